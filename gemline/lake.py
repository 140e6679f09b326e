"""Lake layout and idempotent Delta commits shared by every stage.

    LAKE/events              ingest     partitioned by event_date
    LAKE/dead_letter         ingest
    LAKE/sequences           sequences
    LAKE/examples            sequences  partitioned by event_date
    LAKE/features/user       features
    LAKE/features/item       features
    LAKE/quality             validation one row per (table, version, expectation)
    LAKE/_quality/<table>/<version>/report.{json,html}
    LAKE/_checkpoints/step-N/
    LAKE/_runs/<run_id>/summary.json

Exactly-once writes follow delta-rs's app transactions: each commit carries
``Transaction(app_id, version)`` and the writer first checks ``DeltaTable.transaction_version``
(delta-rs itself accepts a repeated (app_id, version) and would write the rows twice).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import TableNotFoundError

TABLES = ("events", "dead_letter", "sequences", "examples", "features/user", "features/item", "quality")


def table_uri(lake: str | Path, table: str) -> str:
    """Path of a table under the lake root."""
    return str(Path(lake) / table)


def open_table(lake: str | Path, table: str, version: int | None = None) -> DeltaTable | None:
    """The Delta table at ``version`` (latest when None), or None if it does not exist yet."""
    try:
        return DeltaTable(table_uri(lake, table), version=version)
    except TableNotFoundError:
        return None


def committed_version(lake: str | Path, table: str, app_id: str) -> int | None:
    """Last app-transaction version ``app_id`` committed to ``table``; None if never (or no table)."""
    dt = open_table(lake, table)
    if dt is None:
        return None
    return dt.transaction_version(app_id)


def commit_once(
    lake: str | Path,
    table: str,
    data: pa.Table,
    *,
    app_id: str,
    version: int,
    mode: Literal["append", "overwrite"] = "append",
    partition_by: list[str] | None = None,
    metadata: dict[str, Any] | None = None,
) -> bool:
    """Write ``data`` to ``table`` in one commit tagged (app_id, version), unless already committed.

    Args:
        data: rows to write; its schema must match the table's.
        app_id: the writer's identity (one per pipeline and partition set).
        version: monotonically increasing batch sequence number of that writer.
        metadata: JSON-serialisable values stored in the commit's custom metadata
            (e.g. Kafka offset ranges), readable with :func:`commit_metadata`.

    Returns:
        True if this call committed, False if (app_id, version) or a later version was already there.

    Raises:
        ValueError: ``version`` skips ahead of the last committed version + 1.
    """
    last = committed_version(lake, table, app_id)
    if last is not None and version <= last:
        return False
    expected = 0 if last is None else last + 1
    if version != expected:
        raise ValueError(f"{table}: app {app_id!r} must commit version {expected} next, got {version}")
    custom = {"gemline": json.dumps({**(metadata or {}), "app_id": app_id, "txn_version": version}, sort_keys=True)}
    write_deltalake(
        table_uri(lake, table),
        data,
        mode=mode,
        partition_by=partition_by,
        schema_mode="merge" if mode == "append" else "overwrite",
        commit_properties=CommitProperties(
            custom_metadata=custom, app_transactions=[Transaction(app_id=app_id, version=version)]
        ),
    )
    return True


def commit_metadata(lake: str | Path, table: str, app_id: str) -> dict[str, Any] | None:
    """Custom metadata of the newest commit of ``table`` whose app transaction belongs to ``app_id``.

    Reads the table history newest first. Returns None when ``app_id`` never committed.
    """
    dt = open_table(lake, table)
    if dt is None or dt.transaction_version(app_id) is None:
        return None
    for entry in dt.history():
        raw = entry.get("gemline")
        if raw is None:
            continue
        meta = json.loads(raw)
        if meta.get("app_id") == app_id:
            return meta
    return None


def read_table(
    lake: str | Path, table: str, version: int | None = None, columns: list[str] | None = None
) -> pa.Table | None:
    """Read a whole table (at ``version``, latest when None) into Arrow; None if it does not exist.

    Goes through ``to_pyarrow_dataset()``: with deltalake 1.6.6 and pyarrow 25,
    ``DeltaTable.to_pyarrow_table()`` aborts the interpreter at exit ("terminate called without
    an active exception"), so no gemline code calls it.
    """
    dt = open_table(lake, table, version)
    if dt is None:
        return None
    return dt.to_pyarrow_dataset().to_table(columns=columns)
