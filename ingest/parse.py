"""Kafka record -> ``events`` row or ``dead_letter`` row: the only place raw bytes become Events.

:func:`parse_record` is pure (the clock is passed in) and never raises on any message value:
every record ends in exactly one of the two tables. Checks run in this order and the first that
fails names the dead-letter reason:

==============================  =============================================================
reason                          meaning
==============================  =============================================================
``tombstone``                   the message has no value (a null value, as log compaction uses;
                                an empty value is ``not_json``)
``too_large``                   the value is larger than ``IngestConfig.max_message_bytes``
                                (``raw`` keeps its first :data:`RAW_PREFIX_BYTES`; the detail
                                gives its size)
``lone_surrogate``              the value or the key holds a UTF-16 surrogate code point that is
                                not part of a pair: escaped in a JSON string (``"\\ud800"``) or
                                raw (the 3-byte WTF-8/CESU-8 form, invalid UTF-8). Python's
                                ``json`` reads the escape into a string no UTF-8 column can hold
``too_deep``                    the JSON nests objects/arrays deeper than :data:`MAX_JSON_DEPTH`
                                (Python's ``json`` would fail at a depth that depends on the
                                stack, Arrow's reader at another: one rule for both)
``not_json``                    the value is not UTF-8 JSON
``not_object``                  valid JSON, but not an object (a list, a string, ...)
``unsupported_schema_version``  ``schema_version`` is not an int, or not a version we read
                                (absent means the current version, as ``Event`` defaults it)
``missing_field``               a required field is absent, null, or a string that is empty
                                after trimming Unicode White_Space (:data:`BLANK`; detail names
                                every such field)
``wrong_type``                  a field has another JSON type than declared (booleans are not
                                ints; optional fields, when present and not null, too), an
                                int outside its column's range (int64 times, int32 position/age),
                                an event time that is no ISO-8601 string, or one outside years
                                1..9999
``unknown_event_type``          ``event_type`` is not one of ``EVENT_TYPES``
``unknown_domain``              ``domain`` is not one of the configured domains
``future_event_time``           event time ``> now_ms + max_future_skew_ms``
``too_early_event_time``        event time ``< min_event_time_ms`` (``IngestConfig``; default
                                2000-01-01: 0, -1 or 1914 are clock bugs, not events)
``expired_event_time``          event time ``< now_ms - retention_ms`` (only when a retention
                                is configured)
``parse_failure``               the parser itself failed on the message (a bug, never expected:
                                the detail names the exception) instead of failing the batch
==============================  =============================================================

The record timestamp becomes ``created_ts_ms`` (when the event could first be known, which the
point-in-time rules of the build use). A timestamp that cannot be that time -- none (< 0), before
``min_event_time_ms``, or after ``now_ms + max_future_skew_ms`` (a producer clock in the year
3000 would hide the event from every history) -- is replaced by ``now_ms``, the ingest clock:
the event was surely appended by then (:func:`known_since`).

Event time (wire field ``event_time_ms``) is normalised to UTC microseconds (``event_time_us``;
``event_time_ms = floor(event_time_us / 1000)``). Accepted forms:

* a JSON integer whose unit is decided by magnitude (:func:`event_time_to_us`):
  ``|v| < 1e11`` seconds, ``1e11 <= |v| < 1e14`` milliseconds, ``|v| >= 1e14`` microseconds.
  1e11 s is the year 5138 and 1e11 ms is 1973-03-03, so every time from March 1973 to the year
  5138 is read right in any unit; an earlier time in ms or us is misread (as s or ms): send those
  as ISO strings.
* an ISO-8601 string as :meth:`datetime.datetime.fromisoformat` reads it (``Z`` or an offset;
  a naive time is UTC by rule, since producers log UTC; digits past microseconds are cut).

JSON floats are rejected (``wrong_type``): a float cannot hold a microsecond time exactly.

Fields the schema does not know are ignored, so that producers can add fields before consumers
read them.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Iterable
from typing import Any, Literal

from ingest.kafka_clients import RAW_PREFIX_BYTES, KafkaRecord
from ingest.schema import EVENT_TYPES, OPTIONAL_FIELDS, REQUIRED_FIELDS, SCHEMA_VERSION

GOOD = "good"
"""Tag of the events output of ``ingest.vectorized.ParseBatches``."""
DEAD_LETTER = "dead_letter"
"""Tag of the dead-letter output of ``ingest.vectorized.ParseBatches``."""

REASONS: tuple[str, ...] = (
    "tombstone",
    "too_large",
    "lone_surrogate",
    "too_deep",
    "not_json",
    "not_object",
    "unsupported_schema_version",
    "missing_field",
    "wrong_type",
    "unknown_event_type",
    "unknown_domain",
    "future_event_time",
    "too_early_event_time",
    "expired_event_time",
    "parse_failure",
)
"""Every dead-letter reason code :func:`parse_record` emits."""

MAX_JSON_DEPTH = 32
"""Deepest nesting of JSON objects/arrays a message may have (events are flat: 1)."""

BLANK = ("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
         "\u2028\u2029\u202f\u205f\u3000")
"""Unicode White_Space, the characters trimmed before an id counts as blank. Spelled out because
Python's ``str.strip()`` also trims U+001C..U+001F and Rust's (polars') ``trim`` does not: both
parsers trim exactly these."""

DEFAULT_MIN_EVENT_TIME_MS = 946_684_800_000
"""2000-01-01T00:00:00Z in ms since epoch: ``IngestConfig.min_event_time_ms``'s default."""

_SURROGATE = re.compile("[\ud800-\udfff]")
_RAW_SURROGATE = re.compile(b"\xed[\xa0-\xbf]")
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_BRACKET = re.compile(r"[\[\]{}]")
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)
_FIELD_TYPES: dict[str, tuple[type[Any], tuple[int, int] | None]] = {
    "event_id": (str, None),
    "event_time_ms": (int, _INT64),
    "user_id": (str, None),
    "item_id": (str, None),
    "domain": (str, None),
    "event_type": (str, None),
    "category": (str, None),
    "position": (int, _INT32),
    "ad_format": (str, None),
    "age": (int, _INT32),
    "gender": (str, None),
    "location": (str, None),
}
_MS_PER_DAY = 86_400_000
_EPOCH = dt.date(1970, 1, 1)
_EPOCH_UTC = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
_ONE_US = dt.timedelta(microseconds=1)

