"""Shards of the build: many users (or items) per Beam element, as Arrow tables.

The build's unit of work is a *shard*: every user (or item) whose key hashes to the same shard
number, with all their rows of each input as one Arrow table. Beam then pays its per-element
cost (coders, bundle bookkeeping, shuffle records) per shard, not per user, and the per-shard
step is free to run vectorised over all its users at once (:mod:`sequences.vectorized`).

This module holds the shard assignment and the *reference* shard steps, which loop over the
shard's entities and call the per-entity functions of :mod:`sequences.incremental`. They define
what a shard step computes; the vectorised steps are tested against them.

Tables (any row order, duplicates of events allowed):

- ``new`` / ``buffer``: events (:data:`EVENT_SCHEMA`);
- ``seq`` / ``dseq``: stored rows of ``sequences`` / ``sequences_by_domain``;
- ``evicted``: :data:`sequences.incremental.EVICTED_SCHEMA` rows (entity "item" for item
  shards, "user" and "user_category" for user shards);
- ``pending``: :data:`sequences.examples.PENDING_SCHEMA` rows;
- ``dense``: :data:`DENSE_SCHEMA` rows, the item counters of this build's new impressions.
"""

from __future__ import annotations

import os
import uuid
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from features.definitions import ITEM_FEATURES, USER_CATEGORY_FEATURES, USER_FEATURES
from ingest.schema import EVENT_ARROW_SCHEMA
from sequences.config import BuildConfig
from sequences.examples import EXAMPLES_SCHEMA, ITEM_DENSE, PENDING_SCHEMA, examples_schema, pending_schema
from sequences.incremental import EVICTED_SCHEMA, build_item, build_user
from sequences.publish import ORPHAN_LABELS_SCHEMA
from sequences.schema import HISTORY_SCHEMA, SEQUENCES_BY_DOMAIN_SCHEMA, SEQUENCES_SCHEMA

EVENT_SCHEMA = pa.schema([*EVENT_ARROW_SCHEMA, pa.field("created_ts_ms", pa.int64(), nullable=False)])
"""Event rows the build reads: the ingest event fields plus the Kafka append time (ms since epoch UTC)."""

DENSE_SCHEMA = pa.schema(
    [pa.field("user_id", pa.string(), nullable=False), pa.field("example_id", pa.string(), nullable=False),
     *[pa.field(name, pa.float64(), nullable=False) for name in ITEM_DENSE]]
)
"""Item counters of one new impression, keyed for the join with its user."""

HISTORY_EVENT_SCHEMA = pa.schema([f for f in HISTORY_SCHEMA if f.name not in ("user_bucket", "build")])
"""A user shard's ``history`` output: its events first seen in this build (the pipeline adds the
build number and the user's bucket, :data:`sequences.schema.HISTORY_SCHEMA`)."""

USER_INPUTS: dict[str, pa.Schema] = {
    "new": EVENT_SCHEMA, "buffer": EVENT_SCHEMA, "seq": SEQUENCES_SCHEMA, "dseq": SEQUENCES_BY_DOMAIN_SCHEMA,
    "evicted": EVICTED_SCHEMA, "pending": PENDING_SCHEMA, "dense": DENSE_SCHEMA,
}
"""Input tables of a user shard and their schemas."""

ITEM_INPUTS: dict[str, pa.Schema] = {"new": EVENT_SCHEMA, "buffer": EVENT_SCHEMA, "evicted": EVICTED_SCHEMA}
"""Input tables of an item shard and their schemas."""

USER_OUTPUTS: dict[str, pa.Schema] = {
    "sequences": SEQUENCES_SCHEMA, "sequences_by_domain": SEQUENCES_BY_DOMAIN_SCHEMA,
    "buffer": EVENT_SCHEMA, "evicted": EVICTED_SCHEMA, "pending": PENDING_SCHEMA, "examples": EXAMPLES_SCHEMA,
    "orphan_labels": ORPHAN_LABELS_SCHEMA, "history": HISTORY_EVENT_SCHEMA, USER_FEATURES.name: USER_FEATURES.schema, USER_CATEGORY_FEATURES.name: USER_CATEGORY_FEATURES.schema,
}
"""Output tables of a user shard."""

ITEM_OUTPUTS: dict[str, pa.Schema] = {"dense": DENSE_SCHEMA, "evicted": EVICTED_SCHEMA,
                                      ITEM_FEATURES.name: ITEM_FEATURES.schema}
