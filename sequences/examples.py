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

import dataclasses
import datetime as dt
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from features.definitions import CounterIndex
from ingest.schema import IMPRESSION_TYPES, EventRow, sorted_unique_events
from sequences.config import BuildConfig
from sequences.history import point_in_time_gather
from sequences.labels import CLICK, CONVERSION, _first_in_window
from sequences.publish import NO_LABEL, PublicationPlan, deadlines, published_rows
from sequences.schema import BUILD_EXTRA_SCHEMA, EXAMPLES_BASE_SCHEMA, SPARSE_FEATURES, pointer_schema

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
    list(EXAMPLES_BASE_SCHEMA) + list(BUILD_EXTRA_SCHEMA) + [pa.field(name, pa.float64()) for name in DENSE_FEATURES]
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


LABEL_COLUMNS: tuple[str, ...] = (
    "label_click", "label_conversion", "click_latency_ms", "conversion_latency_ms", "label_window_closed",
    "published_watermark_ms", "label_mode", "click_open", "conversion_open", "corrects_example_id", "correction_task",
)
"""Columns filled at publication (the rest are fixed when the impression is first seen)."""

PENDING_SCHEMA = pa.schema([f for f in EXAMPLES_SCHEMA if f.name not in LABEL_COLUMNS])
"""An example waiting for its attribution windows to close: everything but the labels."""


def examples_schema(config: BuildConfig) -> pa.Schema:
    """The ``examples`` schema of ``config.examples_layout``: :data:`EXAMPLES_SCHEMA`, or without its
    list columns for "pointer" (:func:`sequences.schema.pointer_schema`)."""
    return EXAMPLES_SCHEMA if config.examples_layout == "fat" else pointer_schema(EXAMPLES_SCHEMA)


def pending_schema(config: BuildConfig) -> pa.Schema:
    """The pending-state schema of ``config.examples_layout`` (the pointer layout computes no lists)."""
    return PENDING_SCHEMA if config.examples_layout == "fat" else pointer_schema(PENDING_SCHEMA)

_CONTEXT_FIELDS = ("event_id", "event_time_ms", "created_ts_ms", "user_id", "item_id", "domain", "event_type",
                   "category")


def _created(event: EventRow) -> int:
    value = event.get("created_ts_ms")
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(
            f"event {event.get('event_id')!r}: created_ts_ms must be an int (Kafka append time, ms since epoch "
            f"UTC), got {value!r}; events rows need EVENTS_TABLE_SCHEMA's created_ts_ms"
        )
    return value


def _dense_per_impression(
    events: list[EventRow],
    impressions: list[EventRow],
    mapping: Mapping[str, str],
    config: BuildConfig,
    prior_counts: Mapping[tuple[str, str], Mapping[str, int]] | None = None,
) -> dict[str, dict[str, float]]:
    """``{impression event_id: {f_name: value}}``: counters per domain over sorted ``events`` as of
    each impression (event time < t and appended at or before the impression)."""
    out: dict[str, dict[str, float]] = {}
    by_domain: dict[str, list[EventRow]] = defaultdict(list)
    for event in impressions:
        by_domain[event["domain"]].append(event)
    for domain, domain_impressions in by_domain.items():
        in_domain = [e for e in events if e["domain"] == domain]
        index = CounterIndex([e["event_time_ms"] for e in in_domain], [e["event_type"] for e in in_domain],
                             [_created(e) for e in in_domain])
        values = index.as_of(
            np.fromiter((e["event_time_ms"] for e in domain_impressions), dtype=np.int64, count=len(domain_impressions)),
            a=config.ctr_prior_clicks,
            b=config.ctr_prior_non_clicks,
            query_created_ms=[_created(e) for e in domain_impressions],
            prior_counts=(prior_counts or {}).get((domain, "")),
        )
        columns = {f_name: values[counter].tolist() for f_name, counter in mapping.items()}
        for i, event in enumerate(domain_impressions):
            out[event["event_id"]] = {f_name: column[i] for f_name, column in columns.items()}
    return out


