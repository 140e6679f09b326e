"""features.vectorized: the polars fast path of the counters' prefix sums against the numpy reference."""

from __future__ import annotations

import numpy as np
import polars as pl
from hypothesis import given
from hypothesis import strategies as st

from features.definitions import COUNTED_TYPES
from features.vectorized import EVENT_ORDER, latest_non_null, latest_non_null_in_order, prefix_counts

TYPES = st.sampled_from(["impression", "click", "conversion", "engagement", None])


@given(st.lists(TYPES, max_size=200))
def test_prefix_counts_of_a_series_equal_those_of_its_numpy_array(types):
    series = pl.Series("event_type", types, dtype=pl.String)
    fast, reference = prefix_counts(series), prefix_counts(np.array(types, dtype=object))
    assert fast.keys() == reference.keys() == set(COUNTED_TYPES)
    for name in reference:
        assert fast[name].dtype == reference[name].dtype == np.int64 and np.array_equal(fast[name], reference[name])


def test_hand_checked_prefix_counts():
    counts = prefix_counts(pl.Series(["click", "impression", "click", None, "conversion"]))
    assert counts["clicks"].tolist() == [0, 1, 1, 2, 2, 2]
    assert counts["impressions"].tolist() == [0, 0, 1, 1, 1, 1]
    assert counts["conversions"].tolist() == [0, 0, 0, 0, 0, 1]


def _joined_reference(rows: pl.DataFrame, events: pl.DataFrame, keys: list[str], fields: list[str]) -> pl.DataFrame:
    for field in fields:
        rows = rows.join(latest_non_null(events, keys, field), on=keys, how="left")
    return rows


def test_hand_checked_latest_non_null_in_order():
    """u1/d0: age 30 then null (the last non-null is 30), gender the tie at t=2 broken by event_id (e2 > e1);
    u2 has no age at all (null); u3 is only in the rows joined onto."""
    events = pl.DataFrame({
        "user_id": ["u1", "u1", "u1", "u2", "u1"], "domain": ["d0", "d0", "d0", "d0", "d1"],
        "event_time_ms": [1, 2, 2, 1, 5], "event_id": ["e0", "e1", "e2", "e3", "e4"],
        "age": [30, None, None, None, 40], "gender": [None, "f", "m", "x", None],
    }).sort(["user_id", *EVENT_ORDER])
    rows = pl.DataFrame({"user_id": ["u3", "u2", "u1"], "domain": ["d0", "d0", "d0"]})
    got = rows.join(latest_non_null_in_order(events, ["user_id", "domain"], ["age", "gender"]),
                    on=["user_id", "domain"], how="left")
    assert got.to_dicts() == [{"user_id": "u3", "domain": "d0", "age": None, "gender": None},
                              {"user_id": "u2", "domain": "d0", "age": None, "gender": "x"},
                              {"user_id": "u1", "domain": "d0", "age": 30, "gender": "m"}]
    assert got.equals(_joined_reference(rows, events, ["user_id", "domain"], ["age", "gender"]))


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1), st.integers(0, 4), st.integers(0, 9),
                          st.none() | st.integers(0, 2), st.none() | st.sampled_from(["a", "b"])), max_size=40,
                unique_by=lambda r: (r[0], r[3])))  # a shard's events are unique per (entity, event_id)
def test_latest_non_null_in_order_equals_the_sorting_reference(rows):
    """Events sorted by (entity, time, event_id), as a shard's are, grouped by (entity, domain): the left join of
    latest_non_null_in_order equals the left joins of latest_non_null, field by field."""
    events = pl.DataFrame([{"user_id": f"u{u}", "domain": f"d{d}", "event_time_ms": t, "event_id": f"e{e}",
                            "age": a, "gender": g} for u, d, t, e, a, g in rows],
                          schema={"user_id": pl.String, "domain": pl.String, "event_time_ms": pl.Int64,
                                  "event_id": pl.String, "age": pl.Int64, "gender": pl.String})
    events = events.sort(["user_id", *EVENT_ORDER], maintain_order=True)
    keys = ["user_id", "domain"]
    owners = pl.DataFrame({"user_id": [f"u{u}" for u in range(5) for _ in range(2)],
                           "domain": [f"d{d}" for _ in range(5) for d in range(2)]})
    got = owners.join(latest_non_null_in_order(events, keys, ["age", "gender"]), on=keys, how="left")
    assert got.equals(_joined_reference(owners, events, keys, ["age", "gender"]))
