"""trainer.bootstrap: the paired, stratified bootstrap of a row-weighted mean AUC (or NE) difference, checked
against a direct numpy computation with the documented draw order, and on hand-made cases whose interval is known."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainer.bootstrap import bootstrap_means, difference_interval, paired_bootstrap, weighted_auc
from trainer.metrics import auc, normalized_entropy


def pairwise_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """AUC by its definition: the share of (positive, negative) pairs the positive wins, ties counting 1/2."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    if not len(pos) or not len(neg):
        return math.nan
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0) + 0.5 * (diff == 0)).mean())


def groups(seed: int, sizes=(40, 25, 60), ties: bool = True):
    """Labels and two models' scores per group; rounded scores make ties."""
    rng = np.random.default_rng(seed)
    labels = [(rng.random(n) < 0.3).astype(np.float64) for n in sizes]
    a = [np.round(0.3 * y + 0.7 * rng.random(len(y)), 1 if ties else 12) for y in labels]
    b = [np.round(rng.random(len(y)), 1 if ties else 12) for y in labels]
    return labels, a, b


def test_weighted_auc_is_the_auc_of_the_repeated_rows():
    labels, a, _ = groups(0)
    y, s = labels[0], a[0]
    counts = np.random.default_rng(1).integers(0, 4, len(y))
    assert weighted_auc(y, s) == pytest.approx(pairwise_auc(y, s), abs=1e-12)
    assert weighted_auc(y, s, counts) == pytest.approx(pairwise_auc(np.repeat(y, counts), np.repeat(s, counts)), abs=1e-12)
    assert math.isnan(weighted_auc(np.zeros(5), np.arange(5.0)))


