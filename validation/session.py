"""What a long-running validator (``gemline validate --follow``) keeps between versions instead of reading again.

Validating one version used to read the whole ``quality`` table (which events version was validated last) and
the whole ``quality_profiles`` table (the drift baseline), and the follower read ``quality`` again for every
pass to find the versions not validated yet: reads that grow with every version validated, so a stream paid
more per version the longer it ran (about a third of the CPU of a 3-minute stream's version). A
:class:`ValidationSession` keeps an index of each of the two tables in memory and brings it up to date before
each version by reading only the commits added since (the process's :class:`gemline.increments.TableLedger` of
each table: one ``stat`` per new log entry, then that commit's own files), so its answers are those of a fresh read of the tables
(``tests/validation/test_session.py`` checks the quality rows, profiles and reports of a session against
fresh validations).

Nothing is written from the session: a crashed or restarted validator starts a new one from the tables. A
commit that removed rows from either table, or the table's recreation under the same path, makes the ledger read
that table whole again, and the session rebuilds its index.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from gemline.gate import QUALITY_SCHEMA, RELEASE
from gemline.increments import ledger, rows_added
from gemline.lake import Lake, open_table
from gemline.tables import Table
from sequences.config import BuildConfig
from sequences.history_tail import HistoryTail
from sequences.pointer_summaries import PointerSummaries
from validation.pointer_checks import Summaries, split_summaries, summarize_pointers
from validation.profiles import PROFILES_SCHEMA
from validation.suites import SEQUENCE_TIME_COLUMN

log = logging.getLogger(__name__)


class _AppendOnlyTail:
    """Feeds every row of one append-only Delta table to ``on_rows``: the whole table first, then the rows each new
    commit added, as the process's :class:`gemline.increments.TableLedger` of the table takes them in (the gate's
    own reads share it); ``on_reset`` is called before the rows are fed whole again, after the ledger read the
    table whole again (a commit removed files, the table was recreated).

    Args:
        lake: the lake holding ``table``.
        table: an append-only table (``quality``, ``quality_profiles``).
        schema: the columns fed: the ledger's schema.
    """

    def __init__(self, lake: Lake, table: str, schema: pa.Schema, on_rows: Callable[[pa.Table], None],
                 on_reset: Callable[[], None]) -> None:
        self._ledger = ledger(lake, table, schema)
        self._on_rows, self._on_reset = on_rows, on_reset
        self._generation: int | None = None
        self._fed = 0
        """Rows of the ledger's current generation fed so far."""

    @property
    def whole_reads(self) -> int:
        """How many times the ledger read the table whole."""
        return self._ledger.generation

    def advance(self) -> None:
        """Feed the rows committed since the last call (the whole table the first time)."""
        rows = self._ledger.rows()
        if rows is None:
            return
        if self._ledger.generation != self._generation:
            self._on_reset()
            self._generation, self._fed = self._ledger.generation, 0
        if rows.num_rows > self._fed:
            self._on_rows(rows.slice(self._fed))
            self._fed = rows.num_rows


