"""features.vectorized: the polars fast path of the counters' prefix sums against the numpy reference."""

from __future__ import annotations

import numpy as np
import polars as pl
from hypothesis import given
from hypothesis import strategies as st

from features.definitions import COUNTED_TYPES
from features.vectorized import prefix_counts

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
