"""No code runs from a checkpoint: a ``__reduce__`` payload planted in each kind of checkpoint the project writes
(one-shot ``step-N``, the continuous run's, the distill students', a sharded run's DCP ``.metadata``) is refused with
one :class:`gemline.errors.CheckpointError` line before it runs; the RNG states saved without numpy objects restore
exactly; a checkpoint written in the old format (numpy arrays) still resumes."""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import trainer.distill as distill
from gemline.cli import main
from gemline.errors import CheckpointError
from tests.conftest import trainer_args
from trainer.checkpoint import (
    TrainState,
    latest_checkpoint,
    load_checkpoint,
    load_weights,
    read_state,
    restore_rng_state,
    rng_state,
    save_checkpoint,
)
from trainer.continuous import current_root, run_once
from trainer.sharded_checkpoint import SafeLoadPlanner, SafeReader, read_metadata, shards_of

from .test_continuous import _add, _config
from .test_distill import _config as _distill_config
from .test_distill import _lake as _distill_lake


class _Payload:
    """Unpickling this runs ``touch MARKER``: what an attacker who can write to the lake would plant."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(file: Path, marker: Path) -> None:
    """Replace ``file`` with a torch file whose unpickling runs the payload (as a whole value and inside a dict)."""
    torch.save({"model": {}, "optimizers": {}, "rng": _Payload(marker)}, file)


def _assert_refused(call, file: Path, marker: Path) -> None:
    with pytest.raises(CheckpointError, match=f"{file}.*--from-scratch") as caught:
        call()
    assert "\n" not in str(caught.value), "one line"
    assert not marker.exists(), "the payload ran"


def _small(tmp_path: Path) -> tuple[nn.Module, dict[str, torch.optim.Optimizer]]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return model, {"dense": opt}


def test_a_planted_one_shot_checkpoint_is_refused_before_it_runs(tmp_path):
    model, optimizers = _small(tmp_path)
    path = Path(save_checkpoint(tmp_path / "lake", TrainState(step=3, examples_seen=9, examples_version=0), model,
                                optimizers))
    marker = tmp_path / "pwned"
    _plant(path / "state.pt", marker)
    _assert_refused(lambda: load_checkpoint(path, model, optimizers), path / "state.pt", marker)
    _assert_refused(lambda: load_weights(path, model), path / "state.pt", marker)


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 truncated", b"not a zip"])
def test_a_corrupt_state_file_is_one_line(tmp_path, content):
    model, optimizers = _small(tmp_path)
    path = Path(save_checkpoint(tmp_path / "lake", TrainState(step=1, examples_seen=1, examples_version=0), model,
                                optimizers))
    (path / "state.pt").write_bytes(content)
    _assert_refused(lambda: load_checkpoint(path, model, optimizers), path / "state.pt", tmp_path / "none")


def test_a_state_file_of_something_else_is_refused(tmp_path):
    model, optimizers = _small(tmp_path)
    path = Path(save_checkpoint(tmp_path / "lake", TrainState(step=1, examples_seen=1, examples_version=0), model,
                                optimizers))
    torch.save({"weights": torch.zeros(2)}, path / "state.pt")
    with pytest.raises(CheckpointError, match="not a gemline checkpoint.*weights"):
        load_checkpoint(path, model, optimizers)


@pytest.mark.parametrize("meta", ['{"step": 1', '{"step": "x", "examples_seen": 0, "examples_version": 0, "extra": {}}',
                                  '{"step": 1, "examples_seen": 0, "examples_version": 0, "extra": []}', "[]"])
def test_a_garbled_meta_json_is_one_line(tmp_path, meta):
    model, optimizers = _small(tmp_path)
    path = Path(save_checkpoint(tmp_path / "lake", TrainState(step=1, examples_seen=1, examples_version=0), model,
                                optimizers))
    (path / "meta.json").write_text(meta)
    with pytest.raises(CheckpointError, match=f"{path / 'meta.json'}.*--from-scratch"):
        read_state(path)


def test_rng_states_restore_exactly_and_hold_no_numpy_object(tmp_path):
    model, optimizers = _small(tmp_path)
    generator = np.random.default_rng(7)
    generator.random(3)
    np.random.seed(11)
    np.random.random(5)
    random.seed(3)
    torch.manual_seed(5)
    path = Path(save_checkpoint(tmp_path / "lake", TrainState(step=1, examples_seen=1, examples_version=0), model,
                                optimizers, numpy_rng=generator))
    expected = (generator.random(4), np.random.random(4), random.random(), torch.rand(3))
    other = np.random.default_rng(99)
    np.random.seed(0), random.seed(0), torch.manual_seed(0)
    load_checkpoint(path, model, optimizers, numpy_rng=other)
    got = (other.random(4), np.random.random(4), random.random(), torch.rand(3))
    assert np.array_equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert got[2] == expected[2] and torch.equal(got[3], expected[3])
    # Readable by the restricted unpickler with nothing allowed beyond torch's defaults.
    torch.load(path / "state.pt", weights_only=True)


def test_a_checkpoint_of_the_old_format_with_numpy_arrays_still_resumes(tmp_path):
    model, optimizers = _small(tmp_path)
    path = Path(save_checkpoint(tmp_path / "lake", TrainState(step=1, examples_seen=1, examples_version=0), model,
                                optimizers))
    payload = torch.load(path / "state.pt", weights_only=True)
    np.random.seed(21)
    payload["rng"]["numpy_global"] = np.random.get_state()  # the legacy tuple with its uint32 key array
    torch.save(payload, path / "state.pt")
    expected = np.random.random(3)
    np.random.seed(0)
    load_checkpoint(path, model, optimizers)
    assert np.array_equal(np.random.random(3), expected)


def test_warm_rng_state_round_trips():
    state = rng_state()
    expected = np.random.random(2)
    np.random.seed(1)
    restore_rng_state(state)
    assert np.array_equal(np.random.random(2), expected)


def test_a_planted_continuous_checkpoint_is_refused_by_train_once(tmp_path, capsys):
    lake = tmp_path / "lake"
    _add(lake, 1)
    run_once(*trainer_args(_config(lake)))
    newest = latest_checkpoint(current_root(str(lake)))
    assert newest is not None
    marker = tmp_path / "pwned"
    _plant(newest / "state.pt", marker)
    _add(lake, 2)  # a new version: the resume loads the checkpoint
    _assert_refused(lambda: run_once(*trainer_args(_config(lake))), newest / "state.pt", marker)
    capsys.readouterr()
    from .test_continuous import SMALL

    sets = [arg for key, value in SMALL.items() for arg in ("--set", f"{key}={value}")]
    assert main(["train", "--once", "--lake", str(lake), *sets]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: checkpoint file") and "--from-scratch" in err[0]
    assert not marker.exists()


def test_a_planted_students_file_is_refused_before_it_runs(tmp_path):
    lake = tmp_path / "lake"
    _distill_lake(lake)
    config = _distill_config(lake)
    run_once(*trainer_args(config))
    distill.run_distill_once(trainer_args(config)[0], config.trainer, config.distill)
    newest = latest_checkpoint(f"{lake}/_distill")
    assert newest is not None
    marker = tmp_path / "pwned"
    file = newest / distill.STUDENTS_FILE
    torch.save({"model": {}, "optimizers": {}, "rows": _Payload(marker)}, file)
    extra = read_state(newest).extra
    _assert_refused(lambda: distill._load(newest, extra, config.distill, config.trainer,
                                          len(extra["normalizer"]["names"])), file, marker)


def _dcp_folder(tmp_path: Path) -> tuple[Path, dict]:
    model, optimizers = _small(tmp_path)
    folder = tmp_path / "_checkpoints" / "sharded" / "step-2"
    state = {"model": model.state_dict(), "optim": optimizers["dense"].state_dict()}
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, checkpoint_id=str(folder))
    return folder, state


def test_a_planted_dcp_metadata_is_refused_before_it_runs(tmp_path):
    folder, _ = _dcp_folder(tmp_path)
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _assert_refused(lambda: read_metadata(folder), folder / ".metadata", marker)


def test_the_safe_dcp_reader_loads_what_dcp_saved(tmp_path):
    folder, saved = _dcp_folder(tmp_path)
    model, optimizers = _small(tmp_path)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    target = {"model": model.state_dict(), "optim": optimizers["dense"].state_dict()}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(target, storage_reader=SafeReader(str(folder)), planner=SafeLoadPlanner())
    assert all(torch.equal(target["model"][k], v) for k, v in saved["model"].items())
    assert target["optim"]["param_groups"][0]["lr"] == 0.1
    assert shards_of(tmp_path / "_checkpoints" / "step-2") == folder


def _sets() -> list[str]:
    from .test_continuous import SMALL

    return [arg for key, value in SMALL.items() for arg in ("--set", f"{key}={value}")]


@pytest.mark.parametrize("current", ["../../../x", "", "0123456789ab", "ABCDEF012345\n"])
def test_a_current_pointer_that_names_no_run_is_one_line_not_a_silent_new_run(tmp_path, capsys, current):
    lake = tmp_path / "lake"
    _add(lake, 1)
    first = run_once(*trainer_args(_config(lake)))
    _add(lake, 2)
    (lake / "_continuous" / "CURRENT").write_text(current)
    capsys.readouterr()
    assert main(["train", "--once", "--lake", str(lake), *_sets()]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "_continuous/CURRENT" in err[0] and "--from-scratch" in err[0], err
    assert sorted(p.name for p in (lake / "_continuous" / "runs").iterdir()) == [first.run_id], "no new run started"
    # --from-scratch goes on whatever CURRENT says, and points it at the new run.
    assert main(["train", "--once", "--from-scratch", "--lake", str(lake), *_sets()]) == 0
    new = (lake / "_continuous" / "CURRENT").read_text()
    assert new != first.run_id and latest_checkpoint(current_root(str(lake))) is not None


def test_a_run_that_started_but_never_checkpointed_is_not_an_error(tmp_path):
    lake = tmp_path / "lake"
    _add(lake, 1)
    first = run_once(*trainer_args(_config(lake)))
    started = lake / "_continuous" / "runs" / "0123456789ab"
    started.mkdir()
    (started / "RUN").write_text('{"run_id": "0123456789ab"}')  # as a new run writes it before its first checkpoint
    (lake / "_continuous" / "CURRENT").write_text("0123456789ab")
    assert current_root(str(lake)).endswith("runs/0123456789ab")
    _add(lake, 2)
    again = run_once(*trainer_args(_config(lake)))
    assert again.run_id != first.run_id and again.rows_trained_total == 400, "a new run, as the crashed one would be"


def _page_step(lake: Path, run_id: str) -> str:
    text = (lake / "_runs" / run_id / "report.html").read_text()
    return text.split("<p>step ", 1)[1].split(",", 1)[0]


def test_follow_rewrites_a_throttled_report_when_it_stops(tmp_path):
    from trainer.continuous import follow

    lake = tmp_path / "lake"
    _add(lake, 1)
    config = _config(lake)
    calls: list = []

    def after(result) -> None:
        calls.append(result)
        if len(calls) == 1:
            _add(lake, 2)  # the second call trains it; its report is throttled (report_every_s)

    follow(*trainer_args(config), poll_interval_s=0, max_polls=2, watch_s=None, report_every_s=3600,
           report_cpu_share=1.0, on_result=after)
    assert calls[0].report_path is not None and calls[1].report_path is None, "the second drawing was throttled"
    assert _page_step(lake, calls[1].run_id) == str(calls[1].step) != str(calls[0].step), "redrawn at the stop"


def test_once_rewrites_a_report_older_than_its_checkpoint(tmp_path):
    lake = tmp_path / "lake"
    _add(lake, 1)
    _add(lake, 2)
    first = run_once(*trainer_args(_config(lake)), max_versions=1)
    second = run_once(*trainer_args(_config(lake)), write_report=False)
    assert _page_step(lake, first.run_id) == str(first.step) != str(second.step)
    idle = run_once(*trainer_args(_config(lake)))  # nothing new to train: the stale page is redrawn
    assert idle.versions == [] and idle.report_path is not None
    assert _page_step(lake, first.run_id) == str(second.step)
    assert run_once(*trainer_args(_config(lake))).report_path is None, "a current page is left alone"