class SeenEventIds:
    """Hashes of the ``event_id`` of every ``events`` row up to one version, in the ``event_date`` partitions from
    :attr:`first_date` on: what lets an events increment skip reading the earlier rows it may repeat when none of
    its ids can be among them (:func:`validation.run._events_increment`).

    A hash (polars' 64-bit hash of the string) that matches proves nothing (the earlier rows are then read as
    without a session); no hash matching proves that no earlier row has one of the ids, so the earlier rows the
    reference would read are none. The hashes are one sorted uint64 array: 8 bytes a row; past
    :data:`MAX_SEEN_IDS` rows the session stops keeping them (the reads come back).
    """

    def __init__(self) -> None:
        self.version: int | None = None
        """The events version whose rows the hashes cover; None: none kept."""
        self.first_date = ""
        self._hashes = np.zeros(0, np.uint64)
        self.skips = 0
        """Increments that found none of their ids here (their earlier rows not read)."""

    @staticmethod
    def _hash(ids: pa.ChunkedArray | pa.Array) -> np.ndarray:
        return np.sort(pl.Series(ids).drop_nulls().hash(seed=0).to_numpy())

    def none_of(self, ids: pa.Array, dates: list[str], since: int) -> bool:
        """True when none of ``ids`` is the id of a row of ``events@since`` in the partitions ``dates`` (the
        ``event_date`` strings the reference reads); False when some may be, or the hashes do not cover them."""
        if self.version != since or not dates or min(dates) < self.first_date:
            return False
        wanted = self._hash(ids)
        if len(self._hashes):
            at = np.minimum(np.searchsorted(self._hashes, wanted), len(self._hashes) - 1)
            if np.any(self._hashes[at] == wanted):
                return False
        self.skips += 1
        return True

    def reset(self, version: int, rows: pa.Table, first_date: str) -> None:
        """Cover ``events@version`` from its rows (``event_id``, ``event_date``) in the partitions from ``first_date``."""
        kept = rows.filter(pc.greater_equal(rows["event_date"], first_date))
        self.version, self.first_date, self._hashes = None, first_date, self._hash(kept["event_id"])
        self._keep(version)

    def extend(self, since: int, version: int, rows: pa.Table) -> None:
        """Cover ``events@version`` given the rows it added after ``events@since`` (which must be covered)."""
        if self.version != since:
            self.version = None
            return
        kept = rows.filter(pc.greater_equal(rows["event_date"], self.first_date))
        new = self._hash(kept["event_id"])
        self._hashes = np.insert(self._hashes, np.searchsorted(self._hashes, new), new)
        self._keep(version)

    def _keep(self, version: int) -> None:
        if len(self._hashes) > MAX_SEEN_IDS:
            log.info("validation session: more than %d events ids since %s; earlier rows are read again",
                     MAX_SEEN_IDS, self.first_date)
            self.version, self._hashes = None, np.zeros(0, np.uint64)
        else:
            self.version = version


MAX_SEEN_IDS = 20_000_000
"""Most event ids :class:`SeenEventIds` keeps (8 bytes each: 160 MB), about 3 hours of a 2,000 events/s stream."""


@dataclass
class _Profile:
    key: tuple[int, str]  # (run_ts_ms, run_id): the newest run of a version wins, as profiles.profile_history
    passed: bool
    metrics: dict[str, float] = field(default_factory=dict)


