"""run_build on a tmp lake: window-close publishing, exactly-once appends, incremental == from scratch."""

from __future__ import annotations

import pyarrow as pa
import pytest
from deltalake import write_deltalake

from gemline.config import GemlineConfig
from gemline.lake import commit_once, committed_version, open_table, read_table
from ingest.schema import EVENTS_TABLE_SCHEMA
from sequences.config import BuildConfig
from sequences.examples import EXAMPLES_SCHEMA
from sequences.pipeline import run_build

CONFIG = BuildConfig(max_seq_len=3, click_window_ms=100, conversion_window_ms=1_000)


def _events(make_event):
    return [
        make_event("a_imp1", 1_000, "impression", item="i1"),
        make_event("a_click1", 1_050, "click", item="i1"),
        make_event("b_imp1", 1_020, "impression", user="u2", item="i1"),
        make_event("a_imp2", 1_200, "impression", item="i2"),
        make_event("a_view", 2_300, "engagement", item="i3"),
        make_event("a_imp2", 1_200, "impression", item="i2"),  # a duplicate delivery
    ]


def write_events(lake, rows, version):
    """Append ``rows`` to LAKE/events as one commit (app "test", ``version``)."""
    table = pa.Table.from_pylist(
        [{**r, "event_date": "1970-01-01", "kafka_topic": "t", "kafka_partition": 0,
          "kafka_offset": version * 10_000 + i} for i, r in enumerate(rows)],
        schema=EVENTS_TABLE_SCHEMA,
    )
    commit_once(lake, "events", table, app_id="test", version=version, partition_by=["event_date"])


def _ids(lake):
    return sorted(read_table(lake, "examples", columns=["example_id"]).column("example_id").to_pylist())


@pytest.mark.slow
def test_publish_when_windows_close_then_final_then_skip(tmp_path, make_event):
    lake = str(tmp_path / "lake")
    config = GemlineConfig(lake=lake, build=CONFIG)
    write_events(lake, _events(make_event), version=0)
    first = run_build(config)
    # Watermark 2_300: a_imp1 (1_000 + 1_000) and b_imp1 (2_020) closed; a_imp2 (2_200) closed too.
    assert (first.events_version, first.examples_version, first.skipped, first.watermark_ms) == (0, 0, False, 2_300)
    assert _ids(lake) == ["a_imp1", "a_imp2", "b_imp1"] and first.num_pending == 0
    examples = read_table(lake, "examples")
    assert {f.name: f.type for f in examples.schema} == {f.name: f.type for f in EXAMPLES_SCHEMA}
    by_id = {r["example_id"]: r for r in examples.to_pylist()}
    assert by_id["a_imp2"]["seq_event_time_ms"] == [1_000, 1_050]
    assert by_id["a_imp2"]["seq_time_delta_ms"] == [200, 150]
    assert (by_id["a_imp1"]["label_click"], by_id["a_imp1"]["click_latency_ms"]) == (1, 50)
    assert by_id["a_imp1"]["published_watermark_ms"] == 2_300

    again = run_build(config)
    assert again.skipped and again.examples_version == 0 and again.num_examples == 3

    write_events(lake, [make_event("b_imp2", 2_500, "impression", user="u2", item="i3")], version=1)
    second = run_build(config)
    assert (second.events_version, second.num_published, second.num_pending) == (1, 0, 1)
    assert second.num_examples == 3  # b_imp2's conversion window is open at watermark 2_500
    third = run_build(config, final=True)
    assert (third.num_published, third.num_pending, third.num_examples) == (1, 0, 4)
    row = [r for r in read_table(lake, "examples").to_pylist() if r["example_id"] == "b_imp2"][0]
    assert row["label_window_closed"] is False and row["seq_item_ids"] == ["i1"]
    assert _ids(lake) == ["a_imp1", "a_imp2", "b_imp1", "b_imp2"]  # each impression exactly once


def test_run_build_without_events_table_raises(tmp_path):
    with pytest.raises(ValueError, match="no events table"):
        run_build(GemlineConfig(lake=str(tmp_path / "lake")))


def test_run_build_rejects_events_without_required_columns(tmp_path, make_event):
    lake = str(tmp_path / "lake")
    row = make_event("a", 1, "impression")
    del row["created_ts_ms"]
    write_deltalake(f"{lake}/events", pa.Table.from_pylist([row]))
    with pytest.raises(ValueError, match=r"events table lacks columns \['created_ts_ms'\]"):
        run_build(GemlineConfig(lake=lake))


@pytest.mark.slow
def test_run_build_without_impressions_writes_empty_typed_examples(tmp_path, make_event):
    lake = str(tmp_path / "lake")
    write_events(lake, [make_event("c", 5, "click"), make_event("v", 9, "engagement", user="u2")], version=0)
    result = run_build(GemlineConfig(lake=lake, build=CONFIG))
    assert (result.num_examples, result.num_sequences, result.seq_length_p50) == (0, 2, None)
    examples = read_table(lake, "examples")
    assert examples.num_rows == 0
    assert {f.name: f.type for f in examples.schema} == {f.name: f.type for f in EXAMPLES_SCHEMA}
    sequences = {r["user_id"]: r for r in read_table(lake, "sequences").to_pylist()}
    assert sequences["u2"]["seq_event_time_ms"] == [9] and sequences["u2"]["as_of_ms"] == 9
    assert committed_version(lake, "examples", "build") == 0 and open_table(lake, "examples").version() == 0
