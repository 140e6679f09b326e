"""The ingest job: one bounded Kafka snapshot -> ``dead_letter`` and ``events`` Delta tables, exactly once.

The lake, not a Kafka consumer group, records what was consumed. Each run is one batch with
``app_id = "ingest:<topic>"`` and ``batch_version`` = the last events app-transaction version + 1:

1. Plan. Start offsets are the ``end_offsets`` in the metadata of the app's last ``events``
   commit (the low watermark, normally 0, for a partition never seen); ends are the high watermarks now
   (:func:`ingest.kafka_source.plan_topic`). If ``dead_letter`` already holds
   ``batch_version`` (a crash between the two commits), the ranges and the clock recorded in
   that commit are reused instead, so the rerun reads and decides exactly as the crashed run did.
   With ``IngestConfig.max_offsets_per_partition`` set, each range is cut to that many offsets
   (:func:`cap_ranges`): a backlog is then ingested in batches of bounded memory by running again
   until the run is skipped (``ingest_backlog``).
2. Skip when every range is empty: nothing is written.
3. Read and parse the ranges: in this process (:func:`_run_in_process`, ``ingest.engine``'s default on one
   machine), or as the Beam pipeline (:func:`uses_beam`): :class:`ReadRecordBatches` (the splittable ``ReadPartitionFn`` of
   ``ingest.kafka_source`` emitting Arrow record batches of up to ``IngestConfig.batch_max_records``
   messages of one partition; a Reshuffle of the batches only with ``IngestConfig.reshuffle``)
   -> ``ParseBatches`` (vectorised, ``ingest.vectorized``) -> one Arrow IPC file per bundle under
   ``LAKE/_staging/ingest/<batch_version>/{events,dead_letter}/``.
4. On the driver: read the staged rows (deduplicated by Kafka (partition, offset), since a
   retried bundle may stage twice); drop duplicate deliveries of an event_id within
   ``dedup_window_ms`` (against this batch and a filtered read of the committed events,
   ``ingest.dedup``); move events more than ``allowed_lateness_ms`` behind their partition's
   watermark to ``late_events``. Commit ``dead_letter``, then ``late_events``, then ``events``
   (partitioned by ``event_date``), each tagged (app_id, batch_version) and carrying
   ``{"offset_ranges", "end_offsets", "now_ms", "watermarks_ms", "duplicates_dropped",
   "duplicates_dropped_offsets", "late_events", "rules", "topic_identity", "generation", "gaps"}``
   (and ``"reset"`` when the batch started over on the topic); remove the staging dir. Every row carries
   the batch's topic generation (``kafka_generation``, :mod:`ingest.schema`); ``duplicates_dropped_offsets``
   names the offsets counted in ``duplicates_dropped`` (``{"<partition>": [[start, end), ...]}``), so that
   ``gemline audit`` (:mod:`ingest.audit`) can account for every offset read.

Each commit is atomic and idempotent, and ``events`` moves the offsets only after
``dead_letter`` and ``late_events`` hold the same batch, so a crash anywhere loses no record and
writes none twice. Dedup and lateness depend only on the ranges, the clock, and lake state that
only the ``events`` commit changes, so a recovery run decides as the crashed run did.
Run one ingest job per topic at a time: two concurrent runs would plan the same batch.

5. After the ``events`` commit, the same ``end_offsets`` are committed to the Kafka consumer group
   ``IngestConfig.group_id`` (:func:`mirror_to_group`) for lag monitors only: a crash before it, or a
   failed group commit, leaves the group behind the lake until the next batch, and nothing reads it back.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.feather as feather
from apache_beam.options.pipeline_options import PipelineOptions

from gemline.beam_runner import local_runner_args
from gemline.errors import BadConfigError
from gemline.lake import Lake, commit_metadata, committed_version, is_remote, open_table
from gemline.locks import holding
from gemline.tables import Table, commit
from ingest.config import IngestConfig, KafkaConfig
from ingest.dedup import (
    committed_ids,
    committed_payloads,
    conflict_dead_letter,
    drop_duplicates,
    dropped_offsets,
    split_conflicts,
    split_late,
)
from ingest.kafka_clients import commit_group_offsets, make_client
from ingest.kafka_source import ClientName, OffsetRange, ReadPartitionFn, TopicChangedError, TopicIdentity, plan_topic
from ingest.parse import DEAD_LETTER, GOOD
from ingest.schema import DEAD_LETTER_SCHEMA, EVENTS_TABLE_SCHEMA
from ingest.vectorized import ParseBatches, parse_batch

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class IngestResult:
    """What one :func:`run_ingest` call did.

    ``events_written`` / ``dead_letter_written`` count rows this call committed (0 for a table
    whose batch was already committed, e.g. ``dead_letter`` in a recovery run).
    """

    batch_version: int
    """App-transaction version of this batch (the version that would have been used when skipped)."""
    events_written: int
    dead_letter_written: int
    offset_ranges: tuple[OffsetRange, ...]
    skipped: bool
    """True when every range was empty and nothing was written."""
    recovered: bool = False
    """True when the ranges came from a ``dead_letter`` commit left by a crashed run."""
    duplicates_dropped: int = 0
    """Duplicate deliveries of an event_id within ``dedup_window_ms`` this batch dropped."""
    late_events_written: int = 0
    """Rows this call committed to ``late_events`` (behind the watermark by more than the allowed lateness)."""
    duplicate_conflicts: int = 0
    """Second deliveries of an event_id with another payload, dead-lettered as ``duplicate_conflict``."""
    gaps: tuple[tuple[int, int, int], ...] = ()
    """(partition, first, end) offsets retention deleted before they were ingested; recorded in the commit."""
    rules_changed: tuple[str, ...] = ()
    """Fate-deciding settings changed since the recovered batch was planned (the batch kept the old ones)."""
    reset: bool = False
    """True when this batch started over on the topic (``--reset-topic``)."""


def app_id_for(topic: str) -> str:
    """Writer identity of the ingest job for ``topic`` in app transactions."""
    return f"ingest:{topic}"


def staging_dir(lake: str | Path, batch_version: int) -> Path:
    """Per-batch staging directory ``LAKE/_staging/ingest/<batch_version>`` (local lake only).

    Raises:
        ValueError: ``lake`` is an object-store URI; :func:`run_ingest` stages those batches in a
            local temporary directory instead (see :func:`_stage_for`).
    """
    if is_remote(lake):
        raise ValueError(f"staging_dir: expected a local lake path, got the URI {str(lake)!r}; "
                         "remote lakes stage in a local temporary directory")
    return Path(lake) / "_staging" / "ingest" / str(batch_version)


def _stage_for(lake: str | Path, batch_version: int) -> Path:
    """Where this batch's Beam workers stage their rows (Arrow IPC files) before the commit.

    A remote lake stages in a fresh local ``tempfile.mkdtemp`` directory: Beam's DirectRunner
    workers share this machine's disk, and a crashed batch is recomputed from its recorded offset
    ranges, so nothing is lost with the temp dir. Multi-machine runners need a shared staging
    location instead (not supported yet).
    """
    if is_remote(lake):
        return Path(tempfile.mkdtemp(prefix=f"gemline-ingest-{batch_version}-"))
    return staging_dir(lake, batch_version)


RULE_FIELDS: tuple[str, ...] = ("domains", "max_future_skew_ms", "retention_days", "dedup_window_ms",
                                 "allowed_lateness_ms", "min_event_time_ms", "max_message_bytes")
"""The ``IngestConfig`` settings that decide a message's fate (events, dead_letter, late_events or
dropped). Recorded with each batch; a recovery run reuses the crashed batch's values."""


