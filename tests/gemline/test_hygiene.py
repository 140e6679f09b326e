"""Delta hygiene: compaction keeps rows, checkpoints every K, vacuum keeps referenced files, bad config."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from gemline.hygiene import HygieneConfig, conform, tidy
from gemline.lake import read_table


def test_compact_checkpoint_vacuum_keep_rows(tmp_path):
    lake = str(tmp_path)
    for i in range(4):
        write_deltalake(f"{lake}/t", pa.table({"a": [i, i + 10]}), mode="append")
    result = tidy(lake, "t", HygieneConfig(checkpoint_every=4, retention_hours=1.0, compact_min_files=4))
    assert result.files_compacted == 4 and result.checkpointed  # version 4 after the compaction
    assert result.files_vacuumed == 0  # the compacted-away files are younger than the retention
    assert sorted(read_table(lake, "t").column("a").to_pylist()) == [0, 1, 2, 3, 10, 11, 12, 13]
    assert list((tmp_path / "t" / "_delta_log").glob("*.checkpoint.parquet"))


def test_compaction_counts_files_per_partition(tmp_path):
    """Four files spread over two partitions (2 + 2) stay; a third file in one partition triggers compaction."""
    lake, config = str(tmp_path), HygieneConfig(retention_hours=1.0, compact_min_files=3)
    for i in range(4):
        write_deltalake(f"{lake}/t", pa.table({"a": [i], "p": ["x" if i % 2 else "y"]}), mode="append",
                        partition_by=["p"])
    assert tidy(lake, "t", config).files_compacted == 0
    write_deltalake(f"{lake}/t", pa.table({"a": [9], "p": ["x"]}), mode="append", partition_by=["p"])
    # x's three files trigger it; delta-rs then bins every partition with several files (y's two too).
    assert tidy(lake, "t", config).files_compacted == 5
    assert sorted(read_table(lake, "t").column("a").to_pylist()) == [0, 1, 2, 3, 9]


def _append(lake: str, rows: int, seed: int) -> None:
    """One file of ``rows`` random float64s (about 8 bytes a row: random values do not compress)."""
    write_deltalake(f"{lake}/t", pa.table({"x": np.random.default_rng(seed).random(rows)}), mode="append")


def _sizes(lake: str) -> dict[str, int]:
    actions = pa.table(DeltaTable(f"{lake}/t").get_add_actions(flatten=True))
    return dict(zip(actions.column("path").to_pylist(), actions.column("size_bytes").to_pylist()))


def test_first_tier_merges_small_files_and_leaves_larger_ones(tmp_path):
    lake = str(tmp_path)
    config = HygieneConfig(retention_hours=1.0, compact_min_files=4, small_file_bytes=100_000, target_file_bytes=10**7)
    _append(lake, 50_000, 0)  # ~400 kB: above small_file_bytes
    big = set(_sizes(lake))
    for seed in range(1, 4):
        _append(lake, 500, seed)
    assert tidy(lake, "t", config).files_compacted == 0  # three small files: under compact_min_files
    _append(lake, 500, 4)
    assert tidy(lake, "t", config).files_compacted == 4
    sizes = _sizes(lake)
    assert big <= set(sizes) and len(sizes) == 2  # the large file untouched, the four small ones merged into one
    assert read_table(lake, "t").num_rows == 52_000


def test_second_tier_merges_files_between_the_sizes(tmp_path):
    lake = str(tmp_path)
    config = HygieneConfig(retention_hours=1.0, compact_min_files=3, small_file_bytes=50_000, target_file_bytes=10**7)
    for seed in range(3):
        _append(lake, 20_000, seed)  # ~160 kB each: none small
    before = _sizes(lake)
    assert all(size >= 50_000 for size in before.values())
    assert tidy(lake, "t", config).files_compacted == 3
    assert len(_sizes(lake)) == 1 and read_table(lake, "t").num_rows == 60_000


def test_tiers_bound_what_a_growing_table_rewrites(tmp_path):
    """Appends with a tidy after each: the tiers rewrite each appended byte a bounded number of times, where one
    target for every file (delta-rs's 100 MB default, the old policy) rewrote the whole table at each compaction."""
    rewritten = {}
    for name, config in {
        "tiered": HygieneConfig(retention_hours=1.0, compact_min_files=4, small_file_bytes=60_000, target_file_bytes=10**6),
        "one target": HygieneConfig(retention_hours=1.0, compact_min_files=4, small_file_bytes=10**8 - 1,
                                    target_file_bytes=10**8),
    }.items():
        lake = str(tmp_path / name.replace(" ", "_"))
        appended = removed = 0
        before: dict[str, int] = {}
        for seed in range(32):
            _append(lake, 2_000, seed)  # ~16 kB
            grown = _sizes(lake)
            appended += sum(size for path, size in grown.items() if path not in before)
            before = grown
            tidy(lake, "t", config)
            after = _sizes(lake)
            removed += sum(size for path, size in before.items() if path not in after)
            before = after
        assert read_table(lake, "t").num_rows == 64_000
        rewritten[name] = removed / appended
    assert rewritten["tiered"] < 4 and rewritten["one target"] > 2 * rewritten["tiered"], rewritten


@pytest.mark.parametrize(("message", "kwargs"), [
    ("checkpoint_every must be >= 1 commit, got 0", {"checkpoint_every": 0}),
    ("retention_hours must be >= 1.0", {"retention_hours": 0.0}),
    ("compact_min_files must be >= 2 files, got 1", {"compact_min_files": 1}),
    ("0 < small_file_bytes < target_file_bytes", {"small_file_bytes": 0}),
    ("0 < small_file_bytes < target_file_bytes", {"small_file_bytes": 2**20, "target_file_bytes": 2**20}),
])
def test_invalid_config(message, kwargs):
    with pytest.raises(ValueError, match=message):
        HygieneConfig(**kwargs)


def test_missing_table(tmp_path):
    with pytest.raises(ValueError, match="no table 'x'"):
        tidy(str(tmp_path), "x", HygieneConfig())


SCHEMA = pa.schema([pa.field("ids", pa.list_(pa.string())), pa.field("ts_ms", pa.int64()), pa.field("x", pa.float64())])


def test_conform_keeps_declared_types_for_empty_lists_and_nulls(tmp_path):
    batch = pa.Table.from_pylist([{"x": 1.0, "ids": [], "ts_ms": None}, {"x": 2.0, "ids": [], "ts_ms": None}])
    assert batch.schema.field("ids").type == pa.list_(pa.null()) and batch.schema.field("ts_ms").type == pa.null()
    conformed = conform(batch, SCHEMA)
    assert conformed.schema == SCHEMA and conformed.column("ids").to_pylist() == [[], []]
    write_deltalake(f"{tmp_path}/t", conform(pa.Table.from_pylist([{"ids": ["a"], "ts_ms": 5, "x": 0.5}]), SCHEMA))
    write_deltalake(f"{tmp_path}/t", conformed, mode="append")
    assert read_table(str(tmp_path), "t").schema == SCHEMA


@pytest.mark.parametrize(("message", "rows"), [
    (r"batch lacks columns \['x'\]", [{"ids": [], "ts_ms": 1}]),
    ("column 'ts_ms': expected int64, got string", [{"ids": [], "ts_ms": "noon", "x": 1.0}]),
])
def test_conform_rejects(message, rows):
    with pytest.raises(ValueError, match=message):
        conform(pa.Table.from_pylist(rows), SCHEMA)
