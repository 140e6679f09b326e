"""The lake on an object store: Delta tables and plain files on S3 (moto_server on 127.0.0.1).

moto_server runs as a subprocess on a free port for this module; a bucket per test keeps tests
independent. Every table kind gemline writes is round-tripped: a partitioned append with app
transactions (events), an overwrite (sequences, features), a read at an older version, and the
commit metadata the stages restart from.
"""

from __future__ import annotations

import itertools
import json

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from gemline.config import load_config
from gemline.lake import (
    CommitConflictError,
    commit_metadata,
    commit_once,
    committed_version,
    is_remote,
    lake_fs,
    open_table,
    read_table,
    table_uri,
)

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


def test_lake_options_commit_by_conditional_put(s3_lake):
    _, opts = s3_lake
    assert opts["AWS_CONDITIONAL_PUT"] == "etag" and "AWS_S3_ALLOW_UNSAFE_RENAME" not in opts


def _log_entry(lake: str, opts: dict[str, str], table: str, version: int) -> list[dict]:
    """The actions of ``table``'s commit ``version``, read straight from ``_delta_log``."""
    import json

    fs, root = lake_fs(lake, opts)
    with fs.open_input_stream(f"{root}/{table}/_delta_log/{version:020d}.json") as src:
        return [json.loads(line) for line in src.read().decode().splitlines() if line]


def _race(writers, barrier_timeout_s: float = 60.0) -> dict[int, object]:
    """Run each writer in its own thread; {index: return value or the exception it raised}."""
    import threading

    results: dict[int, object] = {}

    def run(i, writer):
        try:
            results[i] = writer()
        except Exception as exc:  # noqa: BLE001  (the race's loser: asserted on below)
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, w)) for i, w in enumerate(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(barrier_timeout_s)
    assert not any(t.is_alive() for t in threads)
    return results


def test_two_writers_of_one_version_one_wins_the_other_conflicts(s3_lake):
    """Two delta-rs writers on snapshots of version 1 both commit version 2 at once, retries off:
    the conditional put lets exactly one write ``_delta_log/...002.json``; the other fails."""
    import threading

    from deltalake import CommitProperties, DeltaTable, write_deltalake
    from deltalake.exceptions import CommitFailedError

    lake, opts = s3_lake
    uri = table_uri(lake, "events")
    for ids in ([1], [2]):
        write_deltalake(uri, _events(ids, "2026-01-01"), mode="append", storage_options=opts)
    snapshots = [DeltaTable(uri, storage_options=opts) for _ in range(2)]
    assert [s.version() for s in snapshots] == [1, 1]
    start = threading.Barrier(2, timeout=60)

    def writer(i):
        def write():
            start.wait()
            write_deltalake(snapshots[i], _events([10 + i], "2026-01-01"), mode="append",
                            commit_properties=CommitProperties(max_commit_retries=0))
            return "committed"
        return write

    results = _race([writer(0), writer(1)])
    winners = [i for i, r in results.items() if r == "committed"]
    losers = [r for r in results.values() if r != "committed"]
    assert len(winners) == 1 and len(losers) == 1 and isinstance(losers[0], CommitFailedError), results
    table = DeltaTable(uri, storage_options=opts)
    assert table.version() == 2
    assert sorted(read_table(lake, "events", storage_options=opts)["value"].to_pylist()) == [1, 2, 10 + winners[0]]
    # The log's commit 2 is the winner's, whole: one added file, the winner's row.
    adds = [a["add"] for a in _log_entry(lake, opts, "events", 2) if "add" in a]
    assert len(adds) == 1 and json.loads(adds[0]["stats"])["numRecords"] == 1
    assert [e["version"] for e in table.history()] == [2, 1, 0]


def test_two_commits_of_one_batch_one_wins_the_other_raises(s3_lake, monkeypatch):
    """Two runs commit the same batch (app "ingest:t", version 1) at once, each having checked that
    version 1 is next: exactly one commits, the other gets CommitConflictError, no row twice."""
    import threading

    import gemline.lake as lake_module

    lake, opts = s3_lake
    assert commit_once(lake, "events", _events([1, 2], "2026-01-01"), app_id="ingest:t", version=0,
                       partition_by=["event_date"], storage_options=opts)
    checked = threading.Barrier(2, timeout=60)
    is_next = lake_module._is_next_version

    def is_next_then_wait(*args, **kwargs):
        answer = is_next(*args, **kwargs)
        checked.wait()  # both writers have read the snapshot and passed the check before either commits
        return answer

    monkeypatch.setattr(lake_module, "_is_next_version", is_next_then_wait)

    def writer(ids):
        return lambda: commit_once(lake, "events", _events(ids, "2026-01-02"), app_id="ingest:t", version=1,
                                   partition_by=["event_date"], metadata={"writer": ids[0]}, storage_options=opts)

    results = _race([writer([3, 4]), writer([5, 6])])
    winners = [i for i, r in results.items() if r is True]
    losers = [r for r in results.values() if r is not True]
    assert len(winners) == 1 and len(losers) == 1, results
    assert isinstance(losers[0], CommitConflictError)
    assert "another writer committed to this table" in str(losers[0]) and "'ingest:t', version 1" in str(losers[0])
    won = [[3, 4], [5, 6]][winners[0]]
    assert sorted(read_table(lake, "events", storage_options=opts)["value"].to_pylist()) == [1, 2, *won]
    assert committed_version(lake, "events", "ingest:t", storage_options=opts) == 1
    assert open_table(lake, "events", storage_options=opts).version() == 1
    assert commit_metadata(lake, "events", "ingest:t", storage_options=opts)["writer"] == won[0]


def test_two_writers_of_different_apps_both_land(s3_lake, monkeypatch):
    """Two different writers (app ids) commit at once from the same snapshot: neither commit is lost
    or overwritten; delta-rs puts the second at the next version."""
    import threading

    import gemline.lake as lake_module

    lake, opts = s3_lake
    assert commit_once(lake, "events", _events([1], "2026-01-01"), app_id="a", version=0, storage_options=opts)
    checked = threading.Barrier(2, timeout=60)
    is_next = lake_module._is_next_version

    def is_next_then_wait(*args, **kwargs):
        answer = is_next(*args, **kwargs)
        checked.wait()
        return answer

    monkeypatch.setattr(lake_module, "_is_next_version", is_next_then_wait)
    results = _race([
        lambda: commit_once(lake, "events", _events([2], "2026-01-01"), app_id="a", version=1, storage_options=opts),
        lambda: commit_once(lake, "events", _events([3], "2026-01-01"), app_id="b", version=0, storage_options=opts),
    ])
    assert results == {0: True, 1: True}
    assert sorted(read_table(lake, "events", storage_options=opts)["value"].to_pylist()) == [1, 2, 3]
    assert open_table(lake, "events", storage_options=opts).version() == 2
    txns = sorted((a["txn"]["appId"], a["txn"]["version"]) for v in (1, 2)
                  for a in _log_entry(lake, opts, "events", v) if "txn" in a)
    assert txns == [("a", 1), ("b", 0)]  # one commit each, neither overwritten
