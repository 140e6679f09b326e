"""The splittable Kafka source: restrictions, watermarks, splits, unbounded reads, codecs, clients."""

from __future__ import annotations

import itertools

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pytest
from apache_beam.io.restriction_trackers import OffsetRange as BeamOffsetRange
from apache_beam.io.restriction_trackers import OffsetRestrictionTracker
from apache_beam.testing import test_pipeline  # module import: pytest would try to collect class TestPipeline
from apache_beam.testing.util import assert_that, equal_to
from apache_beam.utils.timestamp import MIN_TIMESTAMP, Duration, Timestamp
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.broker import EmbeddedBroker
from ingest.kafka_source import (
    CODECS,
    UNBOUNDED_END,
    KafkaRecord,
    KafkaRestrictionProvider,
    OffsetRange,
    PartitionStart,
    PartitionWatermarkEstimator,
    PollSettings,
    ReadFromKafkaPartitions,
    ReadOffsetRanges,
    ReadPartitionFn,
    WatermarkState,
    advance_watermark,
    batches_of,
    claim_batch,
    make_client,
    records_to_batch,
    missing_codecs,
    plan_snapshot,
)

_topic_ids = itertools.count()


# ---- pure parts -----------------------------------------------------------------------------

WM_CASES = [
    # (state, record timestamps, now_ms, idle_timeout_ms, max_out_of_order_ms, expected)
    (WatermarkState(None, None), [5, 9, 7], 100, 50, 0, WatermarkState(9, 100)),
    (WatermarkState(None, None), [5, 9, 7], 100, 50, 4, WatermarkState(5, 100)),
    (WatermarkState(20, 90), [5, 9], 100, 50, 0, WatermarkState(20, 100)),  # never goes back
    (WatermarkState(20, 90), [-1], 100, 50, 0, WatermarkState(20, 100)),  # "no timestamp" records
    (WatermarkState(None, None), [], 100, 50, 0, WatermarkState(None, 100)),  # first poll starts the idle clock
    (WatermarkState(20, 90), [], 139, 50, 0, WatermarkState(20, 90)),  # idle 49 ms < 50: holds
    (WatermarkState(20, 90), [], 140, 50, 0, WatermarkState(140, 90)),  # idle 50 ms: moves to the wall clock
    (WatermarkState(20, 90), [], 140, 50, 30, WatermarkState(110, 90)),
    (WatermarkState(500, 90), [], 140, 50, 0, WatermarkState(500, 90)),  # wall clock behind: keeps 500
]


@pytest.mark.parametrize(("state", "ts", "now", "idle", "ooo", "expected"), WM_CASES)
def test_advance_watermark_hand_checked(state, ts, now, idle, ooo, expected):
    assert advance_watermark(state, ts, now, idle_timeout_ms=idle, max_out_of_order_ms=ooo) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(-1, 10**6), max_size=5), st.integers(0, 10**4)), max_size=20),
       st.integers(0, 500), st.integers(0, 100))
def test_watermark_is_monotone_and_never_passes_a_record(polls, idle, ooo):
    state, now = WatermarkState(None, None), 0
    for ts, step in polls:
        now += step
        new = advance_watermark(state, ts, now, idle_timeout_ms=idle, max_out_of_order_ms=ooo)
        if state.watermark_ms is not None:
            assert new.watermark_ms >= state.watermark_ms
        valid = [t for t in ts if t >= 0]
        if valid and (state.watermark_ms is None or state.watermark_ms <= max(valid) - ooo):
            assert new.watermark_ms == max(valid) - ooo  # the newest record minus the bound, not past it
        state = new


def test_advance_watermark_rejects_negative_bounds():
    with pytest.raises(ValueError, match="expected idle_timeout_ms >= 0"):
        advance_watermark(WatermarkState(None, None), [], 0, idle_timeout_ms=-1, max_out_of_order_ms=0)


