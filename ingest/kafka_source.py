"""A Kafka source for Beam's Python SDK: a splittable DoFn over (topic, partition, offset range).

Beam's ``ReadFromKafka`` is a Java cross-language transform (it needs a JVM expansion service),
so gemline reads Kafka itself, at the pipeline edge only:

1. :func:`plan_topic` (on the driver) checks that the topic is the one the lake read and fixes,
   per partition, the half-open range ``[start, end)`` where ``start`` comes from the lake (the
   last committed end offset) and ``end`` is the end of the partition seen now. Fixing the ends up
   front makes the read bounded and repeatable: the same ranges always yield the same records.
2. :class:`ReadPartitionFn` (run by ``ingest.pipeline.ReadRecordBatches``) is a splittable DoFn
   (SDF) whose restriction is an element's offset range ``[start, end)``, claimed through Beam's
   ``OffsetRestrictionTracker`` one Arrow record batch at a time (:func:`claim_batch`). All
   progress lives in the restriction, which the runner checkpoints and may split, so the same
   code is correct on portable runners (no driver-side or global state).

Consumers are ``assign``-ed and never commit to a consumer group: the lake, not Kafka, is the
source of truth for what has been consumed.

Both clients go through the small :class:`KafkaClient` interface of ``ingest.kafka_clients``:
confluent-kafka (librdkafka; the default, much faster, every codec built in) or kafka-python (pure
Python; snappy, lz4 and zstd need extra Python modules, probed before a read starts:
:func:`missing_codecs`).

Source: Beam programming guide, "Splittable DoFns" (sections 12.1-12.3: restrictions, trackers,
dynamic splits); the Kafka fetch semantics of librdkafka /
kafka-python.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
import numpy as np
import pyarrow as pa
from apache_beam.io.restriction_trackers import OffsetRange as BeamOffsetRange
from apache_beam.io.restriction_trackers import OffsetRestrictionTracker
from apache_beam.transforms.core import RestrictionProvider
from tqdm import tqdm

from gemline.errors import GemlineError

# The clients and record types live in ingest.kafka_clients; they are importable from here too.
from ingest.kafka_clients import (  # noqa: F401
    CODECS,
    RECORDS_SCHEMA,
    ClientName,
    ConfluentClient,
    KafkaClient,
    KafkaPythonClient,
    KafkaRecord,
    OffsetRange,
    _check_progress,
    batches_of,
    make_client,
    missing_codecs,
    records_to_batch,
)

log = logging.getLogger(__name__)


def probe_ranges(kc: KafkaClient, ranges: list[OffsetRange], *, timeout_s: float) -> None:
    """Decode the first record of each non-empty range, so that a codec the client lacks fails
    the job before it starts instead of mid-pipeline (never "healthy, reading nothing").

    Raises:
        ValueError: a record batch uses a codec the client cannot decode (the message names it).
        TimeoutError: no record arrived within ``timeout_s`` for a range that should have one.
    """
    for rng in ranges:
        if rng.num_offsets == 0:
            continue
        deadline = time.monotonic() + timeout_s
        while not kc.fetch(rng.topic, rng.partition, rng.start, max_records=1, timeout_s=0.5):
            _check_progress(rng, rng.start, deadline)


class TopicChangedError(GemlineError, ValueError):
    """The topic is not the one the lake's offsets were committed from: recreated (another topic id,
    another record at a committed offset), its partition count changed, or its offsets went backwards.
    ``gemline ingest --reset-topic`` starts over on the new topic deliberately. Exit 2."""


@dataclass(frozen=True)
class Fingerprint:
    """What identifies one record of a partition: its offset, timestamp (ms) and a BLAKE2b digest of key and value."""

    offset: int
    timestamp_ms: int
    digest: str

    @classmethod
    def of(cls, rec: KafkaRecord) -> "Fingerprint":
        """The fingerprint of a record read whole (``value_size`` None)."""
        h = hashlib.blake2b(digest_size=16)
        for part in (rec.key, rec.value):
            h.update(b"-" if part is None else b"+%d:" % len(part) + part)
        return cls(rec.offset, rec.timestamp_ms, h.hexdigest())

    def to_dict(self) -> dict[str, Any]:
        """JSON form, as stored in commit metadata."""
        return {"offset": self.offset, "timestamp_ms": self.timestamp_ms, "digest": self.digest}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Fingerprint":
        """Inverse of :meth:`to_dict`."""
        return cls(int(data["offset"]), int(data["timestamp_ms"]), str(data["digest"]))


@dataclass(frozen=True)
class TopicIdentity:
    """The topic as of a committed snapshot: its id (None where the broker gives none), partition
    count, and per partition the fingerprint of the last record the snapshot read."""

    topic_id: str | None
    partitions: int
    last: dict[int, Fingerprint]

    def to_dict(self) -> dict[str, Any]:
        """JSON form, as stored in commit metadata."""
        return {"topic_id": self.topic_id, "partitions": self.partitions,
                "last": {str(p): f.to_dict() for p, f in sorted(self.last.items())}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TopicIdentity":
        """Inverse of :meth:`to_dict`."""
        return cls(data.get("topic_id"), int(data["partitions"]),
                   {int(p): Fingerprint.from_dict(f) for p, f in data.get("last", {}).items()})


@dataclass(frozen=True)
class Snapshot:
    """A planned bounded snapshot of a topic (:func:`plan_topic`).

    ``gaps`` maps a partition to ``[first, last)``: offsets retention deleted before they were ingested.
    """

    ranges: list[OffsetRange]
    identity: TopicIdentity
    gaps: dict[int, tuple[int, int]]


PROBE_TIMEOUT_S = 2.0
"""Seconds :func:`chunk_at` waits for the first record of a probe (a control record at the high
watermark - 1, e.g. a transaction marker, is never delivered: the probe then gives up)."""


def chunk_at(kc: KafkaClient, topic: str, partition: int, offset: int, *, timeout_s: float = PROBE_TIMEOUT_S,
             max_polls: int = 3) -> list[KafkaRecord]:
    """The records a fetch from ``offset`` delivers at once: the first record at or after ``offset``
    (waiting up to ``timeout_s``), then what is already there, in up to ``max_polls`` short polls.

    Kafka's log is stored in record batches and a fetch returns whole batches, so this reads to the
    end of the batch holding ``offset`` -- also past a high watermark that lags the last batch (the
    embedded broker reports the base offset of the last batch + 1).
    """
    deadline = time.monotonic() + timeout_s
    out: list[KafkaRecord] = []
    while not out and time.monotonic() < deadline:
        out = kc.fetch(topic, partition, offset, max_records=1, timeout_s=min(0.5, timeout_s))
    for _ in range(max_polls if out else 0):
        more = kc.fetch(topic, partition, out[-1].offset + 1, max_records=100_000, timeout_s=0.05)
        if not more:
            break
        out.extend(more)
    return out


def _verify(kc: KafkaClient, topic: str, previous: TopicIdentity, topic_id: str | None,
            watermarks: dict[int, tuple[int, int]], reset_hint: str) -> None:
    """Raise :class:`TopicChangedError` unless the topic is the one ``previous`` describes."""
    if previous.topic_id and topic_id and previous.topic_id != topic_id:
        raise TopicChangedError(f"topic {topic!r} was recreated: its id is {topic_id}, the lake's offsets are of "
                                f"{previous.topic_id}; {reset_hint}")
    if previous.partitions != len(watermarks):
        raise TopicChangedError(f"topic {topic!r} has {len(watermarks)} partitions, the lake's offsets are of "
                                f"{previous.partitions}; {reset_hint}")
    for partition, fp in sorted(previous.last.items()):
        low, high = watermarks[partition]
        if fp.offset < low:
            continue  # retention deleted it after it was ingested: nothing left to compare
        got = chunk_at(kc, topic, partition, fp.offset, max_polls=0)  # only its first record matters
        if not got or got[0].offset > fp.offset:
            if not got and high <= fp.offset:
                raise TopicChangedError(f"{topic}[{partition}]: offsets went backwards: the lake ingested up to "
                                        f"offset {fp.offset}, the partition now ends at {high}; {reset_hint}")
            log.warning("%s[%d]: the record at offset %d is gone (compaction?); topic identity not checked there",
                        topic, partition, fp.offset)
            continue
        if Fingerprint.of(got[0]) != fp:
            raise TopicChangedError(f"{topic}[{partition}]: the record at offset {fp.offset} is not the one ingested "
                                    f"(timestamp {got[0].timestamp_ms} vs {fp.timestamp_ms} ms, or another key/value): "
                                    f"the topic was recreated; {reset_hint}")


def plan_topic(
    bootstrap: str,
    topic: str,
    start_offsets: dict[int, int],
    *,
    previous: TopicIdentity | None,
    client: ClientName = "confluent",
    timeout_s: float = 30.0,
    max_offsets: int | None = None,
    fixed: list[OffsetRange] | None = None,
    reset_hint: str = "run `gemline ingest --reset-topic` to start over on the new topic",
) -> Snapshot:
    """Plan one bounded snapshot of ``topic``, after checking that it is the topic the lake read.

    Per partition, ``[start, end)``: ``start`` is ``start_offsets[p]`` (the low watermark for a
    partition never read; moved up to it, and the difference reported in ``gaps``, where retention
    deleted records before they were ingested); ``end`` is the high watermark, or past it to the
    end of the record batch holding the last record (:func:`chunk_at`: a broker whose high
    watermark lags its last batch would otherwise hold records back until more arrive), cut to
    ``max_offsets`` per partition. ``fixed`` (a crashed batch's recorded ranges) skips the planning
    and only checks the identity.

    Args:
        previous: the identity recorded with the last commit (None: nothing to check, e.g. a new lake
            or ``--reset-topic``).

    Returns:
        A :class:`Snapshot` whose identity holds the fingerprint of each range's last record.

    Raises:
        TopicChangedError: another topic id, partition count, a different record at a committed
            offset, or offsets that went backwards.
        ValueError: the topic does not exist.
        ConnectionError, TimeoutError: the cluster does not answer.
    """
    kc = make_client(client, bootstrap, timeout_s=timeout_s)
    try:
        watermarks = kc.end_offsets(topic)
        topic_id = kc.topic_id(topic)
        unknown = sorted(set(start_offsets) - set(watermarks))
        if unknown and previous is None:
            raise TopicChangedError(f"topic {topic!r}: lake has offsets for partitions {unknown} the topic lacks "
                                    f"(has {sorted(watermarks)}); was the topic recreated? {reset_hint}")
        if previous is not None:
            _verify(kc, topic, previous, topic_id, watermarks, reset_hint)
        last = dict(previous.last) if previous is not None else {}
        gaps: dict[int, tuple[int, int]] = {}
        ranges: list[OffsetRange] = []
        chunks: dict[int, list[KafkaRecord]] = {}
        if fixed is not None:
            ranges = list(fixed)
        for partition, (low, high) in ([] if fixed is not None else sorted(watermarks.items())):
            start = start_offsets.get(partition, low)
            if start < low:
                gaps[partition] = (start, low)
                log.warning("%s[%d]: records [%d, %d) were deleted by retention before they were ingested",
                            topic, partition, start, low)
                start = low
            end = high
            if max(high, start) > low:
                chunk = chunk_at(kc, topic, partition, max(high, start) - 1)
                chunks[partition] = chunk
                if chunk:
                    end = max(high, chunk[-1].offset + 1)
            if start > end:
                raise TopicChangedError(f"{topic}[{partition}]: committed offset {start} is past the end of the "
                                        f"partition {end}: the topic was recreated or the lake is another "
                                        f"cluster's; {reset_hint}")
            if max_offsets is not None:
                end = min(end, start + max_offsets)
            ranges.append(OffsetRange(topic, partition, start, end))
        for rng in ranges:
            if rng.num_offsets == 0:
                continue
            chunk = [r for r in chunks.get(rng.partition, []) if r.offset == rng.end - 1]
            got = chunk or chunk_at(kc, topic, rng.partition, rng.end - 1, timeout_s=timeout_s, max_polls=0)
            if got and got[0].offset < rng.end:
                last[rng.partition] = Fingerprint.of(got[0])
        if missing_codecs(client):
            probe_ranges(kc, ranges, timeout_s=timeout_s)
    finally:
        kc.close()
    return Snapshot(ranges, TopicIdentity(topic_id, len(watermarks), last), gaps)


# ---------------------------------------------------------------------------------------------
# The splittable DoFn
# ---------------------------------------------------------------------------------------------

class KafkaRestrictionProvider(RestrictionProvider):
    """Restrictions of :class:`ReadPartitionFn`: Beam ``OffsetRange(start, end)`` over Kafka offsets.

    An :class:`OffsetRange` element gives ``[start, end)``. The initial restriction is not split:
    one consumer reads one partition sequentially, and the runner can still split dynamically
    (``try_split``).

    Raises:
        TypeError: an element of another type.
    """

    def initial_restriction(self, element: OffsetRange) -> BeamOffsetRange:
        if isinstance(element, OffsetRange):
            return BeamOffsetRange(element.start, element.end)
        raise TypeError(f"Kafka read: expected OffsetRange elements, got {type(element).__name__}")

    def create_tracker(self, restriction: BeamOffsetRange) -> OffsetRestrictionTracker:
        return OffsetRestrictionTracker(restriction)

    def restriction_size(self, element: Any, restriction: BeamOffsetRange) -> int:
        return restriction.size()

    def truncate(self, element: Any, restriction: BeamOffsetRange) -> BeamOffsetRange | None:
        return restriction  # on drain a bounded read finishes its range


def claim_batch(tracker: OffsetRestrictionTracker, offsets: np.ndarray) -> int:
    """Claim a batch of records at once; return n: the first n records belong to this restriction.

    One claim per batch instead of one per record: the batch's last offset below the current stop
    is claimed, which by the offset tracker's contract covers every offset up to it. When
    ``n < len(offsets)`` the restriction is finished (a dynamic split moved its stop into or before
    the batch): the rest belongs to the residual, and the tracker has seen a failed claim, so
    ``check_done`` passes even with an offset gap before the stop.

    A split that lands between reading the stop and claiming moves the stop below the claimed
    offset, and the claim fails; the records below the new stop are still this restriction's (the
    residual starts at the stop), and the stop cannot move again (a split point always lies above
    the last attempted claim), so they are returned.

    Args:
        tracker: the restriction tracker of ``[start, stop)`` (Beam ``OffsetRestrictionTracker``
            or its thread-safe wrapper).
        offsets: (N,) int64, strictly increasing Kafka offsets of the batch, all >= the tracker's
            last claim.

    Returns:
        n in [0, N].
    """
    stop = tracker.current_restriction().stop
    n = int(np.searchsorted(offsets, stop, side="left"))
    if n and not tracker.try_claim(int(offsets[n - 1])):
        return int(np.searchsorted(offsets, tracker.current_restriction().stop, side="left"))
    if n < len(offsets):
        claimed = tracker.try_claim(int(offsets[n]))
        assert not claimed, f"offset {offsets[n]} at or past the stop {stop} was claimed"
    return n


class ReadPartitionFn(beam.DoFn):
    """Splittable DoFn: OffsetRange -> pa.RecordBatch of :data:`RECORDS_SCHEMA`, each offset claimed once.

    Reads ``[start, end)`` and emits record batches of up to ``batch_records`` messages of one
    partition, each claimed at once (:func:`claim_batch`), so that Beam's per-element cost is paid
    per batch; they carry the element's timestamp (the batch ingest does not window). A dynamic
    split ends the read at the new stop; the residual is read by another call.

    One client per DoFn instance (``setup``/``teardown``).

    Raises:
        ValueError: ``batch_records < 1``.
    """

    def __init__(self, client: ClientName, bootstrap: str, timeout_s: float, *,
                 batch_records: int, max_message_bytes: int | None = None) -> None:
        if batch_records < 1:
            raise ValueError(f"ReadPartitionFn: expected batch_records >= 1, got {batch_records}")
        self._batch_records = batch_records
        self._max_message_bytes = max_message_bytes
        self._client_name = client
        self._bootstrap = bootstrap
        self._timeout_s = timeout_s
        self._client: KafkaClient | None = None

    def setup(self) -> None:
        self._client = make_client(self._client_name, self._bootstrap, timeout_s=self._timeout_s,
                                   max_message_bytes=self._max_message_bytes)

    def process(
        self,
        element: OffsetRange,
        # Beam's marker default, replaced by the runner with the tracker; Beam types it as the marker.
        tracker: OffsetRestrictionTracker = beam.DoFn.RestrictionParam(KafkaRestrictionProvider()),  # type: ignore[assignment]
    ) -> Iterator[pa.RecordBatch]:
        assert self._client is not None, "setup() not called"
        yield from self._read_bounded_batches(element, tracker)

    def _read_bounded_batches(self, element: OffsetRange,
                              tracker: OffsetRestrictionTracker) -> Iterator[pa.RecordBatch]:
        assert self._client is not None
        rest = tracker.current_restriction()
        rng = OffsetRange(element.topic, element.partition, rest.start, rest.stop)
        batches = self._client.read_batches(rng, max_records=self._batch_records)
        desc = f"read {rng.topic}[{rng.partition}]"
        try:
            with tqdm(total=rng.num_offsets, desc=desc, unit="rec", leave=False, disable=None) as progress:
                for batch in batches:
                    n = claim_batch(tracker, batch.column("offset").to_numpy())
                    if n:
                        yield batch if n == batch.num_rows else batch.slice(0, n)
                    if n < batch.num_rows:
                        return  # the runner split the range: the rest belongs to the residual
                    progress.update(n)
        finally:
            batches.close()
        tracker.try_claim(tracker.current_restriction().stop)  # gaps at the end (compaction) count as done

    def teardown(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

