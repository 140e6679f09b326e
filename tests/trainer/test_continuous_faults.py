"""The continuous trainer under faults and odd inputs (issue 13): a SIGKILL at seeded points of a real process,
then a restart, trains every gate-allowed example exactly once and ends at an uninterrupted run's parameters;
empty and compaction versions, late bootstraps, vacuumed files, and new, missing or retyped columns."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from deltalake import write_deltalake

from gemline.increments import CursorError
from gemline.lake import read_table, table_uri
from tests.conftest import trainer_args
from trainer.continuous import current_root, run_once

from .conftest import mark_quality, synthetic_examples
from .test_continuous import SMALL, _add, _config, _params

ROOT = Path(__file__).resolve().parents[2]

# A process that trains with one function wrapped to SIGKILL itself at its k-th call: the wrapped function
# marks where in the run the kill lands. Nothing is caught: the process dies as under `kill -9`.
_KILLER = r"""
import json, os, signal, sys
import torch
import trainer.continuous as continuous
import trainer.loop as loop
from gemline.config import load_config
from tests.conftest import trainer_args

lake, point, k, overrides = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
calls = {"n": 0}

def die_at_k(real, before):
    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if before and calls["n"] == k:
            os.kill(os.getpid(), signal.SIGKILL)
        out = real(*args, **kwargs)
        if not before and calls["n"] == k:
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    return wrapped

if point == "between_read_and_step":    # a batch read and encoded, the step not begun
    loop.train_step = die_at_k(loop.train_step, before=True)
elif point == "mid_step":               # gradients computed, no optimiser has stepped
    torch.Tensor.backward = die_at_k(torch.Tensor.backward, before=False)
elif point == "mid_checkpoint":         # state.pt written, meta.json (the completion mark) not
    torch.save = die_at_k(torch.save, before=False)
elif point == "after_checkpoint":       # a complete checkpoint, not yet pruned, no run report
    continuous._prune = die_at_k(continuous._prune, before=True)
