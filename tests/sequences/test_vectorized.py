"""The vectorised shard steps equal the reference shard steps (which loop build_user/build_item),
table by table, batch after batch, on random events — including backfilled events appended out of
order (those entities take the reference path), empty and null categories, and evictions."""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from sequences.config import BuildConfig
from sequences.shards import EVENT_SCHEMA, ITEM_OUTPUTS, USER_OUTPUTS, item_shard_reference, user_shard_reference
from sequences.vectorized import _events, _needs_reference, item_shard_vectorized, user_shard_vectorized

from .conftest import event

DAY = 24 * 3600 * 1000
# Fat: the vectorised lists are compared with the reference's (tests/sequences/test_materialize.py
# compares the pointer rows with these).
CONFIG = BuildConfig(max_seq_len=3, max_same_domain_seq_len=2, click_window_ms=DAY // 2, conversion_window_ms=DAY,
                     state_lookback_ms=30 * DAY, window_overrides=("d2:click:3600000",), examples_layout="fat")


def _canon(table: pa.Table) -> list[str]:
    return sorted(json.dumps(row, sort_keys=True, default=str) for row in table.to_pylist())


def _assert_same(got: dict[str, pa.Table], want: dict[str, pa.Table], schemas: dict[str, pa.Schema], where: str):
    assert set(got) == set(want) == set(schemas)
    for name, schema in schemas.items():
        assert got[name].schema.equals(schema), f"{where} {name}: schema {got[name].schema} != {schema}"
        assert _canon(got[name]) == _canon(want[name]), f"{where}: table {name} differs"


def compare_batches(batches: list[list[dict]], config: BuildConfig | list[BuildConfig] = CONFIG,
                    outputs: list[dict[str, pa.Table]] | None = None) -> int:
    """Drive the reference steps over the batches; at each, the vectorised steps on the same
    inputs must give the same tables. ``config``: one for every batch, or one per batch; ``outputs``:
    a list the vectorised user outputs of each batch are appended to. Returns the number of examples
    published."""
    configs = config if isinstance(config, list) else [config] * len(batches)
    empty = {name: schema.empty_table() for name, schema in USER_OUTPUTS.items()}
    state = {"buffer": empty["buffer"], "seq": empty["sequences"], "dseq": empty["sequences_by_domain"],
             "evicted": empty["evicted"], "pending": empty["pending"]}
    watermark, close, published = 0, None, 0
    for n, (batch, config) in enumerate(zip(batches, configs, strict=True)):
        new = pa.Table.from_pylist(batch, schema=EVENT_SCHEMA)
        watermark = max([watermark, *[e["event_time_ms"] for e in batch]])
        new_close = max(close or watermark, watermark) + (2 * DAY if n == len(batches) - 1 else 0)
        is_item = pa.compute.equal(state["evicted"].column("entity"), "item")
        item_in = {"new": new, "buffer": state["buffer"], "evicted": state["evicted"].filter(is_item)}
        item_want = item_shard_reference(item_in, config, watermark)
        _assert_same(item_shard_vectorized(item_in, config, watermark_ms=watermark), item_want, ITEM_OUTPUTS,
                     f"batch {n} item")
        user_in = {"new": new, "buffer": state["buffer"], "seq": state["seq"], "dseq": state["dseq"],
                   "evicted": state["evicted"].filter(pa.compute.invert(is_item)), "pending": state["pending"],
                   "dense": item_want["dense"]}
        kwargs = {"watermark_ms": watermark, "old_close_ms": close, "close_ms": new_close}
        user_want = user_shard_reference(user_in, config, **kwargs)
        user_got = user_shard_vectorized(user_in, config, **kwargs)
        _assert_same(user_got, user_want, USER_OUTPUTS, f"batch {n} user")
        # What the build appends to the buffer: the kept rows the input buffer lacks, the rest unchanged.
        held = set(state["buffer"].column("event_id").to_pylist())
        appended = user_want["buffer"].filter(pa.array([e not in held for e in
                                                        user_want["buffer"].column("event_id").to_pylist()], pa.bool_()))
        _assert_same(user_shard_vectorized(user_in, config, **kwargs, new_buffer_rows_only=True),
                     {**user_want, "buffer": appended}, USER_OUTPUTS, f"batch {n} user, new buffer rows")
        if outputs is not None:
            outputs.append(user_got)
        state = {"buffer": user_want["buffer"], "seq": user_want["sequences"], "dseq": user_want["sequences_by_domain"],
                 "evicted": pa.concat_tables([user_want["evicted"], item_want["evicted"]]),
                 "pending": user_want["pending"]}
        close = new_close
        published += user_want["examples"].num_rows
    return published


def test_hand_case_two_users_three_batches():
    batches = [
        [event("a1", 1_000, "impression", category="c1", age=30), event("a2", 2_000, "click", category="c1"),
         event("b1", 1_500, "impression", user="u2", item="i2", domain="d2", gender="f")],
        [event("a3", DAY, "impression", item="i2", category=""), event("a4", DAY + 5, "conversion", item="i2"),
         event("b2", DAY + 10, "impression", user="u2", item="i1", domain="d2", location="x"),
         event("a1", 1_000, "impression", category="c1", age=30)],  # a redelivered copy
        [event("a5", 40 * DAY, "impression", item="i1"), event("b3", 40 * DAY + 1, "click", user="u2", item="i1",
                                                              domain="d2")],  # evicts the first days
    ]
    assert compare_batches(batches) == 5


