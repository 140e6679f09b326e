"""One incremental build step per user and per item: state + new events -> new state + outputs.

The build state (tables written by :mod:`sequences.pipeline`) is, per user:

- the stored cross-domain sequence (``sequences``) and per-domain sequences
  (``sequences_by_domain``): the newest N events as of the previous watermark, with the count of
  older events cut;
- the *buffer*: raw events with event time >= watermark - ``state_lookback_ms`` (every pending
  impression, its label events and the 1 h / 1 d / 7 d counter inputs live there);
- *evicted counts*: impressions/clicks/conversions of events that left the buffer, per
  (entity, key, domain, category), added to the all-time counters;
- *pending* examples: impressions whose attribution windows have not closed yet, with their
  point-in-time sequence and features already computed (they only wait for labels).

Why features are computed when an impression is first seen rather than when it is published:
everything written before the impression is in the events table by then (the point-in-time rule
keeps only events appended at or before it), while by publication time the stored sequences may
have cut the impression's own history. Labels, which look forward, are joined at publication.

Exactness: building from all events at once equals building batch by batch when each batch's
impressions are not older than the previous watermark (events appended roughly in time order, as
a Kafka log is). An impression older than N newer stored events of its user gets a shorter
history; an event older than watermark - lookback goes straight to the evicted counts.

Deduplication is by event_id against everything the state still holds (buffer and stored
sequences); the events table is unique by event_id (ingest commits exactly once), so a copy of an
event that has already left the state does not occur; if it did, it would be counted again in
``seq_truncated`` and the all-time counters.

EventRow rows are dicts of :data:`ingest.schema.EVENT_ARROW_SCHEMA` + ``created_ts_ms``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from features.definitions import COUNTED_TYPES
from features.reference import item_feature_rows, user_category_feature_rows, user_feature_rows
from ingest.schema import IMPRESSION_TYPES, EventRow, sorted_unique_events
from sequences.config import BuildConfig
from sequences.examples import (
    LABEL_COLUMNS,
    examples_schema,
    item_features,
    label_latencies,
    pending_examples,
    rows_to_table,
)
from sequences.publish import (
    ORPHAN_LABELS_SCHEMA,
    TASKS,
    deadlines,
    needs_labels,
    orphan_labels,
    plan_publication,
    published_rows,
)

EVICTED_SCHEMA = pa.schema(
    [
        pa.field("entity", pa.string(), nullable=False),  # "user", "item" or "user_category"
        pa.field("key", pa.string(), nullable=False),  # user_id or item_id
        pa.field("domain", pa.string(), nullable=False),
        pa.field("category", pa.string(), nullable=False),  # '' unless entity == "user_category"
        *[pa.field(name, pa.int64(), nullable=False) for name in COUNTED_TYPES],
    ]
)
"""Counts of events that left the buffer, per (entity, key, domain, category)."""

_ORPHAN_INPUT = pa.schema([f for f in ORPHAN_LABELS_SCHEMA if f.name not in ("reason", "close_ms")])
_IMPRESSION_KEYS = pa.schema([pa.field(n, pa.string()) for n in ("event_id", "user_id", "item_id", "domain")]
                             + [pa.field("event_time_ms", pa.int64())])


def split_buffer(events: list[EventRow], watermark_ms: int, lookback_ms: int) -> tuple[list[EventRow], list[EventRow]]:
    """(kept, evicted): events with event time >= ``watermark_ms - lookback_ms`` stay in the buffer."""
    cut = watermark_ms - lookback_ms
    kept = [e for e in events if e["event_time_ms"] >= cut]
    gone = [e for e in events if e["event_time_ms"] < cut]
    return kept, gone


def merge_evicted(
    old: Iterable[Mapping[str, Any]], gone: Iterable[EventRow], entity: str, key_field: str
) -> list[dict[str, Any]]:
    """Add the counted types of ``gone`` events to ``old`` evicted rows of one entity kind.

    Returns the updated rows (EVICTED_SCHEMA), sorted by (key, domain, category).
    """
    totals: dict[tuple[str, str, str], dict[str, int]] = defaultdict(lambda: dict.fromkeys(COUNTED_TYPES, 0))
    for row in old:
        if row["entity"] == entity:
            slot = totals[(row["key"], row["domain"], row["category"])]
            for name in COUNTED_TYPES:
                slot[name] += int(row[name])
    by_type = {t: name for name, t in COUNTED_TYPES.items()}
    for event in gone:
        category = (event.get("category") or "") if entity == "user_category" else ""
        slot = totals[(event[key_field], event["domain"], category)]
        if event["event_type"] in by_type:
            slot[by_type[event["event_type"]]] += 1
    return [
        {"entity": entity, "key": k, "domain": d, "category": c, **counts}
        for (k, d, c), counts in sorted(totals.items())
    ]


def prior_by_domain(evicted: Iterable[Mapping[str, Any]], entity: str) -> dict[tuple[str, str], dict[str, int]]:
    """``{(domain, category): {counted name: n}}`` of one entity's evicted rows."""
    return {
        (row["domain"], row["category"]): {name: int(row[name]) for name in COUNTED_TYPES}
        for row in evicted
        if row["entity"] == entity
    }


