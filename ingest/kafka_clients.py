"""Kafka clients for the ingest source: one small interface over confluent-kafka and kafka-python.

The source (``ingest.kafka_source``) and the planner need only :class:`KafkaClient`: the end
offsets of a topic, a bounded read of an offset range (as records, or as Arrow record batches of
:data:`RECORDS_SCHEMA`), and a poll. :func:`make_client` picks the implementation named by
``KafkaConfig.client``: confluent-kafka (librdkafka; the default, much faster, every codec built
in) or kafka-python (pure Python; snappy, lz4 and zstd need extra Python modules, probed before a
read starts: :func:`missing_codecs`). Consumers are ``assign``-ed and never commit to a consumer
group: the lake, not Kafka, is the source of truth for what has been consumed. After the lake committed,
:func:`commit_group_offsets` copies its offsets to a consumer group only so that lag monitors see them.

Source: the Kafka fetch semantics of librdkafka (``Consumer.consume``) and kafka-python
(``KafkaConsumer.poll``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import socket
import time
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol, cast

import numpy as np
import pyarrow as pa

from gemline.errors import BrokerTimeoutError, BrokerUnreachableError, MissingInputError

ClientName = Literal["confluent", "kafka-python"]


class _FirstOfEach(logging.Filter):
    """Passes a record unless one of the same kind (level + text up to its first digit) passed
    less than ``every_s`` seconds before it.

    librdkafka retries a refused connection every ~50 ms and logs each try: against a wrong
    ``--bootstrap`` that was 600 identical lines before the real error. A long-running stream
    still hears of a broker that goes away again later.
    """

    def __init__(self, every_s: float = 60.0) -> None:
        super().__init__()
        self._every_s = every_s
        self._last: dict[tuple[int, str], float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        key = (record.levelno, text[: next((i for i, c in enumerate(text) if c.isdigit()), len(text))])
        last = self._last.get(key)
        if last is not None and record.created - last < self._every_s:
            return False
        self._last[key] = record.created
        return True


def rdkafka_logger() -> logging.Logger:
    """The Python logger librdkafka's log lines go to (confluent-kafka's ``logger`` setting), each
    kind of line at most once a minute; the first call installs the filter."""
    logger = logging.getLogger("ingest.rdkafka")
    if not any(isinstance(f, _FirstOfEach) for f in logger.filters):
        logger.addFilter(_FirstOfEach())
    return logger


def all_refused(bootstrap: str, *, timeout_s: float = 2.0) -> bool:
    """True when every ``HOST:PORT`` of ``bootstrap`` refuses a TCP connection (nothing listens there).

    librdkafka retries a refused connection until the request timeout (30 s by default) before it
    reports anything; a refusal is definitive, so callers check this first and fail at once. Any
    other outcome (a connection, a timeout, an unparsable address) is False: the client decides.
    """
    addresses = []
    for item in bootstrap.split(","):
        host, _, port = item.strip().split("://")[-1].rpartition(":")
        if not host or not port.isdigit():
            return False
        addresses.append((host.strip("[]"), int(port)))
    for address in addresses:
        try:
            socket.create_connection(address, timeout=timeout_s).close()
            return False
        except ConnectionRefusedError:
            continue
        except OSError:
            return False
    return bool(addresses)


def check_not_refused(bootstrap: str) -> None:
    """Fail at once when nothing listens at any server of ``bootstrap`` (see :func:`all_refused`).

    Raises:
        BrokerUnreachableError: every bootstrap server refused the connection.
    """
    if all_refused(bootstrap):
        raise BrokerUnreachableError(f"connection refused by {bootstrap}: nothing listens there; is the broker up and "
                              "--bootstrap right?")


def unreachable(bootstrap: str, timeout_s: float, exc: BaseException | None = None) -> BrokerUnreachableError:
    """The error for a Kafka cluster that did not answer a request within ``timeout_s`` seconds."""
    detail = f" ({exc})" if exc is not None and str(exc) else ""
    return BrokerUnreachableError(f"no answer from the Kafka cluster at {bootstrap} within {timeout_s:g} s{detail}; "
                           "is the broker up and --bootstrap right?")


CONNECTION_ERRORS = frozenset({-195, -187, -137, -185, -193})
"""librdkafka's codes for a cluster that went away or never answered (``KafkaError._TRANSPORT``,
``_ALL_BROKERS_DOWN``, ``_DESTROY_BROKER``, ``_TIMED_OUT``, ``_RESOLVE``): a broker stopped or unreachable
while a read was in flight, as opposed to a bad record or request."""


def message_error(where: str, error: Any) -> Exception:
    """The exception for a Kafka error ``error`` (a confluent-kafka ``KafkaError``) met at ``where``:
    :class:`BrokerUnreachableError` for a connection error (:data:`CONNECTION_ERRORS`), which a streaming
    job waits out, else a RuntimeError (a broken invariant)."""
    code = getattr(error, "code", None)
    if callable(code) and code() in CONNECTION_ERRORS:
        return BrokerUnreachableError(f"{where}: the Kafka cluster went away ({error}); is the broker up?")
    return RuntimeError(f"{where}: Kafka error {error}")


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the block (restored after, exceptions included).

    ``Consumer.consume(num_messages=10_000)`` allocates 10,000 GC-tracked ``Message`` objects at
    once; every 700 allocations start a young-generation collection and every tenth of those an
    older one, which walks the process's long-lived objects (Beam's, pyarrow's, polars'). Measured
    with ``perf`` on the ingest benchmark: ~75% of the consume loop's CPU was ``gc_collect_main``;
    paused, consuming costs 2.2 instead of 9-11 us per message. Messages hold no reference
    cycles, so reference counting frees them all the same; the pause only defers collection.
    Process-wide (``gc.disable``), so the block should not yield to other code.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


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
    topic is configured), -1 when the broker gives none. ``value`` is None for a tombstone (a
    message without a value, as log compaction uses them), ``b""`` for an empty value.
    ``value_size`` is None when ``value`` is the whole value; a reader that met a value larger than
    its ``max_message_bytes`` keeps only its first :data:`RAW_PREFIX_BYTES` and sets ``value_size``
    to the full size in bytes, so that one huge message never has to travel through the pipeline.
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int
    value_size: int | None = None


RECORDS_SCHEMA = pa.schema(
    [
        pa.field("topic", pa.string(), nullable=False),
        pa.field("partition", pa.int32(), nullable=False),
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),  # null: a tombstone
        pa.field("timestamp_ms", pa.int64(), nullable=False),
        pa.field("value_size", pa.int64()),  # bytes of a value cut to its first RAW_PREFIX_BYTES; null: whole
    ]
)
"""Arrow schema of a batch of Kafka messages (the fields of :class:`KafkaRecord`)."""

RECEIVE_MAX_BYTES = 2_147_483_647
"""librdkafka's largest ``receive.message.max.bytes``: any message a broker can store is received."""

