"""Delta hygiene: compaction keeps rows, checkpoints every K, vacuum keeps referenced files, bad config."""

from __future__ import annotations

import pyarrow as pa
import pytest
from deltalake import write_deltalake

from gemline.hygiene import HygieneConfig, tidy
from gemline.lake import read_table


def test_compact_checkpoint_vacuum_keep_rows(tmp_path):
    lake = str(tmp_path)
    for i in range(4):
        write_deltalake(f"{lake}/t", pa.table({"a": [i, i + 10]}), mode="append")
    result = tidy(lake, "t", HygieneConfig(checkpoint_every=4, retention_hours=1.0))
    assert result.files_compacted == 4 and result.checkpointed  # version 4 after the compaction
    assert result.files_vacuumed == 0  # the compacted-away files are younger than the retention
    assert sorted(read_table(lake, "t").column("a").to_pylist()) == [0, 1, 2, 3, 10, 11, 12, 13]
    assert list((tmp_path / "t" / "_delta_log").glob("*.checkpoint.parquet"))


@pytest.mark.parametrize(("message", "kwargs"), [
    ("checkpoint_every must be >= 1 commit, got 0", {"checkpoint_every": 0}),
    ("retention_hours must be >= 1.0", {"retention_hours": 0.0}),
])
def test_invalid_config(message, kwargs):
    with pytest.raises(ValueError, match=message):
        HygieneConfig(**kwargs)


def test_missing_table(tmp_path):
    with pytest.raises(ValueError, match="no table 'x'"):
        tidy(str(tmp_path), "x", HygieneConfig())
