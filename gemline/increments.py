"""Incremental reads of a Delta table: the rows the commits after a cursor added, in bounded batches.

A continuously running trainer must read only what is new, never the whole table again. Each Delta
commit lists the data files it added (``add`` actions); those with ``dataChange = true`` carry new
rows, while a compaction (``OPTIMIZE``) rewrites existing rows with ``dataChange = false`` and is never
read again. The position in the stream is a :class:`Cursor` (table id, version, file index, row offset):
the next row to read is row ``row_offset`` of the ``file_index``-th file that ``version`` added, the way
Spark's Delta streaming source tracks ``(reservoirVersion, index)``.

Files are read straight from their Parquet footers in batches of at most ``batch_rows`` rows, so
memory is bounded by one batch, whatever a version holds. Partition columns (not stored in the files)
are filled from the ``add`` action's partition values; columns the table gained after a file was written
are null in that file's rows.

Failures that must stop a trainer instead of training on the wrong rows raise :class:`CursorError`:
the table was recreated under the same path (another table id), a commit's log entry or a data file
under the cursor is gone (log cleanup, VACUUM).

Source: Delta Lake transaction protocol (github.com/delta-io/delta, PROTOCOL.md: "Add File and Remove
File", ``dataChange``; "Metadata", table ``id``); Spark's Delta streaming source offsets
(``DeltaSourceOffset``: reservoirId, reservoirVersion, index).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow.fs import FileType

from gemline.errors import GemlineError
from gemline.lake import Lake, StorageOptions, as_lake, lake_fs, open_table, read_table


class CursorError(GemlineError, ValueError):
    """The cursor cannot continue on this table: recreated, or its log entries or files are gone (exit 2)."""


@dataclass(frozen=True)
class Cursor:
    """The next row to read: row ``row_offset`` of the ``file_index``-th data file (in log order) that
    commit ``version`` of the table with id ``table_id`` added with ``dataChange = true``.

    Raises:
        ValueError: a negative version, index or offset.
    """

    table_id: str
    version: int
    file_index: int = 0
    row_offset: int = 0

    def __post_init__(self) -> None:
        if min(self.version, self.file_index, self.row_offset) < 0:
            raise ValueError(f"Cursor: expected version, file_index, row_offset >= 0, got {self}")

    def to_dict(self) -> dict[str, Any]:
        """JSON form (stored in checkpoints)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Cursor":
        """Inverse of :meth:`to_dict`."""
        return cls(str(data["table_id"]), int(data["version"]), int(data["file_index"]), int(data["row_offset"]))


@dataclass(frozen=True)
class AddedFile:
    """One data file a commit added: path relative to the table root, size in bytes, partition values
    (strings as the log stores them; None for a null partition), rows (None when the log has no stats), and the
    per-column minimum and maximum of its rows the log's stats hold (``minValues``/``maxValues``; empty without
    stats; long strings may be truncated by the writer, so read them as bounds, not values)."""

    path: str
    size: int
    partition_values: dict[str, str | None]
    num_records: int | None
    min_values: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_values: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class Increment:
    """What commit ``version`` changed: its operation (``WRITE``, ``OPTIMIZE``, ...), the files it
    added with ``dataChange = true`` (``files``; empty for a compaction or a metadata-only commit) and how
    many files it removed (``removed``, any ``dataChange``: 0 for a plain append)."""

    version: int
    operation: str
    files: tuple[AddedFile, ...]
    removed: int = 0

    @property
    def num_records(self) -> int | None:
        """Rows the version added (None if a file lacks stats)."""
        counts = [f.num_records for f in self.files]
        return None if any(c is None for c in counts) else sum(c for c in counts if c is not None)


def table_id(lake: str | Path, table: str, *, storage_options: StorageOptions | None = None) -> str | None:
    """The Delta table id (``metaData.id``, fixed at creation: a table recreated under the same path has
    another), or None when the table does not exist."""
    dt = open_table(lake, table, storage_options=storage_options)
    return None if dt is None else str(dt.metadata().id)


def latest_version(lake: str | Path, table: str, *, storage_options: StorageOptions | None = None) -> int | None:
    """The table's newest version, or None when it does not exist."""
    dt = open_table(lake, table, storage_options=storage_options)
    return None if dt is None else int(dt.version())


def _log_path(root: str, table: str, version: int) -> str:
    return f"{root}/{table}/_delta_log/{version:020d}.json"


