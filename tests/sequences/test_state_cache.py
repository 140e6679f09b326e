"""The build's buffer kept in memory across passes (:mod:`sequences.state_cache`): the twin of reading it from Delta.

A sequence of passes sharing one :class:`BuildStateCache` (what ``build --follow`` does) leaves every table as the
same passes run fresh from Delta, through expiry (a short ``state_lookback_ms``), a crash and its rerun, and a
foreign commit (a compaction of the buffer, whose files the cache then refuses and reads again).
"""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import gemline.lake as lake_mod
from gemline.config import GemlineConfig
from gemline.lake import open_table, read_table
from gemline.tables import Table
from sequences.config import BuildConfig
from sequences.pipeline import _OUTPUTS, run_build
from sequences.publish import TASKS
from sequences.shards import split_by_shard
from sequences.state_cache import ITEM_ORDER, LABEL_COLUMNS, SPLIT_KEYS, BuildStateCache
from tests.conftest import build_args, with_layout

from .test_pipeline import write_events

DAY_MS = 86_400_000
PASSES = 7
CRASHED_PASS = 3
COMPACTED_BEFORE = 4

CONFIG = BuildConfig(max_seq_len=3, click_window_ms=100, conversion_window_ms=1_000, events_gate="off",
                     state_lookback_ms=31 * DAY_MS, engine="inprocess")


def _batch(make_event, n: int) -> list[dict]:
    """Pass ``n``'s events: 8 users, 5 items, 2 domains, 9 days after pass ``n - 1``'s (so with a 31-day lookback
    the buffer expires rows from pass 4 on); impressions, clicks within the click window, a late conversion."""
    rows = []
    base = n * 9 * DAY_MS
    for i in range(8):
        user, domain = f"u{i}", f"d{i % 2}"
        for k in range(3):
            t = base + 1_000 * k + 37 * i
            rows.append(make_event(f"p{n}_{user}_imp{k}", t, "impression", user=user, item=f"i{(i + k + n) % 5}",
                                   domain=domain))
        rows.append(make_event(f"p{n}_{user}_click", base + 50 + 37 * i, "click", user=user,
                               item=f"i{(i + n) % 5}", domain=domain))
        if i % 3 == 0 and n:  # a conversion of the previous pass's impression: a late label
            rows.append(make_event(f"p{n}_{user}_conv", base - 9 * DAY_MS + 1_500 + 37 * i, "conversion",
                                   user=user, item=f"i{(i + 1 + n - 1) % 5}", domain=domain))
    return rows


def _rows(lake: str) -> dict[str, list[str]]:
    """Every build table's rows, sorted (compacted files get random names, so file order may differ)."""
    return {name: sorted(json.dumps(r, sort_keys=True, default=str) for r in read_table(lake, name).to_pylist())
            for name in _OUTPUTS}


def _fresh_split(lake: str, version: int, shards: int) -> tuple[dict, pa.Table]:
    """The buffer at ``version`` read and split as a pass without the cache does, and its labels."""
    dt = open_table(lake, Table.BUILD_BUFFER, version)
    whole = dt.to_pyarrow_dataset().to_table()
    labels = dt.to_pyarrow_dataset().to_table(columns=LABEL_COLUMNS, filter=pc.field("event_type").isin(list(TASKS)))
    return {key: dict(split_by_shard(whole, key, shards)) for key in SPLIT_KEYS}, labels


