"""Offline ranking metrics: NE, AUC and calibration, overall and per domain (plain numpy).

Shape letters: N examples. Labels are 0/1, predictions are probabilities in [0, 1].

- NE (normalized entropy): mean log loss divided by the entropy of the base rate; He et al. 2014,
  "Practical Lessons from Predicting Clicks on Ads at Facebook", §2. Lower is better; 1 means no
  better than predicting the base rate.
- AUC: the Mann-Whitney U statistic from ranks, ties averaged (equals the probability that a
  random positive scores above a random negative, ties counting 1/2).
- calibration: sum of predictions / sum of labels (1 is calibrated).

A metric that is undefined on the given data (AUC with one class, NE with base rate 0 or 1,
calibration with no positives) is NaN rather than an error: a small domain on one eval day
often has no conversions, and that must not stop training. :func:`binary_metrics` says why
under ``"undefined"`` (:func:`why_undefined`), and :func:`describe_undefined` turns that into
lines for people; JSON output writes the NaN as null (:func:`nan_to_none`).
"""

from __future__ import annotations

import math

import numpy as np

TASKS: tuple[str, ...] = ("click", "conversion")
"""Column order of labels and predictions."""

_EPS = 1e-7
"""Predictions are clipped to [eps, 1-eps] inside the log loss."""


def _check(labels: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    labels = np.asarray(labels, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    if labels.ndim != 1 or labels.shape != probs.shape:
        raise ValueError(f"labels and predictions must be 1-D of equal length, got {labels.shape} and {probs.shape}")
    if not np.all((labels == 0) | (labels == 1)):
        raise ValueError(f"labels must be 0 or 1, got values {np.unique(labels)[:5].tolist()}")
    if not np.all(np.isfinite(probs)) or np.any(probs < 0) or np.any(probs > 1):
        raise ValueError("predictions must be finite probabilities in [0, 1]; apply a sigmoid to logits first")
    return labels, probs


def log_loss(labels: np.ndarray, probs: np.ndarray) -> float:
    """Mean binary cross-entropy in nats of (N,) labels and (N,) probabilities; NaN when N = 0.

    Raises:
        ValueError: shapes differ, labels not 0/1, or predictions outside [0, 1].
    """
    labels, probs = _check(labels, probs)
    if labels.size == 0:
        return math.nan
    p = np.clip(probs, _EPS, 1 - _EPS)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))


def normalized_entropy(labels: np.ndarray, probs: np.ndarray) -> float:
    """NE = log loss / H(base rate), He et al. 2014 §2; NaN when the base rate is 0 or 1 or N = 0.

    Raises:
        ValueError: as :func:`log_loss`.
    """
    labels, probs = _check(labels, probs)
    if labels.size == 0:
        return math.nan
    base = float(labels.mean())
    if base <= 0 or base >= 1:
        return math.nan
    entropy = -(base * math.log(base) + (1 - base) * math.log(1 - base))
    return log_loss(labels, probs) / entropy


