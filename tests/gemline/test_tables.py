"""The table registry (gemline.tables): every spec names a real schema holding its partition columns, writes
through it refuse unknown tables and wrong partitioning with one clear message, the gate's and the profiles'
writes are idempotent app transactions, and a demo-like run writes exactly the registered tables."""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import pyarrow as pa
import pytest

from features.definitions import FEATURE_VIEWS
from gemline import tables
from gemline.errors import TableSpecError
from gemline.gate import QUALITY_SCHEMA, append_quality_rows, gate_decision, release
from gemline.lake import Lake, commit_once, committed_version, open_table, read_table
from gemline.tables import TABLES, Table
from ingest.schema import EVENTS_TABLE_SCHEMA
from tests.conftest import build_args, ingest_args, quality_sections, trainer_args
from validation.profiles import append_profile


def _resolve(ref: str) -> object:
    module, _, attribute = ref.partition(":")
    value: object = importlib.import_module(module)
    for part in attribute.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize("name", list(TABLES))
def test_each_spec_names_its_schema_and_the_schema_holds_the_partition_columns(name):
    spec = TABLES[name]
    schema = _resolve(spec.schema)
    assert isinstance(schema, pa.Schema), f"{spec.schema} is a {type(schema).__name__}"
    assert [c for c in spec.partition_by if c not in schema.names] == []
    package = spec.schema.split(".")[0]
    # The schema lives with the stage that owns the table; the gate's table (quality) in the core.
    assert package == spec.owner or (package, name) == ("gemline", Table.QUALITY)
    assert spec.name == name and tables.spec(str(name)) is spec and Table(str(name)).spec is spec


def test_the_feature_views_are_the_registered_feature_tables():
    assert {v.name: v.partition_by for v in FEATURE_VIEWS} == {
        Table.FEATURES_USER: ("domain", "event_date"), Table.FEATURES_ITEM: ("domain", "event_date"),
        Table.FEATURES_USER_CATEGORY: ("domain", "event_date")}
    assert all(_resolve(TABLES[v.name].schema) is v.schema for v in FEATURE_VIEWS)


def test_a_table_name_reads_as_its_string():
    assert Table.FEATURES_USER == "features/user" and f"{Table.EVENTS}/x" == "events/x"
    assert repr(Table.EXAMPLES) == "'examples'" and json.dumps([Table.QUALITY]) == '["quality"]'


ROOT = Path(__file__).resolve().parents[2]
WRITERS = {"write_deltalake", "commit_once", "commit_files_once", "write_data_file", "create_write_transaction",
           "CommitProperties", "Transaction"}


