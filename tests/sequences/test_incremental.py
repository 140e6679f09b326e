"""The incremental step without a pipeline: batch by batch equals all at once; no leakage;
truncation keeps the newest N with siblings cut alike; an empty history."""

from __future__ import annotations

from collections import defaultdict

import pyarrow as pa
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from sequences.config import BuildConfig
from sequences.examples import PENDING_SCHEMA
from sequences.incremental import build_item, build_user

from .conftest import event

DAY = 24 * 3600 * 1000
# The per-user functions' sequence lists are checked: the fat layout's.
CONFIG = BuildConfig(max_seq_len=3, max_same_domain_seq_len=2, click_window_ms=DAY // 2,
                     conversion_window_ms=DAY, state_lookback_ms=30 * DAY, examples_layout="fat")


def run_batches(batches, config=CONFIG):
    """Drive build_item/build_user over batches like sequences.pipeline does; the last closes all windows."""
    state = {"buffer": [], "seq": {}, "dseq": defaultdict(list), "evicted": [], "pending": {}}
    examples, features = [], {}
    watermark, close = 0, None
    for n, batch in enumerate(batches):
        watermark = max([watermark, *[e["event_time_ms"] for e in batch]])
        new_close = max(close or watermark, watermark) + (2 * DAY if n == len(batches) - 1 else 0)
        dense, evicted, item_rows = defaultdict(dict), [], []
        for item in sorted({e["item_id"] for e in state["buffer"] + batch}):
            out = build_item(item, buffer=[e for e in state["buffer"] if e["item_id"] == item],
                             new=[e for e in batch if e["item_id"] == item],
                             evicted=[r for r in state["evicted"] if r["entity"] == "item" and r["key"] == item],
                             config=config, watermark_ms=watermark)
            for user, example_id, values in out["dense"]:
                dense[user][example_id] = values
            evicted += out["evicted"]
            item_rows += out["item_features"]
        users = sorted({e["user_id"] for e in state["buffer"] + batch} | set(state["seq"]) | set(state["pending"]))
        buffer, seq, dseq, pending, user_rows = [], {}, defaultdict(list), {}, []
        for user in users:
            out = build_user(
                user, stored_seq=state["seq"].get(user), stored_domain_seqs=state["dseq"][user],
                buffer=[e for e in state["buffer"] if e["user_id"] == user],
                new=[e for e in batch if e["user_id"] == user],
                evicted=[r for r in state["evicted"] if r["entity"] != "item" and r["key"] == user],
                pending=state["pending"].get(user, PENDING_SCHEMA.empty_table()),
                item_dense=dense[user], config=config, watermark_ms=watermark, old_close_ms=close, close_ms=new_close)
            seq[user] = out["sequence"]
            dseq[user] = out["domain_sequences"]
            buffer += out["buffer"]
            evicted += out["evicted"]
            pending[user] = out["pending"]
            examples += out["examples"].to_pylist()
            user_rows += out["user_features"] + out["user_category_features"]
        state = {"buffer": buffer, "seq": seq, "dseq": dseq, "evicted": evicted, "pending": pending}
        close = new_close
        features = {"item": item_rows, "user": user_rows}
    for row in examples:
        row.pop("published_watermark_ms")  # when it was published depends on the batching, by design
    key = lambda r: r["example_id"]  # noqa: E731
    return sorted(examples, key=key), state["seq"], dict(state["dseq"]), features


def _canon(features):
    return {k: sorted(map(lambda r: sorted(r.items(), key=str), v), key=str) for k, v in features.items()}