continuous.run_once(*trainer_args(load_config(overrides={"lake": lake, **overrides})))
print("finished without being killed")
"""

# Calls of each wrapped function in an uninterrupted run of three 200-row versions in batches of 64:
# 4 steps (and backward passes) per version, one checkpoint (one torch.save, one prune) per version.
_CALLS = {"between_read_and_step": 12, "mid_step": 12, "mid_checkpoint": 3, "after_checkpoint": 3}


@pytest.mark.parametrize("point", sorted(_CALLS))
def test_a_sigkill_at_a_seeded_point_then_a_restart_trains_each_example_once(tmp_path, point):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for day in (1, 2, 3):
        _add(straight, day)
    shutil.copytree(straight, killed)
    reference = run_once(*trainer_args(_config(straight)))
    k = random.Random(f"{point}-13").randint(1, _CALLS[point])
    proc = subprocess.run([sys.executable, "-c", _KILLER, str(killed), point, str(k), json.dumps(SMALL)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, f"k={k}: {proc.stdout[-500:]}{proc.stderr[-2000:]}"

    out = run_once(*trainer_args(_config(killed)))
    lineage = json.loads(json.dumps(out.versions))
    before_kill = 3 - len(lineage)
    assert [r["version"] for r in lineage] == list(range(before_kill, 3)), "the restart goes on where the kill left"
    assert out.rows_trained_total == 600 and out.step == reference.step, "each example trained exactly once"
    folder = Path(current_root(str(killed))) / "_checkpoints"
    complete = sorted((int(p.name.split("-")[1]), p) for p in folder.iterdir() if (p / "meta.json").is_file())
    newest = str(complete[-1][1])
    assert out.checkpoint_path in (None, newest), "a restart with nothing left to train writes no checkpoint"
    want, got = _params(reference.checkpoint_path), _params(newest)
    assert all(torch.allclose(want[name], got[name], atol=1e-6, rtol=0) for name in want), f"k={k}"
    metrics = read_table(str(killed), "training_metrics").to_pylist()
    keys = [(r["examples_version"], r["task"], r["domain"], r["metric"]) for r in metrics]
    # 2 evaluations x 2 tasks x (overall + 3 domains) x 5 metrics, and 3 versions' id counts (10 namespaces x 5, the width included)
    assert len(keys) == len(set(keys)) == 2 * 2 * 4 * 5 + 3 * 10 * 5, "each evaluation and id count written once"
    hops = [(r["examples_version"], r["hop"]) for r in read_table(str(killed), "freshness").to_pylist()]
    assert len(hops) == len(set(hops)) == 3 * 3, "each version's freshness written once"


def test_versions_after_a_bootstrap_and_a_range_past_the_newest_version(tmp_path):
    lake = tmp_path / "lake"
    for day in range(1, 7):  # versions 0-5
        _add(lake, day, rows=70)
    first = run_once(*trainer_args(_config(lake)))
    assert [r["version"] for r in first.versions] == [0, 1, 2, 3, 4, 5] and first.cursor.version == 6
    nothing = run_once(*trainer_args(_config(lake)))  # the cursor is past the newest version: an empty range, not an error
    assert nothing.versions == [] and nothing.cursor == first.cursor and nothing.step == first.step
    _add(lake, 7, rows=70)
    _add(lake, 8, rows=70)
    later = run_once(*trainer_args(_config(lake)))
    assert [(r["version"], r["rows_trained"], r["evaluated"]) for r in later.versions] == [(6, 70, True), (7, 70, True)]
    assert later.rows_trained_total == 8 * 70


def test_an_empty_version_moves_the_cursor_without_a_step(tmp_path):
    lake = tmp_path / "lake"
    _add(lake, 1)
    first = run_once(*trainer_args(_config(lake)))
    empty = synthetic_examples(["2026-01-02"], 10, seed=2).slice(0, 0)
    _add(lake, 2, table=empty)
    res = run_once(*trainer_args(_config(lake)))
    assert [(r["version"], r["rows_trained"], r["evaluated"]) for r in res.versions] == [(1, 0, False)]
    assert res.step == first.step and res.cursor.version == 2


def test_a_compaction_commit_is_not_trained_again(tmp_path):
    from deltalake import DeltaTable

    lake = tmp_path / "lake"
    _add(lake, 1, rows=100)
    _add(lake, 1, rows=100, table=synthetic_examples(["2026-01-01"], 100, seed=9))  # a second file in that partition
    first = run_once(*trainer_args(_config(lake)))
    metrics = DeltaTable(str(lake / "examples")).optimize.compact()  # dataChange=false: the same rows, new files
    assert metrics["numFilesRemoved"] == 2 and metrics["numFilesAdded"] == 1
    compacted = DeltaTable(str(lake / "examples")).version()
    _add(lake, 3, rows=90)
    res = run_once(*trainer_args(_config(lake)))
    assert [(r["version"], r["rows_trained"]) for r in res.versions] == [(compacted, 0), (compacted + 1, 90)]
    assert res.rows_trained_total == first.rows_trained_total + 90 == 290


def test_a_vacuumed_file_under_the_cursor_is_refused_and_nothing_is_trained(tmp_path):
    lake = tmp_path / "lake"
    _add(lake, 1)
    first = run_once(*trainer_args(_config(lake)))
    _add(lake, 2)
    (added,) = [p for p in (lake / "examples").rglob("*.parquet")
                if p.stat().st_mtime >= max(q.stat().st_mtime for q in (lake / "examples").rglob("*.parquet"))]
    added.unlink()  # as a vacuum with too short a retention would
    with pytest.raises(CursorError, match="--from-scratch|vacuum"):
        run_once(*trainer_args(_config(lake)))
    again_lineage = json.loads(Path(first.checkpoint_path, "meta.json").read_text())
    assert again_lineage["step"] == first.step, "the newest checkpoint is still the one before"


def test_a_new_column_is_trained_as_before_and_logged(tmp_path, caplog):
    plain, wider = tmp_path / "plain", tmp_path / "wider"
    for lake in (plain, wider):
        _add(lake, 1)
        run_once(*trainer_args(_config(lake)))
    second = synthetic_examples(["2026-01-02"], 200, seed=2)
    _add(plain, 2, table=second)
    write_deltalake(table_uri(wider, "examples"), second.append_column("f_campaign_budget", pa.array([1.5] * 200)),
                    mode="append", schema_mode="merge", partition_by=["event_date"])
    mark_quality(wider, 1, passed=True)
    a = run_once(*trainer_args(_config(plain)))
    caplog.clear()
    caplog.set_level("INFO", logger="trainer.continuous")
    b = run_once(*trainer_args(_config(wider)))
    assert [r["rows_trained"] for r in b.versions] == [200]
    noted = [r.getMessage() for r in caplog.records if "does not read" in r.getMessage()]
    assert noted == ["examples@1 has dense columns the model does not read, trained as before: ['f_campaign_budget']"]
    want, got = _params(a.checkpoint_path), _params(b.checkpoint_path)
    assert all(torch.equal(want[n], got[n]) for n in want), "a column the model does not read changes nothing"


@pytest.mark.parametrize("change", ["removed", "retyped"])
def test_a_removed_or_retyped_dense_column_is_one_line_and_nothing_is_trained(tmp_path, capsys, change):
    from gemline.cli import main

    lake = tmp_path / "lake"
    _add(lake, 1)
    first = run_once(*trainer_args(_config(lake)))
    table = synthetic_examples(["2026-01-02"], 200, seed=2)
    column = next(n for n in table.column_names if n.startswith("f_user_"))
    if change == "removed":
        table = table.drop_columns([column])
    else:
        table = table.set_column(table.column_names.index(column), column,
                                 pc.cast(table.column(column), pa.string()))
    # A build that rewrote the table with another schema: the only way a Delta column goes or changes type.
    write_deltalake(table_uri(lake, "examples"), table, mode="overwrite", schema_mode="overwrite",
                    partition_by=["event_date"])
    mark_quality(lake, 1, passed=True)
    sets = [x for k, v in SMALL.items() for x in ("--set", f"{k}={v}")]
    assert main(["train", "--once", "--lake", str(lake), *sets]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and column in err[0], err
    state = json.loads(Path(first.checkpoint_path, "meta.json").read_text())
    assert state["step"] == first.step
    newest = sorted((Path(current_root(str(lake))) / "_checkpoints").glob("step-*"))[-1]
    assert str(newest) == first.checkpoint_path, "nothing was trained or checkpointed"
