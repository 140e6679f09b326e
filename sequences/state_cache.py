"""The build's event buffer kept in memory across the passes of one ``build --follow`` process.

Each pass of :func:`sequences.pipeline.run_build` reads the buffer (``_build_state/buffer``, every event of the
last ``build.state_lookback_ms``) as the previous build left it, splits it by item shard and by user shard, and
filters its clicks and conversions out for the pending state's labels. The buffer only grows by the events a
pass first keeps and shrinks by the files expiry removes or rewrites, so nearly all of it is the same from one
pass to the next. A :class:`BuildStateCache` keeps, per data file of the buffer's snapshot, the file's rows
already split into shard pieces (by ``item_id`` and by ``user_id``) and its label rows; a pass then reads from
Delta only the files its snapshot added since (the new events kept, files rewritten by expiry or a compaction).
When the pass's shard count differs from the copy's (``build.shards = "auto"`` adding shards as the buffer grows,
2-3 times a run), each held file's rows are put back in file order from their pieces and split again, in memory,
instead of the whole buffer being read from Delta again.

Exactness: the Delta table stays the source of truth. Data files are immutable and a snapshot's rows are the
rows of its add actions' files, so a copy is used only for a file of the very snapshot the pass reads
(:func:`sequences.pipeline.run_build` names its version: the one the previous build committed, by time travel
after a crash) with the same table id, path, size and modification time; every other cached file is dropped,
every file not cached is read. The pieces come in the snapshot's file order; within a file, a user piece's rows
are in file order and an item piece's rows stably sorted by :data:`ITEM_ORDER` (the item step's own stable sort,
done once per file instead of once per pass; the step's sort then gives the same rows in the same order). So every
user shard receives the rows the fresh read and split gives, in the same order, and every item shard the same rows
in an order its sort makes the same (the twin test: ``tests/sequences/test_state_cache.py``). A new process
starts with an empty cache, i.e. from Delta as before.

Memory: at most ``build.memory_budget_bytes // 2`` bytes of Arrow data (two copies of the buffer's rows, one per
split key, plus its labels); a buffer larger than that is not cached (passes read it from Delta as without a
cache), so a build process holds at most 1.5x the budget its shard steps are sized for.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gemline.lake import StorageOptions, open_table
from gemline.tables import Table
from sequences.publish import TASKS
from sequences.shards import split_by_shard_with_order

log = logging.getLogger(__name__)

SPLIT_KEYS = ("item_id", "user_id")
"""The columns the buffer is split by (the item shards' and the user shards' routes of the build)."""

LABEL_COLUMNS = ["user_id", "item_id", "domain", "event_type", "event_time_ms"]
"""The buffer's columns the pending state's labels read (its clicks and conversions)."""


@dataclass(frozen=True)
class _File:
    """One buffer data file as cached: its identity in the snapshot, its rows by shard and its labels."""

    identity: tuple[int, int]
    """(size_bytes, modification_time in ms since epoch UTC) of the add action: a file rewritten under the same
    path differs."""
    pieces: dict[str, list[tuple[int, pa.Table]]]
    """Split key -> ``[(shard, rows)]`` (:func:`sequences.shards.split_by_shard`)."""
    labels: pa.Table
    order: np.ndarray
    """(rows,) int64: row j of the ``SPLIT_KEYS[0]`` pieces concatenated is row ``order[j]`` of the file."""
    nbytes: int


@dataclass(frozen=True)
class HeldBuffer:
    """The buffer of one snapshot as a pass uses it: per split key, per shard that has rows, the rows in snapshot
    order (each file's item pieces stably sorted by :data:`ITEM_ORDER`) (:data:`sequences.shards.EVENT_SCHEMA` columns); and its label rows (:data:`LABEL_COLUMNS`, the clicks and conversions, in snapshot order)."""

    pieces: dict[str, dict[int, pa.Table]]
    labels: pa.Table
    rows: int


@dataclass
class CacheStats:
    """What a :class:`BuildStateCache` did so far (tests and the benchmark read it)."""

    files_read: int = 0
    """Buffer files read from Delta (not cached, or cached under another identity)."""
    files_reused: int = 0
    """Buffer files a pass took from memory."""
    files_resplit: int = 0
    """Held files split again in memory for another shard count (not read from Delta)."""
    refused: list[str] = field(default_factory=list)
    """Why the cache was emptied, once per occasion (another lake or table id, another shard count, over budget)."""


class BuildStateCache:
    """The buffer of successive :func:`sequences.pipeline.run_build` passes in one process (module docstring).

    Pass one instance to every ``run_build(..., state_cache=cache)`` of a follow loop; ``None`` (the default of
    ``run_build``) reads everything from Delta. Not thread-safe: one build at a time uses it (``run_build`` holds
    the lake's build lock). A Beam build does not use it (its workers read their own inputs).
    """

    def __init__(self) -> None:
        self.stats = CacheStats()
        self._where: tuple[str, str] | None = None  # (lake root, table id) the files belong to
        self._shards: int | None = None  # the shard count the held files are split into
        self._files: dict[str, _File] = {}
        self._bytes_per_row: float | None = None  # measured on the files held last; kept when they are dropped
        self.pending_keys = PendingKeys()
        """The pending state's keys, held for :func:`sequences.pipeline.due_pending` (fnw and defer)."""

    def clear(self, reason: str) -> None:
        """Drop every cached file (``reason`` is logged and kept in :attr:`stats`)."""
        if self._files:
            log.info("build state cache emptied: %s", reason)
            self.stats.refused.append(reason)
        self._files, self._where, self._shards = {}, None, None

    @property
    def nbytes(self) -> int:
        """Bytes of the Arrow data held (both splits and the labels)."""
        return sum(f.nbytes for f in self._files.values())

    def buffer(self, lake: str, version: int, shards: int, budget_bytes: int,
               storage_options: StorageOptions | None = None) -> HeldBuffer | None:
        """The buffer at Delta ``version`` split into ``shards`` shards, reading only the files not held; None (and
        nothing held) where its Arrow data would exceed ``budget_bytes // 2`` (read it from Delta instead).

        Raises:
            ValueError: ``lake`` has no buffer table at ``version``.
        """
        dt = open_table(lake, Table.BUILD_BUFFER, version, storage_options=storage_options)
        if dt is None:
            raise ValueError(f"{lake}: no {Table.BUILD_BUFFER} table at version {version}")
        where = (lake, str(dt.metadata().id))
        if self._where != where:
            self.clear(f"the buffer is now {where[0]} (table id {where[1]}), not {self._where}")
            self._where = where
        resplit, self._shards = self._shards not in (None, shards), shards
        snapshot = _identities(dt)
        kept = {path: f for path, f in self._files.items() if snapshot.get(path) == f.identity}
        dataset = dt.to_pyarrow_dataset()
        fragments = list(dataset.get_fragments())
        new_rows = sum(f.count_rows() for f in fragments if _path(f) not in kept)
        held_rows = sum(_rows(f) for f in kept.values())
        limit = budget_bytes // 2
        # Decided before reading, from the bytes per row measured so far, so an over-budget buffer is not read
        # twice a pass (once here, once by the pass) but only once, the first time.
        per_row = self._bytes_per_row
        if per_row is not None and (held_rows + new_rows) * per_row > limit:
            self.clear(f"the buffer's {held_rows + new_rows} rows would take ~{(held_rows + new_rows) * per_row:,.0f} "
                       f"bytes, over half of build.memory_budget_bytes ({limit:,} bytes)")
            return None
        files: dict[str, _File] = {}
        for fragment in fragments:
            path = _path(fragment)
            if path in kept and resplit:
                files[path] = _split_file(_file_rows(kept[path], dataset.schema), snapshot[path], shards)
                self.stats.files_resplit += 1
                continue
            if path in kept:
                files[path] = kept[path]
                self.stats.files_reused += 1
                continue
            files[path] = _split_file(fragment.to_table(schema=dataset.schema), snapshot[path], shards)
            self.stats.files_read += 1
        self._files = files
        rows = sum(_rows(f) for f in files.values())
        if rows:
            self._bytes_per_row = self.nbytes / rows
        if self.nbytes > limit:
            self.clear(f"the buffer's copy takes {self.nbytes:,} bytes, over half of build.memory_budget_bytes "
                       f"({limit:,} bytes)")
            return None
        return _held(files.values(), dataset.schema)


def _identities(dt: Any) -> dict[str, tuple[int, int]]:
    """Each data file of the Delta snapshot ``dt``: path (relative to the table root) -> (size_bytes,
    modification_time), the identity a cached copy of the file must match."""
    actions = pa.table(dt.get_add_actions(flatten=True)).select(["path", "size_bytes", "modification_time"])
    return {row["path"]: (row["size_bytes"], row["modification_time"]) for row in actions.to_pylist()}


def _path(fragment: Any) -> str:
    """A fragment's path as the add actions name it (relative to the table root)."""
    return str(fragment.path).lstrip("/")


def _rows(f: _File) -> int:
    return sum(t.num_rows for _, t in f.pieces[SPLIT_KEYS[0]])


def _split_file(rows: pa.Table, identity: tuple[int, int], shards: int) -> _File:
    split = {key: split_by_shard_with_order(rows, key, shards) for key in SPLIT_KEYS}
    pieces = {key: by_shard for key, (by_shard, _) in split.items()}
    pieces[SPLIT_KEYS[0]], order = _item_sorted(*split[SPLIT_KEYS[0]])
    labels = rows.select(LABEL_COLUMNS).filter(pc.is_in(rows.column("event_type"), value_set=pa.array(list(TASKS))))
    nbytes = sum(t.nbytes for split in pieces.values() for _, t in split) + labels.nbytes + order.nbytes
    return _File(identity, pieces, labels, order, nbytes)


ITEM_ORDER = [("item_id", "ascending"), ("event_time_ms", "ascending"), ("event_id", "ascending")]
"""The order the item shard step sorts its buffer and new events in
(:func:`sequences.vectorized.item_shard_vectorized`: item, then :data:`features.vectorized.EVENT_ORDER`)."""


def _item_sorted(pieces: list[tuple[int, pa.Table]], order: np.ndarray) -> tuple[list[tuple[int, pa.Table]], np.ndarray]:
    """Each item piece stably sorted by :data:`ITEM_ORDER`, and ``order`` permuted to match.

    The buffer's files are written in user order, so the item step's stable sort of (buffer + new events) by item
    had to sort every held row each pass (0.22-0.33 CPU-s of a 0.9 CPU-s step at 274k buffered events); sorted
    runs, one per file, sort ~4x faster (0.07). A stable sort of the pieces concatenated gives the same rows in the
    same order whether or not each file's piece was stably sorted first (ties keep file order within a file and
    the snapshot's file order across files), so the item step's output is unchanged."""
    sorted_pieces, parts, start = [], [], 0
    for shard, table in pieces:
        within = pc.sort_indices(table, sort_keys=ITEM_ORDER).to_numpy()  # stable (Arrow's sort_indices)
        sorted_pieces.append((shard, table.take(pa.array(within))))
        parts.append(order[start:start + table.num_rows][within])
        start += table.num_rows
    return sorted_pieces, (np.concatenate(parts) if parts else order)


def _file_rows(f: _File, schema: pa.Schema) -> pa.Table:
    """The file's rows in file order, put back from its ``SPLIT_KEYS[0]`` pieces (``schema``: the buffer's)."""
    tables = [t for _, t in f.pieces[SPLIT_KEYS[0]]]
    if not tables:
        return schema.empty_table()
    back = np.empty_like(f.order)
    back[f.order] = np.arange(f.order.size)
    return pa.concat_tables(tables).take(pa.array(back))


def _held(files: Any, schema: pa.Schema) -> HeldBuffer:
    pieces: dict[str, dict[int, list[pa.Table]]] = {key: {} for key in SPLIT_KEYS}
    labels, rows = [], 0
    for f in files:
        for key in SPLIT_KEYS:
            for shard, table in f.pieces[key]:
                pieces[key].setdefault(shard, []).append(table)
        labels.append(f.labels)
        rows += _rows(f)
    empty = pa.schema([schema.field(c) for c in LABEL_COLUMNS]).empty_table()
    # One table per shard (a zero-copy concatenation), as the fresh read's split gives.
    joined = {key: {shard: pa.concat_tables(tables) for shard, tables in by_shard.items()}
              for key, by_shard in pieces.items()}
    return HeldBuffer(joined, pa.concat_tables(labels) if labels else empty, rows)


class PendingKeys:
    """The pending state (``_build_state/pending``) per data file, kept across the passes of one process, so
    :func:`sequences.pipeline.due_pending` reads only the files a snapshot added: their narrow key columns always,
    and their whole rows while those fit ``whole_bytes`` (the rows a pass publishes or corrects are then taken
    from memory instead of decoding every row group that holds one).

    In ``fnw`` and ``defer`` a pending row stays until its longest window closes (days), so the table holds every
    impression of that long, and reading its keys was a growing share of each pass (0.9 CPU-s of a 16 CPU-s pass
    after ten minutes at 2,000 events/s). Decoding the row groups that hold the due rows was the next one: late
    positives scatter them over most of the table (0.53 CPU-s of a 9.7 CPU-s pass at the end of a 7-minute run,
    2026-12-03). Exactness as :class:`BuildStateCache`: a copy is used only for a file of the snapshot read, under
    the same path, size and modification time; a file of another table id, or not in the snapshot any more, is
    dropped. Not thread-safe (one build at a time).
    """

    def __init__(self) -> None:
        self._table_id: str | None = None
        self._files: dict[str, tuple[tuple[int, int], pa.Table, pa.Table | None]] = {}
        self._offsets = np.zeros(1, dtype=np.int64)
        self.files_read = 0
        """Pending files read from Delta (tests and the benchmark read it)."""
        self.files_reused = 0
        """Pending files that came from memory."""
        self.rows_taken = 0
        """Due rows :meth:`take` served from the whole rows held."""

    @property
    def whole_nbytes(self) -> int:
        """Bytes of the whole rows held (Arrow data)."""
        return sum(whole.nbytes for _, _, whole in self._files.values() if whole is not None)

    def keys(self, dt: Any, columns: list[str], whole_bytes: int = 0) -> tuple[pa.Table, list[str], np.ndarray]:
        """The ``columns`` of every row of the Delta table ``dt`` (a pending snapshot), files in the dataset's
        order and rows in file order; the files' paths (relative to the table root, as ``__filename`` gives
        them); and, per row, the index of its file in those paths ((rows,) int64).

        ``whole_bytes``: a file read now is read and held whole (every column of ``dt``'s schema) while the whole
        rows held stay within this many bytes of Arrow data (0: keys only); :meth:`take` serves rows from them."""
        table_id = str(dt.metadata().id)
        if table_id != self._table_id:
            self._files, self._table_id = {}, table_id
        snapshot = _identities(dt)
        dataset = dt.to_pyarrow_dataset()
        files: dict[str, tuple[tuple[int, int], pa.Table, pa.Table | None]] = {}
        held = 0
        for fragment in dataset.get_fragments():
            path = _path(fragment)
            kept = self._files.get(path)
            if kept is not None and kept[0] == snapshot.get(path):
                files[path] = kept
                held += 0 if kept[2] is None else kept[2].nbytes
                self.files_reused += 1
                continue
            whole = fragment.to_table(schema=dataset.schema) if held < whole_bytes else None
            if whole is not None and held + whole.nbytes > whole_bytes:
                whole = None  # over the budget: this file's keys only, as the files after it
            held += 0 if whole is None else whole.nbytes
            rows = whole.select(columns) if whole is not None else fragment.to_table(schema=dataset.schema,
                                                                                      columns=columns)
            files[path] = (snapshot.get(path, (-1, -1)), rows, whole)
            self.files_read += 1
        self._files = files
        tables = [rows for _, rows, _ in files.values()]
        counts = np.array([t.num_rows for t in tables], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        keys = (pa.concat_tables(tables) if tables
                else pa.schema([dataset.schema.field(c) for c in columns]).empty_table())
        return keys, list(files), np.repeat(np.arange(len(tables), dtype=np.int64), counts)

    def take(self, positions: np.ndarray) -> pa.Table | None:
        """The whole rows at ``positions`` ((k,) int64, ascending) of the last :meth:`keys` call's rows, in that
        order; None when one of them lies in a file held by its keys only (read those rows from Delta)."""
        files = list(self._files.values())
        file_of = np.searchsorted(self._offsets, positions, side="right") - 1
        parts = []
        for f in np.unique(file_of).tolist():
            whole = files[f][2]
            if whole is None:
                return None
            local = positions[file_of == f] - self._offsets[f]
            parts.append(whole.take(pa.array(local)))
        if not parts:
            return None
        self.rows_taken += len(positions)
        return pa.concat_tables(parts).combine_chunks()  # one chunk, as a read of a row group or two gives
