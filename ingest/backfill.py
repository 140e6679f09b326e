"""Deliberate re-admission of ``late_events`` rows into ``events`` (``gemline backfill --late-events``).

Ingest moves an event more than ``allowed_lateness_ms`` behind its partition's watermark to
``late_events`` (:func:`ingest.dedup.split_late`) instead of ``events``. This job appends those rows
to ``events`` when someone decides they should count after all, exactly once per row:

1. Hold the ingest lock (``LAKE/_locks/ingest.lock``): this job writes ``events`` too. Refuse while
   the configured topic's ingest batch is half committed (``dead_letter`` / ``late_events`` hold a
   batch ``events`` lacks): finish it with ``gemline ingest`` first, so that its recovery decides
   against the lake it was planned on.
2. Read the rows ``late_events`` gained after the version the last backfill consumed (its commit
   metadata ``late_events_version``; from the start the first time) up to the current version:
   the Parquet files added in between, or, when a version in between rewrote files (a compaction),
   the rows whose (topic, partition, offset, event_id) were not there yet.
3. In Kafka order, drop rows whose event_id already has a copy in ``events`` (or earlier in this
   batch) within ``IngestConfig.dedup_window_ms`` (:func:`ingest.dedup.committed_ids`,
   :func:`ingest.dedup.drop_duplicates`: ingest's own rule). A dropped row whose payload differs
   from every such copy (:func:`ingest.dedup.split_conflicts`) is counted apart as a conflict: it
   is not re-admitted and stays in ``late_events`` (ingest would dead-letter it as
   ``duplicate_conflict``; this job writes only ``events``).
4. Commit the rest to ``events`` (``EVENTS_TABLE_SCHEMA``, partitioned by ``event_date``) in one
   commit tagged with the app transaction (``backfill:late_events``, k) and metadata
   ``{"late_events_version", "late_rows_read", "rows_readmitted", "readmitted_offsets", "duplicates_skipped",
   "conflicts_skipped", "backfill_ms"}`` (``readmitted_offsets``: which records moved, :func:`readmitted_offsets`).

One atomic commit per run carries both the rows and the consumed ``late_events`` version, so a crash
at any point leaves either nothing (the rerun redoes the batch) or everything (the rerun finds nothing
new); and the dedup of step 3 would catch a re-admitted row again. ``late_events`` is left as it is:
it stays the record of what ingest judged late, with the original append time.

Point in time. ``created_ts_ms`` is "when we could know it"; the build shows an event to an
example only if it was appended no later than the example's impression
(:func:`sequences.history.point_in_time_gather`). A late event sat in ``late_events``, invisible to
everything built from ``events``, from its Kafka append until this backfill. Keeping the Kafka
append time would slip it into the history and features of impressions appended in between (and
not yet built), which no model serving then could have seen. So a re-admitted row's
``created_ts_ms`` is ``max(Kafka append time, backfill clock)``: it counts only for impressions
appended after the backfill, like any event that arrives now with an old event time (the build's
backfill rule; published examples are never rewritten). The Kafka append time stays in ``late_events``.

Times are ms since epoch UTC.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
from deltalake import DeltaTable

from gemline.lake import Lake, commit_metadata, committed_version, open_table
from gemline.locks import holding
from gemline.tables import Table, commit
from ingest.config import IngestConfig, KafkaConfig
from ingest.dedup import committed_ids, committed_payloads, drop_duplicates, offset_runs, split_conflicts
from ingest.pipeline import app_id_for
from ingest.schema import EVENTS_TABLE_SCHEMA

log = logging.getLogger(__name__)

BACKFILL_APP_ID = "backfill:late_events"
"""Writer identity of this job's ``events`` commits (app transactions)."""

_COORDS = ["kafka_topic", "kafka_partition", "kafka_offset", "event_id"]


@dataclass(frozen=True)
class BackfillResult:
    """What one :func:`backfill_late_events` call did."""

    late_events_version: int | None
    """``late_events`` version consumed up to (inclusive); None when there is no ``late_events`` table."""
    late_rows_read: int
    """Rows ``late_events`` gained since the previous backfill, read by this call."""
    rows_readmitted: int
    """Rows this call committed to ``events``."""
    duplicates_skipped: int
    """Read rows not written: their event_id has a copy in ``events`` or earlier in the batch within
    ``IngestConfig.dedup_window_ms``."""
    conflicts_skipped: int
    """Read rows not written because their event_id has a copy within the dedup window with another payload
    (two events sharing an id); they stay in ``late_events``."""
    batch_version: int | None
    """App-transaction version of this call's ``events`` commit; None when skipped."""
    skipped: bool
    """True when ``late_events`` had nothing new and nothing was written."""
    backfill_ms: int
    """The backfill clock, ms since epoch UTC: the re-admitted rows' ``created_ts_ms`` is at least this."""