def test_users_without_new_events_keep_their_sequences_as_of_the_new_watermark():
    """A user with no event in a batch comes out with the sequences it went in with, stamped with the new
    watermark; one whose stored sequence is longer than a shortened max_seq_len is cut, as the reference
    (which rebuilds every user from its events) cuts it."""
    batches = [
        [event("a1", 1_000, "impression"), event("a2", 2_000, "click"), event("a3", 3_000, "engagement"),
         event("b1", 1_500, "engagement", user="u2", item="i2", domain="d2"),
         event("c1", 1_700, "impression", user="u3", item="i2")],
        [event("c2", DAY, "engagement", user="u3", item="i1")],
    ]
    shorter = dataclasses.replace(CONFIG, max_seq_len=2, max_same_domain_seq_len=1)
    outputs: list[dict[str, pa.Table]] = []
    compare_batches(batches, [CONFIG, shorter], outputs)
    rows = {r["user_id"]: r for r in outputs[1]["sequences"].to_pylist()}
    assert rows["u2"]["seq_event_ids"] == ["b1"] and rows["u2"]["seq_truncated"] == 0  # kept as it was
    assert rows["u1"]["seq_event_ids"] == ["a2", "a3"] and rows["u1"]["seq_truncated"] == 1  # cut to 2
    assert rows["u3"]["seq_event_ids"] == ["c1", "c2"]  # a new event: rebuilt
    assert {r["as_of_ms"] for r in rows.values()} == {DAY}
    by_domain = {(r["user_id"], r["domain"]): r["seq_event_ids"] for r in outputs[1]["sequences_by_domain"].to_pylist()}
    assert by_domain == {("u1", "d1"): ["a3"], ("u2", "d2"): ["b1"], ("u3", "d1"): ["c2"]}


def test_backfilled_event_takes_the_reference_path():
    # b_old (time 500) reaches Kafka after the impression at 1_000 was appended: u1 is "slow".
    batch = [event("imp", 1_000, "impression"), event("b_old", 500, "engagement", created_ts_ms=5_000),
             event("other", 1_000, "impression", user="u2")]
    queries = _events(pa.Table.from_pylist(batch, schema=EVENT_SCHEMA))
    slow = _needs_reference(queries, "user_id", queries.filter(queries["event_type"] == "impression"))
    assert slow == {"u1"}
    assert compare_batches([batch]) == 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dense_random_log_with_backfills(seed, monkeypatch):
    """60 events of 3 users over 20 days, one in six appended 3 days late, in three batches: both
    paths run (some users are backfilled, some not) and the outputs equal the reference's."""
    import random

    import sequences.vectorized as vectorized

    rng = random.Random(seed)
    slow_users = []
    needs = vectorized._needs_reference
    monkeypatch.setattr(vectorized, "_needs_reference", lambda *a: slow_users.append(needs(*a)) or slow_users[-1])
    events = []
    for i in range(60):
        t = rng.randint(0, 20 * 24) * 3_600_000
        late = rng.randint(0, 5) == 0
        events.append(event(f"e{i}", t, rng.choice(["impression", "impression", "click", "conversion", "engagement"]),
                            user=rng.choice(["u1", "u2", "u3"]), item=rng.choice(["i1", "i2"]),
                            domain=rng.choice(["d1", "d2"]), category=rng.choice([None, "", "c1"]),
                            created_ts_ms=t + (3 * DAY if late else rng.randint(1, 5))))
    events.sort(key=lambda e: e["created_ts_ms"])
    assert compare_batches([events[:20], events[20:40], events[40:]]) > 0
    assert any(slow_users) and not all(slow_users)


def test_missing_item_counters_raise():
    new = pa.Table.from_pylist([event("imp", 1_000, "impression")], schema=EVENT_SCHEMA)
    tables = {name: schema.empty_table() for name, schema in
              {"buffer": EVENT_SCHEMA, "seq": USER_OUTPUTS["sequences"], "dseq": USER_OUTPUTS["sequences_by_domain"],
               "evicted": USER_OUTPUTS["evicted"], "pending": USER_OUTPUTS["pending"],
               "dense": ITEM_OUTPUTS["dense"]}.items()}
    with pytest.raises(ValueError, match="no item features"):
        user_shard_vectorized({**tables, "new": new}, CONFIG, watermark_ms=1_000, old_close_ms=None, close_ms=1_000)


EVENTS = st.lists(
    st.tuples(st.integers(0, 45 * 24), st.sampled_from(["u1", "u2", "u3"]), st.sampled_from(["i1", "i2", "i3"]),
              st.sampled_from(["d1", "d2"]),
              st.sampled_from(["impression", "impression", "click", "conversion", "engagement"]),
              st.sampled_from([None, "", "c1", "c2"]), st.sampled_from([None, 25, 40]),
              st.integers(0, 5)),
    max_size=30,
)


@settings(max_examples=30, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(EVENTS, st.integers(1, 4))
def test_vectorised_equals_reference(rows, parts):
    events = []
    for i, (hour, user, item, domain, kind, category, age, lag) in enumerate(rows):
        t = hour * 3_600_000
        # Mostly appended in time order; lag 0 appends an event days late (a backfill).
        created = t + (3 * DAY if lag == 0 else lag)
        events.append(event(f"e{i}", t, kind, user=user, item=item, domain=domain, category=category, age=age,
                            created_ts_ms=created))
    events.sort(key=lambda e: e["created_ts_ms"])
    batches = [events[k::parts] for k in range(parts)] if parts > 1 else [events]
    batches = [sorted(b, key=lambda e: e["created_ts_ms"]) for b in batches]
    compare_batches(batches)