def test_estimator_reports_state_as_beam_timestamps():
    est = PartitionWatermarkEstimator(WatermarkState(None, None))
    assert est.current_watermark() == MIN_TIMESTAMP
    est.set_state(WatermarkState(1_750_000_000_123, 5))
    assert est.current_watermark() == Timestamp(micros=1_750_000_000_123_000)
    assert est.get_estimator_state() == WatermarkState(1_750_000_000_123, 5)


def test_restrictions_bounded_and_unbounded():
    prov = KafkaRestrictionProvider()
    bounded = prov.initial_restriction(OffsetRange("t", 0, 3, 8))
    assert (bounded.start, bounded.stop) == (3, 8) and prov.create_tracker(bounded).is_bounded()
    unbounded = prov.initial_restriction(PartitionStart("t", 1, 4))
    assert (unbounded.start, unbounded.stop) == (4, UNBOUNDED_END)
    assert not prov.create_tracker(unbounded).is_bounded()
    assert prov.truncate(None, unbounded) is None and prov.truncate(None, bounded) is bounded
    with pytest.raises(TypeError, match="expected OffsetRange or PartitionStart elements, got tuple"):
        prov.initial_restriction(("t", 0, 3))


BAD_SETTINGS = [
    ({"poll_timeout_s": -1}, "poll_timeout_s: expected >= 0"),
    ({"max_records_per_poll": 0}, "max_records_per_poll: expected >= 1"),
    ({"finish_when_idle_s": 0}, "finish_when_idle_s: expected > 0 or None"),
    ({"idle_timeout_s": float("nan")}, "idle_timeout_s: expected >= 0"),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD_SETTINGS)
def test_poll_settings_reject_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PollSettings(**kwargs)


def test_partition_start_validates():
    with pytest.raises(ValueError, match="expected partition >= 0 and start >= 0"):
        PartitionStart("t", 0, -3)


class _ListClient:
    """A KafkaClient over an in-memory partition log (offset -> value), gaps allowed."""

    def __init__(self, log: dict[int, bytes]):
        self.log = log

    def read_range(self, rng):
        for off in sorted(self.log):
            if rng.start <= off < rng.end:
                yield KafkaRecord(rng.topic, rng.partition, off, None, self.log[off], 1000 + off)

    def read_batches(self, rng, *, max_records):
        return batches_of(self.read_range(rng), max_records)

    def close(self):
        pass


def _bounded_fn(log):
    fn = ReadPartitionFn("confluent", "unused:1", 1.0)
    fn._client = _ListClient(log)  # setup() would connect to a broker
    return fn


def test_bounded_read_stops_at_a_dynamic_split():
    fn = _bounded_fn({o: f"v{o}".encode() for o in range(10)})
    tracker = OffsetRestrictionTracker(BeamOffsetRange(2, 10))
    out = []
    for rec in fn._read_bounded(OffsetRange("t", 0, 2, 10), tracker):
        out.append(rec.offset)
        if rec.offset == 4:
            primary, residual = tracker.try_split(0.5)  # the runner hands [7, 10) to another worker
            assert (primary.stop, residual.start, residual.stop) == (7, 7, 10)
    assert out == [2, 3, 4, 5, 6]
    tracker.check_done()


def test_bounded_read_with_a_gap_at_the_end_is_done():
    fn = _bounded_fn({0: b"a", 1: b"b", 4: b"c"})  # offsets 5..7 compacted away
    tracker = OffsetRestrictionTracker(BeamOffsetRange(0, 8))
    assert [r.offset for r in fn._read_bounded(OffsetRange("t", 0, 0, 8), tracker)] == [0, 1, 4]
    tracker.check_done()


CLAIM_CASES = [
    # (restriction, split fraction applied before the claim or None, batch offsets, expected n, restriction after)
    ((0, 10), None, [0, 1, 2, 3], 4, (0, 10)),
    ((0, 10), None, [6, 7, 9], 3, (0, 10)),  # a gap before the stop
    ((0, 4), None, [2, 3, 4, 5], 2, (0, 4)),  # the batch runs past the stop
    ((0, 8), None, [5, 6, 9], 2, (0, 8)),  # past the stop with a gap: still done
    ((0, 4), None, [4, 5], 0, (0, 4)),  # nothing of the batch is ours
]


