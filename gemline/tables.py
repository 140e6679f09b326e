"""The table registry: one spec per Delta table of the lake, and the only way stages write them.

    table                      owner       mode       partitioned by       schema (module:attribute)
    events                     ingest      append     event_date           ingest.schema:EVENTS_TABLE_SCHEMA
    dead_letter                ingest      append                          ingest.schema:DEAD_LETTER_SCHEMA
    late_events                ingest      append                          ingest.schema:LATE_EVENTS_SCHEMA
    sequences                  sequences   overwrite                       sequences.schema:SEQUENCES_SCHEMA
    sequences_by_domain        sequences   overwrite                       sequences.schema:SEQUENCES_BY_DOMAIN_SCHEMA
    features/user              features    overwrite  domain, event_date   features.definitions:USER_FEATURES.schema
    features/item              features    overwrite  domain, event_date   features.definitions:ITEM_FEATURES.schema
    features/user_category     features    overwrite  domain, event_date   features.definitions:USER_CATEGORY_FEATURES.schema
    _build_state/buffer        sequences   append*                         sequences.shards:EVENT_SCHEMA
    _build_state/evicted       sequences   overwrite                       sequences.incremental:EVICTED_SCHEMA
    _build_state/pending       sequences   append*                         sequences.examples:PENDING_SCHEMA
    examples                   sequences   append     event_date           sequences.examples:EXAMPLES_SCHEMA
    history                    sequences   append     user_bucket          sequences.schema:HISTORY_SCHEMA
    quality                    validation  append                          gemline.gate:QUALITY_SCHEMA
    quality_profiles           validation  append                          validation.profiles:PROFILES_SCHEMA
    training_metrics           trainer     append                          trainer.continuous:TRAINING_METRICS_SCHEMA
    freshness                  trainer     append                          trainer.freshness:FRESHNESS_SCHEMA
    teacher_predictions        trainer     append                          trainer.teacher_log:TEACHER_PREDICTIONS_SCHEMA

(* rows are added, and the files holding rows that left are removed or rewritten in the same commit:
:func:`commit_files` ``removes``.)

A table is named by a :class:`Table` member (a ``str``, so ``read_table(lake, Table.EVENTS)`` and
``Table.EVENTS == "events"`` work), never by a string literal. The owner is the stage that computes
the rows (the feature tables are computed by ``features`` code inside the sequences build).

Schemas stay with the stage that owns them, in the module the other stages already import for that
stage's typed records: the core imports no stage (tests/test_layers.py), so moving them here would
drag the feature definitions, labels and event types into the core, and a reference resolved at run
time would be an import against the layer direction in disguise. The spec names where the schema
lives; tests/gemline/test_tables.py resolves every name and checks it holds the partition columns.

Writes: :func:`commit` (rows), :func:`write_files` + :func:`commit_files` (data files written by
Beam workers, committed by the driver) apply the spec's partition columns and write mode and go
through the lake's idempotent commit (:func:`gemline.lake.commit_once`,
:func:`gemline.lake.commit_files_once`: one app transaction ``(app_id, version)`` per commit, a
repeated one writes nothing). They refuse, with :class:`~gemline.errors.TableSpecError`, a table
not in the registry, data without the spec's partition columns, and a table in the lake that is
partitioned otherwise than its spec says. The lake's functions are called through the module
(``gemline.lake.commit_once``) at call time, so a test that replaces one sees every stage's write.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa

from gemline import lake as _lake
from gemline.errors import TableSpecError

if TYPE_CHECKING:
    from deltalake import DeltaTable


class Table(StrEnum):
    """The name of every Delta table, as its path under the lake root (``"features/user"``)."""

    EVENTS = "events"
    DEAD_LETTER = "dead_letter"
    LATE_EVENTS = "late_events"
    SEQUENCES = "sequences"
    SEQUENCES_BY_DOMAIN = "sequences_by_domain"
    FEATURES_USER = "features/user"
    FEATURES_ITEM = "features/item"
    FEATURES_USER_CATEGORY = "features/user_category"
    BUILD_BUFFER = "_build_state/buffer"
    BUILD_EVICTED = "_build_state/evicted"
    BUILD_PENDING = "_build_state/pending"
    EXAMPLES = "examples"
    HISTORY = "history"
    ORPHAN_LABELS = "orphan_labels"
    QUALITY = "quality"
    QUALITY_PROFILES = "quality_profiles"
    TRAINING_METRICS = "training_metrics"
    FRESHNESS = "freshness"
    TEACHER_PREDICTIONS = "teacher_predictions"

    def __repr__(self) -> str:
        # A name reads as its string in messages and reprs ('events', not <Table.EVENTS: 'events'>):
        # the messages that printed the literals stay the same.
        return str.__repr__(self)

    @property
    def spec(self) -> TableSpec:
        """This table's :class:`TableSpec`."""
        return TABLES[self]


