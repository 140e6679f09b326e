"""Vectorised twin of :func:`ingest.parse.parse_record`: one Arrow batch of Kafka messages -> events + dead letter.

Shape letters: N messages in a batch, G of them good, D = N - G dead.

The element that moves through the ingest pipeline is a ``pyarrow.RecordBatch`` of
:data:`RECORDS_SCHEMA` (topic, partition, offset, key, value, timestamp_ms), not one Python object
per message. :func:`parse_batch` decodes the N JSON values in one call of Arrow's JSON reader
(``pyarrow.json.read_json`` with an explicit schema: strict about types, so a bool, a float, a
string where an int is declared, or a key given twice fails the read) and validates the columns
with polars and numpy. It must give *exactly* the rows and reasons :func:`ingest.parse.parse_record`
gives message by message (tested on tables of cases and with hypothesis). Where the two could
disagree, the reference decides:

* a bad message of any kind: the vectorised checks only find *that* a row is bad; its reason and
  detail come from the reference, so both paths word them identically (bad rows are rare);
* values Arrow's reader frames or reads differently from Python's ``json``: invalid UTF-8, a
  control character (Arrow frames rows by newlines and accepts raw tabs in strings), not starting
  with ``{`` or not ending with ``}`` (Arrow skips blank lines and reads a top-level ``null`` as
  an all-null row);
* a chunk the reader rejects (a type other than declared, an ISO string time, ``{..}{..}`` on one
  line): it is split in halves until the halves read, down to chunks of :data:`LEAF_ROWS`, which
  go to the reference. Traffic whose times are ISO strings therefore takes the scalar path.

* rows that may hold a rule only the reference applies: a tombstone, a value above
  ``max_message_bytes`` (or cut by the reader), a key that is not UTF-8, a ``\\u`` escape of a
  surrogate (Python's ``json`` reads a lone one into a string Arrow cannot store), more opening
  brackets than :data:`ingest.parse.MAX_JSON_DEPTH` (the nesting limit is the reference's);
* anything at all, if the vectorised code itself fails on a batch: the batch is parsed by the
  reference, message by message, and a message the reference's row cannot be stored for is
  dead-lettered (``parse_failure``), so that no message can fail a batch.

:class:`ParseBatches` applies :func:`parse_batch` to the record batches that
``ingest.pipeline.ReadRecordBatches`` reads.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

# RECORDS_SCHEMA lives with the source that emits the batches.
from ingest.kafka_source import RECORDS_SCHEMA, KafkaRecord
from ingest.parse import (
    BLANK,
    DEAD_LETTER,
    GOOD,
    MAX_EVENT_TIME_US,
    MAX_JSON_DEPTH,
    MILLIS_BELOW,
    MIN_EVENT_TIME_US,
    SECONDS_BELOW,
    dead_row,
    parse_record,
)
from ingest.schema import DEAD_LETTER_SCHEMA, EVENT_TYPES, EVENTS_TABLE_SCHEMA, REQUIRED_FIELDS, SCHEMA_VERSION

log = logging.getLogger(__name__)

LEAF_ROWS = 32
"""A chunk this small that polars cannot decode as declared goes to the reference row by row."""

_STRING_FIELDS = ("event_id", "user_id", "item_id", "domain", "event_type", "category", "ad_format", "gender",
                  "location")
_INT_FIELDS = ("event_time_ms", "position", "age", "schema_version")
_INT32 = (-(2**31), 2**31 - 1)
# One object per line, no control characters: Arrow's reader frames rows by newlines and skips blank lines.
_FRAMED = r"^ *\{[^\x00-\x1f]*\} *$"
_SURROGATE_ESCAPE = r"\\[uU][dD][89a-fA-F]"
_DECLARED = pa.schema([pa.field(n, pa.string()) for n in _STRING_FIELDS] + [pa.field(n, pa.int64()) for n in _INT_FIELDS])
_PARSE_OPTIONS = pajson.ParseOptions(explicit_schema=_DECLARED, unexpected_field_behavior="ignore")
# 1 MiB blocks: a block that stays in the CPU cache while it is parsed; measured 2.1-2.4 us per
# 244-byte event against 3.7 with 64 MiB blocks. A row longer than a block fails the read and goes
# down the bisection to the per-record reference, as any row the reader rejects.
_READ_OPTIONS = pajson.ReadOptions(use_threads=False, block_size=1 << 20)


def _check_records(batch: pa.RecordBatch) -> None:
    if not batch.schema.equals(RECORDS_SCHEMA, check_metadata=False):
        raise TypeError(f"parse_batch: expected a RecordBatch of ingest.vectorized.RECORDS_SCHEMA {RECORDS_SCHEMA}, "
                        f"got {batch.schema}; build it with records_to_batch")


def _record(cols: dict[str, list[Any]], i: int) -> KafkaRecord:
    return KafkaRecord(cols["topic"][i], cols["partition"][i], cols["offset"][i], cols["key"][i], cols["value"][i],
                       cols["timestamp_ms"][i], cols["value_size"][i])


def _utf8(values: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """Values as strings (invalid ones and nulls null) and the mask of null or invalid UTF-8 rows."""
    try:
        strings = values.cast(pa.string())
    except pa.ArrowInvalid:
        good = []
        for v in values.to_pylist():
            try:
                good.append(None if v is None else v.decode("utf-8"))
            except UnicodeDecodeError:
                good.append(None)
        strings = pa.array(good, pa.string())
    return strings, strings.is_null().to_numpy(zero_copy_only=False)


def _reference_only(batch: pa.RecordBatch, strings: pa.Array, max_message_bytes: int | None) -> np.ndarray:
    """Rows a rule of the reference alone decides (see the module docstring): too large or cut,
    a key that is not UTF-8, a surrogate escape, more opening brackets than MAX_JSON_DEPTH."""
    n = batch.num_rows
    out = batch.column("value_size").is_valid().to_numpy(zero_copy_only=False).copy()
    if max_message_bytes is not None:
        out |= (pc.binary_length(batch.column("value")).fill_null(0).to_numpy(zero_copy_only=False)
                > max_message_bytes)
    keys = batch.column("key")
    try:
        keys.cast(pa.string())
    except pa.ArrowInvalid:
        for i, key in enumerate(keys.to_pylist()):
            try:
                if key is not None:
                    key.decode("utf-8")
            except UnicodeDecodeError:
                out[i] = True
    if n == 0 or strings.null_count == n:
        return out
    offsets = np.frombuffer(strings.buffers()[1], dtype=np.int32)[strings.offset: strings.offset + n + 1]
    data_buf = strings.buffers()[2]
    if data_buf is None:
        return out
    data = np.frombuffer(data_buf, dtype=np.uint8)[offsets[0]: offsets[-1]]
    ends = offsets[1:].astype(np.int64) - offsets[0]
    # Rows with a backslash are few: only those take the regex for a surrogate escape.
    slashed = np.unique(np.searchsorted(ends, np.flatnonzero(data == ord("\\")), side="right"))
    if len(slashed):
        found = pc.match_substring_regex(strings.take(pa.array(slashed)), _SURROGATE_ESCAPE).fill_null(False)
        out[slashed] |= found.to_numpy(zero_copy_only=False)
    opening = np.flatnonzero((data == ord("{")) | (data == ord("[")))
    per_row = np.bincount(np.searchsorted(ends, opening, side="right"), minlength=n)[:n]
    out |= per_row > MAX_JSON_DEPTH
    return out


def _suspicious(strings: pa.Array) -> np.ndarray:
    """Rows the two JSON readers might read differently (see the module docstring): rows not matching
    :data:`_FRAMED`, and null rows.

    Checked on the raw UTF-8 bytes instead of with the regex (a fifth of the parse time): a control
    character is a byte < 0x20 (UTF-8 multi-byte sequences only use bytes >= 0x80), and a row
    with none that starts with ``{`` and ends with ``}`` matches; the few rows that start or end
    otherwise (leading/trailing spaces, empty, not an object) take the regex.
    """
    n = len(strings)
    if n == 0:
        return np.zeros(0, dtype=bool)
    offsets = np.frombuffer(strings.buffers()[1], dtype=np.int32)[strings.offset: strings.offset + n + 1]
    data_buf = strings.buffers()[2]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, dtype=np.uint8)
    starts, ends = offsets[:-1].astype(np.int64), offsets[1:].astype(np.int64)
    nonempty = ends > starts
    first = np.zeros(n, dtype=np.uint8)
    last = np.zeros(n, dtype=np.uint8)
    first[nonempty] = data[starts[nonempty]]
    last[nonempty] = data[ends[nonempty] - 1]
    control = np.zeros(n, dtype=bool)
    positions = np.flatnonzero(data[starts[0]: ends[-1]] < 0x20) + starts[0] if ends[-1] > starts[0] else []
    if len(positions):
        rows = np.searchsorted(ends, positions, side="right")
        control[rows[rows < n]] = True
    nulls = strings.is_null().to_numpy(zero_copy_only=False)
    out = nulls | control
    odd = np.flatnonzero(~out & ((first != ord("{")) | (last != ord("}"))))
    if len(odd):
        framed = pc.match_substring_regex(strings.take(pa.array(odd)), _FRAMED).fill_null(False)
        out[odd] = ~framed.to_numpy(zero_copy_only=False)
    return out


def _suspicious_regex(strings: pa.Array) -> np.ndarray:
    """Reference of :func:`_suspicious`: the regex over every row (tests compare the two)."""
    framed = pc.match_substring_regex(strings, _FRAMED)
    return pc.invert(framed).fill_null(True).to_numpy(zero_copy_only=False)


def _joined_lines(strings: pa.Array) -> pa.Buffer:
    """The N strings as one buffer of newline-terminated lines, without a Python object per row."""
    lines = pc.binary_join_element_wise(strings, pa.scalar("", pa.string()), "\n")
    offsets = np.frombuffer(lines.buffers()[1], dtype=np.int32)[lines.offset: lines.offset + len(lines) + 1]
    return lines.buffers()[2][int(offsets[0]): int(offsets[-1])]


def _decode(strings: pa.Array, rows: np.ndarray, slow: np.ndarray) -> list[tuple[np.ndarray, pl.DataFrame]]:
    """Decode ``strings[rows]``; return (rows, frame) parts, marking in ``slow`` what must go to the reference.

    Bisection: a chunk that fails costs one more read of each half, so k bad rows cost
    O(k log(N / LEAF_ROWS)) extra reads of shrinking chunks.
    """
    if len(rows) == 0:
        return []
    chosen = strings if len(rows) == len(strings) else strings.take(pa.array(rows))  # rows are ascending, unique
    try:
        table = pajson.read_json(pa.BufferReader(_joined_lines(chosen)),
                                 read_options=_READ_OPTIONS, parse_options=_PARSE_OPTIONS)
        ok = table.num_rows == len(rows)  # ``{..}{..}`` on one line reads as two rows
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        ok = False
    if ok:
        return [(rows, pl.DataFrame(table))]
    if len(rows) <= LEAF_ROWS:
        slow[rows] = True
        return []
    half = len(rows) // 2
    return _decode(strings, rows[:half], slow) + _decode(strings, rows[half:], slow)


def _column(frame: pl.DataFrame, name: str, dtype: pl.DataType | type[pl.DataType]) -> pl.Series:
    if name in frame.columns:
        return frame[name].cast(dtype)
    return pl.Series(name, [None] * frame.height, dtype=dtype)


def _to_us(ms_or_other: np.ndarray) -> np.ndarray:
    """The unit rule of :func:`ingest.parse.event_time_to_us` on int64 values (overflow only in unused branches)."""
    v = ms_or_other
    with np.errstate(over="ignore"):
        seconds = (v > -SECONDS_BELOW) & (v < SECONDS_BELOW)
        millis = ~seconds & (v > -MILLIS_BELOW) & (v < MILLIS_BELOW)
        return np.where(seconds, v * 1_000_000, np.where(millis, v * 1_000, v))


def _validate(frame: pl.DataFrame, domains: frozenset[str], now_ms: int, skew_ms: int,
              retention_ms: int | None, min_event_time_ms: int | None) -> tuple[np.ndarray, dict[str, pl.Series]]:
    """Good-row mask (G of the frame's rows) and the typed columns, the checks of parse_record in bulk."""
    cols = {name: _column(frame, name, pl.String) for name in _STRING_FIELDS}
    cols.update({name: _column(frame, name, pl.Int64) for name in _INT_FIELDS})
    good = (cols["schema_version"].is_null() | (cols["schema_version"] == SCHEMA_VERSION)).fill_null(False)
    for name in REQUIRED_FIELDS:
        col = cols[name]
        good &= col.is_not_null() & ((col.str.strip_chars(BLANK) != "") if col.dtype == pl.String else True)
    for name in ("position", "age"):
        col = cols[name]
        good &= (col.is_null() | ((col >= _INT32[0]) & (col <= _INT32[1]))).fill_null(False)
    good &= cols["event_type"].is_in(list(EVENT_TYPES)).fill_null(False)
    good &= cols["domain"].is_in(sorted(domains)).fill_null(False)
    good_np = good.fill_null(False).to_numpy().copy()
    us = _to_us(cols["event_time_ms"].fill_null(0).to_numpy())
    good_np &= (us >= MIN_EVENT_TIME_US) & (us <= MAX_EVENT_TIME_US)
    good_np &= us <= (now_ms + skew_ms) * 1000
    if retention_ms is not None:
        good_np &= us >= (now_ms - retention_ms) * 1000
    if min_event_time_ms is not None:
        good_np &= us >= min_event_time_ms * 1000
    cols["event_time_us"] = pl.Series("event_time_us", us, dtype=pl.Int64)
    return good_np, cols


def _events_table(cols: dict[str, pl.Series], keep: np.ndarray, meta: pa.RecordBatch, rows: np.ndarray,
                  known: tuple[int, int, int]) -> pa.Table:
    """EVENTS_TABLE_SCHEMA rows for the frame rows ``keep`` whose batch rows are ``rows[keep]``."""
    take = pa.array(rows[keep])
    mask = pl.Series(keep)
    us = cols["event_time_us"].filter(mask).to_numpy()
    ms = np.floor_divide(us, 1000)
    days = np.floor_divide(ms, 86_400_000).astype("int32")
    dates = pa.array(days, pa.date32()).cast(pa.string())
    arrays: dict[str, pa.Array] = {}
    for field in EVENTS_TABLE_SCHEMA:
        name = field.name
        if name == "event_time_ms":
            arrays[name] = pa.array(ms, pa.int64())
        elif name == "event_time_us":
            arrays[name] = pa.array(us, pa.int64())
        elif name == "schema_version":
            arrays[name] = pa.array(np.full(len(us), SCHEMA_VERSION, dtype=np.int32))
        elif name == "event_date":
            arrays[name] = dates
        elif name in cols:
            arrays[name] = cols[name].filter(mask).to_arrow().cast(field.type)
        elif name == "kafka_generation":  # stamped by the ingest driver (ingest.pipeline)
            arrays[name] = pa.nulls(len(us), field.type)
        elif name == "created_ts_ms":  # the rule of ingest.parse.known_since, on columns
            stamps = meta.column("timestamp_ms").take(take).to_numpy()
            floor, ceiling, now_ms = known
            arrays[name] = pa.array(np.where((stamps < floor) | (stamps > ceiling), now_ms, stamps), pa.int64())
        else:
            source = {"kafka_topic": "topic", "kafka_partition": "partition", "kafka_offset": "offset"}[name]
            arrays[name] = meta.column(source).take(take)
    return pa.Table.from_arrays([arrays[f.name] for f in EVENTS_TABLE_SCHEMA], schema=EVENTS_TABLE_SCHEMA)


def parse_batch(
    batch: pa.RecordBatch,
    *,
    domains: Iterable[str],
    now_ms: int,
    max_future_skew_ms: int,
    retention_ms: int | None = None,
    min_event_time_ms: int | None = None,
    max_message_bytes: int | None = None,
) -> tuple[pa.Table, pa.Table]:
    """Validate N Kafka messages at once; same rules, rows and reasons as :func:`ingest.parse.parse_record`.

    Args:
        batch: N messages, a RecordBatch of :data:`RECORDS_SCHEMA`.
        domains, now_ms, max_future_skew_ms, retention_ms, min_event_time_ms, max_message_bytes: as for
            ``parse_record`` (ms since epoch UTC, ms, bytes).

    Returns:
        ``(events, dead)``: G rows of ``EVENTS_TABLE_SCHEMA`` and N - G rows of ``DEAD_LETTER_SCHEMA``,
        each in batch order; every message lands in exactly one. Should the vectorised code fail on
        the batch, the reference parses it message by message (:func:`parse_by_reference`).

    Raises:
        TypeError: ``batch`` is not of :data:`RECORDS_SCHEMA`.
    """
    _check_records(batch)
    rules: dict[str, Any] = dict(domains=frozenset(domains), now_ms=now_ms, max_future_skew_ms=max_future_skew_ms,
                 retention_ms=retention_ms, min_event_time_ms=min_event_time_ms, max_message_bytes=max_message_bytes)
    if batch.num_rows == 0:
        return EVENTS_TABLE_SCHEMA.empty_table(), DEAD_LETTER_SCHEMA.empty_table()
    try:
        return _parse_fast(batch, **rules)
    except Exception as exc:  # noqa: BLE001 -- no message may fail a batch: the reference decides alone
        first = batch.column("offset")[0].as_py()
        log.warning("parse_batch: the vectorised parser failed on %d messages from offset %s (%s: %s); "
                    "parsing them one by one", batch.num_rows, first, type(exc).__name__, exc)
        return parse_by_reference(batch, np.arange(batch.num_rows), **rules)


def parse_by_reference(batch: pa.RecordBatch, rows: np.ndarray, **rules: Any) -> tuple[pa.Table, pa.Table]:
    """``batch[rows]`` through :func:`ingest.parse.parse_record`, message by message: (events, dead) tables.

    A message whose events row cannot be stored in ``EVENTS_TABLE_SCHEMA`` (a rule the reference
    misses) is dead-lettered as ``parse_failure`` instead of failing the batch.

    Args:
        rows: (R,) int64 ascending row indices of ``batch``.
        rules: the keyword arguments of ``parse_record``.
    """
    events, dead, _ = _by_reference(batch, rows, **rules)
    return events, dead


def _by_reference(batch: pa.RecordBatch, rows: np.ndarray, **rules: Any) -> tuple[pa.Table, pa.Table, np.ndarray]:
    """:func:`parse_by_reference`, plus the (G,) batch row index of each events row."""
    meta = {name: batch.column(name).take(pa.array(rows, pa.int64())).to_pylist() for name in RECORDS_SCHEMA.names}
    ok_rows, dead_rows = [], []
    for j in range(len(rows)):
        rec = _record(meta, j)
        kind, row = parse_record(rec, **rules)
        if kind == "ok":
            ok_rows.append((int(rows[j]), rec, row))
        else:
            dead_rows.append((int(rows[j]), row))
    try:
        events = pa.Table.from_pylist([row for _, _, row in ok_rows], schema=EVENTS_TABLE_SCHEMA)
        index = [i for i, _, _ in ok_rows]
    except Exception:  # noqa: BLE001 -- find the culprits one by one
        kept, index = [], []
        for i, rec, row in ok_rows:
            try:
                pa.Table.from_pylist([row], schema=EVENTS_TABLE_SCHEMA)
                kept.append(row)
                index.append(i)
            except Exception as exc:  # noqa: BLE001
                dead_rows.append((i, dead_row(rec, "parse_failure", f"{type(exc).__name__}: {exc}")))
        events = pa.Table.from_pylist(kept, schema=EVENTS_TABLE_SCHEMA)
        dead_rows.sort(key=lambda r: r[0])
    dead = pa.Table.from_pylist([row for _, row in dead_rows], schema=DEAD_LETTER_SCHEMA)
    return events, dead, np.asarray(index, dtype=np.int64)


def _parse_fast(batch: pa.RecordBatch, *, domains: frozenset[str], now_ms: int, max_future_skew_ms: int,
                retention_ms: int | None, min_event_time_ms: int | None,
                max_message_bytes: int | None) -> tuple[pa.Table, pa.Table]:
    strings, slow = _utf8(batch.column("value"))
    slow |= _suspicious(strings)
    slow |= _reference_only(batch, strings, max_message_bytes)
    parts = _decode(strings, np.flatnonzero(~slow), slow)
    floor = 0 if min_event_time_ms is None else max(min_event_time_ms, 0)
    known = (floor, now_ms + max_future_skew_ms, now_ms)

    fast_tables, fast_index = [], []
    for rows, frame in parts:
        good, cols = _validate(frame, domains, now_ms, max_future_skew_ms, retention_ms, min_event_time_ms)
        slow[rows[~good]] = True
        if good.any():
            fast_tables.append(_events_table(cols, good, batch, rows, known))
            fast_index.append(rows[good])

    slow_rows = np.flatnonzero(slow)
    ok_events, dead, ok_index = _by_reference(batch, slow_rows, domains=domains, now_ms=now_ms,
                                         max_future_skew_ms=max_future_skew_ms, retention_ms=retention_ms,
                                         min_event_time_ms=min_event_time_ms, max_message_bytes=max_message_bytes)
    if ok_events.num_rows or len(fast_tables) != 1:
        events = pa.concat_tables(fast_tables + [ok_events])
        order = np.argsort(np.concatenate(fast_index + [ok_index]), kind="stable")
        events = events.take(pa.array(order)) if events.num_rows else events
    else:  # one decoded part and no row from the reference: already in batch order
        events = fast_tables[0]
    return events, dead


class _ParseBatchFn(beam.DoFn):
    def __init__(self, domains: tuple[str, ...], now_ms: int, skew_ms: int, retention_ms: int | None,
                 min_event_time_ms: int | None, max_message_bytes: int | None) -> None:
        self._args: dict[str, Any] = dict(domains=domains, now_ms=now_ms, max_future_skew_ms=skew_ms, retention_ms=retention_ms,
                          min_event_time_ms=min_event_time_ms, max_message_bytes=max_message_bytes)

    def process(self, batch: pa.RecordBatch) -> Iterator[Any]:
        events, dead = parse_batch(batch, **self._args)
        if events.num_rows:
            yield events
        if dead.num_rows:
            yield beam.pvalue.TaggedOutput(DEAD_LETTER, dead)


class ParseBatches(beam.PTransform):
    """PCollection[RecordBatch] -> tagged ``good`` (events pa.Table) and ``dead_letter`` (pa.Table) outputs.

    Same rules as the reference twin :func:`ingest.parse.parse_record` (see :func:`parse_batch`).

    Raises:
        ValueError: no domains, a negative skew or retention.
    """

    def __init__(self, domains: Iterable[str], now_ms: int, max_future_skew_ms: int,
                 retention_ms: int | None = None, *, min_event_time_ms: int | None = None,
                 max_message_bytes: int | None = None) -> None:
        super().__init__()
        self._domains = tuple(domains)
        if not self._domains:
            raise ValueError("ParseBatches: expected at least one domain, got none")
        if max_future_skew_ms < 0:
            raise ValueError(f"ParseBatches: expected max_future_skew_ms >= 0, got {max_future_skew_ms}")
        if retention_ms is not None and retention_ms < 0:
            raise ValueError(f"ParseBatches: expected retention_ms >= 0 or None, got {retention_ms}")
        self._fn = _ParseBatchFn(self._domains, int(now_ms), int(max_future_skew_ms), retention_ms, min_event_time_ms,
                                 max_message_bytes)

    def expand(self, batches: beam.PCollection) -> beam.pvalue.DoOutputsTuple:
        return batches | "ParseBatch" >> beam.ParDo(self._fn).with_outputs(DEAD_LETTER, main=GOOD)
