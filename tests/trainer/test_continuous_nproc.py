"""``gemline train --once --nproc 2``: the continuous trainer on two gloo ranks (torchrun, CPU).

Two increments, ``--once`` after each: every row is trained once, the progressive evaluation of the second
version is written once (by rank 0), the second run resumes from the first's sharded checkpoint, and the
losses and progressive metrics are those of the one-process run on a copy of the same lake (within 1e-5:
the reduction order differs, tests/trainer/test_distributed.py). The first version has 193 rows, so its
last global batch (1 row) is smaller than the world: the rank without a row must count zero.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gemline.config import load_config
from gemline.lake import read_table
from tests.conftest import trainer_args
from trainer.continuous import run_once

from .conftest import mark_quality, synthetic_examples, write_examples
from .test_continuous import SMALL

REPO = Path(__file__).resolve().parents[2]
ROWS = (193, 200)
"""Rows of examples@0 and examples@1: 4 steps each in batches of 64 (193 = 3 x 64 + 1)."""


def _add(lake: Path, version: int) -> None:
    assert write_examples(lake, synthetic_examples([f"2026-01-0{version + 1}"], ROWS[version], seed=version)) == version
    mark_quality(lake, version, passed=True)


@pytest.mark.integration
def test_once_twice_on_two_ranks_trains_each_row_once_and_resumes(tmp_path, monkeypatch, capsys):
    from gemline.cli import main

    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the ranks import this checkout's trainer
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    sharded, single = tmp_path / "sharded", tmp_path / "single"
    _add(sharded, 0)
    shutil.copytree(sharded, single)
    sets = [x for k, v in SMALL.items() for x in ("--set", f"{k}={v}")]

    assert main(["train", "--once", "--nproc", "2", "--lake", str(sharded), *sets]) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(v["version"], v["rows_trained"], v["evaluated"]) for v in first["versions"]] == [(0, 193, False)]
    assert (first["rows_trained_total"], first["step"]) == (193, 4) and first["progressive"] == []

    _add(sharded, 1)
    second = run_once(*trainer_args(load_config(overrides={"lake": str(sharded), **SMALL})), nproc=2)
    assert second.run_id == first["run_id"], "the second run resumes the first"
    assert [(v["version"], v["rows_trained"], v["evaluated"]) for v in second.versions] == [(1, 200, True)]
    assert (second.rows_trained_total, second.step) == (393, 8)

    everything = read_table(str(sharded), "training_metrics").to_pylist()
    metrics = [r for r in everything if r["task"] != "ids"]
    # One evaluation (examples@1) x 2 tasks x (overall + 3 domains) x 5 metrics, written by rank 0 only; and the
    # id mapping's counts after each of the 2 versions: 10 namespaces x 5 metrics.
    assert len(metrics) == 2 * 4 * 5
    assert sorted({r["examples_version"] for r in everything if r["task"] == "ids"}) == [0, 1]
    assert len(everything) - len(metrics) == 2 * 10 * 5
    assert {(r["run_id"], r["examples_version"], r["step"]) for r in metrics} == {(first["run_id"], 1, 4)}
    meta = json.loads((Path(second.checkpoint_path) / "meta.json").read_text())
    assert Path(second.checkpoint_path).name == "step-8" and meta["extra"]["world_size"] == 2
    assert (Path(meta["extra"]["sharded"]) / ".metadata").is_file()
    assert meta["extra"]["continuous"]["cursor"]["version"] == 2
    assert [v["rows_trained"] for v in meta["extra"]["continuous"]["lineage"]] == list(ROWS)

    one = load_config(overrides={"lake": str(single), **SMALL})
    reference = run_once(*trainer_args(one)).versions
    _add(single, 1)
    reference += run_once(*trainer_args(one)).versions
    ours = [*first["versions"], *second.versions]
    assert [v["mean_loss"] for v in ours] == pytest.approx([v["mean_loss"] for v in reference], rel=1e-5)
    single_ne = [r["value"] for r in read_table(str(single), "training_metrics").to_pylist()
                 if (r["domain"], r["task"], r["metric"]) == ("all", "click", "ne")]
    sharded_ne = [r["value"] for r in metrics if (r["domain"], r["task"], r["metric"]) == ("all", "click", "ne")]
    assert sharded_ne == pytest.approx(single_ne, rel=1e-5)


@pytest.mark.integration
def test_resuming_a_one_process_run_on_two_ranks_is_one_line(tmp_path, monkeypatch, capsys):
    """The ranks stop on the checkpoint they cannot resume (no DCP shards); the CLI prints rank 0's reason."""
    from gemline.cli import main

    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    lake = tmp_path / "lake"
    _add(lake, 0)
    sets = [x for k, v in SMALL.items() for x in ("--set", f"{k}={v}")]
    assert main(["train", "--once", "--lake", str(lake), *sets]) == 0
    _add(lake, 1)
    capsys.readouterr()
    assert main(["train", "--once", "--nproc", "2", "--lake", str(lake), *sets]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no sharded state" in err[0] and "--from-scratch" in err[0], err
    # Only the first run's id counts of examples@0 (trainer.id_mapping): the refused run evaluated nothing.
    written = read_table(str(lake), "training_metrics").to_pylist()
    assert {(r["task"], r["examples_version"]) for r in written} == {("ids", 0)}, "the refused run evaluated nothing"


@pytest.mark.integration
def test_a_sigkill_of_a_sharded_run_then_a_restart_trains_each_row_once(tmp_path):
    """``train --once --nproc 2``: its launcher SIGKILLed once the first checkpoint is complete, while it trains
    the next versions. torchrun and both ranks die with it (gemline.process.die_with_parent: torchrun starts
    ranks in sessions of their own, so they would train on without the lake's lock); a second ``--once --nproc
    2`` finishes: every row trained once, each version's mean loss within 1e-5 of a one-process run's, metrics
    written once."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from trainer.continuous import current_root

    killed, single = tmp_path / "killed", tmp_path / "single"
    rows = (193, 200, 200, 200)
    for version, n in enumerate(rows):
        assert write_examples(killed, synthetic_examples([f"2026-01-0{version + 1}"], n, seed=version)) == version
        mark_quality(killed, version, passed=True)
    shutil.copytree(killed, single)
    sets = [x for k, v in SMALL.items() for x in ("--set", f"{k}={v}")]
    cmd = [sys.executable, "-m", "gemline.cli", "train", "--once", "--nproc", "2", "--lake", str(killed), *sets]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    try:
        while not list((Path(current_root(str(killed))) / "_checkpoints").glob("step-*/meta.json")):
            assert proc.poll() is None, "the run ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)  # the launcher alone, as the OOM killer or `kill -9` would
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL

    def job_alive() -> bool:  # torchrun or a rank of this lake still running
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if str(killed).encode() in cmdline.read_bytes():
                    return True
            except OSError:
                continue
        return False

    while job_alive():
        assert time.monotonic() < deadline + 30, "torchrun or a rank outlived its launcher"
        time.sleep(0.1)
    done = [json.loads(p.read_text())["extra"]["continuous"]["cursor"]["version"]
            for p in (Path(current_root(str(killed))) / "_checkpoints").glob("step-*/meta.json")]
    assert max(done) < len(rows), "killed before the last version: the restart has work left"

    resumed = run_once(*trainer_args(load_config(overrides={"lake": str(killed), **SMALL})), nproc=2)
    assert resumed.rows_trained_total == sum(rows), "every row trained once across the two runs"
    meta = json.loads((Path(resumed.checkpoint_path) / "meta.json").read_text())
    lineage = meta["extra"]["continuous"]["lineage"]
    assert [(v["version"], v["rows_trained"]) for v in lineage] == list(enumerate(rows))
    reference = run_once(*trainer_args(load_config(overrides={"lake": str(single), **SMALL}))).versions
    assert [v["mean_loss"] for v in lineage] == pytest.approx([v["mean_loss"] for v in reference], rel=1e-5)
    metrics = read_table(str(killed), "training_metrics").to_pylist()
    keys = [(r["examples_version"], r["task"], r["domain"], r["metric"]) for r in metrics]
    # Versions 1-3 evaluated once each, and the id counts (10 namespaces x 5 metrics) of versions 0-3 once each.
    assert len(keys) == len(set(keys)) == 3 * 2 * 4 * 5 + 4 * 10 * 5, "versions 1-3 evaluated once each"