SECONDS_BELOW = 10**11
"""An integer event time with ``|v|`` below this is in seconds (1e11 s = year 5138)."""
MILLIS_BELOW = 10**14
"""... else below this in milliseconds (1e14 ms = year 5138); from here on in microseconds."""
MIN_EVENT_TIME_US = (dt.datetime(1, 1, 1, tzinfo=dt.timezone.utc) - _EPOCH_UTC) // _ONE_US
"""0001-01-01T00:00:00Z in us since epoch: the earliest time a Delta date partition can name."""
MAX_EVENT_TIME_US = (dt.datetime(9999, 12, 31, 23, 59, 59, 999_999, tzinfo=dt.timezone.utc) - _EPOCH_UTC) // _ONE_US
"""9999-12-31T23:59:59.999999Z in us since epoch."""

Outcome = tuple[Literal["ok"], dict[str, Any]] | tuple[Literal["dead"], dict[str, Any]]


def event_date(event_time_ms: int) -> str:
    """UTC calendar date ``YYYY-MM-DD`` of a time in ms since epoch (integer arithmetic, exact).

    Raises:
        OverflowError: the date falls outside years 1..9999.
    """
    return (_EPOCH + dt.timedelta(days=event_time_ms // _MS_PER_DAY)).isoformat()


def event_time_to_us(value: Any) -> int:
    """Normalise a wire event time to microseconds since epoch UTC (rules in the module docstring).

    Args:
        value: a Python int (not bool) in seconds, ms or us, decided by magnitude, or an ISO-8601 str.

    Returns:
        int microseconds since 1970-01-01T00:00:00Z, within ``[MIN_EVENT_TIME_US, MAX_EVENT_TIME_US]``.

    Raises:
        ValueError: anything else, or a time outside years 1..9999; the message is the dead-letter detail.
    """
    if isinstance(value, str):
        try:
            parsed = dt.datetime.fromisoformat(value)
        except ValueError as exc:
            raise ValueError(f"event_time_ms: expected an int or an ISO-8601 string, got str {value!r:.80} ({exc})")
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=dt.timezone.utc)
        try:
            us = (parsed - _EPOCH_UTC) // _ONE_US
        except OverflowError:
            us = MIN_EVENT_TIME_US - 1
    elif isinstance(value, int) and not isinstance(value, bool):
        if not _INT64[0] <= value <= _INT64[1]:
            raise ValueError(f"event_time_ms: expected an int in [{_INT64[0]}, {_INT64[1]}], got {value}")
        if -SECONDS_BELOW < value < SECONDS_BELOW:
            us = value * 1_000_000
        elif -MILLIS_BELOW < value < MILLIS_BELOW:
            us = value * 1_000
        else:
            us = value
    else:
        raise ValueError(f"event_time_ms: expected an int or an ISO-8601 string, got {type(value).__name__} "
                         f"{value!r:.80}")
    if not MIN_EVENT_TIME_US <= us <= MAX_EVENT_TIME_US:
        raise ValueError(f"event_time_ms: {value!r:.80} is outside years 1..9999")
    return us


def _type_error(name: str, value: Any) -> str | None:
    """Why ``value`` does not fit field ``name``'s column, or None if it does."""
    want, bounds = _FIELD_TYPES[name]
    # bool is a subclass of int in Python, but true/false is not a number on the wire.
    if not isinstance(value, want) or isinstance(value, bool):
        return f"{name}: expected {want.__name__}, got {type(value).__name__} {value!r:.80}"
    if bounds is not None and not bounds[0] <= int(value) <= bounds[1]:
        return f"{name}: expected an int in [{bounds[0]}, {bounds[1]}], got {value}"
    return None


def _dead(rec: KafkaRecord, reason: str, detail: str) -> tuple[Literal["dead"], dict[str, Any]]:
    return "dead", dead_row(rec, reason, detail)


def dead_row(rec: KafkaRecord, reason: str, detail: str) -> dict[str, Any]:
    """A ``DEAD_LETTER_SCHEMA`` row for ``rec``: the reason, the detail (cut to 1,000 characters), the
    raw value (``b""`` for a tombstone; the first :data:`RAW_PREFIX_BYTES` of a too-large one), the
    Kafka key and coordinates (``kafka_generation`` null: the ingest driver stamps it)."""
    value = b"" if rec.value is None else rec.value
    return {
        "reason": reason,
        "detail": detail[:1000],
        "raw": value[:RAW_PREFIX_BYTES] if reason == "too_large" else value,
        "kafka_topic": rec.topic,
        "kafka_partition": rec.partition,
        "kafka_offset": rec.offset,
        "created_ts_ms": rec.timestamp_ms,
        "kafka_key": rec.key,
        "kafka_generation": None,  # stamped by the ingest driver (ingest.pipeline), which knows the generation
    }


def json_depth(text: str) -> int:
    """Deepest nesting of objects and arrays in JSON ``text`` (brackets inside strings ignored); 0 for a scalar.

    Computed on the text, so that it is defined for any input, valid JSON or not.
    """
    depth = deepest = 0
    for bracket in _BRACKET.findall(_JSON_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _has_surrogate(obj: Any) -> bool:
    """True when a string anywhere in the decoded JSON ``obj`` (keys included) holds a surrogate."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def known_since(record_ts_ms: int, *, now_ms: int, max_future_skew_ms: int, min_event_time_ms: int | None) -> int:
    """``created_ts_ms`` of an event: its Kafka record timestamp, or ``now_ms`` where that cannot be
    when the event became known (rule in the module docstring). All times ms since epoch UTC."""
    floor = 0 if min_event_time_ms is None else max(min_event_time_ms, 0)
    if record_ts_ms < floor or record_ts_ms > now_ms + max_future_skew_ms:
        return now_ms
    return record_ts_ms


def _blank(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip(BLANK) == "")


def parse_record(
    rec: KafkaRecord,
    *,
    domains: Iterable[str],
    now_ms: int,
    max_future_skew_ms: int,
    retention_ms: int | None = None,
    min_event_time_ms: int | None = None,
    max_message_bytes: int | None = None,
) -> Outcome:
    """Validate one Kafka record against the Event schema.

    Args:
        rec: the record; ``rec.value`` is the JSON wire format of ``ingest.schema.Event``.
        domains: known domains (``IngestConfig.domains``).
        now_ms: the ingest clock, ms since epoch UTC (fixed per batch so that a rerun decides alike).
        max_future_skew_ms: tolerated lead of event time over ``now_ms``, ms.
        retention_ms: oldest accepted event time, as a lag behind ``now_ms`` in ms; None accepts any age.
        min_event_time_ms: earliest plausible event time, ms since epoch UTC; None: no floor.
        max_message_bytes: largest value read, bytes; None: no limit (a reader may already have cut
            a larger value, ``rec.value_size``).

    Returns:
        ``("ok", row)`` with a row of ``EVENTS_TABLE_SCHEMA`` (Event fields, ``created_ts_ms`` from
        :func:`known_since`, ``event_date`` = UTC date of ``event_time_ms``, Kafka coordinates,
        ``event_time_us``), or ``("dead", row)`` with a row of ``DEAD_LETTER_SCHEMA`` whose ``reason``
        is one of :data:`REASONS` (see the module docstring). Never raises on any message.
    """
    try:
        return _parse(rec, domains=domains, now_ms=now_ms, max_future_skew_ms=max_future_skew_ms,
                      retention_ms=retention_ms, min_event_time_ms=min_event_time_ms,
                      max_message_bytes=max_message_bytes)
    except Exception as exc:  # noqa: BLE001 -- one message must never fail the batch
        return _dead(rec, "parse_failure", f"{type(exc).__name__}: {exc}")


def _parse(rec: KafkaRecord, *, domains: Iterable[str], now_ms: int, max_future_skew_ms: int,
           retention_ms: int | None, min_event_time_ms: int | None, max_message_bytes: int | None) -> Outcome:
    if rec.value is None:
        return _dead(rec, "tombstone", "the message has no value (a tombstone)")
    size = rec.value_size if rec.value_size is not None else len(rec.value)
    if rec.value_size is not None or (max_message_bytes is not None and size > max_message_bytes):
        limit = "the reader's limit" if max_message_bytes is None else f"ingest.max_message_bytes = {max_message_bytes}"
        return _dead(rec, "too_large", f"value is {size} bytes, above {limit}; raw keeps its first "
                                       f"{RAW_PREFIX_BYTES} bytes")
    if rec.key is not None and _RAW_SURROGATE.search(rec.key):
        return _dead(rec, "lone_surrogate", "the Kafka key holds a UTF-16 surrogate (invalid UTF-8)")
    try:
        text = rec.value.decode("utf-8")
    except ValueError as exc:
        if _RAW_SURROGATE.search(rec.value):
            return _dead(rec, "lone_surrogate", "the value holds a raw UTF-16 surrogate (WTF-8/CESU-8 bytes, "
                                                "invalid UTF-8)")
        return _dead(rec, "not_json", f"value is not UTF-8 JSON: {exc}"[:500])
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        return _dead(rec, "too_deep", f"JSON nested {depth} deep; at most {MAX_JSON_DEPTH} is read")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:  # ValueError covers bad JSON and ints too long to parse
        return _dead(rec, "not_json", f"value is not UTF-8 JSON: {exc}"[:500])
    if _has_surrogate(obj):
        return _dead(rec, "lone_surrogate", "a JSON string holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff)")
    if not isinstance(obj, dict):
        return _dead(rec, "not_object", f"expected a JSON object, got {type(obj).__name__}")

    version = obj.get("schema_version", SCHEMA_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or version != SCHEMA_VERSION:
        return _dead(rec, "unsupported_schema_version",
                     f"schema_version: expected {SCHEMA_VERSION}, got {version!r:.80}; upgrade gemline to read it")

    missing = [name for name in REQUIRED_FIELDS if _blank(obj.get(name)) or obj.get(name) == ""]
    if missing:
        return _dead(rec, "missing_field", f"required field(s) absent, null or blank: {', '.join(missing)}")

    time_us = 0
    for name in REQUIRED_FIELDS + OPTIONAL_FIELDS:
        value = obj.get(name)
        if value is None:
            continue
        if name == "event_time_ms":
            try:
                time_us = event_time_to_us(value)
            except ValueError as exc:
                return _dead(rec, "wrong_type", str(exc))
            continue
        problem = _type_error(name, value)
        if problem is not None:
            return _dead(rec, "wrong_type", problem)

    if obj["event_type"] not in EVENT_TYPES:
        return _dead(rec, "unknown_event_type", f"event_type: expected one of {EVENT_TYPES}, got {obj['event_type']!r:.80}")
    domain_set = frozenset(domains)
    if obj["domain"] not in domain_set:
        return _dead(rec, "unknown_domain", f"domain: expected one of {sorted(domain_set)}, got {obj['domain']!r:.80}")
    time_ms = time_us // 1000
    limit_ms = now_ms + max_future_skew_ms
    if time_us > limit_ms * 1000:
        return _dead(rec, "future_event_time", future_detail(time_us, now_ms, max_future_skew_ms))
    if min_event_time_ms is not None and time_us < min_event_time_ms * 1000:
        return _dead(rec, "too_early_event_time", f"event time {time_ms} ms is before ingest.min_event_time_ms = "
                                                  f"{min_event_time_ms} ms (a clock bug or a wrong unit?)")
    if retention_ms is not None and time_us < (now_ms - retention_ms) * 1000:
        return _dead(rec, "expired_event_time", expired_detail(time_us, now_ms, retention_ms))

    row: dict[str, Any] = {name: obj.get(name) for name in REQUIRED_FIELDS + OPTIONAL_FIELDS}
    row["event_time_ms"] = time_ms
    row["schema_version"] = version
    row["created_ts_ms"] = known_since(rec.timestamp_ms, now_ms=now_ms, max_future_skew_ms=max_future_skew_ms,
                                       min_event_time_ms=min_event_time_ms)
    row["event_date"] = event_date(time_ms)
    row["kafka_topic"] = rec.topic
    row["kafka_partition"] = rec.partition
    row["kafka_offset"] = rec.offset
    row["event_time_us"] = time_us
    row["kafka_generation"] = None  # stamped by the ingest driver (ingest.pipeline)
    return "ok", row


def future_detail(time_us: int, now_ms: int, skew_ms: int) -> str:
    """Dead-letter detail of ``future_event_time`` (shared with the vectorised parser)."""
    return (f"event time {time_us} us is after the ingest clock {now_ms} ms + skew {skew_ms} ms = "
            f"{now_ms + skew_ms} ms")


def expired_detail(time_us: int, now_ms: int, retention_ms: int) -> str:
    """Dead-letter detail of ``expired_event_time`` (shared with the vectorised parser)."""
    return (f"event time {time_us} us is before the ingest clock {now_ms} ms - retention {retention_ms} ms = "
            f"{now_ms - retention_ms} ms")

