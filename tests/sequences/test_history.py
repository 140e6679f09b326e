"""Point-in-time history: truncation, empty history, strictly-before, dedup, bad rows."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.schema import sorted_unique_events
from sequences.history import History, Timeline, history_before, sequence_row


def test_truncation_keeps_newest_and_cuts_sibling_lists_alike(make_event):
    events = [make_event(f"e{i}", 100 + i, "click" if i % 2 else "impression", item=f"i{i}",
                         category=None if i == 3 else f"c{i}", domain=f"d{i % 2}") for i in range(6)]
    got = history_before(list(reversed(events)), 200, max_seq_len=4)
    assert got == History(
        item_ids=["i2", "i3", "i4", "i5"],
        categories=["c2", "", "c4", "c5"],
        event_types=["impression", "click", "impression", "click"],
        domains=["d0", "d1", "d0", "d1"],
        event_times_ms=[102, 103, 104, 105],
        truncated=2,
    )


def test_empty_history_is_empty_lists_not_none(make_event):
    got = history_before([make_event("a", 10, "impression")], 10, max_seq_len=3)
    assert got == History([], [], [], [], [], 0)
    assert got.length == 0


def test_event_at_exactly_t_is_excluded(make_event):
    events = [make_event("a", 5, "click"), make_event("b", 10, "click"), make_event("c", 10, "impression")]
    assert history_before(events, 10, max_seq_len=10).event_times_ms == [5]
    assert history_before(events, 11, max_seq_len=10).event_times_ms == [5, 10, 10]


def test_duplicates_are_dropped_and_order_is_time_then_id(make_event):
    events = [make_event("b", 7, "click"), make_event("a", 7, "impression"), make_event("b", 7, "click")]
    assert [e["event_id"] for e in sorted_unique_events(events)] == ["a", "b"]
    assert history_before(events, 8, max_seq_len=5).event_types == ["impression", "click"]


def test_sequence_row_includes_the_watermark_event(make_event):
    row = sequence_row("u1", [make_event("a", 3, "click"), make_event("b", 9, "impression")], as_of_ms=9,
                       max_seq_len=1)
    assert row == {
        "user_id": "u1", "seq_item_ids": ["i1"], "seq_categories": [""], "seq_event_types": ["impression"],
        "seq_domains": ["d1"], "seq_event_time_ms": [9], "seq_length": 1, "seq_truncated": 1, "as_of_ms": 9,
    }


@pytest.mark.parametrize(
    ("error", "message", "patch"),
    [
        (ValueError, "lacks required fields", {"user_id": None}),
        (ValueError, "lacks required fields", {"event_time_ms": None}),
        (TypeError, "event_time_ms must be int", {"event_time_ms": 1.5}),
        (TypeError, "event_time_ms must be int", {"event_time_ms": "12"}),
    ],
)
def test_bad_rows_raise(make_event, error, message, patch):
    with pytest.raises(error, match=message):
        Timeline([{**make_event("a", 1, "click"), **patch}])


def test_max_seq_len_must_be_positive(make_event):
    with pytest.raises(ValueError, match="max_seq_len must be >= 1, got 0"):
        history_before([make_event("a", 1, "click")], 5, max_seq_len=0)


@settings(max_examples=60, deadline=None)
@given(
    times=st.lists(st.integers(0, 50), max_size=30),
    t=st.integers(0, 60),
    n=st.integers(1, 8),
)
def test_matches_brute_force(times, t, n):
    events = [{"event_id": f"e{i}", "event_time_ms": x, "user_id": "u", "item_id": f"i{i}", "domain": "d",
               "event_type": "click"} for i, x in enumerate(times)]
    got = Timeline(events).history_before(t, n)
    before = sorted((x, f"e{i}") for i, x in enumerate(times) if x < t)
    assert got.event_times_ms == [x for x, _ in before][-n:]
    assert got.item_ids == ["i" + eid[1:] for _, eid in before][-n:]
    assert got.truncated == max(0, len(before) - n)
    assert all(x < t for x in got.event_times_ms)
    start, end = Timeline(events).history_bounds([t, t], n)
    assert (start.tolist(), end.tolist()) == ([got.truncated] * 2, [got.truncated + got.length] * 2)
