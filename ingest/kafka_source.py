"""A bounded Kafka source for Beam's Python SDK: plan one snapshot of offset ranges, then read them.

Beam's ``ReadFromKafka`` is a Java cross-language transform (it needs a JVM expansion service),
so the ingest job reads Kafka itself, in two steps:

1. :func:`plan_snapshot` (on the driver) fixes, per partition, the half-open range
   ``[start, end)`` where ``start`` comes from the lake (the last committed end offset) and
   ``end`` is the partition's high watermark seen now. Fixing the ends up front makes the read
   bounded and repeatable: the same ranges always yield the same records.
2. :class:`ReadOffsetRanges` (in the pipeline) reads each range with a consumer that is
   ``assign``-ed to the start offset and never commits to a consumer group: the lake, not
   Kafka, is the source of truth for what has been consumed.

Both clients go through the small :class:`KafkaClient` interface: confluent-kafka (librdkafka;
the default, much faster) or kafka-python (pure Python).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

import apache_beam as beam
from tqdm import tqdm

ClientName = Literal["confluent", "kafka-python"]


@dataclass(frozen=True)
class OffsetRange:
    """Offsets ``[start, end)`` of one topic partition; ``end`` is exclusive.

    Raises:
        ValueError: a negative partition or offset, or ``end < start``.
    """

    topic: str
    partition: int
    start: int
    end: int

    def __post_init__(self) -> None:
        if self.partition < 0 or self.start < 0:
            raise ValueError(f"OffsetRange: expected partition >= 0 and start >= 0, got {self}")
        if self.end < self.start:
            raise ValueError(f"OffsetRange: expected end >= start, got start={self.start} end={self.end}")

    @property
    def num_offsets(self) -> int:
        """Number of offsets in the range (records, unless the log has gaps from compaction)."""
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form, as stored in commit metadata."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "OffsetRange":
        """Inverse of :meth:`to_dict`."""
        return cls(topic=str(data["topic"]), partition=int(data["partition"]), start=int(data["start"]),
                   end=int(data["end"]))


@dataclass(frozen=True)
class KafkaRecord:
    """One Kafka message as read.

    ``timestamp_ms`` is the record timestamp (ms since epoch UTC; log-append or create time as the
    topic is configured), -1 when the broker gives none.
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    timestamp_ms: int


