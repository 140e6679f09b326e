"""What click and conversion AUC the progressive protocol's rows allow: a converged logistic regression as reference.

``python -m benchmarks.progressive_reference --lake L [--l2 1.0]``

For each ``examples`` commit from the second on (first rows, told apart by ``published_watermark_ms`` as in
``benchmarks.progressive_split``), a logistic regression on the trainer's dense features (``encode_for``: the
normalized counters the models get, no ids) is fitted to convergence on every earlier commit's rows whose label
is final (``trainer.labels.final_labels``) and scores this commit's final rows, as ``gemline compare`` judges them.
Fitted by Newton's method (iteratively reweighted least squares; Hastie, Tibshirani & Friedman, *The Elements
of Statistical Learning*, 2nd ed., §4.4.1) with an L2 penalty ``--l2`` on the weights (not the intercept).
Prints per commit and task the rows, positives and AUC, then the row-weighted mean over commits (compare's
statistic). Unlike the trainer's models it takes as many steps as converging needs: the gap to them is what
one pass of Adam per version leaves on the table.
"""

from __future__ import annotations

import argparse

import numpy as np
import pyarrow.compute as pc

from gemline.config import load_config
from gemline.lake import Lake, read_table
from trainer.data import encode_for, fit_normalizer, pointer_history
from trainer.metrics import TASKS, auc


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float, iterations: int = 30) -> np.ndarray:
    """Weights (F + 1,) float64, intercept first, of the L2-penalized logistic regression of ``y`` (N,) 0/1 on
    ``x`` (N, F), by Newton's method from zero (the penalty keeps the Hessian invertible on separable data)."""
    z = np.c_[np.ones(len(x)), x.astype(np.float64)]
    penalty = np.full(z.shape[1], l2)
    penalty[0] = 0.0
    w = np.zeros(z.shape[1])
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-(z @ w)))
        grad = z.T @ (p - y) + penalty * w
        hessian = (z * (p * (1 - p))[:, None]).T @ z + np.diag(penalty) + 1e-9 * np.eye(len(w))
        step = np.linalg.solve(hessian, grad)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return w


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lake", required=True)
    parser.add_argument("--l2", type=float, default=1.0, help="L2 penalty on the weights (not the intercept)")
    args = parser.parse_args(argv)
    tc = load_config().trainer
    lake = Lake(args.lake)
    table = read_table(lake, "examples")
    if table is None:
        raise SystemExit(f"no examples table under {args.lake}")
    first = table.filter(pc.is_null(table["corrects_example_id"]))
    marks = np.asarray(first["published_watermark_ms"].to_numpy(zero_copy_only=False))
    commits = sorted(set(marks.tolist()))
    pointers = pointer_history(lake, first)
    for k, task in enumerate(TASKS):
        total = weighted = 0.0
        for i, mark in enumerate(commits[1:], start=2):
            train_rows, eval_rows = first.filter(pc.less(first["published_watermark_ms"], mark)), first.filter(
                pc.equal(first["published_watermark_ms"], mark))
            normalizer = fit_normalizer(train_rows)
            train, scored = encode_for(train_rows, tc, normalizer, pointers), encode_for(eval_rows, tc, normalizer, pointers)
            fit_mask = train.final[:, k] if train.final is not None else np.ones(len(train.labels), bool)
            eval_mask = scored.final[:, k] if scored.final is not None else np.ones(len(scored.labels), bool)
            y_train, y_eval = train.labels[fit_mask, k], scored.labels[eval_mask, k]
            if y_train.sum() == 0 or y_eval.sum() in (0, len(y_eval)):
                print(f"{task} commit {i}: no positives (or no negatives) to fit or judge; skipped")
                continue
            w = fit_logistic(train.dense[fit_mask], y_train, args.l2)
            value = auc(y_eval, np.c_[np.ones(int(eval_mask.sum())), scored.dense[eval_mask]] @ w)
            print(f"{task} commit {i}: judged {len(y_eval)} rows ({int(y_eval.sum())} positive), fitted on "
                  f"{len(y_train)} ({int(y_train.sum())}): AUC {value:.4f}")
            total += len(y_eval)
            weighted += value * len(y_eval)
        if total:
            print(f"{task}: row-weighted mean AUC {weighted / total:.4f} over {int(total)} rows")


if __name__ == "__main__":
    main()