@pytest.mark.parametrize("metric", ["auc", "ne"])
def test_replicates_equal_a_direct_computation_with_the_documented_draws(metric):
    labels, a, b = groups(2)
    estimates, replicates = bootstrap_means(labels, {"a": a, "b": b}, metric=metric, resamples=30, seed=5)
    one = pairwise_auc if metric == "auc" else normalized_entropy
    sizes = np.array([len(y) for y in labels], dtype=np.float64)

    def mean(values):
        values = np.array(values)
        ok = ~np.isnan(values)
        return float(values[ok] @ sizes[ok] / sizes[ok].sum())

    assert estimates["a"] == pytest.approx(mean([one(y, s) for y, s in zip(labels, a)]), abs=1e-12)
    rng = np.random.default_rng(5)  # resample by resample, group by group (trainer/bootstrap.py)
    expected = {"a": [], "b": []}
    for _ in range(30):
        drawn = [rng.integers(0, len(y), size=len(y)) for y in labels]
        for name, scores in (("a", a), ("b", b)):
            expected[name].append(mean([one(y[i], s[i]) for y, s, i in zip(labels, scores, drawn)]))
    np.testing.assert_allclose(replicates["a"], expected["a"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(replicates["b"], expected["b"], rtol=0, atol=1e-12)
    assert np.unique(replicates["a"]).size > 20, "the resamples differ"


def test_auc_estimate_is_the_row_weighted_mean_of_the_metrics_module():
    labels, a, b = groups(3, ties=False)
    interval = paired_bootstrap(labels, a, b, resamples=50, seed=0)
    sizes = [len(y) for y in labels]
    mean_a = sum(n * auc(y, s) for n, y, s in zip(sizes, labels, a)) / sum(sizes)
    mean_b = sum(n * auc(y, s) for n, y, s in zip(sizes, labels, b)) / sum(sizes)
    assert interval.estimate == pytest.approx(mean_a - mean_b, abs=1e-12)
    assert interval.low < interval.estimate < interval.high and interval.resamples == 50


def test_identical_predictions_give_the_interval_zero_zero():
    labels, a, _ = groups(4)
    for metric in ("auc", "ne"):
        interval = paired_bootstrap(labels, a, [s.copy() for s in a], metric=metric, resamples=200, seed=1)
        assert (interval.estimate, interval.low, interval.high) == (0.0, 0.0, 0.0)
        assert not interval.excludes_zero()


def test_a_model_better_on_every_resample_gives_an_interval_above_zero():
    rng = np.random.default_rng(6)
    labels = [np.tile([0.0, 1.0], 30), np.tile([0.0, 0.0, 1.0], 20)]
    perfect = [y * 0.5 + 0.25 for y in labels]  # every positive above every negative: AUC 1 on any resample
    noisy = [rng.random(len(y)) for y in labels]
    estimates, replicates = bootstrap_means(labels, {"a": perfect, "b": noisy}, resamples=300, seed=2)
    assert np.all(replicates["a"] == 1.0) and np.all(replicates["a"] - replicates["b"] > 0)
    interval = difference_interval(estimates, replicates, "a", "b", metric="auc")
    assert interval.low > 0 and interval.excludes_zero()
    assert interval.low == pytest.approx(np.quantile(replicates["a"] - replicates["b"], 0.025), abs=1e-15)


def test_resamples_with_one_class_leave_the_group_out():
    # Group 1 has one positive in 3 rows: (2/3)^3 + (1/3)^3 = 1/3 of its resamples hold one class only, and
    # group 0 holds one class in 2/16 of its resamples: some resamples define one group, a few none.
    labels = [np.array([0.0, 1.0, 0.0, 1.0]), np.array([0.0, 0.0, 1.0])]
    a = [np.array([0.1, 0.9, 0.2, 0.8]), np.array([0.1, 0.2, 0.9])]
    b = [np.array([0.9, 0.1, 0.2, 0.8]), np.array([0.9, 0.2, 0.1])]
    _, replicates = bootstrap_means(labels, {"a": a, "b": b}, resamples=200, seed=0)
    rng = np.random.default_rng(0)
    seen = {"both": 0, "one": 0, "none": 0}
    for r in range(200):
        drawn = [rng.integers(0, len(y), size=len(y)) for y in labels]
        values = [(len(y), pairwise_auc(y[i], s[i])) for y, s, i in zip(labels, a, drawn)]
        defined = [(n, v) for n, v in values if not math.isnan(v)]
        seen[("none", "one", "both")[len(defined)]] += 1
        if defined:
            assert replicates["a"][r] == pytest.approx(sum(n * v for n, v in defined) / sum(n for n, _ in defined))
        else:
            assert math.isnan(replicates["a"][r])
    assert min(seen.values()) > 0, seen
    interval = difference_interval(*bootstrap_means(labels, {"a": a, "b": b}, resamples=200, seed=0), "a", "b",
                                   metric="auc")
    assert interval.resamples == 200 - seen["none"] and interval.requested == 200


@pytest.mark.parametrize(
    ("message", "kwargs"),
    [
        ("resamples >= 1", {"resamples": 0}),
        ("metric must be", {"metric": "logloss"}),
        ("expected 1 groups of scores", {"scores": {"a": []}}),
        ("labels must be 0 or 1", {"labels": [np.array([0.0, 2.0])]}),
        ("scores must be finite", {"scores": {"a": [np.array([0.1, np.nan])]}}),
        ("NE needs probabilities", {"metric": "ne", "scores": {"a": [np.array([0.1, 1.5])]}}),
    ],
)
def test_bad_input_is_refused(message, kwargs):
    args = {"labels": [np.array([0.0, 1.0])], "scores": {"a": [np.array([0.2, 0.7])]}, **kwargs}
    labels, scores = args.pop("labels"), args.pop("scores")
    with pytest.raises(ValueError, match=message):
        bootstrap_means(labels, scores, **args)


def test_confidence_must_be_a_probability():
    with pytest.raises(ValueError, match="0 < confidence < 1"):
        paired_bootstrap([np.array([0.0, 1.0])], [np.array([0.2, 0.7])], [np.array([0.2, 0.7])], confidence=95)


def test_an_empty_group_draws_nothing_and_weighs_nothing():
    labels, a, b = groups(7, sizes=(30, 45))
    empty = np.zeros(0)
    with_empty = bootstrap_means([labels[0], empty, labels[1]], {"a": [a[0], empty, a[1]], "b": [b[0], empty, b[1]]},
                                 resamples=40, seed=9)
    without = bootstrap_means(labels, {"a": a, "b": b}, resamples=40, seed=9)
    assert with_empty[0] == pytest.approx(without[0], abs=1e-12)
    # Equal up to the order of a float sum (the empty group is a zero-weight column of the weighted mean).
    np.testing.assert_allclose(with_empty[1]["a"], without[1]["a"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(with_empty[1]["b"], without[1]["b"], rtol=0, atol=1e-12)
    assert np.unique(with_empty[1]["a"]).size > 30