@pytest.mark.parametrize(("rest", "split", "offsets", "n", "after"), CLAIM_CASES)
def test_claim_batch_hand_checked(rest, split, offsets, n, after):
    tracker = OffsetRestrictionTracker(BeamOffsetRange(*rest))
    assert claim_batch(tracker, np.array(offsets, dtype=np.int64)) == n
    assert (tracker.current_restriction().start, tracker.current_restriction().stop) == after
    if n < len(offsets) or offsets[-1] >= after[1] - 1:
        tracker.check_done()


class _SplitOnRead(OffsetRestrictionTracker):
    """Simulates the runner splitting right after claim_batch read the stop (a race on another thread)."""

    def __init__(self, rest, fraction):
        super().__init__(rest)
        self._fraction = fraction

    def current_restriction(self):
        rest = super().current_restriction()
        if self._fraction is not None:
            fraction, self._fraction = self._fraction, None
            primary, residual = self.try_split(fraction)  # split point: start - 1 + int(101 * fraction)
            assert (primary.stop, residual.start) == (2, 2)
        return rest


def test_claim_batch_keeps_its_part_when_a_split_races_the_claim():
    tracker = _SplitOnRead(BeamOffsetRange(0, 100), fraction=0.03)
    # claim_batch read stop 100, claims 9 and fails: [0, 2) stays ours, [2, 100) is the residual
    assert claim_batch(tracker, np.arange(0, 10, dtype=np.int64)) == 2
    tracker.check_done()


@given(st.integers(0, 50), st.integers(0, 60), st.sets(st.integers(0, 80), max_size=40), st.integers(1, 7))
@settings(max_examples=60, deadline=None)
def test_batched_bounded_read_equals_the_per_record_read(start, length, log_offsets, batch_records):
    """Batches (with any split the runner makes half way) cover exactly the per-record read's offsets."""
    log = {o: f"v{o}".encode() for o in log_offsets}
    rng = OffsetRange("t", 0, start, start + length)
    per_record = [r.offset for r in _bounded_fn(log)._read_bounded(rng, OffsetRestrictionTracker(
        BeamOffsetRange(rng.start, rng.end)))]
    fn = ReadPartitionFn("confluent", "unused:1", 1.0, batch_records=batch_records)
    fn._client = _ListClient(log)
    tracker = OffsetRestrictionTracker(BeamOffsetRange(rng.start, rng.end))
    batches = list(fn._read_bounded_batches(rng, tracker))
    tracker.check_done()
    got = [o for b in batches for o in b.column("offset").to_pylist()]
    assert got == per_record
    assert all(1 <= b.num_rows <= batch_records for b in batches)
    assert all(b.column("value").to_pylist() == [log[o] for o in b.column("offset").to_pylist()] for b in batches)


def test_batched_bounded_read_stops_at_a_dynamic_split():
    fn = ReadPartitionFn("confluent", "unused:1", 1.0, batch_records=3)
    fn._client = _ListClient({o: f"v{o}".encode() for o in range(12)})
    tracker = OffsetRestrictionTracker(BeamOffsetRange(0, 12))
    out = []
    for batch in fn._read_bounded_batches(OffsetRange("t", 0, 0, 12), tracker):
        out.append(batch.column("offset").to_pylist())
        if len(out) == 1:
            primary, residual = tracker.try_split(0.45)  # after claiming 2: stop = 2 + int(9 * 0.45) = 6
            assert (primary.stop, residual.start) == (6, 6)
    assert out == [[0, 1, 2], [3, 4, 5]]
    tracker.check_done()


def test_batch_records_must_be_positive():
    with pytest.raises(ValueError, match="expected batch_records >= 1 or None, got 0"):
        ReadPartitionFn("confluent", "unused:1", 1.0, batch_records=0)
    with pytest.raises(ValueError, match="expected max_records >= 1, got 0"):
        list(batches_of(iter([]), 0))