class LogTip:
    """The newest version of one Delta table, followed by looking for the next commit's log entry.

    A follower asks "did the table gain a version?" every second or so; opening the table
    (:func:`latest_version`) replays its log from the last checkpoint, a cost that grows with the log. A commit
    is the creation of ``_delta_log/<N+1>.json`` (Delta protocol, "Delta Log Entries"; on S3 a conditional put,
    :mod:`gemline.lake`), so once the newest version N is known, one file-existence check (a ``stat``, or a HEAD
    request on an object store) answers it, whatever the log's length. The table is opened once, at the first
    :meth:`advance`.

    Not seen: a table deleted and recreated under the same path (its versions start again at 0) until it passes
    the old newest version; a follower still runs a pass every ``interval_s``.
    """

    def __init__(self, lake: str | Path, table: str, *, storage_options: StorageOptions | None = None) -> None:
        self._lake, self._table, self._options = lake, table, storage_options
        self._fs, self._root = lake_fs(lake, storage_options)
        self._opened = False
        self.version: int | None = None
        """The newest version seen (None: the table did not exist at the last look)."""

    def advance(self) -> int | None:
        """Look for commits after :attr:`version` and return the newest version (None: no table yet)."""
        if not self._opened:
            self.version = latest_version(self._lake, self._table, storage_options=self._options)
            self._opened = True
        following = 0 if self.version is None else self.version + 1
        while self._fs.get_file_info(_log_path(self._root, self._table, following)).type != FileType.NotFound:
            self.version, following = following, following + 1
        return self.version


