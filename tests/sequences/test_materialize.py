"""Pointer layout: examples without their lists, rebuilt from the history table, equal the fat build
table for table (backfills, late impressions, truncation, empty histories, several domains, the
fnw/defer correction rows); the history holds each event once."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from gemline.cli import main
from gemline.config import GemlineConfig
from gemline.errors import BadConfigError, MissingInputError
from gemline.lake import Lake, read_table
from sequences.config import BuildConfig
from sequences.examples import EXAMPLES_SCHEMA, pending_schema
from sequences.materialize import (
    SequenceIndex,
    export_examples,
    history_bucket,
    history_rows,
    materialize_examples,
    read_history,
    to_pointers,
)
from sequences.pipeline import run_build
from sequences.schema import HISTORY_BUCKETS, HISTORY_SCHEMA, LIST_COLUMNS, pointer_schema
from sequences.shards import EVENT_SCHEMA, user_outputs, user_shard_reference
from sequences.vectorized import item_shard_vectorized, user_shard_vectorized
from tests.conftest import build_args, quality_sections
from validation.run import validate_table

from .conftest import event
from .test_pipeline import CONFIG as PIPELINE
from .test_pipeline import _events as pipeline_events
from .test_pipeline import write_events
from .test_vectorized import CONFIG, DAY

MODES = [CONFIG,
         dataclasses.replace(CONFIG, label_mode="fnw", publish_delay_ms=3_600_000),
         dataclasses.replace(CONFIG, label_mode="defer", publish_delay_ms=3_600_000)]


def build_batches(batches: list[list[dict]], config: BuildConfig, reference: bool = False) -> tuple[pa.Table, pa.Table]:
    """(examples, history) of the shard steps driven over the batches (one shard, build n = batch n);
    ``reference``: the per-user reference steps, else the vectorised ones. The pending state of a
    pointer-layout config has no lists, like its examples."""
    examples, history = build_steps(batches, config, reference)
    return pa.concat_tables(examples), pa.concat_tables(history)


def build_steps(batches: list[list[dict]], config: BuildConfig, reference: bool = False
                ) -> tuple[list[pa.Table], list[pa.Table]]:
    """:func:`build_batches`' examples and history rows, one table of each per build."""
    empty = {name: schema.empty_table() for name, schema in user_outputs(config).items()}
    user_step = user_shard_reference if reference else user_shard_vectorized
    state = {"buffer": empty["buffer"], "seq": empty["sequences"], "dseq": empty["sequences_by_domain"],
             "evicted": empty["evicted"], "pending": empty["pending"]}
    watermark, close = 0, None
    examples, history = [], []
    for n, batch in enumerate(batches):
        new = pa.Table.from_pylist(batch, schema=EVENT_SCHEMA)
        watermark = max([watermark, *[e["event_time_ms"] for e in batch]])
        new_close = max(close or watermark, watermark) + (8 * DAY if n == len(batches) - 1 else 0)
        is_item = pa.compute.equal(state["evicted"].column("entity"), "item")
        item = item_shard_vectorized({"new": new, "buffer": state["buffer"], "evicted": state["evicted"].filter(is_item)},
                                     config, watermark_ms=watermark)
        user = user_step(
            {"new": new, "buffer": state["buffer"], "seq": state["seq"], "dseq": state["dseq"],
             "evicted": state["evicted"].filter(pa.compute.invert(is_item)), "pending": state["pending"],
             "dense": item["dense"]},
            config, watermark_ms=watermark, old_close_ms=close, close_ms=new_close)
        state = {"buffer": user["buffer"], "seq": user["sequences"], "dseq": user["sequences_by_domain"],
                 "evicted": pa.concat_tables([user["evicted"], item["evicted"]]), "pending": user["pending"]}
        close = new_close
        assert user["pending"].schema.equals(pending_schema(config))
        examples.append(user["examples"])
        history.append(history_rows(user["history"], n))
    return examples, history


def assert_materializes(examples: pa.Table, history: pa.Table, config: BuildConfig) -> None:
    pointers = to_pointers(examples)
    assert not set(LIST_COLUMNS) & set(pointers.column_names)
    # Shuffled pointers, a foreign user's history and history rows of later builds change nothing.
    order = np.random.default_rng(0).permutation(pointers.num_rows)
    noise = history_rows(pa.Table.from_pylist([event("zz", 5, "click", user="other")], schema=EVENT_SCHEMA)
                         .select([f.name for f in HISTORY_SCHEMA if f.name not in ("user_bucket", "build")]), 99)
    got = materialize_examples(pointers.take(pa.array(order)), pa.concat_tables([noise, history]), config)
    assert got.schema.equals(EXAMPLES_SCHEMA)
    want = examples.take(pa.array(order))
    for name in EXAMPLES_SCHEMA.names:
        assert got.column(name).to_pylist() == want.column(name).to_pylist(), name


