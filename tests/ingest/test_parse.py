"""parse_record: every dead-letter reason from a table of cases, hand-checked valid rows, and ParseEvents."""

from __future__ import annotations

import json

import apache_beam as beam
import pyarrow as pa
import pytest
from apache_beam.testing import test_pipeline  # module import: pytest would try to collect class TestPipeline
from apache_beam.testing.util import assert_that, equal_to
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.kafka_source import KafkaRecord
from ingest.parse import DEAD_LETTER, GOOD, REASONS, ParseEvents, event_date, parse_record
from ingest.schema import DEAD_LETTER_SCHEMA, EVENT_TYPES, EVENTS_TABLE_SCHEMA, Event

NOW_MS = 1_700_000_000_000  # 2023-11-14T22:13:20Z
SKEW_MS = 60_000
DOMAINS = ("facebook", "instagram")
TS_MS = 1_700_000_123_456  # Kafka record timestamp


def _rec(value: bytes, offset: int = 7) -> KafkaRecord:
    return KafkaRecord(topic="t", partition=2, offset=offset, key=b"u1", value=value, timestamp_ms=TS_MS)


_DROP = object()  # marks a field to leave out of the JSON object


def _obj(**over) -> dict:
    base = {"event_id": "e1", "event_time_ms": NOW_MS - 1000, "user_id": "u1", "item_id": "i1",
            "domain": "facebook", "event_type": "impression", "schema_version": 1}
    base.update(over)
    return {k: v for k, v in base.items() if v is not _DROP}


def _parse(value: bytes):
    return parse_record(_rec(value), domains=DOMAINS, now_ms=NOW_MS, max_future_skew_ms=SKEW_MS)


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
    ("wrong_type", "event_time_ms: expected int, got str", _j(_obj(event_time_ms="1700000000000"))),
    ("wrong_type", "event_time_ms: expected int, got float", _j(_obj(event_time_ms=1.7e12))),
    ("wrong_type", "event_time_ms: expected int, got bool", _j(_obj(event_time_ms=True))),
    ("wrong_type", "event_time_ms: expected an int in", _j(_obj(event_time_ms=-(2**64)))),
    ("wrong_type", "outside years", _j(_obj(event_time_ms=-(2**62)))),
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
]


@pytest.mark.parametrize(("reason", "detail", "value"), DEAD_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(DEAD_CASES)])
def test_dead_letter_cases(reason, detail, value):
    kind, row = _parse(value)
    assert kind == "dead"
    assert row["reason"] == reason
    assert detail in row["detail"]
    assert row == {"reason": reason, "detail": row["detail"], "raw": value, "kafka_topic": "t", "kafka_partition": 2,
                   "kafka_offset": 7, "created_ts_ms": TS_MS}
    pa.Table.from_pylist([row], schema=DEAD_LETTER_SCHEMA)  # the row fits the table


def test_every_reason_has_a_case():
    assert {c[0] for c in DEAD_CASES} == set(REASONS)


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
        "kafka_offset": 7,
    }
    assert list(row) == EVENTS_TABLE_SCHEMA.names


@pytest.mark.parametrize(
    ("obj", "date"),
    [
        (_obj(event_time_ms=0), "1970-01-01"),
        (_obj(event_time_ms=-1), "1969-12-31"),  # floor division: the last ms of 1969
        (_obj(event_time_ms=86_399_999), "1970-01-01"),
        (_obj(event_time_ms=86_400_000), "1970-01-02"),
        (_obj(event_time_ms=951_782_400_000), "2000-02-29"),  # leap day 00:00:00Z
        (_obj(event_time_ms=NOW_MS + SKEW_MS), "2023-11-14"),  # exactly at the skew limit is allowed
        (_obj(schema_version=_DROP), "2023-11-14"),  # absent version = current, as Event defaults it
        (_obj(position=None, age=None, category=None), "2023-11-14"),  # null optionals are fine
    ],
)
def test_valid_rows_dates(obj, date):
    kind, row = _parse(_j(obj))
    assert kind == "ok", row
    assert row["event_date"] == date
    assert row["created_ts_ms"] == TS_MS and row["schema_version"] == 1


_text = st.text(min_size=1, max_size=8)
_events = st.builds(
    Event,
    event_id=_text, user_id=_text, item_id=_text,
    event_time_ms=st.integers(-(2**40), NOW_MS + SKEW_MS),
    domain=st.sampled_from(DOMAINS), event_type=st.sampled_from(EVENT_TYPES),
    category=st.none() | _text, position=st.none() | st.integers(-(2**31), 2**31 - 1),
    ad_format=st.none() | _text, age=st.none() | st.integers(0, 130), gender=st.none() | _text,
    location=st.none() | _text,
)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(_events)
def test_valid_events_round_trip(ev):
    kind, row = _parse(ev.to_json())
    assert kind == "ok", row
    assert {k: row[k] for k in Event.__dataclass_fields__} == ev.__dict__
    assert row["event_date"] == event_date(ev.event_time_ms)
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


def test_parse_events_transform_tags_both_outputs():
    good = _rec(_j(_obj(event_id="g1", event_time_ms=86_400_000)), offset=1)
    bad_json = _rec(b"nope", offset=2)
    bad_domain = _rec(_j(_obj(domain="tiktok")), offset=3)
    with test_pipeline.TestPipeline() as p:
        out = p | beam.Create([good, bad_json, bad_domain]) | ParseEvents(DOMAINS, NOW_MS, SKEW_MS)
        assert_that(out[GOOD] | "GoodKeys" >> beam.Map(lambda r: (r["event_id"], r["event_date"], r["kafka_offset"])),
                    equal_to([("g1", "1970-01-02", 1)]), label="CheckGood")
        assert_that(out[DEAD_LETTER] | "DeadKeys" >> beam.Map(lambda r: (r["reason"], r["kafka_offset"])),
                    equal_to([("not_json", 2), ("unknown_domain", 3)]), label="CheckDead")


@pytest.mark.parametrize(("domains", "skew", "match"), [((), 0, "at least one domain"), (DOMAINS, -1, "skew_ms >= 0")])
def test_parse_events_rejects_bad_arguments(domains, skew, match):
    with pytest.raises(ValueError, match=match):
        ParseEvents(domains, NOW_MS, skew)