"""Output tables of an item shard."""

_SHARD_SEED = 0


def user_inputs(config: BuildConfig) -> dict[str, pa.Schema]:
    """:data:`USER_INPUTS` with the pending schema of ``config.examples_layout``."""
    return {**USER_INPUTS, "pending": pending_schema(config)}


def user_outputs(config: BuildConfig) -> dict[str, pa.Schema]:
    """:data:`USER_OUTPUTS` with the pending and examples schemas of ``config.examples_layout``."""
    return {**USER_OUTPUTS, "pending": pending_schema(config), "examples": examples_schema(config)}


def shard_of(keys: pa.Array | pa.ChunkedArray, shards: int) -> np.ndarray:
    """Shard number in ``[0, shards)`` of each key: (n,) int64.

    Uses polars' string hash with a fixed seed, so every process of one pipeline (any runner
    worker) agrees; polars documents the hash as stable within one polars version, which is all a
    build needs (the user and item passes of one pipeline run with the same code).

    Raises:
        ValueError: ``shards`` < 1.
    """
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    series = pl.Series(values=keys if isinstance(keys, pa.Array) else keys.combine_chunks(), dtype=pl.String)
    return (series.hash(seed=_SHARD_SEED) % shards).cast(pl.Int64).to_numpy()


def split_by_shard(table: pa.Table, key: str, shards: int) -> list[tuple[int, pa.Table]]:
    """``[(shard, rows of that shard)]`` for the shards that have rows, shard-ascending."""
    return split_by_shard_with_order(table, key, shards)[0]


def split_by_shard_with_order(table: pa.Table, key: str, shards: int) -> tuple[list[tuple[int, pa.Table]], np.ndarray]:
    """:func:`split_by_shard` and ``order`` ((N,) int64): row ``j`` of the pieces concatenated is row ``order[j]``
    of ``table`` (each shard's rows keep their order in ``table``), so ``table`` can be put back from the pieces."""
    if table.num_rows == 0:
        return [], np.zeros(0, dtype=np.int64)
    ids = shard_of(table.column(key), shards)
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    bounds = np.flatnonzero(np.diff(sorted_ids)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [ids.size]])
    taken = table.take(pa.array(order))
    return [(int(sorted_ids[s]), taken.slice(s, e - s)) for s, e in zip(starts, ends, strict=True)], order


def gather_inputs(pieces: list[tuple[str, pa.Table]], schemas: Mapping[str, pa.Schema]) -> dict[str, pa.Table]:
    """One table per input name (pieces concatenated; an absent input is an empty table of its schema).

    Raises:
        ValueError: a piece names an input not in ``schemas``.
    """
    parts: dict[str, list[pa.Table]] = defaultdict(list)
    for name, table in pieces:
        if name not in schemas:
            raise ValueError(f"unknown shard input {name!r}; expected one of {sorted(schemas)}")
        parts[name].append(table.select(schemas[name].names).cast(schemas[name]))
    return {name: pa.concat_tables(parts[name]) if parts[name] else schema.empty_table()
            for name, schema in schemas.items()}


def spill_piece(name: str, table: pa.Table, directory: str | None) -> tuple[str, pa.Table | str]:
    """A shard input piece as it travels through the shuffle: ``(name, table)`` inline, or, with a
    ``directory``, ``(name, path)`` of an Arrow IPC file holding the table.

    Spilling keeps the shuffle's records small (a path instead of megabytes of pickled columns);
    the directory must be visible to every worker (a local one for DirectRunner). File names are
    random, so a retried bundle never overwrites a piece another attempt's consumer reads; files
    of failed attempts are never referenced and go with the directory.
    """
    if directory is None:
        return name, table
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name}-{uuid.uuid4().hex}.arrow")
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return name, path


def load_piece(piece: tuple[str, pa.Table | str]) -> tuple[str, pa.Table]:
    """Inverse of :func:`spill_piece`: ``(name, table)`` (an IPC file is memory-mapped, not copied)."""
    name, value = piece
    if isinstance(value, pa.Table):
        return name, value
    return name, pa.ipc.open_file(pa.memory_map(value)).read_all()


def _grouped_rows(table: pa.Table, key: str) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in table.to_pylist():
        groups[row[key]].append(row)
    return groups