EVENTS = st.lists(
    st.tuples(st.integers(0, 6 * 24), st.sampled_from(["u1", "u2"]), st.sampled_from(["i1", "i2"]),
              st.sampled_from(["d1", "d2"]), st.sampled_from(["impression", "impression", "click", "conversion",
                                                              "engagement"]),
              st.sampled_from([None, "", "c1"]), st.just(None), st.integers(0, 3)),
    min_size=8, max_size=40,
)
"""Dense logs of two users over six days (N = 3 truncates), one event in four a backfill."""


def _events(rows):
    events = []
    for i, (hour, user, item, domain, kind, category, age, lag) in enumerate(rows):
        t = hour * 3_600_000
        created = t + (3 * DAY if lag == 0 else lag)  # lag 0: a backfill appended days late
        events.append(event(f"e{i}", t, kind, user=user, item=item, domain=domain, category=category, age=age,
                            created_ts_ms=created))
    return sorted(events, key=lambda e: e["created_ts_ms"])


@settings(max_examples=15, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(EVENTS, st.integers(1, 4), st.sampled_from(MODES))
def test_materialized_pointers_equal_fat_build(rows, parts, config):
    events = _events(rows)
    # Interleaved batches: later batches hold events older than the watermark (late impressions).
    batches = [sorted(events[k::parts], key=lambda e: e["created_ts_ms"]) for k in range(parts)]
    examples, history = build_batches(batches, config)
    assert sorted(history.column("event_id").to_pylist()) == sorted({e["event_id"] for e in events})
    assert_materializes(examples, history, config)
    # The pointer-layout build computes no lists and writes the same rows otherwise, on both step paths.
    pointer = dataclasses.replace(config, examples_layout="pointer")
    for reference in (False, True):
        got, got_history = build_batches(batches, pointer, reference)
        assert _canon(got) == _canon(to_pointers(examples)) and _canon(got_history) == _canon(history)


def _canon(table: pa.Table) -> list[str]:
    return sorted(json.dumps(row, sort_keys=True, default=str) for row in table.to_pylist())


def test_hand_case_truncation_backfill_late_and_redelivery():
    """N = 3 cross-domain, 2 same-domain: the newest ones kept and the cut counted; a backfill appended
    after the impression stays out; a redelivered copy is stored once; an impression older than the
    stored sequence (late) gets the same shorter history as the fat row."""
    first = [event(f"a{i}", 1_000 * i, "engagement", domain="d1" if i % 2 else "d2") for i in range(1, 6)]
    first.append(event("imp1", 6_000, "impression"))
    second = [event("back", 2_500, "engagement", created_ts_ms=9 * DAY),  # backfill, after imp2/imp3 were appended
              event("imp2", 7_000, "impression", domain="d2", created_ts_ms=8 * DAY),
              event("late", 1_500, "impression", created_ts_ms=8 * DAY),  # older than the stored sequence
              event("a1", 1_000, "engagement", domain="d1"),  # redelivered
              event("imp3", 9_000, "impression", user="fresh-user")]  # empty history
    examples, history = build_batches([first, second], CONFIG)
    assert history.num_rows == 10 and history.column("build").to_pylist().count(1) == 4
    by_id = {r["example_id"]: r for r in examples.to_pylist()}
    assert by_id["imp1"]["seq_event_time_ms"] == [3_000, 4_000, 5_000] and by_id["imp1"]["seq_truncated"] == 2
    assert by_id["imp1"]["seq_same_domain_event_time_ms"] == [3_000, 5_000]  # d1: a1, a3, a5
    # The stored newest 3 (a4, a5, imp1) + the late impression, which was appended before imp2; not the backfill.
    assert by_id["imp2"]["seq_event_time_ms"] == [4_000, 5_000, 6_000] and by_id["imp2"]["seq_truncated"] == 4
    assert by_id["late"]["seq_length"] == 0 and by_id["late"]["seq_truncated"] == 3  # stored 3..5 are newer
    assert by_id["imp3"]["seq_length"] == 0 and by_id["imp3"]["seq_truncated"] == 0
    assert_materializes(examples, history, CONFIG)


def test_missing_impression_and_disagreeing_lengths_raise():
    examples, history = build_batches([[event("a", 1_000, "click"), event("b", 1_500, "click"),
                                        event("imp", 2_000, "impression")]], CONFIG)
    pointers = to_pointers(examples)
    with pytest.raises(ValueError, match="missing from history"):
        materialize_examples(pointers, history.filter(pa.compute.equal(history.column("event_id"), "a")), CONFIG)
    with pytest.raises(ValueError, match="seq_same_domain_length"):
        materialize_examples(pointers, history, dataclasses.replace(CONFIG, max_same_domain_seq_len=1))


def test_history_bucket_is_crc32_and_stable():
    import zlib

    got = history_bucket(["u1", "u2", "u1", "éè"])
    assert got.tolist() == [zlib.crc32(s.encode()) % HISTORY_BUCKETS for s in ["u1", "u2", "u1", "éè"]]
    assert json.dumps(got.tolist())  # plain ints


@pytest.mark.slow
def test_pointer_build_materializes_to_the_fat_build(tmp_path, make_event):
    """Two lakes, the same events in two builds (a redelivery, a late impression, a closing final
    build): the pointer lake's examples lack the lists, its history holds each event once, and
    examples + history materialize to the fat lake's examples."""
    second = [make_event("b_imp2", 2_500, "impression", user="u2", item="i3"),
              make_event("a_late", 1_100, "impression", item="i3"),
              make_event("a_click1", 1_050, "click", item="i1")]  # redelivered
    tables = {}
    for layout in ("fat", "pointer"):
        lake = str(tmp_path / layout)
        config = GemlineConfig(lake=lake, build=dataclasses.replace(PIPELINE, examples_layout=layout))
        write_events(lake, pipeline_events(make_event), version=0)
        run_build(*build_args(config))
        write_events(lake, second, version=1)
        run_build(*build_args(config), final=True)
        tables[layout] = read_table(lake, "examples").sort_by("example_id")
    for other in (dataclasses.replace(PIPELINE, examples_layout="fat"),
                  dataclasses.replace(PIPELINE, examples_layout="pointer", max_seq_len=7)):
        with pytest.raises(BadConfigError, match="fixed for the life of a lake"):
            run_build(*build_args(GemlineConfig(lake=str(tmp_path / "pointer"), build=other)))
    history = read_history(str(tmp_path / "pointer"), tables["pointer"].column("user_id"))
    assert sorted(history.column("event_id").to_pylist()) == sorted(
        {e["event_id"] for e in pipeline_events(make_event)} | {"b_imp2", "a_late"})
    assert {f.name: f.type for f in tables["pointer"].schema} == {
        f.name: f.type for f in pointer_schema(EXAMPLES_SCHEMA)}
    got = materialize_examples(tables["pointer"], history, PIPELINE)
    assert tables["fat"].num_rows == 5
    assert got.to_pylist() == tables["fat"].select(EXAMPLES_SCHEMA.names).to_pylist()

    # The quality suite judges the pointer rows on pointers + history (no list materialized): the same
    # verdicts as the fat rows.
    verdicts = {}
    for layout in ("fat", "pointer"):
        config = GemlineConfig(lake=str(tmp_path / layout), build=dataclasses.replace(PIPELINE, examples_layout=layout))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(SequenceIndex, "lists", None)  # a call would raise TypeError
            result = validate_table(Lake.for_config(config), "examples", 2, now_ms=10**13, **quality_sections(config))
        verdicts[layout] = (result.passed, result.num_rows, result.failures)
    assert verdicts["pointer"] == verdicts["fat"] and verdicts["fat"][1] > 0
    wrong = GemlineConfig(lake=str(tmp_path / "pointer"), build=dataclasses.replace(PIPELINE, max_seq_len=1))
    result = validate_table(Lake.for_config(wrong), "examples", 2, now_ms=10**13, **quality_sections(wrong))
    # Checked against another max_seq_len, the pointers rebuild shorter sequences than they store.
    assert ("seq_length_matches_lists", "critical") in [f[:2] for f in result.failures]

    # gemline export examples --materialize: plain Parquet files with the fat rows, readable by any engine.
    out = tmp_path / "export"
    assert main(["export", "examples", "--lake", str(tmp_path / "pointer"), "--out", str(out), "--materialize"]) == 0
    exported = pq.read_table(out).select(EXAMPLES_SCHEMA.names).sort_by("example_id")
    assert exported.to_pylist() == tables["fat"].select(EXAMPLES_SCHEMA.names).to_pylist()
    assert len(list(out.glob("*.parquet"))) == 1, "the table's small files gathered into one part"
    with pytest.raises(BadConfigError, match="already holds Parquet files"):
        export_examples(str(tmp_path / "pointer"), out)
    with pytest.raises(MissingInputError, match=r"versions 0\.\.2, not 9"):
        export_examples(str(tmp_path / "pointer"), tmp_path / "other", version=9)
    with pytest.raises(MissingInputError, match="no examples table"):
        export_examples(str(tmp_path / "nowhere"), tmp_path / "other")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(BadConfigError, match="is a file; export into a directory"):
        export_examples(str(tmp_path / "pointer"), tmp_path / "a-file")
    with pytest.raises(BadConfigError, match="cannot create --out"):
        export_examples(str(tmp_path / "pointer"), tmp_path / "a-file" / "below")
    # Two rows a part: the parts hold every row once.
    parts = export_examples(str(tmp_path / "fat"), tmp_path / "small", materialize=False, chunk_rows=2)
    assert (parts["rows"], parts["files"], parts["layout"], parts["materialized"], parts["fat_rows"]) == \
        (5, 3, "fat", False, True)
    raw = export_examples(str(tmp_path / "pointer"), tmp_path / "raw", materialize=False)
    assert (raw["layout"], raw["materialized"], raw["fat_rows"]) == ("pointer", False, False)
    assert "seq_event_time_ms" not in pq.read_table(tmp_path / "raw").schema.names
    assert pq.read_table(tmp_path / "small").sort_by("example_id").select(EXAMPLES_SCHEMA.names).to_pylist() == \
        tables["fat"].select(EXAMPLES_SCHEMA.names).to_pylist()