def test_no_stage_writes_a_table_around_the_registry():
    """Only gemline.lake and gemline.tables name the Delta writers; everything else calls gemline.tables."""
    found = []
    for package in ("gemline", "ingest", "sequences", "features", "validation", "trainer", "kernels"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.relative_to(ROOT).as_posix() in ("gemline/lake.py", "gemline/tables.py"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = ({a.name for a in node.names} if isinstance(node, ast.ImportFrom) else
                         {node.attr} if isinstance(node, ast.Attribute) else set())
                found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in sorted(names & WRITERS)]
    assert found == []


def _events(n: int, date: str | None = "2026-01-01") -> pa.Table:
    rows = [{"event_id": f"e{i}", "event_time_ms": 1_767_225_600_000 + i, "user_id": "u", "item_id": "i",
             "domain": "feed", "event_type": "impression", "schema_version": 1, "created_ts_ms": 1_767_225_600_001 + i,
             "event_date": date, "kafka_topic": "t", "kafka_partition": 0, "kafka_offset": i} for i in range(n)]
    return pa.Table.from_pylist(rows, schema=EVENTS_TABLE_SCHEMA)


# (table, data, files, the message's start): each refused before anything reaches the lake.
REFUSED = [
    ("event", _events(1), None, "no table 'event' in the registry (gemline.tables.TABLES); registered: events, "),
    (Table.EVENTS, _events(1).drop_columns(["event_date"]), None,
     "events: the data lacks the partition columns ['event_date'] of its spec (partitioned by ['event_date'])"),
    (Table.EXAMPLES, None, [{"path": "x.parquet", "size": 1, "partition_values": {}, "num_records": 1}],
     "examples: file 'x.parquet' has partition values for [] but the spec partitions by ['event_date']"),
]


@pytest.mark.parametrize(("table", "data", "files", "message"), REFUSED)
def test_a_write_that_breaks_the_registry_is_refused_with_one_line(tmp_path, table, data, files, message):
    with pytest.raises(TableSpecError) as info:
        if files is None:
            tables.commit(tmp_path, table, data, app_id="a", version=0)
        else:
            tables.commit_files(tmp_path, table, files, pa.schema([pa.field("event_date", pa.string())]),
                                app_id="a", version=0)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    assert info.value.exit_code == 2
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_table_in_the_lake_partitioned_otherwise_is_refused(tmp_path):
    # events written by other code, unpartitioned: the registry's write does not add to it.
    commit_once(tmp_path, "events", _events(2), app_id="other", version=0)
    with pytest.raises(TableSpecError) as info:
        tables.commit(tmp_path, Table.EVENTS, _events(1), app_id="ingest:t", version=0)
    assert str(info.value) == (
        f"{tmp_path / 'events'} is partitioned by [] but its spec (gemline.tables) says ['event_date']: it was "
        "written by other code; move it away or rewrite it with the spec's partitioning")
    assert read_table(tmp_path, "events").num_rows == 2 and committed_version(tmp_path, "events", "ingest:t") is None


def test_a_write_takes_its_partitioning_and_mode_from_the_spec(tmp_path):
    assert tables.commit(tmp_path, Table.EVENTS, _events(3), app_id="a", version=0)
    assert not tables.commit(tmp_path, Table.EVENTS, _events(3), app_id="a", version=0)  # a retry: nothing
    assert open_table(tmp_path, "events").metadata().partition_columns == ["event_date"]
    assert read_table(tmp_path, "events").num_rows == 3
    with pytest.raises(ValueError, match="must commit version 1 next, got 3"):
        tables.commit(tmp_path, Table.EVENTS, _events(1), app_id="a", version=3)
    # "increasing": any version above the last, the first one included (late_events, training_metrics).
    assert tables.commit(tmp_path, Table.EVENTS, _events(1), app_id="b", version=5, version_rule="increasing")
    assert not tables.commit(tmp_path, Table.EVENTS, _events(1), app_id="b", version=4, version_rule="increasing")
    assert read_table(tmp_path, "events").num_rows == 4


def _quality_rows(run_id: str, version: int, success: bool) -> list[dict]:
    return [{"table": "examples", "table_version": version, "run_id": run_id, "run_ts_ms": 10, "expectation": e,
             "severity": "critical", "success": success, "observed": "", "report_path": ""}
            for e in ("not_null", "leakage")]


def test_a_retried_quality_write_of_the_same_run_lands_once(tmp_path):
    rows = _quality_rows("r1", 0, False)
    assert append_quality_rows(tmp_path, rows, app_id="validate:r1")
    assert not append_quality_rows(tmp_path, rows, app_id="validate:r1")
    assert read_table(tmp_path, "quality").num_rows == 2
    assert committed_version(tmp_path, "quality", "validate:r1") == 0
    # Without an app id the rows name the writer: the same rows once, other rows again.
    assert append_quality_rows(tmp_path, _quality_rows("r2", 1, True))
    assert not append_quality_rows(tmp_path, _quality_rows("r2", 1, True))
    assert append_quality_rows(tmp_path, _quality_rows("r3", 1, False))
    assert read_table(tmp_path, "quality").num_rows == 6
    assert read_table(tmp_path, "quality").schema == QUALITY_SCHEMA
    assert not append_quality_rows(tmp_path, [])


def test_two_releases_in_the_same_millisecond_are_both_recorded(tmp_path):
    append_quality_rows(tmp_path, _quality_rows("r1", 0, False) + _quality_rows("r1", 1, False))
    release(tmp_path, "examples", 0, "checked", now_ms=11)
    release(tmp_path, "examples", 1, "checked", now_ms=11)
    assert gate_decision(tmp_path, "examples", 0).allowed and gate_decision(tmp_path, "examples", 1).allowed
    assert read_table(tmp_path, "quality").num_rows == 4 + 2


def test_a_retried_profile_write_of_the_same_run_lands_once(tmp_path):
    kwargs = dict(table="events", table_version=3, run_id="r1", run_ts_ms=5, passed=True,
                  profile={"num_rows": 10.0, "null_rate:age": 0.5, "mean:position": float("nan")})
    assert append_profile(tmp_path, **kwargs)
    assert not append_profile(tmp_path, **kwargs)  # same run: app transaction (validate:r1, 0) is there
    profiles = read_table(tmp_path, "quality_profiles")
    assert sorted(profiles["metric"].to_pylist()) == ["null_rate:age", "num_rows"]  # NaN skipped, nothing twice
    assert committed_version(tmp_path, "quality_profiles", "validate:r1") == 0
    assert append_profile(tmp_path, **{**kwargs, "run_id": "r2"})
    assert read_table(tmp_path, "quality_profiles").num_rows == 4


def _delta_tables(lake: Path) -> set[str]:
    return {str(log.parent.relative_to(lake)) for log in lake.rglob("_delta_log")}


@pytest.mark.slow
@pytest.mark.integration
def test_a_demo_like_run_writes_exactly_the_registered_tables(tmp_path):
    """generate -> ingest -> validate events -> build -> validate examples, twice, then the continuous
    trainer: every Delta table in the lake is in the registry, and every registered one was written."""
    from confluent_kafka.admin import AdminClient, NewTopic

    from gemline.config import load_config
    from ingest.broker import EmbeddedBroker
    from ingest.generate import GenerateConfig, generate_records, stream_records
    from ingest.pipeline import run_ingest
    from sequences.pipeline import run_build
    from trainer.continuous import run_once
    from validation.run import validate_table

    lake = tmp_path / "lake"
    day_ms = 86_400_000
    with EmbeddedBroker() as broker:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})  # kept: its futures need the handle alive
        admin.create_topics([NewTopic("events", num_partitions=2, replication_factor=1)])["events"].result(timeout=30)
        config = load_config(overrides={
            "lake": str(lake), "kafka.topic": "events", "kafka.partitions": "2", "trainer.model": "lr",
            "trainer.log_teacher_predictions": "true",
            "trainer.batch_size": "64", "trainer.num_embeddings": "1000", "build.shards": "2",
            "validation.gx_sample_rows": "200"})
        for part in range(2):
            start_ms = 1_767_225_600_000 + part * 2 * day_ms
            records = generate_records(GenerateConfig(num_users=40, num_ads=20, days=1.0, start_ms=start_ms,
                                                      bad_rate=0.05, seed=part))
            stream_records(records, bootstrap=broker.bootstrap, topic="events", partitions=2, progress=False)
            assert not run_ingest(*ingest_args(config), bootstrap=broker.bootstrap,
                                  now_ms=start_ms + 3 * day_ms).skipped
            validate_table(Lake.for_config(config), Table.EVENTS, now_ms=start_ms + 3 * day_ms,
                           **quality_sections(config))
            built = run_build(*build_args(config), final=True)
            validate_table(Lake.for_config(config), Table.EXAMPLES, built.examples_version,
                           now_ms=start_ms + 3 * day_ms, **quality_sections(config))
        run_once(*trainer_args(config))
    assert read_table(lake, Table.TRAINING_METRICS).num_rows > 0  # the trainer evaluated the second version
    assert _delta_tables(lake) == set(TABLES)
