"""Feature-table rows of one entity as of a snapshot (``features/user``, ``features/item``,
``features/user_category``).

:func:`user_feature_rows`, :func:`item_feature_rows` and :func:`user_category_feature_rows` are
the per-entity reference twin of :mod:`features.vectorized`: the per-user reference build
(``sequences/incremental.py``) calls these, the vectorised build (``sequences/vectorized.py``) calls
:func:`features.vectorized.feature_rows`, and the build's tests compare the two table by table.

Rows follow :data:`features.definitions.USER_FEATURES` / :data:`ITEM_FEATURES`; counters count
events with time <= ``as_of_ms`` (the snapshot watermark), i.e. strictly before as_of_ms + 1.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

from features.definitions import ITEM_FEATURES, USER_CATEGORY_FEATURES, USER_FEATURES, CounterIndex
from ingest.schema import EventRow, sorted_unique_events
from sequences.config import BuildConfig

Prior = Mapping[tuple[str, str], Mapping[str, int]]


def _counters(events: list[EventRow], as_of_ms: int, config: BuildConfig,
              prior: Mapping[str, int] | None = None) -> dict[str, Any]:
    index = CounterIndex([e["event_time_ms"] for e in events], [e["event_type"] for e in events])
    values = index.as_of([as_of_ms + 1], a=config.ctr_prior_clicks, b=config.ctr_prior_non_clicks,
                         prior_counts=prior)
    return {name: (float(v[0]) if name.startswith("ctr_") else int(v[0])) for name, v in values.items()}


def _latest_non_null(events: list[EventRow], field: str) -> Any:
    for event in reversed(events):
        if event.get(field) is not None:
            return event[field]
    return None


def _times(events: list[EventRow]) -> dict[str, Any]:
    newest = events[-1]["event_time_ms"]
    return {
        "event_ts_ms": newest,
        "created_ts_ms": max(_created_ts_ms(e) for e in events),
        "event_date": dt.datetime.fromtimestamp(newest // 1000, tz=dt.UTC).strftime("%Y-%m-%d"),
    }


def _live(events: list[EventRow], as_of_ms: int, ttl_ms: int | None) -> bool:
    """Whether the entity's newest event is within the TTL (rows past it are expired, not written)."""
    return bool(events) and (ttl_ms is None or events[-1]["event_time_ms"] >= as_of_ms - ttl_ms)


def _created_ts_ms(event: EventRow) -> int:
    value = event.get("created_ts_ms")
    if not isinstance(value, int):
        raise ValueError(
            f"event {event.get('event_id')!r}: created_ts_ms must be an int (ms since epoch UTC, the Kafka "
            f"append time of EVENTS_TABLE_SCHEMA), got {value!r}"
        )
    return value


def _visible(events: Iterable[EventRow], as_of_ms: int) -> list[EventRow]:
    return [e for e in sorted_unique_events(events) if e["event_time_ms"] <= as_of_ms]


def user_feature_rows(
    user_id: str, events: Iterable[EventRow], *, as_of_ms: int, config: BuildConfig, prior_counts: Prior | None = None
) -> list[dict[str, Any]]:
    """``features/user`` rows of one user: one per domain with an event in the TTL
    (``USER_FEATURES.ttl_ms`` before ``as_of_ms``); counters over events with time <= as_of_ms.

    ``age``, ``gender`` and ``location`` are the latest non-null values over the user's events in
    every domain within the TTL (a user's attributes do not depend on the surface; older values are
    expired). ``created_ts_ms`` is the newest Kafka append time of the counted events.
    ``prior_counts`` ``{(domain, ""): counts}`` are evicted events added to the all-time counters.

    Raises:
        ValueError: an event lacks ``created_ts_ms`` or a required field.
    """
    visible = _visible(events, as_of_ms)
    ttl = USER_FEATURES.ttl_ms
    in_ttl = visible if ttl is None else [e for e in visible if e["event_time_ms"] >= as_of_ms - ttl]
    static = {name: _latest_non_null(in_ttl, name) for name in ("age", "gender", "location")}
    rows = []
    for domain in sorted({e["domain"] for e in visible}):
        in_domain = [e for e in visible if e["domain"] == domain]
        if not _live(in_domain, as_of_ms, ttl):
            continue
        rows.append(
            {"user_id": user_id, "domain": domain, "as_of_ms": as_of_ms, **_times(in_domain),
             **_counters(in_domain, as_of_ms, config, (prior_counts or {}).get((domain, ""))), **static}
        )
    return rows


def user_category_feature_rows(
    user_id: str, events: Iterable[EventRow], *, as_of_ms: int, config: BuildConfig, prior_counts: Prior | None = None
) -> list[dict[str, Any]]:
    """``features/user_category`` rows: per (domain, category) of one user with an event in the TTL.

    ``prior_counts`` ``{(domain, category): counts}`` are evicted events added to all-time counters.
    """
    visible = [e for e in _visible(events, as_of_ms) if e.get("category")]
    rows = []
    for domain, category in sorted({(e["domain"], e["category"]) for e in visible}):
        group = [e for e in visible if e["domain"] == domain and e["category"] == category]
        if not _live(group, as_of_ms, USER_CATEGORY_FEATURES.ttl_ms):
            continue
        rows.append(
            {"user_id": user_id, "domain": domain, "category": category, "as_of_ms": as_of_ms, **_times(group),
             **_counters(group, as_of_ms, config, (prior_counts or {}).get((domain, category)))}
        )
    return rows


def item_feature_rows(
    item_id: str, events: Iterable[EventRow], *, as_of_ms: int, config: BuildConfig, prior_counts: Prior | None = None
) -> list[dict[str, Any]]:
    """``features/item`` rows of one item: one per domain with an event in the TTL (time <= as_of_ms).

    ``category`` is the item's latest non-null category in that domain; ``prior_counts`` as in
    :func:`user_feature_rows`.

    Raises:
        ValueError: an event lacks ``created_ts_ms`` or a required field.
    """
    visible = _visible(events, as_of_ms)
    rows = []
    for domain in sorted({e["domain"] for e in visible}):
        in_domain = [e for e in visible if e["domain"] == domain]
        if not _live(in_domain, as_of_ms, ITEM_FEATURES.ttl_ms):
            continue
        rows.append(
            {"item_id": item_id, "domain": domain, "as_of_ms": as_of_ms, **_times(in_domain),
             **_counters(in_domain, as_of_ms, config, (prior_counts or {}).get((domain, ""))),
             "category": _latest_non_null(in_domain, "category")}
        )
    return rows