RAW_PREFIX_BYTES = 1024
"""Bytes of a too-large value that are kept (and dead-lettered as ``too_large``)."""


def cut_large(values: list[bytes | None], max_bytes: int | None) -> list[int | None] | None:
    """Cut, in place, every value longer than ``max_bytes`` to its first :data:`RAW_PREFIX_BYTES`.

    Args:
        values: N message values (None: a tombstone).
        max_bytes: the largest value kept whole, bytes; None keeps every value whole.

    Returns:
        None when no value was cut (the usual case, checked at C speed), else N sizes: the original
        size in bytes of each cut value, None for the others.
    """
    if max_bytes is None or not values:
        return None
    try:
        longest = max(map(len, cast("list[bytes]", values)))  # len(None) raises: the except below
    except TypeError:  # a tombstone among them
        longest = max((len(v) for v in values if v is not None), default=0)
    if longest <= max_bytes:
        return None
    sizes: list[int | None] = [None] * len(values)
    for i, v in enumerate(values):
        if v is not None and len(v) > max_bytes:
            sizes[i] = len(v)
            values[i] = v[:RAW_PREFIX_BYTES]
    return sizes


def records_to_batch(records: Sequence[KafkaRecord]) -> pa.RecordBatch:
    """``records`` (N of them) as one RecordBatch of :data:`RECORDS_SCHEMA`, in the given order."""
    return pa.RecordBatch.from_arrays(
        [
            pa.array([r.topic for r in records], pa.string()),
            pa.array([r.partition for r in records], pa.int32()),
            pa.array([r.offset for r in records], pa.int64()),
            pa.array([r.key for r in records], pa.binary()),
            pa.array([r.value for r in records], pa.binary()),
            pa.array([r.timestamp_ms for r in records], pa.int64()),
            pa.array([r.value_size for r in records], pa.int64()),
        ],
        schema=RECORDS_SCHEMA,
    )


