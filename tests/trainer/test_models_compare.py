"""The comparisons: progressive (every model through the continuous trainer, its means equal to what each run
recorded in training_metrics) and held-out last day (rows from run_training metrics, the table, the files)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tests.conftest import trainer_args
from trainer.compare import comparison_rows, markdown_table, run_compare, run_holdout_compare, write_report
from trainer.metrics import evaluate


def metrics_of(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    labels = np.stack([rng.integers(0, 2, 30), np.zeros(30)], axis=1)  # no conversions: NaN AUC/NE/calibration
    probs = rng.random((30, 2))
    return evaluate(labels, probs, np.array(["reels", "feed", "ads"] * 10, dtype=object))


def test_rows_table_and_files(tmp_path):
    metrics = {"gem": metrics_of(0), "dlrm": metrics_of(1)}
    rows = comparison_rows(metrics)
    assert len(rows) == 2 * 2 * 4  # models x tasks x (overall + 3 domains)
    assert [(r["model"], r["task"], r["domain"]) for r in rows[:4]] == [("gem", "click", d) for d in ("overall", "ads", "feed", "reels")]
    assert rows[0]["auc"] == metrics["gem"]["click"]["overall"]["auc"]
    assert rows[1]["num_examples"] == 10
    conversion = [r for r in rows if r["task"] == "conversion"]
    assert all(math.isnan(r["auc"]) for r in conversion)

    table = markdown_table(rows).splitlines()
    assert len(table) == 2 + len(rows)
    assert table[2].startswith(f"| gem | click | overall | {rows[0]['auc']:.4f} | ")
    assert "| dlrm | conversion | reels | n/a | n/a | n/a | 10 | 0.0000 |" in table

    paths = write_report(tmp_path / "run", {"examples_version": 3, "eval_date": "2026-01-03"}, rows)
    saved = json.loads(open(paths["json"]).read())
    assert saved["examples_version"] == 3 and len(saved["rows"]) == len(rows) and saved["rows"][-1]["auc"] is None
    assert open(paths["md"]).read().startswith("# examples@3, eval day 2026-01-03")
    assert open(paths["png"], "rb").read()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("models", "message"), [
    ((), "at least one"), (("gem", "xgboost"), "trainer.model must be one of"), (("gem", "dlrm", "gem"), "repeat")])
def test_rejects_bad_model_lists_before_training(tmp_path, models, message):
    from gemline.config import load_config

    config = load_config(overrides={"lake": str(tmp_path)})  # no examples table: reaching training would fail otherwise
    with pytest.raises(ValueError, match=message):
        run_compare(*trainer_args(config), models=models)
    with pytest.raises(ValueError, match=message):
        run_holdout_compare(*trainer_args(config), models=models, progress=False)


def test_compare_warns_that_it_trains_from_scratch_whatever_init_from_says(tmp_path, caplog):
    from gemline.config import load_config

    config = load_config(overrides={"lake": str(tmp_path), "trainer.init_from": "latest"})
    # An unknown model stops the comparison before any training, after it read the config.
    with pytest.raises(ValueError, match="trainer.model must be one of"):
        run_compare(*trainer_args(config), models=("gem", "xgboost"))
    assert [r.getMessage() for r in caplog.records if r.name == "trainer.compare" and r.levelname == "WARNING"] == [
        "trainer.init_from='latest' is overridden at run time: using 'scratch' (compare trains every model from fresh "
        "parameters, so none starts from another's checkpoint)"]


def test_rejects_a_bad_bootstrap_before_training(tmp_path):
    from gemline.config import load_config

    with pytest.raises(ValueError, match="resamples >= 1"):
        run_compare(*trainer_args(load_config(overrides={"lake": str(tmp_path)})), resamples=0)


SMALL = {"trainer.num_embeddings": "1000", "trainer.batch_size": "64", "trainer.learning_rate": "0.01",
         "trainer.embedding_learning_rate": "0.01", "trainer.seed": "0",
         "ingest.domains": '["feed", "reels", "marketplace"]'}


def _weighted(values: list[tuple[float | None, float]]) -> float:
    defined = [(v, n) for v, n in values if v is not None]
    return sum(v * n for v, n in defined) / sum(n for _, n in defined)


def test_progressive_compare_reports_what_each_continuous_run_recorded(tmp_path):
    from gemline.config import load_config
    from gemline.lake import read_table

    from .conftest import mark_quality, synthetic_examples, write_examples

    lake = tmp_path / "lake"
    sizes = {1: 200, 2: 150, 3: 250, 4: 180}  # versions 0..3; 1..3 are evaluated before training on them
    for day, rows in sizes.items():
        mark_quality(lake, write_examples(lake, synthetic_examples([f"2026-01-{day:02d}"], rows, seed=day)), passed=True)
    config = load_config(overrides={"lake": str(lake), **SMALL})

    result = run_compare(*trainer_args(config), run_id="cmp", resamples=200, seed=3)

    assert result.versions == [1, 2, 3]
    assert [(r["model"], r["task"]) for r in result.rows] == [
        (m, t) for t in ("click", "conversion") for m in ("gem", "dlrm", "lr")]
    recorded = read_table(str(lake), "training_metrics").to_pylist()
    run_ids = {r["model"]: r["continuous_run_id"] for r in result.rows}
    assert len(set(run_ids.values())) == 3 and {r["run_id"] for r in recorded} == set(run_ids.values())
    for row in result.rows:
        mine = [r for r in recorded if r["run_id"] == row["continuous_run_id"] and r["task"] == row["task"]
                and r["domain"] == "all"]
        by = {(r["examples_version"], r["metric"]): r["value"] for r in mine}
        assert sorted({v for v, _ in by}) == [1, 2, 3]
        assert [by[(v, "num_examples")] for v in (1, 2, 3)] == [150.0, 250.0, 180.0]
        assert row["auc"] == pytest.approx(_weighted([(by[(v, "auc")], by[(v, "num_examples")]) for v in (1, 2, 3)]), abs=1e-12)
        assert row["ne"] == pytest.approx(_weighted([(by[(v, "ne")], by[(v, "num_examples")]) for v in (1, 2, 3)]), abs=1e-12)
        assert row["versions"] == 3 and row["rows"] == 580
        assert 0.0 < row["auc"] < 1.0 and row["ne"] > 0

    means = {(r["model"], r["task"]): r for r in result.rows}
    assert [(d["a"], d["b"], d["task"]) for d in result.differences] == [
        ("gem", "dlrm", "click"), ("gem", "lr", "click"), ("gem", "dlrm", "conversion"), ("gem", "lr", "conversion")]
    for d in result.differences:
        for metric in ("auc", "ne"):
            interval = d[metric]
            assert interval["estimate"] == pytest.approx(
                means[("gem", d["task"])][metric] - means[(d["b"], d["task"])][metric], abs=1e-12)
            assert interval["low"] <= interval["high"] and interval["requested"] == 200 and interval["seed"] == 3

    saved = json.loads(open(result.paths["json"]).read())
    assert saved["versions"] == [1, 2, 3] and saved["bootstrap"]["resamples"] == 200
    assert [p["examples_version"] for p in saved["per_version"]["dlrm"]["click"]] == [1, 2, 3]
    table = open(result.paths["md"]).read()
    assert table.startswith("# Progressive comparison: examples@1..3 (3 versions evaluated before training on them)")
    gem_click = means[("gem", "click")]
    assert f"| gem | click | {gem_click['auc']:.4f} | {gem_click['ne']:.4f} | 3 | 580 |" in table
    assert "| gem - dlrm | click | " in table
    assert open(result.paths["png"], "rb").read()[:8] == b"\x89PNG\r\n\x1a\n"
    # Each model's run keeps its checkpoints in the compare run's folder, never in the lake's continuous run.
    for model in ("gem", "dlrm", "lr"):
        assert list((lake / "_runs" / "cmp" / model / "_checkpoints").glob("step-*/meta.json"))
    assert not (lake / "_continuous").exists()


def test_the_compare_hooks_of_run_once_need_one_process(tmp_path):
    from gemline.config import load_config
    from trainer.continuous import run_once

    config = load_config(overrides={"lake": str(tmp_path)})
    for hooks in ({"root": str(tmp_path / "gem")}, {"on_predictions": print}):
        with pytest.raises(ValueError, match="need nproc=1"):
            run_once(*trainer_args(config), nproc=2, **hooks)