def stored_events(row: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The events of a stored ``sequences`` row as minimal event dicts (ids are not stored)."""
    if row is None:
        return []
    return [
        {"event_id": event_id, "event_time_ms": t, "created_ts_ms": c, "item_id": item,
         "category": category or None, "event_type": event_type, "domain": domain, "user_id": row["user_id"]}
        for event_id, t, c, item, category, event_type, domain in zip(
            row["seq_event_ids"], row["seq_event_time_ms"], row["seq_created_ts_ms"], row["seq_item_ids"],
            row["seq_categories"], row["seq_event_types"], row["seq_domains"], strict=True)
    ]


def sequence_state_row(
    user_id: str,
    events: list[EventRow],
    *,
    prior_total: int,
    as_of_ms: int,
    max_len: int,
    domain: str | None = None,
) -> dict[str, Any]:
    """A ``sequences`` (``domain`` None) or ``sequences_by_domain`` row: newest ``max_len`` of
    ``events`` (sorted, unique, all with time <= as_of_ms) plus the ``prior_total`` already cut
    before them."""
    kept = events[-max_len:]
    row = {
        "user_id": user_id,
        "seq_item_ids": [e["item_id"] for e in kept],
        "seq_categories": [e.get("category") or "" for e in kept],
        "seq_event_types": [e["event_type"] for e in kept],
        "seq_domains": [e["domain"] for e in kept],
        "seq_event_time_ms": [e["event_time_ms"] for e in kept],
        "seq_length": len(kept),
        "seq_truncated": prior_total + len(events) - len(kept),
        "as_of_ms": as_of_ms,
        "seq_event_ids": [e["event_id"] for e in kept],
        "seq_created_ts_ms": [e["created_ts_ms"] for e in kept],
    }
    if domain is not None:
        row["domain"] = domain
    return row


def build_user(
    user_id: str,
    *,
    stored_seq: Mapping[str, Any] | None,
    stored_domain_seqs: Iterable[Mapping[str, Any]],
    buffer: Iterable[EventRow],
    new: Iterable[EventRow],
    evicted: Iterable[Mapping[str, Any]],
    pending: pa.Table,
    item_dense: Mapping[str, Mapping[str, float]],
    config: BuildConfig,
    watermark_ms: int,
    old_close_ms: int | None,
    close_ms: int,
) -> dict[str, Any]:
    """One user's incremental step.

    Args:
        stored_seq / stored_domain_seqs: the user's rows of ``sequences`` / ``sequences_by_domain``.
        buffer, new: the user's buffered and new events (duplicates of each other allowed).
        evicted: the user's EVICTED_SCHEMA rows (entities "user" and "user_category").
        pending: the user's pending examples (PENDING_SCHEMA) from earlier builds.
        item_dense: ``{example_id: f_item_*}`` for this batch's new impressions.
        watermark_ms: newest event time of the events version (ms since epoch UTC).
        old_close_ms / close_ms: label windows closed up to these times before / after this build
            (None: nothing published yet).

    Returns:
        ``{"sequence": row, "domain_sequences": [rows], "buffer": [events], "evicted": [rows],
        "pending": PENDING_SCHEMA table, "examples": EXAMPLES_SCHEMA table, "user_features":
        [rows], "user_category_features": [rows], "fresh": [events]}``; ``fresh`` are the events
        first seen in this build (sorted, unique, none the state already held): the rows this build
        appends to the ``history`` table.

    Raises:
        ValueError: malformed events, or a new impression without item features.
    """

    buffered = sorted_unique_events(buffer)
    buffered_ids = {e["event_id"] for e in buffered}
    seq_cross = stored_events(stored_seq)
    seq_domain = [e for row in stored_domain_seqs for e in stored_events(row)]
    known_ids = buffered_ids | {e["event_id"] for e in seq_cross} | {e["event_id"] for e in seq_domain}
    fresh = [e for e in sorted_unique_events(new) if e["event_id"] not in known_ids]
    recent = sorted_unique_events([*buffered, *fresh])
    evicted_rows = list(evicted)

    domain_rows = {row["domain"]: row for row in stored_domain_seqs}
    new_pending = pending_examples(
        fresh_impressions=[e for e in fresh if e["event_type"] in IMPRESSION_TYPES],
        cross_candidates=sorted_unique_events([*seq_cross, *fresh]),
        cross_prior_cut=0 if stored_seq is None else int(stored_seq["seq_truncated"]),
        domain_candidates={
            d: sorted_unique_events([*stored_events(domain_rows.get(d)), *[e for e in fresh if e["domain"] == d]])
            for d in {e["domain"] for e in fresh}
        },
        domain_prior_cut={d: int(row["seq_truncated"]) for d, row in domain_rows.items()},
        counter_events=recent,
        prior_counts=prior_by_domain(evicted_rows, "user"),
        item_dense=item_dense,
        config=config,
    )
    pending_cols = new_pending.schema
    all_pending = pa.concat_tables([pending.select(pending_cols.names).cast(pending_cols), new_pending])
    is_new = np.concatenate([np.zeros(pending.num_rows, dtype=bool), np.ones(new_pending.num_rows, dtype=bool)])
    t = all_pending.column("event_time_ms").to_numpy()
    domains = all_pending.column("domain").to_pylist()
    due_in = deadlines(domains, config)
    need = needs_labels(t, due_in, is_new, config, old_close_ms, close_ms)
    fresh_labels = [e for e in fresh if e["event_type"] in TASKS]
    if config.label_mode != "wait":
        # A late positive is due where a label event is new in this build.
        keys = {(e["item_id"], e["domain"]) for e in fresh_labels}
        need |= np.array([k in keys for k in zip(all_pending.column("item_id").to_pylist(), domains, strict=True)],
                         dtype=bool)
    latency = label_latencies(all_pending, recent, config, need)
    plan = plan_publication(t, due_in, latency, is_new, config, old_close_ms, close_ms)
    examples = published_rows(all_pending, latency, plan, config, watermark_ms=watermark_ms, close_ms=close_ms,
                              schema=examples_schema(config), label_columns=LABEL_COLUMNS)
    still_pending = all_pending.filter(pa.array(plan.keep))
    orphans = orphan_labels(
        rows_to_table([{**e, "user_id": user_id} for e in fresh_labels], _ORPHAN_INPUT),
        rows_to_table([dict(e) for e in recent if e["event_type"] in IMPRESSION_TYPES], _IMPRESSION_KEYS),
        {e["event_id"] for e in fresh if e["event_type"] in IMPRESSION_TYPES}, config, old_close_ms, close_ms)

    cross = sorted_unique_events([*seq_cross, *fresh])
    sequence = sequence_state_row(
        user_id, cross, prior_total=0 if stored_seq is None else int(stored_seq["seq_truncated"]),
        as_of_ms=watermark_ms, max_len=config.max_seq_len)
    domain_sequences = []
    for d in sorted(set(domain_rows) | {e["domain"] for e in fresh}):
        events = sorted_unique_events([*stored_events(domain_rows.get(d)), *[e for e in fresh if e["domain"] == d]])
        prior = int(domain_rows[d]["seq_truncated"]) if d in domain_rows else 0
        domain_sequences.append(sequence_state_row(
            user_id, events, prior_total=prior, as_of_ms=watermark_ms, max_len=config.same_domain_seq_len, domain=d))

    user_features = user_feature_rows(
        user_id, recent, as_of_ms=watermark_ms, config=config, prior_counts=prior_by_domain(evicted_rows, "user"))
    category_features = user_category_feature_rows(
        user_id, recent, as_of_ms=watermark_ms, config=config,
        prior_counts=prior_by_domain(evicted_rows, "user_category"))
    kept, gone = split_buffer(recent, watermark_ms, config.state_lookback_ms)
    return {
        "sequence": sequence,
        "domain_sequences": domain_sequences,
        "buffer": kept,
        "evicted": merge_evicted(evicted_rows, gone, "user", "user_id")
        + merge_evicted(evicted_rows, gone, "user_category", "user_id"),
        "pending": still_pending,
        "examples": examples,
        "orphan_labels": orphans,
        "user_features": user_features,
        "user_category_features": category_features,
        "fresh": fresh,
    }


def build_item(
    item_id: str,
    *,
    buffer: Iterable[EventRow],
    new: Iterable[EventRow],
    evicted: Iterable[Mapping[str, Any]],
    config: BuildConfig,
    watermark_ms: int,
) -> dict[str, Any]:
    """One item's incremental step: item counters of this batch's new impressions, the item's
    evicted counts after this build, and its ``features/item`` rows as of the watermark.

    Returns:
        ``{"dense": [(user_id, example_id, {f_item_*: float})], "evicted": [rows], "item_features": [rows]}``.
    """
    buffered = sorted_unique_events(buffer)
    buffered_ids = {e["event_id"] for e in buffered}
    fresh_ids = {e["event_id"] for e in new if e["event_id"] not in buffered_ids}
    recent = sorted_unique_events([*buffered, *new])
    evicted_rows = list(evicted)
    prior = prior_by_domain(evicted_rows, "item")
    dense = [d for d in item_features(recent, config, prior_counts=prior) if d[1] in fresh_ids]
    kept, gone = split_buffer(recent, watermark_ms, config.state_lookback_ms)
    return {
        "dense": dense,
        "evicted": merge_evicted(evicted_rows, gone, "item", "item_id"),
        "item_features": item_feature_rows(item_id, recent, as_of_ms=watermark_ms, config=config,
                                           prior_counts=prior),
    }


__all__ = ["EVICTED_SCHEMA", "build_item", "build_user", "merge_evicted", "split_buffer"]
