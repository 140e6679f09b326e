"""Replaying dataset records into a Kafka topic, in event-time order, keyed by user.

This is the "live traffic" of the demo and the integration tests: the records of a real dataset
(:mod:`ingest.datasets`) are produced as if they happened now, oldest first. Events go out as
``Event.to_json()`` keyed by ``Event.key`` (the user id, so that one user's events share a
partition and keep their order); RawRecords go out with their own key and value, so that the
ingest job dead-letters them.

Replay is not idempotent at the Kafka level (Kafka has no such thing for a plain producer): a
second replay appends the records again, and the ingest job drops the repeats by ``event_id``.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import Iterable

from confluent_kafka import KafkaError, Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic
from tqdm import tqdm

from gemline.errors import BadConfigError
from ingest.datasets import load_records
from ingest.datasets.types import RawRecord, Record, event_time_sort_key
from ingest.kafka_clients import check_not_refused, rdkafka_logger, unreachable
from ingest.schema import Event


@dataclass(frozen=True, kw_only=True)
class ReplayResult:
    """What a replay produced."""

    num_events: int
    """Events produced (and acknowledged by the broker)."""
    num_raw: int
    """RawRecords (unmappable source rows) produced."""
    topic: str
    """Topic written to."""
    partitions: int
    """Partition count of the topic."""


class DeliveryError(RuntimeError):
    """The broker refused or lost a produced message."""


INTERRUPT_FLUSH_S = 5.0
"""Seconds an interrupted :func:`replay` waits for the acks of the messages it already produced (a local broker
answers in milliseconds), so that its count is of what reached the broker."""


class ReplayInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM raised as one) stopped a :func:`replay` or ``ingest.generate.stream_records``.

    A ``KeyboardInterrupt``, so callers that stop on Ctrl-C still do; it carries the counts a user needs to
    know what the topic now holds of this run.
    """

    def __init__(self, acknowledged: int, unacknowledged: int) -> None:
        super().__init__(f"interrupted: {acknowledged} message(s) acknowledged by the broker, "
                         f"{unacknowledged} produced without an acknowledgement")
        self.acknowledged = acknowledged
        """Messages the broker acknowledged: they are in the topic."""
        self.unacknowledged = unacknowledged
        """Messages handed to the producer whose fate is unknown (not acknowledged within INTERRUPT_FLUSH_S)."""


FLUSH_SLICE_S = 0.1
"""Seconds of one ``Producer.flush`` call in :func:`_flush` (below confluent-kafka's 0.2 s chunk)."""


