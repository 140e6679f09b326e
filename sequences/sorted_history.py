"""Pointer rows' sequences for a long-running reader from a history kept sorted by key and time.

:func:`sequences.materialize.sequence_index` rebuilds a batch's sequences with a sorted join of every
``history`` row of its users; a batch's users are nearly all users, so each batch sorts about the whole
history again (9-15 CPU-s per examples version in the tenth minute of ``benchmarks.freshness``, where
``defer``'s corrections keep the compacted tail from dropping anything). :class:`SortedHistory` keeps the
history sorted by (key, event time, event id) across calls, re-sorting only when commits added rows, and cuts
each row's sequence from a window of its key's events just before the row's time:

- the row's position ``p`` in its key's events (the first at or after its time) by a binary search;
- the window ``[max(start, p - W), p)``, W = ``max_len`` + :data:`WINDOW_SLACK`: of its events, the ones the
  point-in-time rule (:mod:`sequences.materialize`) shows the row are those of its own build k appended at or
  before it, and those of earlier builds appended at or before it that are among the newest ``max_len``
  events of builds < k; the newest ``max_len`` shown are kept.

That is exact when no event of a build < k sits at or after ``p`` (checked with the key's suffix minimum of
``build``), no event of a build > k sits before the window (its prefix maximum), and the window starts at the
key's first event or shows ``max_len`` events with everything before it appended at or before the row (its
prefix maximum of ``created_ts_ms``): nothing before the window is kept then, and what of it is shown is
counted (every event of build k, and the newest of the earlier builds' up to ``max_len`` with the window's). Any other row (a late impression, a
window too short) goes to :func:`~sequences.materialize.sequence_index` over its users' rows: the reference.
The same stored-length check as the reference raises on a row that disagrees with the history.

Cost per batch: O(n x W) for n rows plus the rows sent to the reference; per commit read, a sort of the added
rows and a merge of five int64 arrays per kind held (the order is a permutation of the append-only rows, whose
strings are never copied into it; an added event sharing a held one's key and millisecond is placed by event id,
not by sorting everything again). Measured 2026-12-04 on a 10-minute freshness lake (57 history commits, 1.04M
rows at the end; ``advance`` replayed commit by commit, both kinds held, the previous code and this alternated
twice in one process):
26.0 and 23.3 -> 7.7 and 7.7 CPU-s in all, the last 10 commits 0.66 and 0.58 -> 0.20 and 0.18 CPU-s each. Still
O(rows held) per commit, with a small constant. The rows are all kept: memory as the uncompacted history tail's.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from gemline.lake import Lake, StorageOptions
from sequences.history_tail import HistoryReader
from sequences.materialize import _HISTORY_COLUMNS, SequenceIndex, check_stored_lengths, sequence_index

log = logging.getLogger(__name__)

TIE_LIMIT = 64
"""Events of one key at one millisecond searched for a row's impression before its user's rows are."""

TIES_MAX = 4096
"""Added rows sharing a held row's key and millisecond placed one by one in a merge; more re-sort everything."""

CHUNKS_MAX = 16
"""Commits' rows held as separate chunks before :class:`SortedHistory` joins them into one."""

WINDOW_SLACK = 64
"""Events looked at beyond ``max_len`` before a row's time: room for events of later builds and
invisible ones in the window before a row needs the reference."""


