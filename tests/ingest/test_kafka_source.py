"""The splittable Kafka source: restrictions, batch claims, splits, codecs, clients."""

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
from confluent_kafka import Producer
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.broker import EmbeddedBroker
from ingest.kafka_source import (
    CODECS,
    KafkaRecord,
    KafkaRestrictionProvider,
    OffsetRange,
    ReadPartitionFn,
    batches_of,
    claim_batch,
    make_client,
    missing_codecs,
    plan_topic,
    records_to_batch,
)
from ingest.pipeline import ReadRecordBatches
from ingest.replay import ensure_topic

_topic_ids = itertools.count()


# ---- pure parts -----------------------------------------------------------------------------

def test_restrictions_are_the_offset_ranges():
    prov = KafkaRestrictionProvider()
    bounded = prov.initial_restriction(OffsetRange("t", 0, 3, 8))
    assert (bounded.start, bounded.stop) == (3, 8) and prov.create_tracker(bounded).is_bounded()
    assert prov.truncate(None, bounded) is bounded
    with pytest.raises(TypeError, match="expected OffsetRange elements, got tuple"):
        prov.initial_restriction(("t", 0, 3))


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


def _bounded_fn(log, batch_records=1):
    fn = ReadPartitionFn("confluent", "unused:1", 1.0, batch_records=batch_records)
    fn._client = _ListClient(log)  # setup() would connect to a broker
    return fn


def test_bounded_read_with_a_gap_at_the_end_is_done():
    fn = _bounded_fn({0: b"a", 1: b"b", 4: b"c"}, batch_records=2)  # offsets 5..7 compacted away
    tracker = OffsetRestrictionTracker(BeamOffsetRange(0, 8))
    batches = list(fn._read_bounded_batches(OffsetRange("t", 0, 0, 8), tracker))
    assert [b.column("offset").to_pylist() for b in batches] == [[0, 1], [4]]
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
def test_batched_bounded_read_yields_the_logs_offsets_in_the_range(start, length, log_offsets, batch_records):
    """Batches cover exactly the offsets of the range the log holds, in order, gaps allowed."""
    log = {o: f"v{o}".encode() for o in log_offsets}
    rng = OffsetRange("t", 0, start, start + length)
    per_record = [o for o in sorted(log) if rng.start <= o < rng.end]
    fn = _bounded_fn(log, batch_records)
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
    with pytest.raises(ValueError, match="expected batch_records >= 1, got 0"):
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
    ensure_topic(broker.bootstrap, name, partitions)
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
@pytest.mark.parametrize("codec", CODECS)
def test_compressed_topics_read_back_with_both_clients(broker, codec):
    topic = _topic(broker, 2)
    records = _produce(broker.bootstrap, topic, 8, partitions=2, compression=codec)
    ranges = plan_topic(broker.bootstrap, topic, {}, previous=None, client="confluent", timeout_s=20).ranges
    assert [r.num_offsets for r in ranges] == [4, 4]
    with test_pipeline.TestPipeline() as p:
        out = (p | beam.Create(ranges)
               | ReadRecordBatches(bootstrap=broker.bootstrap, client="confluent", timeout_s=20, max_records=3)
               | beam.FlatMap(lambda b: [KafkaRecord(**row) for row in b.to_pylist()]))
        assert_that(out, equal_to(records))

    if codec in missing_codecs("kafka-python"):
        # Fails at start, naming the codec, instead of timing out or reading nothing.
        with pytest.raises(ValueError, match=f"codecs missing here: .*{codec} \\(pip install"):
            plan_topic(broker.bootstrap, topic, {}, previous=None, client="kafka-python", timeout_s=20)
        return
    assert plan_topic(broker.bootstrap, topic, {}, previous=None, client="kafka-python", timeout_s=20).ranges == ranges
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
