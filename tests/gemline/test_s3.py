"""The lake on an object store: Delta tables and plain files on S3 (moto_server on 127.0.0.1).

moto_server runs as a subprocess on a free port for this module; a bucket per test keeps tests
independent. Every table kind gemline writes is round-tripped: a partitioned append with app
transactions (events), an overwrite (sequences, features), a read at an older version, and the
commit metadata the stages restart from.
"""

from __future__ import annotations

import itertools

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from gemline.config import load_config
from gemline.lake import (commit_metadata, commit_once, committed_version, is_remote, lake_fs, open_table,
                          read_table, table_uri)

from .conftest import s3_bucket

pytestmark = pytest.mark.integration

_buckets = itertools.count()


@pytest.fixture
def s3_lake(moto_endpoint):
    """(lake URI, storage options) for a fresh bucket."""
    bucket = f"lake-{next(_buckets)}"
    options = s3_bucket(moto_endpoint, bucket)
    return f"s3://{bucket}/prefix", options


def _events(ids: list[int], day: str) -> pa.Table:
    return pa.table({"event_id": pa.array([f"e{i}" for i in ids], pa.string()),
                     "value": pa.array(ids, pa.int64()),
                     "event_date": pa.array([day] * len(ids), pa.string())})


def test_partitioned_append_is_exactly_once_on_s3(s3_lake):
    lake, opts = s3_lake
    assert commit_once(lake, "events", _events([1, 2], "2026-01-01"), app_id="ingest:t", version=0,
                       partition_by=["event_date"], metadata={"end_offsets": {"0": 2}}, storage_options=opts)
    # A retried commit of the same batch writes nothing.
    assert not commit_once(lake, "events", _events([1, 2], "2026-01-01"), app_id="ingest:t", version=0,
                           partition_by=["event_date"], storage_options=opts)
    assert commit_once(lake, "events", _events([3], "2026-01-02"), app_id="ingest:t", version=1,
                       partition_by=["event_date"], metadata={"end_offsets": {"0": 3}}, storage_options=opts)
    table = read_table(lake, "events", storage_options=opts)
    assert sorted(table["value"].to_pylist()) == [1, 2, 3]
    assert committed_version(lake, "events", "ingest:t", storage_options=opts) == 1
    assert commit_metadata(lake, "events", "ingest:t", storage_options=opts) == {
        "app_id": "ingest:t", "end_offsets": {"0": 3}, "txn_version": 1}
    # Read at an older version: only the first batch.
    assert sorted(read_table(lake, "events", version=0, storage_options=opts)["value"].to_pylist()) == [1, 2]
    dt = open_table(lake, "events", storage_options=opts)
    assert dt.metadata().partition_columns == ["event_date"]
    assert all(u.startswith(f"{lake}/events/event_date=") for u in dt.file_uris())
    assert sorted({u.split("/")[-2] for u in dt.file_uris()}) == ["event_date=2026-01-01", "event_date=2026-01-02"]


def test_overwrite_replaces_rows_and_keeps_history(s3_lake):
    lake, opts = s3_lake
    commit_once(lake, "sequences", _events([1, 2, 3], "d"), app_id="build", version=0, mode="overwrite",
                metadata={"build": 0}, storage_options=opts)
    commit_once(lake, "sequences", _events([7], "d"), app_id="build", version=1, mode="overwrite",
                metadata={"build": 1}, storage_options=opts)
    assert read_table(lake, "sequences", storage_options=opts)["value"].to_pylist() == [7]
    assert sorted(read_table(lake, "sequences", version=0, storage_options=opts)["value"].to_pylist()) == [1, 2, 3]
    assert commit_metadata(lake, "sequences", "build", storage_options=opts)["build"] == 1
    assert read_table(lake, "missing", storage_options=opts) is None
    assert committed_version(lake, "missing", "build", storage_options=opts) is None


def test_plain_files_round_trip_through_lake_fs(s3_lake):
    lake, opts = s3_lake
    fs, root = lake_fs(lake, opts)
    assert isinstance(fs, pafs.S3FileSystem)
    path = f"{root}/_quality/events/0/report.json"
    fs.create_dir(f"{root}/_quality/events/0")
    with fs.open_output_stream(path) as out:
        out.write(b'{"passed": true}')
    with fs.open_input_stream(path) as src:
        assert src.read() == b'{"passed": true}'
    assert [i.path for i in fs.get_file_info(pafs.FileSelector(f"{root}/_quality", recursive=True)) if i.is_file] == [path]


def test_local_paths_are_unchanged(tmp_path):
    assert not is_remote(tmp_path) and is_remote("s3://b/p")
    assert table_uri(tmp_path, "features/user") == str(tmp_path / "features/user")
    assert table_uri("s3://b/p/", "features/user") == "s3://b/p/features/user"
    fs, root = lake_fs(tmp_path)
    assert isinstance(fs, pafs.LocalFileSystem) and root == str(tmp_path.absolute())
    # Options are ignored for a local lake (the same config can point at either).
    assert commit_once(tmp_path, "t", _events([1], "d"), app_id="a", version=0, storage_options={"AWS_REGION": "x"})


@pytest.mark.parametrize("lake, options, error, match", [
    ("gs://bucket/p", {}, ValueError, "expected a local path or one of"),
    ("s3://b/p", {"AWS_ENDPOINT_URL": "http://127.0.0.1:1"}, ValueError, "set AWS_ALLOW_HTTP='true'"),
    ("s3://b/p", {"AWS_ALLOW_HTTP": True}, TypeError, "expected str keys and str values"),
])
def test_lake_fs_rejects_bad_input(lake, options, error, match):
    with pytest.raises(error, match=match):
        lake_fs(lake, options)


def test_config_carries_storage_options(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('lake = "s3://b/p"\n[lake_storage_options]\nAWS_REGION = "eu-west-1"\n')
    config = load_config(toml, {"lake_storage_options.AWS_ALLOW_HTTP": "true"})
    assert config.lake_storage_options == {"AWS_REGION": "eu-west-1", "AWS_ALLOW_HTTP": "true"}
    toml.write_text('[lake_storage_options]\nAWS_ALLOW_HTTP = true\n')
    with pytest.raises(ValueError, match="lake_storage_options.AWS_ALLOW_HTTP: expected a string"):
        load_config(toml)