def rules_of(ingest: IngestConfig) -> dict[str, Any]:
    """The :data:`RULE_FIELDS` of ``ingest`` as JSON values."""
    return {name: list(getattr(ingest, name)) if name == "domains" else getattr(ingest, name) for name in RULE_FIELDS}


def with_rules(ingest: IngestConfig, rules: dict[str, Any]) -> IngestConfig:
    """``ingest`` with the recorded ``rules`` (fields missing from an older record keep ``ingest``'s value)."""
    known: dict[str, Any] = {k: (tuple(v) if k == "domains" else v) for k, v in rules.items() if k in RULE_FIELDS}
    return dataclasses.replace(ingest, **known)


@dataclass(frozen=True)
class _Plan:
    batch_version: int
    ranges: tuple[OffsetRange, ...]
    end_offsets: dict[int, int]
    now_ms: int
    recovered: bool
    watermarks_ms: dict[int, int]
    rules: IngestConfig
    """The ingest settings this batch decides by (the crashed run's on recovery)."""
    identity: TopicIdentity
    gaps: dict[int, tuple[int, int]]
    rules_changed: tuple[str, ...] = ()
    reset: dict[str, Any] | None = None
    generation: int | None = 0
    """The topic generation stamped on the rows (``kafka_generation``, :mod:`ingest.schema`); None only for a
    recovered batch planned before generations existed (its rows stay null, its metadata without one)."""


def cap_ranges(ranges: list[OffsetRange], max_offsets: int | None) -> list[OffsetRange]:
    """``ranges`` with each cut to its first ``max_offsets`` offsets (``IngestConfig.max_offsets_per_partition``;
    None: unchanged). The next batch starts where a cut range ends, so a backlog is read in bounded batches.

    Raises:
        ValueError: ``max_offsets < 1``.
    """
    if max_offsets is None:
        return list(ranges)
    if max_offsets < 1:
        raise ValueError(f"cap_ranges: expected max_offsets >= 1 or None, got {max_offsets}")
    return [OffsetRange(r.topic, r.partition, r.start, min(r.end, r.start + max_offsets)) for r in ranges]


