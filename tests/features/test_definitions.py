"""Windowed counters: hand-checked windows, strictly-before, smoothing, schemas, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from features.definitions import (
    COUNTER_NAMES,
    DAY_MS,
    HOUR_MS,
    ITEM_FEATURES,
    USER_FEATURES,
    CounterIndex,
    counters_as_of,
    smoothed_ctr,
)

T = 100 * DAY_MS  # query time


def test_counters_over_windows_hand_checked():
    times = [
        T - 10 * DAY_MS,       # impression: all-time only
        T - 3 * DAY_MS,        # impression: 7d, all
        T - 3 * DAY_MS + 5,    # click: 7d, all
        T - 2 * HOUR_MS,       # impression: 1d, 7d, all
        T - HOUR_MS,           # impression: exactly 1h before -> inside [t - 1h, t)
        T - HOUR_MS + 1,       # click: 1h
        T - 1,                 # conversion: 1h
        T,                     # impression at t: excluded everywhere
    ]
    types = ["impression", "impression", "click", "impression", "impression", "click", "conversion", "impression"]
    got = counters_as_of(times, types, T, a=1.0, b=3.0)
    assert set(got) == set(COUNTER_NAMES)
    expected_counts = {
        "1h": (1, 1, 1),
        "1d": (2, 1, 1),
        "7d": (3, 2, 1),
        "all": (4, 2, 1),
    }
    for window, (imps, clicks, convs) in expected_counts.items():
        assert got[f"impressions_{window}"] == imps
        assert got[f"clicks_{window}"] == clicks
        assert got[f"conversions_{window}"] == convs
        assert got[f"ctr_{window}"] == pytest.approx((clicks + 1.0) / (imps + 4.0))


def test_no_history_gives_zero_counts_and_prior_ctr():
    got = counters_as_of([], [], T, a=1.0, b=1.0)
    assert got["impressions_all"] == 0 and got["clicks_7d"] == 0
    assert got["ctr_all"] == 0.5 and got["ctr_1h"] == 0.5


def test_smoothed_ctr_values():
    np.testing.assert_allclose(smoothed_ctr(np.array([0, 1, 9]), np.array([0, 10, 10]), 1.0, 9.0),
                               [0.1, 2 / 20, 10 / 20])


@pytest.mark.parametrize(("a", "b"), [(-1.0, 1.0), (1.0, -0.5), (0.0, 0.0)])
def test_smoothed_ctr_rejects_bad_prior(a, b):
    with pytest.raises(ValueError, match="CTR prior needs"):
        smoothed_ctr(1, 2, a, b)


@pytest.mark.parametrize(
    ("message", "times", "types"),
    [
        ("times_ms has 2 entries but event_types has 1", [1, 2], ["click"]),
        ("must be ascending", [2, 1], ["click", "click"]),
    ],
)
def test_counter_index_rejects_bad_input(message, times, types):
    with pytest.raises(ValueError, match=message):
        CounterIndex(times, types)


@settings(max_examples=50, deadline=None)
@given(
    events=st.lists(st.tuples(st.integers(0, 10 * DAY_MS), st.sampled_from(["impression", "click", "conversion",
                                                                               "engagement"])), max_size=40),
    queries=st.lists(st.integers(0, 11 * DAY_MS), min_size=1, max_size=5),
)
def test_vectorised_counts_match_brute_force(events, queries):
    events.sort()
    index = CounterIndex([t for t, _ in events], [k for _, k in events])
    got = index.as_of(queries, a=2.0, b=3.0)
    for q_i, q in enumerate(queries):
        for window, w in {"1h": HOUR_MS, "1d": DAY_MS, "7d": 7 * DAY_MS, "all": None}.items():
            inside = [k for t, k in events if t < q and (w is None or t >= q - w)]
            assert got[f"impressions_{window}"][q_i] == inside.count("impression")
            assert got[f"clicks_{window}"][q_i] == inside.count("click")
            assert got[f"conversions_{window}"][q_i] == inside.count("conversion")


def test_feature_views_declare_keys_times_and_every_counter():
    for view, keys in ((USER_FEATURES, ("user_id", "domain")), (ITEM_FEATURES, ("item_id", "domain"))):
        assert view.entity_keys == keys
        names = view.schema.names
        assert set(keys) | {view.timestamp_field, view.created_timestamp_field} <= set(names)
        assert set(COUNTER_NAMES) <= set(names)
