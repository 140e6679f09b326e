"""parse_batch against its reference twin parse_record: same rows, same reasons, on cases and hypothesis batches."""

from __future__ import annotations

import json

import apache_beam as beam
import pyarrow as pa
import pytest
from apache_beam.testing import test_pipeline  # module import: pytest would try to collect class TestPipeline
from apache_beam.testing.util import assert_that, equal_to
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.kafka_source import KafkaRecord, records_to_batch
from ingest.parse import DEAD_LETTER, GOOD, REASONS, parse_record
from ingest.schema import DEAD_LETTER_SCHEMA, EVENT_TYPES, EVENTS_TABLE_SCHEMA
from ingest.vectorized import (
    LEAF_ROWS,
    ParseBatches,
    _suspicious,
    _suspicious_regex,
    parse_batch,
)

NOW_MS = 1_700_000_000_000
SKEW_MS = 60_000
RETENTION_MS = 30 * 86_400_000
MIN_MS = 946_684_800_000  # 2000-01-01
MAX_BYTES = 4096
DOMAINS = ("facebook", "instagram")
RULES = dict(domains=DOMAINS, now_ms=NOW_MS, max_future_skew_ms=SKEW_MS, retention_ms=RETENTION_MS,
             min_event_time_ms=MIN_MS, max_message_bytes=MAX_BYTES)
_DROP = object()


def _obj(i: int = 0, **over) -> dict:
    base = {"event_id": f"e{i}", "event_time_ms": NOW_MS - 1000 * i, "user_id": f"u{i % 3}", "item_id": f"i{i}",
            "domain": DOMAINS[i % 2], "event_type": EVENT_TYPES[i % 4], "category": "c", "position": i, "age": None,
            "schema_version": 1}
    base.update(over)
    return {k: v for k, v in base.items() if v is not _DROP}


def _j(obj) -> bytes:
    return json.dumps(obj).encode()


def _records(values: list[bytes | None]) -> list[KafkaRecord]:
    return [KafkaRecord("t", i % 3, 100 + i, None if i % 2 else b"k", v, NOW_MS + i) for i, v in enumerate(values)]


def _reference(records: list[KafkaRecord], **over) -> tuple[list[dict], list[dict]]:
    good, dead = [], []
    for rec in records:
        kind, row = parse_record(rec, **{**RULES, **over})
        (good if kind == "ok" else dead).append(row)
    return good, dead


def _vectorized(records: list[KafkaRecord], **over) -> tuple[list[dict], list[dict]]:
    events, dead = parse_batch(records_to_batch(records), **{**RULES, **over})
    assert events.schema == EVENTS_TABLE_SCHEMA and dead.schema == DEAD_LETTER_SCHEMA
    return events.to_pylist(), dead.to_pylist()


def _check_twins(values: list[bytes | None], **over) -> tuple[list[dict], list[dict]]:
    records = _records(values)
    good, dead = _vectorized(records, **over)
    ref_good, ref_dead = _reference(records, **over)
    assert good == ref_good
    assert dead == ref_dead
    assert len(good) + len(dead) == len(values)
    return good, dead


BAD_CASES = [
    # (reason, value): one bad message among good ones
    ("not_json", b"{oops"),
    ("not_json", b""),
    ("not_json", b"\xff\xfe{}"),
    ("not_json", b'{"event_id": "x"} trailing'),
    ("not_json", b"{\"event_id\": 1,}"),
    ("missing_field", b"{\"event_id\": NaN}"),  # Python json reads NaN; polars cannot
    ("not_object", b"[1, 2]"),
    ("not_object", b"null"),
    ("unsupported_schema_version", _j(_obj(schema_version=2))),
    ("unsupported_schema_version", _j(_obj(schema_version=True))),
    ("missing_field", _j(_obj(event_id=_DROP))),
    ("missing_field", _j(_obj(user_id=None))),
    ("missing_field", _j(_obj(item_id=""))),
    ("wrong_type", _j(_obj(event_time_ms="not a time"))),
    ("wrong_type", _j(_obj(event_time_ms=1.7e12))),
    ("wrong_type", _j(_obj(event_time_ms=True))),
    ("wrong_type", _j(_obj(event_time_ms=2**62))),
    ("wrong_type", _j(_obj(event_time_ms=2**64))),
    ("wrong_type", _j(_obj(user_id=17))),
    ("wrong_type", _j(_obj(domain=["facebook"]))),
    ("wrong_type", _j(_obj(category={"a": 1}))),
    ("wrong_type", _j(_obj(position=False))),
    ("wrong_type", _j(_obj(position=2**31))),
    ("wrong_type", _j(_obj(age="33"))),
    ("unknown_event_type", _j(_obj(event_type="purchase"))),
    ("unknown_domain", _j(_obj(domain="tiktok"))),
    ("future_event_time", _j(_obj(event_time_ms=NOW_MS + SKEW_MS + 1))),
    ("future_event_time", _j(_obj(event_time_ms=(NOW_MS + SKEW_MS) * 1000 + 1))),
    ("expired_event_time", _j(_obj(event_time_ms=NOW_MS - RETENTION_MS - 1))),
    ("too_early_event_time", _j(_obj(event_time_ms="2000-01-01T00:00:00+05:00"))),
    ("too_early_event_time", _j(_obj(event_time_ms=0))),
    ("too_early_event_time", _j(_obj(event_time_ms=-1))),
    ("too_early_event_time", _j(_obj(event_time_ms="1914-07-28T00:00:00Z"))),
    ("tombstone", None),
    ("too_large", _j(_obj(category="x" * MAX_BYTES))),
    ("lone_surrogate", _j(_obj(event_id="\ud800"))),  # json.dumps writes the escape \ud800
    ("lone_surrogate", _j(_obj(category="a\udfff"))),
    ("lone_surrogate", _j(_obj(extra={"deep": ["\udc00"]}))),  # a field we do not even read
    ("lone_surrogate", _j(_obj(event_id="SURR")).replace(b"SURR", b"\xed\xa0\x80")),  # raw WTF-8 bytes
    ("too_deep", _j(_obj(extra=json.loads("[" * 40 + "]" * 40)))),
    ("too_deep", b'{"a": ' + b"[" * 1_500 + b"]" * 1_500 + b"}"),
    ("missing_field", _j(_obj(user_id=" \t\u3000\u00a0 "))),
    ("missing_field", _j(_obj(item_id="\u2028"))),
]


