"""Assembly of ``examples`` rows: one per impression, all features as of the impression's time.

A row (schema :data:`EXAMPLES_SCHEMA`, contract in :mod:`sequences.schema`) joins

- identity: ``example_id`` (the impression's event_id), ``event_time_ms``, ``event_date`` (UTC);
- sparse features as strings (``position`` and ``age`` converted with ``str``; None stays None);
- the behaviour sequence strictly before the impression (:mod:`sequences.history`);
- labels from later events (:mod:`sequences.labels`);
- dense features (float64, :data:`DENSE_FEATURES`), counters of :mod:`features.definitions`
  as of the impression's time (events strictly before it):

  ============================  =========================================================
  f_user_impressions_1d/7d      impressions of this user in this domain, last 1 d / 7 d
  f_user_clicks_1d/7d           clicks of this user in this domain, last 1 d / 7 d
  f_user_conversions_7d         conversions of this user in this domain, last 7 d
  f_user_ctr_7d / _all          smoothed CTR of the user in this domain, 7 d / all time
  f_item_impressions_7d         impressions of this item in this domain (all users), 7 d
  f_item_clicks_7d              clicks of this item in this domain, 7 d
  f_item_ctr_7d / _all          smoothed CTR of the item in this domain, 7 d / all time
  f_item_conversions_all        conversions of this item in this domain, all time
  f_seq_length                  number of events in the behaviour sequence
  ============================  =========================================================

User counters come from the user's own events (the user-keyed pass); item counters need every
user's events on the item, so an item-keyed pass computes them (:func:`item_features`) and the
build joins them to the user's impressions by example_id.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from features.definitions import CounterIndex
from ingest.schema import IMPRESSION_TYPES
from sequences.config import BuildConfig
from sequences.history import Event, Timeline, sorted_unique_events
from sequences.labels import label_impressions
from sequences.schema import EXAMPLES_BASE_SCHEMA, SPARSE_FEATURES

USER_DENSE: dict[str, str] = {
    "f_user_impressions_1d": "impressions_1d",
    "f_user_clicks_1d": "clicks_1d",
    "f_user_impressions_7d": "impressions_7d",
    "f_user_clicks_7d": "clicks_7d",
    "f_user_conversions_7d": "conversions_7d",
    "f_user_ctr_7d": "ctr_7d",
    "f_user_ctr_all": "ctr_all",
}
"""Dense user feature -> counter of the (user_id, domain) entity."""

ITEM_DENSE: dict[str, str] = {
    "f_item_impressions_7d": "impressions_7d",
    "f_item_clicks_7d": "clicks_7d",
    "f_item_ctr_7d": "ctr_7d",
    "f_item_ctr_all": "ctr_all",
    "f_item_conversions_all": "conversions_all",
}
"""Dense item feature -> counter of the (item_id, domain) entity."""

DENSE_FEATURES: tuple[str, ...] = (*USER_DENSE, *ITEM_DENSE, "f_seq_length")
"""All dense feature columns of ``examples``, in schema order."""

EXAMPLES_SCHEMA = pa.schema(
    list(EXAMPLES_BASE_SCHEMA) + [pa.field(name, pa.float64()) for name in DENSE_FEATURES]
)
"""The full ``examples`` schema this build writes."""

_DAY_MS = 24 * 3600 * 1000


def _utc_date(t_ms: int, cache: dict[int, str]) -> str:
    day = t_ms // _DAY_MS
    if day not in cache:
        cache[day] = dt.datetime.fromtimestamp(day * 86400, tz=dt.UTC).strftime("%Y-%m-%d")
    return cache[day]


def _as_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _impressions_by_domain(events: list[Event]) -> dict[str, list[Event]]:
    by_domain: dict[str, list[Event]] = defaultdict(list)
    for event in events:
        if event["event_type"] in IMPRESSION_TYPES:
            by_domain[event["domain"]].append(event)
    return by_domain


def _dense_per_impression(
    events: list[Event], mapping: Mapping[str, str], config: BuildConfig
) -> dict[str, dict[str, float]]:
    """``{impression event_id: {f_name: value}}``; counters per domain over sorted ``events``."""
    out: dict[str, dict[str, float]] = {}
    impressions = _impressions_by_domain(events)
    for domain, domain_impressions in impressions.items():
        in_domain = [e for e in events if e["domain"] == domain]
        index = CounterIndex([e["event_time_ms"] for e in in_domain], [e["event_type"] for e in in_domain])
        values = index.as_of(
            np.fromiter((e["event_time_ms"] for e in domain_impressions), dtype=np.int64, count=len(domain_impressions)),
            a=config.ctr_prior_clicks,
            b=config.ctr_prior_non_clicks,
        )
        columns = {f_name: values[counter].tolist() for f_name, counter in mapping.items()}
        for i, event in enumerate(domain_impressions):
            out[event["event_id"]] = {f_name: column[i] for f_name, column in columns.items()}
    return out


def item_features(item_events: Iterable[Event], config: BuildConfig) -> list[tuple[str, str, dict[str, float]]]:
    """Item counters (:data:`ITEM_DENSE`) as of each impression of one item.

    Args:
        item_events: every user's events on one item_id (any domains, any order, duplicates ok).

    Returns:
        ``[(user_id, example_id, {f_item_*: float})]``, one per impression, keyed for the join
        with the impression's user.
    """
    events = sorted_unique_events(item_events)
    dense = _dense_per_impression(events, ITEM_DENSE, config)
    return [(e["user_id"], e["event_id"], dense[e["event_id"]]) for e in events if e["event_id"] in dense]


def _list_column(values: pa.Array, offsets: np.ndarray, index: np.ndarray, list_type: pa.DataType) -> pa.Array:
    """list<T> column whose row i is ``values[index[offsets[i]:offsets[i+1]]]``."""
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values.take(pa.array(index)), type=list_type)


def assemble_examples(
    user_events: Iterable[Event],
    item_dense: Mapping[str, Mapping[str, float]],
    config: BuildConfig,
    watermark_ms: int,
) -> pa.Table:
    """The ``examples`` rows (a table of exactly :data:`EXAMPLES_SCHEMA`) of one user's impressions.

    Row order follows the impressions' (event_time_ms, event_id). The sequence columns are sliced
    from the user's sorted timeline with one vectorised gather (Q impressions with histories of
    length L_i give T = sum L_i list values), so the cost is O(n log n + T) with no per-value
    Python work.

    Args:
        user_events: all events of one user (any order, duplicates ok).
        item_dense: ``{example_id: {f_item_*: float}}`` from :func:`item_features`.
        watermark_ms: max event_time_ms of the snapshot (ms since epoch UTC).

    Raises:
        ValueError: an impression has no entry in ``item_dense`` (the item pass missed it), or
            the events are malformed (see :func:`sequences.history.sorted_unique_events`).
    """
    timeline = Timeline(user_events)
    impressions = [e for e in timeline.events if e["event_type"] in IMPRESSION_TYPES]
    if not impressions:
        return EXAMPLES_SCHEMA.empty_table()
    missing = [e["event_id"] for e in impressions if e["event_id"] not in item_dense]
    if missing:
        raise ValueError(
            f"no item features for impressions {missing[:3]!r} ({len(missing)} in all); "
            "item_dense must come from item_features over the same events"
        )
    labels = label_impressions(
        timeline.events,
        click_window_ms=config.click_window_ms,
        conversion_window_ms=config.conversion_window_ms,
        watermark_ms=watermark_ms,
    )
    user_dense = _dense_per_impression(timeline.events, USER_DENSE, config)
    times = np.fromiter((e["event_time_ms"] for e in impressions), dtype=np.int64, count=len(impressions))
    start, end = timeline.history_bounds(times, config.max_seq_len)
    lengths = end - start
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    # Index of every list value in the timeline: row i contributes start[i], ..., end[i] - 1.
    index = np.repeat(start - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)

    dates: dict[int, str] = {}
    ids = [e["event_id"] for e in impressions]
    columns: dict[str, Any] = {
        "example_id": ids,
        "event_time_ms": times,
        "event_date": [_utc_date(int(t), dates) for t in times],
        **{name: [_as_str(e.get(name)) for e in impressions] for name in SPARSE_FEATURES},
    }
    list_str = EXAMPLES_SCHEMA.field("seq_item_ids").type
    for column, values in (
        ("seq_item_ids", timeline.item_ids),
        ("seq_categories", timeline.categories),
        ("seq_event_types", timeline.event_types),
        ("seq_domains", timeline.domains),
    ):
        columns[column] = _list_column(pa.array(values, pa.string()), offsets, index, list_str)
    columns["seq_event_time_ms"] = _list_column(
        pa.array(timeline.times_ms, pa.int64()), offsets, index, EXAMPLES_SCHEMA.field("seq_event_time_ms").type
    )
    columns["seq_length"] = lengths
    columns["seq_truncated"] = start
    for field in ("label_click", "label_conversion", "click_latency_ms", "conversion_latency_ms",
                  "label_window_closed"):
        columns[field] = [getattr(labels[i], field) for i in ids]
    for name in USER_DENSE:
        columns[name] = [user_dense[i][name] for i in ids]
    for name in ITEM_DENSE:
        columns[name] = [item_dense[i][name] for i in ids]
    columns["f_seq_length"] = lengths.astype(np.float64)
    arrays = [pa.array(columns[f.name], f.type) if not isinstance(columns[f.name], pa.Array) else columns[f.name]
              for f in EXAMPLES_SCHEMA]
    return pa.Table.from_arrays(arrays, schema=EXAMPLES_SCHEMA)


def rows_to_table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """Rows to an Arrow table of exactly ``schema`` (list columns keep their types when all empty).

    Raises:
        pyarrow.ArrowInvalid / ArrowTypeError: a value does not fit its column's type.
    """
    return pa.Table.from_pylist(rows, schema=schema)
