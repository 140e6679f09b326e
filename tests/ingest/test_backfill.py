"""backfill_late_events: late_events rows re-admitted to events exactly once, across reruns, crashes,
compaction, and into the build under the point-in-time rule; the `gemline backfill` command."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from deltalake import DeltaTable

import gemline.lake as lake_mod
from gemline.cli import main
from gemline.config import GemlineConfig
from gemline.lake import Lake, commit_once, open_table, read_table, table_uri
from gemline.locks import LakeBusyError, exclusive
from ingest.backfill import BACKFILL_APP_ID, backfill_late_events
from ingest.config import IngestConfig
from ingest.dedup import dates_between
from ingest.pipeline import app_id_for
from ingest.schema import EVENTS_TABLE_SCHEMA, LATE_EVENTS_SCHEMA
from tests.conftest import build_args, ingest_args, quality_sections

DAY = 86_400_000
T = 1_750_000_000_000  # event times of the ingested batches (2025-06-15)
BACKFILL_MS = T + 7 * DAY  # the backfill clock, after every Kafka append time below


def _row(eid: str, t_ms: int, offset: int, *, created: int, partition: int = 0, user: str = "u1",
         item: str = "i1", event_type: str = "engagement") -> dict:
    return {"event_id": eid, "event_time_ms": t_ms, "user_id": user, "item_id": item, "domain": "d1",
            "event_type": event_type, "category": "c1", "position": None, "ad_format": None, "age": None,
            "gender": None, "location": None, "schema_version": 1, "created_ts_ms": created,
            "event_date": dates_between(t_ms, t_ms)[0], "kafka_topic": "events", "kafka_partition": partition,
            "kafka_offset": offset, "event_time_us": t_ms * 1000, "kafka_generation": None}


def _late(row: dict, watermark_ms: int) -> dict:
    return {**row, "watermark_ms": watermark_ms, "lateness_ms": watermark_ms - row["event_time_ms"]}


def _ingest_batch(config: GemlineConfig, k: int, events: list[dict], late: list[dict]) -> None:
    """What ingest batch k commits: late_events, then events, both tagged (ingest:<topic>, k)."""
    app = app_id_for(config.kafka.topic)
    commit_once(config.lake, "late_events", pa.Table.from_pylist(late, schema=LATE_EVENTS_SCHEMA), app_id=app,
                version=k)
    commit_once(config.lake, "events", pa.Table.from_pylist(events, schema=EVENTS_TABLE_SCHEMA), app_id=app,
                version=k, partition_by=["event_date"])


def _events(lake: str) -> list[dict]:
    rows = read_table(lake, "events").to_pylist()
    return sorted(rows, key=lambda r: (r["kafka_partition"], r["kafka_offset"]))


def _config(tmp_path) -> GemlineConfig:
    return GemlineConfig(lake=str(tmp_path / "lake"), ingest=IngestConfig(dedup_window_ms=DAY))


def _readmitted(row: dict) -> dict:
    """The events row a late row becomes: same fields, created_ts_ms raised to the backfill clock."""
    return {**{k: v for k, v in row.items() if k not in ("watermark_ms", "lateness_ms")},
            "created_ts_ms": max(row["created_ts_ms"], BACKFILL_MS)}


def test_readmits_exactly_the_late_rows_then_nothing_then_only_new_ones(tmp_path):
    config = _config(tmp_path)
    a, b = _row("a", T, 0, created=T + 5), _row("b", T + 1, 3, created=T + 6, partition=1)
    x = _row("x", T - 2 * DAY, 1, created=T + 10)
    y = _row("y", T - 3 * DAY, 2, created=BACKFILL_MS + 9)  # an append after the clock: kept, never lowered
    _ingest_batch(config, 0, [a, b], [_late(x, T), _late(y, T)])

    first = backfill_late_events(*ingest_args(config), now_ms=BACKFILL_MS)
    assert (first.late_events_version, first.late_rows_read, first.rows_readmitted, first.duplicates_skipped,
            first.batch_version, first.skipped) == (0, 2, 2, 0, 0, False)
    assert _events(config.lake) == [a, _readmitted(x), _readmitted(y), b]
    assert [r["created_ts_ms"] for r in _events(config.lake)] == [T + 5, BACKFILL_MS, BACKFILL_MS + 9, T + 6]
    assert read_table(config.lake, "events").schema.names == EVENTS_TABLE_SCHEMA.names
    assert sorted(DeltaTable(table_uri(config.lake, "events")).metadata().partition_columns) == ["event_date"]
    assert read_table(config.lake, "late_events").num_rows == 2  # late_events keeps its record

    version = open_table(config.lake, "events").version()
    second = backfill_late_events(*ingest_args(config), now_ms=BACKFILL_MS + 1)
    assert (second.late_events_version, second.rows_readmitted, second.skipped) == (0, 0, True)
    assert open_table(config.lake, "events").version() == version

    # Batch 1: a new late event z; a late second delivery of a (same payload as the copy in events,
    # within the dedup window: a duplicate); a late event b2 sharing b's id with another item (a
    # conflict: kept out, it stays in late_events); two identical late deliveries of w in one batch
    # (the first in Kafka order is kept).
    c = _row("c", T + 2, 4, created=T + 20)
    z = _row("z", T - 4 * DAY, 5, created=T + 21)
    a2 = _row("a", T, 6, created=T + 22)
    b2 = _row("b", T + 1, 8, created=T + 25, item="other")
    w1, w2 = _row("w", T - DAY, 7, created=T + 23), _row("w", T - DAY, 2, created=T + 24, partition=1)
    _ingest_batch(config, 1, [c], [_late(r, T + 2) for r in (w2, a2, z, w1, b2)])
    third = backfill_late_events(*ingest_args(config), now_ms=BACKFILL_MS)
    assert (third.late_events_version, third.late_rows_read, third.rows_readmitted, third.duplicates_skipped,
            third.conflicts_skipped, third.batch_version) == (1, 5, 2, 2, 1, 1)
    ids = [r["event_id"] for r in _events(config.lake)]
    assert sorted(ids) == ["a", "b", "c", "w", "x", "y", "z"]
    kept_w = [r for r in _events(config.lake) if r["event_id"] == "w"]
    assert [(r["kafka_partition"], r["kafka_offset"]) for r in kept_w] == [(0, 7)]
    assert [r["item_id"] for r in _events(config.lake) if r["event_id"] == "b"] == ["i1"]
    assert backfill_late_events(*ingest_args(config), now_ms=BACKFILL_MS).skipped


def test_a_crash_before_or_after_the_commit_then_a_rerun_writes_each_row_once(tmp_path, monkeypatch):
    config = _config(tmp_path)
    late = [_row(f"l{i}", T - DAY - i, i + 1, created=T + i) for i in range(3)]
    _ingest_batch(config, 0, [_row("a", T, 0, created=T)], [_late(r, T) for r in late])
    real = lake_mod.commit_once

    def die_before(*args, **kwargs):
        raise RuntimeError("killed before the commit")

    monkeypatch.setattr(lake_mod, "commit_once", die_before)
    with pytest.raises(RuntimeError, match="killed before"):
        backfill_late_events(*ingest_args(config), now_ms=BACKFILL_MS)
    assert [r["event_id"] for r in _events(config.lake)] == ["a"]

    def die_after(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError("killed after the commit")

    monkeypatch.setattr(lake_mod, "commit_once", die_after)
    with pytest.raises(RuntimeError, match="killed after"):
        backfill_late_events(*ingest_args(config), now_ms=BACKFILL_MS)
    monkeypatch.setattr(lake_mod, "commit_once", real)
    rerun = backfill_late_events(*ingest_args(config), now_ms=BACKFILL_MS + 1)
    assert rerun.skipped and rerun.rows_readmitted == 0
    assert [r["event_id"] for r in _events(config.lake)] == ["a", "l0", "l1", "l2"]
    assert DeltaTable(table_uri(config.lake, "events")).transaction_version(BACKFILL_APP_ID) == 0


def test_compacted_late_events_reads_only_rows_added_since(tmp_path):
    config = _config(tmp_path)
    x = _row("x", T - 2 * DAY, 1, created=T)
    _ingest_batch(config, 0, [_row("a", T, 0, created=T)], [_late(x, T)])
    assert backfill_late_events(*ingest_args(config), now_ms=BACKFILL_MS).rows_readmitted == 1
    z = _row("z", T - 3 * DAY, 3, created=T)
    _ingest_batch(config, 1, [_row("c", T, 2, created=T)], [_late(z, T)])
    DeltaTable(table_uri(config.lake, "late_events")).optimize.compact()  # rewrites x's and z's files into one
    result = backfill_late_events(*ingest_args(config), now_ms=BACKFILL_MS)
    # x is not read again (the file diff would have: it sits in the compacted file); only z is new.
    assert (result.late_rows_read, result.rows_readmitted, result.duplicates_skipped) == (1, 1, 0)
    assert sorted(r["event_id"] for r in _events(config.lake)) == ["a", "c", "x", "z"]


def test_refuses_while_an_ingest_batch_is_half_committed_and_skips_without_late_events(tmp_path):
    config = _config(tmp_path)
    # no tables at all
    assert backfill_late_events(*ingest_args(config), now_ms=BACKFILL_MS).late_events_version is None
    _ingest_batch(config, 0, [_row("a", T, 0, created=T)], [])
    app = app_id_for(config.kafka.topic)
    commit_once(config.lake, "late_events", pa.Table.from_pylist([_late(_row("x", 1, 1, created=T), T)],
                                                                 schema=LATE_EVENTS_SCHEMA), app_id=app, version=1)
    half = r"ingest batch 1 of 'ingest:gemline.events' is in late_events .* `gemline ingest`"
    with pytest.raises(ValueError, match=half):
        backfill_late_events(*ingest_args(config), now_ms=BACKFILL_MS)
    assert [r["event_id"] for r in _events(config.lake)] == ["a"]


def test_holds_the_ingest_lock(tmp_path):
    config = _config(tmp_path)
    _ingest_batch(config, 0, [_row("a", T, 0, created=T)], [_late(_row("x", T - 2 * DAY, 1, created=T), T)])
    with exclusive(config.lake, "ingest"):  # an ingest is running: the backfill must not write events
        with pytest.raises(LakeBusyError, match="another ingest is running"):
            backfill_late_events(*ingest_args(config), now_ms=BACKFILL_MS)
    assert [r["event_id"] for r in _events(config.lake)] == ["a"]


def test_cli_prints_one_json_line(tmp_path, capsys):
    config = _config(tmp_path)
    _ingest_batch(config, 0, [_row("a", T, 0, created=T)], [_late(_row("x", T - 2 * DAY, 1, created=T), T)])
    assert main(["backfill", "--late-events", "--lake", config.lake]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert (summary["rows_readmitted"], summary["duplicates_skipped"], summary["conflicts_skipped"],
            summary["late_events_version"]) == (1, 0, 0, 0)
    assert main(["backfill", "--late-events", "--lake", config.lake]) == 0
    assert json.loads(capsys.readouterr().out)["rows_readmitted"] == 0


def test_cli_backfill_needs_the_late_events_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["backfill", "--lake", str(tmp_path / "lake")])
    assert exit_info.value.code == 2
    assert "--late-events" in capsys.readouterr().err


@pytest.mark.slow
def test_the_build_sees_a_readmitted_event_only_after_its_backfill(tmp_path, examples_layout):
    from sequences.config import BuildConfig
    from sequences.materialize import read_examples
    from sequences.pipeline import run_build
    from validation.run import validate_table

    config = GemlineConfig(lake=str(tmp_path / "lake"),
                           build=BuildConfig(max_seq_len=5, click_window_ms=100, conversion_window_ms=1_000,
                                             examples_layout=examples_layout))
    ev = dict(domain="facebook")
    imp1 = {**_row("imp1", T + 1_000, 0, created=T + 1_001, event_type="impression"), **ev}
    view = {**_row("view", T + 1_500, 1, created=T + 1_501), **ev}
    imp2 = {**_row("imp2", T + 2_000, 3, created=T + 2_001, event_type="impression", item="i2"), **ev}
    # Event time T + 500, appended to Kafka at T + 1_800 (before imp2), but judged late: not in events.
    late = {**_row("late_view", T + 500, 2, created=T + 1_800, item="i3"), **ev}
    _ingest_batch(config, 0, [imp1, view, imp2], [_late(late, T + 1_500 + DAY)])
    assert backfill_late_events(*ingest_args(config), now_ms=T + 5_000).rows_readmitted == 1
    # The backfill is a new events version: it goes through the quality gate like an ingest batch.
    assert validate_table(Lake.for_config(config), "events", now_ms=T + 6_000, **quality_sections(config)).passed
    run_build(*build_args(config), final=True)

    examples = {r["example_id"]: r for r in read_examples(config.lake).to_pylist()}
    # imp2 reached Kafka at T + 2_001, before the backfill at T + 5_000: its history is what was known
    # then. (Had the backfill kept the Kafka append time T + 1_800, late_view would have leaked into it.)
    assert examples["imp2"]["seq_event_time_ms"] == [T + 1_000, T + 1_500]
    assert examples["imp1"]["seq_event_time_ms"] == []
    seq = {r["user_id"]: r for r in read_table(config.lake, "sequences").to_pylist()}["u1"]
    assert seq["seq_event_ids"] == ["late_view", "imp1", "view", "imp2"]
    assert seq["seq_created_ts_ms"] == [T + 5_000, T + 1_001, T + 1_501, T + 2_001]
