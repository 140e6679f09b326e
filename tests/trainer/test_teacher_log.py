"""trainer.teacher_log: the continuous teacher logs each progressive evaluation's predictions and vectors to
``teacher_predictions``, one row per (example_id, teacher step), exactly once across a SIGKILL between the write and
the checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from gemline.config import load_config
from gemline.lake import read_table
from tests.conftest import trainer_args
from trainer.continuous import run_once

from .test_continuous import SMALL, _add

ROOT = Path(__file__).resolve().parents[2]
LOGGED = {**SMALL, "trainer.log_teacher_predictions": "true"}


def _rows(lake) -> list[dict]:
    table = read_table(str(lake), "teacher_predictions")
    return [] if table is None else table.to_pylist()


def test_gem_logs_what_it_predicted_before_training_with_its_vectors(tmp_path):
    lake = tmp_path / "lake"
    for day in (1, 2, 3):
        _add(lake, day, rows=120)
    seen = {}
    config = load_config(overrides={"lake": str(lake), **SMALL, "trainer.model": "gem"})
    assert config.trainer.logs_teacher_predictions, "on by default for gem"
    out = run_once(*trainer_args(config),
                   on_predictions=lambda p: seen.update({p.version: dict(zip(p.example_ids, p.probs[:, 0]))}))
    rows = _rows(lake)
    steps = {v["version"]: v["step"] for v in out.versions}
    assert sorted({r["examples_version"] for r in rows}) == [1, 2], "version 0 is not evaluated (no model yet)"
    assert len(rows) == 240 and len({(r["example_id"], r["teacher_step"]) for r in rows}) == 240
    for r in rows:
        version = r["examples_version"]
        # The predicting parameters are those after the previous version's training, i.e. its checkpoint.
        assert r["teacher_step"] == steps[version - 1]
        assert r["p_click"] == seen[version][r["example_id"]]
        assert len(r["user_vector"]) == len(r["candidate_vector"]) == 16 and len(r["representation"]) == 32
    by_version = {r["examples_version"]: r for r in rows}
    assert by_version[1]["teacher_data_ms"] == max(_event_ms(lake, 0)), "the newest event the teacher trained on"
    assert by_version[1]["teacher_checkpoint_ms"] <= by_version[2]["teacher_checkpoint_ms"]
    assert not np.allclose(by_version[1]["user_vector"], by_version[2]["user_vector"]), "vectors of real rows"


def _event_ms(lake, version: int) -> list[int]:
    table = read_table(str(lake), "examples", version)
    assert table is not None
    if version > 0:
        before = read_table(str(lake), "examples", version - 1)
        assert before is not None
        ids = set(before["example_id"].to_pylist())
        return [r["event_time_ms"] for r in table.to_pylist() if r["example_id"] not in ids]
    return table["event_time_ms"].to_pylist()


def test_off_for_other_models_by_default(tmp_path):
    lake = tmp_path / "lake"
    for day in (1, 2):
        _add(lake, day, rows=80)
    run_once(*trainer_args(load_config(overrides={"lake": str(lake), **SMALL})))
    assert _rows(lake) == []


_KILLER = r"""
import json, os, signal, sys
import trainer.teacher_log as teacher_log
from gemline.config import load_config
from tests.conftest import trainer_args
from trainer.continuous import run_once

lake, k, overrides = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
real, calls = teacher_log.append_predictions, {"n": 0}

def append_then_die(*args, **kwargs):
    out = real(*args, **kwargs)
    calls["n"] += 1
    if calls["n"] == k:  # the rows are committed; the version's training and checkpoint are not
        os.kill(os.getpid(), signal.SIGKILL)
    return out

teacher_log.append_predictions = append_then_die
run_once(*trainer_args(load_config(overrides={"lake": lake, **overrides})))
print("finished without being killed")
"""


def test_a_sigkill_between_the_write_and_the_checkpoint_then_a_restart_logs_each_row_once(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for lake in (straight, killed):
        for day in (1, 2, 3):
            _add(lake, day, rows=100)
    run_once(*trainer_args(load_config(overrides={"lake": str(straight), **LOGGED})))
    for k in (1, 2):  # killed after version 1's rows; restarted (version 1 again, its commit skipped), after version 2's
        proc = subprocess.run([sys.executable, "-c", _KILLER, str(killed), str(k), json.dumps(LOGGED)], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
        assert proc.returncode == -signal.SIGKILL, f"kill {k}: {proc.stdout[-500:]}{proc.stderr[-2000:]}"
        assert {r["examples_version"] for r in _rows(killed)} == set(range(1, k + 1)), "the rows were committed"
    run_once(*trainer_args(load_config(overrides={"lake": str(killed), **LOGGED})))

    got, want = _rows(killed), _rows(straight)
    keys = [(r["example_id"], r["teacher_step"]) for r in got]
    assert len(keys) == len(set(keys)) == 200, "each (example, teacher step) exactly once"
    want_by_key = {(r["example_id"], r["teacher_step"]): r for r in want}
    assert set(want_by_key) == set(keys), "the same rows as an uninterrupted run"
    for r in got:
        ref = want_by_key[(r["example_id"], r["teacher_step"])]
        assert abs(r["p_click"] - ref["p_click"]) < 1e-6 and abs(r["p_conversion"] - ref["p_conversion"]) < 1e-6
        assert r["teacher_data_ms"] == ref["teacher_data_ms"]


def test_prediction_rows_keep_each_vector_whole_and_null_where_the_model_has_none():
    from trainer.teacher_log import TEACHER_PREDICTIONS_SCHEMA, prediction_rows

    user = [np.array([0.5, -1.0, 2.0], np.float32), np.array([3.0, 0.25, -0.125], np.float32)]
    ragged = [np.array([1.0], np.float32), None]  # not one width for every row: the per-row path
    rows = prediction_rows(example_ids=np.array(["x0", "x1"], dtype=object), domains=np.array(["a", None], dtype=object),
                           probs=np.array([[0.1, 0.2], [0.3, 0.4]]), run_id="r", step=7, checkpoint_ms=5, data_ms=4,
                           version=2, vectors={"user_vector": user, "candidate_vector": ragged,
                                               "representation": [None, None]})
    assert rows.schema.equals(TEACHER_PREDICTIONS_SCHEMA)
    assert rows["user_vector"].to_pylist() == [[0.5, -1.0, 2.0], [3.0, 0.25, -0.125]]
    assert rows["candidate_vector"].to_pylist() == [[1.0], None]
    assert rows["representation"].to_pylist() == [None, None]
    assert rows["domain"].to_pylist() == ["a", None] and rows["teacher_step"].to_pylist() == [7, 7]
