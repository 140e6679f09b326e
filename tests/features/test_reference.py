"""Feature-table rows as of a snapshot."""

from __future__ import annotations

import pytest

from features.definitions import DAY_MS, ITEM_FEATURES, USER_FEATURES
from features.reference import item_feature_rows, user_feature_rows
from sequences.config import BuildConfig

CONFIG = BuildConfig(ctr_prior_clicks=1.0, ctr_prior_non_clicks=1.0)
T = 10 * DAY_MS


def _events(make_event):
    return [
        make_event("e1", T - 2 * DAY_MS, "impression", age=30, gender="F", category="c1"),
        make_event("e2", T - 2 * DAY_MS + 1, "click", location="zip1", category="c2"),
        make_event("e3", T - 1, "impression", domain="d2", age=31, item="i2"),
        make_event("e4", T, "click", domain="d2", item="i2"),  # at the watermark: counted
        make_event("e5", T + 1, "impression", age=99, gender="X"),  # after the watermark: ignored
        make_event("e6", T - 5, "impression", user="u2", category=None),
    ]


def test_user_rows_hand_checked(make_event):
    rows = user_feature_rows("u1", [e for e in _events(make_event) if e["user_id"] == "u1"], as_of_ms=T,
                             config=CONFIG)
    assert [(r["domain"], r["event_ts_ms"], r["created_ts_ms"]) for r in rows] == [
        ("d1", T - 2 * DAY_MS + 1, T - 2 * DAY_MS + 2), ("d2", T, T + 1)]
    d1, d2 = rows
    assert (d1["impressions_all"], d1["clicks_all"], d1["impressions_1d"], d1["impressions_7d"]) == (1, 1, 0, 1)
    assert d1["ctr_7d"] == pytest.approx(2 / 3) and d1["ctr_1d"] == 0.5
    assert (d2["impressions_1h"], d2["clicks_1h"], d2["ctr_1h"]) == (1, 1, pytest.approx(2 / 3))
    # Latest non-null static attributes over all domains, up to the watermark.
    assert (d1["age"], d1["gender"], d1["location"]) == (31, "F", "zip1") == (d2["age"], d2["gender"], d2["location"])
    assert set(d1) == set(USER_FEATURES.schema.names)


def test_item_rows_per_domain_and_empty_item(make_event):
    events = [e for e in _events(make_event) if e["item_id"] == "i1"] + [
        make_event("e7", T - 3, "conversion", domain="d3", category="c3")]
    rows = item_feature_rows("i1", events, as_of_ms=T, config=CONFIG)
    assert [(r["domain"], r["impressions_all"], r["clicks_all"], r["conversions_all"], r["category"])
            for r in rows] == [("d1", 2, 1, 0, "c2"), ("d3", 0, 0, 1, "c3")]
    assert set(rows[0]) == set(ITEM_FEATURES.schema.names)
    assert item_feature_rows("i1", [make_event("late", T + 5, "impression")], as_of_ms=T, config=CONFIG) == []


def test_missing_created_ts_raises(make_event):
    with pytest.raises(ValueError, match="created_ts_ms must be an int"):
        user_feature_rows("u1", [make_event("a", 1, "click", created_ts_ms=None)], as_of_ms=5, config=CONFIG)


def test_user_category_rows_ttl_and_prior_counts(make_event):
    from features.reference import user_category_feature_rows

    events = [
        make_event("old", T - 31 * DAY_MS, "impression", category="c0"),  # past the 30 d TTL
        make_event("x1", T - 2 * DAY_MS, "impression", category="c1"),
        make_event("x2", T - 1, "click", category="c1"),
        make_event("x3", T - 5, "impression", category=None),  # no category: no user x category row
    ]
    rows = user_category_feature_rows("u1", events, as_of_ms=T, config=CONFIG,
                                      prior_counts={("d1", "c1"): {"impressions": 4, "clicks": 1}})
    assert [(r["category"], r["impressions_all"], r["clicks_all"], r["impressions_1d"], r["clicks_1h"])
            for r in rows] == [("c1", 5, 2, 0, 1)]
    assert rows[0]["ctr_all"] == pytest.approx(3 / 7) and rows[0]["event_date"] == "1970-01-10"
    # The user row counts the expired event in all-time counters but takes attributes only within the TTL.
    (user_row,) = user_feature_rows("u1", events, as_of_ms=T, config=CONFIG)
    assert (user_row["impressions_all"], user_row["impressions_7d"]) == (3, 2)
    assert user_feature_rows("u1", events[:1], as_of_ms=T, config=CONFIG) == []  # expired entity: no row