def item_features(
    item_events: Iterable[EventRow],
    config: BuildConfig,
    prior_counts: Mapping[tuple[str, str], Mapping[str, int]] | None = None,
) -> list[tuple[str, str, dict[str, float]]]:
    """Item counters (:data:`ITEM_DENSE`) as of each impression of one item (point in time).

    Args:
        item_events: every user's events on one item_id (any domains, any order, duplicates ok).
        prior_counts: ``{(domain, ""): {"impressions": n, ...}}`` evicted from the build state,
            added to the all-time counters.

    Returns:
        ``[(user_id, example_id, {f_item_*: float})]``, one per impression, keyed for the join
        with the impression's user.
    """
    events = sorted_unique_events(item_events)
    impressions = [e for e in events if e["event_type"] in IMPRESSION_TYPES]
    dense = _dense_per_impression(events, impressions, ITEM_DENSE, config, prior_counts)
    return [(e["user_id"], e["event_id"], dense[e["event_id"]]) for e in impressions]


def _list_column(values: pa.Array, offsets: np.ndarray, index: np.ndarray, list_type: pa.DataType) -> pa.Array:
    """list<T> column whose row i is ``values[index[offsets[i]:offsets[i+1]]]``."""
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values.take(pa.array(index)), type=list_type)


def _gather(candidates: list[EventRow], impressions: list[EventRow], max_len: int, prior_cut: np.ndarray,
            prefix: str, lists: bool = True) -> dict[str, Any]:
    """Sequence columns (``seq_*`` or ``seq_same_domain_*``) of Q impressions from sorted candidates;
    without ``lists`` only the length and truncation count (the pointer layout)."""
    times = np.fromiter((e["event_time_ms"] for e in candidates), dtype=np.int64, count=len(candidates))
    created = np.fromiter((_created(e) for e in candidates), dtype=np.int64, count=len(candidates))
    q_t = np.fromiter((e["event_time_ms"] for e in impressions), dtype=np.int64, count=len(impressions))
    q_c = np.fromiter((_created(e) for e in impressions), dtype=np.int64, count=len(impressions))
    index, lengths, visible = point_in_time_gather(times, created, q_t, q_c, max_len)
    if not lists:
        return {f"{prefix}length": lengths, f"{prefix}truncated": prior_cut + visible - lengths}
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    list_str = pa.list_(pa.string())
    list_i64 = pa.list_(pa.int64())
    out: dict[str, Any] = {}
    for name, values in (("item_ids", [e["item_id"] for e in candidates]),
                         ("categories", [e.get("category") or "" for e in candidates]),
                         ("event_types", [e["event_type"] for e in candidates]),
                         ("domains", [e["domain"] for e in candidates])):
        if prefix == "seq_same_domain_" and name == "domains":
            continue
        out[f"{prefix}{name}"] = _list_column(pa.array(values, pa.string()), offsets, index, list_str)
    out[f"{prefix}event_time_ms"] = _list_column(pa.array(times, pa.int64()), offsets, index, list_i64)
    deltas = np.repeat(q_t, lengths) - times[index]
    out[f"{prefix}time_delta_ms"] = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()),
                                                             pa.array(deltas, pa.int64()), type=list_i64)
    out[f"{prefix}length"] = lengths
    out[f"{prefix}truncated"] = prior_cut + visible - lengths
    return out


def _take_rows(columns: dict[str, Any], order: np.ndarray) -> dict[str, Any]:
    return {k: (v.take(pa.array(order)) if isinstance(v, pa.Array) else np.asarray(v)[order]) for k, v in columns.items()}