def _assert_same_piece(key: str, held: pa.Table, fresh: pa.Table) -> None:
    """A user piece is the fresh split's row for row; an item piece holds the same rows, each file's stably sorted
    by ITEM_ORDER, so a stable sort by ITEM_ORDER (the item step's) gives the fresh piece's sorted rows, in order."""
    if key == "user_id":
        assert held.equals(fresh)
        return
    assert held.take(pc.sort_indices(held, sort_keys=ITEM_ORDER)).equals(
        fresh.take(pc.sort_indices(fresh, sort_keys=ITEM_ORDER)))


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "shards", "label_mode"), [("pointer", 1, "wait"), ("fat", 3, "defer")])
def test_passes_sharing_the_cache_write_what_fresh_passes_write(tmp_path, make_event, monkeypatch, layout, shards,
                                                                label_mode):
    build = dataclasses.replace(with_layout(CONFIG, layout), shards=shards, label_mode=label_mode,
                                publish_delay_ms=500, parallelism=2)
    cache = BuildStateCache()
    held_checked = []
    real_buffer = BuildStateCache.buffer

    def checked_buffer(self, lake, version, n_shards, budget_bytes, storage_options=None):
        # The held copy is, shard for shard and row for row, the fresh read and split of the same snapshot.
        held = real_buffer(self, lake, version, n_shards, budget_bytes, storage_options)
        assert held is not None
        pieces, labels = _fresh_split(lake, version, n_shards)
        for key in SPLIT_KEYS:
            assert held.pieces[key].keys() == pieces[key].keys()
            for shard, table in pieces[key].items():
                _assert_same_piece(key, held.pieces[key][shard], table)
        assert held.labels.equals(labels)
        held_checked.append(version)
        return held

    monkeypatch.setattr(BuildStateCache, "buffer", checked_buffer)
    lakes = {"fresh": str(tmp_path / "fresh"), "cached": str(tmp_path / "cached")}
    buffer_rows = []
    for n in range(PASSES):
        snapshots = {}
        for kind, lake in lakes.items():
            config = GemlineConfig(lake=lake, build=build)
            state_cache = cache if kind == "cached" else None
            write_events(lake, _batch(make_event, n), version=n)
            if n == COMPACTED_BEFORE:  # a foreign commit: every buffer file rewritten into one
                open_table(lake, Table.BUILD_BUFFER).optimize.compact()
            if n == CRASHED_PASS:  # crash at the examples commit (the last), then rerun
                real = lake_mod.commit_files_once

                def crashing(lake_root, table, *args, real=real, **kwargs):
                    if table == Table.EXAMPLES:
                        raise RuntimeError("injected crash before the examples commit")
                    return real(lake_root, table, *args, **kwargs)

                monkeypatch.setattr(lake_mod, "commit_files_once", crashing)
                with pytest.raises(RuntimeError, match="injected crash"):
                    run_build(*build_args(config), state_cache=state_cache)
                monkeypatch.setattr(lake_mod, "commit_files_once", real)
            before = dataclasses.replace(cache.stats)
            run_build(*build_args(config), state_cache=state_cache)
            snapshots[kind] = _rows(lake)
            if kind == "cached" and n == COMPACTED_BEFORE + 1:
                # The pass after (build COMPACTED_BEFORE's snapshot holds the compaction): the compacted file was
                # read, and none of the files the compaction removed was reused.
                assert cache.stats.files_read > before.files_read
                assert cache.stats.files_reused == before.files_reused
            if kind == "cached" and n in (2, CRASHED_PASS, PASSES - 1):
                assert cache.stats.files_reused > before.files_reused  # the cache was used, not bypassed
        assert snapshots["cached"] == snapshots["fresh"], f"pass {n}"
        buffer_rows.append(len(snapshots["fresh"][Table.BUILD_BUFFER]))
    # Passes 1.. read a buffer (twice on the crashed pass), each checked against the fresh read.
    assert len(held_checked) == PASSES
    # Expiry happened: the buffer lost pass 0's events (older than 31 days) and shrank.
    assert buffer_rows[-1] < buffer_rows[-2] + len(_batch(make_event, PASSES - 1))
    buffer = read_table(lakes["cached"], Table.BUILD_BUFFER, columns=["event_id"]).column("event_id").to_pylist()
    assert not [e for e in buffer if e.startswith("p0_")]
    assert len(snapshots["cached"][Table.EXAMPLES]) > 0
    if label_mode == "defer":  # the pending state's keys were held too (wait reads only the due row groups)
        assert cache.pending_keys.files_reused > 0