def _tables(rows: Mapping[str, list], schemas: Mapping[str, pa.Schema]) -> dict[str, pa.Table]:
    out = {}
    for name, schema in schemas.items():
        parts = rows.get(name, [])
        if parts and isinstance(parts[0], pa.Table):
            out[name] = pa.concat_tables([p.select(schema.names).cast(schema) for p in parts])
        else:
            out[name] = pa.Table.from_pylist(parts, schema=schema)
    return out


def item_shard_reference(tables: Mapping[str, pa.Table], config: BuildConfig, watermark_ms: int) -> dict[str, pa.Table]:
    """The item step of one shard by looping :func:`sequences.incremental.build_item` over its items.

    Args:
        tables: :data:`ITEM_INPUTS` tables of the shard's items.
        watermark_ms: newest event time after this batch (ms since epoch UTC).

    Returns:
        :data:`ITEM_OUTPUTS` tables (``dense``: one row per new impression of the shard's items).
    """
    new = _grouped_rows(tables["new"], "item_id")
    buffer = _grouped_rows(tables["buffer"], "item_id")
    evicted = _grouped_rows(tables["evicted"], "key")
    rows: dict[str, list] = defaultdict(list)
    for item in sorted(set(new) | set(buffer) | set(evicted)):
        out = build_item(item, buffer=buffer.get(item, []), new=new.get(item, []), evicted=evicted.get(item, []),
                         config=config, watermark_ms=watermark_ms)
        rows["dense"] += [{"user_id": user, "example_id": example_id, **values}
                          for user, example_id, values in out["dense"]]
        rows["evicted"] += out["evicted"]
        rows[ITEM_FEATURES.name] += out["item_features"]
    return _tables(rows, ITEM_OUTPUTS)


def user_shard_reference(
    tables: Mapping[str, pa.Table],
    config: BuildConfig,
    *,
    watermark_ms: int,
    old_close_ms: int | None,
    close_ms: int,
) -> dict[str, pa.Table]:
    """The user step of one shard by looping :func:`sequences.incremental.build_user` over its users.

    Args:
        tables: :data:`USER_INPUTS` tables of the shard's users.
        watermark_ms, old_close_ms, close_ms: as :func:`sequences.incremental.build_user`.

    Returns:
        :data:`USER_OUTPUTS` tables.

    Raises:
        ValueError: as :func:`sequences.incremental.build_user`.
    """
    groups = {name: _grouped_rows(tables[name], "key" if name == "evicted" else "user_id")
              for name in ("new", "buffer", "seq", "dseq", "evicted")}
    pending_ids = tables["pending"].column("user_id").to_pylist()
    pending_rows = defaultdict(list)
    for i, user in enumerate(pending_ids):
        pending_rows[user].append(i)
    dense: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    for row in tables["dense"].to_pylist():
        dense[row.pop("user_id")][row.pop("example_id")] = row
    users = set(pending_rows).union(*(set(g) for g in groups.values()))
    rows: dict[str, list] = defaultdict(list)
    for user in sorted(users):
        seq = groups["seq"].get(user, [])
        pending = (tables["pending"].take(pa.array(pending_rows[user], pa.int64())) if user in pending_rows
                   else pending_schema(config).empty_table())
        out = build_user(
            user, stored_seq=seq[0] if seq else None, stored_domain_seqs=groups["dseq"].get(user, []),
            buffer=groups["buffer"].get(user, []), new=groups["new"].get(user, []),
            evicted=groups["evicted"].get(user, []), pending=pending, item_dense=dense.get(user, {}),
            config=config, watermark_ms=watermark_ms, old_close_ms=old_close_ms, close_ms=close_ms)
        rows["sequences"].append(out["sequence"])
        for name, key in (("sequences_by_domain", "domain_sequences"), ("buffer", "buffer"), ("evicted", "evicted"),
                          (USER_FEATURES.name, "user_features"),
                          (USER_CATEGORY_FEATURES.name, "user_category_features")):
            rows[name] += out[key]
        rows["history"] += out["fresh"]
        for name in ("examples", "pending", "orphan_labels"):
            if out[name].num_rows:
                rows[name].append(out[name])
    return _tables(rows, user_outputs(config))


__all__ = [
    "DENSE_SCHEMA", "EVENT_SCHEMA", "HISTORY_EVENT_SCHEMA", "ITEM_INPUTS", "ITEM_OUTPUTS", "USER_INPUTS", "USER_OUTPUTS", "gather_inputs",
    "item_shard_reference", "load_piece", "shard_of", "spill_piece", "split_by_shard", "user_inputs", "user_outputs",
    "user_shard_reference",
]