def test_missing_codecs():
    assert missing_codecs("confluent") == ()
    from kafka import codec

    expected = tuple(c for c, ok in zip(CODECS, (codec.has_gzip(), codec.has_snappy(), codec.has_lz4(),
                                                   codec.has_zstd())) if not ok)
    assert missing_codecs("kafka-python") == expected
    with pytest.raises(ValueError, match="expected 'confluent' or 'kafka-python', got 'rdkafka'"):
        missing_codecs("rdkafka")


# ---- against the embedded broker ------------------------------------------------------------

@pytest.fixture(scope="module")
def broker():
    with EmbeddedBroker() as b:
        yield b


def _topic(broker, partitions: int) -> str:
    name = f"src-{next(_topic_ids)}"
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for fut in admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)]).values():
        fut.result(timeout=30)
    return name


def _produce(bootstrap, topic, n, *, partitions, compression="none"):
    producer = Producer({"bootstrap.servers": bootstrap, "batch.num.messages": 1, "linger.ms": 0,
                         "compression.type": compression})
    for i in range(n):
        producer.produce(topic, key=f"k{i}".encode(), value=f"value-{i}-".encode() * 8, partition=i % partitions,
                         timestamp=1_000 + i)
    assert producer.flush(30) == 0
    # partition p holds messages p, p+P, p+2P, ... at offsets 0, 1, 2, ...
    return [KafkaRecord(topic, i % partitions, i // partitions, f"k{i}".encode(), f"value-{i}-".encode() * 8,
                        1_000 + i) for i in range(n)]