def _consumed_version(lake: Lake) -> tuple[int | None, int]:
    """(late_events version the last backfill consumed up to, or None; this run's batch version)."""
    root, opts = lake.root, lake.delta_options
    last = committed_version(root, Table.EVENTS, BACKFILL_APP_ID, storage_options=opts)
    if last is None:
        return None, 0
    meta = commit_metadata(root, Table.EVENTS, BACKFILL_APP_ID, storage_options=opts)
    assert meta is not None and "late_events_version" in meta, "backfill commit without its metadata"
    return int(meta["late_events_version"]), last + 1


def _check_ingest_settled(lake: Lake, topic: str) -> None:
    """Raise ValueError when ``topic``'s ingest batch is committed to ``dead_letter`` or
    ``late_events`` but not yet to ``events`` (a crashed ingest)."""
    app_id, root, opts = app_id_for(topic), lake.root, lake.delta_options
    done = committed_version(root, Table.EVENTS, app_id, storage_options=opts)
    for table in (Table.DEAD_LETTER, Table.LATE_EVENTS):
        ahead = committed_version(root, table, app_id, storage_options=opts)
        if ahead is not None and (done is None or ahead > done):
            raise ValueError(f"ingest batch {ahead} of {app_id!r} is in {table} but not yet in {Table.EVENTS} "
                             "(an ingest crashed mid-commit): run `gemline ingest` to finish it, then backfill")


def _appends_only(table: DeltaTable, old_version: int) -> bool:
    """True when every commit after ``old_version`` up to ``table``'s version only appended files."""
    return all(
        entry.get("operation") in ("WRITE", "CREATE TABLE")
        and entry.get("operationParameters", {}).get("mode", "Append") == "Append"
        for entry in table.history(table.version() - old_version)
    )


def late_rows_since(
    lake: str, old_version: int | None, version: int, *, storage_options: dict[str, str] | None = None
) -> pa.Table:
    """Rows ``late_events`` gained after ``old_version`` (exclusive; None: from nothing) up to ``version``
    (inclusive), in the table's columns.

    Reads only the data files added in between when every commit in between was an append;
    otherwise (a compaction rewrote files) every row of ``version`` whose (kafka_topic,
    kafka_partition, kafka_offset, event_id) is not in ``old_version``.

    Raises:
        ValueError: ``old_version > version``, or ``late_events`` does not exist at ``version``.
    """
    if old_version is not None and old_version > version:
        raise ValueError(f"late_rows_since: expected old_version <= version, got {old_version} > {version}")
    new = open_table(lake, Table.LATE_EVENTS, version, storage_options=storage_options)
    if new is None:
        raise ValueError(f"no {Table.LATE_EVENTS} table under {lake!r}")
    dataset = new.to_pyarrow_dataset()
    if old_version is None:
        return dataset.to_table()
    old = open_table(lake, Table.LATE_EVENTS, old_version, storage_options=storage_options)
    assert old is not None, "late_events exists at a later version but not at an earlier one"
    if _appends_only(new, old_version):
        seen = {frag.path for frag in old.to_pyarrow_dataset().get_fragments()}
        added = [frag for frag in dataset.get_fragments() if frag.path not in seen]
        return pads.FileSystemDataset(added, dataset.schema, dataset.format, dataset.filesystem).to_table()
    before = old.to_pyarrow_dataset().to_table(columns=_COORDS)
    return dataset.to_table().join(before, _COORDS, join_type="left anti")


def _as_events(late: pa.Table, backfill_ms: int) -> pa.Table:
    """``late_events`` rows as ``events`` rows in Kafka order: without ``watermark_ms`` / ``lateness_ms``,
    ``created_ts_ms`` raised to ``backfill_ms`` (see the module docstring)."""
    columns = []
    for field in EVENTS_TABLE_SCHEMA:
        if field.name in late.column_names:
            columns.append(late.column(field.name))
        elif field.nullable:  # a column late_events gained after these rows were written
            columns.append(pa.nulls(late.num_rows, field.type))
        else:
            raise ValueError(f"{Table.LATE_EVENTS} lacks the events column {field.name!r}; "
                             f"expected the columns of ingest.schema.LATE_EVENTS_SCHEMA")
    rows = pa.Table.from_arrays(columns, names=EVENTS_TABLE_SCHEMA.names).cast(EVENTS_TABLE_SCHEMA)
    created = pc.max_element_wise(rows.column("created_ts_ms"), pa.scalar(backfill_ms, pa.int64()))
    rows = rows.set_column(rows.schema.get_field_index("created_ts_ms"), EVENTS_TABLE_SCHEMA.field("created_ts_ms"),
                           created)
    return rows.sort_by([(c, "ascending") for c in ("kafka_topic", "kafka_partition", "kafka_offset")])


