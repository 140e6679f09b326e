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


def test_data_files_are_invisible_until_committed_once(tmp_path):
    from gemline.lake import commit_files_once, open_table, write_data_file

    data = pa.table({"x": pa.array([1, 2, 3], pa.int64()), "day": ["d1", "d 2", "d1"]})
    files = write_data_file(tmp_path, "t", data, name="part-a", partition_by=["day"])
    assert sorted((f["path"], f["num_records"]) for f in files) == [("day=d%202/part-a.parquet", 1),
                                                                     ("day=d1/part-a.parquet", 2)]
    assert open_table(tmp_path, "t") is None  # written, not committed
    # A retried writer writes the same names again: still two files, no duplicate rows.
    files = write_data_file(tmp_path, "t", data, name="part-a", partition_by=["day"])
    kwargs = {"app_id": "a", "partition_by": ["day"], "metadata": {"build": 0}}
    assert commit_files_once(tmp_path, "t", files, data.schema, version=0, **kwargs)
    assert not commit_files_once(tmp_path, "t", files, data.schema, version=0, **kwargs)
    assert sorted(read_table(tmp_path, "t").to_pylist(), key=lambda r: r["x"]) == [
        {"x": 1, "day": "d1"}, {"x": 2, "day": "d 2"}, {"x": 3, "day": "d1"}]
    assert commit_metadata(tmp_path, "t", "a") == {"app_id": "a", "build": 0, "txn_version": 0}
    # Overwrite replaces every file of the table with the new ones.
    more = write_data_file(tmp_path, "t", data.slice(1, 1), name="part-b", partition_by=["day"])
    assert commit_files_once(tmp_path, "t", more, data.schema, version=1, mode="overwrite", **kwargs)
    assert read_table(tmp_path, "t").to_pylist() == [{"x": 2, "day": "d 2"}]
    with pytest.raises(ValueError, match="must commit version 2 next, got 5"):
        commit_files_once(tmp_path, "t", more, data.schema, version=5, **kwargs)


def test_an_append_commit_removes_named_files_in_the_same_commit(tmp_path):
    from gemline.lake import commit_files_once, open_table, write_data_file

    data = pa.table({"x": pa.array([1, 2, 3], pa.int64())})
    kwargs = {"app_id": "a"}
    first = write_data_file(tmp_path, "t", data.slice(0, 2), name="first")
    assert commit_files_once(tmp_path, "t", first, data.schema, version=0, **kwargs)
    before = open_table(tmp_path, "t").version()
    second = write_data_file(tmp_path, "t", data.slice(2), name="second")
    rest = write_data_file(tmp_path, "t", data.slice(1, 1), name="first-kept")  # "first" without x = 1
    assert commit_files_once(tmp_path, "t", second + rest, data.schema, version=1, removes=first, **kwargs)
    assert sorted(read_table(tmp_path, "t").column("x").to_pylist()) == [2, 3]
    assert open_table(tmp_path, "t").version() == before + 1  # adds and removes in one commit
    assert sorted(read_table(tmp_path, "t", version=before).column("x").to_pylist()) == [1, 2]  # time travel
    with pytest.raises(ValueError, match="removes go with mode='append'"):
        commit_files_once(tmp_path, "t", rest, data.schema, version=2, mode="overwrite", removes=rest, **kwargs)


def test_data_files_encode_ids_and_times_plain_and_the_rest_with_dictionaries(tmp_path):
    """write_data_file: ``*_id`` and ``*_ms`` columns (nearly distinct), list values included, skip the
    dictionary; other columns, list values included, keep it; the rows read back unchanged."""
    import pyarrow.parquet as pq

    from gemline.lake import write_data_file

    data = pa.table({"event_id": [f"e{i}" for i in range(100)], "domain": ["d1", "d2"] * 50,
                     "seq_item_ids": [["i1", "i2"]] * 100, "event_time_ms": list(range(100)),
                     "seq_event_time_ms": [[i, i + 1] for i in range(100)], "position": [1, 2] * 50})
    (entry,) = write_data_file(tmp_path, "t", data, name="part")
    meta = pq.ParquetFile(tmp_path / "t" / entry["path"]).metadata.row_group(0)
    dictionary = {meta.column(i).path_in_schema: "RLE_DICTIONARY" in meta.column(i).encodings
                  for i in range(meta.num_columns)}
    assert dictionary == {"event_id": False, "domain": True, "seq_item_ids.list.element": True,
                          "event_time_ms": False, "seq_event_time_ms.list.element": False, "position": True}
    assert pq.read_table(tmp_path / "t" / entry["path"]).equals(data)


def test_a_versioned_open_is_kept_until_its_table_is_replaced(tmp_path):
    """open_table hands out the same snapshot for the same (table, version), the snapshot still reads
    that version after later commits, and a table replaced at the same path is opened afresh."""
    import shutil

    from gemline.lake import commit_once, open_table

    data = pa.table({"x": pa.array([1, 2], pa.int64())})
    commit_once(tmp_path, "t", data, app_id="a", version=0, mode="append")
    first = open_table(tmp_path, "t", 0)
    commit_once(tmp_path, "t", data, app_id="a", version=1, mode="append")
    assert open_table(tmp_path, "t", 0) is first
    assert first.version() == 0 and first.to_pyarrow_table().num_rows == 2
    assert open_table(tmp_path, "t").to_pyarrow_table().num_rows == 4  # latest: never kept
    shutil.rmtree(tmp_path / "t")
    commit_once(tmp_path, "t", pa.table({"x": pa.array([7, 8, 9], pa.int64())}), app_id="a", version=0,
                mode="append")
    again = open_table(tmp_path, "t", 0)
    assert again is not first and again.to_pyarrow_table().num_rows == 3