def _partition_batch(topic: str, partition: int, offsets: list[int], keys: list[bytes | None],
                     values: list[bytes | None], timestamps_ms: list[int],
                     max_message_bytes: int | None = None) -> pa.RecordBatch:
    """N messages of one partition, given column-wise, as a RecordBatch of :data:`RECORDS_SCHEMA`
    (values above ``max_message_bytes`` cut, :func:`cut_large`)."""
    n = len(offsets)
    sizes = cut_large(values, max_message_bytes)
    return pa.RecordBatch.from_arrays(
        [
            pa.array([topic] * n, pa.string()),
            pa.array(np.full(n, partition, dtype=np.int32)),
            pa.array(offsets, pa.int64()),
            pa.array(keys, pa.binary()),
            pa.array(values, pa.binary()),
            pa.array(timestamps_ms, pa.int64()),
            pa.nulls(n, pa.int64()) if sizes is None else pa.array(sizes, pa.int64()),
        ],
        schema=RECORDS_SCHEMA,
    )


def _record(topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None, timestamp_ms: int,
            max_message_bytes: int | None) -> KafkaRecord:
    """A KafkaRecord, its value cut to :data:`RAW_PREFIX_BYTES` when above ``max_message_bytes``."""
    if max_message_bytes is not None and value is not None and len(value) > max_message_bytes:
        return KafkaRecord(topic, partition, offset, key, value[:RAW_PREFIX_BYTES], timestamp_ms, len(value))
    return KafkaRecord(topic, partition, offset, key, value, timestamp_ms)


def batches_of(records: Iterator[KafkaRecord], max_records: int) -> Generator[pa.RecordBatch, None, None]:
    """Consecutive RecordBatches of up to ``max_records`` of ``records``, in their order.

    Closes ``records`` (a generator holding a consumer assignment) when done or closed early.

    Raises:
        ValueError: ``max_records < 1``.
    """
    if max_records < 1:
        raise ValueError(f"batches_of: expected max_records >= 1, got {max_records}")
    buf: list[KafkaRecord] = []
    try:
        for rec in records:
            buf.append(rec)
            if len(buf) == max_records:
                yield records_to_batch(buf)
                buf = []
        if buf:
            yield records_to_batch(buf)
    finally:
        close = getattr(records, "close", None)
        if close is not None:
            close()


CODECS: tuple[str, ...] = ("gzip", "snappy", "lz4", "zstd")
"""Kafka record-batch compression codecs (``compression.type`` of a producer or topic)."""

_KAFKA_PYTHON_CODEC_MODULES = {"gzip": "gzip (stdlib)", "snappy": "python-snappy or cramjam",
                               "lz4": "lz4", "zstd": "zstandard"}