def _generation_of(lake: Lake, app_id: str, events_meta: dict[str, Any]) -> int | None:
    """The generation of the app's last ``events`` commit (``events_meta``): its recorded ``generation``; for a
    commit from before generations were recorded, the ``--reset-topic`` batches among the app's commits (the
    first commit starts generation 0, each later reset one more); None when the app never committed."""
    if not events_meta:
        return None
    if "generation" in events_meta:
        return int(events_meta["generation"])
    dt = open_table(lake.root, Table.EVENTS, storage_options=lake.delta_options)
    generation = -1
    for entry in [] if dt is None else reversed(dt.history()):  # oldest first
        meta = json.loads(entry["gemline"]) if entry.get("gemline") else {}
        if meta.get("app_id") == app_id:
            generation = 0 if generation < 0 else generation + ("reset" in meta)
    return max(generation, 0)


def stamp_generation(table: pa.Table, generation: int | None) -> pa.Table:
    """``table`` (events or dead-letter rows) with ``kafka_generation`` set to ``generation`` on every row
    (None: left as it is, null)."""
    if generation is None:
        return table
    i = table.schema.get_field_index("kafka_generation")
    return table.set_column(i, table.schema.field(i), pa.array(np.full(table.num_rows, generation, np.int32)))


def _plan_batch(lake: Lake, kafka: KafkaConfig, ingest: IngestConfig, bootstrap: str, now_ms: int | None,
                reset_topic: bool = False) -> _Plan:
    """Decide the batch: version, ranges, clock, rules (fresh, or recovered from a dead_letter commit)."""
    root, topic, opts = lake.root, kafka.topic, lake.delta_options
    app_id = app_id_for(topic)
    last_events = committed_version(root, Table.EVENTS, app_id, storage_options=opts)
    batch_version = 0 if last_events is None else last_events + 1
    events_meta = commit_metadata(root, Table.EVENTS, app_id, storage_options=opts) or {}
    prev_ends = {int(p): int(e) for p, e in events_meta.get("end_offsets", {}).items()}
    marks = {int(p): int(w) for p, w in events_meta.get("watermarks_ms", {}).items()}
    identity = events_meta.get("topic_identity")
    previous = None if identity is None else TopicIdentity.from_dict(identity)
    plan_args: dict[str, Any] = dict(client=kafka.client, timeout_s=ingest.read_timeout_s)

    last_dead = committed_version(root, Table.DEAD_LETTER, app_id, storage_options=opts)
    if last_dead is not None and last_dead > batch_version:
        raise RuntimeError(f"{Table.DEAD_LETTER} holds batch {last_dead} of {app_id!r} but {Table.EVENTS} only "
                           f"{last_events}: the tables were changed outside the ingest job; restore them together")
    if last_dead == batch_version:
        meta = commit_metadata(root, Table.DEAD_LETTER, app_id, storage_options=opts)
        assert meta is not None, "dead_letter has a txn version but no gemline metadata"
        ranges = tuple(OffsetRange.from_dict(d) for d in meta["offset_ranges"])
        ends = {int(p): int(e) for p, e in meta["end_offsets"].items()}
        rules = with_rules(ingest, meta.get("rules", {}))
        changed = tuple(k for k in RULE_FIELDS if getattr(rules, k) != getattr(ingest, k))
        if changed:
            log.warning("ingest %s: recovering batch %d with the settings it was planned with, overriding at run time "
                        "%s (the configured values apply from the next batch)", app_id, batch_version,
                        "; ".join(f"ingest.{k}={getattr(ingest, k)!r} configured, {getattr(rules, k)!r} used"
                                  for k in changed))
        recorded = meta.get("topic_identity")
        snapshot_identity = previous if recorded is None else TopicIdentity.from_dict(recorded)
        if recorded is not None:  # the crashed run's topic must still be there
            plan_topic(bootstrap, topic, {}, previous=snapshot_identity, fixed=list(ranges), **plan_args)
        log.info("ingest %s: recovering batch %d from its dead_letter commit (%d ranges)",
                 app_id, batch_version, len(ranges))
        gaps = {int(g["partition"]): (int(g["start"]), int(g["end"])) for g in meta.get("gaps", [])}
        recorded_generation = meta.get("generation")  # absent: a batch planned before generations, kept so
        return _Plan(batch_version, ranges, ends, int(meta["now_ms"]), recovered=True, watermarks_ms=marks,
                     rules=rules, identity=snapshot_identity or TopicIdentity(None, 0, {}), gaps=gaps,
                     rules_changed=changed, reset=meta.get("reset"),
                     generation=None if recorded_generation is None else int(recorded_generation))

    last_generation = _generation_of(lake, app_id, events_meta)
    reset = None
    if reset_topic and previous is not None:
        try:  # a deliberate start-over is for a topic that changed; the same topic would be read again from 0
            plan_topic(bootstrap, topic, prev_ends, previous=previous, **plan_args)
        except TopicChangedError:
            pass
        else:
            raise BadConfigError(f"topic {topic!r} is the one the lake read (same id, partitions and records at the "
                                 "committed offsets): --reset-topic would read it again from the start; nothing to reset")
    if reset_topic:
        reset = {"previous_end_offsets": {str(p): e for p, e in sorted(prev_ends.items())},
                 "previous_topic_id": None if previous is None else previous.topic_id,
                 "at_ms": int(time.time() * 1000)}
        prev_ends, previous = {}, None
    snap = plan_topic(bootstrap, topic, prev_ends, previous=previous,
                      max_offsets=ingest.max_offsets_per_partition, **plan_args)
    ranges = tuple(snap.ranges)
    ends = {**prev_ends, **{r.partition: r.end for r in ranges}} if not reset_topic else {r.partition: r.end
                                                                                           for r in ranges}
    clock_ms = int(time.time() * 1000) if now_ms is None else int(now_ms)
    generation = 0 if last_generation is None else last_generation + (1 if reset_topic else 0)
    return _Plan(batch_version, ranges, ends, clock_ms, recovered=False, watermarks_ms=marks, rules=ingest,
                 identity=snap.identity, gaps=snap.gaps, reset=reset, generation=generation)