class ValidationSession:
    """The ``quality`` and ``quality_profiles`` tables of ``lake`` kept in memory for a validator that judges
    version after version (module docstring), plus the ``history`` tail of its pointer checks.

    Its answers equal :func:`gemline.gate.last_validated_before`, :func:`gemline.gate.gate_decisions`'
    ``validated`` and :func:`validation.profiles.profile_history` on the tables as they are at :meth:`refresh`.

    Args:
        lake: the lake validated.
        history_tail: the pointer checks' ``history`` (:class:`sequences.history_tail.HistoryTail`), or None.
        pointer_summaries: the pointer checks' sequence summaries kept up to date with ``history``
            (:class:`sequences.pointer_summaries.PointerSummaries`, a cost that follows each version's rows); when
            set, it answers them instead of ``history_tail``.
    """

    def __init__(self, lake: Lake, history_tail: HistoryTail | None = None,
                 pointer_summaries: PointerSummaries | None = None) -> None:
        self.lake = lake
        self.history_tail = history_tail
        self.pointer_summaries = pointer_summaries
        self._validated: dict[str, set[int]] = {}
        self._profiles: dict[tuple[str, int], _Profile] = {}
        self._snapshots: dict[str, DeltaTable | None] = {}
        self.events_ids = SeenEventIds()
        self._pointer_summaries: dict[int, tuple[int, Summaries]] = {}
        self._quality = _AppendOnlyTail(lake, Table.QUALITY, QUALITY_SCHEMA, self._add_quality, self._validated.clear)
        self._profile_rows = _AppendOnlyTail(lake, Table.QUALITY_PROFILES, PROFILES_SCHEMA, self._add_profiles,
                                             self._profiles.clear)

    def prefetch_pointer_summaries(self, versions: list[int], build: BuildConfig) -> None:
        """Summarize the pointer rows of several ``examples`` versions (a validator behind by more than one) in one
        pass over their users' history: that pass costs about the history rows of the users, whom consecutive
        versions share, not the rows, so k versions cost about one. :meth:`take_pointer_summaries` hands each
        version its part, equal to what its rows alone give (:func:`validation.pointer_checks.split_summaries`).
        Nothing is kept when the rows are not in the pointer layout, the session has no history tail, or an
        impression is missing from history (each version then meets the error on its own)."""
        if self.history_tail is None or self.pointer_summaries is not None or len(versions) < 2:
            return
        opts = self.lake.delta_options
        read = [rows_added(self.lake.root, Table.EXAMPLES, v, storage_options=opts) for v in versions]
        parts = [p for p in read if p is not None]
        if len(parts) < len(read) or any(SEQUENCE_TIME_COLUMN in p.column_names for p in parts):
            return
        rows = pa.concat_tables(parts, promote_options="permissive")
        history, cut = self.history_tail.history_for(rows)
        try:
            summaries = summarize_pointers(rows, history, build, cut)
        except ValueError:
            return
        for version, part, summary in zip(versions, parts, split_summaries(summaries, [p.num_rows for p in parts]),
                                          strict=True):
            self._pointer_summaries[version] = (part.num_rows, summary)

    def take_pointer_summaries(self, version: int, num_rows: int) -> Summaries | None:
        """The summaries :meth:`prefetch_pointer_summaries` made for ``examples@version`` (once), or None."""
        kept = self._pointer_summaries.pop(version, None)
        return kept[1] if kept is not None and kept[0] == num_rows else None

    def refresh(self) -> None:
        """Take in what was committed to ``quality`` and ``quality_profiles`` since the last call."""
        self._quality.advance()
        self._profile_rows.advance()

    def _add_quality(self, rows: pa.Table) -> None:
        checks = rows.filter(pc.not_equal(rows["expectation"], RELEASE)).select(["table", "table_version"])
        for table, version in zip(checks["table"].to_pylist(), checks["table_version"].to_pylist()):
            self._validated.setdefault(table, set()).add(version)

    def _add_profiles(self, rows: pa.Table) -> None:
        for r in rows.to_pylist():
            where, key = (r["table"], r["table_version"]), (r["run_ts_ms"], r["run_id"])
            known = self._profiles.get(where)
            if known is None or key > known.key:
                known = self._profiles[where] = _Profile(key, r["passed"])
            if key == known.key:
                known.passed = r["passed"]
                known.metrics[r["metric"]] = r["value"]

    def snapshot(self, table: str) -> DeltaTable | None:
        """An open handle of ``table`` kept for this session's commits to it (``quality``, ``quality_profiles``),
        which bring it up to date (:func:`gemline.lake.commit_once`); None while the table does not exist."""
        if self._snapshots.get(table) is None:
            self._snapshots[table] = open_table(self.lake.root, table, storage_options=self.lake.delta_options)
        return self._snapshots[table]

    def validated(self, table: str) -> set[int]:
        """The versions of ``table`` with a validation run (a release alone is not one), at the last refresh."""
        return set(self._validated.get(table, ()))

    def last_validated_before(self, table: str, table_version: int) -> int | None:
        """:func:`gemline.gate.last_validated_before` at the last refresh."""
        return max((v for v in self._validated.get(table, ()) if v < table_version), default=None)

    def profile_history(self, table: str, before_version: int, k: int) -> list[tuple[int, dict[str, float]]]:
        """:func:`validation.profiles.profile_history` at the last refresh."""
        kept = sorted(v for (t, v), p in self._profiles.items() if t == table and v < before_version and p.passed)
        return [(v, dict(self._profiles[(table, v)].metrics)) for v in kept[-k:]]