def missing_codecs(client: "ClientName") -> tuple[str, ...]:
    """Codecs of :data:`CODECS` that ``client`` cannot decode in this interpreter, in CODECS order.

    confluent-kafka's wheels ship librdkafka with every codec built in; kafka-python decodes in
    Python and needs one module per codec (its ``kafka.codec.has_*`` probes).

    Raises:
        ValueError: an unknown client name.
    """
    if client == "confluent":
        return ()
    if client == "kafka-python":
        from kafka import codec

        have = {"gzip": codec.has_gzip(), "snappy": codec.has_snappy(), "lz4": codec.has_lz4(),
                "zstd": codec.has_zstd()}
        return tuple(c for c in CODECS if not have[c])
    raise ValueError(f"kafka client: expected 'confluent' or 'kafka-python', got {client!r}")


def _codec_error(rng_desc: str, exc: Exception) -> ValueError:
    missing = missing_codecs("kafka-python")
    hints = ", ".join(f"{c} (pip install {_KAFKA_PYTHON_CODEC_MODULES[c]})" for c in missing)
    return ValueError(
        f"{rng_desc}: kafka-python cannot decode the records ({exc}); codecs missing here: {hints or 'none'}. "
        "Install the codec module or use kafka.client='confluent' (all codecs built in)."
    )


class KafkaClient(Protocol):
    """What the source needs from a Kafka client library."""

    def end_offsets(self, topic: str) -> dict[int, tuple[int, int]]:
        """Per partition, (low watermark, high watermark) seen now.

        Raises:
            ValueError: the topic does not exist.
        """
        ...

    def topic_id(self, topic: str) -> str | None:
        """The topic's id (a UUID the broker gives a topic at creation, KIP-516) or None where the
        broker or client gives none; a recreated topic gets a new one."""
        ...

    def read_range(self, rng: OffsetRange) -> Iterator[KafkaRecord]:
        """The records with offsets in ``[rng.start, rng.end)``, in offset order.

        Raises:
            BrokerTimeoutError: no progress within the client's timeout (a TimeoutError).
            ValueError: the records use a compression codec the client cannot decode.
        """
        ...

    def read_batches(self, rng: OffsetRange, *, max_records: int) -> Generator[pa.RecordBatch, None, None]:
        """The records of ``[rng.start, rng.end)`` as RecordBatches of :data:`RECORDS_SCHEMA` of up to
        ``max_records`` rows each, in offset order (the bounded read without a Python object per message).

        Raises:
            as :meth:`read_range`; ValueError for ``max_records < 1``.
        """
        ...

    def fetch(self, topic: str, partition: int, offset: int, *, max_records: int,
              timeout_s: float) -> list[KafkaRecord]:
        """Up to ``max_records`` records of one partition from ``offset`` on, in offset order;
        empty when none arrived within ``timeout_s`` (the unbounded read's poll).

        Raises:
            RuntimeError: a Kafka error (e.g. ``offset`` out of range).
            BrokerUnreachableError: the cluster went away during the poll (:func:`message_error`).
            ValueError: the records use a compression codec the client cannot decode.
        """
        ...

    def close(self) -> None:
        """Release connections."""
        ...


def _check_progress(rng: OffsetRange, next_offset: int, deadline: float) -> None:
    if time.monotonic() > deadline:
        raise BrokerTimeoutError(
            f"{rng.topic}[{rng.partition}]: no record at offset >= {next_offset} within the read "
            f"timeout while reading [{rng.start}, {rng.end}); is the broker up and the range planned "
            "from this cluster?"
        )