STAGED_SUFFIX = ".arrow"
"""Staged files: Arrow IPC (``pyarrow.feather``, LZ4), one per bundle."""


class _StageArrowFn(beam.DoFn):
    """Buffers a bundle's rows (dicts or Arrow tables) and writes them as one LZ4 Arrow IPC file
    (aside, then renamed)."""

    def __init__(self, directory: str, schema: pa.Schema) -> None:
        self._dir = directory
        self._schema = schema
        self._rows: list[dict[str, Any]] = []
        self._tables: list[pa.Table] = []

    def start_bundle(self) -> None:
        self._rows = []
        self._tables = []

    def process(self, row: dict[str, Any] | pa.Table) -> Iterator[Any]:
        if isinstance(row, pa.Table):
            if not row.schema.equals(self._schema):
                raise TypeError(f"StageRows: expected tables of schema {self._schema}, got {row.schema}")
            self._tables.append(row)
        else:
            self._rows.append(row)
        return iter(())

    def finish_bundle(self) -> None:
        if not self._rows and not self._tables:
            return
        table = pa.concat_tables(self._tables + [pa.Table.from_pylist(self._rows, schema=self._schema)])
        name = uuid.uuid4().hex
        if table.num_rows and {"kafka_partition", "kafka_offset"} <= set(table.column_names):
            # Named by the first (partition, offset), so that the files of bundles that each read
            # one partition in order list in (partition, offset) order and read_staged need not sort.
            first = (table["kafka_partition"][0].as_py(), table["kafka_offset"][0].as_py())
            name = f"{first[0]:010d}-{first[1]:020d}-{name}"
        tmp = os.path.join(self._dir, f".{name}.tmp")
        feather.write_feather(table, tmp, compression="lz4")
        os.replace(tmp, os.path.join(self._dir, f"{name}{STAGED_SUFFIX}"))
        self._rows = []
        self._tables = []


class StageRows(beam.PTransform):
    """PCollection[row dict | pa.Table of ``schema``] -> Arrow IPC files of ``schema`` in ``directory`` (one per bundle).

    Arrow IPC with LZ4, not Parquet: staged rows are read back once, by the driver, soon after.
    Measured on 50,000 events: 0.28 + 0.15 us per row to write and read, against 1.25 + 0.87 for
    Parquet with pyarrow's defaults, ~2 us per event of the job's ~20.

    The directory must exist. Files are renamed into place only when complete, so a reader sees
    whole files; a retried bundle can leave a duplicate, which the driver removes by Kafka
    coordinates (:func:`read_staged`).
    """

    def __init__(self, directory: str | Path, schema: pa.Schema) -> None:
        super().__init__()
        self._dir = str(directory)
        self._schema = schema

    def expand(self, rows: beam.PCollection) -> beam.PCollection:
        return rows | "WriteArrow" >> beam.ParDo(_StageArrowFn(self._dir, self._schema))


