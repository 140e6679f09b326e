"""The live status's per-stage progress: each number equals what the lake and Kafka hold (hand-built lake)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from rich.console import Console

from gemline.gate import append_quality_rows
from gemline.lake import Lake, commit_once
from gemline.progress import StageProgress, pipeline_progress
from gemline.run import status_view
from gemline.supervisor import StageCommand, Supervisor

APP = "ingest:gemline.events"


def _rows(n: int, start: int = 0) -> pa.Table:
    return pa.table({"x": pa.array(range(start, start + n), pa.int64())})


def _check(table: str, version: int, success: bool = True) -> dict:
    return {"table": table, "table_version": version, "run_id": f"{table}{version}", "run_ts_ms": 1_000 + version,
            "expectation": "not_null", "severity": "critical", "success": success, "observed": "", "report_path": ""}


def _freshness_rows(run: str, version: int, rows: int, wall_ms: int) -> list[dict]:
    return [{"run_id": run, "examples_version": version, "hop": hop, "rows": n, "wall_time_ms": wall_ms}
            for hop, n in (("impression->published", rows - 1), ("published->trained", rows),
                           ("impression->trained", rows - 1))]


def _lake(tmp_path) -> Lake:
    """events: 4 ingest batches (3+3+3+3 rows; offsets end at {0: 7, 1: 5}); the build read events@1 then events@2
    (examples@0: 2 rows, examples@1: 3); validated: events@2 (not events@3), examples@0 (not examples@1)."""
    lake = Lake(str(tmp_path / "lake"))
    for v, offsets in enumerate(({"0": 2, "1": 1}, {"0": 3, "1": 3}, {"0": 5, "1": 4}, {"0": 7, "1": 5})):
        commit_once(lake, "events", _rows(3, 3 * v), app_id=APP, version=v, metadata={"end_offsets": offsets})
    commit_once(lake, "examples", _rows(2), app_id="build", version=0, metadata={"events_version": 1})
    commit_once(lake, "examples", _rows(3, 2), app_id="build", version=1, metadata={"events_version": 2})
    append_quality_rows(lake, [_check("events", 2), _check("examples", 0, success=False)])
    return lake


def test_each_stages_progress_is_what_the_lake_and_kafka_hold(tmp_path):
    lake = _lake(tmp_path)
    got = pipeline_progress(lake, ingest_app_id=APP, watermarks=lambda: {0: (0, 10), 1: (0, 5), 2: (4, 6)})
    # Kafka: 10 - 7 + 5 - 5 + (6 - 4, a partition ingest never committed starts at its low watermark) = 5.
    assert got["ingest"] == StageProgress("events@3", 12, 5, "messages")
    # events@3 waits (the newest events version, the only one validation looks at); examples@1 waits; a failed
    # check still counts as validated (the gate decided).
    assert got["validate"] == StageProgress("events@2 examples@0", 2, 2)
    assert got["build"] == StageProgress("events@2", 5, 1)
    # No freshness table yet: both examples versions wait for the trainer.
    assert got["train"] == StageProgress("", None, 2)


def test_the_trainers_progress_is_its_newest_runs(tmp_path):
    lake = _lake(tmp_path)
    # An earlier run trained examples@0..1; the current one (newest wall time) has trained examples@0 only.
    rows = [*_freshness_rows("old", 0, 2, 100), *_freshness_rows("old", 1, 3, 200), *_freshness_rows("new", 0, 2, 300)]
    commit_once(lake, "freshness", pa.Table.from_pylist(rows), app_id="trainer", version=0)
    assert pipeline_progress(lake)["train"] == StageProgress("examples@0", 2, 1)
    assert "ingest" not in pipeline_progress(lake)  # no writer id: ingest's row stays blank
    # Versions that published nothing leave the trainer nothing to do (it writes no freshness rows for them):
    # they are not lag. examples@2 and @3 are empty, @4 has rows.
    commit_once(lake, "examples", _rows(0), app_id="build", version=2, metadata={"events_version": 3})
    commit_once(lake, "examples", _rows(0), app_id="build", version=3, metadata={"events_version": 3})
    assert pipeline_progress(lake)["train"] == StageProgress("examples@0", 2, 1)
    commit_once(lake, "examples", _rows(2, 9), app_id="build", version=4, metadata={"events_version": 3})
    assert pipeline_progress(lake)["train"] == StageProgress("examples@0", 2, 2)


def test_an_empty_lake_and_an_unreachable_broker_show_as_unknown(tmp_path):
    def down():
        raise TimeoutError("Kafka at 127.0.0.1:1 unreachable")

    empty = pipeline_progress(Lake(str(tmp_path / "empty")), ingest_app_id=APP, watermarks=down)
    assert empty == {"ingest": StageProgress(lag_unit="messages"), "validate": StageProgress(),
                     "build": StageProgress(), "train": StageProgress(), "distill": StageProgress()}
    # The lake's part of ingest still shows when Kafka does not answer.
    assert pipeline_progress(_lake(tmp_path), ingest_app_id=APP, watermarks=down)["ingest"] == StageProgress(
        "events@3", 12, None, "messages")


def _cells(view, width: int) -> dict[str, list[str]]:
    console = Console(record=True, width=width)
    console.print(view)
    return {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in console.export_text().splitlines() if line.count("│") > 5}


@pytest.mark.parametrize("width", [80, 160])
def test_the_status_table_shows_each_stages_last_version_rows_and_lag(tmp_path, width):
    lake = _lake(tmp_path)
    sup = Supervisor([StageCommand("ingest", ("true",)), StageCommand("build", ("true",)),
                      StageCommand("train", ("true",))], log_dir=tmp_path / "logs")
    progress = pipeline_progress(lake, ingest_app_id=APP, watermarks=lambda: {0: (0, 1_007), 1: (0, 5)})
    cells = _cells(status_view(sup, lake, progress=progress, width=width), width)
    # On an 80-column terminal the pid, uptime and log line give way; the numbers stay whole.
    first = 4 if width >= 120 else 2
    assert cells["ingest"][first:first + 3] == ["events@3", "12", "1,000 messages"]
    assert cells["build"][first:first + 3] == ["events@2", "5", "1 version"]
    assert cells["train"][first:first + 3] == ["", "", "2 versions"]


def _dead(reasons: list[str]) -> pa.Table:
    return pa.table({"reason": pa.array(reasons, pa.string())})


def _ranges(*counts: int) -> dict:
    return {"offset_ranges": [{"partition": p, "start": 10, "end": 10 + n} for p, n in enumerate(counts)]}


def test_the_ingest_row_counts_dead_letter_and_a_mostly_dead_batch_is_said_once(tmp_path):
    """Issue 20: a rerun with the same generate.seed dead-lettered every record as duplicate_conflict and the live
    table showed nothing. Hand case: batch 0 reads 4 records (1 dead), batch 1 reads 5 (4 dead, 3 conflicts),
    batch 2 reads 2 (none dead)."""
    from gemline.progress import DeadLetterShare, dead_letter_warning, ingest_progress, last_ingest_dead_letter
    from gemline.run import dead_letter_watch

    lake = Lake(str(tmp_path / "lake"))
    commit_once(lake, "dead_letter", _dead(["not_json"]), app_id=APP, version=0, metadata=_ranges(3, 1))
    commit_once(lake, "events", _rows(3), app_id=APP, version=0, metadata=_ranges(3, 1))
    first = last_ingest_dead_letter(lake, APP)
    assert first == DeadLetterShare(0, 4, 1, {"not_json": 1}) and first.share == 0.25
    assert dead_letter_warning(first) is None  # a quarter: no warning

    reasons = ["duplicate_conflict", "not_json", "duplicate_conflict", "duplicate_conflict"]
    commit_once(lake, "dead_letter", _dead(reasons), app_id=APP, version=1, metadata=_ranges(2, 3))
    commit_once(lake, "events", _rows(1, 3), app_id=APP, version=1, metadata=_ranges(2, 3))
    second = last_ingest_dead_letter(lake, APP)
    assert second == DeadLetterShare(1, 5, 4, {"duplicate_conflict": 3, "not_json": 1})
    line = dead_letter_warning(second)
    assert line is not None
    assert line.startswith("warning: ingest batch 1 sent 4 of its 5 records (80%) to dead_letter, most as "
                           "duplicate_conflict (3)")
    assert "same generate.seed" in line
    # The table's ingest row: 4 events, 5 dead-letter rows in all.
    progress = ingest_progress(lake, APP, None)
    assert (progress.rows, progress.dead_letter) == (4, 5)
    assert progress.rows_cell() == "4 (dead-letter 5)"
    assert StageProgress(rows=120_000).rows_cell() == "120,000"  # no dead_letter table: the plain count

    said: list[str] = []
    check = dead_letter_watch(lake, APP, said.append)
    check()
    check()
    assert said == [line]  # once

    # The newest batch dead-lettered nothing: nothing to say about it.
    commit_once(lake, "events", _rows(2, 4), app_id=APP, version=2, metadata=_ranges(2))
    assert last_ingest_dead_letter(lake, APP) is None
    assert dead_letter_warning(DeadLetterShare(3, 10, 5, {"not_json": 5})) is None  # half is not above half
    other = dead_letter_warning(DeadLetterShare(3, 10, 6, {"too_large": 6}))
    assert other is not None and "too_large (6)" in other and "generate.seed" not in other
