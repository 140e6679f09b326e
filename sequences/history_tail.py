"""Each user's recent ``history`` rows, held by a long-running reader (``validate --follow``, ``train --follow``).

:func:`sequences.materialize.read_history` reads every row of a batch's users; a batch's users fall in
nearly every ``user_bucket`` and ``history`` keeps every event of the run, so each batch of pointer rows
read about the whole table, a cost that grew with the run. A :class:`HistoryTail` reads the table once,
then only the rows each later commit added (:func:`gemline.increments.read_from`), and keeps them in
memory, compacted (:func:`compact`) to what an example of a later build can still see: each user's newest
``max_seq_len`` and each (user, domain)'s newest ``same_domain_seq_len`` events of the builds up to a
horizon, every event after it, and the count of what it left out (:class:`sequences.materialize.HistoryCut`).
So a batch's cost follows its rows and their users' bounded tails, not the run's length; its memory is at
most users x (``max_seq_len`` + domains x ``same_domain_seq_len``) rows plus the events since the horizon.

Exactness (the point-in-time rule is untouched): an example of build k > horizon is rebuilt from the
compacted rows exactly as from the whole history (:class:`~sequences.materialize.HistoryCut`); a batch
holding an example of a build at or before the horizon (a label correction of an old impression) is
answered with the whole history of its users (:func:`~sequences.materialize.read_history`), the reference
path. Compaction runs when the rows since the horizon outnumber the compacted ones (amortised O(1) per
event), its horizon the oldest build the last batch pointed into, less ``margin_builds``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from features.vectorized import EVENT_ORDER
from gemline.increments import Cursor, CursorError, read_since, table_id
from gemline.lake import Lake, StorageOptions, open_table
from gemline.tables import Table
from sequences.materialize import _HISTORY_COLUMNS, HistoryCut, read_history
from sequences.schema import HISTORY_SCHEMA

log = logging.getLogger(__name__)

_CUT_SCHEMA = {"user_id": pl.String, "cut": pl.Int64}
_DOMAIN_CUT_SCHEMA = {"user_id": pl.String, "domain": pl.String, "cut": pl.Int64}


def no_cut() -> HistoryCut:
    """The :class:`~sequences.materialize.HistoryCut` of a history nothing was left out of."""
    return HistoryCut(-1, pl.DataFrame(schema=_CUT_SCHEMA), pl.DataFrame(schema=_DOMAIN_CUT_SCHEMA))


def _add_counts(counts: pl.DataFrame, more: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    """Per-key sums of two ``keys`` + ``cut`` count tables."""
    return pl.concat([counts, more.select(*keys, "cut")]).group_by(keys).agg(pl.col("cut").sum())


def compact(rows: pl.DataFrame, cut: HistoryCut, horizon: int, max_seq_len: int, same_domain_seq_len: int
            ) -> tuple[pl.DataFrame, HistoryCut]:
    """(kept rows, cut): ``rows`` (``history`` columns of every user, already compacted up to ``cut.horizon``)
    compacted up to build ``horizon``: of the rows of builds <= ``horizon``, each user's newest
    ``max_seq_len`` and each (user, domain)'s newest ``same_domain_seq_len`` by (event_time_ms, event_id);
    every later row; the rows left out added to ``cut``'s counts. A ``horizon`` at or before
    ``cut.horizon`` changes nothing.

    Exact for examples of builds > ``horizon``: see :class:`sequences.materialize.HistoryCut`.
    """
    if horizon <= cut.horizon:
        return rows, cut
    old = rows.filter(pl.col("build") <= horizon).sort(EVENT_ORDER, descending=True)
    ranked = old.with_columns(pl.int_range(pl.len()).over("user_id").alias("_user_rank"),
                              pl.int_range(pl.len()).over(["user_id", "domain"]).alias("_domain_rank"))
    keep = (pl.col("_user_rank") < max_seq_len) | (pl.col("_domain_rank") < same_domain_seq_len)
    dropped = ranked.filter(~keep)
    kept = pl.concat([ranked.filter(keep).drop("_user_rank", "_domain_rank"), rows.filter(pl.col("build") > horizon)])
    users = _add_counts(cut.users, dropped.group_by("user_id").agg(pl.len().cast(pl.Int64).alias("cut")), ["user_id"])
    domains = _add_counts(cut.domains, dropped.group_by(["user_id", "domain"]).agg(pl.len().cast(pl.Int64).alias("cut")),
                          ["user_id", "domain"])
    return kept, HistoryCut(horizon, users, domains)


def _anchors(pointer_rows: pa.Table) -> pa.ChunkedArray | pa.Array:
    """The event id each pointer row's sequence is cut at: its own impression, or the one it corrects."""
    anchor = pointer_rows.column("example_id")
    if "corrects_example_id" in pointer_rows.column_names:
        anchor = pc.coalesce(pointer_rows.column("corrects_example_id"), anchor)
    return anchor


