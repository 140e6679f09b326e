"""Streaming ingest: run until stopped, committing one exactly-once micro-batch every few seconds.

Two paths, one protocol:

* The CLI (``gemline ingest --streaming``) uses :func:`run_streaming`, a driver loop that runs a
  bounded :func:`ingest.pipeline.run_ingest` snapshot every ``commit_interval_s``. Each snapshot
  is one micro-batch: the same app transaction ``(ingest:<topic>, batch_version)``, the same
  dead_letter-then-events commits, the same crash recovery. It is the path used here because the
  Python DirectRunner cannot checkpoint an unbounded pipeline or commit Delta transactions from
  one, while a snapshot loop inherits bounded ingest's exactly-once proof unchanged; its cost is a
  Beam pipeline start per batch (about a second on DirectRunner) and latency >= the interval.
* For streaming runners (Flink, Dataflow via the portable runner), :func:`read_unbounded` starts
  :class:`ingest.kafka_source.ReadFromKafkaPartitions` (a splittable DoFn over ``[start, inf)``
  with per-partition watermarks) at the lake's committed offsets. A windowed Delta sink for it is
  not written yet.

Stopping: :func:`install_stop_signals` turns SIGINT/SIGTERM into a :class:`threading.Event`; the
loop finishes the batch in flight, then returns. A second signal interrupts at once, which is
still safe: the next run completes or redoes the interrupted batch (see ``ingest.pipeline``).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import apache_beam as beam

from gemline.config import GemlineConfig
from gemline.lake import commit_metadata
from ingest.kafka_source import PartitionStart, PollSettings, ReadFromKafkaPartitions, make_client
from ingest.pipeline import EVENTS_TABLE, IngestResult, app_id_for, run_ingest

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class StreamingConfig:
    """Settings of streaming ingest (driver loop and unbounded read)."""

    commit_interval_s: float = 5.0
    """Seconds from the start of one micro-batch to the start of the next (the loop never overlaps batches)."""
    max_batches: int | None = None
    """Stop after this many micro-batch cycles, skipped ones included (tests, backfills); None: until stopped."""
    poll_timeout_s: float = 1.0
    """Unbounded read: seconds one Kafka poll may wait for records."""
    idle_timeout_s: float = 30.0
    """Unbounded read: a partition without records this long stops holding the watermark back."""
    max_out_of_order_ms: int = 0
    """Unbounded read: the watermark trails the newest record timestamp of a partition by this much."""
    finish_when_idle_s: float | None = None
    """Unbounded read: end a partition once idle this long (DirectRunner tests); None: read forever."""

    def __post_init__(self) -> None:
        if not self.commit_interval_s > 0:
            raise ValueError(f"streaming.commit_interval_s: expected > 0 seconds, got {self.commit_interval_s}")
        if self.max_batches is not None and self.max_batches < 1:
            raise ValueError(f"streaming.max_batches: expected >= 1 or None, got {self.max_batches}")
        if not self.poll_timeout_s > 0:
            raise ValueError(f"streaming.poll_timeout_s: expected > 0 seconds, got {self.poll_timeout_s}")
        if not self.idle_timeout_s >= 0:
            raise ValueError(f"streaming.idle_timeout_s: expected >= 0 seconds, got {self.idle_timeout_s}")
        if self.max_out_of_order_ms < 0:
            raise ValueError(f"streaming.max_out_of_order_ms: expected >= 0, got {self.max_out_of_order_ms}")
        if self.finish_when_idle_s is not None and not self.finish_when_idle_s > 0:
            raise ValueError(f"streaming.finish_when_idle_s: expected > 0 or None, got {self.finish_when_idle_s}")

    def poll_settings(self) -> PollSettings:
        """The :class:`PollSettings` of the unbounded read."""
        return PollSettings(poll_timeout_s=self.poll_timeout_s, idle_timeout_s=self.idle_timeout_s,
                            max_out_of_order_ms=self.max_out_of_order_ms,
                            finish_when_idle_s=self.finish_when_idle_s)


@dataclass
class StreamingSummary:
    """What one :func:`run_streaming` call did (counts of rows this call committed)."""

    batches: int = 0
    """Micro-batch cycles run, skipped ones included."""
    committed: list[int] = field(default_factory=list)
    """Batch versions this call committed (recovered ones included)."""
    events_written: int = 0
    dead_letter_written: int = 0
    late_events_written: int = 0
    """Rows moved to ``late_events`` (behind the watermark by more than the allowed lateness)."""
    duplicates_dropped: int = 0
    """Second deliveries of an event_id dropped (counted, not written)."""
    stopped_by: str = "max_batches"
    """'max_batches' or 'stop' (signal or caller's event)."""


def install_stop_signals(stop: threading.Event) -> Callable[[], None]:
    """Make SIGINT and SIGTERM set ``stop`` (a second one raises KeyboardInterrupt at once).

    Must be called from the main thread (Python delivers signals there).

    Returns:
        A function restoring the previous handlers.
    """
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt(f"second signal {signum}: stopping without finishing the batch")
        log.info("ingest: signal %d, finishing the batch in flight", signum)
        stop.set()

    for sig in previous:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


def run_streaming(
    config: GemlineConfig,
    streaming: StreamingConfig,
    *,
    bootstrap: str,
    stop: threading.Event | None = None,
    beam_args: list[str] | None = None,
    on_batch: Callable[[IngestResult], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> StreamingSummary:
    """Ingest ``config.kafka.topic`` in micro-batches until ``stop`` is set or ``streaming.max_batches`` ran.

    Each cycle is one :func:`ingest.pipeline.run_ingest` call (exactly once, restartable); the
    next cycle starts ``commit_interval_s`` after the previous one started, or at once when a
    batch took longer.

    Args:
        stop: set it (another thread, or :func:`install_stop_signals`) to end after the batch in flight.
        on_batch: called with each cycle's result, after its commits (tests use it to produce more).
        clock: monotonic seconds, for the interval only.

    Returns:
        A :class:`StreamingSummary`.

    Raises:
        Whatever :func:`run_ingest` raises (ValueError for a lake/topic disagreement, RuntimeError
        for broken invariants): a streaming job must not skip a batch it cannot commit.
    """
    stop = stop or threading.Event()
    summary = StreamingSummary()
    while not stop.is_set():
        started = clock()
        result = run_ingest(config, bootstrap=bootstrap, beam_args=beam_args)
        summary.batches += 1
        if not result.skipped:
            summary.committed.append(result.batch_version)
            summary.events_written += result.events_written
            summary.dead_letter_written += result.dead_letter_written
            summary.late_events_written += result.late_events_written
            summary.duplicates_dropped += result.duplicates_dropped
        if on_batch is not None:
            on_batch(result)
        if streaming.max_batches is not None and summary.batches >= streaming.max_batches:
            return summary
        stop.wait(max(0.0, streaming.commit_interval_s - (clock() - started)))
    summary.stopped_by = "stop"
    return summary


def partition_starts(config: GemlineConfig, bootstrap: str) -> list[PartitionStart]:
    """Where an unbounded read resumes: per partition, the ``end_offsets`` of the last ``events``
    commit of this topic's ingest app (the low watermark for a partition never ingested).

    Raises:
        ValueError: the topic does not exist, or the lake has offsets for partitions it lacks.
    """
    topic = config.kafka.topic
    meta = commit_metadata(config.lake, EVENTS_TABLE, app_id_for(topic)) or {}
    ends = {int(p): int(e) for p, e in meta.get("end_offsets", {}).items()}
    kc = make_client(config.kafka.client, bootstrap, timeout_s=config.ingest.read_timeout_s)
    try:
        watermarks = kc.end_offsets(topic)
    finally:
        kc.close()
    unknown = sorted(set(ends) - set(watermarks))
    if unknown:
        raise ValueError(f"topic {topic!r}: lake has offsets for partitions {unknown} the topic lacks "
                         f"(has {sorted(watermarks)}); was the topic recreated?")
    return [PartitionStart(topic, p, ends.get(p, low)) for p, (low, _high) in sorted(watermarks.items())]


def read_unbounded(pipeline: beam.Pipeline, config: GemlineConfig, streaming: StreamingConfig,
                   *, bootstrap: str) -> beam.PCollection:
    """The unbounded KafkaRecord PCollection of ``config.kafka.topic`` from the lake's committed offsets.

    For streaming runners; see the module docstring. Records carry their Kafka timestamp as
    event time and each partition reports its own watermark.
    """
    starts = partition_starts(config, bootstrap)
    return (
        pipeline
        | "PartitionStarts" >> beam.Create(starts)
        | "ReadKafka" >> ReadFromKafkaPartitions(bootstrap=bootstrap, client=config.kafka.client,
                                                 timeout_s=config.ingest.read_timeout_s,
                                                 poll=streaming.poll_settings())
    )
