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
                     "build": StageProgress(), "train": StageProgress()}
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
