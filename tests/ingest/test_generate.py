"""Synthetic generator: deterministic by seed, labels after their impressions, bad records at the set rate."""

import collections
import dataclasses
import json

import pytest

from ingest.datasets.types import RawRecord
from ingest.generate import GEM_DOMAINS, GenerateConfig, generate_records, stamped
from ingest.schema import Event

SMALL = dict(num_users=200, num_ads=100, days=2.0, seed=7)


@pytest.fixture(scope="module")
def records():
    return generate_records(GenerateConfig(**SMALL, bad_rate=0.02))


def _events(records):
    return [r for r in records if isinstance(r, Event)]


def test_same_seed_same_bytes_other_seed_differs(records):
    again = generate_records(GenerateConfig(**SMALL, bad_rate=0.02))
    assert [r.to_json() if isinstance(r, Event) else r.value for r in again] == [
        r.to_json() if isinstance(r, Event) else r.value for r in records
    ]
    other = generate_records(GenerateConfig(**{**SMALL, "seed": 8}, bad_rate=0.02))
    assert [e.to_json() for e in _events(other)] != [e.to_json() for e in _events(records)]


def test_events_sorted_unique_and_within_the_three_domains(records):
    events = _events(records)
    times = [e.event_time_ms for e in events]
    assert times == sorted(times)
    assert len({e.event_id for e in events}) == len(events)
    assert {e.domain for e in events} == set(GEM_DOMAINS)
    assert {e.event_type for e in events} == {"impression", "click", "conversion", "engagement"}


def test_every_label_follows_an_impression_of_the_same_user_ad_and_domain(records):
    events = _events(records)
    first_impression = {}
    for e in events:
        if e.event_type == "impression":
            first_impression.setdefault((e.user_id, e.item_id, e.domain), e.event_time_ms)
    labels = [e for e in events if e.event_type in ("click", "conversion")]
    assert labels, "a 2-day sample must contain clicks"
    for e in labels:
        key = (e.user_id, e.item_id, e.domain)
        assert key in first_impression and first_impression[key] < e.event_time_ms


def test_click_rate_is_realistic(records):
    counts = collections.Counter(e.event_type for e in _events(records))
    ctr = counts["click"] / counts["impression"]
    assert 0.005 < ctr < 0.08
    assert counts["conversion"] < counts["click"]


def test_bad_records_at_the_configured_rate_and_each_is_bad(records):
    bad = [r for r in records if isinstance(r, RawRecord)]
    good = _events(records)
    assert len(bad) == round(0.02 * len(good))
    for record in bad:
        if record.reason_hint == "not_json":
            with pytest.raises(json.JSONDecodeError):
                json.loads(record.value)
            continue
        body = json.loads(record.value)
        if record.reason_hint == "missing_field":
            assert "user_id" not in body
        elif record.reason_hint == "unknown_domain":
            assert body["domain"] not in GEM_DOMAINS
        elif record.reason_hint == "wrong_type":
            assert isinstance(body["event_time_ms"], str)
        else:
            assert record.reason_hint == "future_event_time" and body["event_time_ms"] >= 4_102_444_800_000


def test_power_law_users():
    events = _events(generate_records(GenerateConfig(num_users=500, num_ads=100, days=3.0, seed=1)))
    per_user = collections.Counter(e.user_id for e in events)
    top = sum(c for _, c in per_user.most_common(50))
    assert top / len(events) > 0.4  # the top 10% of users make a large share of the traffic


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_users": 0}, "num_users must be >= 1"),
        ({"days": 0}, "days must be > 0"),
        ({"ctr": (0.1, 0.1)}, "one rate per domain"),
        ({"bad_rate": 1.5}, "bad_rate must be in"),
    ],
)
def test_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerateConfig(**kwargs)


def test_time_order_for_producing_keeps_bad_records_among_the_events(records):
    from ingest.generate import in_time_order

    raw = [RawRecord(b"x1", b"k", "test"), RawRecord(b"x2", b"k", "test")]
    ev = [r for r in records if isinstance(r, Event)][:3]
    early, mid, late = sorted(ev, key=lambda e: e.event_time_ms)
    assert in_time_order([raw[0], late, raw[1], early, mid]) == [raw[0], early, mid, late, raw[1]]

    ordered = in_time_order(records)
    assert sorted(map(id, ordered)) == sorted(map(id, records)), "every record once"
    times = [r.event_time_ms for r in ordered if isinstance(r, Event)]
    assert times == sorted(times)
    where = [i for i, r in enumerate(ordered) if isinstance(r, RawRecord)]
    assert where and where[0] < len(ordered) // 2, "bad records are spread through the stream, not all at its end"


def test_a_wall_clock_stream_stamps_each_slice_with_its_start_and_keeps_the_order(records, monkeypatch):
    import ingest.generate as generate
    import ingest.replay

    slices, clock = [], iter([1_000, 2_000, 3_000])
    monkeypatch.setattr(ingest.replay, "replay", lambda chunk, **kw: slices.append(chunk))
    monkeypatch.setattr(generate, "_now_ms", lambda: next(clock))
    monkeypatch.setattr(generate.time, "sleep", lambda s: None)
    head = generate.in_time_order(records)[:250]
    produced = generate.stream_records(head, bootstrap="unused:1", topic="t", partitions=1, rate_per_s=100,
                                       wall_clock=True)
    assert produced == 250 and [len(c) for c in slices] == [100, 100, 50]
    for stamp, chunk, original in zip((1_000, 2_000, 3_000), slices, (head[:100], head[100:200], head[200:])):
        assert [getattr(r, "event_time_ms", None) for r in chunk] == [
            stamp if isinstance(r, Event) else None for r in original]
        assert [r.event_id if isinstance(r, Event) else r for r in chunk] == [
            r.event_id if isinstance(r, Event) else r for r in original], "same records, same order"


def test_wire_bytes_and_stamps_match_the_dataclasses_reference(records):
    """Event.to_json and stamped (the generator's fast path) against dataclasses.asdict / dataclasses.replace."""
    events = _events(records)
    full = Event(event_id="e", event_time_ms=1, user_id="u", item_id="i", domain="feed", event_type="click",
                 category="c", position=2, ad_format="video", age=30, gender="f", location="x")
    for event in [*events, full]:
        assert event.to_json() == json.dumps(dataclasses.asdict(event), separators=(",", ":")).encode()
    now_ms = 1_800_000_000_123
    out = stamped(records, now_ms)
    assert len(out) == len(records)
    for before, after in zip(records, out, strict=True):
        if isinstance(before, Event):
            assert after == dataclasses.replace(before, event_time_ms=now_ms) and type(after) is Event
            assert before.event_time_ms != now_ms  # the input is not changed
        else:
            assert after is before