def _take_columns(msgs: list[Any], rng: OffsetRange, next_offset: int, offsets: list[int],
                  keys: list[bytes | None], values: list[bytes | None], timestamps_ms: list[int]) -> int:
    """Append the fields of the confluent-kafka ``msgs`` of ``rng`` at or after ``next_offset`` to the
    column lists; return the next offset to read (``rng.end`` once the range is done).

    The usual chunk (this partition, offsets ascending inside the range) is taken by one list
    comprehension per field, ~1 us per message less than a loop with the checks per message;
    any other chunk takes that loop, which skips what is outside the range.

    Raises:
        BrokerUnreachableError, RuntimeError: a message carries a Kafka error (:func:`message_error`).
    """
    errors = [m for m in msgs if m.error() is not None]
    if errors:
        raise message_error(f"{rng.topic}[{rng.partition}]", errors[0].error())
    got = [m.offset() for m in msgs]
    n = len(msgs)
    if (n and next_offset <= got[0] and got[-1] < rng.end
            and [m.partition() for m in msgs].count(rng.partition) == n
            and [m.topic() for m in msgs].count(rng.topic) == n
            and (n == 1 or bool(np.all(np.diff(np.asarray(got, dtype=np.int64)) > 0)))):
        offsets.extend(got)
        keys.extend([m.key() for m in msgs])
        values.extend([m.value() for m in msgs])
        timestamps_ms.extend([m.timestamp()[1] for m in msgs])
        return got[-1] + 1
    for msg, offset in zip(msgs, got):
        # Guards against a message still queued from an earlier assignment or a re-fetch.
        if offset < next_offset or msg.partition() != rng.partition or msg.topic() != rng.topic:
            continue
        if offset >= rng.end:
            return rng.end
        next_offset = offset + 1
        offsets.append(offset)
        keys.append(msg.key())
        values.append(msg.value())
        timestamps_ms.append(msg.timestamp()[1])
    return next_offset


