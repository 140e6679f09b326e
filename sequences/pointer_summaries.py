"""Sequence summaries of pointer rows for a long-running reader, from running counts instead of sequences.

:func:`sequences.materialize.sequence_summary` answers a batch of pointer rows with a sorted join of every
``history`` row of their users: a batch's users are nearly all users, so its cost grows with the whole
history (O(H log H)), not with the batch. A validator following a build (``validate --follow``) reads a
version's summaries every few seconds; in ``defer`` mode its label corrections point into the first builds
for as long as their windows are open, so the compacted history (:mod:`sequences.history_tail`) cannot drop
anything either. :class:`PointerSummaries` answers the same summaries at a cost that follows the batch:

- **A row of a recent build** (its impression appended by a build k after the ``horizon``): its candidates
  are the newest N = ``max_len`` of its key's events appended before k plus the events of build k
  (:mod:`sequences.materialize`). Per key (user, or (user, domain)) the reader keeps the count, newest
  event time and latest append time of the events of builds <= ``horizon`` (folded), and every event of a
  later build (recent). When every earlier event of the key is strictly older than the row and appended
  at or before it (the usual case: an impression is newer than what its user did before), all of the newest
  N are visible, so the summary follows from those counts and the row's build-k events alone:
  ``visible = min(n_old, N) + v_k``, ``length = min(visible, N)``, ``truncated = max(0, n_old - N) +
  visible - length``, ``newest_ms`` = the newest visible event time.
- **A correction** (``corrects_example_id``) is cut at its original impression with the same event time,
  append time and domain (``sequences.publish.published_rows`` copies them), so its summary is the
  original's: the reader keeps the summaries it gave each impression (by event id, event time and append
  time) and answers a correction from them.
- **Anything else** (an impression at or before the horizon, a late event older than the row, an earlier
  event appended after it, a correction of an impression this reader never summarized, say after a
  restart) goes to the reference: the whole history of those rows' users
  (:func:`sequences.materialize.read_history`) and :func:`~sequences.materialize.sequence_summary`.

Exactness: ``lengths``, ``truncated``, ``newest_ms`` and ``unordered`` equal the reference's; ``newest_created_ms``
is the latest append time of the key's earlier events and of the row's visible build-k events, an upper
bound of the reference's (as :class:`~sequences.materialize.SequenceSummary` allows) that never exceeds
the row's own append time on this path, so the leakage check reaches the same verdict
(tests/sequences/test_pointer_summaries.py, a twin on random histories with late events, backfills and
corrections).

Cost per batch: O((n + R) log(n + R)) for n rows and R recent events (bounded by folding: the folded part
is one row per key), whatever a key's share of them, plus the rows sent to the reference. Memory: one row per key, the recent events,
and one cached summary per impression (at most ``max_cached``, the oldest by event time dropped first).
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
from sequences.materialize import SequenceSummary, read_history, sequence_summary

log = logging.getLogger(__name__)

_RECENT_COLUMNS = ["user_id", "event_id", "event_time_ms", "created_ts_ms", "domain", "build"]
_LOWEST = np.iinfo(np.int64).min
_FIELDS = ("lengths", "truncated", "newest_ms", "newest_created_ms", "unordered")
_KINDS = (("cross", ["user_id"]), ("same", ["user_id", "domain"]))


def _folded_schema(keys: list[str]) -> dict[str, pl.DataType]:
    return {**dict.fromkeys(keys, pl.String()), "_nf": pl.Int64(), "_tf": pl.Int64(), "_cf": pl.Int64()}


def _fold(folded: pl.DataFrame, rows: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    """Per key: events counted, newest event time, latest append time of ``folded`` and ``rows`` together."""
    more = rows.group_by(keys).agg(pl.len().cast(pl.Int64).alias("_nf"), pl.col("event_time_ms").max().alias("_tf"),
                                   pl.col("created_ts_ms").max().alias("_cf"))
    return (pl.concat([folded, more.select(folded.columns)]).group_by(keys)
            .agg(pl.col("_nf").sum(), pl.col("_tf").max(), pl.col("_cf").max()))


def _append(frame: pl.DataFrame, more: pl.DataFrame) -> pl.DataFrame:
    """``frame`` then ``more``, rechunked once the appends pile up (joins slow down over many chunks)."""
    out = pl.concat([frame, more.select(frame.columns)], how="vertical_relaxed")
    return out.rechunk() if out.n_chunks() > 32 else out


class PointerSummaries(HistoryReader):
    """Cross-domain and same-domain :class:`~sequences.materialize.SequenceSummary` of pointer-layout rows,
    kept up to date with a lake's ``history`` by reading only what each commit added (module docstring).

    Args:
        lake: the lake (or its root) whose ``history`` the rows point into.
        max_seq_len, same_domain_seq_len: the build's sequence lengths (its commit metadata).
        storage_options: the lake's object-store options (with a root).
        margin_builds: builds before the oldest one a batch's rows pointed into that stay unfolded, so a later
            batch pointing a little further back is still answered here (an impression is published a waiting
            window after the build that appended it, one or two builds back; a row further back goes to the
            reference, exactly, at its users' whole-history cost).
        min_fold_rows: no folding while fewer recent events than this could be folded.
        max_cached: impressions whose summaries are kept for their corrections.

    Attributes:
        reference_rows: rows answered by the reference path so far (a count, for tests and benchmarks).
    """

    def __init__(self, lake: Lake | str | Path, max_seq_len: int, same_domain_seq_len: int, *,
                 storage_options: StorageOptions | None = None, margin_builds: int = 2,
                 min_fold_rows: int = 100_000, max_cached: int = 5_000_000) -> None:
        super().__init__(lake, storage_options)
        self.max_len = {"cross": max_seq_len, "same": same_domain_seq_len}
        self.margin_builds, self.min_fold_rows, self.max_cached = margin_builds, min_fold_rows, max_cached
        self.reference_rows = 0
        self._reset()

    def _reset(self) -> None:
        self.horizon = -1
        self.folded = {kind: pl.DataFrame(schema=_folded_schema(keys)) for kind, keys in _KINDS}
        self.recent = pl.DataFrame(schema={"user_id": pl.String, "event_id": pl.String, "event_time_ms": pl.Int64,
                                           "created_ts_ms": pl.Int64, "domain": pl.String, "build": pl.Int64})
        self.cached = pl.DataFrame(schema={"_anchor": pl.String, "_t": pl.Int64, "_c": pl.Int64,
                                           **{f"{kind}_{f}": pl.Int64 for kind, _ in _KINDS for f in _FIELDS}})

    COLUMNS = _RECENT_COLUMNS

    def _whole(self, rows: pl.DataFrame) -> None:
        self._reset()
        self.recent = rows

    def _added(self, rows: pl.DataFrame) -> None:
        self.recent = _append(self.recent, rows)

    def summarize(self, pointer_rows: pa.Table, version: int | None = None) -> tuple[SequenceSummary, SequenceSummary]:
        """(cross-domain, same-domain) summaries of ``pointer_rows``, equal to
        :func:`~sequences.materialize.sequence_summary` over the whole history (``newest_created_ms``: see the
        module docstring). ``version``: the ``history`` version read up to (newest when None).

        Raises:
            ValueError: an impression is not in ``history`` (the reference's error).
        """
        self.advance(version)
        n = pointer_rows.num_rows
        out = {kind: {f: np.full(n, _LOWEST if f.startswith("newest") else 0, np.int64) for f in _FIELDS}
               for kind, _ in _KINDS}
        if n == 0:
            return self._summaries(out, n)
        anchor = pointer_rows.column("example_id")
        first = np.ones(n, dtype=bool)
        if "corrects_example_id" in pointer_rows.column_names:
            anchor = pc.coalesce(pointer_rows.column("corrects_example_id"), anchor)
            first = pc.is_null(pointer_rows.column("corrects_example_id")).to_numpy(zero_copy_only=False)
        queries = pl.DataFrame({"user_id": pointer_rows.column("user_id"), "_anchor": anchor,
                                "domain": pointer_rows.column("domain"), "_t": pointer_rows.column("event_time_ms"),
                                "_c": pointer_rows.column("created_ts_ms")}).with_row_index("_i")
        done = np.zeros(n, dtype=bool)
        hits = queries.join(self.cached, on=["_anchor", "_t", "_c"], how="inner")
        if hits.height:
            i = hits.get_column("_i").to_numpy()
            for kind, _ in _KINDS:
                for f in _FIELDS:
                    out[kind][f][i] = hits.get_column(f"{kind}_{f}").to_numpy()
            done[i] = True
        builds = self.recent.select("user_id", pl.col("event_id").alias("_anchor"), pl.col("build").alias("_k"))
        todo = queries.filter(pl.Series(~done)).join(builds, on=["user_id", "_anchor"], how="inner")
        fast = np.zeros(n, dtype=bool)
        if todo.height:
            fast[todo.get_column("_i").to_numpy()] = True
            for kind, keys in _KINDS:
                i, values, ok = self._fast(todo, keys, self.max_len[kind], kind)
                fast[i[~ok]] = False
                for f in _FIELDS:
                    out[kind][f][i[ok]] = values[f][ok]
        slow = np.flatnonzero(~done & ~fast)
        if slow.size:
            self._reference(pointer_rows.take(pa.array(slow)), slow, out, version)
        fresh = np.flatnonzero(~done)
        self._remember(queries, fresh, out)
        # The fold follows first publications: a correction of an old impression is answered from the cache.
        i = todo.get_column("_i").to_numpy()
        first_builds = todo.filter(pl.Series(fast[i] & first[i])).get_column("_k")
        if first_builds.len():
            self._maybe_fold(int(first_builds.min()) - 1 - self.margin_builds)  # type: ignore[arg-type]
        return self._summaries(out, n)

    def _fast(self, todo: pl.DataFrame, keys: list[str], max_len: int, kind: str
              ) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
        """(row numbers, summary fields, answered here) of the ``todo`` queries (module docstring's first case).

        Sorted searches, never a join of rows with their key's events (a generated user can have 75k events
        and a thousand rows in one version): per key and build, the counts, newest time and latest append of
        the recent events, cumulated over builds, searched for the last build before each row's; and each
        row's build-k events sorted by time, searched for the row's time, with their running latest append."""
        q = todo.select("_i", *keys, "_k", "_t", "_c").join(self.folded[kind], on=keys, how="left")
        recent = self.recent.select(*keys, "build", "event_time_ms", "created_ts_ms")
        codes = pl.concat([q.select(keys), recent.select(keys)]).unique().with_row_index("_kc")
        q = q.join(codes, on=keys, how="left")
        recent = recent.join(codes, on=keys, how="left").select("_kc", "build", "event_time_ms", "created_ts_ms")
        kc = q.get_column("_kc").to_numpy().astype(np.int64)
        k = q.get_column("_k").to_numpy()
        t, c = q.get_column("_t").to_numpy(), q.get_column("_c").to_numpy()

        # Recent events of builds < k: per (key, build) aggregates cumulated over the key's builds.
        per_build = (recent.group_by("_kc", "build").agg(pl.len().cast(pl.Int64).alias("n"),
                                                           pl.col("event_time_ms").max().alias("t"),
                                                           pl.col("created_ts_ms").max().alias("c"))
                     .sort("_kc", "build")
                     .with_columns(pl.col("n").cum_sum().over("_kc"), pl.col("t").cum_max().over("_kc"),
                                   pl.col("c").cum_max().over("_kc")))
        pb_kc = per_build.get_column("_kc").to_numpy().astype(np.int64)
        pb_key = (pb_kc << 32) | per_build.get_column("build").to_numpy()
        at = np.searchsorted(pb_key, (kc << 32) | k, side="left") - 1
        has = (at >= 0) & (pb_kc[np.maximum(at, 0)] == kc)
        at = np.maximum(at, 0)
        n_recent = np.where(has, per_build.get_column("n").to_numpy()[at] if per_build.height else 0, 0)
        t_recent = np.where(has, per_build.get_column("t").to_numpy()[at] if per_build.height else _LOWEST, _LOWEST)
        c_recent = np.where(has, per_build.get_column("c").to_numpy()[at] if per_build.height else _LOWEST, _LOWEST)

        # The row's own build's events before its time (a time search), appended at or before it.
        pairs = q.select("_kc", pl.col("_k").alias("build")).unique().with_row_index("_pc")
        own = (recent.join(pairs, on=["_kc", "build"], how="inner").sort("_pc", "event_time_ms")
               .with_columns(pl.col("created_ts_ms").cum_max().over("_pc").alias("_run")))
        pc_q = q.join(pairs, left_on=["_kc", "_k"], right_on=["_kc", "build"], how="left").get_column("_pc").to_numpy()
        times = own.get_column("event_time_ms").to_numpy()
        t0 = min(int(times.min()) if times.size else 0, int(t.min()))
        own_key = (own.get_column("_pc").to_numpy().astype(np.int64) << 41) | (times - t0)
        pc_q = pc_q.astype(np.int64)
        first = np.searchsorted(own_key, pc_q << 41, side="left")
        end = np.searchsorted(own_key, (pc_q << 41) | (t - t0), side="left")
        v = end - first
        last = np.maximum(end - 1, 0)
        run = own.get_column("_run").to_numpy()
        t_k = np.where(v > 0, times[last] if times.size else _LOWEST, _LOWEST)
        c_k = np.where(v > 0, run[last] if run.size else _LOWEST, _LOWEST)

        n_old = q.get_column("_nf").fill_null(0).to_numpy() + n_recent
        t_all = np.maximum(q.get_column("_tf").fill_null(_LOWEST).to_numpy(), t_recent)
        c_all = np.maximum(q.get_column("_cf").fill_null(_LOWEST).to_numpy(), c_recent)
        # Answered here when every earlier event is older than the row and appended at or before it, and so are
        # the row's own build's events before it (else some of those are invisible: the reference sorts it out).
        ok = ((n_old == 0) | ((t_all < t) & (c_all <= c))) & ((v == 0) | (c_k <= c))
        visible = np.minimum(n_old, max_len) + v
        lengths = np.minimum(visible, max_len)
        newest = np.maximum(np.where(n_old > 0, t_all, _LOWEST), t_k)
        newest_created = np.maximum(np.where(n_old > 0, c_all, _LOWEST), c_k)
        # Kept events are cut in event order, so they are time-ascending by construction.
        values = {"lengths": lengths, "truncated": np.maximum(n_old - max_len, 0) + visible - lengths,
                  "newest_ms": np.where(lengths > 0, newest, _LOWEST),
                  "newest_created_ms": np.where(lengths > 0, newest_created, _LOWEST),
                  "unordered": np.zeros(len(lengths), np.int64)}
        return q.get_column("_i").to_numpy(), values, ok

    def _reference(self, rows: pa.Table, where: np.ndarray, out: dict[str, dict[str, np.ndarray]],
                   version: int | None) -> None:
        """The reference path for ``rows`` (at positions ``where`` of the batch); raises as it does."""
        self.reference_rows += rows.num_rows
        history = read_history(self.lake, rows.column("user_id"), version=version,
                               storage_options=self.storage_options)
        for kind, _ in _KINDS:
            summary = sequence_summary(rows, history, self.max_len[kind], same_domain=kind == "same")
            for f in _FIELDS:
                out[kind][f][where] = np.asarray(getattr(summary, f), dtype=np.int64)

    def _remember(self, queries: pl.DataFrame, where: np.ndarray, out: dict[str, dict[str, np.ndarray]]) -> None:
        """Keep the summaries just computed by their impression, for the corrections that will point to it."""
        if not where.size:
            return
        rows = queries[where].select("_anchor", "_t", "_c").with_columns(
            pl.Series(f"{kind}_{f}", out[kind][f][where]) for kind, _ in _KINDS for f in _FIELDS)
        # Rows not answered from the cache are not in it; only a batch's own repeats (an impression and its
        # correction in one version) need dropping.
        cached = _append(self.cached, rows.unique(["_anchor", "_t", "_c"], keep="first", maintain_order=True))
        if cached.height > self.max_cached:
            cached = cached.sort("_t").tail(self.max_cached * 9 // 10)
        self.cached = cached

    def _maybe_fold(self, horizon: int) -> None:
        """Fold the recent events of builds <= ``horizon`` into the per-key counts once enough are there."""
        if horizon <= self.horizon:
            return
        older = self.recent.filter(pl.col("build") <= horizon)
        if older.height < self.min_fold_rows:
            return
        for kind, keys in _KINDS:
            self.folded[kind] = _fold(self.folded[kind], older, keys)
        self.recent = self.recent.filter(pl.col("build") > horizon)
        self.horizon = horizon

    def _summaries(self, out: dict[str, dict[str, np.ndarray]], n: int) -> tuple[SequenceSummary, SequenceSummary]:
        cross, same = (SequenceSummary(out[kind]["lengths"], out[kind]["truncated"], out[kind]["newest_ms"],
                                       out[kind]["newest_created_ms"], out[kind]["unordered"] > 0) for kind, _ in _KINDS)
        return cross, same