class HistoryReader:
    """A long-running reader's copy of columns of a lake's ``history``: the whole table on the first
    :meth:`advance` (and when the table was recreated, or a file under the cursor is gone), then only the rows
    each new commit added. A subclass keeps them as it needs (:meth:`_whole`, :meth:`_added`).

    Args:
        lake: the lake (or its root) whose ``history`` table is read.
        storage_options: the lake's object-store options (with a root).
    """

    COLUMNS: list[str] = _HISTORY_COLUMNS
    """The ``history`` columns read."""

    def __init__(self, lake: Lake | str | Path, storage_options: StorageOptions | None = None) -> None:
        self.lake = lake.root if isinstance(lake, Lake) else lake
        self.storage_options = lake.delta_options if isinstance(lake, Lake) else storage_options
        self.cursor: Cursor | None = None

    def _whole(self, rows: pl.DataFrame) -> None:
        """Take every row of the table (what was kept before is dropped)."""
        raise NotImplementedError

    def _added(self, rows: pl.DataFrame) -> None:
        """Take the rows the commits since the last call added."""
        raise NotImplementedError

    def advance(self, version: int | None = None) -> None:
        """Take in the rows added since the last call up to ``history@version`` (newest when None): the
        whole table the first time, or when it was recreated, or when a file under the cursor is gone."""
        tid = table_id(self.lake, Table.HISTORY, storage_options=self.storage_options)
        if tid is None:
            return
        if self.cursor is not None and self.cursor.table_id == tid:
            try:
                added, cursor = read_since(self.lake, Table.HISTORY, self.cursor, columns=self.COLUMNS,
                                           until_version=version, storage_options=self.storage_options)
            except CursorError as exc:
                log.warning("%s: reading the whole history again (%s)", type(self).__name__, exc)
            else:
                if added is not None:
                    self._added(pl.DataFrame(added).select(self.COLUMNS))
                self.cursor = cursor
                return
        dt = open_table(self.lake, Table.HISTORY, version, storage_options=self.storage_options)
        assert dt is not None, "table_id found the table"
        self._whole(pl.DataFrame(dt.to_pyarrow_dataset().to_table(columns=self.COLUMNS)).select(self.COLUMNS))
        self.cursor = Cursor(tid, dt.version() + 1)


class HistoryTail(HistoryReader):
    """The compacted ``history`` of a lake, advanced on each call by the rows the table's new commits added.

    Args:
        lake: the lake (or its root) whose ``history`` table is read.
        max_seq_len, same_domain_seq_len: the build's sequence lengths (``build`` commit metadata); the
            compaction keeps that many events per user and per (user, domain).
        storage_options: the lake's object-store options.
        margin_builds: how many builds before the oldest one a batch pointed into are kept whole, so a
            later batch pointing a little further back (a correction) still reads the compacted rows.
        min_compact_rows: no compaction while fewer rows than this came since the horizon.
    """

    def __init__(self, lake: Lake | str | Path, max_seq_len: int, same_domain_seq_len: int, *,
                 storage_options: StorageOptions | None = None, margin_builds: int = 10,
                 min_compact_rows: int = 200_000) -> None:
        super().__init__(lake, storage_options)
        self.max_seq_len, self.same_domain_seq_len = max_seq_len, same_domain_seq_len
        self.margin_builds, self.min_compact_rows = margin_builds, min_compact_rows
        self.rows = pl.DataFrame(HISTORY_SCHEMA.empty_table().select(_HISTORY_COLUMNS))
        self.cut = no_cut()
        self.full_reads = 0
        """Batches answered with the whole history of their users (an example at or before the horizon)."""

    def _whole(self, rows: pl.DataFrame) -> None:
        self.rows, self.cut = rows, no_cut()

    def _added(self, rows: pl.DataFrame) -> None:
        self.rows = pl.concat([self.rows, rows], how="vertical_relaxed")

    def history_for(self, pointer_rows: pa.Table, version: int | None = None) -> tuple[pa.Table, HistoryCut | None]:
        """(history rows, cut) to rebuild ``pointer_rows``' sequences with
        (:func:`sequences.materialize.sequence_index` / ``sequence_summary``'s ``history`` and ``cut``):
        the compacted rows of their users and what was left out of them, or, when a row points to an
        impression at or before the horizon (or to none in the table), their users' whole history
        (:func:`~sequences.materialize.read_history`) and None. ``version``: as :meth:`advance`."""
        self.advance(version)
        users = pl.Series("user_id", pointer_rows.column("user_id")).unique()
        mine = self.rows.filter(pl.col("user_id").is_in(users.implode()))
        anchors = pl.Series("event_id", _anchors(pointer_rows)).unique()
        builds = mine.filter(pl.col("event_id").is_in(anchors.implode())).get_column("build")
        if pointer_rows.num_rows and (builds.len() < anchors.len() or builds.min() <= self.cut.horizon):  # type: ignore[operator]
            self.full_reads += 1
            return read_history(self.lake, pointer_rows.column("user_id"), version=version,
                                storage_options=self.storage_options), None
        cut = HistoryCut(self.cut.horizon, self.cut.users.join(mine.select("user_id").unique(), on="user_id", how="semi"),
                         self.cut.domains.join(mine.select("user_id").unique(), on="user_id", how="semi"))
        history = mine.to_arrow()
        if builds.len():
            self._maybe_compact(int(builds.min()) - 1 - self.margin_builds)  # type: ignore[arg-type]
        return history, cut

    def _maybe_compact(self, horizon: int) -> None:
        newer = self.rows.filter(pl.col("build") > self.cut.horizon).height
        if newer >= max(self.min_compact_rows, self.rows.height - newer):
            self.rows, self.cut = compact(self.rows, self.cut, horizon, self.max_seq_len, self.same_domain_seq_len)
