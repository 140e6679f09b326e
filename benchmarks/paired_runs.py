"""Paired bootstrap of progressive click AUC between runs that logged their predictions, on the versions every
one of them evaluated: what ``gemline compare`` reports at its end, for runs cut short or run separately.

``python -m benchmarks.paired_runs NAME=LAKE:RUN_ID [NAME=LAKE:RUN_ID ...] [--resamples 1000]``

Each run must have logged its progressive evaluations to ``teacher_predictions`` (on for GEM; other models with
``--set trainer.log_teacher_predictions=true``); a ``gemline compare`` run's id is in its log and in
``training_metrics``. The lakes must hold the same examples (copies of one lake: the first one's labels are read).
Per version, only final click labels count (:func:`trainer.labels.final_labels` over the version's rows, with the
default 1-day click window), the same rows for every run; the statistic and the interval are
:mod:`trainer.bootstrap`'s (row-weighted mean over versions, 95% paired percentile interval). Prints per-version
AUCs, the means and every pairwise difference.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gemline.lake import read_table
from trainer.bootstrap import bootstrap_means, difference_interval
from trainer.labels import final_labels
from trainer.metrics import auc

CLICK_WINDOW_MS = 86_400_000
"""The build's default click window (``trainer.click_window_ms``): a click label is final once a day has passed."""


def run_predictions(lake: str, run_id: str) -> dict[int, dict[str, float]]:
    """``{examples_version: {example_id: p_click}}`` of ``run_id``'s logged progressive evaluations in ``lake``."""
    table = read_table(lake, "teacher_predictions", columns=["example_id", "run_id", "examples_version", "p_click"])
    if table is None:
        return {}
    table = table.filter(pc.equal(table["run_id"], run_id))
    out: dict[int, dict[str, float]] = {}
    for e, v, p in zip(table["example_id"].to_pylist(), table["examples_version"].to_pylist(),
                       table["p_click"].to_pylist(), strict=True):
        out.setdefault(int(v), {})[e] = float(p)
    return out


def paired_groups(examples: pa.Table, runs: Mapping[str, Mapping[int, Mapping[str, float]]]
                  ) -> tuple[list[int], list[np.ndarray], dict[str, list[np.ndarray]]]:
    """(versions, per-version click labels (n_v,), run -> per-version p_click (n_v,)) on the versions every run
    evaluated and the rows of the first run there, final click labels only, rows sorted by example id.

    Raises:
        KeyError: a run lacks a row the first run has on a shared version, or an example id is not in ``examples``.
    """
    versions = sorted(set.intersection(*(set(r) for r in runs.values()))) if runs else []
    first = next(iter(runs.values()), {})
    labels: list[np.ndarray] = []
    scores: dict[str, list[np.ndarray]] = {name: [] for name in runs}
    for v in versions:
        ids = sorted(first[v])
        rows = examples.filter(pc.is_in(examples["example_id"], pa.array(ids, pa.string())))
        at = {e: i for i, e in enumerate(rows["example_id"].to_pylist())}
        rows = rows.take(pa.array([at[e] for e in ids], pa.int64()))
        final = final_labels(rows, CLICK_WINDOW_MS)[:, 0]
        labels.append(rows["label_click"].to_numpy(zero_copy_only=False).astype(np.float64)[final])
        for name, run in runs.items():
            scores[name].append(np.array([run[v][e] for e in ids], dtype=np.float64)[final])
    return versions, labels, scores


def main(argv: Sequence[str] | None = None) -> None:
    """Print the per-version AUCs, the weighted means and the pairwise differences with 95% intervals."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="NAME=LAKE:RUN_ID")
    parser.add_argument("--resamples", type=int, default=1000)
    args = parser.parse_args(argv)
    runs, lakes = {}, []
    for spec in args.runs:
        name, _, rest = spec.partition("=")
        lake, _, run_id = rest.rpartition(":")
        runs[name] = run_predictions(lake, run_id)
        lakes.append(lake)
    examples = read_table(lakes[0], "examples", columns=["example_id", "event_time_ms", "label_window_closed", "label_click"])
    versions, labels, scores = paired_groups(examples, runs)
    for k, v in enumerate(versions):
        print(f"version {v}: {len(labels[k])} final click labels", {n: round(auc(labels[k], s[k]), 4) for n, s in scores.items()})
    estimates, replicates = bootstrap_means(labels, scores, metric="auc", resamples=args.resamples)
    print(f"row-weighted mean click AUC over versions {versions}:", {n: round(x, 4) for n, x in estimates.items()})
    names = list(runs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            iv = difference_interval(estimates, replicates, a, b, metric="auc")
            print(f"{a} - {b}: {iv.estimate:+.4f} [{iv.low:+.4f}, {iv.high:+.4f}]")


if __name__ == "__main__":
    main()
