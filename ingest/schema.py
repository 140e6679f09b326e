"""The versioned event schema: the typed record every stage after Kafka relies on.

Wire format: one JSON object per Kafka message, keyed by ``user_id`` (UTF-8), with the fields of
:class:`Event`. Times are integers in ms since the epoch, UTC.

The ``event_time_ms`` wire field also accepts seconds, microseconds and ISO-8601 strings; ingest
normalises them (``ingest.parse``).

Topic generations. ``kafka_generation`` (``events``, ``late_events``, ``dead_letter``) is the lake's generation of
the topic a record was read from: 0 for the first topic of that name the lake read, one more after each
``gemline ingest --reset-topic`` (a recreated topic starts its offsets at 0 again, so (kafka_topic,
kafka_partition, kafka_offset) alone names two records after a reset). Ingest stamps it on every row and records
it in each batch's commit metadata (``generation``, beside the broker's ``topic_identity``). Rows written before
the column existed hold null, and their batches' metadata lacks it; ``ingest.audit`` reconciles them apart.

Version history:
    1  first version.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

SCHEMA_VERSION = 1

EVENT_TYPES: tuple[str, ...] = ("impression", "click", "conversion", "engagement")
"""impression: an item/ad was shown; click and conversion: labels of a prior impression;
engagement: organic activity (a view, a like) that feeds sequences but carries no label."""

IMPRESSION_TYPES: frozenset[str] = frozenset({"impression"})
"""Event types that become training examples."""


@dataclass(frozen=True, kw_only=True)
class Event:
    """One user event, as produced to Kafka and stored in the ``events`` table.

    Required: event_id, event_time_ms, user_id, item_id, domain, event_type.
    Optional context is None where the source dataset lacks it (adapters never invent it).
    """

    event_id: str
    """Globally unique, deterministic id (dataset prefix + source keys), used for deduplication."""
    event_time_ms: int
    """When the event happened, ms since epoch UTC."""
    user_id: str
    """The acting user."""
    item_id: str
    """The item or ad the event is about."""
    domain: str
    """Surface/domain (facebook, instagram, messaging, or the dataset's own)."""
    event_type: str
    """One of EVENT_TYPES."""
    category: str | None = None
    """Item/ad category."""
    position: int | None = None
    """Slot/position the item was shown in (1-based)."""
    ad_format: str | None = None
    """Ad format or placement."""
    age: int | None = None
    """User age in years (or the dataset's age bucket)."""
    gender: str | None = None
    """User gender as the dataset codes it."""
    location: str | None = None
    """User location (zip, city level, ...)."""
    schema_version: int = SCHEMA_VERSION
    """Version of this schema the producer wrote."""

    def to_json(self) -> bytes:
        """Encode as the UTF-8 JSON wire format: every field, in declaration order.

        The fields are read directly rather than through ``dataclasses.asdict``, whose recursive deep copy was 40 %
        of ``gemline generate``'s CPU at 2,000 events/s (py-spy during ``benchmarks.freshness``); the bytes are
        the same (tests/ingest/test_generate.py), 3.2x cheaper (timeit, 20k calls each, one process)."""
        return json.dumps({name: getattr(self, name) for name in EVENT_FIELDS}, separators=(",", ":")).encode()

    def at(self, event_time_ms: int) -> Event:
        """This event with ``event_time_ms`` (ms since epoch UTC) instead: ``dataclasses.replace`` without its
        ``__init__`` call (Event has no ``__post_init__`` to run): 6.3x cheaper (timeit, 20k calls each, one process),
        for a generator stamping every event."""
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__, event_time_ms=event_time_ms)
        return copy

    @property
    def key(self) -> bytes:
        """Kafka message key: the user id, so one user's events share a partition and stay in order."""
        return self.user_id.encode()


EVENT_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Event))
"""Event's field names in declaration order (the keys of :meth:`Event.to_json`)."""

REQUIRED_FIELDS: tuple[str, ...] = ("event_id", "event_time_ms", "user_id", "item_id", "domain", "event_type")
OPTIONAL_FIELDS: tuple[str, ...] = ("category", "position", "ad_format", "age", "gender", "location")

EVENT_ARROW_SCHEMA = pa.schema(
    [
        pa.field("event_id", pa.string(), nullable=False),
        pa.field("event_time_ms", pa.int64(), nullable=False),
        pa.field("user_id", pa.string(), nullable=False),
        pa.field("item_id", pa.string(), nullable=False),
        pa.field("domain", pa.string(), nullable=False),
        pa.field("event_type", pa.string(), nullable=False),
        pa.field("category", pa.string()),
        pa.field("position", pa.int32()),
        pa.field("ad_format", pa.string()),
        pa.field("age", pa.int32()),
        pa.field("gender", pa.string()),
        pa.field("location", pa.string()),
        pa.field("schema_version", pa.int32(), nullable=False),
    ]
)
"""Arrow schema of an Event."""

