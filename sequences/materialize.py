"""Pointer-layout examples: each user's history stored once, sequences rebuilt when read.

With ``build.examples_layout = "pointer"`` the build appends every event it sees for the first time
to the ``history`` table (:data:`sequences.schema.HISTORY_SCHEMA`, one row per (user, event), with
``build``, the number of the build that appended it), and the ``examples`` rows keep every column
but the list columns (:data:`sequences.schema.LIST_COLUMNS`). :func:`materialize_examples` gives
back the fat rows, equal to what the fat build writes.

The pointer. An example's own impression is an event of the history, appended by the build ``k``
that first saw it, and that build cut the example's sequences from (:mod:`sequences.incremental`):

- cross-domain: the stored sequence as of build k - 1, i.e. the newest N = ``max_seq_len`` of the
  user's events appended by builds < k (newest by (event_time_ms, event_id); newest-N of a union
  is newest-N of the newest-N of its parts, so the stored sequence of k - 1 is exactly that), plus
  the user's events appended by build k; of those, the events with event time strictly before the
  impression and append time (``created_ts_ms``) at or before the impression's, newest N kept,
  time-ascending. ``seq_truncated`` = max(0, |builds < k| - N) (what the stored sequence had cut)
  + the candidates visible to the impression - the length kept.
- same-domain: the same over the user's events of the impression's domain, with
  ``build.same_domain_seq_len``.

So the pointer is (user_id, example_id -> its history row's ``build``); a correction row points
through ``corrects_example_id``. Nothing else is stored: a backfilled event (old event time,
appended late) has a ``created_ts_ms`` after the example's and never enters it; a late impression
(older than N events the state already held) gets the same shorter history the fat build gave it.

Assumes, as the fat build does, that ``max_seq_len`` and ``same_domain_seq_len`` do not change over
the life of the lake and that an event id reaches the history once (the build deduplicates
redeliveries against its state: :mod:`sequences.incremental`).

Batch-time use: the candidates of a (user, build) pair are computed once however many examples of
the batch point into them, and each example's lists are index ranges into them (RecD's inverse
indices, Zhao et al., MLSys 2023, arXiv 2211.05239, section 4).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from features.vectorized import EVENT_ORDER, grouped
from gemline.errors import BadConfigError, MissingInputError
from gemline.lake import Lake, StorageOptions, commit_metadata, open_table
from gemline.tables import Table
from sequences.config import BuildConfig
from sequences.schema import HISTORY_BUCKETS, HISTORY_SCHEMA, LIST_COLUMNS

_HISTORY_COLUMNS = ["user_id", "event_id", "event_time_ms", "created_ts_ms", "item_id", "category", "event_type",
                    "domain", "build"]


def history_bucket(user_ids: pa.Array | pa.ChunkedArray | list[str]) -> np.ndarray:
    """(n,) int32 bucket in ``[0, HISTORY_BUCKETS)`` of each user: crc32 of its UTF-8 id.

    crc32 (zlib) rather than a library hash: the bucket is stored in the ``history`` table's
    partition column, so it must not change with a library version.
    """
    values = pa.array(user_ids, pa.string()) if isinstance(user_ids, list) else user_ids
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    encoded = values.dictionary_encode()
    per_id = np.fromiter((zlib.crc32(s.encode()) % HISTORY_BUCKETS for s in encoded.dictionary.to_pylist()),
                         dtype=np.int32, count=len(encoded.dictionary))
    return per_id[encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)]


def history_rows(fresh: pa.Table, build: int) -> pa.Table:
    """``history`` rows (:data:`HISTORY_SCHEMA`) of events first seen by build number ``build``."""
    with_build = fresh.append_column("build", pa.array(np.full(fresh.num_rows, build, dtype=np.int64)))
    bucket = pa.array(history_bucket(fresh.column("user_id")), pa.int32())
    return with_build.append_column("user_bucket", bucket).select(HISTORY_SCHEMA.names).cast(HISTORY_SCHEMA)


def to_pointers(examples: pa.Table) -> pa.Table:
    """Fat examples rows without their list columns (the pointer layout)."""
    return examples.drop_columns([c for c in LIST_COLUMNS if c in examples.column_names])


@dataclass(frozen=True)
class HistoryCut:
    """The events a compacted history left out (:mod:`sequences.history_tail`), counted per key.

    Compacting at ``horizon`` keeps, of the events appended by builds <= ``horizon``, each user's newest
    ``max_seq_len`` and each (user, domain)'s newest ``same_domain_seq_len`` (by (event_time_ms, event_id));
    every later event stays. For an example of build k > ``horizon`` all the events left out were appended
    before k and are older than the ``max_len`` kept of its key, so they only count in its truncation
    (newest-N of a union is newest-N of the newest-N of its parts): the compacted rows plus these counts
    rebuild it exactly. Examples of builds <= ``horizon`` need the whole history.

    Attributes:
        horizon: the newest build whose events were compacted (-1: nothing was).
        users: ``user_id`` (str), ``cut`` (int64): the user's events left out (users without any absent).
        domains: ``user_id``, ``domain`` (str), ``cut`` (int64): the same per (user, domain).
    """

    horizon: int
    users: pl.DataFrame
    domains: pl.DataFrame


HEAVY_KEY_ROWS = 2048
"""A key (user, or (user, domain)) with more ``history`` rows than this has its candidates cut per (key, build)
pair with numpy on its rows sorted once (:func:`_heavy_candidates`) rather than through the join of the pairs
with its rows, which copies all of them once per pair: one generated user of 75k events with a dozen pairs
(label corrections of old impressions) made that join 1.5M rows for a 37k-row examples version."""


def _candidates_joined(history: pl.DataFrame, pairs: pl.DataFrame, keys: list[str], max_len: int
                       ) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(candidates, older): :func:`_candidates` through one join of ``pairs`` with ``history`` (the reference:
    every row of a key is copied once per pair); ``older`` holds each pair's ``_n``, its rows appended before _k."""
    rows = (pairs.join(history, on=keys, how="inner").filter(pl.col("build") <= pl.col("_k"))
            .sort([*keys, "_k", *EVENT_ORDER]))
    old = (pl.col("build") < pl.col("_k")).cast(pl.Int64)
    rows = rows.with_columns(old.alias("_old"), old.cum_sum(reverse=True).over([*keys, "_k"]).alias("_newer"))
    older = rows.group_by([*keys, "_k"]).agg(pl.col("_old").sum().alias("_n"))
    kept = rows.filter((pl.col("_old") == 0) | (pl.col("_newer") <= max_len))
    return kept.drop("_old", "_newer"), older


