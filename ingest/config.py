"""Typed configuration of the ingest stage (Kafka -> events / dead_letter)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gemline.errors import BadConfigError

DEFAULT_DOMAINS: tuple[str, ...] = (
    # GEM's three surfaces (synthetic data) ...
    "facebook",
    "instagram",
    "messaging",
    # ... and the domains of the real datasets the adapters map (see ingest/datasets/).
    "movielens",
    "taobao",
    "obd_all",
    "obd_men",
    "obd_women",
)


@dataclass(frozen=True, kw_only=True)
class KafkaConfig:
    """Where events come from."""

    bootstrap: str | None = None
    """HOST:PORT of a Kafka cluster; None starts the embedded broker (tansu) where a command needs one."""
    topic: str = "gemline.events"
    """Topic the events are produced to and consumed from."""
    partitions: int = 4
    """Partitions created for the topic when it does not exist."""
    client: Literal["confluent", "kafka-python"] = "confluent"
    """Client library; confluent-kafka measured ~28x faster at consuming here."""
    producer_batch_messages: int = 1
    """Messages per produced record batch. 1 by default because tansu 0.x reports a partition's
    high watermark as (base offset of its last batch) + 1, so with larger batches a bounded
    snapshot ends early (nothing is lost: the rest is read by the next run). Raise it on real Kafka."""

    def __post_init__(self) -> None:
        if self.producer_batch_messages < 1:
            raise BadConfigError(f"kafka.producer_batch_messages must be >= 1, got {self.producer_batch_messages}")
        if self.partitions < 1:
            raise BadConfigError(f"kafka.partitions must be >= 1, got {self.partitions}")


@dataclass(frozen=True, kw_only=True)
class StreamingConfig:
    """Settings of streaming ingest, ``gemline ingest --streaming`` (``[ingest.streaming]``; the driver
    loop is ``ingest.streaming.run_streaming``)."""

    commit_interval_s: float = 5.0
    """Seconds from the start of one micro-batch to the start of the next (the loop never overlaps
    batches); ``--commit-interval-s`` sets it too."""
    max_batches: int | None = None
    """Stop after this many micro-batch cycles, skipped ones included (tests, backfills); None: until
    stopped; ``--max-batches`` sets it too."""
    retry_backoff_s: float = 1.0
    """Seconds before the first retry of a micro-batch the Kafka cluster did not answer (refused or timed
    out); the wait doubles with each consecutive failure, up to ``max_retry_backoff_s``."""
    max_retry_backoff_s: float = 30.0
    """The longest wait (s) between two tries while the Kafka cluster stays unreachable."""

    def __post_init__(self) -> None:
        """Raises BadConfigError (a ValueError) naming the ``ingest.streaming.*`` key of a bad value."""
        if not 0 < self.retry_backoff_s <= self.max_retry_backoff_s:
            raise BadConfigError("ingest.streaming: expected 0 < retry_backoff_s <= max_retry_backoff_s seconds, got "
                                 f"{self.retry_backoff_s} and {self.max_retry_backoff_s}")
        if not self.commit_interval_s > 0:
            raise BadConfigError(f"ingest.streaming.commit_interval_s: expected > 0 seconds, got {self.commit_interval_s}")
        if self.max_batches is not None and self.max_batches < 1:
            raise BadConfigError(f"ingest.streaming.max_batches: expected >= 1 or None, got {self.max_batches}")


@dataclass(frozen=True, kw_only=True)
class IngestConfig:
    """Parsing, validation and the Delta commit of the ingest job."""

    domains: tuple[str, ...] = DEFAULT_DOMAINS
    """Known domains; an event with any other domain is dead-lettered (reason unknown_domain)."""
    max_future_skew_ms: int = 5 * 60 * 1000
    """An event time later than (ingest clock + this) is dead-lettered (reason future_event_time)."""
    runner: str = "DirectRunner"
    """Beam runner; any other Beam pipeline flag passes through the CLI untouched."""
    engine: Literal["auto", "inprocess", "beam"] = "auto"
    """"beam": each batch is a Beam pipeline (read, parse, stage; the reference twin). "inprocess": the same
    read and parse functions called in this process, without building a pipeline per batch: that construction
    cost more CPU than the parsing it ran (~55 % of a streaming ingest's CPU at 2,000 events/s). "auto": Beam
    when Beam flags are given or ``runner`` is not the DirectRunner, else in process. Both commit the same rows."""
    read_timeout_s: float = 30.0
    """Seconds a Kafka metadata request or a range read may go without progress before the run fails."""
    retention_days: int | None = None
    """Events older than (ingest clock - this) are dead-lettered (expired_event_time); None keeps any age,
    the default because the public datasets replayed here are decades old."""
    dedup_window_ms: int = 24 * 3600 * 1000
    """A second delivery of an event_id within this event-time distance of a kept copy (same batch or
    committed) is dropped and counted."""
    allowed_lateness_ms: int = 24 * 3600 * 1000
    """Events more than this behind their partition's ingest watermark go to late_events. One day: the
    replays are in event-time order per partition, and generated traffic is seconds apart."""
    batch_max_records: int = 50_000
    """Kafka messages per Arrow record batch, the element the parse step works on (~12 MB of 250-byte
    events). Larger batches spread each batch's fixed costs thinner: 10,000 -> 50,000 measured
    ~10% fewer CPU-seconds per event (``benchmarks/ingest.py``)."""
    reshuffle: bool = False
    """Reshuffle the record batches after the Kafka read (a fusion break: parse on more workers than
    partitions, retries replay the shuffle instead of re-reading Kafka), at ~5 us of CPU per event on
    the DirectRunner. Off: each partition's batches are parsed where they were read."""
    min_event_time_ms: int = 946_684_800_000
    """Events before this time (ms since epoch UTC; default 2000-01-01) are dead-lettered
    (too_early_event_time): 0, -1 or 1914 are clock bugs or wrong units. Lower it to replay older
    data (MovieLens-100K is from 1997-98: the demo and ``replay`` say so)."""
    max_message_bytes: int = 1 << 20
    """A message value larger than this (bytes) is dead-lettered as too_large with its size and its
    first KiB; the reader keeps no more of it. 1 MiB, Kafka's default ``message.max.bytes``."""
    accept_gaps: bool = False
    """Go on when retention deleted records before they were ingested (the gap is recorded in the
    commit either way); False stops the run with exit code 4 after committing what was there."""
    max_offsets_per_partition: int | None = None
    """Offsets one ingest batch reads per partition at most, bounding a batch's memory (the driver holds
    its rows to dedup and commit); the rest is left to the next batch. None: up to the high watermark."""
    group_id: str = "gemline-ingest"
    """Kafka consumer group the ingested offsets are committed to after each Delta commit of ``events``, so a
    standard lag monitor (kafka-consumer-groups, Burrow, an exporter) sees the pipeline. The lake stays the
    source of truth and the group may lag it (a failed group commit only logs a warning); "" commits nothing."""
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    """The micro-batch loop of ``gemline ingest --streaming``."""

    def __post_init__(self) -> None:
        if not self.domains:
            raise BadConfigError("ingest.domains must name at least one domain")
        if self.engine not in ("auto", "inprocess", "beam"):
            raise BadConfigError(f"ingest.engine must be 'auto', 'inprocess' or 'beam', got {self.engine!r}")
        if not self.read_timeout_s > 0:
            raise BadConfigError(f"ingest.read_timeout_s must be > 0, got {self.read_timeout_s}")
        if self.max_future_skew_ms < 0:
            raise BadConfigError(f"ingest.max_future_skew_ms must be >= 0, got {self.max_future_skew_ms}")
        if self.retention_days is not None and self.retention_days < 1:
            raise BadConfigError(f"ingest.retention_days must be >= 1 or None (no limit), got {self.retention_days}")
        if self.dedup_window_ms < 0:
            raise BadConfigError(f"ingest.dedup_window_ms must be >= 0, got {self.dedup_window_ms}")
        if self.allowed_lateness_ms < 0:
            raise BadConfigError(f"ingest.allowed_lateness_ms must be >= 0, got {self.allowed_lateness_ms}")
        if self.max_message_bytes < 1024:
            raise BadConfigError(f"ingest.max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.batch_max_records < 1:
            raise BadConfigError(f"ingest.batch_max_records must be >= 1, got {self.batch_max_records}")
        if self.max_offsets_per_partition is not None and self.max_offsets_per_partition < 1:
            raise BadConfigError("ingest.max_offsets_per_partition must be >= 1 or None (no limit), got "
                                 f"{self.max_offsets_per_partition}")

    @property
    def retention_ms(self) -> int | None:
        """``retention_days`` in ms, or None."""
        return None if self.retention_days is None else self.retention_days * 86_400_000
