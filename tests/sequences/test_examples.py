"""Example assembly: a hand-checked row, the item pass, and the no-leakage invariant."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from features.definitions import DAY_MS, HOUR_MS
from sequences.config import BuildConfig
from sequences.examples import DENSE_FEATURES, EXAMPLES_SCHEMA, assemble_examples, item_features, rows_to_table
from sequences.schema import EXAMPLES_BASE_SCHEMA, dense_feature_names

# The rows' sequence lists are what these tests check: the fat layout's.
CONFIG = BuildConfig(max_seq_len=2, click_window_ms=HOUR_MS, conversion_window_ms=DAY_MS,
                     ctr_prior_clicks=1.0, ctr_prior_non_clicks=1.0, examples_layout="fat")
T0 = 1_000 * DAY_MS  # 1972-09-27


def _both_passes(events, config=CONFIG, watermark_ms=None):
    watermark_ms = max(e["event_time_ms"] for e in events) if watermark_ms is None else watermark_ms
    item_dense = {}
    for item in {e["item_id"] for e in events}:
        for _, example_id, dense in item_features([e for e in events if e["item_id"] == item], config):
            item_dense[example_id] = dense
    rows = []
    for user in sorted({e["user_id"] for e in events}):
        table = assemble_examples([e for e in events if e["user_id"] == user], item_dense, config, watermark_ms)
        assert table.schema == EXAMPLES_SCHEMA
        rows += table.to_pylist()
    return rows


def test_hand_checked_example_row(make_event):
    events = [
        make_event("u1_imp_old", T0 - 2 * DAY_MS, "impression", item="i9", category="cat9"),
        make_event("u1_click_old", T0 - 2 * DAY_MS + 10, "click", item="i9", category="cat9"),
        make_event("u1_view", T0 - HOUR_MS, "engagement", item="i5", domain="d2"),
        make_event("u2_imp", T0 - 3 * HOUR_MS, "impression", user="u2", item="i1"),
        make_event("u2_click", T0 - 3 * HOUR_MS + 1, "click", user="u2", item="i1"),
        make_event("u1_imp", T0, "impression", item="i1", category="cat1", position=3, age=34, gender="F",
                   location="10001", ad_format="video"),
        make_event("u1_click", T0 + 60_000, "click", item="i1"),
    ]
    rows = {r["example_id"]: r for r in _both_passes(events)}
    assert set(rows) == {"u1_imp_old", "u2_imp", "u1_imp"}
    row = rows["u1_imp"]
    assert row["event_date"] == "1972-09-27" and row["event_time_ms"] == T0
    assert (row["position"], row["age"], row["gender"], row["location"], row["ad_format"]) == (
        "3", "34", "F", "10001", "video")
    # Sequence: newest 2 of the 3 earlier u1 events; u2's events never appear.
    assert row["seq_item_ids"] == ["i9", "i5"] and row["seq_event_types"] == ["click", "engagement"]
    assert row["seq_categories"] == ["cat9", ""] and row["seq_domains"] == ["d1", "d2"]
    assert (row["seq_length"], row["seq_truncated"], row["f_seq_length"]) == (2, 1, 2.0)
    assert (row["label_click"], row["click_latency_ms"], row["label_conversion"]) == (1, 60_000, 0)
    assert row["label_window_closed"] is False  # T0 + 1 d > watermark T0 + 1 min
    # User counters in domain d1 before T0: 1 impression and 1 click two days ago.
    assert (row["f_user_impressions_1d"], row["f_user_clicks_1d"]) == (0.0, 0.0)
    assert (row["f_user_impressions_7d"], row["f_user_clicks_7d"], row["f_user_conversions_7d"]) == (1.0, 1.0, 0.0)
    assert row["f_user_ctr_7d"] == pytest.approx(2 / 3) and row["f_user_ctr_all"] == pytest.approx(2 / 3)
    # Item i1 counters before T0 come from u2: 1 impression, 1 click.
    assert (row["f_item_impressions_7d"], row["f_item_clicks_7d"], row["f_item_conversions_all"]) == (1.0, 1.0, 0.0)
    assert row["f_item_ctr_7d"] == pytest.approx(2 / 3)
    # The first impression sees nothing: empty lists and prior CTRs.
    first = rows["u1_imp_old"]
    assert first["seq_item_ids"] == [] and first["seq_event_time_ms"] == [] and first["seq_length"] == 0
    assert first["f_user_ctr_all"] == 0.5 and first["f_item_ctr_all"] == 0.5


def test_schema_has_dense_features_after_base_columns():
    assert EXAMPLES_SCHEMA.names[: len(EXAMPLES_BASE_SCHEMA)] == EXAMPLES_BASE_SCHEMA.names
    assert tuple(dense_feature_names(EXAMPLES_SCHEMA)) == DENSE_FEATURES
    assert all(EXAMPLES_SCHEMA.field(n).type == pa.float64() for n in DENSE_FEATURES)


def test_all_empty_lists_keep_declared_types(make_event):
    rows = _both_passes([make_event("only", T0, "impression")])
    table = rows_to_table(rows, EXAMPLES_SCHEMA)
    assert table.schema == EXAMPLES_SCHEMA
    assert table.column("seq_item_ids").to_pylist() == [[]]
    no_impressions = assemble_examples([make_event("c", T0, "click")], {}, CONFIG, T0)
    assert no_impressions.num_rows == 0 and no_impressions.schema == EXAMPLES_SCHEMA


def test_missing_item_features_raise(make_event):
    with pytest.raises(ValueError, match=r"no item features for impressions \['x'\]"):
        assemble_examples([make_event("x", T0, "impression")], {}, CONFIG, T0)


def _random_events(seed: int, n: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    types = ["impression", "click", "conversion", "engagement"]
    return [
        {
            "event_id": f"e{i}", "event_time_ms": int(rng.integers(0, 50)) * 1000, "user_id": f"u{rng.integers(4)}",
            "item_id": f"i{rng.integers(5)}", "domain": f"d{rng.integers(2)}", "event_type": types[rng.integers(4)],
            "category": None, "position": None, "ad_format": None, "age": None, "gender": None, "location": None,
            "schema_version": 1, "created_ts_ms": 0,
        }
        for i in range(n)
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_leakage_on_random_events(seed):
    events = _random_events(seed, 300)
    config = BuildConfig(max_seq_len=7, click_window_ms=5_000, conversion_window_ms=20_000, examples_layout="fat")
    rows = _both_passes(events, config)
    by_id = {e["event_id"]: e for e in events}
    impressions = [e for e in events if e["event_type"] == "impression"]
    assert sorted(r["example_id"] for r in rows) == sorted(e["event_id"] for e in impressions)
    for row in rows:
        t = row["event_time_ms"]
        assert all(s < t for s in row["seq_event_time_ms"])
        assert row["seq_event_time_ms"] == sorted(row["seq_event_time_ms"])
        user_before = [e for e in events if e["user_id"] == row["user_id"] and e["event_time_ms"] < t]
        assert row["seq_length"] == min(7, len(user_before))
        assert row["seq_truncated"] == len(user_before) - row["seq_length"]
        item_before = [e for e in events if e["item_id"] == row["item_id"] and e["domain"] == row["domain"]
                       and e["event_time_ms"] < t]
        assert row["f_item_impressions_7d"] == sum(e["event_type"] == "impression" for e in item_before)
        assert by_id[row["example_id"]]["user_id"] == row["user_id"]