def _heavy_candidates(history: pl.DataFrame, pairs: pl.DataFrame, keys: list[str], max_len: int
                      ) -> tuple[pl.DataFrame, pl.DataFrame]:
    """:func:`_candidates_joined` for keys with many rows: each key's rows sorted once by event order, then per
    (key, build _k) pair a numpy mask over them (its rows of _k, and the newest ``max_len`` before _k), so a
    pair costs a scan of its key's build numbers and copies only the rows it keeps."""
    rows = history.join(pairs.select(keys).unique(), on=keys, how="semi").sort([*keys, *EVENT_ORDER])
    segments = (rows.with_row_index("_i").group_by(keys, maintain_order=True)
                .agg(pl.col("_i").first().alias("_s"), (pl.col("_i").last() + 1).alias("_e")))
    todo = pairs.join(segments, on=keys, how="inner")
    builds = rows.get_column("build").to_numpy()
    taken: list[np.ndarray] = []
    counts, olds = np.zeros(todo.height, np.int64), np.zeros(todo.height, np.int64)
    for j, (start, end, k) in enumerate(zip(todo.get_column("_s").to_list(), todo.get_column("_e").to_list(),
                                            todo.get_column("_k").to_list(), strict=True)):
        b = builds[start:end]
        old = b < k
        newer = np.cumsum(old[::-1])[::-1]  # old rows at or after each row: the newest max_len have <= max_len
        keep = np.flatnonzero((b == k) | (old & (newer <= max_len)))
        taken.append(start + keep)
        counts[j], olds[j] = keep.size, int(newer[0]) if b.size else 0
    index = np.concatenate(taken) if taken else np.zeros(0, np.int64)
    kept = rows[index].with_columns(pl.Series("_k", np.repeat(todo.get_column("_k").to_numpy(), counts)))
    older = todo.select(*keys, "_k").with_columns(pl.Series("_n", olds))
    return kept.select(*keys, "_k", *[c for c in rows.columns if c not in keys]), older


