"""The comparison report: rows from run_training metrics, the markdown table, the files written."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from trainer.compare import comparison_rows, markdown_table, run_compare, write_report
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


@pytest.mark.parametrize(("models", "message"), [((), "at least one"), (("gem", "xgboost"), "trainer.model must be one of")])
def test_rejects_bad_model_lists_before_training(tmp_path, models, message):
    from gemline.config import load_config

    with pytest.raises(ValueError, match=message):
        run_compare(load_config(overrides={"lake": str(tmp_path)}), models=models, progress=False)


def test_compare_warns_that_it_trains_from_scratch_whatever_init_from_says(tmp_path, caplog):
    from gemline.config import load_config

    config = load_config(overrides={"lake": str(tmp_path), "trainer.init_from": "latest"})
    # An unknown model stops run_compare before any training, after it read the config.
    with pytest.raises(ValueError, match="trainer.model must be one of"):
        run_compare(config, models=("gem", "xgboost"), progress=False)
    assert [r.getMessage() for r in caplog.records if r.name == "trainer.compare" and r.levelname == "WARNING"] == [
        "trainer.init_from='latest' is overridden at run time: using 'scratch' (compare trains every model from fresh "
        "parameters, so none starts from another's checkpoint)"]
