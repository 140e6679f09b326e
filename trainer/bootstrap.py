"""Paired bootstrap intervals of the difference of two models' AUC (or NE) on the same examples.

Shape letters: K groups (examples versions, each one progressive evaluation), n_k examples of group k,
R resamples, C resamples handled at once.

The statistic is the **row-weighted mean over groups** of a per-group metric, the way ``gemline compare``
summarises progressive validation: ``mean(m) = sum_k n_k * m_k / sum_k n_k`` over the groups where ``m_k`` is
defined (both classes present). The difference is ``mean(m_a) - mean(m_b)`` for models a and b scored on the
same rows.

Method: the paired, stratified nonparametric bootstrap with the percentile interval (Efron & Tibshirani, "An
Introduction to the Bootstrap", Chapman & Hall 1993, ch. 6 for the bootstrap of a statistic, ch. 13 for
percentile intervals). Each resample draws, in every group, ``n_k`` example indices uniformly with
replacement; **the same indices serve both models** (paired: the rows' difficulty cancels, as in the
paired bootstrap test of two ROC curves, e.g. pROC's ``roc.test(method="bootstrap")``, Robin et al. 2011),
and groups are resampled separately (stratified: every resample keeps the evaluation's K versions and their
sizes). A group whose resample holds one class only has no AUC for either model (same labels) and is left
out of that resample's mean for both; a resample with no defined group is dropped (counted in
:attr:`BootstrapInterval.resamples`). The interval is the (1-c)/2 and (1+c)/2 quantiles of the R differences.

Draw order, so a result can be reproduced: ``rng = numpy.random.default_rng(seed)``; for each resample in
turn, for each non-empty group in turn, ``rng.integers(0, n_k, size=n_k)``.

**Several training seeds** (:func:`seeded_difference_interval`): each model trained S times (seeds s = 1..S)
and every run scored on the same rows. The statistic is the mean over seeds of the per-seed difference,
``mean_s [mean(m_a,s) - mean(m_b,s)]``. Seed and row are crossed factors (every seed scores every row), so
each resample draws both independently, the pigeonhole bootstrap for crossed designs (Owen, "The pigeonhole
bootstrap", Annals of Applied Statistics 1(2), 2007): the rows as above, the same indices for every model and
every seed, and S seed indices uniformly with replacement (``numpy.random.default_rng((seed, 1))``, one
``integers(0, S, size=S)`` per resample, in resample order); the resample's value is the mean over the drawn
seeds of their differences on the drawn rows. The interval so spans training noise (which seed) as well as
evaluation noise (which rows); Owen shows this resampling is mildly conservative. With S = 1 it is the
single-seed interval above, draw for draw. With few seeds the seed draw is coarse: at S = 3 all three draws
land on the worst seed in 1/27 of the resamples, so the lower end of a 95% interval sits near the worst seed's
difference; an interval above 0 then says every seed's difference is, beyond row noise.

A resample is evaluated without sorting again: each model's scores are ranked once into tie groups, and a
resample's AUC is a ``bincount`` of its drawn rows by (tie group, label) (:func:`weighted_auc` is the same
computation with given multiplicities).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Metric = Literal["auc", "ne"]

_EPS = 1e-7
"""Predictions are clipped to [eps, 1-eps] in the log loss, as in :mod:`trainer.metrics`."""

_CHUNK_CELLS = 4_000_000
"""Multiplicity cells (resamples x rows) held at once: ~32 MB of float64 per array."""


@dataclass(frozen=True)
class BootstrapInterval:
    """A percentile bootstrap interval of ``mean(metric of a) - mean(metric of b)`` (module docstring).

    Attributes:
        metric: "auc" or "ne".
        estimate: the difference on the evaluated rows themselves (no resampling); NaN if undefined.
        low, high: the interval's ends; NaN when no resample was defined.
        confidence: e.g. 0.95.
        resamples: resamples with a defined difference (of ``requested``).
        requested: resamples drawn.
        seed: the numpy seed of the draws.
    """

    metric: str
    estimate: float
    low: float
    high: float
    confidence: float
    resamples: int
    requested: int
    seed: int

    def excludes_zero(self) -> bool:
        """True when the whole interval lies on one side of 0 (the lead is not explained by resampling noise)."""
        return bool(self.low > 0 or self.high < 0)


def _check(labels: np.ndarray, scores: np.ndarray, name: str) -> None:
    if labels.ndim != 1 or scores.shape != labels.shape:
        raise ValueError(f"{name}: expected 1-D labels and scores of one length, got {labels.shape} and {scores.shape}")
    if not np.all((labels == 0) | (labels == 1)):
        raise ValueError(f"{name}: labels must be 0 or 1, got values {np.unique(labels)[:5].tolist()}")
    if not np.all(np.isfinite(scores)):
        raise ValueError(f"{name}: scores must be finite")


class _Ranked:
    """One model's scores on one group, ranked once: each row's tie group (runs of equal scores, numbered in
    ascending score order), so a resample's AUC is one ``bincount`` over the drawn rows, without sorting."""

    def __init__(self, labels: np.ndarray, scores: np.ndarray) -> None:
        order = np.argsort(scores, kind="mergesort")
        ordered = scores[order]
        new_run = np.concatenate([[True], ordered[1:] != ordered[:-1]]) if len(ordered) else np.zeros(0, bool)
        self.num_groups = int(new_run.sum())
        group = np.empty(len(scores), dtype=np.int64)
        group[order] = np.cumsum(new_run) - 1
        self.key = 2 * group + labels.astype(np.int64)  # (tie group, label) of each row

    def auc(self, drawn: np.ndarray) -> np.ndarray:
        """(C,) AUC of each resample, row r drawing rows ``drawn[r]`` (C, m) (repeats count); NaN with one class."""
        count, cells = drawn.shape[0], 2 * self.num_groups
        keys = self.key[drawn] + cells * np.arange(count, dtype=np.int64)[:, None]
        tally = np.bincount(keys.ravel(), minlength=count * cells).reshape(count, self.num_groups, 2).astype(np.float64)
        neg_g, pos_g = tally[..., 0], tally[..., 1]
        neg_below = np.cumsum(neg_g, axis=1) - neg_g
        # A positive beats the negatives of lower score and ties with those of its own score (counted 1/2).
        wins = (pos_g * (neg_below + 0.5 * neg_g)).sum(axis=1)
        num_pos, num_neg = pos_g.sum(axis=1), neg_g.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            out = wins / (num_pos * num_neg)
        return np.where((num_pos > 0) & (num_neg > 0), out, np.nan)