class ConfluentClient:
    """:class:`KafkaClient` over confluent-kafka (librdkafka).

    A consumer needs a ``group.id`` in librdkafka, but it is only a name here: partitions are
    ``assign``-ed, auto commit is off and nothing is ever committed.
    """

    def __init__(self, bootstrap: str, *, timeout_s: float = 30.0, max_message_bytes: int | None = None) -> None:
        from confluent_kafka import Consumer

        self._timeout_s = timeout_s
        self._max_message_bytes = max_message_bytes
        self._bootstrap = bootstrap
        self._probed = False  # the bootstrap servers were tried once (check_not_refused)
        self._position: tuple[str, int, int] | None = None  # (topic, partition, next offset) assigned
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": "gemline-ingest-reader",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "enable.partition.eof": False,
                "auto.offset.reset": "error",
                "logger": rdkafka_logger(),
                # librdkafka refuses a fetch response above this (default 100 MB: "Invalid response
                # size"), and one message larger than fetch.max.bytes still comes whole (KIP-74), so a
                # message the broker accepted could block its partition. At librdkafka's maximum any
                # message a broker can hold is received; ingest.max_message_bytes then decides its fate.
                "receive.message.max.bytes": RECEIVE_MAX_BYTES,
            }
        )

    def end_offsets(self, topic: str) -> dict[int, tuple[int, int]]:
        """See :meth:`KafkaClient.end_offsets`.

        Raises:
            BrokerUnreachableError: no metadata or offsets from the cluster within the timeout, or the
                cluster went away meanwhile.
            MissingInputError: the topic does not exist (a ValueError).
        """
        from confluent_kafka import KafkaException, TopicPartition

        if not self._probed:
            check_not_refused(self._bootstrap)
            self._probed = True
        try:
            meta = self._consumer.list_topics(topic, timeout=self._timeout_s).topics.get(topic)
        except KafkaException as exc:
            raise unreachable(self._bootstrap, self._timeout_s, exc) from exc
        if meta is None or meta.error is not None or not meta.partitions:
            raise MissingInputError(f"topic {topic!r} not found on the cluster ({meta and meta.error}); create it first")
        try:
            return {
                p: self._consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=self._timeout_s, cached=False)
                for p in sorted(meta.partitions)
            }
        except KafkaException as exc:  # the broker went away between the metadata and the offsets
            raise unreachable(self._bootstrap, self._timeout_s, exc) from exc

    def topic_id(self, topic: str) -> str | None:
        """See :meth:`KafkaClient.topic_id` (AdminClient ``describe_topics``; None when it fails)."""
        from confluent_kafka import KafkaException, TopicCollection
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self._bootstrap}, logger=rdkafka_logger())
        try:
            future = admin.describe_topics(TopicCollection([topic]), request_timeout=self._timeout_s)[topic]
            uuid = future.result(timeout=self._timeout_s).topic_id
        except (KafkaException, TimeoutError, ValueError, TypeError, AttributeError):
            return None
        text = None if uuid is None else str(uuid)
        return None if not text or text == "AAAAAAAAAAAAAAAAAAAAAA" else text  # the all-zero id means "none"

    def read_range(self, rng: OffsetRange) -> Iterator[KafkaRecord]:
        from confluent_kafka import TopicPartition

        if rng.num_offsets == 0:
            return
        self._consumer.assign([TopicPartition(rng.topic, rng.partition, rng.start)])
        try:
            next_offset = rng.start
            deadline = time.monotonic() + self._timeout_s
            while next_offset < rng.end:
                with gc_paused():
                    msgs = self._consumer.consume(num_messages=min(10_000, rng.end - next_offset), timeout=0.5)
                if not msgs:
                    _check_progress(rng, next_offset, deadline)
                    continue
                deadline = time.monotonic() + self._timeout_s
                for msg in msgs:
                    if msg.error() is not None:
                        raise message_error(f"{rng.topic}[{rng.partition}]", msg.error())
                    offset = cast(int, msg.offset())  # None only on an error message, raised above
                    # Guards against a message still queued from an earlier assignment or a re-fetch.
                    if msg.topic() != rng.topic or msg.partition() != rng.partition or offset < next_offset:
                        continue
                    if offset >= rng.end:
                        next_offset = rng.end
                        break
                    next_offset = offset + 1
                    _, ts = msg.timestamp()
                    yield _record(rng.topic, rng.partition, offset, msg.key(), msg.value(), ts, self._max_message_bytes)
        finally:
            self._consumer.unassign()
            self._position = None

    def read_batches(self, rng: OffsetRange, *, max_records: int) -> Generator[pa.RecordBatch, None, None]:
        """See :meth:`KafkaClient.read_batches`. Messages are consumed ``max_records`` at a time
        (``Consumer.consume(num_messages=...)``) and their fields go straight into column lists: no
        per-message record object, which cost more than the JSON parse of the message."""
        from confluent_kafka import TopicPartition

        if max_records < 1:
            raise ValueError(f"read_batches: expected max_records >= 1, got {max_records}")
        if rng.num_offsets == 0:
            return
        topic, partition = rng.topic, rng.partition
        self._consumer.assign([TopicPartition(topic, partition, rng.start)])
        try:
            next_offset = rng.start
            deadline = time.monotonic() + self._timeout_s
            offsets: list[int] = []
            keys: list[bytes | None] = []
            values: list[bytes | None] = []
            stamps: list[int] = []
            while next_offset < rng.end:
                want = min(max_records - len(offsets), rng.end - next_offset)
                # One pause over consume and unpack, the messages freed inside it: alive at the
                # re-enable, they would make the next young-generation collection walk all of them.
                with gc_paused():
                    msgs = self._consumer.consume(num_messages=want, timeout=0.5)
                    got = len(msgs)
                    if got:
                        next_offset = _take_columns(msgs, rng, next_offset, offsets, keys, values, stamps)
                    del msgs
                if not got:
                    _check_progress(rng, next_offset, deadline)
                    continue
                deadline = time.monotonic() + self._timeout_s
                if len(offsets) >= max_records or (offsets and next_offset >= rng.end):
                    yield _partition_batch(topic, partition, offsets, keys, values, stamps, self._max_message_bytes)
                    offsets, keys, values, stamps = [], [], [], []
        finally:
            self._consumer.unassign()
            self._position = None

    def fetch(self, topic: str, partition: int, offset: int, *, max_records: int,
              timeout_s: float) -> list[KafkaRecord]:
        from confluent_kafka import TopicPartition

        # Re-assigning drops librdkafka's prefetched queue, so keep the assignment while polls continue.
        if self._position != (topic, partition, offset):
            self._consumer.assign([TopicPartition(topic, partition, offset)])
        out: list[KafkaRecord] = []
        with gc_paused():
            msgs = self._consumer.consume(num_messages=max_records, timeout=timeout_s)
        for msg in msgs:
            if msg.error() is not None:
                self._position = None
                raise message_error(f"{topic}[{partition}] at offset >= {offset}", msg.error())
            msg_offset = cast(int, msg.offset())  # None only on an error message, raised above
            if msg.topic() != topic or msg.partition() != partition or msg_offset < offset:
                continue
            _, ts = msg.timestamp()
            out.append(_record(topic, partition, msg_offset, msg.key(), msg.value(), ts, self._max_message_bytes))
        self._position = (topic, partition, out[-1].offset + 1 if out else offset)
        return out

    def close(self) -> None:
        self._consumer.close()