Owner = Literal["ingest", "sequences", "features", "validation", "trainer"]
"""The stage that computes a table's rows."""


@dataclass(frozen=True, kw_only=True)
class TableSpec:
    """How one Delta table is laid out and written.

    Attributes:
        name: the table (its path under the lake root).
        owner: the stage that computes its rows.
        mode: ``"append"`` (each commit adds rows) or ``"overwrite"`` (each commit replaces the table).
        partition_by: Delta partition columns (Hive-style directories), in order; () for none.
        schema: ``"module:attribute"`` of the Arrow schema, in the owning stage's records module.
        about: one line on what a row is.

    Raises:
        TableSpecError: ``mode`` is neither "append" nor "overwrite", or ``schema`` is not ``module:attribute``.
    """

    name: Table
    owner: Owner
    mode: Literal["append", "overwrite"]
    partition_by: tuple[str, ...] = ()
    schema: str
    about: str

    def __post_init__(self) -> None:
        if self.mode not in ("append", "overwrite"):
            raise TableSpecError(f"{self.name}: mode must be 'append' or 'overwrite', got {self.mode!r}")
        module, _, attribute = self.schema.partition(":")
        if not module or not attribute:
            raise TableSpecError(f"{self.name}: schema must be 'module:attribute', got {self.schema!r}")


def _specs(*specs: TableSpec) -> Mapping[Table, TableSpec]:
    return MappingProxyType({s.name: s for s in specs})


_FEATURES = ("domain", "event_date")