def pending_examples(
    *,
    fresh_impressions: list[EventRow],
    cross_candidates: list[EventRow],
    cross_prior_cut: int,
    domain_candidates: Mapping[str, list[EventRow]],
    domain_prior_cut: Mapping[str, int],
    counter_events: list[EventRow],
    prior_counts: Mapping[tuple[str, str], Mapping[str, int]] | None,
    item_dense: Mapping[str, Mapping[str, float]],
    config: BuildConfig,
) -> pa.Table:
    """Point-in-time sequence and features of one user's new impressions (:func:`pending_schema`).

    Every sequence element and counter input of an impression at time t appended at c has event
    time < t and append time <= c. Rows follow the impressions' (event_time_ms, event_id).

    Args:
        fresh_impressions: the user's impressions first seen in this build, sorted.
        cross_candidates: sorted, unique events the cross-domain sequence is cut from (the stored
            sequence plus the new events); ``cross_prior_cut`` older events were already cut.
        domain_candidates / domain_prior_cut: the same per domain.
        counter_events: sorted, unique events (the buffer plus the new events) for the user counters;
            ``prior_counts`` ``{(domain, ""): counts}`` adds the evicted ones to all-time counters.
        item_dense: ``{example_id: {f_item_*: float}}`` from :func:`item_features`.

    Raises:
        ValueError: an impression has no entry in ``item_dense``, or an event lacks created_ts_ms.
    """
    impressions = fresh_impressions
    schema = pending_schema(config)
    lists = config.examples_layout == "fat"
    if not impressions:
        return schema.empty_table()
    missing = [e["event_id"] for e in impressions if e["event_id"] not in item_dense]
    if missing:
        raise ValueError(
            f"no item features for impressions {missing[:3]!r} ({len(missing)} in all); "
            "item_dense must come from item_features over the same events"
        )
    user_dense = _dense_per_impression(counter_events, impressions, USER_DENSE, config, prior_counts)
    columns: dict[str, Any] = _gather(cross_candidates, impressions, config.max_seq_len,
                                      np.full(len(impressions), cross_prior_cut, dtype=np.int64), "seq_", lists)
    # Same-domain sequences are gathered per domain, then put back in impression order.
    same: dict[str, Any] = {}  # column -> pa.Array or np.ndarray, as _gather returns them
    positions: list[int] = []
    parts: list[dict[str, Any]] = []
    for domain in sorted({e["domain"] for e in impressions}):
        rows = [i for i, e in enumerate(impressions) if e["domain"] == domain]
        group = [impressions[i] for i in rows]
        parts.append(_gather(domain_candidates.get(domain, []), group, config.same_domain_seq_len,
                             np.full(len(group), domain_prior_cut.get(domain, 0), dtype=np.int64), "seq_same_domain_",
                             lists))
        positions += rows
    order = np.argsort(np.asarray(positions, dtype=np.int64), kind="stable")
    for name in parts[0]:
        merged = (pa.concat_arrays([p[name] for p in parts]) if isinstance(parts[0][name], pa.Array)
                  else np.concatenate([p[name] for p in parts]))
        same[name] = merged
    columns.update(_take_rows(same, order))

    dates: dict[int, str] = {}
    ids = [e["event_id"] for e in impressions]
    times = [e["event_time_ms"] for e in impressions]
    columns.update({
        "example_id": ids,
        "event_time_ms": times,
        "event_date": [_utc_date(int(t), dates) for t in times],
        "created_ts_ms": [_created(e) for e in impressions],
        **{name: [_as_str(e.get(name)) for e in impressions] for name in SPARSE_FEATURES},
    })
    for name in USER_DENSE:
        columns[name] = [user_dense[i][name] for i in ids]
    for name in ITEM_DENSE:
        columns[name] = [item_dense[i][name] for i in ids]
    columns["f_seq_length"] = np.asarray(columns["seq_length"], dtype=np.float64)
    arrays = [columns[f.name] if isinstance(columns[f.name], pa.Array) else pa.array(columns[f.name], f.type)
              for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


def label_latencies(pending: pa.Table, events: list[EventRow], config: BuildConfig,
                    rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """ms from each pending impression to its first click / conversion on the same (item, domain) within the
    window (:mod:`sequences.labels`, windows per domain from ``config.window_ms``), -1 when none.

    Args:
        pending: rows of :data:`PENDING_SCHEMA` of one user.
        events: that user's sorted, unique events covering every label window of the rows asked for.
        rows: (n,) bool, the rows to join; the others get -1 (None: all).

    Returns:
        ``{"click": (n,) int64, "conversion": (n,) int64}``.
    """
    label_times: dict[tuple[str, str, str], list[int]] = defaultdict(list)
    for event in events:
        if event["event_type"] in (CLICK, CONVERSION):
            label_times[(event["event_type"], event["item_id"], event["domain"])].append(event["event_time_ms"])
    for times in label_times.values():
        times.sort()
    n = pending.num_rows
    out = {CLICK: np.full(n, NO_LABEL, dtype=np.int64), CONVERSION: np.full(n, NO_LABEL, dtype=np.int64)}
    wanted = np.ones(n, dtype=bool) if rows is None else rows
    for i, (t, item, domain) in enumerate(zip(pending.column("event_time_ms").to_pylist(),
                                              pending.column("item_id").to_pylist(),
                                              pending.column("domain").to_pylist(), strict=True)):
        if not wanted[i]:
            continue
        for task in (CLICK, CONVERSION):
            latency = _first_in_window(label_times.get((task, item, domain), []), t, config.window_ms(domain, task))
            if latency is not None:
                out[task][i] = latency
    return out


def attach_labels(
    pending: pa.Table, events: list[EventRow], config: BuildConfig, watermark_ms: int, close_ms: int
) -> pa.Table:
    """Publish every pending example once with its final labels (wait mode, whatever ``config.label_mode``)
    and return a table of :data:`EXAMPLES_SCHEMA`.

    Args:
        pending: rows of :data:`PENDING_SCHEMA` of one user.
        events: that user's sorted, unique events covering every label window of ``pending``.
        watermark_ms: newest event time of the snapshot; ``label_window_closed`` is
            ``t + longest window <= watermark_ms`` (False only for windows closed by ``final``).
        close_ms: windows are treated as closed up to here (``published_watermark_ms``).
    """
    wait = dataclasses.replace(config, label_mode="wait")
    latency = label_latencies(pending, events, wait)
    n = pending.num_rows
    plan = PublicationPlan(deadlines=deadlines(pending.column("domain").to_pylist(), wait),
                           first=np.ones(n, dtype=bool), keep=np.zeros(n, dtype=bool),
                           correction_rows=np.zeros(0, dtype=np.int64), correction_task=[],
                           correction_label=np.zeros(0, dtype=np.int32))
    return published_rows(pending, latency, plan, wait, watermark_ms=watermark_ms, close_ms=close_ms,
                          schema=EXAMPLES_SCHEMA, label_columns=LABEL_COLUMNS)


def assemble_examples(
    user_events: Iterable[EventRow],
    item_dense: Mapping[str, Mapping[str, float]],
    config: BuildConfig,
    watermark_ms: int,
) -> pa.Table:
    """Every impression of one user as an example (a table of exactly :data:`EXAMPLES_SCHEMA`),
    labelled with the events given, whether or not its windows have closed (a from-scratch,
    stateless build; :func:`sequences.incremental.build_user` is the publishing one).

    Row order follows the impressions' (event_time_ms, event_id).

    Args:
        user_events: all events of one user (any order, duplicates ok).
        item_dense: ``{example_id: {f_item_*: float}}`` from :func:`item_features`.
        watermark_ms: max event_time_ms of the snapshot (ms since epoch UTC).

    Raises:
        ValueError: an impression has no entry in ``item_dense``, or malformed events.
    """
    events = sorted_unique_events(user_events)
    impressions = [e for e in events if e["event_type"] in IMPRESSION_TYPES]
    pending = pending_examples(
        fresh_impressions=impressions,
        cross_candidates=events,
        cross_prior_cut=0,
        domain_candidates={d: [e for e in events if e["domain"] == d] for d in {e["domain"] for e in impressions}},
        domain_prior_cut={},
        counter_events=events,
        prior_counts=None,
        item_dense=item_dense,
        config=config,
    )
    return attach_labels(pending, events, config, watermark_ms, watermark_ms)


def rows_to_table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """Rows to an Arrow table of exactly ``schema`` (list columns keep their types when all empty).

    Raises:
        pyarrow.ArrowInvalid / ArrowTypeError: a value does not fit its column's type.
    """
    return pa.Table.from_pylist(rows, schema=schema)