def test_the_cache_refuses_another_table_and_a_buffer_over_half_the_budget(tmp_path, make_event):
    """A cache used on one lake and then another holds only the second's files; a buffer whose copy would pass
    half the memory budget is not held (None: the pass reads it from Delta)."""
    lakes = [str(tmp_path / "a"), str(tmp_path / "b")]
    for lake in lakes:
        config = GemlineConfig(lake=lake, build=CONFIG)
        for n in range(2):
            write_events(lake, _batch(make_event, n), version=n)
            run_build(*build_args(config))
    cache = BuildStateCache()
    versions = [open_table(lake, Table.BUILD_BUFFER).version() for lake in lakes]
    first = cache.buffer(lakes[0], versions[0], 2, CONFIG.memory_budget_bytes)
    again = cache.buffer(lakes[0], versions[0], 2, CONFIG.memory_budget_bytes)
    assert first is not None and again is not None and again.rows == first.rows > 0
    assert cache.stats.files_reused == cache.stats.files_read > 0
    read_before = cache.stats.files_read
    other = cache.buffer(lakes[1], versions[1], 2, CONFIG.memory_budget_bytes)
    assert other is not None and other.rows == read_table(lakes[1], Table.BUILD_BUFFER).num_rows
    assert cache.stats.files_read == 2 * read_before and len(cache.stats.refused) == 1
    # Over budget: nothing held, and the reason said.
    read_before = cache.stats.files_read
    assert cache.buffer(lakes[1], versions[1], 3, budget_bytes=2 * 1_000) is None
    assert cache.nbytes == 0 and "memory_budget_bytes" in cache.stats.refused[-1]
    # Decided from the bytes per row measured before: nothing is read to find out again.
    assert cache.buffer(lakes[1], versions[1], 3, budget_bytes=2 * 1_000) is None
    assert cache.stats.files_read == read_before
    # A fresh cache reads once to measure, then holds nothing.
    fresh = BuildStateCache()
    assert fresh.buffer(lakes[1], versions[1], 3, budget_bytes=2 * 1_000) is None and fresh.nbytes == 0
    assert fresh.buffer(lakes[1], versions[1], 3, budget_bytes=2 * 1_000) is None
    assert fresh.stats.files_read == len(open_table(lakes[1], Table.BUILD_BUFFER, versions[1]).file_uris()) > 0


@pytest.mark.slow
def test_another_shard_count_is_split_again_from_memory_as_a_fresh_read_splits_it(tmp_path, make_event):
    """``build.shards = auto`` changes the count as the buffer grows: the held files are put back in file order and
    split again (nothing read from Delta), shard for shard and row for row the fresh read's split; passes whose
    shard count changes every time write, sharing the cache, what fresh passes write."""
    lakes = {"fresh": str(tmp_path / "fresh"), "cached": str(tmp_path / "cached")}
    cache = BuildStateCache()
    for n, shards in enumerate([2, 3, 1, 4, 3]):
        snapshots = {}
        for kind, lake in lakes.items():
            config = GemlineConfig(lake=lake, build=dataclasses.replace(CONFIG, shards=shards, label_mode="defer"))
            write_events(lake, _batch(make_event, n), version=n)
            before = dataclasses.replace(cache.stats)
            buffer = open_table(lake, Table.BUILD_BUFFER)
            run_build(*build_args(config), state_cache=cache if kind == "cached" else None)
            snapshots[kind] = _rows(lake)
            if kind == "cached" and n >= 2:
                # Only the files the last pass added were read; the rest were split again, not reread.
                assert buffer is not None and before.files_resplit < cache.stats.files_resplit
                resplit, read = (cache.stats.files_resplit - before.files_resplit,
                                 cache.stats.files_read - before.files_read)
                assert resplit + read == len(buffer.file_uris()) and read < len(buffer.file_uris())
                assert not cache.stats.refused
        assert snapshots["cached"] == snapshots["fresh"], f"pass {n}"
    lake = lakes["cached"]
    version = open_table(lake, Table.BUILD_BUFFER).version()
    assert cache.buffer(lake, version, 3, CONFIG.memory_budget_bytes) is not None  # the last pass's files read
    for shards in (5, 1, 2):
        read_before = cache.stats.files_read
        held = cache.buffer(lake, version, shards, CONFIG.memory_budget_bytes)
        assert held is not None and cache.stats.files_read == read_before
        pieces, labels = _fresh_split(lake, version, shards)
        assert shards == 1 or max(len(by_shard) for by_shard in pieces.values()) > 1  # rows did move
        for key in SPLIT_KEYS:
            assert held.pieces[key].keys() == pieces[key].keys()
            for shard, table in pieces[key].items():
                _assert_same_piece(key, held.pieces[key][shard], table)
        assert held.labels.equals(labels)
        # Each file's item pieces are held sorted (the step's sort then works on sorted runs), not in file order.
        for held_file in cache._files.values():
            for _, piece in held_file.pieces["item_id"]:
                assert piece.equals(piece.take(pc.sort_indices(piece, sort_keys=ITEM_ORDER)))
        assert any(not p.equals(p.take(pc.sort_indices(p, sort_keys=ITEM_ORDER))) for p in pieces["item_id"].values())