EVENTS_TABLE_SCHEMA = pa.schema(
    list(EVENT_ARROW_SCHEMA)
    + [
        pa.field("created_ts_ms", pa.int64(), nullable=False),  # Kafka log-append time: when we could know it
        pa.field("event_date", pa.string(), nullable=False),  # YYYY-MM-DD of event_time_ms (UTC); partition column
        pa.field("kafka_topic", pa.string(), nullable=False),
        pa.field("kafka_partition", pa.int32(), nullable=False),
        pa.field("kafka_offset", pa.int64(), nullable=False),
        # Event time normalised to UTC microseconds (event_time_ms = floor(us / 1000)). Ingest always
        # fills it; nullable only because events tables written before it existed lack it.
        pa.field("event_time_us", pa.int64()),
        # Which read of the topic the record came from (module docstring). Null in rows written before it existed.
        pa.field("kafka_generation", pa.int32()),
    ]
)
"""Arrow schema of the ``events`` Delta table (partitioned by ``event_date``)."""

LATE_EVENTS_SCHEMA = pa.schema(
    list(EVENTS_TABLE_SCHEMA)
    + [
        pa.field("watermark_ms", pa.int64(), nullable=False),  # ingest watermark of the partition, ms since epoch
        pa.field("lateness_ms", pa.int64(), nullable=False),  # watermark_ms - event_time_ms, > allowed lateness
    ]
)
"""Arrow schema of the ``late_events`` Delta table: events rows behind the ingest watermark."""

DEAD_LETTER_SCHEMA = pa.schema(
    [
        pa.field("reason", pa.string(), nullable=False),  # a code: not_json, missing_field, wrong_type, ...
        pa.field("detail", pa.string(), nullable=False),  # human-readable message
        pa.field("raw", pa.binary(), nullable=False),  # the message value exactly as read
        pa.field("kafka_topic", pa.string(), nullable=False),
        pa.field("kafka_partition", pa.int32(), nullable=False),
        pa.field("kafka_offset", pa.int64(), nullable=False),
        pa.field("created_ts_ms", pa.int64(), nullable=False),  # the Kafka record timestamp as read
        pa.field("kafka_key", pa.binary()),  # the message key as read (null: none); dead_letter rows before it lack it
        pa.field("kafka_generation", pa.int32()),  # as in EVENTS_TABLE_SCHEMA (module docstring)
    ]
)
"""Arrow schema of the ``dead_letter`` Delta table. ``raw`` is ``b""`` for a tombstone (reason
``tombstone``) and for an empty value (reason ``not_json``)."""


def event_to_row(event: Event) -> dict[str, Any]:
    """The Event as a dict in EVENT_ARROW_SCHEMA field order."""
    return dataclasses.asdict(event)


EventRow = Mapping[str, Any]
"""One event as a plain mapping with the :data:`EVENT_ARROW_SCHEMA` fields (a row of ``pyarrow.Table.to_pylist``)."""

_ROW_REQUIRED = ("event_id", "event_time_ms", "user_id", "item_id", "domain", "event_type")


def sorted_unique_events(events: Iterable[EventRow]) -> list[EventRow]:
    """Deduplicate by ``event_id`` (first copy in (event_time_ms, event_id) order wins) and sort.

    Duplicates come from at-least-once delivery upstream; a copy is the same event, so which one
    is kept does not change any result.

    Raises:
        ValueError: an event lacks a required field or has a non-integer ``event_time_ms``.
    """
    materialised = list(events)
    for event in materialised:
        missing = [name for name in _ROW_REQUIRED if event.get(name) is None]
        if missing:
            raise ValueError(
                f"event {event.get('event_id')!r} lacks required fields {missing}; "
                "expected rows of ingest.schema.EVENTS_TABLE_SCHEMA"
            )
        if not isinstance(event["event_time_ms"], int) or isinstance(event["event_time_ms"], bool):
            raise TypeError(
                f"event {event['event_id']!r}: event_time_ms must be int (ms since epoch UTC), "
                f"got {type(event['event_time_ms']).__name__}"
            )
    materialised.sort(key=lambda e: (e["event_time_ms"], e["event_id"]))
    seen: set[str] = set()
    unique: list[EventRow] = []
    for event in materialised:
        if event["event_id"] not in seen:
            seen.add(event["event_id"])
            unique.append(event)
    return unique
