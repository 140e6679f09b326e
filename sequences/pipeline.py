"""The incremental build: new ``events`` rows + build state -> ``examples`` and ``history`` (appended),
``sequences``, ``sequences_by_domain``, ``features/{user,item,user_category}`` and the evicted counts
(overwritten), and the *row state*, buffered events and pending impressions (rows appended; the files of
rows that left are removed or rewritten without them in the same commit, :func:`expire_rows`; a pass reads
only the pending rows it publishes or corrects, :func:`due_pending`), so a pass costs what its new events
and due rows cost, not what the pending state holds.
``history`` gets each event the build sees for the first time, once; with ``build.examples_layout =
"pointer"`` the examples (and the pending state) carry no sequence lists and readers rebuild them from it
(:mod:`sequences.materialize`).

    events@v_old..v  --ReadNewEvents--+                              +--> examples (append, once per impression)
    state@k (buffer, sequences,       +--GroupByKey(user shard)--BuildUserShard--> sequences, sequences_by_domain,
      evicted counts, pending)        |        ^ item dense                   features/user, features/user_category,
                                      +--GroupByKey(item shard)--BuildItemShard   buffer, evicted, pending
                                                                      +--> features/item, evicted

Elements are *shards* (:mod:`sequences.shards`): all users (items) hashing to one shard, as Arrow
tables, spilled to IPC files so the shuffles carry paths (``build.shards = "auto"``: as few as keep a
shard's working set within ``build.memory_budget_bytes``, :func:`shards_for`). The steps run in the
building process (:func:`_run_in_process`, parts written by threads beside the computation) or, with
Beam flags or ``build.engine = "beam"``, as the Beam pipeline drawn above (:class:`BuildIncrement`,
its tested twin: the same parts, table for table); each shard is built vectorised over its
users (:mod:`sequences.vectorized`), which equals looping the per-entity functions of
:mod:`sequences.incremental` (the reference, ``build.shard_step = "reference"``). Workers write
the outputs as data files straight into the tables, uncommitted, and list them in manifests; the
driver commits each table's files once (:func:`gemline.tables.commit_files`). New events are the rows of
the Parquet files the events table gained since the last built version (the table is append-only;
if a version in between rewrote files, e.g. a compaction, the rows are found by Kafka offset
instead). Nothing older than the state is reread.

Publishing: an impression becomes an example once its attribution windows (per domain,
``BuildConfig.window_ms``) have closed by the *close point*: the events watermark (newest event
time, ms since epoch UTC), or later when the caller closes windows explicitly (``final=True`` or
``close_windows_at``), as the demo does at the end of a bounded replay so the last day is
published. Examples are appended exactly once and never rewritten; a backfill of old events
changes no published example.

Restartable: every table's commit carries the app transaction ("build", k) and the examples
commit goes last, so it marks a complete build; a crashed build k reruns from the state tables as
they were at build k - 1 (time travel), and the commits already made are skipped (a row-state commit's
removals are found in the table's latest snapshot, which a crashed build left as build k - 1 did).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import apache_beam as beam
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from apache_beam.options.pipeline_options import PipelineOptions
from tqdm import tqdm

from features.definitions import ITEM_FEATURES, USER_CATEGORY_FEATURES, USER_FEATURES
from gemline.beam_runner import local_runner_args
from gemline.errors import BadConfigError, MissingInputError
from gemline.gate import require_allowed, require_version
from gemline.hygiene import HygieneConfig, conform, tidy
from gemline.lake import (
    Lake,
    StorageOptions,
    commit_metadata,
    committed_version,
    is_remote,
    lake_fs,
    open_table,
    read_table,
)
from gemline.locks import holding
from gemline.metrics import table_rows
from gemline.tables import Table, commit_files, write_files
from sequences.config import BuildConfig
from sequences.examples import EXAMPLES_SCHEMA, PENDING_SCHEMA, examples_schema, pending_schema
from sequences.incremental import EVICTED_SCHEMA
from sequences.length_counts import METADATA_KEY as LENGTH_COUNTS_KEY
from sequences.length_counts import add_counts, count_lengths, percentile
from sequences.materialize import history_rows
from sequences.publish import ORPHAN_LABELS_SCHEMA, TASKS, deadlines, needs_labels, plan_publication
from sequences.schema import HISTORY_SCHEMA, SEQUENCES_BY_DOMAIN_SCHEMA, SEQUENCES_SCHEMA
from sequences.shards import (
    EVENT_SCHEMA,
    ITEM_INPUTS,
    USER_OUTPUTS,
    gather_inputs,
    item_shard_reference,
    load_piece,
    spill_piece,
    split_by_shard,
    user_inputs,
    user_shard_reference,
)
from sequences.state_cache import BuildStateCache, HeldBuffer, PendingKeys
from sequences.vectorized import (
    FEATURE_VIEW_OUTPUTS,
    item_shard_vectorized,
    label_latencies_vectorized,
    not_held,
    user_shard_vectorized,
    without_views,
)

log = logging.getLogger(__name__)

APP_ID = "build"

# Columns the build needs; the Kafka bookkeeping columns stay out of the pipeline.
_EVENT_COLUMNS = list(EVENT_SCHEMA.names)


_OUTPUTS: dict[str, pa.Schema] = {
    Table.SEQUENCES: SEQUENCES_SCHEMA,
    Table.SEQUENCES_BY_DOMAIN: SEQUENCES_BY_DOMAIN_SCHEMA,
    USER_FEATURES.name: USER_FEATURES.schema,
    ITEM_FEATURES.name: ITEM_FEATURES.schema,
    USER_CATEGORY_FEATURES.name: USER_CATEGORY_FEATURES.schema,
    Table.BUILD_BUFFER: EVENT_SCHEMA,
    Table.BUILD_EVICTED: EVICTED_SCHEMA,
    Table.BUILD_PENDING: PENDING_SCHEMA,
    Table.ORPHAN_LABELS: ORPHAN_LABELS_SCHEMA,
    Table.HISTORY: HISTORY_SCHEMA,  # before examples: a committed example's history is there
    Table.EXAMPLES: EXAMPLES_SCHEMA,  # last: its commit marks the build complete
}
"""Every table the build writes and its schema, in commit order (partition columns and write mode:
the table's spec, :mod:`gemline.tables`); :func:`output_schemas` gives the layout's examples schema."""


def layout_metadata(config: BuildConfig) -> dict[str, Any]:
    """What a reader of pointer-layout examples needs from the build, stored in every build commit:
    ``examples_layout``, ``max_seq_len`` and ``same_domain_seq_len``
    (:func:`sequences.materialize.materialize_examples`)."""
    return {"examples_layout": config.examples_layout, "max_seq_len": config.max_seq_len,
            "same_domain_seq_len": config.same_domain_seq_len}


def _same_as(built: dict[str, Any]) -> str:
    """The ``--set`` flags that give a config the :func:`layout_metadata` ``built`` (a lake's)."""
    flags = [f"--set build.examples_layout={built['examples_layout']}"]
    if built.get("max_seq_len") is not None:  # stored since the pointer layout came
        flags.append(f"--set build.max_seq_len={built['max_seq_len']}")
        same = built.get("same_domain_seq_len")
        flags.append(f"--set build.max_same_domain_seq_len={'none' if same in (None, built['max_seq_len']) else same}")
    return " ".join(flags)


def output_schemas(config: BuildConfig) -> dict[str, pa.Schema]:
    """:data:`_OUTPUTS` with the ``examples`` and pending schemas of ``config.examples_layout`` (the
    pointer layout drops the list columns, :func:`sequences.schema.pointer_schema`)."""
    if config.examples_layout == "fat":
        return dict(_OUTPUTS)
    return {**_OUTPUTS, Table.EXAMPLES: examples_schema(config), Table.BUILD_PENDING: pending_schema(config)}


_ROW_STATE: dict[str, tuple[Table, str]] = {"buffer": (Table.BUILD_BUFFER, "event_id"),
                                            "pending": (Table.BUILD_PENDING, "example_id")}
"""The state a build keeps as rows that never change while they stay (an event in the buffer, a pending
impression): shard output name -> (table, row key). A build appends the rows it adds and removes the files
of rows that left (:func:`expire_rows`), instead of rewriting the whole state."""


def _user_shard_step(keyed, config: BuildConfig, watermark_ms: int, old_close_ms: int | None, close_ms: int,
                     build: int, feature_views: bool = True):
    shard, pieces = keyed
    tables = gather_inputs([load_piece(p) for p in pieces], user_inputs(config))
    kwargs: dict[str, Any] = {"watermark_ms": watermark_ms, "old_close_ms": old_close_ms, "close_ms": close_ms}
    vectorized = config.shard_step == "vectorized"
    out = (user_shard_vectorized(tables, config, **kwargs, new_buffer_rows_only=True, feature_views=feature_views)
           if vectorized else without_views(user_shard_reference(tables, config, **kwargs), feature_views))
    for name, (_, key) in _ROW_STATE.items():
        # Rows the state already holds stay where they are; only the ones first kept now are written.
        if name == "buffer" and vectorized:
            continue  # the vectorised step gave only those
        out[name] = not_held(out[name], tables[name], key)
    out["history"] = history_rows(out["history"], build)
    for name, table in out.items():
        if table.num_rows:
            yield _USER_OUTPUT_TABLES[name], f"user-{shard:05d}", table


def _item_shard_step(keyed, config: BuildConfig, watermark_ms: int, user_shards: int, spill: str | None,
                     feature_views: bool = True):
    shard, pieces = keyed
    inputs = gather_inputs([load_piece(p) for p in pieces], ITEM_INPUTS)
    out = (item_shard_vectorized(inputs, config, watermark_ms=watermark_ms, feature_views=feature_views)
           if config.shard_step == "vectorized"
           else without_views(item_shard_reference(inputs, config, watermark_ms), feature_views))
    for user_shard, table in split_by_shard(out["dense"], "user_id", user_shards):
        yield beam.pvalue.TaggedOutput("dense", (user_shard, spill_piece("dense", table, spill)))
    for name in ("evicted", ITEM_FEATURES.name):
        if out[name].num_rows:
            yield _ITEM_OUTPUT_TABLES[name], f"item-{shard:05d}", out[name]


def _shard_pieces(table: pa.Table, name: str, key: str, shards: int, spill: str | None, keep: Any = None):
    """``(shard, piece)`` of one input table (:func:`sequences.shards.spill_piece`); ``keep``:
    optional row filter (table -> mask)."""
    if keep is not None:
        table = table.filter(keep(table))
    for shard, part in split_by_shard(table, key, shards):
        yield shard, spill_piece(name, part, spill)


def _split_pieces(table: pa.Table, name: str, key: str, shards: int, spill: str | None, keep: Any = None) -> list:
    """:func:`_shard_pieces` as a list (a task of the in-process build's thread pool)."""
    return list(_shard_pieces(table, name, key, shards, spill, keep))


def _is_item(table: pa.Table):
    return pc.equal(table.column("entity"), "item")


def _is_not_item(table: pa.Table):
    return pc.invert(_is_item(table))


_ROUTES: tuple[tuple[str, str, str, str, Any], ...] = (
    ("NewByItem", "new", "item", "item_id", None),
    ("BufferByItem", "buffer", "item", "item_id", None),
    ("EvictedByItem", "evicted", "item", "key", _is_item),
    ("NewByUser", "new", "user", "user_id", None),
    ("BufferByUser", "buffer", "user", "user_id", None),
    ("SeqByUser", "seq", "user", "user_id", None),
    ("DomainSeqByUser", "dseq", "user", "user_id", None),
    ("EvictedByUser", "evicted", "user", "key", _is_not_item),
    ("PendingByUser", "pending", "user", "user_id", None),
)
"""Where each build input goes, the same in both engines: (Beam label, input, "item" or "user" shards,
key column, row filter or None)."""


_USER_OUTPUT_TABLES = {"buffer": Table.BUILD_BUFFER, "evicted": Table.BUILD_EVICTED, "pending": Table.BUILD_PENDING,
                       "orphan_labels": Table.ORPHAN_LABELS}
# The other shard outputs are named after their tables ("sequences", "features/user", "examples", ...).
_USER_OUTPUT_TABLES.update({name: Table(name) for name in USER_OUTPUTS if name not in _USER_OUTPUT_TABLES})
_ITEM_OUTPUT_TABLES = {"evicted": Table.BUILD_EVICTED, ITEM_FEATURES.name: ITEM_FEATURES.name}


class BuildIncrement(beam.PTransform):
    """One build step on Beam: ``{"new", "buffer", "seq", "dseq", "evicted", "pending"}`` PCollections
    of ``pyarrow.Table`` s (any chunking; schemas of :data:`sequences.shards.USER_INPUTS`) ->
    ``{"item": parts, "user": parts}``, PCollections of ``(table name, part name, pyarrow.Table)``
    covering every table of :data:`_OUTPUTS`; a part name is unique per table within one build
    ("user-00003", "item-00001").

    Users and items are hashed into ``config.shards`` shards (:mod:`sequences.shards`); each shard
    is one element through two shuffles: a GroupByKey by item shard (item counters of the new
    impressions, item features) and one by user shard, which also receives the item counters
    keyed by the impression's user shard (so the heavy example rows are never shuffled). The
    per-shard steps are vectorised over all the shard's users (:mod:`sequences.vectorized`).
    Few, large elements keep Beam's per-element and per-transform costs small.

    Args:
        config: windows, sequence lengths, CTR prior, state lookback, shards (a number: :func:`run_build`
            resolves ``"auto"``; ``config.shard_count`` raises ValueError on it).
        watermark_ms: newest event time after this batch (ms since epoch UTC).
        old_close_ms / close_ms: windows closed up to these times before / after this build.
        spill_dir: when given, shard inputs travel through the shuffles as Arrow IPC files in this
            directory (paths in the records; see :func:`sequences.shards.spill_piece`), else inline.
        build: the build's number, stored with the ``history`` rows it appends.
        feature_views: compute the feature views (``features/*`` parts); False: none of their parts are made
            (a pass that does not materialise them, ``build.features_interval_ms``).
    """

    def __init__(self, config: BuildConfig, *, watermark_ms: int, old_close_ms: int | None, close_ms: int,
                 spill_dir: str | None = None, build: int = 0, feature_views: bool = True) -> None:
        super().__init__()
        self._feature_views = feature_views
        self._build = build
        self._spill_dir = spill_dir
        self._config = config
        self._watermark_ms = watermark_ms
        self._old_close_ms = old_close_ms
        self._close_ms = close_ms

    def expand(self, inputs: dict[str, beam.PCollection]) -> dict[str, beam.PCollection]:
        shards, spill = self._config.shard_count, self._spill_dir
        pieces: dict[str, list[beam.PCollection]] = {"item": [], "user": []}
        for label, source, kind, key, keep in _ROUTES:
            pieces[kind].append(inputs[source] | label >> beam.FlatMap(_shard_pieces, source, key, shards, spill, keep))
        item_out = (
            tuple(pieces["item"])
            | "ItemPieces" >> beam.Flatten()
            | "GroupByItemShard" >> beam.GroupByKey()
            | "BuildItemShard" >> beam.FlatMap(_item_shard_step, self._config, self._watermark_ms, shards, spill,
                                               self._feature_views)
            .with_outputs("dense", main="parts")
        )
        user_parts = (
            (*pieces["user"], item_out["dense"])
            | "UserPieces" >> beam.Flatten()
            | "GroupByUserShard" >> beam.GroupByKey()
            | "BuildUserShard" >> beam.FlatMap(
                _user_shard_step, self._config, self._watermark_ms, self._old_close_ms, self._close_ms, self._build,
                self._feature_views)
        )
        # Two outputs, not one Flatten: a Flatten of two stages' outputs would materialise (pickle)
        # every output table between stages, while a consumer of each is fused with its producer.
        return {"item": item_out["parts"], "user": user_parts}


_SOURCE_LABELS = {"new": "ReadNewEvents", "buffer": "ReadBuffer", "seq": "ReadSequences",
                  "dseq": "ReadDomainSequences", "evicted": "ReadEvicted", "pending": "ReadPending"}


def _run_on_beam(sources: dict[str, tuple], steps: dict[str, Any], write: tuple, beam_args: list[str]) -> None:
    """The build's computation and part writes as a Beam pipeline (:class:`BuildIncrement`): each of
    ``sources`` (specs of :func:`_emit_table`) read by one step; ``steps``: the transform's arguments;
    ``write``: the trailing arguments of :func:`_write_part`."""
    with beam.Pipeline(options=PipelineOptions(local_runner_args(beam_args))) as pipeline:
        start = pipeline | "Start" >> beam.Create([None])
        inputs = {name: start | _SOURCE_LABELS[name] >> beam.FlatMap(_emit_table, spec)
                  for name, spec in sources.items()}
        parts = inputs | "BuildIncrement" >> BuildIncrement(**steps)
        parts["item"] | "WriteItemParts" >> beam.Map(_write_part, *write)
        parts["user"] | "WriteUserParts" >> beam.Map(_write_part, *write)


_WRITERS = 2
"""Threads writing parts while :func:`_run_in_process` computes the next shards (Parquet encoding and
compression release the GIL, so the writes and the computation share the cores)."""


def _run_in_process(sources: dict[str, tuple], steps: dict[str, Any], write: tuple,
                    held: HeldBuffer | None = None, pending_keys: PendingKeys | None = None) -> None:
    """:func:`_run_on_beam`'s work in this process, without Beam: the same functions (:func:`_emit_table`,
    :func:`_shard_pieces` along :data:`_ROUTES`, :func:`_item_shard_step`, :func:`_user_shard_step`,
    :func:`_write_part`) in the order the two shuffles impose (every item shard before any user shard),
    so the same parts are written, without Beam's graph construction, DoFn inspection and per-element
    bookkeeping: CPU every build pays whatever its size (0.5-1.5 s per build in issue 15's profiles).

    ``build.parallelism`` (P) shard steps are computed at once, in threads (:func:`_run_shards`); a shard's
    parts are written by :data:`_WRITERS` threads while the next shards are computed. A failed step or write
    is raised once the work under way ends (queued work is cancelled): nothing is committed, and a rerun
    rewrites the same file names.

    ``held``: the buffer of ``sources["buffer"]``'s snapshot already split into this build's shards, and its
    labels (:class:`sequences.state_cache.BuildStateCache`): its pieces go to the shards as they are (in
    memory, not spilled) and the pending state's labels are taken from it, instead of reading the buffer.
    ``pending_keys``: the pending state's keys held across passes (:class:`sequences.state_cache.PendingKeys`).

    Raises:
        whatever a step or a write raises.
    """
    config: BuildConfig = steps["config"]
    shards, spill = config.shard_count, steps["spill_dir"]
    pieces: dict[str, dict[int, list]] = {"item": defaultdict(list), "user": defaultdict(list)}

    def item_step(keyed: tuple) -> list:
        return list(_item_shard_step(keyed, config, steps["watermark_ms"], shards, spill, steps["feature_views"]))

    def user_step(keyed: tuple) -> list:
        return list(_user_shard_step(keyed, config, steps["watermark_ms"], steps["old_close_ms"], steps["close_ms"],
                                     steps["build"], steps["feature_views"]))

    counters: dict[int, list[tuple[int, Any]]] = {}

    def route(shard: int, outputs: list) -> list[tuple[str, str, pa.Table]]:
        parts = []
        for out in outputs:
            if isinstance(out, beam.pvalue.TaggedOutput):  # an item shard's counters for a user shard
                counters.setdefault(shard, []).append(out.value)
            else:
                parts.append(out)
        return parts

    parallel = min(config.parallel_shards, shards)
    with ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="build-shard") as compute, \
            ThreadPoolExecutor(max_workers=_WRITERS, thread_name_prefix="build-write") as writers:
        try:
            for name, spec in sources.items():
                routes = [r for r in _ROUTES if r[1] == name]
                if name == "buffer" and held is not None:
                    for _, _, kind, key, _ in routes:  # the buffer's routes keep every row
                        for shard, table in held.pieces[key].items():
                            pieces[kind][shard].append(spill_piece(name, table, None))
                    continue
                labels = held.labels if name == "pending" and held is not None else None
                for table in _emit_table(None, spec, buffer_labels=labels, pending_keys=pending_keys):
                    # A table's routes (by item and by user) are split at once; each table is split before
                    # the next is read, so one table (a chunk of the new events) is held at a time.
                    splits = [compute.submit(_split_pieces, table, name, key, shards, spill, keep)
                              for _, _, _, key, keep in routes]
                    for (_, _, kind, _, _), split in zip(routes, splits, strict=True):
                        for shard, piece in split.result():
                            pieces[kind][shard].append(piece)
            written: list[list[Future]] = []
            for kind, step in (("item", item_step), ("user", user_step)):
                keyed = [(shard, pieces[kind].pop(shard)) for shard in sorted(pieces[kind])]
                _run_shards(keyed, step, route, compute, writers, write, written, parallel)
                # Every item shard's counters reach the user shards before a user shard starts, in item shard
                # order whichever finished first, so a user shard's inputs are the same pieces in the same order.
                for shard in sorted(counters):
                    for user_shard, piece in counters.pop(shard):
                        pieces["user"][user_shard].append(piece)
            for futures in written:
                for future in futures:
                    future.result()
        except BaseException:
            for pool in (compute, writers):
                pool.shutdown(wait=True, cancel_futures=True)
            raise


def _run_shards(keyed: list[tuple[int, list]], step: Any, route: Any, compute: ThreadPoolExecutor,
                writers: ThreadPoolExecutor, write: tuple, written: list[list[Future]], parallel: int) -> None:
    """Compute ``step`` of each ``(shard, pieces)`` of ``keyed`` in ``compute``, ``parallel`` at a time, and
    hand each result as it comes to ``route(shard, result)`` (which keeps the item counters for the user
    shards and returns the parts) and its parts to ``writers`` (futures appended to ``written``, one list
    per shard): a shard finished early is written while the others are computed.

    At most ``parallel`` shards are computed and ``parallel`` shards' parts written at once (a finished
    shard's parts go to the writers once the writes of the shard finished ``parallel`` places before it
    end; ``parallel`` >= 1), so the build
    holds about 2 x ``parallel`` shards' outputs: with ``parallel = 1`` a shard is written while the next
    one is computed."""
    running: dict[Future, int] = {}

    def finish_one() -> None:
        done = next(iter(wait(running, return_when=FIRST_COMPLETED).done))
        parts = route(running.pop(done), done.result())
        while len(written) >= parallel:
            for future in written.pop(0):
                future.result()
        written.append([writers.submit(_write_part, part, *write) for part in parts])

    for shard, shard_pieces in keyed:
        if len(running) >= parallel:
            finish_one()
        running[compute.submit(step, (shard, shard_pieces))] = shard
    while running:
        finish_one()


def _write_part(part: tuple[str, str, pa.Table], lake: str, opts: StorageOptions | None, manifests: str,
                build: int, done: frozenset[str], schemas: dict[str, pa.Schema]) -> None:
    """Write one part's rows as (uncommitted) data files of its table and list them in
    ``<manifests>/<table>/<part>.json``. File names are fixed by (build, part), so a retried bundle
    replaces its files rather than adding copies; tables this build already committed (before a
    crash) are left alone."""
    name, part_name, table = part
    if name in done:
        return
    table = conform(table, schemas[name])
    files = _write_state_aware(lake, name, table, f"build{build:06d}-{part_name}", opts)
    if name == Table.EXAMPLES:  # before the manifest: a listed part always has its counts
        _write_json(Path(manifests) / _LENGTH_COUNTS_DIR, part_name, count_lengths(table.column("seq_length").to_numpy()))
    _write_json(Path(manifests) / name, part_name, files)


_LENGTH_COUNTS_DIR = "_seq_length_counts"
"""Folder of the staging manifests holding each examples part's ``seq_length`` counts (:mod:`sequences.length_counts`)."""


def _write_json(directory: Path, part_name: str, value: Any) -> None:
    """``<directory>/<part_name>.json`` written whole or not at all (a temp file renamed)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{part_name}.json.tmp"
    tmp.write_text(json.dumps(value))
    os.replace(tmp, directory / f"{part_name}.json")


PENDING_ROW_GROUP_ROWS = 256
"""Rows per Parquet row group of fat-layout pending files (a row carries its sequences: 256 rows are ~1 MB). The
pending state's files hold their rows in event-time order: a pass reads the few rows it publishes or corrects
(:func:`due_pending`) and decodes only the row groups whose time range holds one."""

POINTER_PENDING_ROW_GROUP_ROWS = 16_384
"""Rows per row group of pointer-layout pending files (no lists: ~65 bytes a row, so 16,384 rows are ~1 MB). At
256 rows a late pass of the 10-minute freshness run decoded 2,463 of 2,607 row groups (the cost is per group and
column, and corrections are scattered over the whole time range): 8.4 of its 19.2 CPU-s; the same rows in 64k-row
groups read their keys in 0.09 CPU-s instead of 1.09 and the due rows in 0.39 instead of 4.6."""


def pending_row_group_rows(schema: pa.Schema) -> int:
    """Rows per row group of pending-state files of ``schema``: :data:`PENDING_ROW_GROUP_ROWS` when its rows carry
    list columns (the fat layout), else :data:`POINTER_PENDING_ROW_GROUP_ROWS`; each is about 1 MB a group."""
    fat = any(pa.types.is_list(f.type) or pa.types.is_large_list(f.type) for f in schema)
    return PENDING_ROW_GROUP_ROWS if fat else POINTER_PENDING_ROW_GROUP_ROWS


def _write_state_aware(lake: str, name: str, table: pa.Table, file_name: str,
                       opts: StorageOptions | None) -> list[dict[str, Any]]:
    """:func:`gemline.tables.write_files`; the pending state's rows sorted by event time, in row groups of
    about 1 MB (:func:`pending_row_group_rows`)."""
    if name != Table.BUILD_PENDING:
        return write_files(lake, name, table, name=file_name, storage_options=opts)
    ordered = table.take(pc.sort_indices(table, sort_keys=[("event_time_ms", "ascending"), ("example_id", "ascending")]))
    return write_files(lake, name, ordered, name=file_name, storage_options=opts,
                       row_group_rows=pending_row_group_rows(table.schema))


def _manifest_files(directory: Path) -> list[dict[str, Any]]:
    return [entry for path in sorted(directory.glob("*.json")) for entry in json.loads(path.read_text())]


@dataclass(frozen=True)
class BuildResult:
    """What one :func:`run_build` did. Percentiles are of ``seq_length`` over all examples (events), from the counts
    the examples commit carries (:mod:`sequences.length_counts`)."""

    events_version: int
    examples_version: int | None
    num_examples: int
    num_sequences: int
    num_user_features: int
    num_item_features: int
    seq_length_p50: float | None
    seq_length_p99: float | None
    skipped: bool
    num_published: int = 0
    """Examples appended by this call."""
    num_pending: int = 0
    """Impressions waiting for their windows to close after this call."""
    watermark_ms: int | None = None
    """Newest event time built so far (ms since epoch UTC)."""
    close_ms: int | None = None
    """Attribution windows are closed up to here (ms since epoch UTC)."""


def _rows(lake: str, table: str, opts: StorageOptions | None = None) -> int:
    dt = open_table(lake, table, storage_options=opts)
    return 0 if dt is None else _log_rows(dt)


def _log_rows(dt: Any) -> int:
    """Rows of a Delta snapshot from its log's per-file record counts (no Parquet footer read; a build's
    tables hold hundreds of files), or counted from the files where a file has no count."""
    try:
        return table_rows(dt)
    except ValueError:  # a file written without statistics
        return dt.to_pyarrow_dataset().count_rows()


def length_counts(lake: str, meta: dict[str, Any], opts: StorageOptions | None = None) -> dict[str, int]:
    """``seq_length`` counts of every example in the latest ``examples`` snapshot, whose last build commit carried
    ``meta``: read from ``meta`` (O(distinct lengths)), or from the table itself when the commit has none (a lake
    built before the counts were kept; the next build stores them)."""
    if LENGTH_COUNTS_KEY in meta:
        return dict(meta[LENGTH_COUNTS_KEY])
    examples = open_table(lake, Table.EXAMPLES, storage_options=opts)
    if examples is None:
        return {}
    return count_lengths(examples.to_pyarrow_dataset().to_table(columns=["seq_length"]).column("seq_length").to_numpy())


def _result_from_lake(lake: str, events_version: int, *, skipped: bool, published: int = 0,
                      opts: StorageOptions | None = None) -> BuildResult:
    examples = open_table(lake, Table.EXAMPLES, storage_options=opts)
    meta = commit_metadata(lake, Table.EXAMPLES, APP_ID, storage_options=opts) or {}
    counts = length_counts(lake, meta, opts)
    return BuildResult(
        events_version=events_version,
        examples_version=None if examples is None else examples.version(),
        num_examples=_rows(lake, Table.EXAMPLES, opts),
        num_sequences=_rows(lake, Table.SEQUENCES, opts),
        num_user_features=_rows(lake, USER_FEATURES.name, opts),
        num_item_features=_rows(lake, ITEM_FEATURES.name, opts),
        seq_length_p50=percentile(counts, 50),
        seq_length_p99=percentile(counts, 99),
        skipped=skipped,
        num_published=published,
        num_pending=_rows(lake, Table.BUILD_PENDING, opts),
        watermark_ms=meta.get("watermark_ms"),
        close_ms=meta.get("close_ms"),
    )


def _check_events(names: list[str]) -> None:
    missing = [name for name in _EVENT_COLUMNS if name not in names]
    if missing:
        raise ValueError(
            f"events table lacks columns {missing}; expected ingest.schema.EVENTS_TABLE_SCHEMA (got {names})"
        )


def _version_at_build(lake: str, table: str, build: int | None, opts: StorageOptions | None = None) -> int | None:
    """Delta version of ``table`` as the build with number ``build`` left it (None: before any)."""
    if build is None:
        return None
    dt = open_table(lake, table, storage_options=opts)
    if dt is None:
        return None
    # The newest commits first (the build asks for the last build's, one of them): the whole history is one log
    # file per commit.
    for limit in (20, None):
        for entry in dt.history(limit=limit):
            raw = entry.get("gemline")
            meta = json.loads(raw) if raw else {}
            if meta.get("app_id") == APP_ID and meta.get("build") == build:
                return int(entry["version"])
    raise ValueError(f"{table}: no commit of build {build} in its history; was the table vacuumed past it?")


def new_event_rows(
    lake: str, old_version: int | None, version: int, columns: list[str] | None = None,
    *, storage_options: StorageOptions | None = None,
) -> pa.Table:
    """Rows the append-only ``events`` table gained from ``old_version`` (exclusive; None: from
    nothing) to ``version`` (inclusive), columns :data:`_EVENT_COLUMNS`.

    ``columns``: a subset of :data:`_EVENT_COLUMNS` (all when None). Reads only the Parquet files
    added in between (through :func:`gemline.lake.lake_fs` on an object-store lake, with
    ``storage_options``). When a version in between was not a plain
    append (a compaction rewrites files), falls back to Kafka coordinates: rows whose
    (topic, partition, offset) is past the old version's last offset per partition.
    """
    source = _new_events_source(lake, old_version, version, columns, storage_options)
    return source if isinstance(source, pa.Table) else source.to_table(columns=columns or list(_EVENT_COLUMNS))


def new_event_chunks(lake: str, old_version: int | None, version: int, *, chunk_rows: int,
                     storage_options: StorageOptions | None = None) -> Iterator[pa.Table]:
    """:func:`new_event_rows` (all columns) in tables of ``chunk_rows`` rows (the last one fewer), read
    one after the other, so a reader holds one chunk rather than the whole
    increment (the build's peak memory at a million users, issue 15). The Kafka-coordinates fallback
    reads its rows whole, then slices them."""
    source = _new_events_source(lake, old_version, version, None, storage_options)
    if isinstance(source, pa.Table):
        for start in range(0, source.num_rows, chunk_rows):
            yield source.slice(start, chunk_rows)
        return
    pending: list[pa.RecordBatch] = []
    rows = 0
    for batch in source.to_batches(columns=list(_EVENT_COLUMNS)):
        while batch.num_rows:
            take = min(batch.num_rows, chunk_rows - rows)
            pending.append(batch.slice(0, take))
            rows, batch = rows + take, batch.slice(take)
            if rows == chunk_rows:
                yield pa.Table.from_batches(pending)
                pending, rows = [], 0
    if rows:
        yield pa.Table.from_batches(pending)


def _new_events_source(lake: str, old_version: int | None, version: int, columns: list[str] | None,
                       opts: StorageOptions | None) -> ds.Dataset | pa.Table:
    """The rows of :func:`new_event_rows` as a dataset to scan (plain appends), or as a table (the
    Kafka-coordinates fallback, or no new file)."""
    columns = list(_EVENT_COLUMNS) if columns is None else columns
    schema = pa.schema([EVENT_SCHEMA.field(name) for name in columns])
    new = open_table(lake, Table.EVENTS, version, storage_options=opts)
    assert new is not None, "the events versions a build names exist"
    if old_version is None:
        return new.to_pyarrow_dataset()
    old = open_table(lake, Table.EVENTS, old_version, storage_options=opts)
    assert old is not None, "the events versions a build names exist"
    appends_only = all(
        entry.get("operation") in ("WRITE", "CREATE TABLE")
        and entry.get("operationParameters", {}).get("mode", "Append") == "Append"
        for entry in new.history(version - old_version)
    )
    if appends_only:
        files = sorted(set(new.file_uris()) - set(old.file_uris()))
        if not files:
            return schema.empty_table()
        if is_remote(lake):
            fs, _ = lake_fs(lake, opts)
            return ds.dataset([f.split("://", 1)[1] for f in files], format="parquet", filesystem=fs)
        return ds.dataset(files, format="parquet")
    coords = ["kafka_topic", "kafka_partition", "kafka_offset"]
    seen = old.to_pyarrow_dataset().to_table(columns=coords).group_by(coords[:2]).aggregate([("kafka_offset", "max")])
    rows = new.to_pyarrow_dataset().to_table(columns=[*columns, *[c for c in coords if c not in columns]])
    joined = rows.join(seen, coords[:2], join_type="left outer")
    last = pc.fill_null(joined.column("kafka_offset_max"), -1)
    return joined.filter(pc.greater(joined.column("kafka_offset"), last)).select(columns)


_PENDING_KEYS = ["example_id", "user_id", "item_id", "domain", "event_time_ms"]

PENDING_ROWS_SHARE = 4
"""A ``build --follow`` process holds whole pending rows (:class:`sequences.state_cache.PendingKeys`) up to
``build.memory_budget_bytes // 4`` bytes, beside its buffer copy (up to half the budget)."""


def due_pending(lake: str, version: int | None, labels: pa.Table, config: BuildConfig, old_close_ms: int | None,
                close_ms: int, *, storage_options: StorageOptions | None = None,
                row_groups: Literal["due", "all"] = "due", key_cache: PendingKeys | None = None) -> pa.Table:
    """The rows of ``_build_state/pending`` at Delta ``version`` that a build publishes or corrects: a first
    publication due in (``old_close_ms``, ``close_ms``], and in fnw and defer a correction due there (a late
    positive at its label's time, in defer a real negative when a window closes), by the rules of
    :func:`sequences.publish.plan_publication`. Every other pending row would come out of the build
    unchanged (or leave it unread: :func:`expire_rows`), so it is not read.

    Decides from five narrow columns of every pending row (example id, user, item, domain, event time)
    and ``labels``, then reads whole rows only from the row groups that hold a chosen one
    (:func:`_row_groups_holding`).

    Args:
        version: the pending table's version as the previous build left it (None: no table yet).
        labels: every click and conversion the build sees for these rows (the buffer's and the new
            events'; other event types are ignored): ``user_id``, ``item_id``, ``domain``, ``event_type``,
            ``event_time_ms``.
        old_close_ms / close_ms: the close points before / after this build (ms since epoch UTC).
        row_groups: "due": in ``wait`` mode the keys are read only from the row groups whose earliest impression
            can be due (``min event_time_ms + shortest publish delay <= close_ms``); "all": from every row group
            (the reference: the same rows come back, tested).
        key_cache: the keys of the pending files read by earlier passes of this process
            (:class:`sequences.state_cache.PendingKeys`): only the files not held are read, whole (as "all" reads
            them), and the rows returned come from the whole rows it holds (up to ``build.memory_budget_bytes //
            PENDING_ROWS_SHARE`` bytes) when every one of them is held; None reads the keys from Delta. Used in
            fnw and defer only: wait reads only the row groups whose rows can be due, and keeps nothing.

    Returns:
        Rows of :func:`sequences.examples.pending_schema` (possibly empty).
    """
    schema = pending_schema(config)
    dt = None if version is None else open_table(lake, Table.BUILD_PENDING, version, storage_options=storage_options)
    if dt is None:
        return schema.empty_table()
    dataset = dt.to_pyarrow_dataset()
    searched = dataset
    if config.label_mode == "wait":
        key_cache = None
    if key_cache is not None:
        keys, paths, file_of = key_cache.keys(dt, _PENDING_KEYS, whole_bytes=config.memory_budget_bytes // PENDING_ROWS_SHARE)
    elif config.label_mode == "wait" and row_groups == "due":
        # In wait a row is due only at its first publication, t + delay <= close_ms (no label can make an earlier
        # row due): the row groups of later impressions (the files are in time order: most of them) are not read.
        latest = close_ms - _shortest_publish_delay_ms(config)
        fragments = list(dataset.get_fragments())
        narrowed = _row_groups_where(fragments, lambda low, _: low <= latest)
        log.debug("due_pending: keys read from %d of %d row groups", sum(len(f.row_groups) for f in narrowed),
                  sum(len(f.row_groups) for f in fragments))
        searched = ds.FileSystemDataset(narrowed, dataset.schema, dataset.format, dataset.filesystem)
    if key_cache is None:
        keys = searched.to_table(columns=[*_PENDING_KEYS, "__filename"])
    if keys.num_rows == 0:
        return schema.empty_table()
    t = keys.column("event_time_ms").to_numpy()
    is_new = np.zeros(len(t), dtype=bool)
    due_in = deadlines(keys.column("domain"), config)
    with_labels = np.zeros(len(t), dtype=bool)
    if config.label_mode != "wait" and labels.num_rows:
        # Only a row whose (user, item, domain) has a label can have a late positive due.
        hits = (pl.DataFrame(labels.select(["user_id", "item_id", "domain", "event_type"]))
                .filter(pl.col("event_type").is_in(list(TASKS))).select("user_id", "item_id", "domain").unique()
                .with_columns(pl.lit(True).alias("_hit")))
        with_labels = (pl.DataFrame(keys.select(["user_id", "item_id", "domain"]))
                       .join(hits, on=["user_id", "item_id", "domain"], how="left", maintain_order="left")
                       .get_column("_hit").fill_null(False).to_numpy())
    need = needs_labels(t, due_in, is_new, config, old_close_ms, close_ms) | with_labels
    frame = pl.DataFrame(labels.select(["user_id", "item_id", "domain", "event_type", "event_time_ms"]))
    latency = label_latencies_vectorized(keys, need, frame, config)
    plan = plan_publication(t, due_in, latency, is_new, config, old_close_ms, close_ms)
    chosen_rows = plan.first.copy()
    chosen_rows[plan.correction_rows] = True
    if not chosen_rows.any():
        return schema.empty_table()
    if key_cache is not None:
        held = key_cache.take(np.flatnonzero(chosen_rows))
        if held is not None:
            return held
    chosen = keys.filter(pa.array(chosen_rows))
    files = ({paths[i] for i in np.unique(file_of[chosen_rows])} if key_cache is not None
             else set(chosen.column("__filename").to_pylist()))
    fragments = [f for f in dataset.get_fragments() if _relative(f.path) in files]
    # The files hold rows in time order: only row groups whose time range holds a chosen row are decoded.
    holding = ds.FileSystemDataset(_row_groups_holding(fragments, chosen.column("event_time_ms").to_numpy()),
                                   dataset.schema, dataset.format, dataset.filesystem)
    return holding.to_table(filter=pc.field("example_id").isin(chosen.column("example_id")))


def _row_groups_holding(fragments: list[Any], times: np.ndarray) -> list[Any]:
    """Each Parquet fragment narrowed to its row groups whose ``event_time_ms`` statistics (min, max) hold
    one of ``times`` (ms since epoch UTC); a row group without statistics is kept.

    One binary search per row group: a dataset filter of one time range per cluster of ``times`` (what this
    replaced) cost Arrow ~3x the read it saved once late positives scattered the chosen rows over hundreds
    of ranges (4.0 vs 1.2 CPU-s for 27k of 233k pending rows, pointer layout)."""
    ordered = np.sort(times)

    def holds(low: int, high: int) -> bool:
        first = np.searchsorted(ordered, low, side="left")
        return bool(first < len(ordered) and ordered[first] <= high)

    return _row_groups_where(fragments, holds)


def _row_groups_where(fragments: list[Any], keep: Any) -> list[Any]:
    """Each Parquet fragment narrowed to its row groups whose ``event_time_ms`` statistics satisfy
    ``keep(min, max)`` (ms since epoch UTC); a row group without statistics is kept."""
    out = []
    for fragment in fragments:
        fragment.ensure_complete_metadata()
        kept = []
        for group in fragment.row_groups:
            stats = (group.statistics or {}).get("event_time_ms")
            if stats is None or stats.get("min") is None or stats.get("max") is None or keep(stats["min"], stats["max"]):
                kept.append(group.id)
        out.append(fragment.subset(row_group_ids=kept))
    return out


def _shortest_publish_delay_ms(config: BuildConfig) -> int:
    """The shortest ``config.publish_delay`` of any domain (ms): the defaults' and each overridden domain's."""
    named = {_parse_domain(entry) for entry in (*config.window_overrides, *config.publish_delay_overrides)}
    unnamed = next(f"\0{k}" for k in range(len(named) + 1) if f"\0{k}" not in named)  # a domain no override names
    return min(config.publish_delay(domain) for domain in (*named, unnamed))


def _parse_domain(override: str) -> str:
    return override.partition(":")[0]


def _relative(path: str) -> str:
    """A fragment path of a Delta dataset as ``__filename`` gives it (relative to the table root)."""
    return path.lstrip("/")


def _load(spec: tuple, buffer_labels: pa.Table | None = None, pending_keys: PendingKeys | None = None) -> pa.Table | None:
    """Read an input inside the pipeline (a table passed as an argument would be pickled into the
    graph: minutes of compression for 10^5 rows). ``spec``: ("new", lake, old_version, version, opts),
    ("state", lake, table, delta_version | None, opts) or ("pending", lake, pending_version | None,
    buffer_version | None, opts, old_version, version, config, old_close_ms, close_ms) (:func:`due_pending`, with
    the labels of the buffer and the new events); ``opts``: storage options or None. ``buffer_labels``: the
    buffer's clicks and conversions (:data:`sequences.state_cache.LABEL_COLUMNS`) as the buffer at
    ``buffer_version`` holds them, in its order, instead of reading them (a pending spec only); ``pending_keys``:
    :func:`due_pending`'s ``key_cache``."""
    if spec[0] == "pending":
        _, lake, pending_version, buffer_version, opts, old_version, version, config, old_close_ms, close_ms = spec
        if pending_version is None:
            return None  # no pending state yet: no label to read
        columns = ["user_id", "item_id", "domain", "event_type", "event_time_ms"]
        labels = [new_event_rows(lake, old_version, version, columns=columns, storage_options=opts)]
        buffer = (None if buffer_version is None or buffer_labels is not None
                  else open_table(lake, Table.BUILD_BUFFER, buffer_version, storage_options=opts))
        if buffer_labels is not None:
            labels.append(buffer_labels.cast(labels[0].schema))
        elif buffer is not None:
            labels.append(buffer.to_pyarrow_dataset().to_table(
                columns=columns, filter=pc.field("event_type").isin(list(TASKS))).cast(labels[0].schema))
        return due_pending(lake, pending_version, pa.concat_tables(labels), config, old_close_ms, close_ms,
                           storage_options=opts, key_cache=pending_keys)
    kind, lake, a, b, opts = spec
    if kind == "new":
        return new_event_rows(lake, a, b, storage_options=opts)
    return None if b is None else read_table(lake, a, b, storage_options=opts)


NEW_EVENTS_CHUNK_ROWS = 500_000
"""New events enter the build in tables of about this many rows (:func:`new_event_chunks`): each is split
into its shards' pieces and spilled before the next is read, so the whole increment is never held at
once (at ~150 bytes per event in Arrow, a chunk is ~75 MB)."""


def _emit_table(_: Any, spec: tuple, buffer_labels: pa.Table | None = None, pending_keys: PendingKeys | None = None):
    if spec[0] == "new":
        _, lake, old_version, version, opts = spec
        for chunk in new_event_chunks(lake, old_version, version, chunk_rows=NEW_EVENTS_CHUNK_ROWS,
                                      storage_options=opts):
            if chunk.num_rows:
                yield chunk
        return
    table = _load(spec, buffer_labels, pending_keys)
    if table is not None and table.num_rows:
        yield table


@dataclass(frozen=True)
class Leaving:
    """Which rows of a row-state table leave it: ``mask(rows)`` -> (n,) bool over rows holding ``columns``;
    ``prefilter``: a dataset filter every leaving row passes (it lets the reader skip row groups by their
    statistics), or None."""

    columns: tuple[str, ...]
    mask: Any
    prefilter: Any = None


def _buffer_leaves(cut_ms: int) -> Leaving:
    """Buffered events older than ``cut_ms`` (watermark - ``state_lookback_ms``): the shard step counted them
    into the evicted counts."""
    return Leaving(("event_time_ms",), lambda rows: pc.less(rows.column("event_time_ms"), cut_ms).to_numpy(
        zero_copy_only=False), pc.field("event_time_ms") < cut_ms)


def _pending_leaves(config: BuildConfig, close_ms: int) -> Leaving:
    """Pending impressions whose longest window closed by ``close_ms`` (t + W <= close: the shard step's
    :attr:`sequences.publish.PublicationPlan.keep` is false)."""
    def mask(rows: pa.Table) -> np.ndarray:
        t = rows.column("event_time_ms").to_numpy()
        return t + deadlines(rows.column("domain"), config).longest <= close_ms

    shortest = min([config.close_delay_ms(entry.split(":")[0]) for entry in config.window_overrides]
                   + [config.close_delay_ms("")])
    return Leaving(("event_time_ms", "domain"), mask, pc.field("event_time_ms") <= close_ms - shortest)


def expire_rows(lake: str, table: str, leaving: Leaving, *, build: int,
                storage_options: StorageOptions | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The files of a row-state ``table`` (latest snapshot) that hold rows leaving it: ``(adds, removes)``
    for :func:`gemline.tables.commit_files`. A file all of whose rows leave is removed; one with some is
    rewritten without them (named ``build<build>-kept-<n>``, so a rerun of a crashed build replaces it).

    Reads ``leaving.columns`` of the rows that pass ``leaving.prefilter`` (row groups whose statistics
    rule every row out are skipped), and whole files only where rows stay beside leaving ones; the
    latest snapshot, not the previous build's version, so a compaction since then is respected (it moved
    rows, never changed them).

    Raises:
        ValueError: a file named by the scan is not in the table's snapshot (a concurrent writer).
    """
    dt = open_table(lake, table, storage_options=storage_options)
    if dt is None:
        return [], []
    dataset = dt.to_pyarrow_dataset()
    rows = dataset.to_table(columns=[*leaving.columns, "__filename"], filter=leaving.prefilter)
    gone = leaving.mask(rows) if rows.num_rows else np.zeros(0, dtype=bool)
    if not gone.any():
        return [], []
    leaving_per_file = (pl.DataFrame({"path": rows.column("__filename").combine_chunks(), "gone": gone})
                        .filter(pl.col("gone")).group_by("path").len())
    touched = sorted(leaving_per_file.get_column("path").to_list())
    count = dict(zip(leaving_per_file.get_column("path").to_list(), leaving_per_file.get_column("len").to_list(),
                     strict=True))
    snapshot = {a["path"]: a for a in pa.table(dt.get_add_actions(flatten=True)).select(["path", "size_bytes"]).to_pylist()}
    missing = [f for f in touched if f not in snapshot]
    if missing:
        raise ValueError(f"{table}: files {missing[:3]} hold leaving rows but are not in the snapshot")
    fragments = {_relative(f.path): f for f in dataset.get_fragments()}
    adds: list[dict[str, Any]] = []
    for n, path in enumerate(touched):
        if fragments[path].count_rows() == count[path]:
            continue  # every row leaves: the file just goes
        whole = fragments[path].to_table(schema=dataset.schema)
        adds += _write_state_aware(lake, table, whole.filter(pa.array(~leaving.mask(whole))),
                                   f"build{build:06d}-kept-{n:05d}", storage_options)
    removes = [{"path": path, "size": snapshot[path]["size_bytes"], "partition_values": {}} for path in touched]
    return adds, removes


STATE_FILE_BYTES = 16 * 2**20
"""Target size of a row-state table's files after compaction: files this large are left alone, so a
compaction rewrites at most about this much however large the state grows (compacting everything, as
the other tables do, would rewrite the whole state every few builds)."""


STATE_COMPACT_FACTOR = 4
"""A row-state table is compacted once it has this many times ``compact_min_files`` small files. The
newest pending rows are the ones the next passes read (their first publication is due a waiting window
later): between compactions they sit in their own small files, and a compaction moves them into a file
of up to :data:`STATE_FILE_BYTES` that a pass then reads whole, so compactions are kept rare."""


def compact_state(lake: str, table: str, hygiene: HygieneConfig, *,
                  storage_options: StorageOptions | None = None) -> int:
    """Compact a row-state table's files smaller than :data:`STATE_FILE_BYTES` once there are at least
    :data:`STATE_COMPACT_FACTOR` x ``hygiene.compact_min_files`` of them (delta-rs
    ``optimize.compact(target_size=...)``, which skips larger files). Returns the number of files removed."""
    dt = open_table(lake, table, storage_options=storage_options)
    if dt is None:
        return 0
    sizes = pa.table(dt.get_add_actions(flatten=True)).column("size_bytes").to_numpy()
    if int(np.count_nonzero(sizes < STATE_FILE_BYTES)) < STATE_COMPACT_FACTOR * hygiene.compact_min_files:
        return 0
    from deltalake import WriterProperties

    # Compaction keeps the files' order, so pending rows stay roughly in time order, in ~1 MB row groups.
    groups = (WriterProperties(max_row_group_size=pending_row_group_rows(pa.schema(dt.schema().to_arrow())))
              if table == Table.BUILD_PENDING else None)
    return int(dt.optimize.compact(target_size=STATE_FILE_BYTES, writer_properties=groups).get("numFilesRemoved", 0))


def build_hygiene(build: BuildConfig, *, auto_shards: bool = False) -> HygieneConfig:
    """The hygiene :func:`run_build` applies to the build tables: ``build.hygiene`` with
    ``compact_min_files`` raised to at least 2 x ``build.shards`` + 1.

    Each build writes up to one file per shard into a partition, so a lower threshold would
    compact after every build or two; a raised value is logged naming the key, the configured value
    and the value used: a warning when the shard count was set (``build.shards`` a number), at INFO when
    ``build.shards = "auto"`` chose it (``auto_shards``: nothing the user set conflicts, and the count
    changes with the data, so "set it to >= N" would be no advice).
    """
    floor = 2 * build.shard_count + 1
    configured = build.hygiene.compact_min_files
    if configured >= floor:
        return build.hygiene
    log.log(logging.INFO if auto_shards else logging.WARNING,
            "build.hygiene.compact_min_files=%d is overridden at run time: using %d (2 x build.shards + 1; "
            "a build writes up to one file per shard into a partition); set it to >= %d to silence this",
            configured, floor, floor)
    return dataclasses.replace(build.hygiene, compact_min_files=floor)


def feature_views_due(config: BuildConfig, watermark_ms: int, last_commits: Mapping[str, Mapping[str, Any]], *,
                      final: bool) -> bool:
    """Whether a build at ``watermark_ms`` (ms since epoch UTC) materialises the feature views
    (``build.features_interval_ms``): on a ``final`` build, when one of them has no build commit yet, or when the
    watermark is at least the interval past the oldest watermark they were last written at.

    ``last_commits``: each table's last build commit metadata, by table name (``{}`` for none; tables other than
    the views are ignored). The oldest, not the newest: a build that crashed after committing some of the views
    finds the others older and writes them on its rerun (the committed ones are skipped as done), so the three
    always move together."""
    if final or config.features_interval_ms == 0:
        return True
    written = [last_commits.get(name, {}).get("watermark_ms") for name in FEATURE_VIEW_OUTPUTS]
    if None in written:
        return True
    return watermark_ms - min(int(w) for w in written if w is not None) >= config.features_interval_ms


def uses_beam(config: BuildConfig, beam_args: list[str] | None) -> bool:
    """Whether :func:`run_build` runs its computation as a Beam pipeline: ``build.engine = "beam"``,
    or ``"auto"`` with Beam flags given (a runner such as Dask or Flink, or DirectRunner options);
    otherwise (no flags, or ``"inprocess"``) in this process (:func:`_run_in_process`).

    Raises:
        BadConfigError: ``build.engine = "inprocess"`` with Beam flags (they would be ignored).
    """
    if config.engine == "inprocess" and beam_args:
        raise BadConfigError(f"build.engine='inprocess' runs no Beam pipeline, so the Beam flags {beam_args} would be "
                             "ignored: drop them, or set build.engine=beam (or auto)")
    return config.engine == "beam" or (config.engine == "auto" and bool(beam_args))


SHARD_BYTES_PER_ROW = 2_560
"""Bytes a user shard step holds per event it reads (new or buffered), pointer layout: 1,017 MiB peak at
16 shards and 2,171 MiB at 4 on the same 2,555,249 events (max length 4096, issue 15) give 2.41 KiB per
event of a shard and ~630 MiB of the rest of the process."""

SHARD_BYTES_PER_LIST_ITEM = 16
"""Fat layout: bytes more per event read and per unit of ``max_seq_len`` (its examples carry their lists:
~35 KB per event at 2048, issue 15's table)."""


BEAM_MIN_SHARDS = 4
"""The fewest shards ``"auto"`` gives a Beam build: there a shard is the unit of parallelism (a Dask
worker builds one), so auto keeps the count the default was before it."""


def shards_for(config: BuildConfig, rows: int, *, minimum: int = 1, parallel: int = 1) -> int:
    """The shard count of a build that reads ``rows`` events (new + buffered): ``build.shards`` when a
    number, else ("auto") the fewest shards, at least ``minimum``, such that the ``parallel`` of them
    computed at once fit in ``build.memory_budget_bytes`` together, each holding its share of the rows at
    :data:`SHARD_BYTES_PER_ROW` bytes each (plus :data:`SHARD_BYTES_PER_LIST_ITEM` x ``max_seq_len`` in the
    fat layout). Where all the rows fit, one shard (measured idle, 2 cores: a 200,000-event build split into 2
    shards run at once was 0.88x as fast as 1 shard, for 10% more CPU; polars already runs one step on ~1.4
    cores); where they do not, a multiple of ``parallel``, so the last round of steps keeps every core busy
    (1,000,000 events: 6 shards 2 at once 1.17-1.61x as fast as 3 one after the other, the same CPU). A shard has fixed costs: it
    writes its own file into each partition of each table (a 200,000-event build at 4 shards wrote ~340
    files). :func:`run_build` passes :data:`BEAM_MIN_SHARDS` for a Beam build and ``build.parallelism`` for
    an in-process one."""
    if config.shards != "auto":
        return config.shards
    per_row = SHARD_BYTES_PER_ROW + (SHARD_BYTES_PER_LIST_ITEM * config.max_seq_len
                                     if config.examples_layout == "fat" else 0)
    if rows * per_row <= config.memory_budget_bytes:
        return max(minimum, 1)
    by_memory = max(parallel, -(-rows * per_row * parallel // config.memory_budget_bytes))
    return max(minimum, -(-by_memory // parallel) * parallel)


def _rows_at(lake: str, table: str, version: int | None, opts: StorageOptions | None) -> int:
    """Rows of ``table`` at ``version`` from its log's file statistics (no data read); 0 for None."""
    dt = None if version is None else open_table(lake, table, version, storage_options=opts)
    return 0 if dt is None else _log_rows(dt)


def _close_point(config: BuildConfig, watermark_ms: int, old_close_ms: int | None, final: bool,
                 close_windows_at: int | None) -> int:
    close = watermark_ms if old_close_ms is None else max(old_close_ms, watermark_ms)
    if close_windows_at is not None:
        close = max(close, close_windows_at)
    if final:
        domains = {entry.split(":")[0] for entry in config.window_overrides}
        longest = max([config.close_delay_ms(d) for d in domains] + [config.close_delay_ms("")])
        close = max(close, watermark_ms + longest)
    return close


@holding("build")
def run_build(
    lake: Lake,
    config: BuildConfig,
    *,
    events_version: int | None = None,
    beam_args: list[str] | None = None,
    final: bool = False,
    close_windows_at: int | None = None,
    state_cache: BuildStateCache | None = None,
) -> BuildResult:
    """Build the events gained since the last build into examples, sequences, features and state.

    Reads ``events`` at ``events_version`` (latest when None) but only the rows added since the last
    built version (:func:`new_event_rows`), merges them with the build state, in this process or as
    a Beam pipeline (:func:`uses_beam`: ``build.engine``; DirectRunner unless ``beam_args`` say
    otherwise; the same tables either way), stages Parquet under
    ``LAKE/_staging/build/<events_version>/`` and commits each table once, tagged ("build", k) with
    metadata ``{"events_version", "watermark_ms", "close_ms"}``; ``examples`` is appended last.

    Windows close by the watermark (the newest event time seen); impressions whose windows are
    still open wait in the state for a later build. At the end of a bounded snapshot (a replayed
    dataset), pass ``final=True`` to close every window now (``watermark + longest window``) or
    ``close_windows_at`` (ms since epoch UTC) to close them up to a time; the affected examples get
    ``label_window_closed=False``. The close point never moves back, so later builds still publish
    each impression exactly once.

    Restartable: a build of an already-built events version returns ``skipped=True`` and changes
    nothing; a crashed build is redone from the state of the previous one.

    The quality gate holds the build (``config.events_gate = "required"``, the default):
    ``events@version`` must have passed its newest validation or been released by hand, and no
    version between the last built one and it may be quarantined
    (:func:`gemline.gate.require_allowed`); a never-validated version is refused too (validate
    it first). Nothing is written before that check. A rerun with nothing new reads no events and
    is not checked.

    Args:
        lake: the lake of ``events`` and the build's tables (its root's build lock is held).
        config: the ``build`` section: windows, sequence lengths, shards, the events gate, hygiene.
        events_version: the ``events`` version to build up to; None: the latest.
        beam_args: Beam pipeline flags (DirectRunner unless they name another runner); with
            ``build.engine = "auto"`` (the default) any flag runs the build on Beam.
        final, close_windows_at: close attribution windows beyond the watermark (see above).
        state_cache: the buffer kept in memory across the passes of one process (``build --follow``): this
            build reads from Delta only the buffer files its snapshot gained since the cache's copy and neither
            re-reads nor re-splits the rest (:mod:`sequences.state_cache`: used only for the files of the very
            snapshot this build reads; the same tables either way). None: everything read from Delta. Ignored
            by a Beam build.

    Raises:
        MissingInputError: no ``events`` table (run ingest first; a ValueError).
        BadConfigError: an ``events_version`` older than the last built one, or (a pointer lake, or a
            pointer config) an ``examples_layout``, ``max_seq_len`` or ``same_domain_seq_len`` other than the
            lake was built with (a ValueError).
        ValueError: missing columns, or ``close_windows_at`` < 0.
        gemline.errors.MissingInputError: no events table, or no ``events_version`` of it.
        gemline.locks.LakeBusyError: another build is running on this lake.
        gemline.gate.GateClosedError: an events version to be read is quarantined, or
            ``events@version`` was never validated (one line naming the version and the command).
    """
    # The helpers and the Beam steps below take the root and its delta-rs options (None for a local lake).
    root, opts = lake.root, lake.delta_options
    if open_table(root, Table.EVENTS, storage_options=opts) is None:
        raise MissingInputError(f"no events table under {root!r}; run the ingest job first")
    if events_version is not None:
        require_version(root, Table.EVENTS, events_version, storage_options=opts)
    table = open_table(root, Table.EVENTS, events_version, storage_options=opts)
    assert table is not None
    if close_windows_at is not None and close_windows_at < 0:
        raise ValueError(f"close_windows_at must be ms since epoch UTC (>= 0), got {close_windows_at}")
    version = table.version()
    meta = commit_metadata(root, Table.EXAMPLES, APP_ID, storage_options=opts) or {}
    old_version = meta.get("events_version")
    if old_version is not None and version < old_version:
        raise BadConfigError(f"events_version {version} is older than the last built version {old_version}; "
                             "examples are append-only, so the build cannot go back")
    built = {k: meta.get(k, "fat" if k == "examples_layout" else None) for k in layout_metadata(config)} if meta else {}
    changed = {k: (v, layout_metadata(config)[k]) for k, v in built.items() if v is not None and v != layout_metadata(config)[k]}
    if changed and "pointer" in (built.get("examples_layout"), config.examples_layout):
        # Pointer rows are rebuilt with the lake's layout and lengths; a change would make them unreadable.
        raise BadConfigError(f"this lake was built with {', '.join(f'build.{k}={v[0]!r}' for k, v in changed.items())}; "
                             f"got {', '.join(f'{v[1]!r}' for v in changed.values())}: they are fixed for the life of a "
                             f"lake (build a new lake to change them, or keep building this one with {_same_as(built)})")
    old_close = meta.get("close_ms")
    if old_version == version:
        # Nothing new: only closing windows further can publish anything, and only if impressions
        # are pending; otherwise a rerun (e.g. a second `build --final`) is a no-op, not an empty version.
        wants_close = final or (close_windows_at is not None and close_windows_at > (old_close or 0))
        moves = wants_close and (old_close is None or _close_point(
            config, meta.get("watermark_ms") or 0, old_close, final, close_windows_at) > old_close)
        if not moves or _rows(root, Table.BUILD_PENDING, opts) == 0:
            return _result_from_lake(root, version, skipped=True, opts=opts)
    _check_events(table.to_pyarrow_dataset().schema.names)
    if config.events_gate == "required" and version != old_version:
        # Only the events versions the quality gate allows are built (the rows read are those of
        # old_version (exclusive) .. version); a refusal names the version and the command to run.
        require_allowed(root, Table.EVENTS, version, since=old_version, reader="build", storage_options=opts)
    new_times = new_event_rows(root, old_version, version, columns=["event_time_ms"],
                               storage_options=opts).column("event_time_ms")
    newest = pc.max(new_times).as_py() if len(new_times) else None
    old_watermark = meta.get("watermark_ms")
    # An empty first snapshot has no event time: the epoch makes every as-of output empty.
    watermark_ms = max(x for x in (old_watermark, newest, 0) if x is not None)
    close_ms = _close_point(config, watermark_ms, old_close, final, close_windows_at)
    last_build = meta.get("build")
    build = 0 if last_build is None else last_build + 1
    state: dict[Table, tuple] = {
        name: ("state", root, name, _version_at_build(root, name, last_build, opts), opts)
        for name in (Table.SEQUENCES, Table.SEQUENCES_BY_DOMAIN, Table.BUILD_BUFFER, Table.BUILD_EVICTED)}
    # Only the pending rows with something due are read (most wait days for their windows to close).
    state[Table.BUILD_PENDING] = ("pending", root, _version_at_build(root, Table.BUILD_PENDING, last_build, opts),
                                  state[Table.BUILD_BUFFER][3], opts, old_version, version, config, old_close, close_ms)
    on_beam = uses_beam(config, beam_args)
    parallel = 1 if on_beam else config.parallel_shards
    shards = shards_for(config, len(new_times) + _rows_at(root, Table.BUILD_BUFFER, state[Table.BUILD_BUFFER][3], opts),
                        minimum=BEAM_MIN_SHARDS if on_beam else 1, parallel=parallel)
    if config.shards == "auto":
        log.info("build %d: %d shard(s) for %d new events (build.shards = auto, build.memory_budget_bytes = %d, "
                 "%d at once)", build, shards, len(new_times), config.memory_budget_bytes, min(parallel, shards))
    auto_shards, config = config.shards == "auto", dataclasses.replace(config, shards=shards)
    # Workers write data files straight into the tables (uncommitted) and list them in manifests;
    # DirectRunner workers share this machine's disk, so a remote lake keeps its manifests in a
    # local temp dir (multi-machine runners need a shared one).
    staging = (Path(tempfile.mkdtemp(prefix=f"gemline-build-{version}-")) if is_remote(root)
               else Path(root) / "_staging" / APP_ID / str(version))
    # A crashed earlier attempt may have left manifests: start afresh (its files get rewritten).
    shutil.rmtree(staging, ignore_errors=True)
    schemas = output_schemas(config)
    # One handle per output table for the rest of the build, brought up to date where it is used: opening a
    # table replays its log from the last checkpoint, and the commits and tidying below read each table 5-7 times.
    handles = {name: open_table(root, name, storage_options=opts) for name in _OUTPUTS}
    last_commits = {name: commit_metadata(root, name, APP_ID, storage_options=opts, snapshot=handles[name]) or {}
                    for name in _OUTPUTS}
    done = frozenset(name for name, meta in last_commits.items() if meta.get("build") == build)

    sources = {
        "new": ("new", root, old_version, version, opts),
        "buffer": state[Table.BUILD_BUFFER],
        "seq": state[Table.SEQUENCES],
        "dseq": state[Table.SEQUENCES_BY_DOMAIN],
        "evicted": state[Table.BUILD_EVICTED],
        "pending": state[Table.BUILD_PENDING],
    }
    views = feature_views_due(config, watermark_ms, last_commits, final=final)
    steps = {"config": config, "watermark_ms": watermark_ms, "old_close_ms": old_close, "close_ms": close_ms,
             "spill_dir": str(staging / "shuffle"), "build": build, "feature_views": views}
    write = (str(root), opts, str(staging), build, done, schemas)
    if on_beam:
        _run_on_beam(sources, steps, write, list(beam_args or []))
    else:
        buffer_version = state[Table.BUILD_BUFFER][3]
        held = (None if state_cache is None or buffer_version is None else
                state_cache.buffer(root, buffer_version, shards, config.memory_budget_bytes, opts))
        _run_in_process(sources, steps, write, held, None if state_cache is None else state_cache.pending_keys)

    published = 0
    for name in tqdm(list(_OUTPUTS), desc="commit build tables", unit="table"):
        if name in done:
            continue  # committed before a crash: the rerun computed the same rows
        if name in FEATURE_VIEW_OUTPUTS and not views:
            continue  # not materialised by this pass: the last snapshot stays
        files = _manifest_files(staging / name)
        counts: dict[str, Any] = {}
        if name == Table.EXAMPLES:
            published = sum(f["num_records"] for f in files)
            # The last build's commit holds the counts of every example before this one's.
            counts = {LENGTH_COUNTS_KEY: add_counts(length_counts(root, meta, opts),
                                                    *(json.loads(p.read_text()) for p in
                                                      sorted((staging / _LENGTH_COUNTS_DIR).glob("*.json"))))}
        removes: list[dict[str, Any]] = []
        if name == Table.BUILD_BUFFER:
            kept, removes = expire_rows(root, name, _buffer_leaves(watermark_ms - config.state_lookback_ms),
                                        build=build, storage_options=opts)
            files += kept
        elif name == Table.BUILD_PENDING:
            kept, removes = expire_rows(root, name, _pending_leaves(config, close_ms), build=build,
                                        storage_options=opts)
            files += kept
        last = committed_version(root, name, APP_ID, storage_options=opts, snapshot=handles[name])
        commit_files(
            root, name, files, schemas[name], app_id=APP_ID, version=0 if last is None else last + 1,
            metadata={"events_version": version, "watermark_ms": watermark_ms, "close_ms": close_ms, "build": build,
                      **layout_metadata(config), **counts},
            storage_options=opts, removes=removes, snapshot=handles[name],
        )
    shutil.rmtree(staging, ignore_errors=True)
    hygiene = build_hygiene(config, auto_shards=auto_shards)
    row_state = {table for table, _ in _ROW_STATE.values()}
    for name in _OUTPUTS:
        if name in row_state:
            compact_state(root, name, hygiene, storage_options=opts)
        # compact_state may have committed through its own handle: the update brings this one to it.
        tidy(root, name, hygiene, compact=name not in row_state, storage_options=opts, snapshot=handles[name])
    return _result_from_lake(root, version, skipped=False, published=published, opts=opts)