def weighted_auc(labels: np.ndarray, scores: np.ndarray, counts: np.ndarray | None = None) -> float:
    """ROC AUC of (n,) scores when row i counts ``counts[i]`` times (ties count 1/2); NaN with one class.

    This is :func:`trainer.metrics.auc` on the rows repeated that many times.

    Raises:
        ValueError: shapes differ, labels not 0/1, non-finite scores, or counts that are not non-negative integers.
    """
    labels, scores = np.asarray(labels, dtype=np.float64), np.asarray(scores, dtype=np.float64)
    _check(labels, scores, "weighted_auc")
    c = np.ones(labels.shape, dtype=np.int64) if counts is None else np.asarray(counts)
    if c.shape != labels.shape or not np.issubdtype(c.dtype, np.integer) or np.any(c < 0):
        raise ValueError(f"weighted_auc: expected {labels.shape} non-negative integer counts, got {c.dtype} {c.shape}")
    if labels.size == 0:
        return math.nan
    return float(_Ranked(labels, scores).auc(np.repeat(np.arange(labels.size), c)[None, :])[0])


def _log_losses(labels: np.ndarray, probs: np.ndarray) -> np.ndarray:
    p = np.clip(probs, _EPS, 1 - _EPS)
    return -(labels * np.log(p) + (1 - labels) * np.log(1 - p))


def _ne(drawn: np.ndarray, labels: np.ndarray, losses: np.ndarray) -> np.ndarray:
    """(C,) NE (He et al. 2014, §2) of each resample ``drawn`` (C, m); NaN where its base rate is 0 or 1."""
    size = drawn.shape[1]
    base = labels[drawn].sum(axis=1) / size
    with np.errstate(invalid="ignore", divide="ignore"):
        entropy = -(base * np.log(base) + (1 - base) * np.log(1 - base))
        out = losses[drawn].sum(axis=1) / size / entropy
    return np.where((base > 0) & (base < 1), out, np.nan)


