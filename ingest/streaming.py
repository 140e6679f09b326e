"""Streaming ingest: run until stopped, committing one exactly-once micro-batch every few seconds.

The CLI (``gemline ingest --streaming``) uses :func:`run_streaming`, a driver loop that runs a
bounded :func:`ingest.pipeline.run_ingest` snapshot every ``ingest.streaming.commit_interval_s``.
Each snapshot is one micro-batch: the same app transaction ``(ingest:<topic>, batch_version)``, the same
dead_letter-then-events commits, the same crash recovery. The Python DirectRunner cannot
checkpoint an unbounded pipeline or commit Delta transactions from one, while a snapshot loop
inherits bounded ingest's exactly-once proof unchanged; its cost is a Beam pipeline start per
batch (about a second on DirectRunner) and latency >= the interval.

Stopping: :func:`install_stop_signals` turns SIGINT/SIGTERM into a :class:`threading.Event`; the
loop finishes the batch in flight, then returns. A second signal interrupts at once, which is
still safe: the next run completes or redoes the interrupted batch (see ``ingest.pipeline``).

An unreachable Kafka cluster (connections refused, or no answer within ``ingest.read_timeout_s``) does not
end the loop: the batch is tried again after an exponential backoff (``ingest.streaming.retry_backoff_s``,
doubling up to ``max_retry_backoff_s``, as ``gemline run`` restarts a stage), with one
warning when the outage starts and one when the cluster answers again. A retried batch is the same
restartable :func:`run_ingest` call a restarted process would make, so nothing is lost or written twice.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from gemline.errors import BrokerUnreachableError
from gemline.lake import Lake
from gemline.supervisor import restart_delay_s
from ingest.config import IngestConfig, KafkaConfig, StreamingConfig
from ingest.pipeline import IngestResult, run_ingest

__all__ = ["StreamingConfig", "StreamingSummary", "install_stop_signals", "run_streaming"]

log = logging.getLogger(__name__)


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
    outages: int = 0
    """Times the Kafka cluster became unreachable (the loop waited and retried each time)."""
    failed_tries: int = 0
    """Micro-batch tries that ended with :class:`~gemline.errors.BrokerUnreachableError` (then retried)."""
    stopped_by: Literal["max_batches", "stop"] = "max_batches"
    """What ended the loop: ``ingest.streaming.max_batches`` ran, or ``stop`` was set (signal or caller's event)."""


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
    lake: Lake,
    kafka: KafkaConfig,
    ingest: IngestConfig,
    streaming: StreamingConfig,
    *,
    bootstrap: str,
    stop: threading.Event | None = None,
    beam_args: list[str] | None = None,
    on_batch: Callable[[IngestResult], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> StreamingSummary:
    """Ingest ``kafka.topic`` in micro-batches until ``stop`` is set or ``streaming.max_batches`` ran.

    Each cycle is one :func:`ingest.pipeline.run_ingest` call (exactly once, restartable); the
    next cycle starts ``commit_interval_s`` after the previous one started, or at once when a
    batch took longer.

    Args:
        lake, kafka, ingest: as for :func:`ingest.pipeline.run_ingest`, for every micro-batch.
        streaming: the loop's settings, ``ingest.streaming`` from the CLI (a test may pass others).
        stop: set it (another thread, or :func:`install_stop_signals`) to end after the batch in flight.
        on_batch: called with each cycle's result, after its commits (tests use it to produce more).
        clock: monotonic seconds, for the interval only.

    Returns:
        A :class:`StreamingSummary`.

    Raises:
        Whatever :func:`run_ingest` raises (ValueError for a lake/topic disagreement, RuntimeError
        for broken invariants): a streaming job must not skip a batch it cannot commit. The exception is
        :class:`~gemline.errors.BrokerUnreachableError` (a timeout included), after which the batch is
        tried again (module docstring) until the cluster answers or ``stop`` is set.
    """
    stop = stop or threading.Event()
    summary = StreamingSummary()
    failures = 0  # consecutive tries the cluster did not answer: the current outage
    while not stop.is_set():
        started = clock()
        try:
            result = run_ingest(lake, kafka, ingest, bootstrap=bootstrap, beam_args=beam_args)
        except BrokerUnreachableError as exc:
            failures += 1
            summary.failed_tries += 1
            delay = restart_delay_s(failures, base_s=streaming.retry_backoff_s, cap_s=streaming.max_retry_backoff_s)
            if failures == 1:  # once per outage: a log line per retry would drown the log of a long one
                summary.outages += 1
                log.warning("ingest: Kafka at %s is unreachable (%s); waiting, retrying with backoff from %.1f s "
                            "up to %.1f s", bootstrap, exc, delay, streaming.max_retry_backoff_s)
            stop.wait(delay)
            continue
        if failures:
            log.warning("ingest: Kafka at %s is reachable again after %d failed tries; resuming", bootstrap, failures)
            failures = 0
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

