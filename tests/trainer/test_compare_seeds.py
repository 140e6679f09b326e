"""gemline compare --seeds: the seed-and-row (pigeonhole) bootstrap on hand cases, the report's per-seed lists."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.bootstrap import bootstrap_means, difference_interval, seeded_difference_interval
from trainer.compare import compare_json, progressive_summary, seeded_summary


def _predictions(version: int, labels: np.ndarray, probs: np.ndarray):
    from trainer.continuous import ProgressivePredictions

    both = np.stack([labels, labels], axis=1).astype(np.float64)
    return ProgressivePredictions(version, both, np.stack([probs, probs], axis=1),
                                  np.array(["feed"] * len(labels), dtype=object))


def _labels() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.permutation(np.r_[np.ones(30), np.zeros(50)]), rng.permutation(np.r_[np.ones(20), np.zeros(40)])]


def test_seeds_and_rows_resampled_on_a_hand_case():
    """Seed 0: a ranks perfectly (AUC 1), b scores a constant (0.5): difference 0.5 on every resample of rows.
    Seed 1: both constant: difference 0. The mean over seeds is 0.25; drawing 2 seeds with replacement gives
    0, 0.25 or 0.5 with probabilities 1/4, 1/2, 1/4, so the 95% interval is [0, 0.5], and the per-seed
    differences are [0.5, 0]."""
    labels = _labels()
    perfect = [np.where(y == 1, 0.9, 0.1) for y in labels]
    constant = [np.full(len(y), 0.3) for y in labels]
    scores = {"a@0": perfect, "b@0": constant, "a@1": constant, "b@1": constant}
    estimates, replicates = bootstrap_means(labels, scores, metric="auc", resamples=2000, seed=7)
    iv = seeded_difference_interval(estimates, replicates, ["a@0", "a@1"], ["b@0", "b@1"], metric="auc", seed=7)
    assert iv.per_seed == (0.5, 0.0)
    assert iv.estimate == 0.25 and (iv.low, iv.high) == (0.0, 0.5)
    assert iv.resamples == iv.requested == 2000
    # The replicate values themselves, recomputed from the documented seed draw.
    drawn = np.random.default_rng((7, 1)).integers(0, 2, size=(2000, 2))
    expected = np.where(drawn == 0, 0.5, 0.0).mean(axis=1)
    shares = [np.mean(expected == v) for v in (0.0, 0.25, 0.5)]
    assert shares == pytest.approx([0.25, 0.5, 0.25], abs=0.03)


def test_one_seed_is_the_paired_interval_draw_for_draw():
    rng = np.random.default_rng(1)
    labels = _labels()
    scores = {"a": [np.clip(y * 0.3 + rng.random(len(y)) * 0.7, 0, 1) for y in labels],
              "b": [rng.random(len(y)) for y in labels]}
    for metric in ("auc", "ne"):
        estimates, replicates = bootstrap_means(labels, scores, metric=metric, resamples=300, seed=3)
        single = difference_interval(estimates, replicates, "a", "b", metric=metric, seed=3)
        seeded = seeded_difference_interval(estimates, replicates, ["a"], ["b"], metric=metric, seed=3)
        assert (seeded.estimate, seeded.low, seeded.high, seeded.resamples) == \
            (single.estimate, single.low, single.high, single.resamples)
        assert seeded.per_seed == (single.estimate,)
    with pytest.raises(ValueError, match="one run of each model per seed"):
        seeded_difference_interval(estimates, replicates, ["a"], [], metric="ne")


def test_seeded_summary_means_per_seed_values_and_json():
    """Two versions, two seeds: a perfect at seed 0 and reversed (AUC 0) at seed 1, b constant at both: a's mean
    AUC is 0.5 (mean of 1 and 0), the difference 0 with per-seed [+0.5, -0.5], and its interval spans both."""
    labels = _labels()
    perfect = [np.where(y == 1, 0.9, 0.1) for y in labels]
    reversed_ = [np.where(y == 1, 0.1, 0.9) for y in labels]
    constant = [np.full(len(y), 0.3) for y in labels]

    def runs(groups):
        return {v: _predictions(v, y, p) for v, (y, p) in enumerate(zip(labels, groups, strict=True), 1)}

    by_seed = {0: {"a": runs(perfect), "b": runs(constant)}, 1: {"a": runs(reversed_), "b": runs(constant)}}
    versions, rows, differences, per_version = seeded_summary(by_seed, resamples=400, seed=2)
    assert versions == [1, 2]
    click = {r["model"]: r for r in rows if r["task"] == "click"}
    assert click["a"]["auc"] == 0.5 and click["a"]["per_seed_auc"] == [1.0, 0.0] and click["a"]["seeds"] == [0, 1]
    assert click["b"]["auc"] == 0.5 and click["a"]["rows"] == 140
    assert per_version["a"]["click"][0]["per_seed_auc"] == [1.0, 0.0] and per_version["a"]["click"][0]["auc"] == 0.5
    d = next(d for d in differences if d["task"] == "click")
    assert d["auc"]["estimate"] == 0.0 and d["auc"]["per_seed"] == [0.5, -0.5]
    assert (d["auc"]["low"], d["auc"]["high"]) == (-0.5, 0.5)
    summary = compare_json(rows, differences)
    assert summary["seeds"] == [0, 1] and summary["models"]["a"]["per_seed_auc"] == [1.0, 0.0]
    assert summary["a_minus_b_auc"] == {"mean": 0.0, "ci95": [-0.5, 0.5], "per_seed": [0.5, -0.5]}

    # One seed through progressive_summary: no per-seed lists, the same numbers as that seed alone.
    _, rows0, differences0, _ = progressive_summary(by_seed[0], resamples=400, seed=2)
    d0 = next(d for d in differences0 if d["task"] == "click")
    assert "per_seed" not in d0["auc"] and d0["auc"]["estimate"] == 0.5
    assert "per_seed_auc" not in rows0[0] and "seeds" not in compare_json(rows0, differences0)

    # Runs that scored different rows cannot be paired.
    by_seed[1]["b"] = {v: _predictions(v, y[::-1], p) for v, (y, p) in enumerate(zip(labels, constant), 1)}
    with pytest.raises(ValueError, match=r"b \(seed 1\) and a \(seed 0\) were evaluated on different rows"):
        seeded_summary(by_seed, resamples=10)


def test_compare_trains_every_model_once_per_seed(tmp_path):
    """``run_compare(seeds=(0, 1))`` on a tiny lake: two runs per model under ``<model>/seed-<s>``, each model's mean
    the mean of its per-seed means, each difference's per-seed list that of the per-seed means."""
    import json

    from gemline.lake import Lake
    from tests.trainer.conftest import three_day_compare_config
    from trainer.compare import run_compare

    lake = tmp_path / "lake"
    config = three_day_compare_config(lake, batch_size=16)
    with pytest.raises(ValueError, match="seeds must be distinct"):
        run_compare(Lake.for_config(config), config.trainer, models=("lr", "dlrm"), seeds=(1, 1))
    result = run_compare(Lake.for_config(config), config.trainer, models=("lr", "dlrm"), run_id="seeds",
                         resamples=20, seeds=(0, 1))
    assert result.versions == [1, 2]
    for model in ("lr", "dlrm"):
        assert sorted(p.name for p in (lake / "_runs" / "seeds" / model).iterdir()) == ["seed-0", "seed-1"]
    click = {r["model"]: r for r in result.rows if r["task"] == "click"}
    for r in click.values():
        assert len(set(r["continuous_run_ids"])) == 2 and r["seeds"] == [0, 1]
        assert r["auc"] == pytest.approx(sum(r["per_seed_auc"]) / 2, abs=1e-12)
    assert click["dlrm"]["per_seed_auc"][0] != click["dlrm"]["per_seed_auc"][1]  # the seed reached the training
    d = next(d for d in result.differences if d["task"] == "click")
    assert d["auc"]["per_seed"] == pytest.approx(
        [a - b for a, b in zip(click["lr"]["per_seed_auc"], click["dlrm"]["per_seed_auc"], strict=True)], abs=1e-12)
    summary = json.loads(open(result.paths["summary"]).read())
    assert summary["seeds"] == [0, 1] and summary["lr_minus_dlrm_auc"]["per_seed"] == d["auc"]["per_seed"]
    assert "AUC per seed" in open(result.paths["md"]).read()