class KafkaPythonClient:
    """:class:`KafkaClient` over kafka-python (no consumer group: ``group_id=None``)."""

    def __init__(self, bootstrap: str, *, timeout_s: float = 30.0, max_message_bytes: int | None = None) -> None:
        from kafka import KafkaConsumer

        self._timeout_s = timeout_s
        self._max_message_bytes = max_message_bytes
        self._position: tuple[str, int, int] | None = None
        self._consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                       request_timeout_ms=int(timeout_s * 1000) + 1000)

    def end_offsets(self, topic: str) -> dict[int, tuple[int, int]]:
        from kafka import TopicPartition

        parts = self._consumer.partitions_for_topic(topic)
        if not parts:
            raise MissingInputError(f"topic {topic!r} not found on the cluster; create it first")
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        timeout_ms = int(self._timeout_s * 1000)
        low = self._consumer.beginning_offsets(tps, timeout_ms=timeout_ms)
        high = self._consumer.end_offsets(tps, timeout_ms=timeout_ms)
        return {tp.partition: (low[tp], high[tp]) for tp in tps}

    def topic_id(self, topic: str) -> str | None:
        """See :meth:`KafkaClient.topic_id`: kafka-python does not expose topic ids, so None."""
        return None

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
                records = self._poll(tp, 0.5, min(10_000, rng.end - next_offset),
                                     f"{rng.topic}[{rng.partition}] [{rng.start}, {rng.end})")
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
                    yield _record(rng.topic, rng.partition, r.offset, r.key, r.value, r.timestamp, self._max_message_bytes)
        finally:
            self._consumer.unsubscribe()
            self._position = None

    def read_batches(self, rng: OffsetRange, *, max_records: int) -> Generator[pa.RecordBatch, None, None]:
        """See :meth:`KafkaClient.read_batches` (kafka-python builds a record object per message anyway)."""
        return batches_of(self.read_range(rng), max_records)

    def _poll(self, tp: Any, timeout_s: float, max_records: int, desc: str) -> list[Any]:
        from kafka.errors import UnsupportedCodecError

        try:
            return self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records).get(tp, [])
        except UnsupportedCodecError as exc:
            raise _codec_error(desc, exc) from exc

    def fetch(self, topic: str, partition: int, offset: int, *, max_records: int,
              timeout_s: float) -> list[KafkaRecord]:
        from kafka import TopicPartition

        tp = TopicPartition(topic, partition)
        if self._position != (topic, partition, offset):
            self._consumer.assign([tp])
            self._consumer.seek(tp, offset)
        records = self._poll(tp, timeout_s, max_records, f"{topic}[{partition}] from {offset}")
        out = [_record(topic, partition, r.offset, r.key, r.value, r.timestamp, self._max_message_bytes)
               for r in records if r.offset >= offset]
        self._position = (topic, partition, out[-1].offset + 1 if out else offset)
        return out

    def close(self) -> None:
        self._consumer.close()


