"""run_build on a tmp lake: window-close publishing, exactly-once appends, incremental == from scratch."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest
from deltalake import write_deltalake

from gemline.config import GemlineConfig
from gemline.lake import commit_once, committed_version, open_table, read_table
from ingest.schema import EVENTS_TABLE_SCHEMA
from sequences.config import BuildConfig
from sequences.examples import EXAMPLES_SCHEMA
from sequences.materialize import read_examples
from sequences.pipeline import run_build
from tests.conftest import build_args, with_layout

# These tests are about the build on a raw lake, not the quality gate (tests/sequences/test_events_gate.py).
CONFIG = BuildConfig(max_seq_len=3, click_window_ms=100, conversion_window_ms=1_000, events_gate="off")
UNGATED = BuildConfig(events_gate="off")


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
def test_publish_when_windows_close_then_final_then_skip(tmp_path, make_event, examples_layout):
    lake = str(tmp_path / "lake")
    config = GemlineConfig(lake=lake, build=with_layout(CONFIG, examples_layout))
    write_events(lake, _events(make_event), version=0)
    first = run_build(*build_args(config))
    # Watermark 2_300: a_imp1 (1_000 + 1_000) and b_imp1 (2_020) closed; a_imp2 (2_200) closed too.
    # examples@0 is the empty CREATE TABLE commit, examples@1 the first build's files.
    assert (first.events_version, first.examples_version, first.skipped, first.watermark_ms) == (0, 1, False, 2_300)
    assert _ids(lake) == ["a_imp1", "a_imp2", "b_imp1"] and first.num_pending == 0
    examples = read_examples(lake)
    assert {f.name: f.type for f in examples.schema} == {f.name: f.type for f in EXAMPLES_SCHEMA}
    by_id = {r["example_id"]: r for r in examples.to_pylist()}
    assert by_id["a_imp2"]["seq_event_time_ms"] == [1_000, 1_050]
    assert by_id["a_imp2"]["seq_time_delta_ms"] == [200, 150]
    assert (by_id["a_imp1"]["label_click"], by_id["a_imp1"]["click_latency_ms"]) == (1, 50)
    assert by_id["a_imp1"]["published_watermark_ms"] == 2_300

    again = run_build(*build_args(config))
    assert again.skipped and again.examples_version == 1 and again.num_examples == 3

    write_events(lake, [make_event("b_imp2", 2_500, "impression", user="u2", item="i3")], version=1)
    second = run_build(*build_args(config))
    assert (second.events_version, second.num_published, second.num_pending) == (1, 0, 1)
    assert second.num_examples == 3  # b_imp2's conversion window is open at watermark 2_500
    third = run_build(*build_args(config), final=True)
    assert (third.num_published, third.num_pending, third.num_examples) == (1, 0, 4)
    row = [r for r in read_examples(lake).to_pylist() if r["example_id"] == "b_imp2"][0]
    assert row["label_window_closed"] is False and row["seq_item_ids"] == ["i1"]
    assert _ids(lake) == ["a_imp1", "a_imp2", "b_imp1", "b_imp2"]  # each impression exactly once
    # Nothing new and nothing pending: another final build is a no-op, not an empty examples version.
    version = open_table(lake, "examples").version()
    fourth = run_build(*build_args(config), final=True)
    assert fourth.skipped and open_table(lake, "examples").version() == version


def test_run_build_without_events_table_raises(tmp_path):
    with pytest.raises(ValueError, match="no events table"):
        run_build(*build_args(GemlineConfig(lake=str(tmp_path / "lake"), build=UNGATED)))


def test_run_build_rejects_events_without_required_columns(tmp_path, make_event):
    lake = str(tmp_path / "lake")
    row = make_event("a", 1, "impression")
    del row["created_ts_ms"]
    write_deltalake(f"{lake}/events", pa.Table.from_pylist([row]))
    with pytest.raises(ValueError, match=r"events table lacks columns \['created_ts_ms'\]"):
        run_build(*build_args(GemlineConfig(lake=lake, build=UNGATED)))


@pytest.mark.slow
def test_run_build_without_impressions_writes_empty_typed_examples(tmp_path, make_event, examples_layout):
    lake = str(tmp_path / "lake")
    write_events(lake, [make_event("c", 5, "click"), make_event("v", 9, "engagement", user="u2")], version=0)
    result = run_build(*build_args(GemlineConfig(lake=lake, build=with_layout(CONFIG, examples_layout))))
    assert (result.num_examples, result.num_sequences, result.seq_length_p50) == (0, 2, None)
    examples = read_examples(lake)
    assert examples.num_rows == 0
    assert {f.name: f.type for f in examples.schema} == {f.name: f.type for f in EXAMPLES_SCHEMA}
    sequences = {r["user_id"]: r for r in read_table(lake, "sequences").to_pylist()}
    assert sequences["u2"]["seq_event_time_ms"] == [9] and sequences["u2"]["as_of_ms"] == 9
    assert committed_version(lake, "examples", "build") == 0 and open_table(lake, "examples").version() == 1


@pytest.mark.parametrize("auto_shards", [False, True])
@pytest.mark.parametrize(("shards", "configured", "used"), [(8, 16, 17), (8, 2, 17), (4, 16, 16), (8, 17, 17)])
def test_build_hygiene_raises_compact_min_files_with_a_warning(caplog, shards, configured, used, auto_shards):
    """run_build compacts at >= 2 x shards + 1 files; raising a configured value is logged, naming the key: a
    warning for a shard count the user set, INFO for one build.shards = "auto" chose."""
    from gemline.hygiene import HygieneConfig
    from sequences.pipeline import build_hygiene

    build = BuildConfig(shards=shards, hygiene=HygieneConfig(compact_min_files=configured, checkpoint_every=3))
    with caplog.at_level("INFO", logger="sequences.pipeline"):
        hygiene = build_hygiene(build, auto_shards=auto_shards)
    assert hygiene == HygieneConfig(compact_min_files=used, checkpoint_every=3)
    level = "INFO" if auto_shards else "WARNING"
    warnings = [r.getMessage() for r in caplog.records if r.name == "sequences.pipeline" and r.levelname == level]
    assert not [r for r in caplog.records if r.name == "sequences.pipeline" and r.levelname not in (level, "DEBUG")]
    if used == configured:
        assert warnings == [] and hygiene is build.hygiene
    else:
        assert warnings == [
            f"build.hygiene.compact_min_files={configured} is overridden at run time: using {used} (2 x build.shards + 1; "
            f"a build writes up to one file per shard into a partition); set it to >= {used} to silence this"
        ]


@pytest.mark.slow
def test_run_build_warns_when_it_raises_compact_min_files(tmp_path, make_event, caplog):
    lake = str(tmp_path / "lake")
    write_events(lake, [make_event("v", 9, "engagement")], version=0)
    with caplog.at_level("WARNING", logger="sequences.pipeline"):
        run_build(*build_args(GemlineConfig(lake=lake, build=BuildConfig(events_gate="off", shards=9))))
    assert [r.getMessage().split(" is overridden")[0] for r in caplog.records if r.name == "sequences.pipeline" and r.levelname == "WARNING"] == [
        "build.hygiene.compact_min_files=16"]
    assert "using 19 (2 x build.shards + 1" in caplog.text


def test_build_increment_transform(make_event):
    import apache_beam as beam
    from apache_beam.testing import test_pipeline
    from apache_beam.testing.util import assert_that, equal_to

    from sequences.pipeline import BuildIncrement
    from sequences.shards import EVENT_SCHEMA

    events = _events(make_event)
    # Two pieces of the new events: a transform input may arrive in any chunking.
    tables = [pa.Table.from_pylist(events[:3], schema=EVENT_SCHEMA), pa.Table.from_pylist(events[3:], schema=EVENT_SCHEMA)]
    with test_pipeline.TestPipeline() as p:
        empty = p | "Empty" >> beam.Create([])
        inputs = {"new": p | "New" >> beam.Create(tables), "buffer": empty, "seq": empty, "dseq": empty,
                  "evicted": empty, "pending": empty}
        # Fat rows: the lists are checked (the pointer rows are compared with them in test_materialize.py).
        config = dataclasses.replace(CONFIG, examples_layout="fat", shards=4)  # run_build resolves "auto" shards
        parts = inputs | BuildIncrement(config, watermark_ms=2_300, old_close_ms=None, close_ms=2_300)
        parts = (parts["item"], parts["user"]) | beam.Flatten()
        out = {name: parts | f"Only[{name}]" >> beam.Filter(lambda part, n: part[0] == n, name)
               | f"Table[{name}]" >> beam.Map(lambda part: part[2])
               for name in ("examples", "sequences", "features/item")}
        assert_that(
            out["examples"] | beam.FlatMap(pa.Table.to_pylist)
            | beam.Map(lambda r: (r["example_id"], tuple(r["seq_item_ids"]), r["label_click"],
                                  r["f_item_impressions_7d"])),
            equal_to([("a_imp1", (), 1, 0.0), ("b_imp1", (), 0, 1.0), ("a_imp2", ("i1", "i1"), 0, 0.0)]),
            label="Examples",
        )
        assert_that(
            out["sequences"] | "SeqRows" >> beam.FlatMap(pa.Table.to_pylist)
            | beam.Map(lambda r: (r["user_id"], tuple(r["seq_item_ids"]), r["seq_truncated"])),
            equal_to([("u1", ("i1", "i2", "i3"), 1), ("u2", ("i1",), 0)]),
            label="Sequences",
        )
        assert_that(out["features/item"] | "ItemRows" >> beam.FlatMap(pa.Table.to_pylist)
                    | beam.Map(lambda r: (r["item_id"], r["impressions_all"])),
                    equal_to([("i1", 2), ("i2", 1), ("i3", 0)]), label="ItemFeatures")


TAOBAO = "/work/shared/data/taobao_userbehavior/UserBehavior_sample.csv"


@pytest.mark.slow
def test_taobao_conversion_labels_match_polars(tmp_path, examples_layout):
    """On the real Taobao sample (first 15K rows): examples with label_conversion == 1 equal a polars
    count of pv rows followed by a buy of the same user and item within the 7-day window."""
    import os

    import polars as pl

    from ingest.datasets import load_records
    from ingest.schema import Event, event_to_row

    if not os.path.exists(TAOBAO):
        pytest.skip(f"{TAOBAO} not present")
    records = [r for r in load_records("taobao", path=TAOBAO, limit=15_000) if isinstance(r, Event)]
    rows = [{**event_to_row(r), "created_ts_ms": r.event_time_ms} for r in records]
    lake = str(tmp_path / "lake")
    write_events(lake, rows, version=0)
    result = run_build(*build_args(GemlineConfig(lake=lake, build=with_layout(UNGATED, examples_layout))), final=True)
    examples = read_examples(lake).select(["example_id", "label_conversion", "event_time_ms", "seq_event_time_ms",
                                           "seq_same_domain_event_time_ms"])
    for row in examples.to_pylist():  # leakage: nothing at or after the example's time
        assert all(t < row["event_time_ms"] for t in row["seq_event_time_ms"] + row["seq_same_domain_event_time_ms"])
    frame = pl.DataFrame(rows).select("event_id", "user_id", "item_id", "event_type", "event_time_ms")
    pv = frame.filter(pl.col("event_type") == "impression")
    buy = frame.filter(pl.col("event_type") == "conversion").select("user_id", "item_id",
                                                                     pl.col("event_time_ms").alias("buy_ms"))
    window = GemlineConfig().build.conversion_window_ms
    expected = (pv.join(buy, on=["user_id", "item_id"])
                .filter((pl.col("buy_ms") >= pl.col("event_time_ms"))
                        & (pl.col("buy_ms") <= pl.col("event_time_ms") + window))
                .select("event_id").unique().height)
    assert expected > 0
    assert result.num_examples == pv.select("event_id").unique().height
    assert sum(examples.column("label_conversion").to_pylist()) == expected


@pytest.mark.slow
def test_defer_publishes_early_then_corrects_and_counts_orphans(tmp_path, make_event, examples_layout):
    """defer, waiting window 30 ms (click window 100, conversion 1_000): a_imp1 is published at 1_030 without
    its click (at 1_050), corrected by a late-positive row, and closed by a real-negative conversion row; a
    click without impression goes to orphan_labels. A rerun changes nothing."""
    import dataclasses

    lake = str(tmp_path / "lake")
    config = GemlineConfig(lake=lake, build=dataclasses.replace(CONFIG, label_mode="defer", publish_delay_ms=30,
                                                                      examples_layout=examples_layout))
    write_events(lake, [make_event("a_imp1", 1_000, "impression", item="i1"),
                        make_event("x_click", 1_010, "click", item="nowhere"),
                        make_event("a_tick", 1_040, "engagement", item="i9")], version=0)
    first = run_build(*build_args(config))
    rows = {r["example_id"]: r for r in read_examples(lake).to_pylist()}
    assert list(rows) == ["a_imp1"] and first.num_pending == 1
    assert (rows["a_imp1"]["label_click"], rows["a_imp1"]["click_open"], rows["a_imp1"]["label_mode"]) == (0, True,
                                                                                                           "defer")
    orphans = read_table(lake, "orphan_labels").to_pylist()
    assert [(o["event_id"], o["reason"]) for o in orphans] == [("x_click", "no_impression")]

    write_events(lake, [make_event("a_click1", 1_050, "click", item="i1"),
                        make_event("a_view", 2_300, "engagement", item="i3")], version=1)
    second = run_build(*build_args(config))
    rows = {r["example_id"]: r for r in read_examples(lake).to_pylist()}
    assert sorted(rows) == ["a_imp1", "a_imp1#click", "a_imp1#conversion"] and second.num_pending == 0
    late, negative = rows["a_imp1#click"], rows["a_imp1#conversion"]
    assert (late["label_click"], late["click_latency_ms"], late["corrects_example_id"]) == (1, 50, "a_imp1")
    assert (negative["label_conversion"], negative["correction_task"]) == (0, "conversion")
    assert late["seq_item_ids"] == rows["a_imp1"]["seq_item_ids"]  # the impression's history, as of the impression
    again = run_build(*build_args(config))
    assert again.skipped and read_table(lake, "examples").num_rows == 3
    assert read_table(lake, "orphan_labels").num_rows == 1


@pytest.mark.parametrize(("config", "rows", "shards"), [
    (BuildConfig(), 0, 1),
    (BuildConfig(), 200_000, 1),  # 200,000 x 2,560 B = 488 MiB <= 1 GiB
    (BuildConfig(), 419_430, 1),  # 419,430 x 2,560 = 1,073,740,800 B: just within 2**30
    (BuildConfig(), 419_431, 2),
    (BuildConfig(), 2_555_249, 7),  # issue 15's million users: 6.09 GiB of working set
    (BuildConfig(memory_budget_bytes=2**29), 2_555_249, 13),
    (BuildConfig(examples_layout="fat", max_seq_len=2048), 60_000, 2),  # 60,000 x (2,560 + 16 x 2,048) B = 1.97 GiB
    (BuildConfig(shards=4), 10**9, 4),  # a number is kept
])
def test_auto_shards_keep_a_shard_within_the_memory_budget(config, rows, shards):
    from sequences.pipeline import BEAM_MIN_SHARDS, shards_for

    assert shards_for(config, rows) == shards
    # A Beam build gets at least BEAM_MIN_SHARDS (its unit of parallelism) when auto; a number stays.
    assert shards_for(config, rows, minimum=BEAM_MIN_SHARDS) == (shards if config.shards != "auto"
                                                                 else max(shards, BEAM_MIN_SHARDS))
    if config.shards == "auto":
        with pytest.raises(ValueError, match="resolved per build"):
            _ = config.shard_count


@pytest.mark.parametrize(("config", "rows", "parallel", "shards"), [
    (BuildConfig(), 0, 2, 1),
    (BuildConfig(), 200_000, 2, 1),  # all rows fit the budget: one shard (two at once were slower, issue 15)
    (BuildConfig(), 200_000, 16, 1),
    (BuildConfig(), 419_430, 2, 1),  # 419,430 x 2,560 = 1,073,740,800 B: just within 2**30
    (BuildConfig(), 419_431, 2, 4),  # 3 would fit; a multiple of 2 keeps both cores busy in the last round
    (BuildConfig(), 2_555_249, 2, 14),  # 13 by memory (2 at once), rounded up to a multiple of 2
    (BuildConfig(), 2_555_249, 3, 21),
    (BuildConfig(shards=3), 10**6, 2, 3),  # a number is kept
])
def test_auto_shards_share_the_memory_budget_between_parallel_steps(config, rows, parallel, shards):
    """``build.parallelism`` P: P shard steps at once hold the budget together; a build that needs several shards
    gets a multiple of P so every core works, one that fits the budget one shard; P = 1 is the sequential count."""
    from sequences.pipeline import SHARD_BYTES_PER_ROW, shards_for

    assert shards_for(config, rows, parallel=parallel) == shards
    if config.shards == "auto" and shards > 1:
        assert min(parallel, shards) * -(-rows // shards) * SHARD_BYTES_PER_ROW <= config.memory_budget_bytes
        assert rows * SHARD_BYTES_PER_ROW > config.memory_budget_bytes  # split only where one shard would not fit


def test_parallelism_auto_is_the_cores():
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert BuildConfig().parallelism == "auto" and BuildConfig().parallel_shards == cores
    assert BuildConfig(parallelism=3).parallel_shards == 3


@pytest.mark.slow
def test_auto_shards_are_resolved_per_build(tmp_path, make_event, caplog):
    """``build.shards = "auto"`` (the default): a build with a tiny budget gets a shard per 2 events it reads
    (new + buffered) and says so; it writes what a build of that many fixed shards writes."""
    lake = str(tmp_path / "lake")
    write_events(lake, _events(make_event), version=0)
    budget = BuildConfig(max_seq_len=3, click_window_ms=100, conversion_window_ms=1_000, events_gate="off",
                         memory_budget_bytes=2**20, parallelism=1)
    rows = 2**20 // 2_560  # events of one shard's budget
    events = [make_event(f"e{i}", 3_000 + i, "engagement", user=f"u{i % 7}") for i in range(2 * rows + 1)]
    write_events(lake, events, version=1)
    with caplog.at_level("INFO", logger="sequences.pipeline"):
        run_build(*build_args(GemlineConfig(lake=lake, build=budget)), events_version=0)
        run_build(*build_args(GemlineConfig(lake=lake, build=budget)), events_version=1)
    # Build 0 reads 6 events; build 1 reads 2 x rows + 1 new ones (2 shards' worth) and build 0's 5 buffered ones.
    assert [r.getMessage().split(" (")[0] for r in caplog.records if "shard(s)" in r.getMessage()] == [
        "build 0: 1 shard(s) for 6 new events", f"build 1: 3 shard(s) for {2 * rows + 1} new events"]
