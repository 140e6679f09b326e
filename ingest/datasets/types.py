"""Value types shared by the dataset adapters: the unmappable-line record and the row grouping.

An adapter reads its source line by line ("source rows") and maps each row to zero or more
records: :class:`ingest.schema.Event` for what it can map, :class:`RawRecord` for what it cannot.
Adapters never drop a row: a RawRecord is produced to Kafka as-is so that the ingest job
dead-letters it with a reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Protocol, TypeAlias

from ingest.schema import SCHEMA_VERSION, Event


@dataclass(frozen=True)
class RawRecord:
    """A source row the adapter could not map to an Event, produced to Kafka unchanged.

    value: the message value: the JSON object of the fields that could be read (the ingest
        validator dead-letters it as ``missing_field``/``wrong_type``), or the raw line bytes.
    key: the message key: the user id's UTF-8 bytes if it could be read, else ``b""``.
    reason_hint: why the adapter gave up (for logs and tests; the ingest job decides the
        dead-letter reason itself from the value).
    """

    value: bytes
    key: bytes
    reason_hint: str

    def __post_init__(self) -> None:
        if not isinstance(self.value, bytes) or not isinstance(self.key, bytes):
            raise TypeError(
                f"RawRecord value and key must be bytes, got {type(self.value).__name__} and "
                f"{type(self.key).__name__}; encode text with .encode()"
            )


Record: TypeAlias = Event | RawRecord
"""What an adapter yields and replay produces."""


class RowReader(Protocol):
    """An adapter's entry point as the registry calls it: one list of records per source row."""

    def __call__(self, *, path: str | None, cache_dir: str | None) -> Iterator[list[Record]]: ...


def partial_record(fields: dict[str, Any], *, key: str | None, reason_hint: str) -> RawRecord:
    """A RawRecord whose value is the JSON object of the Event fields that could be read.

    ``schema_version`` is added so that the ingest validator judges the missing fields, not the
    version. Keys are sorted so that the bytes are deterministic.
    """
    body = {**fields, "schema_version": SCHEMA_VERSION}
    value = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
    return RawRecord(value=value, key=(key or "").encode(), reason_hint=reason_hint)


def event_time_sort_key(record: Record) -> tuple[int, int]:
    """Sort key placing Events by ``event_time_ms`` (ms since epoch UTC) and RawRecords last."""
    if isinstance(record, Event):
        return (0, record.event_time_ms)
    return (1, 0)


def flatten(rows: Iterable[list[Record]]) -> Iterator[Record]:
    """The records of ``rows`` in order."""
    for row in rows:
        yield from row


def parse_int(text: str, what: str) -> int:
    """Parse a base-10 integer, accepting an integral float spelling like ``"881250949.0"``.

    Raises:
        ValueError: ``text`` is not an integer (message names ``what`` and the text).
    """
    try:
        return int(text)
    except ValueError:
        pass
    try:
        as_float = float(text)
    except ValueError:
        raise ValueError(f"{what}: expected an integer, got {text!r}") from None
    if not as_float.is_integer():
        raise ValueError(f"{what}: expected an integer, got {text!r}")
    return int(as_float)
