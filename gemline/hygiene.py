"""Delta table hygiene after builds and ingests: checkpoints, small-file compaction, safe vacuum.

- one declared type per column whatever a batch holds (:func:`conform`): an all-empty list
  column or an all-null column would otherwise be inferred as ``list<null>`` / ``null`` and
  either fail the write or widen the table schema;
- checkpoint every ``checkpoint_every`` commits (``DeltaTable.create_checkpoint``), so readers
  replay at most K JSON commits;
- compaction of small files (``DeltaTable.optimize.compact``, delta-rs docs "Optimize"): a
  ``dataChange=false`` commit, so readers of the data see no new rows. It is tiered, so that no byte is
  rewritten more than a few times however long the table grows: small files (under ``small_file_bytes``)
  are merged into files of about that size, and only once ``compact_min_files`` of those pile up in a
  partition are they merged into files of up to ``target_file_bytes``. delta-rs's compaction skips files at
  or above its ``target_size`` and bins the rest up to it (largest first), so one pass with a target of
  ``small_file_bytes`` leaves every larger file as it is. (Compacting to delta-rs's default 100 MB target,
  as this did before, rewrote a growing ``examples`` or ``history`` table whole at every compaction: a cost
  that grew with the table, a compaction every pass or two);
- vacuum of files unreferenced for longer than ``retention_hours`` (``DeltaTable.vacuum``); the
  retention must exceed the longest running writer or reader (a build reads its input version
  for minutes), so values under :data:`MIN_RETENTION_HOURS` are rejected rather than forced.

Note for the incremental build: it reads the events files added since its last version and falls
back to Kafka offsets across a compaction (``sequences.pipeline.new_event_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from gemline.errors import BadConfigError, MissingInputError
from gemline.lake import StorageOptions, latest_table

MIN_RETENTION_HOURS = 1.0
"""Shortest vacuum retention accepted: longer than any build or ingest micro-batch runs."""


@dataclass(frozen=True, kw_only=True)
class HygieneConfig:
    """How each table is kept tidy: ``[build.hygiene]`` for the build tables, the only ones tidied today."""

    checkpoint_every: int = 10
    """Write a checkpoint when the table version is a multiple of this K (commits)."""
    retention_hours: float = 168.0
    """Vacuum removes files unreferenced for longer than this (hours)."""
    compact_min_files: int = 16
    """Compact only when one partition (the table, if unpartitioned) holds at least this many small
    data files (or, for the second tier, this many files between ``small_file_bytes`` and
    ``target_file_bytes``): small files pile up where many commits append to the same partitions."""
    small_file_bytes: int = 4 * 2**20
    """A data file under this size (bytes) is small; small files are merged into files of about this size
    (the first tier: each compaction rewrites at most about this much per partition)."""
    target_file_bytes: int = 128 * 2**20
    """Files between ``small_file_bytes`` and this size (bytes) are merged into files of up to this size once
    ``compact_min_files`` of them are in one partition (the second tier); larger files are never rewritten."""

    def __post_init__(self) -> None:
        if self.checkpoint_every < 1:
            raise BadConfigError(f"build.hygiene.checkpoint_every must be >= 1 commit, got {self.checkpoint_every}")
        if not self.retention_hours >= MIN_RETENTION_HOURS:
            raise BadConfigError(
                f"build.hygiene.retention_hours must be >= {MIN_RETENTION_HOURS} (files a running writer or reader still "
                f"needs would go), got {self.retention_hours}"
            )
        if self.compact_min_files < 2:
            raise BadConfigError(f"build.hygiene.compact_min_files must be >= 2 files, got {self.compact_min_files}")
        if not 0 < self.small_file_bytes < self.target_file_bytes:
            raise BadConfigError(
                "build.hygiene needs 0 < small_file_bytes < target_file_bytes, got "
                f"small_file_bytes={self.small_file_bytes}, target_file_bytes={self.target_file_bytes}")


def conform(data: pa.Table, schema: pa.Schema) -> pa.Table:
    """``data`` with exactly ``schema``'s columns, order and types.

    Columns of type ``null`` (all values null, type unknown) or lists of ``null`` (all lists
    empty) take the declared type; other columns are cast safely (no lossy conversions).

    Raises:
        ValueError: a column of ``schema`` is missing, or a value does not fit its declared type.
    """
    missing = [name for name in schema.names if name not in data.column_names]
    if missing:
        raise ValueError(f"batch lacks columns {missing}; expected {schema.names}, got {data.column_names}")
    arrays = []
    for field in schema:
        column = data.column(field.name)
        try:
            arrays.append(column.cast(field.type, safe=True))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
            raise ValueError(
                f"column {field.name!r}: expected {field.type}, got {column.type} that does not convert ({exc})"
            ) from None
    return pa.Table.from_arrays(arrays, schema=schema)


@dataclass(frozen=True)
class HygieneResult:
    """What :func:`tidy` did to one table."""

    checkpointed: bool
    files_compacted: int
    files_vacuumed: int


def _most_files_in_a_partition(actions: pa.Table, columns: list[str], low: int, high: int) -> int:
    """The largest number of data files of ``low <= size < high`` bytes any one partition holds (the table's, if
    unpartitioned), from a snapshot's flattened add ``actions`` and its partition ``columns``."""
    sizes = actions.column("size_bytes")
    actions = actions.filter(pc.and_(pc.greater_equal(sizes, low), pc.less(sizes, high)))
    if not columns or actions.num_rows == 0:
        return actions.num_rows
    keys = [f"partition.{c}" for c in columns]
    counts = actions.select(keys).group_by(keys).aggregate([([], "count_all")])
    return int(pc.max(counts.column("count_all")).as_py())