def read_staged(directory: str | Path, schema: pa.Schema) -> pa.Table:
    """All staged rows of ``directory`` as one table of ``schema``, sorted by (kafka_partition,
    kafka_offset) with duplicates of the same coordinates dropped.

    Raises:
        ValueError: a staged file does not match ``schema``.
    """
    files = sorted(str(p) for p in Path(directory).glob(f"*{STAGED_SUFFIX}"))
    if not files:
        return schema.empty_table()
    table = pads.dataset(files, format="ipc", schema=schema).to_table()
    if table.schema != schema:
        raise ValueError(f"staged rows in {directory}: expected schema {schema}, got {table.schema}")
    return in_kafka_order(table)


def in_kafka_order(table: pa.Table) -> pa.Table:
    """``table`` sorted by (kafka_partition, kafka_offset), a second row of the same coordinates dropped."""
    parts = table["kafka_partition"].to_numpy()
    offsets = table["kafka_offset"].to_numpy()
    order = np.lexsort((offsets, parts))
    # Taking every column in a new order costs ~1 us per row: skip it when the files already are.
    if not np.array_equal(order, np.arange(len(order))):
        table, parts, offsets = table.take(pa.array(order)), parts[order], offsets[order]
    keep = np.ones(len(table), dtype=bool)
    keep[1:] = (parts[1:] != parts[:-1]) | (offsets[1:] != offsets[:-1])
    return table if keep.all() else table.filter(pa.array(keep))


def _check_batch(events: pa.Table, dead: pa.Table, ranges: tuple[OffsetRange, ...]) -> None:
    """Invariants before committing: no record in both tables, none outside its planned range.

    ``events`` and ``dead`` each hold a (kafka_partition, kafka_offset) at most once (``read_staged``).
    """
    parts = np.concatenate([events["kafka_partition"].to_numpy(), dead["kafka_partition"].to_numpy()]).astype(np.int64)
    offsets = np.concatenate([events["kafka_offset"].to_numpy(), dead["kafka_offset"].to_numpy()]).astype(np.int64)
    order = np.lexsort((offsets, parts))
    same = (parts[order][1:] == parts[order][:-1]) & (offsets[order][1:] == offsets[order][:-1])
    if same.any():
        both = sorted({(int(parts[order][i]), int(offsets[order][i])) for i in np.flatnonzero(same)})
        raise RuntimeError(f"records {both[:5]} were staged to both tables")
    by_part = {r.partition: r for r in ranges}
    for part in np.unique(parts):
        rng = by_part.get(int(part))
        in_part = offsets[parts == part]
        outside = in_part if rng is None else in_part[(in_part < rng.start) | (in_part >= rng.end)]
        if len(outside):
            raise RuntimeError(f"record {int(part)}:{int(outside[0])} is outside the planned ranges {ranges}")
    planned = sum(r.num_offsets for r in ranges)
    if len(parts) != planned:
        # Real Kafka can leave offset gaps (compaction, transaction markers); tansu does not.
        log.warning("ingest: %d records for %d planned offsets (gaps in the log?)", len(parts), planned)


class ReadRecordBatches(beam.PTransform):
    """PCollection[OffsetRange] -> PCollection[pa.RecordBatch of ``ingest.kafka_source.RECORDS_SCHEMA``].

    The splittable ``ReadPartitionFn`` in batch mode: it consumes ``max_records`` messages at a
    time and emits them as one Arrow record batch, claimed at once, so Beam's per-element cost
    (a windowed value, a coder round trip) is paid per batch, not per message: one KafkaRecord
    per element cost ~80% of the job's CPU on the DirectRunner.

    ``reshuffle=True`` adds a fusion break after the read: the batches are spread over workers
    (parsing can then use more workers than there are partitions) and checkpointed, so a
    downstream retry replays them instead of re-reading Kafka. Off by default: on the DirectRunner
    the shuffle pickles and copies every batch several times, ~5 us of CPU per event, a third of
    the whole job (``benchmarks/ingest.py``); without it a retried bundle re-reads its offset
    range, which yields the same records, and the staging dedup by Kafka coordinates holds.
    """

    def __init__(self, *, bootstrap: str, client: ClientName, timeout_s: float, max_records: int,
                 reshuffle: bool = False, max_message_bytes: int | None = None) -> None:
        super().__init__()
        self._read = ReadPartitionFn(client, bootstrap, timeout_s, batch_records=max_records,
                                     max_message_bytes=max_message_bytes)
        self._reshuffle = reshuffle

    def expand(self, ranges: beam.PCollection) -> beam.PCollection:
        batches = ranges | "ReadRange" >> beam.ParDo(self._read)
        return batches | "Reshuffle" >> beam.Reshuffle() if self._reshuffle else batches