def _weighted_means(per_group: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """(C,) row-weighted mean over groups of (C, K) values, skipping NaN; NaN where all K are NaN."""
    defined = ~np.isnan(per_group)
    weight = defined * sizes[None, :]
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(defined, per_group, 0.0) @ sizes / weight.sum(axis=1)
    return np.where(defined.any(axis=1), out, np.nan)


def bootstrap_means(labels: Sequence[np.ndarray], scores: Mapping[str, Sequence[np.ndarray]], *,
                    metric: Metric = "auc", resamples: int = 1000,
                    seed: int = 0) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Each model's row-weighted mean ``metric`` over groups on the data, and its ``resamples`` bootstrap
    replicates (R,) float64 drawn with the **same** indices for every model (NaN where a resample defines no
    group). Module docstring: the statistic, the method and the draw order.

    Args:
        labels: per group, (n_k,) 0/1 labels.
        scores: model name -> per group, (n_k,) probabilities of that model on the same rows.
        metric: "auc" (higher is better) or "ne" (normalized entropy, lower is better).
        resamples: R >= 1.
        seed: numpy seed of the draws.

    Raises:
        ValueError: group counts or lengths disagree, labels not 0/1, non-finite scores (or, for NE, scores
            outside [0, 1]), ``resamples < 1``, or an unknown metric.
    """
    if metric not in ("auc", "ne"):
        raise ValueError(f"bootstrap: metric must be 'auc' or 'ne', got {metric!r}")
    if resamples < 1:
        raise ValueError(f"bootstrap: expected resamples >= 1, got {resamples}")
    ys = [np.asarray(y, dtype=np.float64) for y in labels]
    evaluators: dict[str, list[Any]] = {}
    for model, groups in scores.items():
        if len(groups) != len(ys):
            raise ValueError(f"bootstrap: expected {len(ys)} groups of scores for {model}, got {len(groups)}")
        evaluators[model] = []
        for k, (y, s) in enumerate(zip(ys, groups, strict=True)):
            s = np.asarray(s, dtype=np.float64)
            _check(y, s, f"bootstrap group {k} ({model})")
            if metric == "ne" and np.any((s < 0) | (s > 1)):
                raise ValueError(f"bootstrap group {k} ({model}): NE needs probabilities in [0, 1]")
            if not len(y):
                evaluators[model].append(None)
            elif metric == "auc":
                evaluators[model].append(_Ranked(y, s).auc)
            else:
                evaluators[model].append(functools.partial(_ne, labels=y, losses=_log_losses(y, s)))
    sizes = np.array([len(y) for y in ys], dtype=np.float64)

    def means(drawn: list[np.ndarray], count: int) -> dict[str, np.ndarray]:
        out = {}
        for model, evs in evaluators.items():
            per_group = np.full((count, len(ys)), np.nan)
            for k, ev in enumerate(evs):
                if ev is not None:
                    per_group[:, k] = ev(drawn[k])
            out[model] = _weighted_means(per_group, sizes)
        return out

    estimates = {m: float(v[0]) for m, v in means([np.arange(len(y))[None, :] for y in ys], 1).items()}
    replicates = {m: np.empty(resamples) for m in evaluators}
    rng = np.random.default_rng(seed)
    chunk = max(1, min(resamples, _CHUNK_CELLS // max(int(sizes.sum()), 1)))
    for first in range(0, resamples, chunk):
        count = min(chunk, resamples - first)
        drawn = [np.empty((count, len(y)), dtype=np.int64) for y in ys]
        for r in range(count):  # the documented draw order: resample by resample, group by group
            for k, y in enumerate(ys):
                if len(y):  # an empty group draws nothing and has no metric
                    drawn[k][r] = rng.integers(0, len(y), size=len(y))
        for model, values in means(drawn, count).items():
            replicates[model][first: first + count] = values
    return estimates, replicates


def difference_interval(estimates: Mapping[str, float], replicates: Mapping[str, np.ndarray], a: str, b: str, *,
                        metric: Metric, confidence: float = 0.95, seed: int = 0) -> BootstrapInterval:
    """The percentile interval of ``mean(metric of a) - mean(metric of b)`` from :func:`bootstrap_means`'s output.

    Raises:
        ValueError: ``confidence`` not in (0, 1); KeyError: ``a`` or ``b`` not among the models.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"bootstrap: expected 0 < confidence < 1, got {confidence}")
    diffs = replicates[a] - replicates[b]
    defined = diffs[~np.isnan(diffs)]
    if defined.size:
        low, high = (float(q) for q in np.quantile(defined, [(1 - confidence) / 2, (1 + confidence) / 2]))
    else:
        low = high = math.nan
    return BootstrapInterval(metric=metric, estimate=estimates[a] - estimates[b], low=low, high=high,
                             confidence=confidence, resamples=int(defined.size), requested=len(diffs), seed=seed)


