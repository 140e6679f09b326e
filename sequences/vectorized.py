"""Vectorised shard steps: the build of many users (or items) at once with polars and numpy.

Same inputs, outputs and semantics as the reference steps of :mod:`sequences.shards` (which loop
:func:`sequences.incremental.build_user` / ``build_item`` over the shard's entities); the tests
compare the two table by table. The per-entity logic becomes whole-shard operations:

- dedup and order: one sort by (entity, event_time_ms, event_id) and one ``unique`` on event_id;
- point-in-time sequences and counters (the counters and feature rows from :mod:`features.vectorized`): every group (user, user x domain, item x domain) sorted
  by time in one array, queries answered with one ``numpy.searchsorted`` on the key
  ``group * span + time`` (so a search never crosses into another group), prefix sums for counts;
- labels: an as-of join (polars ``join_asof``, forward) of each impression with the first later
  click or conversion of the same (user, item, domain);
- state rows (sequences, features, buffer, evicted counts): group-bys.

Append times: the vectorised gather and counters assume every event earlier than a query was
also appended no later than the query (the fast case of
:func:`sequences.history.point_in_time_gather`). An entity with a query where that fails (a
backfilled event older than an impression that reached Kafka before it) is built by the reference
step instead; such entities are rare in a log appended in time order, and the results are the
same either way.

Times are ms since epoch UTC throughout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from features.definitions import ITEM_FEATURES, USER_CATEGORY_FEATURES, USER_FEATURES, WINDOWS_MS
from features.vectorized import (
    EVENT_ORDER,
    counter_frame,
    feature_rows,
    grouped,
    latest_non_null_in_order,
    merge_evicted,
    prior_counts,
    utc_date,
    with_ctr,
)
from ingest.schema import IMPRESSION_TYPES
from sequences.config import BuildConfig
from sequences.examples import ITEM_DENSE, LABEL_COLUMNS, USER_DENSE, examples_schema, pending_schema
from sequences.incremental import EVICTED_SCHEMA
from sequences.publish import (
    NO_LABEL,
    ORPHAN_LABELS_SCHEMA,
    TASKS,
    deadlines,
    needs_labels,
    plan_publication,
    published_rows,
)
from sequences.schema import SEQUENCES_BY_DOMAIN_SCHEMA, SEQUENCES_SCHEMA, SPARSE_FEATURES
from sequences.shards import (
    DENSE_SCHEMA,
    EVENT_SCHEMA,
    HISTORY_EVENT_SCHEMA,
    ITEM_OUTPUTS,
    item_shard_reference,
    user_outputs,
    user_shard_reference,
)

_REQUIRED = ("event_id", "event_time_ms", "user_id", "item_id", "domain", "event_type", "created_ts_ms")
_IMPRESSIONS = sorted(IMPRESSION_TYPES)


# --------------------------------------------------------------------------------------------
# Events


def _events(table: pa.Table) -> pl.DataFrame:
    """Events as polars, checked like :func:`ingest.schema.sorted_unique_events`."""
    for name in _REQUIRED:
        if table.column(name).null_count:
            raise ValueError(f"events lack required field {name!r} in {table.column(name).null_count} row(s); "
                             "expected rows of ingest.schema.EVENTS_TABLE_SCHEMA with created_ts_ms")
    return pl.DataFrame(table.select(EVENT_SCHEMA.names).cast(EVENT_SCHEMA))


def _sorted_unique(frame: pl.DataFrame, entity: str) -> pl.DataFrame:
    """Sorted by (entity, time, event_id), first copy of each (entity, event_id) kept."""
    ordered = frame.sort([entity, *EVENT_ORDER], maintain_order=True)
    return ordered.filter(pl.struct(entity, "event_id").is_first_distinct())


def _stored(seq: pa.Table) -> pl.DataFrame:
    """A stored sequences (or sequences_by_domain) table as minimal events, like
    :func:`sequences.incremental.stored_events`."""
    frame = pl.DataFrame(seq.select(SEQUENCES_SCHEMA.names))
    lists = {"seq_event_ids": "event_id", "seq_event_time_ms": "event_time_ms", "seq_created_ts_ms": "created_ts_ms",
             "seq_item_ids": "item_id", "seq_categories": "category", "seq_event_types": "event_type",
             "seq_domains": "domain"}
    exploded = (frame.filter(pl.col("seq_length") > 0).select("user_id", *lists).explode(list(lists))
                .rename(lists))
    return exploded.with_columns(pl.when(pl.col("category") == "").then(None).otherwise(pl.col("category"))
                                 .alias("category"))


# --------------------------------------------------------------------------------------------
# Slow entities


def _needs_reference(events: pl.DataFrame, entity: str, queries: pl.DataFrame) -> set[str]:
    """Entities with a query that some earlier event (time < query time) was appended after."""
    if queries.height == 0 or events.height == 0:
        return set()
    # Only an event appended after some query can be one: the rest (nearly all of a long-lived user's buffered
    # and stored events, appended before this batch's impressions) is left out of the sort below. The worst
    # append time before a query is unchanged wherever it exceeds the query's, so the answer is the same.
    events = events.filter(pl.col("created_ts_ms") > queries.get_column("created_ts_ms").min())
    queries = queries.join(events.select(entity).unique(), on=entity, how="semi")  # the others have none
    if queries.height == 0:
        return set()
    events, groups, q_codes, q_times = grouped(_queried(events, queries, [entity]), queries, [entity])
    created = events.get_column("created_ts_ms").to_numpy()
    codes = events.get_column("_g").to_numpy()
    end = groups.before(q_codes, q_times)
    start = groups.start(q_codes)
    # Running max of append times, restarted at every group.
    running = (pl.DataFrame({"g": codes, "c": created}).select(pl.col("c").cum_max().over("g"))
               .get_column("c").to_numpy())
    worst = np.where(end > start, running[np.maximum(end - 1, 0)], np.iinfo(np.int64).min)
    slow = worst > queries.get_column("created_ts_ms").to_numpy()
    return set(queries.get_column(entity).filter(pl.Series(slow)).to_list())


def _queried(events: pl.DataFrame, queries: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    """The rows of ``events`` whose ``keys`` some query shares: a search of one group never looks at another,
    so the rest of the shard's state (most of it, in a pass that touches few entities) is left out of the sort."""
    return events.join(queries.select(keys).unique(), on=keys, how="semi", maintain_order="left")