def _raw_kept(reason: str, value: bytes | None) -> bytes:
    return b"" if value is None else value[:1024] if reason == "too_large" else value


@pytest.mark.parametrize(("reason", "value"), BAD_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_CASES)])
def test_bad_message_reason_and_good_rows_kept(reason, value):
    goods = [_j(_obj(i)) for i in range(6)]
    good, dead = _check_twins(goods[:3] + [value] + goods[3:])
    assert [(d["reason"], d["kafka_offset"], d["raw"]) for d in dead] == [(reason, 103, _raw_kept(reason, value))]
    assert [g["event_id"] for g in good] == [f"e{i}" for i in range(6)]


@pytest.mark.parametrize(("reason", "value"), BAD_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_CASES)])
def test_a_message_fate_does_not_depend_on_its_neighbours(reason, value):
    alone = _check_twins([value])[1]
    among = _check_twins([_j(_obj(i)) for i in range(LEAF_ROWS * 3)] + [value])[1]
    assert [d["reason"] for d in alone] == [d["reason"] for d in among] == [reason]


def test_every_reason_has_a_batch_case():
    # parse_failure is the net under a parser bug: test_a_failing_row_is_dead_lettered_not_raised
    assert {c[0] for c in BAD_CASES} | {"parse_failure"} == set(REASONS)


def test_dead_letter_keeps_key_tombstone_and_the_size_of_a_large_message():
    recs = [KafkaRecord("t", 0, 1, b"k1", None, NOW_MS), KafkaRecord("t", 0, 2, None, b"", NOW_MS),
            KafkaRecord("t", 0, 3, b"k3", b"{" * 1024, NOW_MS, 50_000_000),  # cut by the reader
            KafkaRecord("t", 0, 4, b"\xed\xb0\x80", _j(_obj(4)), NOW_MS)]  # a surrogate in the key
    events, dead = parse_batch(records_to_batch(recs), **RULES)
    assert events.num_rows == 0
    rows = dead.to_pylist()
    assert [(r["reason"], r["kafka_key"], r["raw"]) for r in rows] == [
        ("tombstone", b"k1", b""), ("not_json", None, b""), ("too_large", b"k3", b"{" * 1024),
        ("lone_surrogate", b"\xed\xb0\x80", _j(_obj(4)))]
    assert "50000000 bytes" in rows[2]["detail"]
    assert _reference(recs)[1] == rows


def test_a_failing_row_is_dead_lettered_not_raised(monkeypatch):
    import ingest.vectorized as vec

    values = [_j(_obj(i)) for i in range(5)] + [_j(_obj(5, category="BOOM"))]
    real = vec.parse_record

    def buggy(rec, **kw):  # a reference that lets a row through that Arrow cannot store
        kind, row = real(rec, **kw)
        if kind == "ok" and row["category"] == "BOOM":
            row = {**row, "position": "not an int"}
        return kind, row

    def broken_fast(*args, **kw):
        raise MemoryError("simulated failure of the vectorised parser")

    monkeypatch.setattr(vec, "parse_record", buggy)
    monkeypatch.setattr(vec, "_parse_fast", broken_fast)
    events, dead = parse_batch(records_to_batch(_records(values)), **RULES)
    assert events["event_id"].to_pylist() == [f"e{i}" for i in range(5)]
    assert [(d["reason"], d["kafka_offset"]) for d in dead.to_pylist()] == [("parse_failure", 105)]