def _run_beam(kafka: KafkaConfig, ingest: IngestConfig, bootstrap: str, plan: _Plan, stage: Path,
              beam_args: list[str]) -> None:
    options = PipelineOptions(local_runner_args([f"--runner={ingest.runner}", *beam_args]))
    nonempty = [r for r in plan.ranges if r.num_offsets > 0]
    with beam.Pipeline(options=options) as p:
        parsed = (
            p
            | "Ranges" >> beam.Create(nonempty)
            | "ReadKafka" >> ReadRecordBatches(bootstrap=bootstrap, client=kafka.client,
                                               timeout_s=ingest.read_timeout_s,
                                               max_records=ingest.batch_max_records,
                                               reshuffle=ingest.reshuffle,
                                               max_message_bytes=plan.rules.max_message_bytes)
            | "ParseBatches" >> ParseBatches(plan.rules.domains, plan.now_ms, plan.rules.max_future_skew_ms,
                                             plan.rules.retention_ms, min_event_time_ms=plan.rules.min_event_time_ms,
                                             max_message_bytes=plan.rules.max_message_bytes)
        )
        _ = parsed[GOOD] | "StageEvents" >> StageRows(stage / Table.EVENTS, EVENTS_TABLE_SCHEMA)
        _ = parsed[DEAD_LETTER] | "StageDeadLetter" >> StageRows(stage / Table.DEAD_LETTER, DEAD_LETTER_SCHEMA)


def uses_beam(ingest: IngestConfig, beam_args: list[str] | None) -> bool:
    """Whether a batch runs as a Beam pipeline (:func:`_run_beam`): ``ingest.engine = "beam"``, or ``"auto"`` with
    Beam flags or a runner other than the DirectRunner; otherwise in this process (:func:`_run_in_process`).

    Raises:
        BadConfigError: ``ingest.engine = "inprocess"`` with Beam flags or another runner (they would be ignored).
    """
    beam_wanted = bool(beam_args) or ingest.runner != "DirectRunner"
    if ingest.engine == "inprocess" and beam_wanted:
        raise BadConfigError(f"ingest.engine='inprocess' runs no Beam pipeline, so the Beam flags {beam_args or []} "
                             f"and runner {ingest.runner!r} would be ignored: drop them, or set ingest.engine=beam "
                             "(or auto)")
    return ingest.engine == "beam" or (ingest.engine == "auto" and beam_wanted)


def _run_in_process(kafka: KafkaConfig, ingest: IngestConfig, bootstrap: str, plan: _Plan) -> tuple[pa.Table, pa.Table]:
    """:func:`_run_beam`'s work in this process: each planned range read in record batches of up to
    ``ingest.batch_max_records`` messages (the client ``ReadPartitionFn`` uses) and parsed by the same function
    (:func:`ingest.vectorized.parse_batch`), without a pipeline per batch and without staging files.

    Returns:
        (events of ``EVENTS_TABLE_SCHEMA``, dead-letter rows of ``DEAD_LETTER_SCHEMA``), each in (partition,
        offset) order, as :func:`read_staged` returns the Beam path's.

    Raises:
        whatever the Kafka client raises (a timeout, a refused connection).
    """
    args: dict[str, Any] = dict(
        domains=plan.rules.domains, now_ms=int(plan.now_ms), max_future_skew_ms=plan.rules.max_future_skew_ms,
        retention_ms=plan.rules.retention_ms, min_event_time_ms=plan.rules.min_event_time_ms,
        max_message_bytes=plan.rules.max_message_bytes)
    events: list[pa.Table] = []
    dead: list[pa.Table] = []
    client = make_client(kafka.client, bootstrap, timeout_s=ingest.read_timeout_s,
                         max_message_bytes=plan.rules.max_message_bytes)
    try:
        for rng in (r for r in plan.ranges if r.num_offsets > 0):
            batches = client.read_batches(rng, max_records=ingest.batch_max_records)
            try:
                for batch in batches:
                    # A range ends at its planned end offset, whatever the client read past it.
                    n = int(np.searchsorted(batch.column("offset").to_numpy(), rng.end, side="left"))
                    if n:
                        good, bad = parse_batch(batch if n == batch.num_rows else batch.slice(0, n), **args)
                        events.append(good)
                        dead.append(bad)
                    if n < batch.num_rows:
                        break
            finally:
                batches.close()
    finally:
        client.close()
    return (in_kafka_order(pa.concat_tables(events)) if events else EVENTS_TABLE_SCHEMA.empty_table(),
            in_kafka_order(pa.concat_tables(dead)) if dead else DEAD_LETTER_SCHEMA.empty_table())


