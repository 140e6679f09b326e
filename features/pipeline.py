"""Beam transform building the ``features/user`` and ``features/item`` tables as of a snapshot.

    events --KeyByUser-------GroupByUser-------UserFeatureRows--> features/user rows (per domain)
           \\-KeyByItemDomain--GroupByItemDomain--ItemFeatureRow--> features/item rows

Rows follow :data:`features.definitions.USER_FEATURES` / :data:`ITEM_FEATURES`; counters count
events with time <= ``as_of_ms`` (the snapshot watermark), i.e. strictly before as_of_ms + 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import apache_beam as beam

from features.definitions import CounterIndex
from sequences.config import BuildConfig
from sequences.history import Event, sorted_unique_events


def _counters(events: list[Event], as_of_ms: int, config: BuildConfig) -> dict[str, Any]:
    index = CounterIndex([e["event_time_ms"] for e in events], [e["event_type"] for e in events])
    values = index.as_of([as_of_ms + 1], a=config.ctr_prior_clicks, b=config.ctr_prior_non_clicks)
    return {name: (float(v[0]) if name.startswith("ctr_") else int(v[0])) for name, v in values.items()}


def _latest_non_null(events: list[Event], field: str) -> Any:
    for event in reversed(events):
        if event.get(field) is not None:
            return event[field]
    return None


def _times(events: list[Event]) -> dict[str, int]:
    return {
        "event_ts_ms": events[-1]["event_time_ms"],
        "created_ts_ms": max(_created_ts_ms(e) for e in events),
    }


def _created_ts_ms(event: Event) -> int:
    value = event.get("created_ts_ms")
    if not isinstance(value, int):
        raise ValueError(
            f"event {event.get('event_id')!r}: created_ts_ms must be an int (ms since epoch UTC, the Kafka "
            f"append time of EVENTS_TABLE_SCHEMA), got {value!r}"
        )
    return value


def _visible(events: Iterable[Event], as_of_ms: int) -> list[Event]:
    return [e for e in sorted_unique_events(events) if e["event_time_ms"] <= as_of_ms]


def user_feature_rows(
    user_id: str, events: Iterable[Event], *, as_of_ms: int, config: BuildConfig
) -> list[dict[str, Any]]:
    """``features/user`` rows of one user: one per domain the user has events in (time <= as_of_ms).

    ``age``, ``gender`` and ``location`` are the latest non-null values over the user's events in
    every domain (a user's attributes do not depend on the surface). ``created_ts_ms`` is the
    newest Kafka append time of the counted events.

    Raises:
        ValueError: an event lacks ``created_ts_ms`` or a required field.
    """
    visible = _visible(events, as_of_ms)
    static = {name: _latest_non_null(visible, name) for name in ("age", "gender", "location")}
    rows = []
    for domain in sorted({e["domain"] for e in visible}):
        in_domain = [e for e in visible if e["domain"] == domain]
        rows.append(
            {"user_id": user_id, "domain": domain, "as_of_ms": as_of_ms, **_times(in_domain),
             **_counters(in_domain, as_of_ms, config), **static}
        )
    return rows


def item_feature_row(
    key: tuple[str, str], events: Iterable[Event], *, as_of_ms: int, config: BuildConfig
) -> list[dict[str, Any]]:
    """The ``features/item`` row of one (item_id, domain), or [] if it has no event <= as_of_ms."""
    visible = _visible(events, as_of_ms)
    if not visible:
        return []
    item_id, domain = key
    return [
        {"item_id": item_id, "domain": domain, "as_of_ms": as_of_ms, **_times(visible),
         **_counters(visible, as_of_ms, config), "category": _latest_non_null(visible, "category")}
    ]


def _user_key(event: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    return event["user_id"], event


def _item_domain_key(event: Mapping[str, Any]) -> tuple[tuple[str, str], Mapping[str, Any]]:
    return (event["item_id"], event["domain"]), event


def _apply_keyed(keyed: tuple[Any, Iterable[Event]], fn, **kwargs: Any) -> list[dict[str, Any]]:
    return fn(*keyed, **kwargs)


class BuildFeatureTables(beam.PTransform):
    """events (dict rows of EVENTS_TABLE_SCHEMA) -> ``{"user": rows, "item": rows}`` as of a snapshot.

    Args:
        config: the build config (CTR prior).
        as_of_ms: snapshot watermark, ms since epoch UTC; events after it are ignored.
    """

    def __init__(self, config: BuildConfig, *, as_of_ms: int) -> None:
        super().__init__()
        self._config = config
        self._as_of_ms = as_of_ms

    def expand(self, events: beam.PCollection) -> dict[str, beam.PCollection]:
        user = (
            events
            | "KeyByUser" >> beam.Map(_user_key)
            | "GroupByUser" >> beam.GroupByKey()
            | "UserFeatureRows"
            >> beam.FlatMap(_apply_keyed, user_feature_rows, as_of_ms=self._as_of_ms, config=self._config)
        )
        item = (
            events
            | "KeyByItemDomain" >> beam.Map(_item_domain_key)
            | "GroupByItemDomain" >> beam.GroupByKey()
            | "ItemFeatureRow"
            >> beam.FlatMap(_apply_keyed, item_feature_row, as_of_ms=self._as_of_ms, config=self._config)
        )
        return {"user": user, "item": item}
