"""End-to-end runs on small synthetic examples tables: the gate, learning, checkpoints, resume."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

import trainer.loop as loop_module
from gemline.config import load_config
from gemline.lake import Lake
from trainer.checkpoint import latest_checkpoint, read_state
from trainer.data import encode_examples, fit_normalizer, make_batch
from trainer.model import TwoTaskRanker
from trainer.train import QuarantinedError, run_training, train_step

# Learnable but small: 2 train days x 400 rows, batch 64 -> 13 steps per epoch.
SMALL = {
    "trainer.num_embeddings": "1000",
    "trainer.batch_size": "64",
    "trainer.epochs": "3",
    "trainer.learning_rate": "0.01",
    "trainer.embedding_learning_rate": "0.01",
    "trainer.seed": "0",
}


def config(lake: str, **overrides):
    return load_config(overrides={"lake": lake, **SMALL, **overrides})


def _run(config, **kwargs):
    """run_training with the config's trainer section and lake."""
    return run_training(config.trainer, Lake.for_config(config), **kwargs)


@pytest.mark.slow
def test_learns_and_checkpoints(make_lake):
    lake, version = make_lake(rows_per_date=400)
    result = _run(config(lake), progress=False)

    assert (result.examples_version, result.train_examples, result.eval_examples) == (version, 800, 400)
    assert result.eval_date == "2026-01-03"
    assert result.steps == 3 * 13 == len(result.loss_curve)
    assert all(math.isfinite(x) for x in result.loss_curve)
    first, last = sum(result.loss_curve[:5]) / 5, sum(result.loss_curve[-5:]) / 5
    assert last < first
    click = result.metrics["click"]["overall"]
    assert click["auc"] > 0.6, click
    assert click["num_examples"] == 400 and 0 < click["base_rate"] < 1 and math.isfinite(click["ne"])
    assert set(result.metrics["conversion"]["by_domain"]) == {"feed", "reels", "marketplace"}
    assert sum(m["num_examples"] for m in result.metrics["click"]["by_domain"].values()) == 400

    path = Path(result.checkpoint_path)
    assert latest_checkpoint(lake) == path and path.name == f"step-{result.steps}"
    assert (path / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    state = read_state(path)
    assert (state.step, state.examples_seen, state.examples_version) == (39, 3 * 800, version)


@pytest.mark.slow
def test_resume_continues_and_runs_are_deterministic(make_lake, tmp_path):
    lake, _ = make_lake(rows_per_date=100)
    first = _run(config(lake, **{"trainer.epochs": "1"}), progress=False)
    resumed = _run(config(lake, **{"trainer.epochs": "1", "trainer.init_from": "latest"}), progress=False)
    assert first.steps == 4 and resumed.steps == 8
    assert read_state(resumed.checkpoint_path).examples_seen == 2 * 200
    assert latest_checkpoint(lake).name == "step-8"
    again = _run(config(lake, **{"trainer.epochs": "1"}), progress=False)
    assert again.loss_curve == first.loss_curve and again.steps == 4


@pytest.mark.parametrize(("passed", "message"), [(False, "quarantined"), (None, "never validated")])
def test_gate_refuses(make_lake, caplog, passed, message):
    lake, version = make_lake(rows_per_date=10, passed=passed)
    with pytest.raises(QuarantinedError, match=message):
        _run(config(lake), examples_version=version, progress=False)
    assert message in caplog.text
    assert latest_checkpoint(lake) is None


def test_fewer_than_two_dates_is_rejected(make_lake):
    lake, version = make_lake(dates=("2026-01-05",), rows_per_date=10)
    with pytest.raises(ValueError, match=r"2026-01-05"):
        _run(config(lake), examples_version=version, progress=False)


def test_missing_table(tmp_path):
    with pytest.raises(FileNotFoundError, match="no examples table"):
        _run(config(str(tmp_path / "lake")), progress=False)


def test_non_finite_loss_skips_the_step(make_examples):
    table = make_examples(["2026-01-01"], 8, 2)
    batch = make_batch(encode_examples(table, 50, fit_normalizer(table)), np.arange(8))
    torch.manual_seed(0)
    model = TwoTaskRanker(num_embeddings=50, embedding_dim=4, num_dense=3, hidden_dims=(8,))
    optimizers = {"all": torch.optim.Adam(model.parameters(), lr=0.1)}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    poisoned = type(batch)(batch.sparse, batch.sequence, torch.full_like(batch.dense, float("nan")), batch.labels, batch.domains)
    assert train_step(model, optimizers, poisoned) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert optimizers["all"].state == {}
    loss = train_step(model, optimizers, batch)
    # Reference: mean BCE of each head, summed, at the parameters before the step.
    fresh = TwoTaskRanker(num_embeddings=50, embedding_dim=4, num_dense=3, hidden_dims=(8,))
    fresh.load_state_dict(before)
    logits = fresh(batch.sparse, batch.sequence, batch.dense)
    y = batch.labels
    expected = -(y * torch.log(torch.sigmoid(logits)) + (1 - y) * torch.log(1 - torch.sigmoid(logits))).mean(dim=0).sum()
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


GOLDEN = Path(__file__).parent / "data" / "tiny_loss_curve.json"


def tiny_run(make_lake):
    lake, _ = make_lake(rows_per_date=60, seed=3)
    # The golden curve was recorded with the TwoTaskRanker, before trainer.model defaulted to gem, and with the
    # tables' per-element Adagrad, before trainer.embedding_optimizer defaulted to rowwise_adagrad.
    return _run(config(lake, **{"trainer.epochs": "1", "trainer.batch_size": "32", "trainer.model": "ranker",
                                "trainer.embedding_optimizer": "adagrad"}), progress=False)


def test_tiny_run_reproduces_checked_in_losses(make_lake):
    """Guards refactors that must not change the maths.

    If the maths changes on purpose, copy the loss curve printed in the failure message into
    ``data/tiny_loss_curve.json`` and say why in the commit message.
    """
    result = tiny_run(make_lake)
    golden = json.loads(GOLDEN.read_text())
    assert result.steps == golden["steps"]
    assert result.loss_curve == pytest.approx(golden["loss_curve"], rel=1e-4), result.loss_curve


@pytest.mark.slow
def test_crashed_run_resumes_to_the_same_parameters(make_lake, tmp_path, monkeypatch):
    """A run that dies mid-epoch and is resumed ends where an uninterrupted run ends, bit for bit."""
    settings = {"trainer.epochs": "2", "trainer.batch_size": "32", "trainer.checkpoint_every_steps": "3"}
    lake, _ = make_lake(rows_per_date=50)  # 100 train rows -> 4 batches per epoch, 8 steps
    uninterrupted = _run(config(lake, **settings), progress=False)

    other = str(tmp_path / "other")
    shutil.copytree(Path(lake) / "examples", Path(other) / "examples")
    shutil.copytree(Path(lake) / "quality", Path(other) / "quality")
    real_step, calls = loop_module.train_step, []

    def dies_at_step_5(*args, **kwargs):
        if len(calls) == 5:
            raise RuntimeError("simulated crash")
        calls.append(1)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop_module, "train_step", dies_at_step_5)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(config(other, **settings), progress=False)
    monkeypatch.setattr(loop_module, "train_step", real_step)
    assert latest_checkpoint(other).name == "step-3"  # steps 4-5 were lost with the crash

    resumed = _run(config(other, **settings, **{"trainer.init_from": "latest"}), progress=False)
    assert resumed.steps == uninterrupted.steps == 8
    assert resumed.loss_curve == uninterrupted.loss_curve[3:]
    assert read_state(resumed.checkpoint_path).examples_seen == read_state(uninterrupted.checkpoint_path).examples_seen == 200
    ours = torch.load(Path(resumed.checkpoint_path) / "state.pt", weights_only=True)["model"]
    theirs = torch.load(Path(uninterrupted.checkpoint_path) / "state.pt", weights_only=True)["model"]
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert resumed.metrics == uninterrupted.metrics


