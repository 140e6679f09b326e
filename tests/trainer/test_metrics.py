"""NE, AUC and calibration against hand-checked cases and a brute-force pairwise AUC."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.metrics import (
    auc,
    binary_metrics,
    calibration,
    describe_undefined,
    evaluate,
    log_loss,
    nan_to_none,
    normalized_entropy,
    why_undefined,
)


def brute_force_auc(labels, scores) -> float:
    pos = [s for y, s in zip(labels, scores) if y == 1]
    neg = [s for y, s in zip(labels, scores) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_auc_hand_checked():
    # Pairs (pos, neg): (0.8,0.1) win, (0.8,0.4) win, (0.35,0.1) win, (0.35,0.4) loss -> 3/4.
    assert auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8])) == pytest.approx(0.75)


def test_auc_ties_count_half():
    # One pos and one neg with the same score: 1/2; plus a clear win -> (1 + 0.5) / 2.
    assert auc(np.array([1, 0, 0]), np.array([0.5, 0.5, 0.1])) == pytest.approx(0.75)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 6)), min_size=2, max_size=40))
def test_auc_matches_brute_force(pairs):
    labels = np.array([p[0] for p in pairs])
    scores = np.array([p[1] / 6 for p in pairs])  # few distinct values: many ties
    if labels.min() == labels.max():
        assert math.isnan(auc(labels, scores))
    else:
        assert auc(labels, scores) == pytest.approx(brute_force_auc(labels, scores))


def test_ne_hand_checked():
    labels = np.array([1, 0, 0, 0])
    probs = np.array([0.5, 0.5, 0.5, 0.5])
    # log loss = ln 2; base rate 1/4: H = -(0.25 ln 0.25 + 0.75 ln 0.75).
    entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert log_loss(labels, probs) == pytest.approx(math.log(2))
    assert normalized_entropy(labels, probs) == pytest.approx(math.log(2) / entropy)


def test_ne_of_base_rate_prediction_is_one():
    labels = np.array([1, 0, 0, 1, 0])
    assert normalized_entropy(labels, np.full(5, 0.4)) == pytest.approx(1.0)


def test_calibration_hand_checked():
    assert calibration(np.array([1, 0, 1, 0]), np.array([0.9, 0.3, 0.5, 0.3])) == pytest.approx(2.0 / 2.0)
    assert calibration(np.array([1, 0, 0, 0]), np.array([0.5, 0.5, 0.5, 0.5])) == pytest.approx(2.0)


def test_undefined_metrics_are_nan():
    m = binary_metrics(np.array([0, 0]), np.array([0.1, 0.2]))
    assert math.isnan(m["auc"]) and math.isnan(m["ne"]) and math.isnan(m["calibration"])
    assert m["num_examples"] == 2 and m["base_rate"] == 0.0
    assert m["undefined"] == {
        "auc": "no positive labels among 2 examples; AUC ranks positives against negatives and needs both",
        "ne": "no positive labels among 2 examples; the base rate is 0, so the entropy NE divides by is 0",
        "calibration": "no positive labels among 2 examples; calibration divides the predicted sum by the number "
                       "of positives",
    }


@pytest.mark.parametrize(("labels", "expected"), [
    ([0, 1, 0], {}),
    ([1, 1, 1], {"auc": "no negative labels among 3 examples; AUC ranks positives against negatives and needs both",
                 "ne": "no negative labels among 3 examples; the base rate is 1, so the entropy NE divides by is 0"}),
    ([], {"auc": "no examples", "ne": "no examples", "calibration": "no examples", "base_rate": "no examples"}),
])
def test_why_undefined_names_exactly_the_nan_metrics(labels, expected):
    labels = np.array(labels, dtype=float)
    assert why_undefined(labels) == expected
    m = binary_metrics(labels, np.full(labels.shape, 0.5))
    nan = {k for k in ("auc", "ne", "calibration", "base_rate") if math.isnan(m[k])}
    assert nan == set(expected)


def test_describe_undefined_lists_overall_metrics_only():
    labels = np.array([[0, 0], [0, 0], [1, 0], [0, 0]])  # clicks only in "reels"; no conversion at all
    probs = np.full(labels.shape, 0.3)
    out = evaluate(labels, probs, ["feed", "feed", "reels", "reels"])
    assert describe_undefined(out, scope="eval day 2026-01-03") == [
        "conversion auc is undefined on the eval day 2026-01-03: no positive labels among 4 examples; AUC ranks "
        "positives against negatives and needs both",
        "conversion ne is undefined on the eval day 2026-01-03: no positive labels among 4 examples; the base rate "
        "is 0, so the entropy NE divides by is 0",
        "conversion calibration is undefined on the eval day 2026-01-03: no positive labels among 4 examples; "
        "calibration divides the predicted sum by the number of positives",
    ]
    assert out["click"]["by_domain"]["feed"]["undefined"]["auc"].startswith("no positive labels among 2 examples")
    assert out["click"]["overall"]["undefined"] == {}
    assert describe_undefined({"click": {}}) == []
    safe = nan_to_none(out)
    assert safe["conversion"]["overall"]["auc"] is None and safe["click"]["overall"]["auc"] == out["click"]["overall"]["auc"]
    assert nan_to_none([1.0, math.nan, {"a": (math.nan,)}]) == [1.0, None, {"a": [None]}]


@pytest.mark.parametrize(
    ("labels", "probs", "message"),
    [
        ([0, 1], [0.5], "equal length"),
        ([0, 2], [0.5, 0.5], "0 or 1"),
        ([0, 1], [0.5, 1.5], r"\[0, 1\]"),
        ([0, 1], [0.5, float("nan")], "finite"),
    ],
)
def test_invalid_inputs(labels, probs, message):
    with pytest.raises(ValueError, match=message):
        binary_metrics(np.array(labels, dtype=float), np.array(probs, dtype=float))


def test_evaluate_per_domain():
    labels = np.array([[1, 0], [0, 0], [1, 1], [0, 0]])
    probs = np.array([[0.9, 0.1], [0.2, 0.1], [0.3, 0.6], [0.6, 0.2]])
    domains = ["feed", "feed", "reels", "reels"]
    out = evaluate(labels, probs, domains)
    assert out["click"]["overall"]["auc"] == pytest.approx(brute_force_auc(labels[:, 0], probs[:, 0]))
    assert out["click"]["by_domain"]["feed"]["auc"] == 1.0
    assert out["click"]["by_domain"]["reels"]["auc"] == 0.0
    assert out["conversion"]["by_domain"]["reels"]["calibration"] == pytest.approx(0.8)
    assert out["conversion"]["by_domain"]["feed"]["num_examples"] == 2
    with pytest.raises(ValueError, match="domains"):
        evaluate(labels, probs, domains[:3])
