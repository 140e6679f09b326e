"""gemline compare --ablate / --json: the ablation registry, the paired bootstrap on a hand case, the JSON shape."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from gemline.errors import BadConfigError
from tests.conftest import trainer_args
from trainer.compare import ABLATIONS, ablated_config, compare_json, progressive_summary, run_compare
from trainer.config import GemConfig, IdsConfig, TrainerConfig

SMALL = {"trainer.num_embeddings": "1000", "trainer.batch_size": "64", "trainer.learning_rate": "0.01",
         "trainer.embedding_learning_rate": "0.01", "trainer.seed": "0", "trainer.embedding_dim": "4",
         "trainer.hidden_dims": "8", "trainer.tower_hidden": "4", "trainer.gem.layers": "1",
         "trainer.gem.max_sequence_len": "8", "trainer.gem.fm_outputs": "2", "trainer.gem.lcb_outputs": "2",
         "trainer.gem.fm_rank": "2", "trainer.ids.mapping": "managed",
         "ingest.domains": '["feed", "reels", "marketplace"]'}


def _predictions(version: int, labels: np.ndarray, probs: np.ndarray):
    from trainer.continuous import ProgressivePredictions

    both = np.stack([labels, labels], axis=1).astype(np.float64)
    scores = np.stack([probs, probs], axis=1)
    return ProgressivePredictions(version, both, scores, np.array(["feed"] * len(labels), dtype=object))


def test_paired_bootstrap_of_a_known_difference():
    """Model a ranks every positive above every negative (AUC 1), b the reverse (AUC 0), on two versions: the AUC
    difference is 1 on the rows and on every resample that has both classes, so the interval is [1, 1]. The NE
    difference equals the reference computation on the rows."""
    from trainer.metrics import normalized_entropy

    rng = np.random.default_rng(0)
    labels = [rng.permutation(np.r_[np.ones(30), np.zeros(50)]), rng.permutation(np.r_[np.ones(10), np.zeros(40)])]
    good = [np.where(y == 1, 0.8, 0.2) for y in labels]
    bad = [np.where(y == 1, 0.3, 0.6) for y in labels]
    predictions = {"a": {v: _predictions(v, y, p) for v, (y, p) in enumerate(zip(labels, good), 1)},
                   "b": {v: _predictions(v, y, p) for v, (y, p) in enumerate(zip(labels, bad), 1)}}
    _, rows, differences, _ = progressive_summary(predictions, resamples=300, seed=5)
    click = next(d for d in differences if d["task"] == "click")
    assert click["auc"]["estimate"] == 1.0 and click["auc"]["low"] == 1.0 and click["auc"]["high"] == 1.0
    ne = [sum(len(y) * normalized_entropy(y, p) for y, p in zip(labels, scores)) / 130 for scores in (good, bad)]
    assert click["ne"]["estimate"] == pytest.approx(ne[0] - ne[1], abs=1e-12)
    assert click["ne"]["low"] <= click["ne"]["estimate"] <= click["ne"]["high"] < 0  # a's NE is lower: better

    summary = compare_json(rows, differences)
    assert summary["models"]["a"]["auc"] == 1.0 and summary["models"]["b"]["auc"] == 0.0
    assert summary["a_minus_b_auc"] == {"mean": 1.0, "ci95": [1.0, 1.0]}
    assert summary["a_minus_b_ne"]["mean"] == pytest.approx(ne[0] - ne[1], abs=1e-12)
    # An ablated run's difference goes under "ablations", named by the ablation.
    as_ablation = compare_json(rows, differences, ablated={"b": "collisions"})
    assert as_ablation["ablations"]["collisions"]["run"] == "b"
    assert as_ablation["ablations"]["collisions"]["auc"] == {"mean": 1.0, "ci95": [1.0, 1.0]}
    assert "a_minus_b_auc" not in as_ablation


def test_an_ablation_is_its_overrides_applied_to_the_full_config():
    full = TrainerConfig(ids=IdsConfig(mapping="managed", min_count=3), gem=GemConfig(max_sequence_len=256),
                         learning_rate=0.02)
    no_collisions = ablated_config(full, "collisions")
    assert no_collisions.ids == IdsConfig(mapping="hash", min_count=3)
    assert no_collisions.gem == full.gem and no_collisions.learning_rate == 0.02
    assert ablated_config(full, "sequence_len").gem.max_sequence_len == int(ABLATIONS["sequence_len"]["trainer.gem.max_sequence_len"])
    for name in ("time_delta_buckets", "recency_branches", "sequence_len", "task_towers"):  # gem_small's values already
        with pytest.raises(BadConfigError, match=f"ablation '{name}'.*changes nothing"):
            ablated_config(TrainerConfig(), name)
    assert ablated_config(TrainerConfig(), "final_labels").final_labels is False
    assert ablated_config(TrainerConfig(), "wide").gem.wide is False  # on by default
    with pytest.raises(BadConfigError, match="ablation 'wide'.*changes nothing"):
        ablated_config(TrainerConfig(gem=GemConfig(wide=False)), "wide")
    gated = TrainerConfig(gem=GemConfig(deep_gate=True))
    assert ablated_config(gated, "deep_gate").gem == GemConfig(deep_gate=False)
    assert ablated_config(gated, "wide").gem == GemConfig(wide=False, deep_gate=False)  # the gate needs the wide part
    with pytest.raises(BadConfigError, match="ablation 'deep_gate'.*changes nothing"):
        ablated_config(TrainerConfig(gem=GemConfig(deep_gate=False)), "deep_gate")
    narrow = replace(full, ids=replace(full.ids, widths="cardinality"))
    assert ablated_config(narrow, "widths").ids == full.ids
    with pytest.raises(BadConfigError, match="ablation 'widths'.*changes nothing"):
        ablated_config(full, "widths")


@pytest.mark.parametrize(("name", "message"), [
    ("interformer", "unknown ablation 'interformer'; known: collisions, deep_gate, final_labels, fmb_mlp_layers, gem_learning_rate, interformer_cross, personalized_ffn, pooled_history, recency_branches, same_domain_stream, sequence_len, target_match, task_towers, time_delta_buckets, wide, wide_loss, widths"),
    ("collisions", "ablation 'collisions' \\(trainer.ids.mapping=hash\\) changes nothing"),
])
def test_an_unknown_or_empty_ablation_is_refused_before_training(tmp_path, name, message):
    from gemline.config import load_config

    config = load_config(overrides={"lake": str(tmp_path)})  # hash ids: the collisions ablation is a no-op
    with pytest.raises(BadConfigError, match=message):
        run_compare(*trainer_args(config), ablations=(name,))
    assert not (tmp_path / "_runs").exists(), "nothing ran"


def test_cli_reports_an_unknown_ablation_in_one_line(tmp_path, capsys):
    from gemline.cli import main

    assert main(["compare", "--set", f"lake={tmp_path}", "--ablate", "nope", "--json"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: unknown ablation 'nope'; known: collisions, deep_gate, final_labels, fmb_mlp_layers, gem_learning_rate, interformer_cross, personalized_ffn, pooled_history, recency_branches, same_domain_stream, sequence_len, target_match, task_towers, time_delta_buckets, wide, wide_loss, widths"]


def test_compare_json_of_a_tiny_run_with_an_ablation(tmp_path):
    from gemline.config import load_config

    from .conftest import mark_quality, synthetic_examples, write_examples

    lake = tmp_path / "lake"
    for day, rows in {1: 120, 2: 90, 3: 90}.items():
        mark_quality(lake, write_examples(lake, synthetic_examples([f"2026-01-{day:02d}"], rows, seed=day)), passed=True)
    config = load_config(overrides={"lake": str(lake), **SMALL})
    result = run_compare(*trainer_args(config), run_id="cmp", resamples=50, seed=1, ablations=("collisions",))

    summary = json.loads(open(result.paths["summary"]).read())
    assert set(summary["models"]) == {"gem", "dlrm", "lr", "gem-no-collisions"}
    for values in summary["models"].values():
        assert set(values) == {"auc", "ne", "conversion_auc", "conversion_ne"} and 0 < values["auc"] < 1
    for key in ("gem_minus_dlrm_auc", "gem_minus_lr_auc", "gem_minus_dlrm_ne", "gem_minus_lr_ne"):
        lo, hi = summary[key]["ci95"]
        assert set(summary[key]) == {"mean", "ci95"} and lo <= hi
    gem, dlrm = summary["models"]["gem"], summary["models"]["dlrm"]
    assert summary["gem_minus_dlrm_auc"]["mean"] == pytest.approx(gem["auc"] - dlrm["auc"], abs=1e-12)
    ablation = summary["ablations"]["collisions"]
    assert ablation["run"] == "gem-no-collisions"
    assert ablation["auc"]["mean"] == pytest.approx(gem["auc"] - summary["models"]["gem-no-collisions"]["auc"], abs=1e-12)
    assert "| gem - gem-no-collisions | click |" in open(result.paths["md"]).read()
    saved = json.loads(open(result.paths["json"]).read())
    assert saved["ablations"] == {"collisions": {"trainer.ids.mapping": "hash"}}