def _split(tables: Mapping[str, pa.Table], keys: Mapping[str, str], slow: set[str]) -> tuple[dict, dict]:
    """(fast, slow) copies of ``tables``, rows split by whether their entity key is in ``slow``."""
    if not slow:
        return dict(tables), {}
    members = pa.array(sorted(slow), pa.string())
    fast_t, slow_t = {}, {}
    for name, table in tables.items():
        mask = pa.compute.is_in(table.column(keys[name]), value_set=members)
        slow_t[name] = table.filter(mask)
        fast_t[name] = table.filter(pa.compute.invert(mask))
    return fast_t, slow_t


def _to_arrow(frame: pl.DataFrame, schema: pa.Schema) -> pa.Table:
    if frame.height == 0:
        return schema.empty_table()
    return frame.select(schema.names).to_arrow().cast(schema)


def _concat_outputs(a: Mapping[str, pa.Table], b: Mapping[str, pa.Table], schemas: Mapping[str, pa.Schema]):
    return {name: pa.concat_tables([a[name].cast(schema), b[name].cast(schema)]) if name in b else a[name]
            for name, schema in schemas.items()}


# --------------------------------------------------------------------------------------------
# Item shard


def item_shard_vectorized(tables: Mapping[str, pa.Table], config: BuildConfig, *, watermark_ms: int,
                          feature_views: bool = True) -> dict[str, pa.Table]:
    """:func:`sequences.shards.item_shard_reference`, vectorised over the shard's items.

    Args:
        tables: :data:`sequences.shards.ITEM_INPUTS` tables.
        watermark_ms: newest event time after this batch (ms since epoch UTC).
        feature_views: compute the ``features/item`` rows; False: that output is empty (a pass that does not
            materialise the feature views, ``build.features_interval_ms``), the others are the same.

    Returns:
        :data:`sequences.shards.ITEM_OUTPUTS` tables (row order may differ from the reference).

    Raises:
        ValueError: an event lacks a required field.
    """
    new, buffer = _events(tables["new"]), _events(tables["buffer"])
    # One sort of the buffer, with the new events: a stable sort keeps the buffer's copy of a repeated event.
    recent = _sorted_unique(pl.concat([buffer, new]), "item_id")
    # The new events the buffer lacks, sorted and deduplicated: recent's rows of the keys the buffer lacks (for
    # such a key recent kept the first of new's copies in the same order), without a second sort.
    fresh_new = recent if buffer.height == 0 else recent.join(
        buffer.select("item_id", "event_id"), on=["item_id", "event_id"], how="anti", maintain_order="left")
    queries = fresh_new.filter(pl.col("event_type").is_in(_IMPRESSIONS))
    slow = _needs_reference(recent, "item_id", queries)
    if slow:
        fast_tables, slow_tables = _split(tables, {"new": "item_id", "buffer": "item_id", "evicted": "key"}, slow)
        return _concat_outputs(item_shard_vectorized(fast_tables, config, watermark_ms=watermark_ms,
                                                     feature_views=feature_views),
                               without_views(item_shard_reference(slow_tables, config, watermark_ms), feature_views),
                               ITEM_OUTPUTS)
    evicted = pl.DataFrame(tables["evicted"].select(EVICTED_SCHEMA.names).cast(EVICTED_SCHEMA))

    # Item counters of the new impressions, per (item, domain), as of each impression.
    dense_windows = {"7d": WINDOWS_MS["7d"], "all": None}
    # recent is in (item, time, event_id) order, and _queried keeps it.
    counts = counter_frame(_queried(recent, queries, ["item_id", "domain"]), ["item_id", "domain"], queries,
                           "event_time_ms", dense_windows, in_time_order=True)
    prior = prior_counts(evicted, "item", queries, {"key": "item_id", "domain": "domain"})
    values = with_ctr(counts, prior, config, dense_windows)
    dense = queries.select("user_id", pl.col("event_id").alias("example_id")).with_columns(
        *[pl.Series(f_name, values[counter].astype(np.float64)) for f_name, counter in ITEM_DENSE.items()])

    # Without the views, no visible event: feature_rows returns no row and computes nothing.
    visible = recent.filter(pl.col("event_time_ms") <= watermark_ms) if feature_views else recent.clear()
    features = feature_rows(visible, ["item_id", "domain"], evicted, "item", {"key": "item_id", "domain": "domain"},
                            watermark_ms, ITEM_FEATURES.ttl_ms, config)
    if features.height:
        # visible is in (item, time, event_id) order: recent's sort.
        features = features.join(latest_non_null_in_order(visible, ["item_id", "domain"], ["category"]),
                                 on=["item_id", "domain"], how="left")
    gone = recent.filter(pl.col("event_time_ms") < watermark_ms - config.state_lookback_ms)
    return {
        "dense": _to_arrow(dense, DENSE_SCHEMA),
        "evicted": _to_arrow(merge_evicted(evicted, gone, "item", "item_id"), EVICTED_SCHEMA),
        ITEM_FEATURES.name: _to_arrow(features, ITEM_FEATURES.schema),
    }