def mirror_to_group(kafka: KafkaConfig, ingest: IngestConfig, bootstrap: str, end_offsets: dict[int, int], *,
                    timeout_s: float = 5.0) -> bool:
    """Commit ``end_offsets`` (partition -> next offset to read, as in the ``events`` commit) to the consumer
    group ``ingest.group_id`` (:func:`ingest.kafka_clients.commit_group_offsets`), waiting ``timeout_s`` seconds
    at most (a mirror must not hold up the next batch for long); nothing when the group id is "".

    Returns:
        True when the group commit succeeded; False when it was off or failed (logged as a warning: the
        Delta commit is the source of truth, so a lagging group never fails the ingest).
    """
    if not ingest.group_id or not end_offsets:
        return False
    try:
        commit_group_offsets(bootstrap, ingest.group_id, kafka.topic, end_offsets,
                             timeout_s=min(timeout_s, ingest.read_timeout_s))
    except Exception as exc:  # any client error: the lake already holds the batch, the group is only a mirror
        log.warning("ingest %s: committing the offsets to consumer group %r failed (%s: %s); the lake has them, "
                    "the group catches up after the next batch", app_id_for(kafka.topic), ingest.group_id,
                    type(exc).__name__, exc)
        return False
    return True


@holding("ingest")
def run_ingest(
    lake: Lake,
    kafka: KafkaConfig,
    ingest: IngestConfig,
    *,
    bootstrap: str,
    beam_args: list[str] | None = None,
    now_ms: int | None = None,
    reset_topic: bool = False,
) -> IngestResult:
    """Ingest one bounded snapshot of ``kafka.topic`` into ``events`` and ``dead_letter``.

    See the module docstring for the protocol. Safe to rerun at any time: a run after a crash
    completes the crashed batch; a run with nothing new is skipped.

    Args:
        lake: the lake the tables are in (its root is locked against a second ingest).
        kafka: ``topic`` and ``client`` are used (the broker is ``bootstrap``).
        ingest: the parsing, dedup, lateness and batching settings of a fresh batch (a recovered
            batch keeps the fate-deciding rules it was planned with).
        bootstrap: ``HOST:PORT`` of the Kafka cluster.
        beam_args: extra Beam pipeline flags (e.g. ``["--direct_num_workers=2"]``).
        now_ms: the ingest clock for ``future_event_time``, ms since epoch UTC; None reads the
            wall clock. A recovered batch uses the clock recorded by the crashed run instead.
        reset_topic: start over on the topic as it is now (from its low watermarks), forgetting the
            committed offsets and topic identity; recorded in the commit (``reset``). For a topic
            that was deliberately recreated: refused (BadConfigError) when the topic is the one the lake read.

    Returns:
        An :class:`IngestResult`; ``gaps`` lists records retention deleted before they were read.

    Raises:
        ingest.kafka_source.TopicChangedError: the topic is not the one the lake read (recreated,
            another partition count, offsets went backwards); ``reset_topic`` accepts it.
        ValueError: the topic does not exist.
        RuntimeError: the two tables hold inconsistent batches, or staged rows break the
            exactly-once invariants.
        gemline.locks.LakeBusyError: another ingest is running on this lake.
    """
    root, app_id, opts = lake.root, app_id_for(kafka.topic), lake.delta_options
    plan = _plan_batch(lake, kafka, ingest, bootstrap, now_ms, reset_topic)
    planned = sum(r.num_offsets for r in plan.ranges)
    if planned == 0 and plan.reset is None and not plan.gaps:
        log.info("ingest %s: nothing new (batch %d skipped)", app_id, plan.batch_version)
        return IngestResult(plan.batch_version, 0, 0, plan.ranges, skipped=True)

    stage = _stage_for(root, plan.batch_version)
    shutil.rmtree(stage, ignore_errors=True)
    if uses_beam(ingest, beam_args):
        for table in (Table.EVENTS, Table.DEAD_LETTER):
            (stage / table).mkdir(parents=True)
        log.info("ingest %s: batch %d, %d records over %d partitions -> staging", app_id, plan.batch_version, planned,
                 len(plan.ranges))
        _run_beam(kafka, ingest, bootstrap, plan, stage, list(beam_args or []))
        events = read_staged(stage / Table.EVENTS, EVENTS_TABLE_SCHEMA)
        dead = read_staged(stage / Table.DEAD_LETTER, DEAD_LETTER_SCHEMA)
    else:
        log.info("ingest %s: batch %d, %d records over %d partitions", app_id, plan.batch_version, planned,
                 len(plan.ranges))
        events, dead = _run_in_process(kafka, ingest, bootstrap, plan)
    _check_batch(events, dead, plan.ranges)
    events, dead = stamp_generation(events, plan.generation), stamp_generation(dead, plan.generation)
    existing = open_table(root, Table.EVENTS, storage_options=opts)
    rules = plan.rules
    dataset = None if existing is None else existing.to_pyarrow_dataset()
    committed = committed_ids(dataset, events, rules.dedup_window_ms)
    parsed = events
    events, duplicates = drop_duplicates(parsed, committed, rules.dedup_window_ms)
    n_conflicts, dropped = 0, {}
    if duplicates:
        payloads = committed_payloads(dataset, pc.unique(parsed["event_id"]), parsed["event_time_ms"],
                                      rules.dedup_window_ms)
        conflicts, duplicates = split_conflicts(parsed, events, payloads, rules.dedup_window_ms)
        n_conflicts = conflicts.num_rows
        if n_conflicts:
            dead = pa.concat_tables([dead, conflict_dead_letter(conflicts, DEAD_LETTER_SCHEMA)])
        dropped = dropped_offsets(parsed, events, conflicts)
    events, late, watermarks = split_late(events, plan.watermarks_ms, rules.allowed_lateness_ms,
                                          now_ms=plan.now_ms)
    metadata = {
        "offset_ranges": [r.to_dict() for r in plan.ranges],
        "end_offsets": {str(p): e for p, e in sorted(plan.end_offsets.items())},
        "now_ms": plan.now_ms,
        "watermarks_ms": {str(p): w for p, w in sorted(watermarks.items())},
        "duplicates_dropped": duplicates,
        "duplicates_dropped_offsets": dropped,
        "late_events": late.num_rows,
        "rules": rules_of(rules),
        "topic_identity": plan.identity.to_dict(),
        "gaps": [{"partition": p, "start": a, "end": b, "count": b - a} for p, (a, b) in sorted(plan.gaps.items())],
        **({"reset": plan.reset} if plan.reset is not None else {}),
        **({"generation": plan.generation} if plan.generation is not None else {}),
    }
    wrote_dead = commit(root, Table.DEAD_LETTER, dead, app_id=app_id, version=plan.batch_version,
                        metadata=metadata, storage_options=opts)
    # late_events joined the lake after events: in an existing lake its first batch is the app's next
    # events version, not 0, so any version above its last is accepted there.
    wrote_late = commit(root, Table.LATE_EVENTS, late, app_id=app_id, version=plan.batch_version,
                        metadata=metadata, version_rule="increasing", storage_options=opts)
    wrote_events = commit(root, Table.EVENTS, events, app_id=app_id, version=plan.batch_version,
                          metadata=metadata, storage_options=opts)
    shutil.rmtree(stage, ignore_errors=True)
    mirror_to_group(kafka, ingest, bootstrap, plan.end_offsets)
    log.info("ingest %s: batch %d committed: %d events, %d dead-letter, %d late, %d duplicates dropped", app_id,
             plan.batch_version, events.num_rows, dead.num_rows, late.num_rows, duplicates)
    return IngestResult(
        batch_version=plan.batch_version,
        events_written=events.num_rows if wrote_events else 0,
        dead_letter_written=dead.num_rows if wrote_dead else 0,
        offset_ranges=plan.ranges,
        skipped=False,
        recovered=plan.recovered,
        duplicates_dropped=duplicates,
        late_events_written=late.num_rows if wrote_late else 0,
        duplicate_conflicts=n_conflicts,
        gaps=tuple((p, a, b) for p, (a, b) in sorted(plan.gaps.items())),
        rules_changed=plan.rules_changed,
        reset=plan.reset is not None,
    )