def _flush(producer: Producer, timeout_s: float, stop: threading.Event | None = None) -> int:
    """``producer.flush`` for up to ``timeout_s`` seconds in slices of FLUSH_SLICE_S, or until ``stop`` is set;
    returns the messages still queued or in flight (0: every one was acknowledged or failed, see the delivery
    callback).

    confluent-kafka 2.16 splits a flush of 0.2 s or more into chunks and checks for signals between them, and a
    Ctrl-C caught there came out as ``SystemError: <method 'flush' ...> returned NULL without setting an
    exception`` (seen on a loaded 2-core machine); a shorter flush takes the plain path, and Python raises the
    KeyboardInterrupt between two slices.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = producer.flush(min(FLUSH_SLICE_S, max(0.0, deadline - time.monotonic())))
        if not remaining or time.monotonic() >= deadline or (stop is not None and stop.is_set()):
            return remaining


def _create_or_describe(bootstrap: str, topic: str, partitions: int, timeout_s: float) -> int:
    """Create ``topic`` unless it exists; return its partition count as the broker reports it."""
    check_not_refused(bootstrap)
    admin = AdminClient({"bootstrap.servers": bootstrap}, logger=rdkafka_logger())
    futures = admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)],
                                  request_timeout=timeout_s)
    # exception() rather than result(): a raised-and-caught error would tie this frame (and the
    # client's open connection) into a reference cycle that lives until the next gc pass.
    try:
        error = futures[topic].exception(timeout=timeout_s)
    except concurrent.futures.TimeoutError as exc:
        raise unreachable(bootstrap, timeout_s, exc) from None
    if error is not None and error.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
        raise error
    metadata = admin.list_topics(topic=topic, timeout=timeout_s)
    return len(metadata.topics[topic].partitions)


def ensure_topic(bootstrap: str, topic: str, partitions: int, *, timeout_s: float = 30.0) -> int:
    """Create ``topic`` with ``partitions`` partitions unless it exists; return its partition count.

    Uses ``confluent_kafka.admin.AdminClient.create_topics`` (replication factor 1) and treats
    ``TOPIC_ALREADY_EXISTS`` as success.

    Raises:
        ValueError: ``partitions < 1``.
        BadConfigError: the topic exists with a different partition count (delete it or pass its
            count); a ValueError.
        KafkaException: the broker failed the request.
    """
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    # The AdminClient lives in the helper's frame only, so it is closed on return: tansu waits for
    # open client connections when it shuts down.
    existing = _create_or_describe(bootstrap, topic, partitions, timeout_s)
    if existing != partitions:
        raise BadConfigError(
            f"topic {topic!r} exists with {existing} partitions, expected {partitions}; "
            f"pass partitions={existing} or use another topic"
        )
    return existing


def _key_value(record: Record) -> tuple[bytes, bytes]:
    """The Kafka (key, value) of a record."""
    if isinstance(record, Event):
        return record.key, record.to_json()
    if isinstance(record, RawRecord):
        return record.key, record.value
    raise TypeError(f"expected an Event or RawRecord, got {type(record).__name__}")


def replay(
    records: Iterable[Record],
    *,
    bootstrap: str,
    topic: str,
    partitions: int,
    batch_messages: int = 1,
    progress: bool = True,
    flush_timeout_s: float = 600.0,
    stop: threading.Event | None = None,
) -> ReplayResult:
    """Produce ``records`` to ``topic`` in event-time order, keyed by user id, and wait for acks.

    Records are stably sorted by ``event_time_ms`` first (RawRecords last), so an already sorted
    input (as from :func:`ingest.datasets.load_records`) keeps its order exactly.

    Args:
        records: Events and RawRecords.
        bootstrap: ``HOST:PORT`` of the cluster.
        topic: created with ``partitions`` partitions if missing.
        partitions: partition count (must match an existing topic's).
        batch_messages: librdkafka ``batch.num.messages``; keep 1 on tansu (its high watermark
            counts batches, see :class:`ingest.config.KafkaConfig`).
        progress: show a tqdm bar (messages).
        flush_timeout_s: how long the final flush may wait for outstanding acks, seconds (generous:
            a loaded 2-core machine acknowledged 25k messages more slowly than 60 s).
        stop: set (by a signal handler that only sets it, e.g. ``ingest.streaming.install_stop_signals``) to stop
            producing: what was produced gets INTERRUPT_FLUSH_S to be acknowledged, then ReplayInterrupted. Exact
            where a raised KeyboardInterrupt is not: one raised inside a delivery callback loses that report.

    Returns:
        counts of what was acknowledged.

    Raises:
        ValueError: bad ``partitions``/``batch_messages`` or a partition-count mismatch.
        TypeError: a record is neither an Event nor a RawRecord.
        DeliveryError: any message failed delivery, or acks were still missing after the flush.
        ReplayInterrupted: ``stop`` was set, or Ctrl-C (a KeyboardInterrupt) while producing, with the
            acknowledged count.
    """
    if batch_messages < 1:
        raise ValueError(f"batch_messages must be >= 1, got {batch_messages}")
    ordered = sorted(records, key=event_time_sort_key)
    messages = [_key_value(record) for record in ordered]  # type-checks every record before producing
    num_partitions = ensure_topic(bootstrap, topic, partitions)
    failures: list[str] = []
    acknowledged = [0]

    def on_delivery(err: KafkaError | None, msg: Message) -> None:
        # Recorded, then raised from the main loop: an exception raised inside librdkafka's
        # callback would surface at an arbitrary later poll.
        if err is not None:
            failures.append(f"{msg.topic()}[{msg.partition()}] key={msg.key()!r}: {err}")
        else:
            acknowledged[0] += 1

    def check() -> None:
        if failures:
            raise DeliveryError(f"{len(failures)} message(s) failed delivery; first: {failures[0]}")

    producer = Producer({
        "bootstrap.servers": bootstrap,
        "logger": rdkafka_logger(),
        "batch.num.messages": batch_messages,
        "linger.ms": 0,
        "enable.idempotence": False,  # tansu 0.x does not implement producer ids
    })
    try:
        with tqdm(total=len(messages), unit="msg", desc=f"replay -> {topic}", disable=not progress) as bar:
            for key, value in messages:
                if stop is not None and stop.is_set():
                    break
                while True:
                    try:
                        producer.produce(topic, value=value, key=key, on_delivery=on_delivery)
                        break
                    except BufferError:  # local queue full: serve acks, then retry
                        producer.poll(0.1)
                producer.poll(0)
                check()
                bar.update(1)
            remaining = _flush(producer, flush_timeout_s, stop)
    except KeyboardInterrupt:
        # Messages already produced are on their way: their acks make the count what reached the broker.
        unacknowledged = _flush(producer, INTERRUPT_FLUSH_S)
        raise ReplayInterrupted(acknowledged[0], unacknowledged) from None
    if stop is not None and stop.is_set():
        unacknowledged = _flush(producer, INTERRUPT_FLUSH_S)  # before the count: its acks are part of it
        raise ReplayInterrupted(acknowledged[0], unacknowledged)
    check()
    if not remaining:
        producer.close()  # release librdkafka's threads and sockets now rather than at garbage collection
    if remaining:
        raise DeliveryError(f"{remaining} message(s) still unacknowledged after {flush_timeout_s}s flush")
    num_events = sum(isinstance(record, Event) for record in ordered)
    return ReplayResult(num_events=num_events, num_raw=len(ordered) - num_events, topic=topic,
                        partitions=num_partitions)


def replay_dataset(
    name: str,
    *,
    bootstrap: str,
    topic: str,
    partitions: int,
    path: str | None = None,
    limit: int | None = None,
    cache_dir: str | None = None,
    batch_messages: int = 1,
    progress: bool = True,
) -> ReplayResult:
    """:func:`ingest.datasets.load_records` then :func:`replay` (arguments and errors as there).

    ``progress`` shows a bar for reading the source rows and one for producing.
    """
    records = load_records(name, path=path, limit=limit, cache_dir=cache_dir, progress=progress)
    return replay(records, bootstrap=bootstrap, topic=topic, partitions=partitions,
                  batch_messages=batch_messages, progress=progress)