@dataclass(frozen=True)
class SeededInterval(BootstrapInterval):
    """A :class:`BootstrapInterval` of the mean over training seeds of a per-seed difference (module docstring,
    "Several training seeds"); ``estimate`` is the mean of ``per_seed``.

    Attributes:
        per_seed: the difference of each seed's runs on the evaluated rows, in the order given (NaN if undefined).
    """

    per_seed: tuple[float, ...] = ()


def seeded_difference_interval(estimates: Mapping[str, float], replicates: Mapping[str, np.ndarray],
                               a: Sequence[str], b: Sequence[str], *, metric: Metric, confidence: float = 0.95,
                               seed: int = 0) -> SeededInterval:
    """The pigeonhole-bootstrap interval of ``mean_s [mean(metric of a[s]) - mean(metric of b[s])]`` over S seeds.

    Args:
        estimates, replicates: of :func:`bootstrap_means` over every run (one draw of rows shared by all of them).
        a, b: the run names of the two models, one per seed, in seed order (``a[s]`` and ``b[s]`` trained at seed s).
        metric, confidence: as :func:`difference_interval`.
        seed: the numpy seed of :func:`bootstrap_means`'s row draws; the seed draws use ``(seed, 1)``.

    Raises:
        ValueError: ``a`` and ``b`` empty or of different lengths, or ``confidence`` not in (0, 1);
            KeyError: a run not among the replicates.
    """
    if not a or len(a) != len(b):
        raise ValueError(f"bootstrap: expected one run of each model per seed, got {len(a)} and {len(b)}")
    if not 0 < confidence < 1:
        raise ValueError(f"bootstrap: expected 0 < confidence < 1, got {confidence}")
    per_seed = np.array([estimates[x] - estimates[y] for x, y in zip(a, b, strict=True)], dtype=np.float64)
    diffs = np.stack([replicates[x] - replicates[y] for x, y in zip(a, b, strict=True)], axis=1)  # (R, S)
    count, seeds = diffs.shape
    drawn = np.random.default_rng((seed, 1)).integers(0, seeds, size=(count, seeds))
    # A resample's rows either define every run's metric or none (same labels), so NaN marks whole resamples.
    values = diffs[np.arange(count)[:, None], drawn].mean(axis=1)
    defined = values[~np.isnan(values)]
    if defined.size:
        low, high = (float(q) for q in np.quantile(defined, [(1 - confidence) / 2, (1 + confidence) / 2]))
    else:
        low = high = math.nan
    estimate = float(np.nanmean(per_seed)) if not np.all(np.isnan(per_seed)) else math.nan
    return SeededInterval(metric=metric, estimate=estimate, low=low, high=high, confidence=confidence,
                          resamples=int(defined.size), requested=count, seed=seed,
                          per_seed=tuple(float(d) for d in per_seed))


def paired_bootstrap(labels: Sequence[np.ndarray], scores_a: Sequence[np.ndarray], scores_b: Sequence[np.ndarray],
                     *, metric: Metric = "auc", resamples: int = 1000, confidence: float = 0.95,
                     seed: int = 0) -> BootstrapInterval:
    """The percentile interval of ``mean(metric of a) - mean(metric of b)`` for two models scored on the same
    rows (:func:`bootstrap_means` with two models, then :func:`difference_interval`).

    Raises:
        ValueError: as :func:`bootstrap_means` and :func:`difference_interval`.
    """
    estimates, replicates = bootstrap_means(labels, {"a": scores_a, "b": scores_b}, metric=metric,
                                            resamples=resamples, seed=seed)
    return difference_interval(estimates, replicates, "a", "b", metric=metric, confidence=confidence, seed=seed)