def make_client(client: ClientName, bootstrap: str, *, timeout_s: float = 30.0,
                max_message_bytes: int | None = None) -> KafkaClient:
    """The :class:`KafkaClient` implementation named by ``KafkaConfig.client``.

    Raises:
        ValueError: an unknown client name.
    """
    if client == "confluent":
        return ConfluentClient(bootstrap, timeout_s=timeout_s, max_message_bytes=max_message_bytes)
    if client == "kafka-python":
        return KafkaPythonClient(bootstrap, timeout_s=timeout_s, max_message_bytes=max_message_bytes)
    raise ValueError(f"kafka client: expected 'confluent' or 'kafka-python', got {client!r}")


def commit_group_offsets(bootstrap: str, group_id: str, topic: str, offsets: Mapping[int, int], *,
                         timeout_s: float = 10.0) -> None:
    """Commit ``offsets`` (partition -> next offset to read) of ``topic`` to the consumer group ``group_id``
    through a short-lived kafka-python consumer that never joins the group, waiting about ``timeout_s``
    seconds at most (bootstrap, commit and close each bounded by it).

    A group commit with explicit offsets needs no group membership (generation -1, Kafka's "simple consumer"
    use of the group coordinator), so the group only mirrors the lake; the broker refuses it while consumers
    are members of the group. kafka-python whatever ``kafka.client`` reads the topic: librdkafka's consumer
    commit has no timeout (its close waited 45 s for the coordinator of a broker that did not answer), and its
    AdminClient ``alter_consumer_group_offsets`` with a request timeout aborted the process
    (``rd_kafka_enq_once_del_source_return: Assertion `eonce->refcnt > 0'``, SIGABRT) in the broker outage test.

    Raises:
        ValueError: an empty ``group_id``.
        BrokerUnreachableError: every bootstrap server refused the connection.
        BrokerTimeoutError: the commit did not complete within ``timeout_s``.
        kafka.errors.KafkaError: the broker refused the commit.
    """
    from kafka import KafkaConsumer
    from kafka import TopicPartition as KafkaTopicPartition
    from kafka.errors import KafkaTimeoutError
    from kafka.structs import OffsetAndMetadata

    if not group_id:
        raise ValueError("commit_group_offsets: expected a consumer group id, got ''")
    check_not_refused(bootstrap)
    timeout_ms = int(timeout_s * 1000)
    try:
        consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group_id, enable_auto_commit=False,
                                 request_timeout_ms=timeout_ms + 1000, bootstrap_timeout_ms=timeout_ms)
        try:
            consumer.commit({KafkaTopicPartition(topic, p): OffsetAndMetadata(o, "", -1)
                             for p, o in sorted(offsets.items())}, timeout_ms=timeout_ms)
        finally:
            consumer.close(autocommit=False, timeout_ms=timeout_ms)
    except KafkaTimeoutError as exc:
        raise BrokerTimeoutError(f"group {group_id!r}: no commit within {timeout_s:g} s ({exc})") from exc


def group_offsets(bootstrap: str, group_id: str, topic: str, partitions: Sequence[int], *,
                  timeout_s: float = 30.0) -> dict[int, int]:
    """The offsets (partition -> next offset to read) the consumer group ``group_id`` committed for
    ``topic``'s ``partitions``; a partition without a committed offset is left out.

    Raises:
        confluent_kafka.KafkaException: the broker did not answer within ``timeout_s``.
    """
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group_id, "enable.auto.commit": False,
                         "logger": rdkafka_logger()})
    try:
        committed = consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=timeout_s)
    finally:
        consumer.close()
    return {tp.partition: tp.offset for tp in committed if tp.offset >= 0}
