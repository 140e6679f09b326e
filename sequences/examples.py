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


def assemble_examples(
    user_events: Iterable[Event],
    item_dense: Mapping[str, Mapping[str, float]],
    config: BuildConfig,
    watermark_ms: int,
) -> list[dict[str, Any]]:
    """One ``examples`` row (dict with the :data:`EXAMPLES_SCHEMA` fields) per impression of a user.

    Args:
        user_events: all events of one user (any order, duplicates ok).
        item_dense: ``{example_id: {f_item_*: float}}`` from :func:`item_features`.
        watermark_ms: max event_time_ms of the snapshot (ms since epoch UTC).

    Raises:
        ValueError: an impression has no entry in ``item_dense`` (the item pass missed it), or
            the events are malformed (see :func:`sequences.history.sorted_unique_events`).
    """
    timeline = Timeline(user_events)
    labels = label_impressions(
        timeline.events,
        click_window_ms=config.click_window_ms,
        conversion_window_ms=config.conversion_window_ms,
        watermark_ms=watermark_ms,
    )
    user_dense = _dense_per_impression(timeline.events, USER_DENSE, config)
    dates: dict[int, str] = {}
    rows: list[dict[str, Any]] = []
    for event in timeline.events:
        if event["event_type"] not in IMPRESSION_TYPES:
            continue
        example_id = event["event_id"]
        if example_id not in item_dense:
            raise ValueError(
                f"no item features for impression {example_id!r} (item {event['item_id']!r}); "
                "item_dense must come from item_features over the same events"
            )
        t_ms = event["event_time_ms"]
        history = timeline.history_before(t_ms, config.max_seq_len)
        label = labels[example_id]
        row: dict[str, Any] = {
            "example_id": example_id,
            "event_time_ms": t_ms,
            "event_date": _utc_date(t_ms, dates),
        }
        for name in SPARSE_FEATURES:
            row[name] = _as_str(event.get(name))
        row.update(
            seq_item_ids=history.item_ids,
            seq_categories=history.categories,
            seq_event_types=history.event_types,
            seq_domains=history.domains,
            seq_event_time_ms=history.event_times_ms,
            seq_length=history.length,
            seq_truncated=history.truncated,
            label_click=label.label_click,
            label_conversion=label.label_conversion,
            click_latency_ms=label.click_latency_ms,
            conversion_latency_ms=label.conversion_latency_ms,
            label_window_closed=label.label_window_closed,
        )
        row.update(user_dense[example_id])
        row.update(item_dense[example_id])
        row["f_seq_length"] = float(history.length)
        rows.append(row)
    return rows


def rows_to_table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """Rows to an Arrow table of exactly ``schema`` (list columns keep their types when all empty).

    Raises:
        pyarrow.ArrowInvalid / ArrowTypeError: a value does not fit its column's type.
    """
    return pa.Table.from_pylist(rows, schema=schema)