def _candidates(history: pl.DataFrame, pairs: pl.DataFrame, keys: list[str], max_len: int,
                cut: HistoryCut | None = None, heavy_rows: int | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(candidates, prior): per pair of ``keys`` + ``_k`` (a build), the events its examples were cut
    from: the newest ``max_len`` appended before build _k plus those appended by _k; ``prior`` holds
    the pair's ``_prior`` (events the stored sequence had cut: those before _k beyond the newest
    ``max_len``, plus, for a compacted ``history``, the ones ``cut`` counts). Keys with more than
    ``heavy_rows`` (None: :data:`HEAVY_KEY_ROWS`) rows go through :func:`_heavy_candidates`, the others
    through the join (its twin, :func:`_candidates_joined`); candidates come in no particular order."""
    heavy_rows = HEAVY_KEY_ROWS if heavy_rows is None else heavy_rows
    sizes = history.join(pairs.select(keys).unique(), on=keys, how="semi").group_by(keys).len()
    heavy = sizes.filter(pl.col("len") > heavy_rows).select(keys)
    light_pairs, heavy_pairs = pairs.join(heavy, on=keys, how="anti"), pairs.join(heavy, on=keys, how="semi")
    kept, older = _candidates_joined(history.join(heavy, on=keys, how="anti"), light_pairs, keys, max_len)
    if heavy_pairs.height:
        more_kept, more_older = _heavy_candidates(history.join(heavy, on=keys, how="semi"), heavy_pairs, keys, max_len)
        kept = pl.concat([kept, more_kept.select(kept.columns)], how="vertical_relaxed")
        older = pl.concat([older, more_older.select(older.columns)], how="vertical_relaxed")
    if cut is not None:
        left_out = cut.domains if len(keys) == 2 else cut.users
        older = (older.join(left_out, on=keys, how="left")
                 .with_columns(pl.col("_n") + pl.col("cut").fill_null(0)).drop("cut"))
    prior = older.select(*keys, "_k", (pl.col("_n") - max_len).clip(lower_bound=0).alias("_prior"))
    return kept, prior


@dataclass(frozen=True)
class SequenceIndex:
    """One sequence (cross-domain or same-domain) of n examples as an index into candidate events.

    Attributes:
        events: the candidate events (columns of :data:`sequences.schema.HISTORY_SCHEMA`), each
            (user, build[, domain]) pair's once however many examples point into it.
        index: (T,) int64 rows of ``events``; example i's sequence, time-ascending, is
            ``events.take(index[offsets[i]:offsets[i + 1]])``.
        offsets: (n + 1,) int64, ``offsets[i + 1] - offsets[i]`` = its length.
        truncated: (n,) int64, its ``*_truncated`` count.
        query_ms: (n,) int64 the examples' event times (for the time deltas).
    """

    events: pa.Table
    index: np.ndarray
    offsets: np.ndarray
    truncated: np.ndarray
    query_ms: np.ndarray

    def lists(self, column: str, value_type: pa.DataType) -> pa.ListArray:
        """The list<value_type> column of ``events[column]`` per example (null category -> '')."""
        values = self.events.column(column)
        if column == "category":
            values = pc.fill_null(values, "")
        taken = values.combine_chunks().cast(value_type).take(pa.array(self.index, pa.int64()))
        return pa.ListArray.from_arrays(pa.array(self.offsets, pa.int32()), taken, type=pa.list_(value_type))

    def time_deltas(self) -> pa.ListArray:
        """list<int64>: the example's time minus each element's (ms, > 0)."""
        times = self.events.column("event_time_ms").to_numpy()
        lengths = np.diff(self.offsets)
        deltas = np.repeat(self.query_ms, lengths) - times[self.index]
        return pa.ListArray.from_arrays(pa.array(self.offsets, pa.int32()), pa.array(deltas, pa.int64()),
                                        type=pa.list_(pa.int64()))


@dataclass(frozen=True)
class _Bounds:
    """Where each query's sequence lies in the candidates sorted by (group, event order): a query
    whose whole prefix was appended before it ("fast", the usual case) takes the contiguous rows
    ``[start, end)``; the others (``slow``: query row -> kept candidate rows) a mask."""

    cands: pl.DataFrame
    first: np.ndarray
    start: np.ndarray
    end: np.ndarray
    fast: np.ndarray
    slow: dict[int, np.ndarray]
    lengths: np.ndarray
    visible: np.ndarray


def _bounds(cands: pl.DataFrame, queries: pl.DataFrame, keys: list[str], max_len: int) -> _Bounds:
    """Per query row, the newest ``max_len`` of its pair's candidates with time < the query's and
    append time <= the query's, as bounds (one ``searchsorted`` per query, no gathered lists)."""
    cands, groups, q_codes, q_times = grouped(cands, queries, [*keys, "_k"])
    created = cands.get_column("created_ts_ms").to_numpy()
    q_created = queries.get_column("created_ts_ms").to_numpy()
    end = groups.before(q_codes, q_times)
    first = groups.start(q_codes)
    # Running max of append times per group: a query whose whole prefix was appended before it
    # (the usual case) takes a contiguous range, the others a mask.
    codes = cands.get_column("_g").to_numpy()
    running = (pl.DataFrame({"g": codes, "c": created}).select(pl.col("c").cum_max().over("g"))
               .get_column("c").to_numpy()) if created.size else np.zeros(1, dtype=np.int64)
    worst = np.where(end > first, running[np.maximum(end - 1, 0)], np.iinfo(np.int64).min)
    fast = worst <= q_created
    start = np.maximum(first, end - max_len)
    lengths = np.where(fast, end - start, 0).astype(np.int64)
    visible = np.where(fast, end - first, 0).astype(np.int64)
    slow: dict[int, np.ndarray] = {}
    for i in np.flatnonzero(~fast):
        hits = first[i] + np.flatnonzero(created[first[i]:end[i]] <= q_created[i])
        slow[int(i)] = hits[-max_len:]
        visible[i] = hits.size
        lengths[i] = slow[int(i)].size
    return _Bounds(cands, first, start, end, fast, slow, lengths, visible)


