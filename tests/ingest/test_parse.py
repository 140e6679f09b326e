"""parse_record: every dead-letter reason from a table of cases and hand-checked valid rows."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.kafka_source import KafkaRecord
from ingest.parse import (
    BLANK,
    REASONS,
    event_date,
    event_time_to_us,
    json_depth,
    known_since,
    parse_record,
)
from ingest.schema import DEAD_LETTER_SCHEMA, EVENT_TYPES, EVENTS_TABLE_SCHEMA, Event

NOW_MS = 1_700_000_000_000  # 2023-11-14T22:13:20Z
SKEW_MS = 60_000
DOMAINS = ("facebook", "instagram")
TS_MS = 1_699_999_876_544  # Kafka record timestamp, 123.456 s before the ingest clock
RETENTION_MS = 86_400_000


def _rec(value: bytes | None, offset: int = 7) -> KafkaRecord:
    return KafkaRecord(topic="t", partition=2, offset=offset, key=b"u1", value=value, timestamp_ms=TS_MS)


_DROP = object()  # marks a field to leave out of the JSON object


def _obj(**over) -> dict:
    base = {"event_id": "e1", "event_time_ms": NOW_MS - 1000, "user_id": "u1", "item_id": "i1",
            "domain": "facebook", "event_type": "impression", "schema_version": 1}
    base.update(over)
    return {k: v for k, v in base.items() if v is not _DROP}


MIN_MS = 946_684_800_000  # 2000-01-01
MAX_BYTES = 8192


def _parse(value: bytes | None, retention_ms: int | None = RETENTION_MS, min_ms: int | None = None):
    return parse_record(_rec(value), domains=DOMAINS, now_ms=NOW_MS, max_future_skew_ms=SKEW_MS,
                        retention_ms=retention_ms, min_event_time_ms=min_ms, max_message_bytes=MAX_BYTES)


def _j(obj) -> bytes:
    return json.dumps(obj).encode()


DEAD_CASES = [
    # (reason, substring of detail, value)
    ("not_json", "not UTF-8 JSON", b"{oops"),
    ("not_json", "not UTF-8 JSON", b""),
    ("not_json", "not UTF-8 JSON", b"\xff\xfe{}"),
    ("not_json", "not UTF-8 JSON", b"1" * 5000),  # an int longer than Python parses
    ("not_object", "got list", b"[1, 2]"),
    ("not_object", "got str", b'"event"'),
    ("not_object", "got NoneType", b"null"),
    ("unsupported_schema_version", "got 2", _j(_obj(schema_version=2))),
    ("unsupported_schema_version", "got '1'", _j(_obj(schema_version="1"))),
    ("unsupported_schema_version", "got True", _j(_obj(schema_version=True))),
    ("missing_field", "event_id", _j(_obj(event_id=_DROP))),
    ("missing_field", "user_id", _j(_obj(user_id=None))),
    ("missing_field", "item_id", _j(_obj(item_id=""))),
    ("missing_field", "event_time_ms, domain", _j(_obj(event_time_ms=_DROP, domain=None))),
    ("wrong_type", "expected an int or an ISO-8601 string, got str '1700000000000'", _j(_obj(event_time_ms="1700000000000"))),
    ("wrong_type", "got str 'yesterday'", _j(_obj(event_time_ms="yesterday"))),
    ("wrong_type", "expected an int or an ISO-8601 string, got float", _j(_obj(event_time_ms=1.7e12))),
    ("wrong_type", "expected an int or an ISO-8601 string, got bool", _j(_obj(event_time_ms=True))),
    ("wrong_type", "event_time_ms: expected an int in", _j(_obj(event_time_ms=-(2**64)))),
    ("wrong_type", "outside years", _j(_obj(event_time_ms=-(2**62)))),  # us: year -144,000
    ("wrong_type", "outside years", _j(_obj(event_time_ms=2**62))),  # us: year 148,000
    ("wrong_type", "outside years", _j(_obj(event_time_ms="0001-01-01T00:00:00+01:00"))),
    ("wrong_type", "user_id: expected str, got int", _j(_obj(user_id=17))),
    ("wrong_type", "domain: expected str, got list", _j(_obj(domain=["facebook"]))),
    ("wrong_type", "position: expected int, got bool", _j(_obj(position=False))),
    ("wrong_type", "position: expected an int in", _j(_obj(position=2**31))),
    ("wrong_type", "age: expected int, got str", _j(_obj(age="33"))),
    ("wrong_type", "category: expected str, got int", _j(_obj(category=5))),
    ("wrong_type", "location: expected str, got dict", _j(_obj(location={"zip": "1"}))),
    ("unknown_event_type", "got 'purchase'", _j(_obj(event_type="purchase"))),
    ("unknown_domain", "got 'tiktok'", _j(_obj(domain="tiktok"))),
    ("unknown_domain", "got 'Facebook'", _j(_obj(domain="Facebook"))),
    ("future_event_time", "after the ingest clock", _j(_obj(event_time_ms=NOW_MS + SKEW_MS + 1))),
    ("future_event_time", "after the ingest clock", _j(_obj(event_time_ms=(NOW_MS + SKEW_MS) * 1000 + 1))),  # us
    ("future_event_time", "after the ingest clock", _j(_obj(event_time_ms=(NOW_MS + SKEW_MS) // 1000 + 1))),  # s
    ("future_event_time", "after the ingest clock", _j(_obj(event_time_ms="2023-11-14T22:14:20.000001Z"))),
    ("future_event_time", "after the ingest clock", _j(_obj(event_time_ms="2023-11-14T23:14:20.000001+01:00"))),
    ("expired_event_time", "before the ingest clock", _j(_obj(event_time_ms=NOW_MS - RETENTION_MS - 1))),
    ("expired_event_time", "before the ingest clock", _j(_obj(event_time_ms="2023-11-13 22:13:19.999999"))),
    ("tombstone", "no value", None),
    ("too_large", "value is 8193 bytes, above ingest.max_message_bytes = 8192", b"{" + b" " * 8191 + b"}"),
    ("lone_surrogate", "unpaired UTF-16 surrogate escape", _j(_obj(event_id="\ud800"))),
    ("lone_surrogate", "unpaired UTF-16 surrogate escape", _j(_obj(**{"\udbff": 1}))),  # in a key of the object
    ("lone_surrogate", "raw UTF-16 surrogate", b'{"event_id": "\xed\xa0\x80"}'),
    ("too_deep", "nested 33 deep", b"[" * 33 + b"]" * 33),
    ("too_deep", "nested 1500 deep", b"[" * 1500 + b"]" * 1500),  # deeper than Python's json can parse
    ("missing_field", "user_id", _j(_obj(user_id="\u3000 \t"))),
    ("missing_field", "event_id, item_id", _j(_obj(event_id="\n", item_id="\u00a0"))),
]

FLOOR_CASES = [  # (value, reason) with ingest.min_event_time_ms = 2000-01-01
    (_j(_obj(event_time_ms=0)), "too_early_event_time"),
    (_j(_obj(event_time_ms=-1)), "too_early_event_time"),
    (_j(_obj(event_time_ms=1914)), "too_early_event_time"),  # seconds: 1970-01-01T00:31:54Z
    (_j(_obj(event_time_ms="1914-07-28")), "too_early_event_time"),
    (_j(_obj(event_time_ms=MIN_MS - 1)), "too_early_event_time"),
    (_j(_obj(event_time_ms=MIN_MS)), None),  # the floor itself is allowed
]


@pytest.mark.parametrize(("value", "reason"), FLOOR_CASES)
def test_min_event_time(value, reason):
    kind, row = _parse(value, retention_ms=None, min_ms=MIN_MS)
    assert (kind, row.get("reason")) == (("ok", None) if reason is None else ("dead", reason))


def test_json_depth_ignores_brackets_in_strings():
    assert json_depth('{"a": "[[[[{{{", "b": [[1], {"c": "\\"]]"}]}') == 3
    assert json_depth("7") == 0 and json_depth("[[]") == 2


@pytest.mark.parametrize(("ts", "known"), [
    (NOW_MS - 5, NOW_MS - 5), (NOW_MS + SKEW_MS, NOW_MS + SKEW_MS), (NOW_MS + SKEW_MS + 1, NOW_MS),
    (32_503_680_000_000, NOW_MS), (-1, NOW_MS), (MIN_MS - 1, NOW_MS), (MIN_MS, MIN_MS)])
def test_known_since_rule(ts, known):
    assert known_since(ts, now_ms=NOW_MS, max_future_skew_ms=SKEW_MS, min_event_time_ms=MIN_MS) == known


@pytest.mark.parametrize(("reason", "detail", "value"), DEAD_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(DEAD_CASES)])
def test_dead_letter_cases(reason, detail, value):
    kind, row = _parse(value)
    assert kind == "dead"
    assert row["reason"] == reason
    assert detail in row["detail"]
    raw = b"" if value is None else value[:1024] if reason == "too_large" else value
    assert row == {"reason": reason, "detail": row["detail"], "raw": raw, "kafka_topic": "t", "kafka_partition": 2,
                   "kafka_offset": 7, "created_ts_ms": TS_MS, "kafka_key": b"u1", "kafka_generation": None}
    pa.Table.from_pylist([row], schema=DEAD_LETTER_SCHEMA)  # the row fits the table


def test_every_reason_has_a_case():
    # too_early_event_time: FLOOR_CASES; parse_failure: tests/ingest/test_vectorized.py (a parser bug's net)
    assert {c[0] for c in DEAD_CASES} | {"too_early_event_time", "parse_failure"} == set(REASONS)


def test_valid_row_is_hand_checked():
    value = _j(_obj(event_time_ms=1_700_000_000_000, category="shoes", position=3, age=41, gender="f",
                    location="10115", ad_format="story", extra_field="ignored"))
    kind, row = _parse(value)
    assert kind == "ok"
    assert row == {
        "event_id": "e1", "event_time_ms": 1_700_000_000_000, "user_id": "u1", "item_id": "i1",
        "domain": "facebook", "event_type": "impression", "category": "shoes", "position": 3,
        "ad_format": "story", "age": 41, "gender": "f", "location": "10115", "schema_version": 1,
        "created_ts_ms": TS_MS, "event_date": "2023-11-14", "kafka_topic": "t", "kafka_partition": 2,
        "kafka_offset": 7, "event_time_us": 1_700_000_000_000_000, "kafka_generation": None,
    }
    assert list(row) == EVENTS_TABLE_SCHEMA.names


@pytest.mark.parametrize(
    ("obj", "date", "us"),
    [
        (_obj(event_time_ms=0), "1970-01-01", 0),
        (_obj(event_time_ms=-1), "1969-12-31", -1_000_000),  # seconds by magnitude; floor to the last day of 1969
        (_obj(event_time_ms=86_399), "1970-01-01", 86_399_000_000),  # seconds
        (_obj(event_time_ms=86_400), "1970-01-02", 86_400_000_000),
        (_obj(event_time_ms=100_000_000_000), "1973-03-03", 100_000_000_000_000),  # the first read as ms
        (_obj(event_time_ms=951_782_400_000), "2000-02-29", 951_782_400_000_000),  # ms, leap day 00:00:00Z
        (_obj(event_time_ms=100_000_000_000_000), "1973-03-03", 100_000_000_000_000),  # the first read as us
        (_obj(event_time_ms=951_782_400_000_001), "2000-02-29", 951_782_400_000_001),  # us
        (_obj(event_time_ms=-951_782_400_000_001), "1939-11-03", -951_782_400_000_001),  # us, before 1970
        (_obj(event_time_ms="2000-02-29T00:00:00Z"), "2000-02-29", 951_782_400_000_000),
        (_obj(event_time_ms="2000-02-29T01:00:00.000001+01:00"), "2000-02-29", 951_782_400_000_001),
        (_obj(event_time_ms="2000-02-28T23:59:59.999999"), "2000-02-28", 951_782_399_999_999),  # naive = UTC
        (_obj(event_time_ms="2000-02-29"), "2000-02-29", 951_782_400_000_000),
        (_obj(event_time_ms=NOW_MS + SKEW_MS), "2023-11-14", (NOW_MS + SKEW_MS) * 1000),  # at the limit is allowed
        (_obj(schema_version=_DROP), "2023-11-14", (NOW_MS - 1000) * 1000),  # absent version = current
        (_obj(position=None, age=None, category=None), "2023-11-14", (NOW_MS - 1000) * 1000),  # null optionals
    ],
)
def test_valid_rows_dates(obj, date, us):
    kind, row = _parse(_j(obj), retention_ms=None)
    assert kind == "ok", row
    assert row["event_date"] == date
    assert row["event_time_us"] == us and row["event_time_ms"] == us // 1000
    assert row["created_ts_ms"] == TS_MS and row["schema_version"] == 1


@pytest.mark.parametrize(
    ("value", "us"),
    [
        (99_999_999_999, 99_999_999_999 * 10**6),  # the largest value read as seconds (year 5138)
        (-99_999_999_999, None),  # seconds too, so year -1199: out of range
        (100_000_000_000, 10**14),  # the smallest read as ms (1973-03-03)
        (-100_000_000_000, -(10**14)),
        (99_999_999_999_999, 99_999_999_999_999_000),  # the largest read as ms
        (100_000_000_000_000, 10**14),  # the smallest read as us
        (253_402_300_799_999_999, 253_402_300_799_999_999),  # 9999-12-31T23:59:59.999999Z
        (253_402_300_800_000_000, None),
        ("9999-12-31T23:59:59.999999", 253_402_300_799_999_999),
        ("0001-01-01T00:00:00Z", -62_135_596_800_000_000),
    ],
)
def test_unit_rule_boundaries(value, us):
    if us is None:
        with pytest.raises(ValueError, match="outside years"):
            event_time_to_us(value)
    else:
        assert event_time_to_us(value) == us


def test_retention_boundary_is_inclusive():
    kind, row = _parse(_j(_obj(event_time_ms=NOW_MS - RETENTION_MS)))
    assert kind == "ok" and row["event_time_us"] == (NOW_MS - RETENTION_MS) * 1000


_text = st.text(min_size=1, max_size=8).filter(lambda t: t.strip(BLANK) != "")
_events = st.builds(
    Event,
    event_id=_text, user_id=_text, item_id=_text,
    event_time_ms=st.integers(10**11, NOW_MS + SKEW_MS),  # the ms band of the unit rule
    domain=st.sampled_from(DOMAINS), event_type=st.sampled_from(EVENT_TYPES),
    category=st.none() | _text, position=st.none() | st.integers(-(2**31), 2**31 - 1),
    ad_format=st.none() | _text, age=st.none() | st.integers(0, 130), gender=st.none() | _text,
    location=st.none() | _text,
)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(_events)
def test_valid_events_round_trip(ev):
    kind, row = _parse(ev.to_json(), retention_ms=None)
    assert kind == "ok", row
    assert {k: row[k] for k in Event.__dataclass_fields__} == ev.__dict__
    assert row["event_date"] == event_date(ev.event_time_ms)
    assert row["event_time_us"] == ev.event_time_ms * 1000
    pa.Table.from_pylist([row], schema=EVENTS_TABLE_SCHEMA)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.binary(max_size=64) | st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                                             lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c,
                                                                                                   max_size=3)).map(_j))
def test_any_bytes_land_in_exactly_one_table(value):
    kind, row = _parse(value)
    assert kind in ("ok", "dead")
    schema = EVENTS_TABLE_SCHEMA if kind == "ok" else DEAD_LETTER_SCHEMA
    pa.Table.from_pylist([row], schema=schema)
    if kind == "dead":
        assert row["reason"] in REASONS and row["raw"] == value


def test_event_date_matches_datetime():
    import datetime as dt

    for ms in (0, 1, -1, 1_700_000_000_000, 253_402_300_799_999):
        expected = (dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc) + dt.timedelta(milliseconds=ms)).date().isoformat()
        assert event_date(ms) == expected
