"""Delta hygiene: compaction keeps rows, checkpoints every K, vacuum keeps referenced files, bad config."""

from __future__ import annotations

import pyarrow as pa
import pytest
from deltalake import write_deltalake

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


@pytest.mark.parametrize(("message", "kwargs"), [
    ("checkpoint_every must be >= 1 commit, got 0", {"checkpoint_every": 0}),
    ("retention_hours must be >= 1.0", {"retention_hours": 0.0}),
    ("compact_min_files must be >= 2 files, got 1", {"compact_min_files": 1}),
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