TABLES: Mapping[Table, TableSpec] = _specs(
    TableSpec(name=Table.EVENTS, owner="ingest", mode="append", partition_by=("event_date",),
              schema="ingest.schema:EVENTS_TABLE_SCHEMA", about="one valid event from Kafka"),
    TableSpec(name=Table.DEAD_LETTER, owner="ingest", mode="append", schema="ingest.schema:DEAD_LETTER_SCHEMA",
              about="one rejected Kafka message with its reason"),
    TableSpec(name=Table.LATE_EVENTS, owner="ingest", mode="append", schema="ingest.schema:LATE_EVENTS_SCHEMA",
              about="one event behind its partition's watermark by more than the allowed lateness"),
    TableSpec(name=Table.SEQUENCES, owner="sequences", mode="overwrite", schema="sequences.schema:SEQUENCES_SCHEMA",
              about="one user's behaviour sequence"),
    TableSpec(name=Table.SEQUENCES_BY_DOMAIN, owner="sequences", mode="overwrite",
              schema="sequences.schema:SEQUENCES_BY_DOMAIN_SCHEMA", about="one user's sequence in one domain"),
    TableSpec(name=Table.FEATURES_USER, owner="features", mode="overwrite", partition_by=_FEATURES,
              schema="features.definitions:USER_FEATURES.schema", about="counters of one (user, domain)"),
    TableSpec(name=Table.FEATURES_ITEM, owner="features", mode="overwrite", partition_by=_FEATURES,
              schema="features.definitions:ITEM_FEATURES.schema", about="counters of one (item, domain)"),
    TableSpec(name=Table.FEATURES_USER_CATEGORY, owner="features", mode="overwrite", partition_by=_FEATURES,
              schema="features.definitions:USER_CATEGORY_FEATURES.schema",
              about="counters of one (user, domain, category)"),
    TableSpec(name=Table.BUILD_BUFFER, owner="sequences", mode="append", schema="sequences.shards:EVENT_SCHEMA",
              about="an event the incremental build still needs"),
    TableSpec(name=Table.BUILD_EVICTED, owner="sequences", mode="overwrite",
              schema="sequences.incremental:EVICTED_SCHEMA", about="counts of events evicted from the buffer"),
    TableSpec(name=Table.BUILD_PENDING, owner="sequences", mode="append", schema="sequences.examples:PENDING_SCHEMA",
              about="an impression whose attribution windows are still open"),
    TableSpec(name=Table.EXAMPLES, owner="sequences", mode="append", partition_by=("event_date",),
              schema="sequences.examples:EXAMPLES_SCHEMA", about="one labelled impression, point-in-time correct"),
    TableSpec(name=Table.HISTORY, owner="sequences", mode="append", partition_by=("user_bucket",),
              schema="sequences.schema:HISTORY_SCHEMA",
              about="one event of one user, stored once; pointer-layout examples are rebuilt from it"),
    TableSpec(name=Table.ORPHAN_LABELS, owner="sequences", mode="append",
              schema="sequences.publish:ORPHAN_LABELS_SCHEMA",
              about="a click or conversion no example carries: no impression, or it arrived after its impression was decided"),
    TableSpec(name=Table.QUALITY, owner="validation", mode="append", schema="gemline.gate:QUALITY_SCHEMA",
              about="one (table, version, expectation) of a validation run, or a release"),
    TableSpec(name=Table.QUALITY_PROFILES, owner="validation", mode="append",
              schema="validation.profiles:PROFILES_SCHEMA", about="one metric of one validated batch"),
    TableSpec(name=Table.TRAINING_METRICS, owner="trainer", mode="append",
              schema="trainer.continuous:TRAINING_METRICS_SCHEMA", about="one metric of one continuous evaluation"),
    TableSpec(name=Table.FRESHNESS, owner="trainer", mode="append", schema="trainer.freshness:FRESHNESS_SCHEMA",
              about="p50/p95/p99 of one freshness hop over one trained examples version"),
    TableSpec(name=Table.TEACHER_PREDICTIONS, owner="trainer", mode="append",
              schema="trainer.teacher_log:TEACHER_PREDICTIONS_SCHEMA",
              about="what the continuous teacher predicted for one example before training on it, and its vectors"),
)
"""Every Delta table gemline writes, by name."""


def spec(table: Table | str) -> TableSpec:
    """The spec of ``table`` (a :class:`Table` or its name, e.g. ``"features/user"``).

    Raises:
        TableSpecError: no table of that name is registered.
    """
    try:
        return TABLES[Table(table)]
    except ValueError:
        raise TableSpecError(f"no table {str(table)!r} in the registry (gemline.tables.TABLES); "
                             f"registered: {', '.join(TABLES)}") from None


def _check_columns(s: TableSpec, columns: Sequence[str]) -> None:
    missing = [c for c in s.partition_by if c not in columns]
    if missing:
        raise TableSpecError(f"{s.name}: the data lacks the partition columns {missing} of its spec "
                             f"(partitioned by {list(s.partition_by)}); got columns {list(columns)}")


def _check_lake_table(lake: _lake.Lake | str | Path, s: TableSpec, storage_options: _lake.StorageOptions | None,
                      snapshot: DeltaTable | None = None) -> None:
    """Refuse a table already in the lake whose partition columns are not the spec's (``snapshot``: an open
    handle of it, brought up to date; None opens the table)."""
    dt = _lake.latest_table(lake, s.name, storage_options, snapshot)
    if dt is None:
        return
    found = list(dt.metadata().partition_columns)
    if found != list(s.partition_by):
        raise TableSpecError(f"{_lake.table_uri(lake, s.name)} is partitioned by {found} but its spec "
                             f"(gemline.tables) says {list(s.partition_by)}: it was written by other code; "
                             "move it away or rewrite it with the spec's partitioning")