def test_blank_means_unicode_white_space_in_both_parsers():
    # U+001C is whitespace to Python's str.strip() but not to Unicode White_Space: an id, not a blank one.
    good, dead = _check_twins([_j(_obj(0, user_id="\x1c")), _j(_obj(1, user_id=" u1 "))])
    assert [g["user_id"] for g in good] == ["\x1c", " u1 "] and not dead


def test_implausible_record_timestamp_becomes_the_ingest_clock():
    values = [_j(_obj(i)) for i in range(4)]
    stamps = [NOW_MS - 5, 32_503_680_000_000, -1, 1_000]  # fine, year 3000, none, 1970
    recs = [KafkaRecord("t", 0, i, None, v, ts) for i, (v, ts) in enumerate(zip(values, stamps))]
    events, _ = parse_batch(records_to_batch(recs), **RULES)
    assert events["created_ts_ms"].to_pylist() == [NOW_MS - 5, NOW_MS, NOW_MS, NOW_MS]
    assert [row["created_ts_ms"] for row in _reference(recs)[0]] == [NOW_MS - 5, NOW_MS, NOW_MS, NOW_MS]


@pytest.mark.parametrize(
    ("value", "us"),
    [
        (_j(_obj(event_time_ms=1_699_999_999)), 1_699_999_999_000_000),  # seconds
        (_j(_obj(event_time_ms=1_699_999_999_123)), 1_699_999_999_123_000),  # ms
        (_j(_obj(event_time_ms=1_699_999_999_123_456)), 1_699_999_999_123_456),  # us
        (_j(_obj(event_time_ms="2023-11-14T22:13:19.5Z")), 1_699_999_999_500_000),
        (_j(_obj(event_time_ms="2023-11-14T23:13:19.5+01:00")), 1_699_999_999_500_000),
        (_j(_obj(event_time_ms="2023-11-14T22:13:19.5")), 1_699_999_999_500_000),  # naive = UTC
    ],
)
def test_time_units_normalised(value, us):
    good, dead = _check_twins([value, _j(_obj(1))])
    assert not dead
    assert (good[0]["event_time_us"], good[0]["event_time_ms"], good[0]["event_date"]) == (us, us // 1000, "2023-11-14")


def test_hand_checked_batch_rows():
    good, dead = _check_twins([_j(_obj(0, position=3, age=41, gender="f", extra={"x": [1]})), b"{"])
    assert good == [{
        "event_id": "e0", "event_time_ms": NOW_MS, "user_id": "u0", "item_id": "i0", "domain": "facebook",
        "event_type": "impression", "category": "c", "position": 3, "ad_format": None, "age": 41, "gender": "f",
        "location": None, "schema_version": 1, "created_ts_ms": NOW_MS, "event_date": "2023-11-14",
        "kafka_topic": "t", "kafka_partition": 0, "kafka_offset": 100, "event_time_us": NOW_MS * 1000,
        "kafka_generation": None,  # stamped by the ingest driver, not the parser
    }]
    assert [d["reason"] for d in dead] == ["not_json"]


def test_empty_batch_and_wrong_schema():
    events, dead = parse_batch(records_to_batch([]), domains=DOMAINS, now_ms=NOW_MS, max_future_skew_ms=0)
    assert events.num_rows == 0 and dead.num_rows == 0
    with pytest.raises(TypeError, match="RECORDS_SCHEMA"):
        parse_batch(pa.record_batch({"value": [b"{}"]}), domains=DOMAINS, now_ms=NOW_MS, max_future_skew_ms=0)


def test_large_batch_with_scattered_bad_rows_bisects_to_the_same_answer():
    values = [_j(_obj(i)) for i in range(10 * LEAF_ROWS)]
    for i in range(0, len(values), 37):
        values[i] = _j(_obj(i, event_time_ms=1.5))  # a float time makes polars decode the chunk as Float64
    good, dead = _check_twins(values)
    assert len(dead) == len(range(0, len(values), 37))


def test_batch_over_many_read_blocks_with_a_row_longer_than_a_block():
    from ingest.vectorized import _READ_OPTIONS

    block = _READ_OPTIONS.block_size
    values = [_j(_obj(i, category="c" * (i % 300))) for i in range(3 * block // 150)]  # rows straddle block ends
    values[len(values) // 2] = _j(_obj(7, category="x" * (block + 10)))  # a valid event longer than a block
    values[len(values) // 3] = b"{oops"
    assert sum(map(len, values)) > 3 * block
    good, dead = _check_twins(values, max_message_bytes=None)
    assert [d["reason"] for d in dead] == ["not_json"]
    assert len(good) == len(values) - 1
    assert any(len(g["category"] or "") > block for g in good), "the long row is kept, by the reference path"


_scalar = st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats(allow_nan=False) | st.text(max_size=6)
_field_value = {
    "event_id": st.text(max_size=4) | _scalar,
    "event_time_ms": st.integers(-(2**63), 2**63) | st.integers(10**11, NOW_MS + 2 * SKEW_MS) | _scalar
    | st.datetimes().map(lambda d: d.isoformat()),
    "user_id": st.text(min_size=1, max_size=4),
    "item_id": st.text(max_size=4) | _scalar,
    "domain": st.sampled_from(DOMAINS + ("tiktok",)) | _scalar,
    "event_type": st.sampled_from(EVENT_TYPES + ("x",)),
    "position": st.integers(-(2**32), 2**32) | _scalar,
    "age": st.none() | st.integers(0, 130),
    "schema_version": st.sampled_from([1, 2]) | _scalar,
    "gender": st.none() | st.text(max_size=3),
}
_message = st.fixed_dictionaries({}, optional=_field_value).map(_j)
_valid = st.builds(lambda i, t: _j(_obj(i, event_time_ms=t)), st.integers(0, 50), st.integers(10**11, NOW_MS))
_garbage = (st.binary(max_size=24) | st.text(max_size=24).map(str.encode) | st.none()
            | st.text(max_size=24).map(lambda t: json.dumps({"x": t}).encode()))  # lone surrogates in escapes


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(_valid | _message | _garbage, max_size=80))
def test_twins_agree_on_any_batch(values):
    _check_twins(values)


def test_parse_batches_in_a_pipeline():
    values = [_j(_obj(i)) for i in range(5)] + [b"nope", _j(_obj(9, domain="tiktok"))]
    records = _records(values)
    batches = [records_to_batch(records[:2]), records_to_batch(records[2:4]), records_to_batch(records[4:])]
    with test_pipeline.TestPipeline() as p:
        out = p | beam.Create(batches) | ParseBatches(DOMAINS, NOW_MS, SKEW_MS, RETENTION_MS)
        good = out[GOOD] | "GoodRows" >> beam.FlatMap(lambda t: [(r["event_id"], r["kafka_offset"]) for r in t.to_pylist()])
        dead = out[DEAD_LETTER] | "DeadRows" >> beam.FlatMap(lambda t: [(r["reason"], r["kafka_offset"]) for r in t.to_pylist()])
        assert_that(good, equal_to([(f"e{i}", 100 + i) for i in range(5)]), label="CheckGood")
        assert_that(dead, equal_to([("not_json", 105), ("unknown_domain", 106)]), label="CheckDead")


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(domains=(), now_ms=0, max_future_skew_ms=0), "at least one domain"),
    (dict(domains=DOMAINS, now_ms=0, max_future_skew_ms=-1), "max_future_skew_ms >= 0"),
    (dict(domains=DOMAINS, now_ms=0, max_future_skew_ms=0, retention_ms=-5), "retention_ms >= 0"),
])
def test_parse_batches_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParseBatches(**kwargs)


FRAMING_CASES = [
    b'{"a": 1}', b'  {"a": 1}  ', b"{}", b"", b" ", b"{", b"}", b"[1]", b'{"a": "\t"}', b'{"a": "\x01"}',
    b'{"a": 1}\n', b'\n{"a": 1}', b'{"a": "\xc3\xa9"}', b"{\t}", b" {} x", b"x {}", b"{} }", b"null",
]


def _framing(values: list[bytes | None]) -> tuple[list[bool], list[bool]]:
    strings = pa.array(values, pa.binary()).cast(pa.string())
    return _suspicious(strings).tolist(), _suspicious_regex(strings).tolist()


def test_byte_framing_check_equals_the_regex_on_cases():
    fast, regex = _framing(FRAMING_CASES + [None])
    assert fast == regex
    assert regex[:3] == [False, False, False] and regex[-1] is True  # the check is not vacuous


@given(st.lists(st.one_of(st.none(), st.text(alphabet=st.sampled_from('{} \t\n\x1f"a\u00e9:1'), max_size=8)),
                max_size=12), st.integers(0, 3))
@settings(max_examples=200, deadline=None)
def test_byte_framing_check_equals_the_regex(texts, cut):
    values = [None if t is None else t.encode() for t in texts]
    strings = pa.array(values, pa.binary()).cast(pa.string())
    for arr in (strings, strings.slice(min(cut, len(strings)))):  # sliced arrays have an offset into the buffers
        assert _suspicious(arr).tolist() == _suspicious_regex(arr).tolist()