def ingest_backlog(
    lake: Lake,
    kafka: KafkaConfig,
    ingest: IngestConfig,
    *,
    bootstrap: str,
    beam_args: list[str] | None = None,
    now_ms: int | None = None,
    max_batches: int | None = None,
    reset_topic: bool = False,
    on_batch: Callable[[IngestResult], None] | None = None,
) -> list[IngestResult]:
    """Run :func:`run_ingest` until the topic is caught up (a run is skipped) or ``max_batches`` ran.

    With ``ingest.max_offsets_per_partition`` set, each batch reads at most that many offsets
    per partition, so a backlog of any size is ingested with the memory of one bounded batch.
    The high watermarks are read anew by each batch, so records produced meanwhile are read too.

    Args:
        max_batches: stop after this many batches (skipped ones included); None: until caught up.
        reset_topic: as for :func:`run_ingest`, for the first batch.
        on_batch: called with each committed batch's result as soon as it committed (progress lines).
        lake, kafka, ingest, bootstrap, beam_args, now_ms: as for :func:`run_ingest` (one ``now_ms`` for
            every batch).

    Returns:
        The results of the non-skipped batches, in order.

    Raises:
        ValueError: ``max_batches < 1``; and what :func:`run_ingest` raises.
    """
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"ingest_backlog: expected max_batches >= 1 or None, got {max_batches}")
    results: list[IngestResult] = []
    for i in itertools.count() if max_batches is None else range(max_batches):
        result = run_ingest(lake, kafka, ingest, bootstrap=bootstrap, beam_args=beam_args, now_ms=now_ms,
                            reset_topic=reset_topic and i == 0)
        if result.skipped:
            break
        results.append(result)
        if on_batch is not None:
            on_batch(result)
    return results
