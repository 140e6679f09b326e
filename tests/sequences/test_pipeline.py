"""BuildExamples / BuildSequences on TestPipeline, and run_build end to end on a tmp lake."""

from __future__ import annotations

import apache_beam as beam
import pyarrow as pa
import pytest
from apache_beam.testing import test_pipeline
from apache_beam.testing.util import assert_that, equal_to
from deltalake import write_deltalake

from features.pipeline import GroupByEntity
from gemline.config import GemlineConfig
from gemline.lake import commit_metadata, commit_once, open_table, read_table
from ingest.schema import EVENTS_TABLE_SCHEMA
from sequences.config import BuildConfig
from sequences.examples import EXAMPLES_SCHEMA
from sequences.pipeline import BuildExamples, BuildSequences, run_build

CONFIG = BuildConfig(max_seq_len=3, click_window_ms=100, conversion_window_ms=1_000)


def _events(make_event):
    return [
        make_event("a_imp1", 1_000, "impression", item="i1"),
        make_event("a_click1", 1_050, "click", item="i1"),
        make_event("b_imp1", 1_020, "impression", user="u2", item="i1"),
        make_event("a_imp2", 1_200, "impression", item="i2"),
        make_event("a_view", 1_300, "engagement", item="i3"),
        make_event("a_imp2", 1_200, "impression", item="i2"),  # a duplicate delivery
    ]


def _summary(row):
    return (row["example_id"], row["user_id"], tuple(row["seq_item_ids"]), row["label_click"],
            row["f_item_impressions_7d"], row["label_window_closed"])


def test_build_examples_transform(make_event):
    with test_pipeline.TestPipeline() as p:
        events = p | beam.Create(_events(make_event))
        grouped = {"by_user": events | "U" >> GroupByEntity("user_id"), "by_item": events | "I" >> GroupByEntity("item_id")}
        rows = grouped | BuildExamples(CONFIG, watermark_ms=2_000)
        assert_that(
            rows | beam.FlatMap(pa.Table.to_pylist) | beam.Map(_summary),
            equal_to([
                ("a_imp1", "u1", (), 1, 0.0, True),
                ("b_imp1", "u2", (), 0, 1.0, False),  # u1's earlier impression of i1 counts for the item;
                # 1_020 + 1_000 > watermark 2_000, so u2's conversion window is still open
                ("a_imp2", "u1", ("i1", "i1"), 0, 0.0, False),
            ]),
        )


def test_build_sequences_transform(make_event):
    with test_pipeline.TestPipeline() as p:
        rows = p | beam.Create(_events(make_event)) | GroupByEntity("user_id") | BuildSequences(CONFIG, as_of_ms=1_300)
        assert_that(
            rows | beam.Map(lambda r: (r["user_id"], tuple(r["seq_item_ids"]), r["seq_truncated"], r["as_of_ms"])),
            equal_to([("u1", ("i1", "i2", "i3"), 1, 1_300), ("u2", ("i1",), 0, 1_300)]),
        )


def _write_events(lake, rows, version):
    table = pa.Table.from_pylist(
        [{**r, "event_date": "1970-01-01", "kafka_topic": "t", "kafka_partition": 0, "kafka_offset": i}
         for i, r in enumerate(rows)],
        schema=EVENTS_TABLE_SCHEMA,
    )
    commit_once(lake, "events", table, app_id="test", version=version, partition_by=["event_date"])


@pytest.mark.slow
def test_run_build_end_to_end_then_skip(tmp_path, make_event):
    lake = str(tmp_path / "lake")
    config = GemlineConfig(lake=lake, build=CONFIG)
    _write_events(lake, _events(make_event), version=0)
    result = run_build(config)
    assert (result.events_version, result.examples_version, result.skipped) == (0, 0, False)
    assert (result.num_examples, result.num_sequences) == (3, 2)
    assert (result.num_user_features, result.num_item_features) == (2, 3)
    assert result.seq_length_p50 == 0.0
    examples = read_table(lake, "examples")
    assert {f.name: f.type for f in examples.schema} == {f.name: f.type for f in EXAMPLES_SCHEMA}
    assert read_table(lake, "sequences").num_rows == 2
    assert commit_metadata(lake, "examples", "build")["events_version"] == 0
    by_id = {r["example_id"]: r for r in examples.to_pylist()}
    assert by_id["a_imp2"]["seq_event_time_ms"] == [1_000, 1_050]

    again = run_build(config)
    assert again.skipped and again.examples_version == 0 and again.num_examples == 3
    assert open_table(lake, "sequences").version() == 0

    _write_events(lake, [make_event("b_imp2", 1_500, "impression", user="u2", item="i3")], version=1)
    third = run_build(config)
    assert (third.events_version, third.examples_version, third.num_examples) == (1, 1, 4)
    assert commit_metadata(lake, "features/item", "build")["events_version"] == 1


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
    _write_events(lake, [make_event("c", 5, "click"), make_event("v", 9, "engagement", user="u2")], version=0)
    result = run_build(GemlineConfig(lake=lake, build=CONFIG))
    assert (result.num_examples, result.num_sequences, result.seq_length_p50) == (0, 2, None)
    examples = read_table(lake, "examples")
    assert examples.num_rows == 0
    assert {f.name: f.type for f in examples.schema} == {f.name: f.type for f in EXAMPLES_SCHEMA}
    sequences = {r["user_id"]: r for r in read_table(lake, "sequences").to_pylist()}
    assert sequences["u2"]["seq_event_time_ms"] == [9] and sequences["u2"]["as_of_ms"] == 9