@pytest.mark.integration
def test_unbounded_read_emits_every_record_once_at_its_kafka_time(broker):
    topic = _topic(broker, 2)
    records = _produce(broker.bootstrap, topic, 9, partitions=2)
    starts = [PartitionStart(topic, 0, 0), PartitionStart(topic, 1, 2)]
    expected = [(r.partition, r.offset, r.value, r.timestamp_ms) for r in records
                if r.partition == 0 or r.offset >= 2]
    poll = PollSettings(poll_timeout_s=0.2, resume_delay_s=0.05, finish_when_idle_s=2.0)
    with test_pipeline.TestPipeline() as p:
        out = (
            p
            | beam.Create(starts)
            | ReadFromKafkaPartitions(bootstrap=broker.bootstrap, poll=poll)
            | beam.Map(lambda r, ts=beam.DoFn.TimestampParam: (r.partition, r.offset, r.value, ts.micros // 1000))
        )
        assert_that(out, equal_to(expected))


@pytest.mark.integration
@pytest.mark.parametrize("codec", CODECS)
def test_compressed_topics_read_back_with_both_clients(broker, codec):
    topic = _topic(broker, 2)
    records = _produce(broker.bootstrap, topic, 8, partitions=2, compression=codec)
    ranges = plan_snapshot(broker.bootstrap, topic, {}, client="confluent", timeout_s=20)
    assert [r.num_offsets for r in ranges] == [4, 4]
    with test_pipeline.TestPipeline() as p:
        out = p | beam.Create(ranges) | ReadOffsetRanges(bootstrap=broker.bootstrap, client="confluent", timeout_s=20)
        assert_that(out, equal_to(records))

    if codec in missing_codecs("kafka-python"):
        # Fails at start, naming the codec, instead of timing out or reading nothing.
        with pytest.raises(ValueError, match=f"codecs missing here: .*{codec} \\(pip install"):
            plan_snapshot(broker.bootstrap, topic, {}, client="kafka-python", timeout_s=20)
        return
    assert plan_snapshot(broker.bootstrap, topic, {}, client="kafka-python", timeout_s=20) == ranges
    kc = make_client("kafka-python", broker.bootstrap, timeout_s=20)
    try:
        got = [rec for rng in ranges for rec in kc.read_range(rng)]
    finally:
        kc.close()
    assert sorted(got, key=lambda r: (r.partition, r.offset)) == sorted(records, key=lambda r: (r.partition, r.offset))


@pytest.mark.integration
@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_read_batches_equals_read_range_in_batches(broker, client):
    topic = _topic(broker, 2)
    records = _produce(broker.bootstrap, topic, 11, partitions=2)
    kc = make_client(client, broker.bootstrap, timeout_s=20)
    try:
        rng = OffsetRange(topic, 0, 1, 6)  # partition 0 holds offsets 0..5
        batches = list(kc.read_batches(rng, max_records=2))
        assert list(kc.read_batches(OffsetRange(topic, 1, 3, 3), max_records=2)) == []
    finally:
        kc.close()
    expected = [r for r in records if r.partition == 0 and 1 <= r.offset < 6]
    assert [b.num_rows for b in batches] == [2, 2, 1]
    assert pa.Table.from_batches(batches).equals(pa.Table.from_batches([records_to_batch(expected)]))


@pytest.mark.integration
@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_fetch_polls_forward_and_returns_empty_at_the_end(broker, client):
    topic = _topic(broker, 1)
    records = _produce(broker.bootstrap, topic, 5, partitions=1)
    kc = make_client(client, broker.bootstrap, timeout_s=20)
    try:
        got: list[KafkaRecord] = []
        for _ in range(50):  # bounded number of polls, no wall-clock condition
            batch = kc.fetch(topic, 0, len(got) + 1, max_records=2, timeout_s=0.5)
            got.extend(batch)
            if len(got) == 4:
                break
        assert got == records[1:]
        assert kc.fetch(topic, 0, 5, max_records=2, timeout_s=0.3) == []
    finally:
        kc.close()


class _ScriptedPoller:
    """A KafkaClient whose fetches return scripted batches (one list per poll)."""

    def __init__(self, batches: list[list[int]]):
        self.batches = batches
        self.fetched_from: list[int] = []

    def fetch(self, topic, partition, offset, *, max_records, timeout_s):
        self.fetched_from.append(offset)
        offsets = self.batches.pop(0) if self.batches else []
        return [KafkaRecord(topic, partition, o, None, b"v", 1_000 * o) for o in offsets]

    def close(self):
        pass


def test_unbounded_polls_defer_and_advance_the_watermark_then_release_an_idle_partition():
    from apache_beam.runners.sdf_utils import RestrictionTrackerView, ThreadsafeRestrictionTracker

    wall_s = iter([100.0, 101.0, 102.0, 140.0, 200.0])  # the wall clock at each poll
    poll = PollSettings(idle_timeout_s=30, resume_delay_s=0.5)
    fn = ReadPartitionFn("confluent", "unused:1", 1.0, poll, clock=lambda: next(wall_s))
    fn._client = object()  # not used by polls
    poller = _ScriptedPoller([[5, 6, 7], [], [8], [], []])
    fn._pollers = {("t", 0): poller}
    estimator = PartitionWatermarkEstimator(WatermarkState(None, None))
    element, start = PartitionStart("t", 0, 5), 5
    seen = []
    delays = []

    class _View(RestrictionTrackerView):
        def defer_remainder(self, deferred_time=None):
            delays.append(deferred_time)
            super().defer_remainder(deferred_time)

    for expected_wm_ms, expected_delay_s in [(7_000, 0), (7_000, 0.5), (8_000, 0), (140_000, 0.5), (200_000, 0.5)]:
        tracker = ThreadsafeRestrictionTracker(OffsetRestrictionTracker(BeamOffsetRange(start, UNBOUNDED_END)))
        out = list(fn.process(element, _View(tracker), estimator))
        seen += [(v.value.offset, v.timestamp.micros // 1000) for v in out]
        assert estimator.current_watermark() == Timestamp(micros=expected_wm_ms * 1000)
        assert delays.pop() == Duration.of(expected_delay_s)
        residual, _ = tracker.deferred_status()
        start = residual.start  # the runner resumes the residual [next offset, inf)
    assert seen == [(5, 5_000), (6, 6_000), (7, 7_000), (8, 8_000)]
    assert poller.fetched_from == [5, 8, 8, 9, 9]
    # Idle from 102 s (last data) to 140 s: 38 s >= 30 s, so at the 4th poll the partition stopped
    # holding the watermark (moved to the wall clock, 140 s), and again at the 5th (200 s).


def test_gc_paused_restores_the_collector_state_even_after_an_error():
    import gc

    from ingest.kafka_clients import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"):
        with gc_paused():
            raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled(), "a collector the caller disabled stays disabled"
    finally:
        gc.enable()


class _Msg:
    """The accessors of a confluent_kafka.Message that the reader uses."""

    def __init__(self, partition, offset, topic="t", error=None):
        self._p, self._o, self._t, self._e = partition, offset, topic, error

    def error(self):
        return self._e

    def offset(self):
        return self._o

    def partition(self):
        return self._p

    def topic(self):
        return self._t

    def key(self):
        return None if self._o % 2 else b"k%d" % self._o

    def value(self):
        return None if self._o == 13 else b"v%d" % self._o

    def timestamp(self):
        return (1, 1000 + self._o)


@pytest.mark.parametrize(("chunk", "start", "taken", "next_offset"), [
    ([(0, o) for o in range(10, 15)], 10, [10, 11, 12, 13, 14], 15),  # the usual chunk: every message
    ([(0, 8), (0, 9), (0, 10), (0, 11)], 10, [10, 11], 12),  # re-fetched offsets before the position
    ([(1, 10), (0, 10), (0, 11)], 10, [10, 11], 12),  # a message of another partition still queued
    ([(0, 18), (0, 19), (0, 20), (0, 21)], 18, [18, 19], 20),  # the range ends inside the chunk
    ([(0, 10), (0, 12)], 10, [10, 12], 13),  # an offset gap (compaction, transaction markers)
    ([], 10, [], 10),
])
def test_take_columns_keeps_exactly_the_messages_of_the_range(chunk, start, taken, next_offset):
    from ingest.kafka_clients import _take_columns

    cols = ([], [], [], [])
    got = _take_columns([_Msg(p, o) for p, o in chunk], OffsetRange("t", 0, 0, 20), start, *cols)
    assert got == next_offset
    assert cols == (taken, [None if o % 2 else b"k%d" % o for o in taken],
                    [None if o == 13 else b"v%d" % o for o in taken], [1000 + o for o in taken])  # 13: a tombstone


def test_take_columns_raises_on_a_kafka_error_and_checks_the_topic():
    from ingest.kafka_clients import _take_columns

    with pytest.raises(RuntimeError, match="Kafka error BROKER_DOWN"):
        _take_columns([_Msg(0, 1), _Msg(0, 2, error="BROKER_DOWN")], OffsetRange("t", 0, 0, 9), 0, [], [], [], [])
    cols = ([], [], [], [])
    assert _take_columns([_Msg(0, 1, topic="other"), _Msg(0, 2)], OffsetRange("t", 0, 0, 9), 0, *cols) == 3
    assert cols[0] == [2]


def test_rdkafka_log_lines_pass_once_per_kind():
    import logging

    from ingest.kafka_clients import _FirstOfEach

    keep = _FirstOfEach(every_s=60)

    def passes(level, text, at):
        record = logging.LogRecord("ingest.rdkafka", level, __file__, 1, text, None, None)
        record.created = at
        return keep.filter(record)

    assert passes(logging.ERROR, "FAIL Connect to ipv4#127.0.0.1:1 failed (after 0ms)", 100.0)
    assert not passes(logging.ERROR, "FAIL Connect to ipv4#127.0.0.1:1 failed (after 3ms)", 100.05)  # same kind
    assert passes(logging.WARNING, "FAIL Connect to ipv4#127.0.0.1:1 failed (after 0ms)", 100.1)  # another level
    assert passes(logging.ERROR, "SSL handshake failed", 100.2)
    assert not passes(logging.ERROR, "FAIL Connect to ipv4#127.0.0.1:1 failed (after 0ms)", 159.0)
    assert passes(logging.ERROR, "FAIL Connect to ipv4#127.0.0.1:1 failed (after 0ms)", 161.0)  # a minute on