class _Sorted:
    """One kind's rows (cross-domain: by user; same-domain: by (user, domain)) in (key, time, event id) order,
    held as ``perm``, their positions in the reader's append-only rows (``whole``), with the columns the searches
    read in that order, each key's first row, and the running minimum (from the end) and maximum (from the
    start) of ``build`` within each key. The string columns are never copied into the order: a merge moves
    five int64 arrays, and a query gathers only the rows it returns from ``whole``."""

    def __init__(self, whole: pl.DataFrame, keys: list[str]) -> None:
        self.keys = keys
        codes = whole.select(keys).unique().with_row_index("_kc").with_columns(pl.col("_kc").cast(pl.Int64))
        ordered = (whole.select(*keys, "event_time_ms", "event_id", "build", "created_ts_ms")
                   .with_row_index("_r").join(codes, on=keys, how="inner").sort("_kc", "event_time_ms", "event_id"))
        self.codes, self.whole = codes, whole
        self.perm = ordered.get_column("_r").cast(pl.Int64).to_numpy()
        self.kc = ordered.get_column("_kc").to_numpy()
        self.time = ordered.get_column("event_time_ms").to_numpy()
        self.build = ordered.get_column("build").to_numpy()
        self.created = ordered.get_column("created_ts_ms").to_numpy()
        self._derive()

    def _derive(self) -> None:
        """The arrays the searches read, from the ordered ``kc``, ``time``, ``build`` and ``created`` alone."""
        self.suffix_min = _within_keys(self.kc, self.build, np.minimum, reverse=True)
        self.prefix_max = _within_keys(self.kc, self.build, np.maximum)
        self.prefix_created = _within_keys(self.kc, self.created, np.maximum)
        self.t_lo = int(self.time.min()) if self.time.size else 0
        self.t_hi = int(self.time.max()) + 1 if self.time.size else 1
        # (key code, time) as one int64, for binary searches; times are clipped to [t_lo, t_hi] (a search past
        # either end lands at the same place).
        self.span = self.t_hi - self.t_lo + 1
        top = int(self.kc.max()) + 2 if self.kc.size else 2
        if top * self.span >= 2**62:
            raise OverflowError("sorted history: key count x time span does not fit a 64-bit search key")
        self.key = self.kc * self.span + (self.time - self.t_lo)
        self.build_positions = _build_positions(self.build)

    def rows_at(self, positions: np.ndarray) -> pl.DataFrame:
        """The history rows at ``positions`` (int64) of this order."""
        return self.whole[self.perm[positions]]

    def sorted_rows(self) -> pl.DataFrame:
        """Every row in this order (a copy of the whole history: for tests and inspection)."""
        return self.rows_at(np.arange(len(self.perm), dtype=np.int64))

    def merged(self, added: pl.DataFrame, whole: pl.DataFrame) -> _Sorted:
        """These rows with ``added`` merged in (``whole``: every row, ``added`` its last ones, for a re-sort): the
        added rows sorted alone and put in place by binary search, not a sort of everything again; one with the
        key and time of held ones goes among them by event id (:meth:`_place_ties`). Where that gives up, or the
        times leave the search key's range, every row is sorted again instead: the same order either way."""
        if added.height == 0:
            return self
        codes = added.select(self.keys).unique().join(self.codes, on=self.keys, how="anti")
        if codes.height:
            more = codes.with_row_index("_kc", offset=self.codes.height).with_columns(pl.col("_kc").cast(pl.Int64))
            codes = pl.concat([self.codes, more.select(self.codes.columns)])
        else:
            codes = self.codes
        new = (added.select(*self.keys, "event_time_ms", "event_id", "build", "created_ts_ms")
               .with_row_index("_r", offset=whole.height - added.height)
               .join(codes, on=self.keys, how="inner").sort("_kc", "event_time_ms", "event_id"))
        t = new.get_column("event_time_ms").to_numpy()
        lo, hi = min(self.t_lo, int(t.min())), max(self.t_hi, int(t.max()) + 1)
        span = hi - lo + 1
        if (int(codes.height) + 2) * span >= 2**62:
            return _Sorted(whole, self.keys)
        new_kc = new.get_column("_kc").to_numpy()
        held_key = self.kc * span + (self.time - lo)
        new_key = new_kc * span + (t - lo)
        at = np.searchsorted(held_key, new_key, side="left")
        end = np.searchsorted(held_key, new_key, side="right")
        ties = np.flatnonzero(end != at)
        if ties.size and not self._place_ties(at, end, ties, new.get_column("event_id")):
            return _Sorted(whole, self.keys)
        # New row m goes to position at[m] + m; the held rows fill the other positions in their order.
        total = len(self.perm) + new.height
        new_pos = at + np.arange(new.height)
        is_held = np.ones(total, dtype=bool)
        is_held[new_pos] = False
        out = _Sorted.__new__(_Sorted)
        out.keys, out.codes, out.whole = self.keys, codes, whole
        for name, fresh in (("perm", new.get_column("_r").cast(pl.Int64).to_numpy()), ("kc", new_kc), ("time", t),
                            ("build", new.get_column("build").to_numpy()),
                            ("created", new.get_column("created_ts_ms").to_numpy())):
            held = getattr(self, name)
            merged = np.empty(total, dtype=np.result_type(held.dtype, fresh.dtype))
            merged[is_held] = held
            merged[new_pos] = fresh
            setattr(out, name, merged)
        out._derive()
        return out

    def _place_ties(self, at: np.ndarray, end: np.ndarray, ties: np.ndarray, new_ids: pl.Series) -> bool:
        """Move each added row in ``ties`` (its key and time those of the held rows ``at`` .. ``end`` - 1) past the
        held rows whose event id sorts before its own, as a sort by (key, time, event id) places it (Python
        compares str by code point, which is UTF-8 byte order, polars' string order). False (nothing moved) for
        more than :data:`TIES_MAX` such rows or an event id already held: the caller sorts everything again."""
        if ties.size > TIES_MAX:
            return False
        held_ids = self.whole.get_column("event_id")
        moved = at.copy()
        for m in ties.tolist():
            group = held_ids.gather(self.perm[at[m]:end[m]]).to_list()
            mine = new_ids[m]
            if mine in group:
                return False
            moved[m] += sum(held < mine for held in group)
        at[:] = moved
        return True

    def own_build_before(self, k: np.ndarray, start: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """How many events of build ``k`` sit at positions ``start`` .. ``lo`` - 1 (within one key): two binary
        searches per row in the (build, position) keys."""
        base = k.astype(np.int64) * (len(self.build) + 1)
        count = (np.searchsorted(self.build_positions, base + lo, side="left")
                 - np.searchsorted(self.build_positions, base + start, side="left"))
        return np.where(lo > start, count, 0)

    def search(self, kc: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Position of the first event of key ``kc`` at or after time ``t`` (ms)."""
        return np.searchsorted(self.key, kc * self.span + (np.clip(t, self.t_lo, self.t_hi) - self.t_lo), side="left")


class SortedHistory(HistoryReader):
    """:func:`~sequences.materialize.sequence_index` of pointer rows from a lake's ``history`` held sorted,
    read by increments (module docstring).

    Args:
        lake: the lake (or its root) whose ``history`` the rows point into.
        storage_options: the lake's object-store options (with a root).

    Attributes:
        reference_rows: rows answered by the reference path so far.
        anchor_lookups: rows whose impression was looked up among their user's rows (not at their position).
    """

    def __init__(self, lake: Lake | str | Path, *, storage_options: StorageOptions | None = None) -> None:
        super().__init__(lake, storage_options)
        self.reference_rows = 0
        self.anchor_lookups = 0
        self.rows = pl.DataFrame(schema={c: (pl.Int64 if c in ("event_time_ms", "created_ts_ms", "build") else pl.String)
                                         for c in _HISTORY_COLUMNS})
        self._kinds: dict[bool, _Sorted] = {}

    def _whole(self, rows: pl.DataFrame) -> None:
        self.rows, self._kinds = rows, {}

    def _added(self, rows: pl.DataFrame) -> None:
        # Appended as a chunk (no copy of what is held); the chunks are joined again once there are
        # CHUNKS_MAX, so that gathers stay fast and the copies cost O(rows) per CHUNKS_MAX commits.
        self.rows = pl.concat([self.rows, rows], how="vertical_relaxed", rechunk=False)
        if self.rows.n_chunks() > CHUNKS_MAX:
            self.rows = self.rows.rechunk()
        # Each kind held sorted takes the added rows in place (a re-sort only where their order needs it).
        self._kinds = {same: kind.merged(rows, self.rows) for same, kind in self._kinds.items()}

    def _kind(self, same_domain: bool) -> _Sorted:
        if same_domain not in self._kinds:
            self._kinds[same_domain] = _Sorted(self.rows, ["user_id", "domain"] if same_domain else ["user_id"])
        return self._kinds[same_domain]

    def _anchor_builds(self, s: _Sorted, q: pl.DataFrame, kc: np.ndarray, t: np.ndarray, p: np.ndarray) -> np.ndarray:
        """(n,) int64: the ``build`` of each row's impression (its ``_anchor`` event of its user), -1 for one not in
        the history. The impression is an event of the row's key at the row's time: it is looked for among those
        (positions ``p`` on; a generated session's events share their millisecond), and a row whose impression is
        not there, or whose millisecond holds more than :data:`TIE_LIMIT` events, among its user's rows."""
        k = np.full(len(kc), -1, dtype=np.int64)
        if not len(s.build):
            return k
        p_end = s.search(kc, t + 1)
        ties = np.where(kc >= 0, p_end - p, 0)
        rows = np.flatnonzero((ties > 0) & (ties <= TIE_LIMIT))
        width = ties[rows]
        pos = _ranges(p[rows], width)
        owner = np.repeat(rows, width)
        same = (s.whole.get_column("event_id").gather(s.perm[pos]) == q.get_column("_anchor").gather(owner)).fill_null(False)
        match = same.to_numpy()
        k[owner[match]] = s.build[pos[match]]
        miss = np.flatnonzero((k < 0) & (kc >= 0))
        if miss.size:
            self.anchor_lookups += miss.size
            asked = q[miss].with_row_index("_m")
            users = asked.get_column("user_id").unique().implode()
            found = (asked.join(self.rows.filter(pl.col("user_id").is_in(users))
                                .select("user_id", pl.col("event_id").alias("_anchor"), pl.col("build").alias("_k")),
                                on=["user_id", "_anchor"], how="left").sort("_m"))
            k[miss] = found.get_column("_k").fill_null(-1).to_numpy()
        return k

    def sequence_index(self, pointer_rows: pa.Table, max_len: int, *, same_domain: bool = False,
                       check: bool = True, version: int | None = None) -> SequenceIndex:
        """:func:`sequences.materialize.sequence_index` of ``pointer_rows`` over the whole history (equal index
        lists, offsets and truncation counts; ``events`` holds only the events kept). ``version``: the history
        version read up to (newest when None).

        Raises:
            ValueError: as the reference: an impression missing from history, a stored length that differs.
        """
        self.advance(version)
        n = pointer_rows.num_rows
        if n == 0:
            return sequence_index(pointer_rows, self.rows.head(0).to_arrow(), max_len, same_domain=same_domain,
                                  check=check)
        s = self._kind(same_domain)
        anchor = pointer_rows.column("example_id")
        if "corrects_example_id" in pointer_rows.column_names:
            anchor = pc.coalesce(pointer_rows.column("corrects_example_id"), anchor)
        q = (pl.DataFrame({"user_id": pointer_rows.column("user_id"), "domain": pointer_rows.column("domain"),
                           "_anchor": anchor, "_t": pointer_rows.column("event_time_ms"),
                           "_c": pointer_rows.column("created_ts_ms")}).with_row_index("_i")
             .join(s.codes, on=s.keys, how="left").sort("_i"))
        kc = q.get_column("_kc").fill_null(-1).to_numpy()
        t, c = q.get_column("_t").to_numpy(), q.get_column("_c").to_numpy()
        start = s.search(kc, np.full(n, s.t_lo - 1))
        end = s.search(kc + 1, np.full(n, s.t_lo - 1))
        p = s.search(kc, t)
        lo = np.maximum(start, p - (max_len + WINDOW_SLACK))
        last = max(len(s.build) - 1, 0)
        k = self._anchor_builds(s, q, kc, t, p)
        known = k >= 0
        nothing_old_after = (p >= end) | (s.suffix_min[np.minimum(p, last)] >= k if len(s.build) else True)
        # Before the window only events of builds <= k (those of build k counted below, by build).
        nothing_new_before = (lo <= start) | (s.prefix_max[np.clip(lo - 1, 0, last)] <= k if len(s.build) else True)
        fast = known & nothing_old_after & nothing_new_before & (len(s.build) > 0)
        rows_fast = np.flatnonzero(fast)

        # Every fast row's window, flattened: row r's positions lo[r] .. p[r] - 1.
        width = (p - lo)[rows_fast]
        r = np.repeat(rows_fast, width)
        pos = _ranges(lo[rows_fast], width)
        b = s.build[pos]
        old = b < k[r]
        shown_by_time = s.created[pos] <= c[r]
        old_after = _after_in_row(old, width)  # old events between this one and the row's time
        visible = ((old & (old_after < max_len)) | (b == k[r])) & shown_by_time
        kept = visible & (_after_in_row(visible, width) < max_len)
        # r holds row numbers: counting by row number, then taking the fast rows', needs no search.
        old_in_window = np.bincount(r[old], minlength=n)[rows_fast]
        shown_in_window = np.bincount(r[visible], minlength=n)[rows_fast]
        own_before = s.own_build_before(k[rows_fast], start[rows_fast], lo[rows_fast])
        before = (lo - start)[rows_fast]
        old_before = before - own_before
        # Exact when the window starts at the key's first event, or when it shows N (nothing before it is kept)
        # and everything before it was appended at or before the row: then those of the row's own build are all
        # shown, and of the earlier builds' the newest N - (old in the window) are.
        made_before = s.prefix_created[np.clip(lo[rows_fast] - 1, 0, last)]
        enough = (before <= 0) | ((shown_in_window >= max_len) & (made_before <= c[rows_fast]))
        fast[rows_fast[~enough]] = False

        lengths = np.zeros(n, np.int64)
        truncated = np.zeros(n, np.int64)
        in_fast = fast[r]
        kept &= in_fast
        lengths[rows_fast] = np.bincount(r[kept], minlength=n)[rows_fast]
        shown = shown_in_window + own_before + np.minimum(old_before, np.maximum(max_len - old_in_window, 0))
        n_old = old_before + old_in_window
        truncated[rows_fast] = np.maximum(n_old - max_len, 0) + shown - lengths[rows_fast]
        slow = np.flatnonzero(~fast)
        reference = None
        if slow.size:
            self.reference_rows += slow.size
            subset = pointer_rows.take(pa.array(slow))
            users = pl.Series("user_id", subset.column("user_id")).unique()
            history = self.rows.filter(pl.col("user_id").is_in(users.implode())).to_arrow()
            reference = sequence_index(subset, history, max_len, same_domain=same_domain, check=False)
            lengths[slow] = np.diff(reference.offsets)
            truncated[slow] = reference.truncated

        # One events table: the fast rows' kept events, then the reference's candidates.
        kept_pos = pos[kept]
        # np.unique's sort of every kept position, done with a mark per held row instead.
        marked = np.zeros(len(s.build), dtype=bool)
        marked[kept_pos] = True
        unique_pos = np.flatnonzero(marked)
        inverse = (np.cumsum(marked) - 1)[kept_pos]
        events = s.rows_at(unique_pos).select(_HISTORY_COLUMNS).to_arrow()
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        index = np.empty(int(offsets[-1]), np.int64)
        # Kept positions come row by row, oldest first: row i's fill offsets[i] .. offsets[i + 1] in that order.
        index[_ranges(offsets[rows_fast[fast[rows_fast]]], lengths[rows_fast[fast[rows_fast]]])] = inverse
        if reference is not None:
            index[_ranges(offsets[slow], lengths[slow])] = reference.index + events.num_rows
            events = pa.concat_tables([events, reference.events.select(_HISTORY_COLUMNS).cast(events.schema)])
        if check:
            check_stored_lengths(pointer_rows, "seq_same_domain_" if same_domain else "seq_", lengths, truncated)
        return SequenceIndex(events, index, offsets, truncated, t.astype(np.int64))


def _build_positions(build: np.ndarray) -> np.ndarray:
    """(n,) int64 sorted: ``build * (n + 1) + position`` of each of ``n`` events, so the events of build k before
    position x are counted by two binary searches. A stable sort by build (radix for builds under 2**16) gives
    that order without sorting the encoded values."""
    n = len(build)
    small = n and 0 <= int(build.min()) and int(build.max()) < 2**16
    order = np.argsort(build.astype(np.uint16) if small else build, kind="stable")
    encoded = build[order].astype(np.int64, copy=False) * (n + 1)
    encoded += order
    return encoded


def _within_keys(kc: np.ndarray, values: np.ndarray, op: np.ufunc, *, reverse: bool = False) -> np.ndarray:
    """The running maximum of ``values`` (int64) within each key's run from its start, or with ``reverse`` the running
    minimum from its end, for rows sorted by key code ``kc`` (non-negative, ascending). Each value is lifted by its
    key code times the value range, so one accumulation over all rows never carries a value into another key: the
    keys met before a key's run (lower codes going forward, higher going back) lie wholly below its values for the
    maximum, wholly above them for the minimum.

    Raises:
        ValueError: ``op`` other than np.maximum forward or np.minimum with ``reverse``.
        OverflowError: key count x value range beyond int64.
    """
    if (op, reverse) not in ((np.maximum, False), (np.minimum, True)):
        raise ValueError("_within_keys: the running maximum forward or the running minimum in reverse")
    if not values.size:
        return values.copy()
    low, span = int(values.min()), int(values.max()) - int(values.min()) + 1
    if (int(kc.max()) + 1) * span >= 2**62:
        raise OverflowError("sorted history: key count x value range does not fit a 64-bit running key")
    lift = np.multiply(kc, span, dtype=np.int64)
    out = values.astype(np.int64)  # a copy: lifted, accumulated and lowered again in place
    out -= low
    out += lift
    if reverse:
        op.accumulate(out[::-1], out=out[::-1])
    else:
        op.accumulate(out, out=out)
    out -= lift
    out += low
    return out


def _after_in_row(flags: np.ndarray, width: np.ndarray) -> np.ndarray:
    """For flattened rows of ``width`` elements: how many flagged elements come after each one in its row."""
    total = np.cumsum(flags.astype(np.int64))
    row_end = np.repeat(np.cumsum(width), width) - 1
    return total[row_end] - total if flags.size else np.zeros(0, np.int64)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenated ranges ``starts[i] .. starts[i] + lengths[i] - 1``."""
    if not lengths.size:
        return np.zeros(0, np.int64)
    first = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.repeat(starts - first, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)