# --------------------------------------------------------------------------------------------
# User shard


def _gather_lists(cands: pl.DataFrame, group_keys: list[str], queries: pl.DataFrame, max_len: int,
                  prior_cut: np.ndarray, prefix: str, with_domains: bool,
                  lists_too: bool = True) -> dict[str, pa.Array | np.ndarray]:
    """Point-in-time sequence columns of each query row from sorted candidates (fast case only);
    without ``lists_too`` only the length and truncation count (the pointer layout)."""
    cands, groups, q_codes, q_times = grouped(cands, queries, group_keys)
    times = cands.get_column("event_time_ms").to_numpy()
    end = groups.before(q_codes, q_times)
    first = groups.start(q_codes)
    start = np.maximum(first, end - max_len)
    lengths = (end - start).astype(np.int64)
    if not lists_too:
        return {f"{prefix}length": lengths, f"{prefix}truncated": prior_cut + (end - first) - lengths}
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    index = np.repeat(start - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
    take = pa.array(index, pa.int64())
    arrow_offsets = pa.array(offsets, pa.int32())

    def lists(column: pl.Series, value_type: pa.DataType) -> pa.Array:
        values = column.to_arrow().cast(value_type).take(take)
        return pa.ListArray.from_arrays(arrow_offsets, values, type=pa.list_(value_type))

    out: dict[str, pa.Array | np.ndarray] = {
        f"{prefix}item_ids": lists(cands.get_column("item_id"), pa.string()),
        f"{prefix}categories": lists(cands.get_column("category").fill_null(""), pa.string()),
        f"{prefix}event_types": lists(cands.get_column("event_type"), pa.string()),
    }
    if with_domains:
        out[f"{prefix}domains"] = lists(cands.get_column("domain"), pa.string())
    out[f"{prefix}event_time_ms"] = lists(cands.get_column("event_time_ms"), pa.int64())
    deltas = np.repeat(q_times, lengths) - times[index]
    out[f"{prefix}time_delta_ms"] = pa.ListArray.from_arrays(arrow_offsets, pa.array(deltas, pa.int64()),
                                                             type=pa.list_(pa.int64()))
    out[f"{prefix}length"] = lengths
    out[f"{prefix}truncated"] = prior_cut + (end - first) - lengths
    return out


def _sequence_rows(events: pl.DataFrame, keys: list[str], owners: pl.DataFrame, prior: pl.DataFrame, max_len: int,
                   watermark_ms: int) -> pl.DataFrame:
    """Newest ``max_len`` sorted events per ``keys`` group, one row per ``owners`` row (empty lists
    where a group has none); ``prior``: ``keys`` + ``prior_cut``."""
    ranked = events.sort([*keys, *EVENT_ORDER]).with_columns(
        pl.len().over(keys).cast(pl.Int64).alias("_n"), pl.int_range(pl.len()).over(keys).alias("_i"))
    kept = ranked.filter(pl.col("_i") >= pl.col("_n") - max_len)
    agg = kept.group_by(keys, maintain_order=True).agg(
        pl.col("item_id").alias("seq_item_ids"), pl.col("category").fill_null("").alias("seq_categories"),
        pl.col("event_type").alias("seq_event_types"), pl.col("domain").alias("seq_domains"),
        pl.col("event_time_ms").alias("seq_event_time_ms"), pl.col("event_id").alias("seq_event_ids"),
        pl.col("created_ts_ms").alias("seq_created_ts_ms"), pl.col("_n").first().alias("_n"))
    rows = owners.join(agg, on=keys, how="left").join(prior, on=keys, how="left")
    empty_str, empty_int = pl.lit([], dtype=pl.List(pl.String)), pl.lit([], dtype=pl.List(pl.Int64))
    return rows.with_columns(
        *[pl.col(c).fill_null(empty_str) for c in ("seq_item_ids", "seq_categories", "seq_event_types", "seq_domains",
                                                   "seq_event_ids")],
        *[pl.col(c).fill_null(empty_int) for c in ("seq_event_time_ms", "seq_created_ts_ms")],
    ).with_columns(
        pl.col("seq_item_ids").list.len().cast(pl.Int32).alias("seq_length"),
        (pl.col("prior_cut").fill_null(0).cast(pl.Int64) + pl.col("_n").fill_null(0) - pl.col("seq_item_ids").list.len().cast(pl.Int64))
        .cast(pl.Int32).alias("seq_truncated"),
        pl.lit(watermark_ms, dtype=pl.Int64).alias("as_of_ms"),
    )


def user_shard_vectorized(
    tables: Mapping[str, pa.Table],
    config: BuildConfig,
    *,
    watermark_ms: int,
    old_close_ms: int | None,
    close_ms: int,
    new_buffer_rows_only: bool = False,
    feature_views: bool = True,
) -> dict[str, pa.Table]:
    """:func:`sequences.shards.user_shard_reference`, vectorised over the shard's users.

    ``new_buffer_rows_only``: the ``buffer`` output holds only the rows the input buffer lacks (what the build
    appends: :func:`sequences.pipeline._user_shard_step`), not every row kept; the other outputs are the same.
    The full output filtered by the input buffer's event ids gives the same rows (tested), without converting
    and hashing the whole buffer every pass.

    ``feature_views``: False leaves the ``features/user`` and ``features/user_category`` outputs empty and does
    not compute them (a pass that does not materialise the feature views, ``build.features_interval_ms``).

    Args:
        tables: :data:`sequences.shards.USER_INPUTS` tables.
        watermark_ms, old_close_ms, close_ms: as :func:`sequences.incremental.build_user`.

    Returns:
        :data:`sequences.shards.USER_OUTPUTS` tables (row order may differ from the reference).

    Raises:
        ValueError: an event lacks a required field, or a new impression has no item counters.
    """
    new, buffer = _events(tables["new"]), _events(tables["buffer"])
    # Only the users with new events get their stored sequences read back into events; every other stored row
    # comes out as it went in (_kept_sequences): most users of a shard have no new event in a streaming pass.
    new_users = pa.array(new.get_column("user_id").unique().to_list(), pa.string())
    seq_in, seq_kept = _touched_rows(tables["seq"], new_users, config.max_seq_len)
    dseq_in, dseq_kept = _touched_rows(tables["dseq"], new_users, config.same_domain_seq_len)
    seq_stored, dseq_stored = _stored(seq_in), _stored(dseq_in.select(SEQUENCES_SCHEMA.names))
    known = pl.concat([buffer.select("user_id", "event_id"), seq_stored.select("user_id", "event_id"),
                       dseq_stored.select("user_id", "event_id")])
    fresh = _sorted_unique(new, "user_id").join(known, on=["user_id", "event_id"], how="anti", maintain_order="left")
    # One sort of the buffer (fresh events are new to it); none without one: fresh is sorted and deduplicated.
    recent = fresh if buffer.height == 0 else _sorted_unique(pl.concat([buffer, fresh]), "user_id")
    queries = fresh.filter(pl.col("event_type").is_in(_IMPRESSIONS))
    minimal = ["user_id", "event_id", "event_time_ms", "created_ts_ms", "item_id", "category", "event_type", "domain"]
    # Queries are new impressions: their users' stored events are all in seq_stored and dseq_stored.
    everything = pl.concat([_queried(recent, queries, ["user_id"]).select(minimal), seq_stored.select(minimal),
                            dseq_stored.select(minimal)])
    slow = _needs_reference(everything, "user_id", queries)
    if slow:
        keys = {"new": "user_id", "buffer": "user_id", "seq": "user_id", "dseq": "user_id", "evicted": "key",
                "pending": "user_id", "dense": "user_id"}
        fast_tables, slow_tables = _split(tables, keys, slow)
        kwargs: dict[str, Any] = {"watermark_ms": watermark_ms, "old_close_ms": old_close_ms, "close_ms": close_ms}
        reference = without_views(user_shard_reference(slow_tables, config, **kwargs), feature_views)
        if new_buffer_rows_only:
            reference["buffer"] = not_held(reference["buffer"], slow_tables["buffer"], "event_id")
        return _concat_outputs(user_shard_vectorized(fast_tables, config, **kwargs,
                                                     new_buffer_rows_only=new_buffer_rows_only,
                                                     feature_views=feature_views),
                               reference, user_outputs(config))

    evicted = pl.DataFrame(tables["evicted"].select(EVICTED_SCHEMA.names).cast(EVICTED_SCHEMA))
    seq_table = pl.DataFrame(tables["seq"].select(["user_id", "seq_truncated"]))
    dseq_table = pl.DataFrame(tables["dseq"].select(["user_id", "domain", "seq_truncated"]))
    pending_old = tables["pending"].select(pending_schema(config).names).cast(pending_schema(config))
    new_pending = _new_pending(tables, queries, fresh, seq_stored, dseq_stored, seq_table, dseq_table, recent,
                               evicted, config)
    all_pending = pa.concat_tables([pending_old, new_pending])
    is_new = np.concatenate([np.zeros(pending_old.num_rows, bool), np.ones(new_pending.num_rows, bool)])
    t = all_pending.column("event_time_ms").to_numpy()
    due_in = deadlines(all_pending.column("domain"), config)
    need = needs_labels(t, due_in, is_new, config, old_close_ms, close_ms)
    fresh_labels = fresh.filter(pl.col("event_type").is_in(list(TASKS)))
    if config.label_mode != "wait" and fresh_labels.height:
        # A late positive is due where a label event is new in this build.
        label_keys = fresh_labels.select("user_id", "item_id", "domain").unique().with_columns(pl.lit(True).alias("_hit"))
        need |= (pl.DataFrame(all_pending.select(["user_id", "item_id", "domain"]))
                 .join(label_keys, on=["user_id", "item_id", "domain"], how="left", maintain_order="left")
                 .get_column("_hit").fill_null(False).to_numpy())
    latency = label_latencies_vectorized(all_pending, need, recent, config)
    plan = plan_publication(t, due_in, latency, is_new, config, old_close_ms, close_ms)
    examples = published_rows(all_pending, latency, plan, config, watermark_ms=watermark_ms, close_ms=close_ms,
                              schema=examples_schema(config), label_columns=LABEL_COLUMNS)
    orphans = _orphan_labels(fresh_labels, recent, fresh, config, old_close_ms, close_ms)

    owners = pl.concat([
        pl.DataFrame(tables[name].select([key])).rename({key: "user_id"})
        for name, key in (("new", "user_id"), ("buffer", "user_id"), ("seq", "user_id"), ("dseq", "user_id"),
                          ("evicted", "key"), ("pending", "user_id"))
    ]).unique().join(pl.DataFrame(seq_kept.select(["user_id"])), on="user_id", how="anti").sort("user_id")
    cross = pl.concat([seq_stored.select(minimal), fresh.select(minimal)])
    sequences = _sequence_rows(cross, ["user_id"], owners, seq_table.rename({"seq_truncated": "prior_cut"}),
                               config.max_seq_len, watermark_ms)
    fresh_by_domain = fresh.select(minimal)
    domain_events = pl.concat([dseq_stored.select(minimal), fresh_by_domain])
    domain_owners = pl.concat([pl.DataFrame(dseq_in.select(["user_id", "domain"])),
                               fresh.select("user_id", "domain")]).unique()
    domain_sequences = _sequence_rows(domain_events, ["user_id", "domain"], domain_owners.sort(["user_id", "domain"]),
                                      dseq_table.rename({"seq_truncated": "prior_cut"}), config.same_domain_seq_len,
                                      watermark_ms)

    # Without the views, no visible event: feature_rows returns no row and computes nothing.
    visible = recent.filter(pl.col("event_time_ms") <= watermark_ms) if feature_views else recent.clear()
    user_features = feature_rows(visible, ["user_id", "domain"], evicted, "user", {"key": "user_id", "domain": "domain"},
                                  watermark_ms, USER_FEATURES.ttl_ms, config)
    if user_features.height:
        ttl = USER_FEATURES.ttl_ms
        in_ttl = visible if ttl is None else visible.filter(pl.col("event_time_ms") >= watermark_ms - ttl)
        # in_ttl is in (user, time, event_id) order: recent's sort.
        user_features = user_features.join(latest_non_null_in_order(in_ttl, ["user_id"], ["age", "gender", "location"]),
                                           on="user_id", how="left")
    categorised = visible.filter(pl.col("category").is_not_null() & (pl.col("category") != ""))
    category_features = feature_rows(
        categorised, ["user_id", "domain", "category"], evicted, "user_category",
        {"key": "user_id", "domain": "domain", "category": "category"}, watermark_ms, USER_CATEGORY_FEATURES.ttl_ms,
        config)

    cut = watermark_ms - config.state_lookback_ms
    kept, gone = recent.filter(pl.col("event_time_ms") >= cut), recent.filter(pl.col("event_time_ms") < cut)
    evicted_out = pl.concat([merge_evicted(evicted, gone, "user", "user_id"),
                             merge_evicted(evicted, gone, "user_category", "user_id")])
    return {
        "sequences": _kept_sequences(_to_arrow(sequences, SEQUENCES_SCHEMA), seq_kept, watermark_ms),
        "sequences_by_domain": _kept_sequences(_to_arrow(domain_sequences, SEQUENCES_BY_DOMAIN_SCHEMA), dseq_kept,
                                               watermark_ms),
        # Every fresh event is new to the buffer (fresh is anti-joined with it): the kept ones are what it gains.
        "buffer": _to_arrow(fresh.filter(pl.col("event_time_ms") >= cut) if new_buffer_rows_only else kept,
                            EVENT_SCHEMA),
        "evicted": _to_arrow(evicted_out, EVICTED_SCHEMA),
        "pending": all_pending.filter(pa.array(plan.keep)),
        "examples": examples,
        "orphan_labels": orphans,
        "history": _to_arrow(fresh, HISTORY_EVENT_SCHEMA),
        USER_FEATURES.name: _to_arrow(user_features, USER_FEATURES.schema),
        USER_CATEGORY_FEATURES.name: _to_arrow(category_features, USER_CATEGORY_FEATURES.schema),
    }


FEATURE_VIEW_OUTPUTS = (ITEM_FEATURES.name, USER_FEATURES.name, USER_CATEGORY_FEATURES.name)
"""The shard steps' outputs that are feature views (``build.features_interval_ms``)."""


def without_views(outputs: dict[str, pa.Table], feature_views: bool) -> dict[str, pa.Table]:
    """``outputs`` with every feature-view output emptied unless ``feature_views``."""
    if feature_views:
        return outputs
    return {name: table.schema.empty_table() if name in FEATURE_VIEW_OUTPUTS else table
            for name, table in outputs.items()}


def not_held(rows: pa.Table, held: pa.Table, key: str) -> pa.Table:
    """The rows of a row-state output whose ``key`` the state's input rows ``held`` lack: what a pass appends."""
    if rows.num_rows == 0 or held.num_rows == 0:
        return rows
    return rows.filter(pc.invert(pc.is_in(rows.column(key), value_set=held.column(key))))


def _touched_rows(stored: pa.Table, users: pa.Array, max_len: int) -> tuple[pa.Table, pa.Table]:
    """(rows to rebuild, rows kept as they are) of a stored sequences table: a row is rebuilt when its user has
    new events (``users``) or it holds more than ``max_len`` events (a shorter ``max_seq_len`` than the one it
    was built with cuts it on the next build, as a rebuild from its events would)."""
    rebuild = pc.or_(pc.is_in(stored.column("user_id"), value_set=users),
                     pc.greater(stored.column("seq_length"), max_len))
    return stored.filter(rebuild), stored.filter(pc.invert(rebuild))


def _kept_sequences(rebuilt: pa.Table, kept: pa.Table, watermark_ms: int) -> pa.Table:
    """``rebuilt`` followed by the ``kept`` rows stamped ``as_of_ms = watermark_ms`` (in their stored order: no
    reader relies on the rows' order, and sorting would copy every list).

    A kept row is what :func:`_sequence_rows` would rebuild from it: its events are the stored ones (the user
    has no new event), so its lists, length and truncation count stay, and only its as-of time moves."""
    if kept.num_rows == 0:
        return rebuilt
    stamped = kept.select(rebuilt.schema.names).cast(rebuilt.schema).set_column(
        rebuilt.schema.get_field_index("as_of_ms"), rebuilt.schema.field("as_of_ms"),
        pa.array(np.full(kept.num_rows, watermark_ms, dtype=np.int64), pa.int64()))
    return pa.concat_tables([rebuilt, stamped])


def _new_pending(tables, queries: pl.DataFrame, fresh: pl.DataFrame, seq_stored: pl.DataFrame,
                 dseq_stored: pl.DataFrame, seq_table: pl.DataFrame, dseq_table: pl.DataFrame, recent: pl.DataFrame,
                 evicted: pl.DataFrame, config: BuildConfig) -> pa.Table:
    """:func:`sequences.examples.pending_schema` rows of the shard's new impressions (sequences and
    features point in time)."""
    schema = pending_schema(config)
    lists_too = config.examples_layout == "fat"
    if queries.height == 0:
        return schema.empty_table()
    queries = queries.sort(["user_id", *EVENT_ORDER])
    dense = pl.DataFrame(tables["dense"].select(DENSE_SCHEMA.names)).unique(subset=["example_id"], keep="first")
    joined = queries.join(dense.drop("user_id"), left_on="event_id", right_on="example_id", how="left",
                          maintain_order="left")
    missing = joined.filter(pl.col(next(iter(ITEM_DENSE))).is_null()).get_column("event_id").to_list()
    if missing:
        raise ValueError(
            f"no item features for impressions {missing[:3]!r} ({len(missing)} in all); "
            "item_dense must come from item_features over the same events")
    minimal = ["user_id", "event_id", "event_time_ms", "created_ts_ms", "item_id", "category", "event_type", "domain"]
    cross = pl.concat([seq_stored.select(minimal), fresh.select(minimal)])
    cross_cut = queries.select("user_id").join(seq_table, on="user_id", how="left", maintain_order="left")
    columns: dict = _gather_lists(cross, ["user_id"], queries, config.max_seq_len,
                                  cross_cut.get_column("seq_truncated").fill_null(0).to_numpy().astype(np.int64),
                                  "seq_", with_domains=True, lists_too=lists_too)
    same = pl.concat([dseq_stored.select(minimal), fresh.select(minimal)])
    same_cut = queries.select("user_id", "domain").join(dseq_table, on=["user_id", "domain"], how="left",
                                                        maintain_order="left")
    columns.update(_gather_lists(same, ["user_id", "domain"], queries, config.same_domain_seq_len,
                                 same_cut.get_column("seq_truncated").fill_null(0).to_numpy().astype(np.int64),
                                 "seq_same_domain_", with_domains=False, lists_too=lists_too))
    user_windows = {"1d": WINDOWS_MS["1d"], "7d": WINDOWS_MS["7d"], "all": None}
    counts = counter_frame(_queried(recent, queries, ["user_id", "domain"]), ["user_id", "domain"], queries,
                           "event_time_ms", user_windows, in_time_order=True)  # recent: (user, time, event_id)
    prior = prior_counts(evicted, "user", queries, {"key": "user_id", "domain": "domain"})
    values = with_ctr(counts, prior, config, user_windows)
    frame = joined.select(
        pl.col("event_id").alias("example_id"), "event_time_ms", utc_date("event_time_ms").alias("event_date"),
        "created_ts_ms", *[pl.col(name).cast(pl.String) for name in SPARSE_FEATURES], *ITEM_DENSE)
    for f_name, counter in USER_DENSE.items():
        frame = frame.with_columns(pl.Series(f_name, values[counter].astype(np.float64)))
    frame = frame.with_columns(pl.Series("f_seq_length", columns["seq_length"].astype(np.float64)))
    base = frame.to_arrow()
    arrays = [columns[f.name] if f.name in columns else base.column(f.name) for f in schema]
    arrays = [pa.array(a, f.type) if isinstance(a, np.ndarray) else a.cast(f.type)
              for a, f in zip(arrays, schema, strict=True)]
    return pa.Table.from_arrays(arrays, schema=schema)


def label_latencies_vectorized(pending: pa.Table, rows: np.ndarray, recent: pl.DataFrame,
                               config: BuildConfig) -> dict[str, np.ndarray]:
    """:func:`sequences.examples.label_latencies` for many users: ms to the first label in [t, t + window]
    of each row where ``rows`` is set, :data:`sequences.publish.NO_LABEL` elsewhere.

    Args:
        pending: n rows with ``user_id``, ``item_id``, ``domain``, ``event_time_ms`` (ms since epoch UTC).
        rows: (n,) bool.
        recent: events with ``user_id``, ``item_id``, ``domain``, ``event_type``, ``event_time_ms`` (the
            labels are its clicks and conversions; other rows are ignored, duplicates allowed).

    Returns:
        ``{"click": (n,) int64, "conversion": (n,) int64}``.
    """
    n = pending.num_rows
    out = {task: np.full(n, NO_LABEL, dtype=np.int64) for task in TASKS}
    index = np.flatnonzero(rows)
    if not len(index):
        return out
    frame = (pl.DataFrame(pending.select(["user_id", "item_id", "domain", "event_time_ms"]).take(pa.array(index)))
             .with_row_index("_row"))
    domains = frame.get_column("domain").unique().to_list()
    for task in TASKS:
        windows = pl.DataFrame({"domain": domains, "_w": [config.window_ms(d, task) for d in domains]},
                               schema={"domain": pl.String, "_w": pl.Int64})
        hits = (recent.filter(pl.col("event_type") == task)
                .select("user_id", "item_id", "domain", pl.col("event_time_ms").alias("_label_ms"))
                .sort("_label_ms"))
        matched = (frame.sort("event_time_ms")
                   .join_asof(hits, left_on="event_time_ms", right_on="_label_ms", by=["user_id", "item_id", "domain"],
                              strategy="forward", check_sortedness=False)  # both sorted by time just above
                   .join(windows, on="domain", how="left").sort("_row"))
        latency = matched.select(
            pl.when(pl.col("_label_ms") <= pl.col("event_time_ms") + pl.col("_w"))
            .then(pl.col("_label_ms") - pl.col("event_time_ms")).otherwise(None)).to_series()
        out[task][index] = latency.fill_null(NO_LABEL).cast(pl.Int64).to_numpy()
    return out


def _orphan_labels(labels: pl.DataFrame, recent: pl.DataFrame, fresh: pl.DataFrame, config: BuildConfig,
                   old_close_ms: int | None, close_ms: int) -> pa.Table:
    """:func:`sequences.publish.orphan_labels` for many users (rows in any order)."""
    if not labels.height:
        return ORPHAN_LABELS_SCHEMA.empty_table()
    new_ids = fresh.filter(pl.col("event_type").is_in(_IMPRESSIONS)).get_column("event_id")
    impressions = (recent.filter(pl.col("event_type").is_in(_IMPRESSIONS))
                   .select("user_id", "item_id", "domain", pl.col("event_time_ms").alias("_t"),
                           pl.col("event_id").is_in(new_ids.implode()).alias("_new")))
    pairs = [(d, task) for d in labels.get_column("domain").unique().to_list() for task in TASKS]
    windows = pl.DataFrame({"domain": [d for d, _ in pairs], "event_type": [k for _, k in pairs],
                            "_w": [config.window_ms(d, k) for d, k in pairs],
                            "_d": [config.publish_delay(d) for d, _ in pairs]},
                           schema={"domain": pl.String, "event_type": pl.String, "_w": pl.Int64, "_d": pl.Int64})
    s = pl.col("event_time_ms")
    in_window = (pl.col("_t") >= s - pl.col("_w")) & (pl.col("_t") <= s)
    decided = pl.when(s - pl.col("_t") <= pl.col("_d")).then(pl.col("_t") + pl.col("_d")).otherwise(s)
    alive = in_window & (pl.col("_new") | (decided > old_close_ms)) if old_close_ms is not None else in_window
    judged = (labels.join(windows, on=["domain", "event_type"], how="left")
              .join(impressions, on=["user_id", "item_id", "domain"], how="left")
              .group_by("event_id")
              .agg(in_window.fill_null(False).any().alias("_matched"), alive.fill_null(False).any().alias("_alive")))
    reasons = judged.filter(~pl.col("_alive")).select(
        "event_id", pl.when(pl.col("_matched")).then(pl.lit("expired")).otherwise(pl.lit("no_impression")).alias("reason"))
    out = labels.join(reasons, on="event_id", how="inner").with_columns(pl.lit(close_ms, pl.Int64).alias("close_ms"))
    return _to_arrow(out.select(ORPHAN_LABELS_SCHEMA.names), ORPHAN_LABELS_SCHEMA)


__all__ = ["FEATURE_VIEW_OUTPUTS", "item_shard_vectorized", "label_latencies_vectorized", "not_held",
           "user_shard_vectorized", "without_views"]
