"""NE, AUC and calibration against hand-checked cases and a brute-force pairwise AUC."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.metrics import auc, binary_metrics, calibration, evaluate, log_loss, normalized_entropy


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