def readmitted_offsets(rows: pa.Table) -> list[dict[str, Any]]:
    """The Kafka coordinates of re-admitted ``rows``, for the commit metadata (``readmitted_offsets``): one entry
    ``{"topic", "generation" (None for rows from before generations), "partition", "runs": [[start, end), ...]}``
    per (topic, generation, partition), in that order (:func:`ingest.dedup.offset_runs`). ``gemline audit`` counts
    a record these name in both ``late_events`` and ``events`` once (:mod:`ingest.audit`)."""
    if rows.num_rows == 0:
        return []
    generation = (rows.column("kafka_generation").to_numpy(zero_copy_only=False) if "kafka_generation" in
                  rows.column_names else np.full(rows.num_rows, np.nan))
    topics = rows.column("kafka_topic").to_numpy(zero_copy_only=False)
    partitions = rows.column("kafka_partition").to_numpy()
    offsets = rows.column("kafka_offset").to_numpy()
    known = ~np.isnan(generation.astype(np.float64))
    out = []
    for topic in sorted(set(topics.tolist())):
        for gen in sorted({int(g) for g in generation[known & (topics == topic)]}) + [None]:
            mask = (topics == topic) & ((~known) if gen is None else (known & (generation == gen)))
            for part, runs in offset_runs(partitions[mask], offsets[mask]).items():
                out.append({"topic": topic, "generation": gen, "partition": int(part), "runs": runs})
    return sorted(out, key=lambda e: (e["topic"], -1 if e["generation"] is None else e["generation"], e["partition"]))


@holding("ingest")
def backfill_late_events(
    lake: Lake, kafka: KafkaConfig, ingest: IngestConfig, *, now_ms: int | None = None
) -> BackfillResult:
    """Re-admit the rows ``late_events`` gained since the last backfill into ``events``, exactly once.

    See the module docstring for the protocol and the ``created_ts_ms`` rule. Safe to rerun at any
    time: a run after a crash redoes the uncommitted batch; a run with nothing new writes nothing.

    Args:
        lake: the lake of ``late_events`` and ``events`` (its root's ingest lock is held).
        kafka: ``topic`` is used: the ingest whose crash state is checked first.
        ingest: ``dedup_window_ms`` is used.
        now_ms: the backfill clock, ms since epoch UTC (the re-admitted rows' ``created_ts_ms`` is at
            least this); None reads the wall clock.

    Returns:
        A :class:`BackfillResult`.

    Raises:
        ValueError: the topic's ingest batch is half committed (run ``gemline ingest`` first),
            ``late_events`` is older than the version the last backfill consumed (restored alone), or
            it lacks an events column.
        gemline.locks.LakeBusyError: an ingest (or another backfill) is running on this lake.
    """
    root, opts = lake.root, lake.delta_options
    backfill_ms = int(time.time() * 1000) if now_ms is None else int(now_ms)
    _check_ingest_settled(lake, kafka.topic)
    consumed, batch_version = _consumed_version(lake)
    late_table = open_table(root, Table.LATE_EVENTS, storage_options=opts)
    if late_table is None:
        return BackfillResult(None, 0, 0, 0, 0, None, skipped=True, backfill_ms=backfill_ms)
    version = late_table.version()
    if consumed is not None and consumed > version:
        raise ValueError(f"{Table.LATE_EVENTS} is at version {version} but the last backfill consumed it up to "
                         f"version {consumed}: it was replaced or restored alone; restore {Table.LATE_EVENTS} and "
                         f"{Table.EVENTS} to the same point together")
    late = (late_rows_since(root, consumed, version, storage_options=opts) if consumed != version
            else late_table.to_pyarrow_dataset().schema.empty_table())
    if late.num_rows == 0:
        # Nothing to re-admit (ingest commits late_events every batch, mostly empty): no events commit.
        log.info("backfill: nothing new in %s up to version %d", Table.LATE_EVENTS, version)
        return BackfillResult(version, 0, 0, 0, 0, None, skipped=True, backfill_ms=backfill_ms)

    rows = _as_events(late, backfill_ms)
    existing = open_table(root, Table.EVENTS, storage_options=opts)
    window_ms = ingest.dedup_window_ms
    dataset = None if existing is None else existing.to_pyarrow_dataset()
    candidates = rows
    rows, duplicates = drop_duplicates(candidates, committed_ids(dataset, candidates, window_ms), window_ms)
    conflicts = 0
    if duplicates:
        payloads = committed_payloads(dataset, pc.unique(candidates["event_id"]), candidates["event_time_ms"],
                                      window_ms)
        conflicting, duplicates = split_conflicts(candidates, rows, payloads, window_ms)
        conflicts = conflicting.num_rows
    metadata = {"late_events_version": version, "late_rows_read": late.num_rows, "rows_readmitted": rows.num_rows,
                "readmitted_offsets": readmitted_offsets(rows), "duplicates_skipped": duplicates,
                "conflicts_skipped": conflicts, "backfill_ms": backfill_ms}
    # Even when every row was a duplicate, the (possibly empty) commit records the consumed version.
    wrote = commit(root, Table.EVENTS, rows, app_id=BACKFILL_APP_ID, version=batch_version, metadata=metadata,
                   storage_options=opts)
    assert wrote, "the backfill batch was committed by someone else while the ingest lock was held"
    log.info("backfill: %d of %d late rows re-admitted to %s (%d duplicates, %d conflicts), %s consumed up to "
             "version %d", rows.num_rows, late.num_rows, Table.EVENTS, duplicates, conflicts, Table.LATE_EVENTS,
             version)
    return BackfillResult(version, late.num_rows, rows.num_rows, duplicates, conflicts, batch_version,
                          skipped=False, backfill_ms=backfill_ms)