def _index(cands: pl.DataFrame, queries: pl.DataFrame, keys: list[str], max_len: int
           ) -> tuple[pl.DataFrame, np.ndarray, np.ndarray, np.ndarray]:
    """(candidates sorted by group, index, offsets, visible): :func:`_bounds` as one flat index."""
    b = _bounds(cands, queries, keys, max_len)
    offsets = np.concatenate([[0], np.cumsum(b.lengths)]).astype(np.int64)
    index = np.repeat(b.start - offsets[:-1], b.lengths) + np.arange(offsets[-1], dtype=np.int64)
    for row, kept in b.slow.items():
        index[offsets[row]:offsets[row + 1]] = kept
    return b.cands, index, offsets, b.visible


def _queries(pointer_rows: pa.Table, history: pa.Table, cut: HistoryCut | None = None
             ) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(queries, history of their users): one query per pointer row with its build ``_k``; raises
    ValueError when a query's build is at or before a compacted history's horizon (``cut``)."""
    anchor = pointer_rows.column("example_id")
    if "corrects_example_id" in pointer_rows.column_names:
        anchor = pc.coalesce(pointer_rows.column("corrects_example_id"), anchor)
    queries = pl.DataFrame({
        "user_id": pointer_rows.column("user_id"), "_anchor": anchor,
        "domain": pointer_rows.column("domain"), "event_time_ms": pointer_rows.column("event_time_ms"),
        "created_ts_ms": pointer_rows.column("created_ts_ms"),
    }).with_row_index("_i")
    hist = pl.DataFrame(history.select(_HISTORY_COLUMNS)).join(queries.select("user_id").unique(), on="user_id",
                                                                how="semi")
    builds = hist.select("user_id", pl.col("event_id").alias("_anchor"), pl.col("build").alias("_k"))
    queries = queries.join(builds, on=["user_id", "_anchor"], how="left").sort("_i")
    lost = queries.filter(pl.col("_k").is_null())
    if lost.height:
        raise ValueError(f"{lost.height} example(s) point to impressions missing from history, e.g. "
                         f"{lost.get_column('_anchor').head(3).to_list()!r}; read history at or after the examples' "
                         "build, from the same lake")
    oldest = int(queries.get_column("_k").min())  # type: ignore[arg-type]  # a non-empty int64 column
    if cut is not None and oldest <= cut.horizon:
        raise ValueError(f"an example of build {oldest} read with a history compacted up to "
                         f"build {cut.horizon}; read the whole history (sequences.materialize.read_history)")
    return queries, hist


def check_stored_lengths(pointer_rows: pa.Table, prefix: str, lengths: np.ndarray, truncated: np.ndarray) -> None:
    """Raise ValueError when the rebuilt (n,) ``lengths`` or ``truncated`` of one sequence (``prefix``: ``seq_`` or
    ``seq_same_domain_``) differ from the ``<prefix>length`` / ``<prefix>truncated`` the rows store."""
    for name, got in ((f"{prefix}length", lengths), (f"{prefix}truncated", truncated)):
        stored = pointer_rows.column(name).to_numpy(zero_copy_only=False).astype(np.int64)
        bad = np.flatnonzero(stored != got)
        if bad.size:
            raise ValueError(f"{bad.size} example(s) rebuild {name} unlike the stored value (row {int(bad[0])}: "
                             f"{int(got[bad[0]])} != {int(stored[bad[0]])}); history and examples disagree "
                             "(another lake, or max_seq_len / max_same_domain_seq_len changed)")


def sequence_index(pointer_rows: pa.Table, history: pa.Table, max_len: int, *, same_domain: bool = False,
                   check: bool = True, cut: HistoryCut | None = None) -> SequenceIndex:
    """The cross-domain (or, ``same_domain``, the example's-domain) sequence of each pointer row as a
    :class:`SequenceIndex` (rules: the module docstring; arguments: :func:`materialize_examples`).

    ``max_len``: ``max_seq_len`` (or ``same_domain_seq_len``) of the build that wrote the rows.
    ``check``: compare the rebuilt length and truncation count with the row's stored ones.
    ``cut``: what ``history`` left out when it is a compacted one (:class:`HistoryCut`).

    Raises:
        ValueError: as :func:`materialize_examples`.
    """
    prefix = "seq_same_domain_" if same_domain else "seq_"
    keys = ["user_id", "domain"] if same_domain else ["user_id"]
    if pointer_rows.num_rows == 0:
        return SequenceIndex(HISTORY_SCHEMA.empty_table(), np.zeros(0, np.int64), np.zeros(1, np.int64),
                             np.zeros(0, np.int64), np.zeros(0, np.int64))
    queries, hist = _queries(pointer_rows, history, cut)
    cands, prior = _candidates(hist, queries.select(*keys, "_k").unique(), keys, max_len, cut)
    cands, index, offsets, visible = _index(cands, queries, keys, max_len)
    lengths = np.diff(offsets)
    before = (queries.select(*keys, "_k").join(prior, on=[*keys, "_k"], how="left", maintain_order="left")
              .get_column("_prior").fill_null(0).to_numpy().astype(np.int64))
    truncated = before + visible - lengths
    if check:
        check_stored_lengths(pointer_rows, prefix, lengths, truncated)
    return SequenceIndex(cands.select(_HISTORY_COLUMNS).to_arrow(), index, offsets, truncated,
                         queries.get_column("event_time_ms").to_numpy())


@dataclass(frozen=True)
class SequenceSummary:
    """What the quality checks read of n pointer rows' sequences (one kind), without their lists.

    Attributes (all (n,), in row order):
        lengths, truncated: int64, the rebuilt length L and ``*_truncated`` count.
        newest_ms: int64 event time of the newest element kept (ms since epoch UTC; int64 min when L = 0).
        newest_created_ms: int64, at or after the latest append time among the elements kept (exact
            for the rows whose visible prefix was appended out of order, else that prefix's
            running maximum, which is <= the row's append time whenever no element kept is later).
        unordered: bool, the elements kept are not time-ascending.
    """

    lengths: np.ndarray
    truncated: np.ndarray
    newest_ms: np.ndarray
    newest_created_ms: np.ndarray
    unordered: np.ndarray


def sequence_summary(pointer_rows: pa.Table, history: pa.Table, max_len: int, *,
                     same_domain: bool = False, cut: HistoryCut | None = None) -> SequenceSummary:
    """:class:`SequenceSummary` of the cross-domain (or ``same_domain``) sequence of each pointer row:
    one sorted join of the rows' (user, build) pairs with ``history`` and one ``searchsorted`` per row
    (:func:`_bounds`); cost O(H log H + n log H) for H history rows, not O(n * max_len). ``cut``: as
    :func:`materialize_examples`.

    Raises:
        ValueError: an example's impression is not in ``history`` (as :func:`materialize_examples`).
    """
    n = pointer_rows.num_rows
    lowest = np.iinfo(np.int64).min
    if n == 0:
        empty = np.zeros(0, np.int64)
        return SequenceSummary(empty, empty, empty, empty, np.zeros(0, bool))
    keys = ["user_id", "domain"] if same_domain else ["user_id"]
    queries, hist = _queries(pointer_rows, history, cut)
    cands, prior = _candidates(hist, queries.select(*keys, "_k").unique(), keys, max_len, cut)
    b = _bounds(cands, queries, keys, max_len)
    times = b.cands.get_column("event_time_ms").to_numpy()
    created = b.cands.get_column("created_ts_ms").to_numpy()
    codes = b.cands.get_column("_g").to_numpy()
    before = (queries.select(*keys, "_k").join(prior, on=[*keys, "_k"], how="left", maintain_order="left")
              .get_column("_prior").fill_null(0).to_numpy().astype(np.int64))
    # Descents inside a group, as prefix counts: a contiguous range [start, end) is ordered iff it has none.
    descents = np.concatenate([[0, 0], np.cumsum((codes[1:] == codes[:-1]) & (times[1:] < times[:-1]))])
    running = (pl.DataFrame({"g": codes, "c": created}).select(pl.col("c").cum_max().over("g"))
               .get_column("c").to_numpy()) if created.size else np.zeros(1, np.int64)
    last = np.maximum(b.end - 1, 0)
    nonempty = b.lengths > 0
    newest = np.where(nonempty, times[last] if times.size else lowest, lowest)
    newest_created = np.where(nonempty, running[last], lowest)
    unordered = nonempty & (descents[b.end] - descents[np.minimum(b.start + 1, b.end)] > 0)
    for row, kept in b.slow.items():
        if kept.size:
            newest[row], newest_created[row] = times[kept].max(), created[kept].max()
            unordered[row] = bool(np.any(np.diff(times[kept]) < 0))
    return SequenceSummary(b.lengths, before + b.visible - b.lengths, newest, newest_created, unordered)


def materialize_examples(pointer_rows: pa.Table, history: pa.Table, cfg: BuildConfig,
                         schema: pa.Schema | None = None, *, cut: HistoryCut | None = None) -> pa.Table:
    """Fat ``examples`` rows from pointer-layout rows and the ``history`` table (rules: module docstring).

    Args:
        pointer_rows: rows of the pointer layout (:func:`sequences.schema.pointer_schema` of the
            examples schema: every column but the lists; ``user_id``, ``example_id``,
            ``event_time_ms``, ``created_ts_ms``, ``domain``, the four ``*_length`` / ``*_truncated``
            counts and, when present, ``corrects_example_id`` are read).
        history: ``history`` rows (:data:`sequences.schema.HISTORY_SCHEMA`) holding at least every
            row of these examples' users; rows of other users or of later builds are ignored.
        cfg: the build config the rows were built with (``max_seq_len``, ``same_domain_seq_len``).
        schema: the output schema (default: :data:`sequences.examples.EXAMPLES_SCHEMA`); its list
            columns are computed, the others taken from ``pointer_rows``.
        cut: None when ``history`` holds every row of the users; for a compacted history
            (:class:`sequences.history_tail.HistoryTail`), the events it left out.

    Returns:
        One fat row per pointer row, in the same order.

    Raises:
        ValueError: an example's impression is not in ``history`` (a history read before the
            example's build, or another lake), or a rebuilt length or truncation count differs from
            the one the row stores (history and pointers disagree, e.g. a changed ``max_seq_len``), or
            an example's build is at or before ``cut.horizon``.
    """
    from sequences.examples import EXAMPLES_SCHEMA

    schema = EXAMPLES_SCHEMA if schema is None else schema
    if pointer_rows.num_rows == 0:
        return schema.empty_table()
    columns: dict[str, pa.Array] = {}
    for prefix, max_len, same in (("seq_", cfg.max_seq_len, False), ("seq_same_domain_", cfg.same_domain_seq_len, True)):
        seq = sequence_index(pointer_rows, history, max_len, same_domain=same, cut=cut)
        for name, column in (("item_ids", "item_id"), ("categories", "category"), ("event_types", "event_type"),
                             ("domains", "domain")):
            if not (same and name == "domains"):
                columns[f"{prefix}{name}"] = seq.lists(column, pa.string())
        columns[f"{prefix}event_time_ms"] = seq.lists("event_time_ms", pa.int64())
        columns[f"{prefix}time_delta_ms"] = seq.time_deltas()
    arrays = [columns[f.name] if f.name in columns else pointer_rows.column(f.name) for f in schema]
    return pa.Table.from_arrays([a.cast(f.type) for a, f in zip(arrays, schema, strict=True)], schema=schema)


def read_history(lake: Lake | str | Path, user_ids: pa.Array | pa.ChunkedArray, *, version: int | None = None,
                 storage_options: StorageOptions | None = None) -> pa.Table:
    """The ``history`` rows of ``user_ids`` (only their buckets' partitions are read); an empty
    :data:`HISTORY_SCHEMA` table when the lake has no history."""
    dt = open_table(lake, Table.HISTORY, version, storage_options=storage_options)
    if dt is None:
        return HISTORY_SCHEMA.empty_table()
    unique = pc.unique(user_ids if isinstance(user_ids, pa.Array) else user_ids.combine_chunks())
    buckets = sorted({int(b) for b in history_bucket(unique)})
    if not buckets:
        return HISTORY_SCHEMA.empty_table()
    dataset = dt.to_pyarrow_dataset()
    wanted = ds.field("user_bucket").isin(buckets) & ds.field("user_id").isin(unique)
    return dataset.to_table(filter=wanted).select(HISTORY_SCHEMA.names).cast(HISTORY_SCHEMA)


def layout_config(lake: Lake | str | Path, examples_schema: pa.Schema, *,
                  storage_options: StorageOptions | None = None) -> BuildConfig | None:
    """The build config that pointer-layout ``examples`` (no ``seq_event_time_ms`` in
    ``examples_schema``) are materialized with (``max_seq_len`` and ``same_domain_seq_len`` from the
    build's commit metadata); None for fat rows.

    Raises:
        ValueError: pointer rows without the build's metadata.
    """
    if "seq_event_time_ms" in examples_schema.names:
        return None
    meta = commit_metadata(lake, Table.EXAMPLES, "build", storage_options=storage_options) or {}
    if "max_seq_len" not in meta:
        raise ValueError("pointer-layout examples without the build's max_seq_len in their commit metadata")
    return BuildConfig(max_seq_len=int(meta["max_seq_len"]), max_same_domain_seq_len=int(meta["same_domain_seq_len"]))


def read_examples(lake: Lake | str | Path, version: int | None = None, *,
                  storage_options: StorageOptions | None = None) -> pa.Table | None:
    """``examples@version`` (latest when None) as fat rows whatever the lake's layout: pointer rows
    are materialized with their users' history (:func:`materialize_examples`); None without the table.

    For small reads (tests, inspection); large ones go through :func:`export_examples` in chunks.

    Raises:
        ValueError: as :func:`materialize_examples` and :func:`layout_config`.
    """
    dt = open_table(lake, Table.EXAMPLES, version, storage_options=storage_options)
    if dt is None:
        return None
    rows = dt.to_pyarrow_dataset().to_table()
    cfg = layout_config(lake, rows.schema, storage_options=storage_options)
    if cfg is None:
        return rows
    history = read_history(lake, rows.column("user_id"), version=None, storage_options=storage_options)
    return materialize_examples(rows, history, cfg)


def export_examples(lake: Lake | str | Path, out_dir: str | Path, *, version: int | None = None,
                    materialize: bool = True, chunk_rows: int = 100_000,
                    storage_options: StorageOptions | None = None) -> dict[str, Any]:
    """Write ``examples@version`` (latest when None) as plain Parquet files under ``out_dir``, for an
    engine that does not know the pointer layout (DuckDB, Spark).

    With ``materialize``, pointer-layout rows are written fat (:func:`materialize_examples`, ``max_seq_len``
    and ``same_domain_seq_len`` from the build's commit metadata), ``chunk_rows`` rows at a time with
    the history of that chunk's users; fat rows are written as they are. Files are
    ``part-NNNNN.parquet``; an existing ``out_dir`` with Parquet files is refused (no mixing of exports).

    Returns:
        ``{"version", "rows", "files", "layout", "materialized", "fat_rows", "out_dir"}``: ``layout`` is the
        lake's (``"fat"`` or ``"pointer"``), ``materialized`` whether pointer rows were rebuilt into lists,
        ``fat_rows`` whether the files hold the sequence lists (a fat lake's rows need no materializing).

    Raises:
        gemline.errors.MissingInputError: no examples table, or no ``version`` of it.
        gemline.errors.BadConfigError: ``out_dir`` holds Parquet files already, is a file, or cannot be created.
        ValueError: as :func:`materialize_examples`, or pointer rows without the build's metadata.
    """
    import pyarrow.parquet as pq

    newest = open_table(lake, Table.EXAMPLES, storage_options=storage_options)
    if newest is None:
        raise MissingInputError(f"no examples table under {str(lake)!r}; run the build stage first")
    if version is not None and not 0 <= version <= newest.version():
        raise MissingInputError(f"examples has versions 0..{newest.version()}, not {version}")
    dt = newest if version is None else open_table(lake, Table.EXAMPLES, version, storage_options=storage_options)
    assert dt is not None
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise BadConfigError(f"--out {str(out)!r} is a file; export into a directory")
    if out.exists() and any(out.glob("*.parquet")):
        raise BadConfigError(f"{out} already holds Parquet files; export into an empty directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadConfigError(f"cannot create --out {str(out)!r}: {exc.strerror or exc}") from None
    dataset = dt.to_pyarrow_dataset()
    cfg = layout_config(lake, dataset.schema, storage_options=storage_options) if materialize else None
    rows = files = 0

    def write(batches: list[pa.RecordBatch]) -> None:
        nonlocal rows, files
        table = pa.Table.from_batches(batches, schema=dataset.schema)
        if cfg is not None and table.num_rows:
            table = materialize_examples(table, read_history(lake, table.column("user_id"),
                                                             storage_options=storage_options), cfg)
        if table.num_rows:
            pq.write_table(table, out / f"part-{files:05d}.parquet")
            rows, files = rows + table.num_rows, files + 1

    # Batches follow the table's files, often a few hundred rows each: gather them to chunk_rows per part.
    pending: list[pa.RecordBatch] = []
    for batch in dataset.to_batches(batch_size=chunk_rows):
        pending.append(batch)
        if sum(b.num_rows for b in pending) >= chunk_rows:
            write(pending)
            pending = []
    if pending:
        write(pending)
    layout = "fat" if "seq_event_time_ms" in dataset.schema.names else "pointer"
    return {"version": dt.version(), "rows": rows, "files": files, "layout": layout,
            "materialized": cfg is not None, "fat_rows": layout == "fat" or cfg is not None, "out_dir": str(out)}


__all__ = ["HistoryCut", "SequenceIndex", "SequenceSummary", "sequence_summary", "export_examples", "history_bucket", "history_rows", "layout_config", "materialize_examples",
           "read_examples", "read_history", "sequence_index", "to_pointers"]
