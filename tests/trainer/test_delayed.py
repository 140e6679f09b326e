"""Importance weights of early-published examples (trainer.delayed): the weighted label distribution equals
the true one per mode (by exact expectation and by simulating the build's rows), Ktena's FNW weights as the
delta = 1 case, the weighting inputs read from an examples table, and a loss equal to plain BCE for wait rows."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.nn.functional as F

from trainer.delayed import SCHEMES, bce_terms, delayed_labels, first_publications, importance_weights, to_torch


def _w(p: float, y: int, mode: str, share: float) -> float:
    t = lambda v: torch.tensor([[v, v]], dtype=torch.float64)  # noqa: E731
    out = importance_weights(t(p), t(float(y)), torch.tensor([SCHEMES[mode]]), torch.ones(1, 2, dtype=torch.bool),
                             t(share))
    return float(out[0, 0])


@pytest.mark.parametrize("mode", ["fnw", "defer"])
@pytest.mark.parametrize("p,share", [(0.02, 0.3), (0.3, 0.9), (0.7, 0.5), (0.5, 1.0)])
def test_weighted_positive_share_is_the_true_rate(mode, p, share):
    """Expected rows per impression (sequences.publish): in-window positives once, delayed positives once as
    negative and once as positive, negatives once (fnw) or twice (defer)."""
    p_dp = p * share
    pos_rows = p
    neg_rows = (1 - p + p_dp) if mode == "fnw" else (2 * (1 - p) + p_dp)
    pos_mass, neg_mass = pos_rows * _w(p, 1, mode, share), neg_rows * _w(p, 0, mode, share)
    assert pos_mass / (pos_mass + neg_mass) == pytest.approx(p, rel=1e-9)


def test_fnw_with_every_positive_late_is_ktena():
    # Ktena et al. 2019: w+ = 1 + p, w- = (1 - p)(1 + p).
    for p in (0.1, 0.4, 0.8):
        assert _w(p, 1, "fnw", 1.0) == pytest.approx(1 + p)
        assert _w(p, 0, "fnw", 1.0) == pytest.approx((1 - p) * (1 + p))


@pytest.mark.parametrize("mode", ["fnw", "defer"])
def test_simulated_stream_weighted_rate_matches(mode):
    """Simulate the rows the build publishes for impressions with a known p and delay distribution: the
    weighted mean label over the rows is p (within sampling error), the unweighted mean is biased low."""
    rng = np.random.default_rng(0)
    p, late_share, n = 0.3, 0.6, 200_000
    positive = rng.random(n) < p
    late = positive & (rng.random(n) < late_share)
    labels = [(positive & ~late).astype(float),  # the first rows: what the waiting window saw
              np.ones(int(late.sum()))]  # late positives
    if mode == "defer":
        labels.append(np.zeros(int((~positive).sum())))  # real negatives
    y = np.concatenate(labels)
    weights = np.where(y > 0, _w(p, 1, mode, late_share), _w(p, 0, mode, late_share))
    assert abs(np.sum(weights * y) / np.sum(weights) - p) < 0.005
    assert y.mean() < p - 0.04  # fnw: p / (1 + p_dp) = 0.254; defer: p / (2 - p + p_dp) x ... = 0.17


def _table(rows: list[dict]) -> pa.Table:
    base = {"domain": "d1", "label_mode": "defer", "click_open": True, "conversion_open": True,
            "corrects_example_id": None, "correction_task": None, "label_click": 0, "label_conversion": 0}
    return pa.Table.from_pylist([{**base, **r} for r in rows], schema=pa.schema([
        ("domain", pa.string()), ("label_mode", pa.string()), ("click_open", pa.bool_()),
        ("conversion_open", pa.bool_()), ("corrects_example_id", pa.string()), ("correction_task", pa.string()),
        ("label_click", pa.int32()), ("label_conversion", pa.int32())]))


def test_delayed_labels_of_a_table():
    table = _table([
        {"label_click": 1},  # a click within the waiting window
        {},  # no label yet
        {"corrects_example_id": "x", "correction_task": "click", "label_click": 1},  # a late click
        {"corrects_example_id": "y", "correction_task": "conversion"},  # a real negative for conversion
        {"label_mode": "wait", "click_open": False, "conversion_open": False, "label_click": 1},  # final
        {"domain": "d2", "label_mode": "defer", "click_open": False, "conversion_open": True},  # click final
    ])
    got = delayed_labels(table)
    assert got is not None
    assert got.scheme.tolist() == [2, 2, 2, 2, 0, 2]
    assert got.mask.tolist() == [[True, True], [True, True], [True, False], [False, True], [True, True],
                                 [True, True]]
    assert got.biased.tolist() == [[True, True], [True, True], [True, False], [False, True], [False, False],
                                   [False, True]]
    # d1 click: 1 late and 1 early positive -> (1 + 1) / (2 + 2); conversion: no positives -> 1 / 2.
    assert got.share[0].tolist() == pytest.approx([0.5, 0.5])
    assert got.share[2, 0] == pytest.approx(0.5)
    assert first_publications(table).num_rows == 4
    assert delayed_labels(_table([{"label_mode": "wait"}])) is None
    with pytest.raises(ValueError, match="label_mode"):
        delayed_labels(_table([{"label_mode": "later"}]))


def test_loss_terms_plain_for_final_rows_masked_for_corrections():
    logits = torch.tensor([[0.3, -1.0], [2.0, 0.5]])
    labels = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    plain = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    assert torch.equal(bce_terms(logits, labels, None), plain)
    table = _table([{"label_mode": "wait", "click_open": False, "conversion_open": False, "label_click": 1},
                    {"corrects_example_id": "x", "correction_task": "conversion", "label_conversion": 1}])
    delayed = delayed_labels(table)
    assert delayed is not None
    terms = bce_terms(logits, labels, to_torch(delayed))
    assert torch.allclose(terms[0], plain[0])  # a final row: weight 1
    assert float(terms[1, 0]) == 0.0  # a conversion correction carries no click label
    p = float(torch.sigmoid(logits[1, 1]))
    share = float(delayed.share[1, 1])
    assert float(terms[1, 1]) == pytest.approx(float(plain[1, 1]) * (2 - p + p * share), rel=1e-5)


def _early_columns(table: pa.Table, **columns) -> pa.Table:
    n = table.num_rows
    values = {"label_mode": ["defer"] * n, "click_open": [True] * n, "conversion_open": [True] * n,
              "corrects_example_id": [None] * n, "correction_task": [None] * n, **columns}
    types = {"label_mode": pa.string(), "click_open": pa.bool_(), "conversion_open": pa.bool_(),
             "corrects_example_id": pa.string(), "correction_task": pa.string()}
    for name, type_ in types.items():
        table = table.append_column(pa.field(name, type_), pa.array(values[name], type_))
    return table


def click_corrections(early: pa.Table) -> tuple[pa.Table, list[str]]:
    """(late-click correction rows of ``early``'s clicked rows, the example ids they correct): each carries its
    impression's features under ``<example_id>#click``, its windows closed (an :func:`_early_columns` table in)."""
    clicked = early.filter(pa.compute.equal(early.column("label_click"), 1))
    ids = clicked.column("example_id").to_pylist()
    corrections = _early_columns(
        clicked.drop_columns(["label_mode", "click_open", "conversion_open", "corrects_example_id",
                              "correction_task"]).set_column(0, "example_id", pa.array([f"{i}#click" for i in ids])),
        click_open=[False] * len(ids), conversion_open=[False] * len(ids), corrects_example_id=ids,
        correction_task=["click"] * len(ids))
    return corrections, ids


def test_corrections_of_a_quarantined_version_are_trained_on_their_own(tmp_path):
    """examples@1 (first rows) fails validation and is skipped; examples@2 holds only its late-click corrections,
    which carry every feature themselves: they are trained (not evaluated: no impression is new there)."""
    from gemline.config import load_config
    from tests.conftest import trainer_args
    from trainer.continuous import run_once

    from .conftest import mark_quality, synthetic_examples, write_examples
    from .test_continuous import SMALL

    lake = tmp_path / "lake"
    first = _early_columns(synthetic_examples(["2026-01-01"], 200, seed=1))
    quarantined = _early_columns(synthetic_examples(["2026-01-02"], 200, seed=2))
    corrections, ids = click_corrections(quarantined)
    for table, passed in ((first, True), (quarantined, False), (corrections, True)):
        mark_quality(lake, write_examples(lake, table), passed=passed)
    result = run_once(*trainer_args(load_config(overrides={"lake": str(lake), **SMALL})))
    assert [(r["version"], r["rows_trained"], r["evaluated"]) for r in result.versions] == [
        (0, 200, False), (1, 0, False), (2, len(ids), False)]  # examples@1: skipped, nothing trained
    assert len(ids) > 20
