"""drop_duplicates / split_late / committed_ids against brute-force references and hand-checked cases."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.dataset as pads
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.dedup import (
    committed_ids,
    dates_between,
    drop_duplicates,
    dropped_offsets,
    offset_runs,
    split_conflicts,
    split_late,
)
from ingest.schema import EVENTS_TABLE_SCHEMA, LATE_EVENTS_SCHEMA

DAY = 86_400_000


def _events(rows: list[tuple[str, int, int]]) -> pa.Table:
    """(event_id, event_time_ms, partition) rows as a full events table, offsets in row order."""
    full = []
    for off, (eid, ms, part) in enumerate(rows):
        full.append({"event_id": eid, "event_time_ms": ms, "user_id": "u", "item_id": "i", "domain": "d",
                     "event_type": "impression", "schema_version": 1, "created_ts_ms": 0,
                     "event_date": dates_between(ms, ms)[0], "kafka_topic": "t", "kafka_partition": part,
                     "kafka_offset": off, "event_time_us": ms * 1000})
    return pa.Table.from_pylist(full, schema=EVENTS_TABLE_SCHEMA)


def _committed(rows: list[tuple[str, int]]) -> pa.Table:
    return pa.table({"event_id": pa.array([r[0] for r in rows], pa.string()),
                     "event_time_ms": pa.array([r[1] for r in rows], pa.int64())})


def test_dedup_hand_checked():
    events = _events([("a", 1000, 0), ("b", 2000, 0), ("a", 1500, 1), ("c", 5000, 0), ("a", 9000, 0),
                      ("a", 9100, 1), ("d", 100, 2)])
    kept, dropped = drop_duplicates(events, _committed([("c", 4000), ("d", 100 - 5001)]), window_ms=5000)
    # a@1500 is within 5 s of a@1000; a@9000 is not (kept), a@9100 is within 5 s of the kept a@9000;
    # c is within 5 s of the committed c@4000; d is 5001 ms from the committed d: kept.
    assert kept["kafka_offset"].to_pylist() == [0, 1, 4, 6]
    assert dropped == 3


def _brute(rows, committed, window):
    kept_times = {}
    for eid, ms in committed:
        kept_times.setdefault(eid, []).append(ms)
    keep = []
    for i, (eid, ms, _) in enumerate(rows):
        if any(abs(ms - t) <= window for t in kept_times.get(eid, [])):
            continue
        kept_times.setdefault(eid, []).append(ms)
        keep.append(i)
    return keep


_ids = st.sampled_from(["a", "b", "c", "d"])
_times = st.integers(0, 20_000)


@settings(max_examples=120, deadline=None, derandomize=True)
@given(st.lists(st.tuples(_ids, _times, st.integers(0, 2)), max_size=30),
       st.lists(st.tuples(_ids, _times), max_size=6), st.integers(0, 8000))
def test_dedup_matches_brute_force(rows, committed, window):
    kept, dropped = drop_duplicates(_events(rows), _committed(committed), window)
    expected = _brute(rows, committed, window)
    assert kept["kafka_offset"].to_pylist() == expected
    assert dropped == len(rows) - len(expected)


def test_split_late_hand_checked():
    events = _events([("a", 10 * DAY, 0), ("b", 7 * DAY, 0), ("c", 8 * DAY, 0), ("d", 1, 1), ("e", 5 * DAY, 2)])
    on_time, late, marks = split_late(events, {0: 9 * DAY, 2: 3 * DAY, 5: 42}, allowed_lateness_ms=DAY + 1,
                                      now_ms=100 * DAY)
    assert on_time["event_id"].to_pylist() == ["a", "c", "d", "e"]  # c is exactly DAY behind: allowed
    assert late.schema == LATE_EVENTS_SCHEMA
    assert [(r["event_id"], r["watermark_ms"], r["lateness_ms"]) for r in late.to_pylist()] == [("b", 9 * DAY, 2 * DAY)]
    assert marks == {0: 10 * DAY, 1: 1, 2: 5 * DAY, 5: 42}  # partition 1 had no watermark: nothing late there


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.lists(st.tuples(_ids, _times, st.integers(0, 2)), max_size=30),
       st.dictionaries(st.integers(0, 2), _times, max_size=3), st.integers(0, 5000), _times)
def test_split_late_partitions_rows_and_never_lowers_watermarks(rows, marks, lateness, now_ms):
    on_time, late, new_marks = split_late(_events(rows), marks, lateness, now_ms=now_ms)
    assert on_time.num_rows + late.num_rows == len(rows)
    for r in late.to_pylist():
        assert r["lateness_ms"] == marks[r["kafka_partition"]] - r["event_time_ms"] > lateness
    for r in on_time.to_pylist():
        p = r["kafka_partition"]
        assert p not in marks or r["event_time_ms"] >= marks[p] - lateness
        assert new_marks[p] >= min(r["event_time_ms"], now_ms)
    assert all(new_marks[p] >= w for p, w in marks.items())
    # Never ahead of the clock, unless the committed watermark already was (it never moves back).
    assert all(w <= max(now_ms, marks.get(p, now_ms)) for p, w in new_marks.items())
    expected = dict(marks)  # brute force: max(W, each on-time event time capped at the clock)
    for r in on_time.to_pylist():
        p, t = r["kafka_partition"], min(r["event_time_ms"], now_ms)
        expected[p] = max(expected.get(p, t), t)
    assert new_marks == expected


def test_split_late_watermark_is_capped_at_the_clock():
    now, skew, lateness = 1_750_000_000_000, 5 * 60_000, 60_000  # the default 5 min skew; 1 min lateness
    # Batch 1: partition 0 has W = now - 10 s; one event 4 min ahead of the clock (inside the skew,
    # so parsing accepted it) and one at now - 2 s. Partition 1 (no W yet) sees only a future event.
    first = _events([("a", now + 4 * 60_000, 0), ("b", now - 2_000, 0), ("c", now + 3 * 60_000, 1)])
    on_time, late, marks = split_late(first, {0: now - 10_000}, lateness, now_ms=now)
    assert 4 * 60_000 < skew and on_time.num_rows == 3 and late.num_rows == 0
    assert marks == {0: now, 1: now}  # uncapped these would be now + 4 min and now + 3 min
    # Batch 2, a second later: events at the true time, up to 50 s old. Against an uncapped W of
    # now + 4 min they would be 3-4 min behind, more than the 1 min allowed, and all go to late_events.
    second = _events([("d", now, 0), ("e", now - 50_000, 0), ("f", now - 30_000, 1)])
    on_time, late, marks = split_late(second, marks, lateness, now_ms=now + 1_000)
    assert on_time["event_id"].to_pylist() == ["d", "e", "f"] and late.num_rows == 0
    assert marks == {0: now, 1: now}
    # A row more than the allowed lateness behind the capped W is still late, measured from W = now.
    third = _events([("g", now - 61_000, 0)])
    _, late, _ = split_late(third, marks, lateness, now_ms=now + 2_000)
    assert [(r["event_id"], r["watermark_ms"], r["lateness_ms"]) for r in late.to_pylist()] == [("g", now, 61_000)]


def test_split_late_keeps_a_watermark_already_past_the_clock():
    # A W committed ahead of this batch's clock (an older lake, or a host whose clock ran fast) does not move back.
    on_time, late, marks = split_late(_events([("a", 900, 0), ("b", 5_000, 0)]), {0: 2_000}, 10_000, now_ms=1_000)
    assert on_time.num_rows == 2 and late.num_rows == 0 and marks == {0: 2_000}


def test_committed_ids_reads_only_the_window_and_the_ids(tmp_path):
    old = _events([("a", 1 * DAY, 0), ("b", 10 * DAY, 0), ("a", 20 * DAY, 0), ("z", 10 * DAY, 0)])
    pads.write_dataset(old, tmp_path, format="parquet", partitioning=["event_date"], partitioning_flavor="hive")
    dataset = pads.dataset(tmp_path, format="parquet", partitioning="hive")
    batch = _events([("a", 10 * DAY + 5, 0), ("b", 10 * DAY, 0)])
    got = committed_ids(dataset, batch, window_ms=DAY)
    assert sorted(zip(got["event_id"].to_pylist(), got["event_time_ms"].to_pylist())) == [("b", 10 * DAY)]
    assert committed_ids(None, batch, DAY).num_rows == 0


@pytest.mark.parametrize(("lo", "hi", "expected"), [
    (0, 0, ["1970-01-01"]), (-1, 0, ["1969-12-31", "1970-01-01"]), (DAY - 1, 2 * DAY, ["1970-01-01", "1970-01-02", "1970-01-03"]),
])
def test_dates_between(lo, hi, expected):
    assert dates_between(lo, hi) == expected


def test_dates_between_rejects_reversed_bounds():
    with pytest.raises(ValueError, match="min_ms <= max_ms"):
        dates_between(5, 4)


def test_offset_runs_are_half_open_runs_per_partition():
    assert offset_runs([], []) == {}
    assert offset_runs([1, 0, 0, 0, 0, 1, 0], [7, 3, 1, 2, 5, 8, 2]) == {"0": [[1, 4], [5, 6]], "1": [[7, 9]]}


def test_dropped_offsets_name_the_identical_duplicates_not_the_conflicts():
    # e1 twice (identical: dropped), e2 twice with another time in the window (another payload: a conflict).
    batch = _events([("e1", DAY, 0), ("e2", DAY, 0), ("e1", DAY, 0), ("e2", DAY + 1, 0), ("e3", DAY, 1)])
    kept, n = drop_duplicates(batch, _committed([]), DAY)
    assert n == 2
    conflicts, identical = split_conflicts(batch, kept, _committed([]).append_column("event_time_us", pa.array(
        [], pa.int64())), DAY)
    assert identical == 1 and conflicts["kafka_offset"].to_pylist() == [3]
    assert dropped_offsets(batch, kept, conflicts) == {"0": [[2, 3]]}
    assert dropped_offsets(kept, kept, conflicts) == {}