def read_increment(lake: str | Path, table: str, version: int, *,
                   storage_options: StorageOptions | None = None) -> Increment:
    """The files commit ``version`` of ``table`` added with ``dataChange = true``, in log order.

    Raises:
        CursorError: the commit's log entry is gone (log retention removed it after a checkpoint).
    """
    fs, root = lake_fs(lake, storage_options)
    path = _log_path(root, table, version)
    try:
        with fs.open_input_stream(path) as stream:
            text = stream.read().decode()
    except (FileNotFoundError, OSError) as exc:
        raise CursorError(f"{table}@{version}: its log entry {path} is gone (log retention after a checkpoint?); "
                          "the rows it added cannot be read incrementally; start a new run with "
                          "`gemline train --from-scratch`") from exc
    operation, files, removed = "UNKNOWN", [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        action = json.loads(line)
        if "commitInfo" in action:
            operation = str(action["commitInfo"].get("operation", operation))
        removed += "remove" in action
        add = action.get("add")
        if add is None or not add.get("dataChange", True):
            continue
        stats = json.loads(add["stats"]) if add.get("stats") else {}
        files.append(AddedFile(urllib.parse.unquote(add["path"]), int(add.get("size", 0)),
                               dict(add.get("partitionValues") or {}),
                               int(stats["numRecords"]) if "numRecords" in stats else None,
                               dict(stats.get("minValues") or {}), dict(stats.get("maxValues") or {})))
    return Increment(version, operation, tuple(files), removed)


def _conform(batch: pa.RecordBatch, file: AddedFile, schema: pa.Schema) -> pa.RecordBatch:
    """``batch`` as rows of ``schema``: partition columns from the file's partition values, columns the
    file lacks (added to the table later) as nulls, types cast to the table's."""
    arrays = []
    for field in schema:
        if field.name in batch.schema.names:
            arrays.append(batch.column(field.name).cast(field.type))
        elif field.name in file.partition_values:
            value = file.partition_values[field.name]
            arrays.append(pa.array([value] * batch.num_rows, pa.string()).cast(field.type))
        else:
            arrays.append(pa.nulls(batch.num_rows, field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def read_from(
    lake: str | Path,
    table: str,
    cursor: Cursor,
    *,
    batch_rows: int = 65_536,
    columns: Sequence[str] | None = None,
    until_version: int | None = None,
    storage_options: StorageOptions | None = None,
) -> Iterator[tuple[int, pa.RecordBatch | None, Cursor]]:
    """Stream the rows added after ``cursor``: ``(version, batch, cursor after the batch)`` triples.

    Versions are read in order up to ``until_version`` (default: the newest now); within a version its
    added files in log order, each in batches of at most ``batch_rows`` rows. After a version's last
    file the cursor moves to ``(version + 1, 0, 0)``. A version with nothing left to read (a compaction,
    an empty write, a metadata change) yields one ``(version, None, next cursor)``, so the caller can
    record that it passed it. A cursor past the newest version yields nothing.

    Args:
        columns: the columns to read (partition columns included); None: all of the table's schema now.

    Raises:
        CursorError: the table is missing or was recreated (another id), a log entry or a data file under
            the cursor is gone.
        KeyError: a requested column is not in the table's schema.
        ValueError: ``batch_rows < 1``.
    """
    if batch_rows < 1:
        raise ValueError(f"read_from: expected batch_rows >= 1, got {batch_rows}")
    dt = open_table(lake, table, storage_options=storage_options)
    if dt is None:
        raise CursorError(f"{table}: no such table in {lake}; the cursor points at table id {cursor.table_id}")
    if str(dt.metadata().id) != cursor.table_id:
        raise CursorError(f"{table} was recreated: its table id is {dt.metadata().id}, the cursor's is "
                          f"{cursor.table_id}; start a new run with `gemline train --from-scratch`")
    full = pa.schema(dt.schema().to_arrow())  # arro3 -> pyarrow
    schema = full if columns is None else pa.schema([full.field(c) for c in columns])
    last = int(dt.version()) if until_version is None else min(int(until_version), int(dt.version()))
    fs, root = lake_fs(lake, storage_options)
    version, file_index, row_offset = cursor.version, cursor.file_index, cursor.row_offset
    while version <= last:
        inc = read_increment(lake, table, version, storage_options=storage_options)
        yielded = False
        for index in range(file_index, len(inc.files)):
            file = inc.files[index]
            path = f"{root}/{table}/{file.path}"
            try:
                parquet = pq.ParquetFile(fs.open_input_file(path))
            except (FileNotFoundError, OSError) as exc:
                raise CursorError(f"{table}@{version}: data file {file.path} under the cursor is gone (vacuumed?); "
                                  "start a new run with `gemline train --from-scratch`") from exc
            stored = [c for c in schema.names if c in parquet.schema_arrow.names]
            done = 0
            for raw in parquet.iter_batches(batch_size=batch_rows, columns=stored):
                if done + raw.num_rows <= row_offset:  # consumed before the cursor
                    done += raw.num_rows
                    continue
                skip = max(row_offset - done, 0)
                done += raw.num_rows
                batch = raw.slice(skip) if skip else raw
                at_end = done >= parquet.metadata.num_rows
                after = (Cursor(cursor.table_id, version, index + 1, 0) if at_end
                         else Cursor(cursor.table_id, version, index, done))
                if at_end and index + 1 == len(inc.files):
                    after = Cursor(cursor.table_id, version + 1, 0, 0)
                yield version, _conform(batch, file, schema), after
                yielded = True
            row_offset = 0
        if not yielded:  # nothing (left) to read in this version: the caller still learns the cursor moved
            yield version, None, Cursor(cursor.table_id, version + 1, 0, 0)
        version, file_index, row_offset = version + 1, 0, 0


def read_since(lake: str | Path, table: str, cursor: Cursor, *, columns: Sequence[str] | None = None,
               until_version: int | None = None, storage_options: StorageOptions | None = None
               ) -> tuple[pa.Table | None, Cursor]:
    """(the rows added after ``cursor`` up to ``until_version`` as one table, or None when none were; the cursor
    after them): :func:`read_from` gathered, for a reader that keeps a table's rows in memory.

    Raises:
        CursorError, KeyError: as :func:`read_from`.
    """
    batches = []
    for _, batch, after in read_from(lake, table, cursor, columns=columns, until_version=until_version,
                                     storage_options=storage_options):
        if batch is not None:
            batches.append(batch)
        cursor = after
    return (pa.Table.from_batches(batches) if batches else None), cursor


def rows_added(lake: str | Path, table: str, version: int, *, columns: Sequence[str] | None = None,
               storage_options: StorageOptions | None = None) -> pa.Table | None:
    """Every row commit ``version`` of ``table`` added with ``dataChange = true`` (an append's new rows; an
    overwrite's whole new table), or None when the commit added none (a compaction, a metadata change).

    Raises:
        CursorError: the table is missing, or the commit's log entry or a data file is gone.
    """
    tid = table_id(lake, table, storage_options=storage_options)
    if tid is None:
        raise CursorError(f"{table}: no such table in {lake}")
    if not read_increment(lake, table, version, storage_options=storage_options).files:
        return None
    batches = [b for _, b, _ in read_from(lake, table, Cursor(tid, version), until_version=version, columns=columns,
                                          storage_options=storage_options) if b is not None]
    if batches:
        return pa.Table.from_batches(batches)
    dt = open_table(lake, table, storage_options=storage_options)
    assert dt is not None
    full = pa.schema(dt.schema().to_arrow())
    return (full if columns is None else pa.schema([full.field(c) for c in columns])).empty_table()


class TableLedger:
    """An append-only table's rows in memory, kept current by reading only the commits added since the last look.

    For the small tables every stage reads whole and a run appends to at each version (``quality``,
    ``quality_profiles``): a whole read each time costs O(commits) per question, so a long run slows every stage.
    A ledger reads the table once, then per new commit only the files it added (:func:`read_increment`: its log
    entry), after one file-existence check for the next commit (:class:`LogTip`) when nothing changed. The
    reference is a whole read (:func:`gemline.lake.read_table`), tested equal.

    It reads the whole table again when the table was recreated (the first log entry's size or modification time
    changed), a commit removed rows (any ``remove`` outside a compaction: for an append-only table only a hand
    edit does), or a log entry or file is gone. Thread-safe.

    Args:
        table: the name of an unpartitioned table under the lake (a file holds every column).
        schema: the columns kept and their types (each file's columns are cast to it).
    """

    def __init__(self, lake: Lake | str | Path, table: str, schema: pa.Schema, *,
                 storage_options: StorageOptions | None = None) -> None:
        self._lake = as_lake(lake, storage_options)
        self._table = table
        self.schema = schema
        """The columns kept (read-only)."""
        self._fs, self._root = lake_fs(self._lake)
        self._lock = threading.Lock()
        self._reset()

    generation = 0
    """How many times the table was read whole (a consumer of :meth:`rows` that keeps its own index of them starts
    again from the first row when this changes; between two changes the rows only grow at the end)."""

    def _reset(self) -> None:
        self._tip = LogTip(self._lake.root, self._table, storage_options=self._lake.storage_options)
        self._version: int | None = None
        self._rows: pa.Table | None = None
        self._birth: tuple[int, int | None] | None = None

    def rows(self) -> pa.Table | None:
        """Every row of the table at its newest version (the ledger's schema), or None when there is no table."""
        with self._lock:
            if self._birth is not None and self._birth != self._first_entry():
                self._reset()  # recreated under the same path: a LogTip would not see it
            newest = self._tip.advance()
            if newest is None:
                self._reset()
                return None
            if self._rows is None or self._version is None or newest < self._version:
                return self._read_whole(newest)
            try:
                parts = [self._rows]
                for version in range(self._version + 1, newest + 1):
                    increment = read_increment(self._lake.root, self._table, version,
                                               storage_options=self._lake.storage_options)
                    if increment.removed and increment.operation != "OPTIMIZE":
                        return self._read_whole(newest)
                    parts.extend(self._read_file(f.path) for f in increment.files)
            except (CursorError, FileNotFoundError, OSError):
                return self._read_whole(newest)
            rows = pa.concat_tables(parts)
            if rows.num_columns and rows.column(0).num_chunks > _MAX_CHUNKS:
                rows = rows.combine_chunks()  # a chunk per commit would slow every filter of a long run
            self._rows, self._version = rows, newest
            return self._rows

    def _read_whole(self, version: int) -> pa.Table | None:
        self.generation += 1
        self._birth = self._first_entry()
        table = read_table(self._lake, self._table, version)
        self._rows = None if table is None else table.select(self.schema.names).cast(self.schema)
        self._version = None if table is None else version
        return self._rows

    def _read_file(self, path: str) -> pa.Table:
        with self._fs.open_input_file(f"{self._root}/{self._table}/{path}") as handle:
            return pq.read_table(handle, columns=self.schema.names).cast(self.schema)

    def _first_entry(self) -> tuple[int, int | None]:
        info = self._fs.get_file_info(f"{self._root}/{self._table}/_delta_log/{0:020d}.json")
        if info.type == FileType.NotFound:
            return (-1, None)
        return (int(info.size or 0), info.mtime_ns)


_MAX_CHUNKS = 64
"""Chunks a ledger's rows may have (one per file read since the last merge) before they are merged into one."""

_LEDGERS: dict[tuple[str, str, str], TableLedger] = {}
_LEDGERS_LOCK = threading.Lock()


def ledger(lake: Lake | str | Path, table: str, schema: pa.Schema, *,
           storage_options: StorageOptions | None = None) -> TableLedger:
    """The process's :class:`TableLedger` of ``table`` under ``lake`` (one per lake, table and process: a
    long-running follower pays for the commits added since its last question, not for the whole table each time).

    Raises:
        ValueError: a ledger of the same table was made with another schema.
    """
    lake = as_lake(lake, storage_options)
    key = (lake.root, repr(sorted(dict(lake.storage_options or {}).items())), table)
    with _LEDGERS_LOCK:
        found = _LEDGERS.get(key)
        if found is None:
            found = _LEDGERS[key] = TableLedger(lake, table, schema)
    if found.schema != schema:
        raise ValueError(f"ledger({table!r}): already kept with schema {found.schema}, asked for {schema}")
    return found