def test_warm_start_from_a_sharded_runs_checkpoint(make_lake):
    """A sharded run's checkpoint (full parameters, no optimiser state, as trainer.launch writes it)
    warm-starts a one-process run: its parameters are loaded, its optimisers start fresh."""
    from trainer.checkpoint import TrainState, save_checkpoint
    from trainer.models import build_model

    lake, version = make_lake(rows_per_date=60, seed=3)
    settings = {"trainer.epochs": "1", "trainer.batch_size": "32", "trainer.model": "dlrm", "trainer.num_embeddings": "97"}
    tc = config(lake, **settings).trainer
    from trainer.data import load_split

    split = load_split(lake, version)
    normalizer = fit_normalizer(split.train)
    domains = tuple(sorted(set(split.train["domain"].to_pylist())))
    torch.manual_seed(123)  # not the run's seed: a fresh init would give other parameters
    saved = build_model(tc, len(normalizer.names), domains)
    extra = {"normalizer": normalizer.to_dict(), "domains": list(domains), "model": "dlrm", "world_size": 2}
    save_checkpoint(lake, TrainState(step=7, examples_seen=224, examples_version=version, extra=extra), saved, {})
    # lr 1e-12: the run barely moves the parameters, so they must end where the checkpoint put them.
    result = _run(config(lake, **settings, **{"trainer.init_from": "latest", "trainer.learning_rate": "1e-12",
                                                      "trainer.embedding_learning_rate": "1e-12"}), progress=False)
    assert result.steps == 7 + 4  # 120 train rows / 32 -> 4 steps after the sharded run's 7
    final = torch.load(Path(result.checkpoint_path) / "state.pt", weights_only=True)
    assert set(final["optimizers"]) == {"dense", "embeddings"}
    for key, value in saved.state_dict().items():
        torch.testing.assert_close(final["model"][key], value, rtol=0, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_cli_train_says_why_auc_is_undefined_on_an_eval_day_without_clicks(tmp_path, make_examples, capsys):
    from gemline.cli import main

    from .conftest import mark_quality, write_examples

    table = make_examples(["2026-01-01", "2026-01-02"], 120, 3)
    is_eval = pc.equal(table["event_date"], "2026-01-02")
    for name in ("label_click", "label_conversion"):  # the eval day has no positive label at all
        column = table.schema.get_field_index(name)
        table = table.set_column(column, name, pc.if_else(is_eval, 0, table[name]).cast(pa.int32()))
    lake = str(tmp_path / "lake")
    version = write_examples(lake, table)
    mark_quality(lake, version, passed=True)
    assert pc.sum(table.filter(pc.invert(is_eval))["label_click"]).as_py() > 0  # the train day has clicks

    capsys.readouterr()
    assert main(["train", "--lake", lake, "--set", "trainer.model=lr", "--set", "trainer.batch_size=64"]) == 0
    out = capsys.readouterr().out
    assert "NaN" not in out
    result = json.loads(out)  # strict JSON: no NaN tokens
    click = result["metrics"]["click"]["overall"]
    assert (click["auc"], click["ne"], click["calibration"], click["num_examples"]) == (None, None, None, 120)
    assert click["undefined"]["auc"] == (
        "no positive labels among 120 examples; AUC ranks positives against negatives and needs both")
    assert result["undefined_metrics"][0] == (
        "click auc is undefined on the eval day 2026-01-02: no positive labels among 120 examples; AUC ranks "
        "positives against negatives and needs both")
    assert len(result["undefined_metrics"]) == 6  # auc, ne, calibration of click and of conversion


def test_the_held_out_day_is_judged_on_every_label_its_open_windows_included(tmp_path, make_examples):
    from .conftest import mark_quality, write_examples

    table = make_examples(["2026-01-01", "2026-01-02"], 120, 3)
    is_eval = pc.equal(table["event_date"], "2026-01-02")
    # A bounded snapshot's last day: its conversion windows are open, and the click window (1 day) too.
    column = table.schema.get_field_index("label_window_closed")
    table = table.set_column(column, "label_window_closed", pc.invert(is_eval))
    lake = str(tmp_path / "lake")
    version = write_examples(lake, table)
    mark_quality(lake, version, passed=True)
    result = _run(config(lake, **{"trainer.model": "lr"}), progress=False)
    assert result.eval_examples == 120
    for task, label in (("click", "label_click"), ("conversion", "label_conversion")):
        overall = result.metrics[task]["overall"]
        want = pc.mean(table.filter(is_eval)[label].cast(pa.float64())).as_py()
        assert overall["num_examples"] == 120 and overall["base_rate"] == pytest.approx(want)
        assert math.isfinite(overall["ne"]), overall


def test_one_shot_train_on_a_validated_version_with_no_rows_is_one_line(tmp_path, capsys, make_examples):
    """A `label_mode=wait` build whose windows are all open publishes a version with 0 rows: exit 2 with the cause,
    not the temporal split's traceback."""
    from gemline.cli import main

    from .conftest import mark_quality, write_examples

    lake = str(tmp_path / "lake")
    mark_quality(lake, write_examples(lake, make_examples(["2026-01-01"], 0, 0)), passed=True)
    capsys.readouterr()
    assert main(["train", "--lake", lake]) == 2
    assert capsys.readouterr().err == (
        "error: examples@0 holds no rows: nothing published yet (build.label_mode=wait publishes an impression when its "
        "longest attribution window closes; fnw/defer after build.publish_delay_ms); train once the build has published "
        "examples on >= 2 event dates\n")