def commit(
    lake: _lake.Lake | str | Path,
    table: Table | str,
    data: pa.Table,
    *,
    app_id: str,
    version: int,
    metadata: dict[str, Any] | None = None,
    version_rule: Literal["next", "increasing"] = "next",
    storage_options: _lake.StorageOptions | None = None,
    snapshot: DeltaTable | None = None,
) -> bool:
    """Write ``data`` to ``table`` in one commit tagged (app_id, version), with the spec's mode and
    partition columns, unless that app transaction is already there (:func:`gemline.lake.commit_once`).

    Args:
        data: rows of the table's schema (it must hold the partition columns).
        app_id, version: the app transaction; ``version_rule`` says which versions are accepted.
        metadata: JSON-serialisable values stored in the commit (:func:`gemline.lake.commit_metadata`).
        storage_options: object-store options for a remote lake given as a root (see :mod:`gemline.lake`).
        snapshot: a long-running writer's open handle of the table (:func:`gemline.lake.commit_once`).

    Returns:
        True if this call committed, False if (app_id, version) or a later version was already there.

    Raises:
        TableSpecError: ``table`` is not registered, ``data`` lacks a partition column, or the table in
            the lake is partitioned otherwise.
        ValueError: ``version`` breaks ``version_rule``.
        gemline.lake.CommitConflictError: another writer committed the same (app_id, version) meanwhile.
    """
    s = spec(table)
    _check_columns(s, data.column_names)
    _check_lake_table(lake, s, storage_options, snapshot)
    return _lake.commit_once(lake, s.name, data, app_id=app_id, version=version, mode=s.mode,
                             partition_by=list(s.partition_by) or None, metadata=metadata,
                             version_rule=version_rule, storage_options=storage_options, snapshot=snapshot)


def write_files(
    lake: _lake.Lake | str | Path,
    table: Table | str,
    data: pa.Table,
    *,
    name: str,
    storage_options: _lake.StorageOptions | None = None,
    row_group_rows: int = _lake.ROW_GROUP_ROWS,
) -> list[dict[str, Any]]:
    """Write ``data`` as uncommitted Parquet files of ``table``, split by the spec's partition columns
    (:func:`gemline.lake.write_data_file`; ``name`` names the files, so a retried writer replaces them;
    ``row_group_rows``: rows per Parquet row group).

    Returns:
        One JSON-serialisable entry per file, for :func:`commit_files`.

    Raises:
        TableSpecError: ``table`` is not registered, or ``data`` lacks a partition column.
        ValueError: a partition value is null.
    """
    s = spec(table)
    _check_columns(s, data.column_names)
    return _lake.write_data_file(lake, s.name, data, name=name, partition_by=list(s.partition_by) or None,
                                 storage_options=storage_options, row_group_rows=row_group_rows)


def commit_files(
    lake: _lake.Lake | str | Path,
    table: Table | str,
    files: Sequence[Mapping[str, Any]],
    schema: pa.Schema,
    *,
    app_id: str,
    version: int,
    metadata: dict[str, Any] | None = None,
    storage_options: _lake.StorageOptions | None = None,
    removes: Sequence[Mapping[str, Any]] = (),
    snapshot: DeltaTable | None = None,
) -> bool:
    """Commit data files from :func:`write_files` to ``table`` once, with the spec's mode and partition
    columns (:func:`gemline.lake.commit_files_once`; ``schema``: the table's Arrow schema, partition
    columns included); ``removes``: files of the table's snapshot the same commit removes (an
    append-mode table only); ``snapshot``: an open handle of ``table``, brought up to date and committed
    through (None opens the table).

    Returns:
        True if this call committed, False if (app_id, version) or a later one was already there.

    Raises:
        TableSpecError: ``table`` is not registered, ``schema`` or a file's partition values miss the
            spec's partition columns, or the table in the lake is partitioned otherwise.
        ValueError: ``version`` skips ahead of the last committed version + 1, or ``removes`` for an overwrite table.
        gemline.lake.CommitConflictError: another writer committed the same (app_id, version) meanwhile.
    """
    s = spec(table)
    _check_columns(s, schema.names)
    for f in files:
        if sorted(f["partition_values"]) != sorted(s.partition_by):
            raise TableSpecError(f"{s.name}: file {f['path']!r} has partition values for "
                                 f"{sorted(f['partition_values'])} but the spec partitions by {list(s.partition_by)}")
    _check_lake_table(lake, s, storage_options, snapshot)
    return _lake.commit_files_once(lake, s.name, files, schema, app_id=app_id, version=version, mode=s.mode,
                                   partition_by=list(s.partition_by) or None, metadata=metadata,
                                   storage_options=storage_options, removes=removes, snapshot=snapshot)
