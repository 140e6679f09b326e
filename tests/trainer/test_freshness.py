"""trainer.freshness: p50/p95/p99 of impression -> published -> trained per examples version, hand-checked on a
small case, checked row by row against the continuous trainer's own step order, and written once per version
across a crash between the freshness commit and the checkpoint."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from deltalake import DeltaTable

import trainer.continuous as continuous
from gemline.lake import read_table, table_uri
from tests.conftest import trainer_args
from trainer import freshness
from trainer.continuous import run_once
from trainer.run_report import freshness_series

from .conftest import synthetic_examples
from .test_continuous import _add, _config

T0 = 1_900_000_000_000  # the fake clock's first reading, ms


def test_quantiles_of_a_hand_checked_version():
    # Published at 10 s. Row 0 corrects an earlier example (impression at 0 s): out of the impression hops.
    # Steps 1, 2, 3 end at 12 s, 15 s, 16 s; rows 0-1 in step 1, rows 2-3 in step 2, row 4 in step 3.
    clock = freshness.VersionClock()
    clock.add_step(np.array([0, 1000]), np.array([True, False]), 1, 12_000)
    clock.add_step(np.array([2000, 3000]), np.array([False, False]), 2, 15_000)
    clock.add_step(np.array([9000]), np.array([False]), 3, 16_000)
    rows = {r["hop"]: r for r in clock.rows("run", 7, published_ms=10_000, now_ms=99)}
    got = {hop: (r["rows"], r["p50_s"], r["p95_s"], r["p99_s"], r["step_first"], r["step_last"])
           for hop, r in rows.items()}
    # impression->published: 9, 8, 7, 1 s -> sorted 1 7 8 9; linear quantiles at positions 1.5, 2.85, 2.97.
    # published->trained: 2, 2, 5, 5, 6 s -> positions 2, 3.8, 3.96.
    # impression->trained: 11, 13, 12, 7 s -> sorted 7 11 12 13.
    want = {"impression->published": (4, 7.5, 8.85, 8.97, 1, 3), "published->trained": (5, 5.0, 5.8, 5.96, 1, 3),
            "impression->trained": (4, 11.5, 12.85, 12.97, 1, 3)}
    assert got.keys() == want.keys() and all(got[hop] == pytest.approx(want[hop]) for hop in want)
    assert all(r["run_id"] == "run" and r["examples_version"] == 7 and r["published_ms"] == 10_000
               and r["wall_time_ms"] == 99 for r in rows.values())


def test_a_version_of_corrections_only_has_only_the_published_hop_and_no_steps_no_rows():
    clock = freshness.VersionClock()
    assert clock.rows("run", 0, published_ms=0, now_ms=0) == []
    clock.add_step(np.array([0, 1000]), np.array([True, True]), 4, 3_000)
    assert [(r["hop"], r["rows"], r["p50_s"]) for r in clock.rows("run", 0, published_ms=2_000, now_ms=0)] == [
        ("published->trained", 2, 1.0)]
    with pytest.raises(ValueError, match="one length"):
        freshness.freshness_rows("run", 0, 0, np.zeros(2), np.zeros(3), np.zeros(2, bool), np.zeros(2), 0)


def _with_corrections(day: int, every: int | None) -> pa.Table:
    """200 synthetic examples of 2026-01-DAY with a ``corrects_example_id`` column, set on every ``every``-th row."""
    table = synthetic_examples([f"2026-01-{day:02d}"], 200, seed=day)
    ids = [f"old-{i}" if every and i % every == 0 else None for i in range(table.num_rows)]
    return table.append_column("corrects_example_id", pa.array(ids, pa.string()))


@pytest.fixture
def fake_clock(monkeypatch):
    """``freshness.wall_ms`` reads T0, T0 + 1 s, T0 + 2 s, ...; returns the list of readings handed out."""
    readings: list[int] = []
    ticks = itertools.count()

    def wall_ms() -> int:
        readings.append(T0 + 1000 * next(ticks))
        return readings[-1]

    monkeypatch.setattr(freshness, "wall_ms", wall_ms)
    return readings


def _reference(lake, tables: list[pa.Table], step_ends: list[int], batch: int = 64, seed: int = 0) -> dict:
    """The freshness rows recomputed from the trainer's documented order: version v's rows shuffled by
    ``default_rng([seed, v, 0, 0])`` (one file, one read batch), cut into steps of ``batch`` rows."""
    history = {e["version"]: e["timestamp"] for e in DeltaTable(table_uri(lake, "examples")).history()}
    out, ends = {}, iter(step_ends)
    for version, table in enumerate(tables):
        order = np.random.default_rng([seed, version, 0, 0]).permutation(table.num_rows)
        trained = np.empty(table.num_rows, dtype=np.int64)
        for i in range(0, len(order), batch):
            trained[order[i: i + batch]] = next(ends)
        event = table["event_time_ms"].to_numpy()
        fresh = ~table["corrects_example_id"].is_valid().to_numpy(zero_copy_only=False)
        published = history[version]
        for hop, delays in (("impression->published", published - event[fresh]),
                            ("published->trained", trained - published),
                            ("impression->trained", trained[fresh] - event[fresh])):
            out[(version, hop)] = (len(delays), *np.quantile(delays / 1000.0, [0.5, 0.95, 0.99]))
    return out


def test_the_trainer_writes_each_versions_quantiles_over_its_rows_steps(tmp_path, fake_clock):
    lake = tmp_path / "lake"
    tables = [_with_corrections(1, None), _with_corrections(2, 5)]
    for day, table in enumerate(tables, start=1):
        _add(lake, day, table=table)
    result = run_once(*trainer_args(_config(lake)))
    written = read_table(str(lake), "freshness").to_pylist()
    assert sorted(written, key=lambda r: (r["examples_version"], r["hop"])) == sorted(
        result.freshness, key=lambda r: (r["examples_version"], r["hop"]))
    now = {r["wall_time_ms"] for r in written}
    step_ends = [t for t in fake_clock if t not in now]
    assert len(step_ends) == 2 * 4, "200 rows in batches of 64: 4 steps per version, each timed once"
    want = _reference(lake, tables, step_ends)
    got = {(r["examples_version"], r["hop"]): (r["rows"], r["p50_s"], r["p95_s"], r["p99_s"]) for r in written}
    assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k], rel=0, abs=1e-6) for k in want)
    assert got[(1, "impression->trained")][0] == 200 - 40, "every 5th row of version 1 is a correction"
    assert {(r["examples_version"], r["step_first"], r["step_last"]) for r in written} == {(0, 1, 4), (1, 5, 8)}
    assert {r["run_id"] for r in written} == {result.run_id}
    series = freshness_series(written, result.run_id)
    assert series["impression->trained"]["p99_s"] == [(v, got[(v, "impression->trained")][3]) for v in (0, 1)]
    page = Path(result.report_path).read_text()
    assert "freshness of the trained rows" in page and page.count("data:image/png;base64,") == 6


def test_a_crash_after_the_freshness_commit_and_before_the_checkpoint_writes_the_version_once(
        tmp_path, fake_clock, monkeypatch):
    lake = tmp_path / "lake"
    for day in (1, 2):
        _add(lake, day)
    real_save, saves = continuous.local_engine, {"n": 0}

    def engine_that_dies_saving_version_1(*args, **kwargs):
        engine = real_save(*args, **kwargs)
        save = engine.save

        def dying_save(*a, **k):
            saves["n"] += 1
            if saves["n"] == 2:  # version 1's freshness is committed, its checkpoint not begun
                raise KeyboardInterrupt("killed")
            return save(*a, **k)

        engine.save = dying_save  # type: ignore[method-assign]
        return engine

    monkeypatch.setattr(continuous, "local_engine", engine_that_dies_saving_version_1)
    with pytest.raises(KeyboardInterrupt):
        run_once(*trainer_args(_config(lake)))
    before = read_table(str(lake), "freshness").to_pylist()
    assert sorted({r["examples_version"] for r in before}) == [0, 1]
    monkeypatch.setattr(continuous, "local_engine", real_save)

    again = run_once(*trainer_args(_config(lake)))
    assert [r["version"] for r in again.versions] == [1], "version 1 is trained again from version 0's checkpoint"
    assert {r["examples_version"] for r in again.freshness} == {1}, "and measured again, at later step ends"
    after = read_table(str(lake), "freshness").to_pylist()
    keys = [(r["examples_version"], r["hop"]) for r in after]
    assert len(keys) == len(set(keys)) == 2 * 3, "each (version, hop) written once"
    first_try = {(r["examples_version"], r["hop"]): r["p50_s"] for r in before}
    assert {(r["examples_version"], r["hop"]): r["p50_s"] for r in after} == first_try, "the first commit stands"
    assert all(r["p50_s"] > first_try[(1, r["hop"])] for r in again.freshness if r["hop"] != "impression->published")