EVENTS = st.lists(
    st.tuples(st.integers(0, 40 * DAY // 3_600_000), st.sampled_from(["u1", "u2"]), st.sampled_from(["i1", "i2", "i3"]),
              st.sampled_from(["d1", "d2"]), st.sampled_from(["impression", "impression", "click", "conversion",
                                                              "engagement"]), st.sampled_from([None, "c1", "c2"])),
    max_size=25,
)


def by_days(events, days_per_batch: int) -> list[list[dict]]:
    """Time-sorted events cut into batches of ``days_per_batch`` days of event time ([[]] when none)."""
    batches = defaultdict(list)
    for e in events:
        batches[e["event_time_ms"] // (days_per_batch * DAY)].append(e)
    return [batches[k] for k in sorted(batches)] or [[]]


def events_of(raw) -> list[dict]:
    """:data:`EVENTS` tuples as event rows, sorted by event time."""
    events = [event(f"e{n}", hour * 3_600_000, kind, user=user, item=item, domain=domain, category=category)
              for n, (hour, user, item, domain, kind, category) in enumerate(raw)]
    return sorted(events, key=lambda e: e["event_time_ms"])


@settings(max_examples=25, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(EVENTS, st.integers(1, 4))
def test_day_by_day_equals_all_at_once(raw, days_per_batch):
    events = events_of(raw)
    whole = run_batches([events] if events else [[]])
    daily = run_batches(by_days(events, days_per_batch))
    assert whole[0] == daily[0]  # examples, labels and features
    assert whole[1] == daily[1] and whole[2] == daily[2]  # cross-domain and per-domain sequences
    assert _canon(whole[3]) == _canon(daily[3])  # feature tables
    assert len(whole[0]) == sum(e["event_type"] == "impression" for e in events)  # each published once
    for row in whole[0]:  # leakage: every sequence element strictly before the example, appended before it
        assert all(t < row["event_time_ms"] for t in row["seq_event_time_ms"] + row["seq_same_domain_event_time_ms"])
        assert all(d > 0 for d in row["seq_time_delta_ms"])


def test_truncation_keeps_newest_with_siblings_and_counts_cut():
    events = [event(f"v{i}", i * 1000, "engagement", item=f"i{i}", domain="d1" if i % 2 else "d2",
                    category=f"c{i}") for i in range(6)]
    events.append(event("imp", 10_000, "impression", item="x", domain="d1"))
    (row,), *_ = run_batches([events[:3], events[3:]])
    assert row["seq_item_ids"] == ["i3", "i4", "i5"] and row["seq_categories"] == ["c3", "c4", "c5"]
    assert row["seq_domains"] == ["d1", "d2", "d1"] and row["seq_event_time_ms"] == [3000, 4000, 5000]
    assert (row["seq_length"], row["seq_truncated"]) == (3, 3)
    assert row["seq_same_domain_item_ids"] == ["i3", "i5"] and row["seq_same_domain_truncated"] == 1
    assert row["seq_same_domain_time_delta_ms"] == [7000, 5000]


def test_empty_history_and_backfill_not_seen():
    imp = event("imp", 5 * DAY, "impression")
    # Old event time, appended after the impression: a backfill the impression could not have seen.
    backfill = event("late", DAY, "click", created_ts_ms=5 * DAY + 10)
    (row,), *_ = run_batches([[imp, backfill]])
    assert (row["seq_item_ids"], row["seq_length"], row["seq_truncated"]) == ([], 0, 0)
    assert row["f_user_clicks_7d"] == 0.0 and row["f_item_clicks_7d"] == 0.0


def test_per_domain_windows_decide_labels():
    config = BuildConfig(click_window_ms=100, conversion_window_ms=1000, window_overrides=("d2:conversion:5000",))
    events = [event("a", 0, "impression", domain="d1"), event("ac", 3000, "conversion", domain="d1"),
              event("b", 0, "impression", item="i2", domain="d2"), event("bc", 3000, "conversion", item="i2",
                                                                          domain="d2")]
    rows, *_ = run_batches([events], config)
    assert [(r["example_id"], r["label_conversion"], r["conversion_latency_ms"]) for r in rows] == [
        ("a", 0, None), ("b", 1, 3000)]


def test_pending_table_roundtrip_types():
    assert pa.Table.from_pylist([], schema=PENDING_SCHEMA).schema == PENDING_SCHEMA
