"""Delta table hygiene after builds and ingests: checkpoints, small-file compaction, safe vacuum.

- checkpoint every ``checkpoint_every`` commits (``DeltaTable.create_checkpoint``), so readers
  replay at most K JSON commits;
- compaction of small files (``DeltaTable.optimize.compact``, delta-rs docs "Optimize"): a
  ``dataChange=false`` commit, so readers of the data see no new rows;
- vacuum of files unreferenced for longer than ``retention_hours`` (``DeltaTable.vacuum``); the
  retention must exceed the longest running writer or reader (a build reads its input version
  for minutes), so values under :data:`MIN_RETENTION_HOURS` are rejected rather than forced.

Note for the incremental build: it reads the events files added since its last version and falls
back to Kafka offsets across a compaction (``sequences.pipeline.new_event_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

from gemline.lake import open_table

MIN_RETENTION_HOURS = 1.0
"""Shortest vacuum retention accepted: longer than any build or ingest micro-batch runs."""


@dataclass(frozen=True, kw_only=True)
class HygieneConfig:
    """How each table is kept tidy."""

    checkpoint_every: int = 10
    """Write a checkpoint when the table version is a multiple of this K (commits)."""
    retention_hours: float = 168.0
    """Vacuum removes files unreferenced for longer than this (hours)."""

    def __post_init__(self) -> None:
        if self.checkpoint_every < 1:
            raise ValueError(f"hygiene.checkpoint_every must be >= 1 commit, got {self.checkpoint_every}")
        if not self.retention_hours >= MIN_RETENTION_HOURS:
            raise ValueError(
                f"hygiene.retention_hours must be >= {MIN_RETENTION_HOURS} (files a running writer or reader still "
                f"needs would go), got {self.retention_hours}"
            )


@dataclass(frozen=True)
class HygieneResult:
    """What :func:`tidy` did to one table."""

    checkpointed: bool
    files_compacted: int
    files_vacuumed: int


def tidy(lake: str, table: str, config: HygieneConfig, *, compact: bool = True) -> HygieneResult:
    """Checkpoint (every K commits), compact and vacuum ``table`` under ``lake``.

    Raises:
        ValueError: the table does not exist.
    """
    dt = open_table(lake, table)
    if dt is None:
        raise ValueError(f"no table {table!r} under {lake!r}; nothing to tidy")
    compacted = 0
    if compact:
        metrics = dt.optimize.compact()
        compacted = int(metrics.get("numFilesRemoved", 0))
    checkpointed = dt.version() % config.checkpoint_every == 0
    if checkpointed:
        dt.create_checkpoint()
    removed = dt.vacuum(retention_hours=int(config.retention_hours), dry_run=False, enforce_retention_duration=False)
    return HygieneResult(checkpointed=checkpointed, files_compacted=compacted, files_vacuumed=len(removed))