class KafkaClient(Protocol):
    """What the source needs from a Kafka client library."""

    def end_offsets(self, topic: str) -> dict[int, tuple[int, int]]:
        """Per partition, (low watermark, high watermark) seen now.

        Raises:
            ValueError: the topic does not exist.
        """
        ...

    def read_range(self, rng: OffsetRange) -> Iterator[KafkaRecord]:
        """The records with offsets in ``[rng.start, rng.end)``, in offset order."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


def _check_progress(rng: OffsetRange, next_offset: int, deadline: float) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(
            f"{rng.topic}[{rng.partition}]: no record at offset >= {next_offset} within the read "
            f"timeout while reading [{rng.start}, {rng.end}); is the broker up and the range planned "
            "from this cluster?"
        )


class ConfluentClient:
    """:class:`KafkaClient` over confluent-kafka (librdkafka).

    A consumer needs a ``group.id`` in librdkafka, but it is only a name here: partitions are
    ``assign``-ed, auto commit is off and nothing is ever committed.
    """

    def __init__(self, bootstrap: str, *, timeout_s: float = 30.0) -> None:
        from confluent_kafka import Consumer

        self._timeout_s = timeout_s
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": "gemline-ingest-reader",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "enable.partition.eof": False,
                "auto.offset.reset": "error",
            }
        )

    def end_offsets(self, topic: str) -> dict[int, tuple[int, int]]:
        from confluent_kafka import TopicPartition

        meta = self._consumer.list_topics(topic, timeout=self._timeout_s).topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            raise ValueError(f"topic {topic!r} not found on the cluster ({meta and meta.error}); create it first")
        return {
            p: self._consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=self._timeout_s, cached=False)
            for p in sorted(meta.partitions)
        }

    def read_range(self, rng: OffsetRange) -> Iterator[KafkaRecord]:
        from confluent_kafka import TopicPartition

        if rng.num_offsets == 0:
            return
        self._consumer.assign([TopicPartition(rng.topic, rng.partition, rng.start)])
        try:
            next_offset = rng.start
            deadline = time.monotonic() + self._timeout_s
            while next_offset < rng.end:
                msgs = self._consumer.consume(num_messages=min(10_000, rng.end - next_offset), timeout=0.5)
                if not msgs:
                    _check_progress(rng, next_offset, deadline)
                    continue
                deadline = time.monotonic() + self._timeout_s
                for msg in msgs:
                    if msg.error() is not None:
                        raise RuntimeError(f"{rng.topic}[{rng.partition}]: Kafka error {msg.error()}")
                    # Guards against a message still queued from an earlier assignment or a re-fetch.
                    if msg.topic() != rng.topic or msg.partition() != rng.partition or msg.offset() < next_offset:
                        continue
                    if msg.offset() >= rng.end:
                        next_offset = rng.end
                        break
                    next_offset = msg.offset() + 1
                    _, ts = msg.timestamp()
                    yield KafkaRecord(rng.topic, rng.partition, msg.offset(), msg.key(), msg.value() or b"", ts)
        finally:
            self._consumer.unassign()

    def close(self) -> None:
        self._consumer.close()


class KafkaPythonClient:
    """:class:`KafkaClient` over kafka-python (no consumer group: ``group_id=None``)."""

    def __init__(self, bootstrap: str, *, timeout_s: float = 30.0) -> None:
        from kafka import KafkaConsumer

        self._timeout_s = timeout_s
        self._consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                       request_timeout_ms=int(timeout_s * 1000) + 1000)

    def end_offsets(self, topic: str) -> dict[int, tuple[int, int]]:
        from kafka import TopicPartition

        parts = self._consumer.partitions_for_topic(topic)
        if not parts:
            raise ValueError(f"topic {topic!r} not found on the cluster; create it first")
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        timeout_ms = int(self._timeout_s * 1000)
        low = self._consumer.beginning_offsets(tps, timeout_ms=timeout_ms)
        high = self._consumer.end_offsets(tps, timeout_ms=timeout_ms)
        return {tp.partition: (low[tp], high[tp]) for tp in tps}

    def read_range(self, rng: OffsetRange) -> Iterator[KafkaRecord]:
        from kafka import TopicPartition

        if rng.num_offsets == 0:
            return
        tp = TopicPartition(rng.topic, rng.partition)
        self._consumer.assign([tp])
        self._consumer.seek(tp, rng.start)
        try:
            next_offset = rng.start
            deadline = time.monotonic() + self._timeout_s
            while next_offset < rng.end:
                batch = self._consumer.poll(timeout_ms=500, max_records=min(10_000, rng.end - next_offset))
                records = batch.get(tp, [])
                if not records:
                    _check_progress(rng, next_offset, deadline)
                    continue
                deadline = time.monotonic() + self._timeout_s
                for r in records:
                    if r.offset < next_offset:
                        continue
                    if r.offset >= rng.end:
                        next_offset = rng.end
                        break
                    next_offset = r.offset + 1
                    yield KafkaRecord(rng.topic, rng.partition, r.offset, r.key, r.value or b"", r.timestamp)
        finally:
            self._consumer.unsubscribe()

    def close(self) -> None:
        self._consumer.close()


def make_client(client: ClientName, bootstrap: str, *, timeout_s: float = 30.0) -> KafkaClient:
    """The :class:`KafkaClient` implementation named by ``KafkaConfig.client``.

    Raises:
        ValueError: an unknown client name.
    """
    if client == "confluent":
        return ConfluentClient(bootstrap, timeout_s=timeout_s)
    if client == "kafka-python":
        return KafkaPythonClient(bootstrap, timeout_s=timeout_s)
    raise ValueError(f"kafka client: expected 'confluent' or 'kafka-python', got {client!r}")


def plan_snapshot(
    bootstrap: str,
    topic: str,
    start_offsets: dict[int, int],
    *,
    client: ClientName = "confluent",
    timeout_s: float = 30.0,
) -> list[OffsetRange]:
    """One bounded snapshot: per partition of ``topic``, ``[start_offsets[p], high watermark)``.

    A partition absent from ``start_offsets`` was never ingested and starts at its low watermark
    (0 unless retention already deleted its head, which then was never ours to read).

    Returns:
        One OffsetRange per partition, sorted by partition; empty ranges included.

    Raises:
        ValueError: the topic does not exist; a start offset lies past the high watermark (the
            topic was recreated or the lake belongs to another cluster) or below the low watermark
            (retention deleted records that were never ingested). Either way the lake and the
            topic disagree: a person must decide (reset the lake or move the offsets).
    """
    kc = make_client(client, bootstrap, timeout_s=timeout_s)
    try:
        watermarks = kc.end_offsets(topic)
    finally:
        kc.close()
    unknown = sorted(set(start_offsets) - set(watermarks))
    if unknown:
        raise ValueError(f"topic {topic!r}: lake has offsets for partitions {unknown} the topic lacks "
                         f"(has {sorted(watermarks)}); was the topic recreated?")
    ranges = []
    for partition, (low, high) in watermarks.items():
        start = start_offsets.get(partition, low)
        if start > high:
            raise ValueError(f"{topic}[{partition}]: committed offset {start} is past the high watermark {high}; "
                             "was the topic recreated? Reset the lake or the offsets.")
        if start < low:
            raise ValueError(f"{topic}[{partition}]: next offset {start} is below the low watermark {low}: "
                             f"records [{start}, {low}) were deleted before ingest.")
        ranges.append(OffsetRange(topic, partition, start, high))
    return ranges


class _ReadRangeFn(beam.DoFn):
    """Reads one OffsetRange per element; one client per DoFn instance."""

    def __init__(self, client: ClientName, bootstrap: str, timeout_s: float) -> None:
        self._client_name = client
        self._bootstrap = bootstrap
        self._timeout_s = timeout_s
        self._client: KafkaClient | None = None

    def setup(self) -> None:
        self._client = make_client(self._client_name, self._bootstrap, timeout_s=self._timeout_s)

    def process(self, rng: OffsetRange) -> Iterator[KafkaRecord]:
        assert self._client is not None, "setup() not called"
        desc = f"read {rng.topic}[{rng.partition}]"
        yield from tqdm(self._client.read_range(rng), total=rng.num_offsets, desc=desc, unit="rec",
                        leave=False, disable=None)

    def teardown(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class ReadOffsetRanges(beam.PTransform):
    """PCollection[OffsetRange] -> PCollection[KafkaRecord], every offset of every range once.

    A Reshuffle follows the read so that parsing is spread across workers (one range is one
    element, so without it a partition's records would stay in one bundle) and a downstream
    retry replays the checkpointed records instead of re-reading Kafka.
    """

    def __init__(self, *, bootstrap: str, client: ClientName = "confluent", timeout_s: float = 30.0) -> None:
        super().__init__()
        self._bootstrap = bootstrap
        self._client = client
        self._timeout_s = timeout_s

    def expand(self, ranges: beam.PCollection) -> beam.PCollection:
        return (
            ranges
            | "ReadRange" >> beam.ParDo(_ReadRangeFn(self._client, self._bootstrap, self._timeout_s))
            | "Reshuffle" >> beam.Reshuffle()
        )