def _compaction_target(dt: DeltaTable, config: HygieneConfig) -> int | None:
    """The ``target_size`` of the compaction ``dt`` is due (bytes; see the module docstring's tiers), or None."""
    actions = pa.table(dt.get_add_actions(flatten=True))  # read once for both tiers
    if actions.num_rows == 0:
        return None
    columns = list(dt.metadata().partition_columns)
    if _most_files_in_a_partition(actions, columns, 0, config.small_file_bytes) >= config.compact_min_files:
        return config.small_file_bytes
    if (_most_files_in_a_partition(actions, columns, config.small_file_bytes, config.target_file_bytes)
            >= config.compact_min_files):
        return config.target_file_bytes
    return None


def tidy(lake: str, table: str, config: HygieneConfig, *, compact: bool = True,
         storage_options: StorageOptions | None = None, snapshot: DeltaTable | None = None) -> HygieneResult:
    """Compact (when ``compact`` and a partition has >= ``compact_min_files`` small files, or as many of the
    second tier: the module docstring), checkpoint (when the version is a multiple of K) and vacuum ``table``
    under ``lake``; ``storage_options``
    as in :mod:`gemline.lake` for an object-store lake; ``snapshot``: an open handle of ``table``, brought up
    to date and used (None opens the table).

    Raises:
        MissingInputError: the table does not exist (a ValueError).
    """
    dt = latest_table(lake, table, storage_options, snapshot)
    if dt is None:
        raise MissingInputError(f"no table {table!r} under {lake!r}; nothing to tidy")
    compacted = 0
    target = _compaction_target(dt, config) if compact else None
    if target is not None:
        metrics = dt.optimize.compact(target_size=target)
        compacted = int(metrics.get("numFilesRemoved", 0))
    checkpointed = dt.version() % config.checkpoint_every == 0
    if checkpointed:
        dt.create_checkpoint()
    removed = dt.vacuum(retention_hours=int(config.retention_hours), dry_run=False, enforce_retention_duration=False)
    return HygieneResult(checkpointed=checkpointed, files_compacted=compacted, files_vacuumed=len(removed))