def _average_ranks(scores: np.ndarray) -> np.ndarray:
    """1-based ranks of (N,) scores, tied scores sharing the mean of their ranks."""
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    # Start of each run of equal scores in sorted order.
    starts = np.flatnonzero(np.concatenate([[True], sorted_scores[1:] != sorted_scores[:-1]]))
    ends = np.concatenate([starts[1:], [len(scores)]])
    run_rank = (starts + 1 + ends) / 2.0  # mean of ranks starts+1 .. ends
    ranks = np.empty(len(scores), dtype=np.float64)
    ranks[order] = np.repeat(run_rank, ends - starts)
    return ranks


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC from ranks with ties averaged; NaN when only one class is present.

    ``scores`` may be any finite reals (probabilities or logits) of shape (N,).

    Raises:
        ValueError: shapes differ, labels not 0/1, or non-finite scores.
    """
    labels = np.asarray(labels, dtype=np.float64)
    scores = np.asarray(scores, dtype=np.float64)
    if labels.ndim != 1 or labels.shape != scores.shape:
        raise ValueError(f"labels and scores must be 1-D of equal length, got {labels.shape} and {scores.shape}")
    if not np.all((labels == 0) | (labels == 1)):
        raise ValueError(f"labels must be 0 or 1, got values {np.unique(labels)[:5].tolist()}")
    if not np.all(np.isfinite(scores)):
        raise ValueError("scores must be finite")
    num_pos = int(labels.sum())
    num_neg = labels.size - num_pos
    if num_pos == 0 or num_neg == 0:
        return math.nan
    rank_sum = float(_average_ranks(scores)[labels == 1].sum())
    return (rank_sum - num_pos * (num_pos + 1) / 2.0) / (num_pos * num_neg)


def calibration(labels: np.ndarray, probs: np.ndarray) -> float:
    """sum(predictions) / sum(labels); NaN when there is no positive label.

    Raises:
        ValueError: as :func:`log_loss`.
    """
    labels, probs = _check(labels, probs)
    positives = float(labels.sum())
    if positives == 0:
        return math.nan
    return float(probs.sum()) / positives


def why_undefined(labels: np.ndarray) -> dict[str, str]:
    """Why each metric of :func:`binary_metrics` is undefined (NaN) on (N,) 0/1 ``labels``.

    Returns ``{metric: reason}`` for ``auc``, ``ne``, ``calibration`` and ``base_rate`` where they are
    undefined; empty when every metric is defined (both classes present).
    """
    labels = np.asarray(labels, dtype=np.float64)
    n = int(labels.size)
    if n == 0:
        reason = "no examples"
        return {"auc": reason, "ne": reason, "calibration": reason, "base_rate": reason}
    num_pos = int(labels.sum())
    if 0 < num_pos < n:
        return {}
    if num_pos == 0:
        missing = f"no positive labels among {n} examples"
        return {"auc": f"{missing}; AUC ranks positives against negatives and needs both",
                "ne": f"{missing}; the base rate is 0, so the entropy NE divides by is 0",
                "calibration": f"{missing}; calibration divides the predicted sum by the number of positives"}
    missing = f"no negative labels among {n} examples"
    return {"auc": f"{missing}; AUC ranks positives against negatives and needs both",
            "ne": f"{missing}; the base rate is 1, so the entropy NE divides by is 0"}


def binary_metrics(labels: np.ndarray, probs: np.ndarray) -> dict:
    """``auc``, ``ne``, ``calibration``, ``num_examples``, ``base_rate`` of one task on (N,) arrays,
    and ``undefined``: ``{metric: reason}`` for each of them that is NaN (:func:`why_undefined`).

    Raises:
        ValueError: as :func:`log_loss`.
    """
    labels, probs = _check(labels, probs)
    return {
        "auc": auc(labels, probs),
        "ne": normalized_entropy(labels, probs),
        "calibration": calibration(labels, probs),
        "num_examples": int(labels.size),
        "base_rate": float(labels.mean()) if labels.size else math.nan,
        "undefined": why_undefined(labels),
    }


def describe_undefined(metrics: dict, *, scope: str = "eval set") -> list[str]:
    """One line per undefined overall metric of :func:`evaluate`'s output, e.g. ``"click auc is
    undefined on the eval set: no positive labels among 536 examples; AUC ranks ..."``.

    Per-domain metrics are left out (a small domain without conversions is common); their reasons
    stay under each domain's ``undefined`` key. Tasks or metrics missing from ``metrics`` are skipped.
    """
    lines = []
    for task in TASKS:
        overall = (metrics.get(task) or {}).get("overall") or {}
        for name, reason in (overall.get("undefined") or {}).items():
            if name != "base_rate":
                lines.append(f"{task} {name} is undefined on the {scope}: {reason}")
    return lines


def nan_to_none(value):
    """``value`` with every NaN float inside dicts and lists replaced by None (JSON has no NaN)."""
    if isinstance(value, dict):
        return {k: nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [nan_to_none(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def evaluate(labels: np.ndarray, probs: np.ndarray, domains: np.ndarray | list[str], final: np.ndarray | None = None) -> dict:
    """Metrics of both tasks, overall and per domain, each task on its final labels only.

    Args:
        labels: (N, 2) 0/1, columns TASKS.
        probs: (N, 2) probabilities, columns TASKS.
        domains: (N,) domain names.
        final: (N, 2) bool, the labels to judge (trainer.labels.final_labels); None: every label.

    Returns:
        ``{task: {"overall": metrics, "by_domain": {domain: metrics}}}`` with metrics as in
        :func:`binary_metrics`.

    Raises:
        ValueError: shapes disagree.
    """
    labels = np.asarray(labels)
    probs = np.asarray(probs)
    domains = np.asarray(domains, dtype=object)
    if labels.shape != probs.shape or labels.ndim != 2 or labels.shape[1] != len(TASKS):
        raise ValueError(f"labels and probs must both be (N, {len(TASKS)}), got {labels.shape} and {probs.shape}")
    if domains.shape != (labels.shape[0],):
        raise ValueError(f"domains must be ({labels.shape[0]},), got {domains.shape}")
    final = np.ones(labels.shape, dtype=bool) if final is None else np.asarray(final, dtype=bool)
    if final.shape != labels.shape:
        raise ValueError(f"final must be {labels.shape} like labels, got {final.shape}")
    out: dict = {}
    for j, task in enumerate(TASKS):
        y, p, d_of, keep = labels[:, j], probs[:, j], domains, final[:, j]
        out[task] = {
            "overall": binary_metrics(y[keep], p[keep]),
            "by_domain": {
                str(d): binary_metrics(y[keep & (d_of == d)], p[keep & (d_of == d)]) for d in sorted(set(domains.tolist()))
            },
        }
    return out
