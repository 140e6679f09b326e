"""Idempotent Delta commits: (app_id, version) is written once, never twice."""

import pyarrow as pa
import pytest

from gemline.lake import commit_metadata, commit_once, committed_version, read_table


def _rows(*values):
    return pa.table({"x": pa.array(values, pa.int64())})


def test_commit_once_skips_a_repeated_version(tmp_path):
    assert commit_once(tmp_path, "t", _rows(1, 2), app_id="a", version=0, metadata={"end": 2})
    assert not commit_once(tmp_path, "t", _rows(1, 2), app_id="a", version=0, metadata={"end": 2})
    assert commit_once(tmp_path, "t", _rows(3), app_id="a", version=1, metadata={"end": 3})
    assert sorted(read_table(tmp_path, "t")["x"].to_pylist()) == [1, 2, 3]
    assert committed_version(tmp_path, "t", "a") == 1
    assert commit_metadata(tmp_path, "t", "a") == {"app_id": "a", "end": 3, "txn_version": 1}


def test_apps_are_independent_and_versions_cannot_skip(tmp_path):
    commit_once(tmp_path, "t", _rows(1), app_id="a", version=0)
    commit_once(tmp_path, "t", _rows(2), app_id="b", version=0, metadata={"k": "b"})
    assert commit_metadata(tmp_path, "t", "b")["k"] == "b"
    assert commit_metadata(tmp_path, "t", "c") is None
    with pytest.raises(ValueError, match="must commit version 1 next, got 5"):
        commit_once(tmp_path, "t", _rows(9), app_id="a", version=5)
    assert sorted(read_table(tmp_path, "t")["x"].to_pylist()) == [1, 2]


def test_missing_table_reads_as_none(tmp_path):
    assert read_table(tmp_path, "nothing") is None
    assert committed_version(tmp_path, "nothing", "a") is None
