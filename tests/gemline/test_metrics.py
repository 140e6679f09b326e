"""Prometheus metrics: the values served on /metrics equal what the lake, Kafka and the supervisor hold."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pyarrow as pa
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gemline.gate import RELEASE, append_quality_rows, gate_decisions, release
from gemline.lake import Lake, commit_metadata, commit_once, open_table, read_table
from gemline.metrics import (
    LagSource,
    PipelineCollector,
    StageSample,
    consumer_lag,
    lake_offsets,
    quarantined_versions,
    serve,
)
from gemline.run import stage_samples
from gemline.supervisor import StageCommand, Supervisor

REPO = Path(__file__).resolve().parents[2]
TOPIC = "gemline.events"
APP = f"ingest:{TOPIC}"


def _rows(n: int, start: int = 0) -> pa.Table:
    return pa.table({"x": pa.array(range(start, start + n), pa.int64())})


def _check(table: str, version: int, run: str, ts: int, success: bool) -> dict:
    return {"table": table, "table_version": version, "run_id": run, "run_ts_ms": ts, "expectation": "not_null",
            "severity": "critical", "success": success, "observed": "", "report_path": ""}


@pytest.fixture
def lake(tmp_path) -> Lake:
    """events: two ingest batches (5 + 2 rows, offsets {0: 4, 1: 3} then {0: 6, 1: 3}) and a commit of another
    writer after them; examples: three versions, v0 and v2 failed a critical check, v2 then released."""
    lake = Lake(str(tmp_path / "lake"))
    commit_once(lake, "events", _rows(5), app_id=APP, version=0, metadata={"end_offsets": {"0": 4, "1": 3}})
    commit_once(lake, "events", _rows(2, 5), app_id=APP, version=1, metadata={"end_offsets": {"0": 6, "1": 3}})
    commit_once(lake, "events", _rows(1, 7), app_id="backfill", version=0)
    for v in range(3):
        commit_once(lake, "examples", _rows(4, 10 * v), app_id="build", version=v)
    append_quality_rows(lake, [_check("examples", 0, "r0", 1_000, False), _check("examples", 1, "r1", 2_000, True),
                               _check("examples", 2, "r2", 3_000, False), _check("events", 1, "r3", 3_000, True)])
    release(lake, "examples", 2, "checked by hand", now_ms=4_000)
    return lake


def _freshness(lake: Lake) -> None:
    rows = [("ingest", 0, 1.0, 2.0, 3.0), ("ingest", 2, 1.5, 2.5, 3.5), ("ingest", 1, 9.0, 9.0, 9.0),
            ("train", 2, 30.0, 60.0, 90.0)]
    commit_once(lake, "freshness", pa.table({
        "hop": [r[0] for r in rows], "examples_version": pa.array([r[1] for r in rows], pa.int64()),
        "p50_s": [r[2] for r in rows], "p95_s": [r[3] for r in rows], "p99_s": [r[4] for r in rows]}),
        app_id="freshness", version=0)


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    """{metric family name: {labels as sorted (name, value) pairs: value}} of one scrape of /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def _served(collector) -> dict[str, dict[tuple, float]]:
    server, port = serve(collector, 0, addr="127.0.0.1")
    try:
        return scrape(port)
    finally:
        server.shutdown()
        server.server_close()


def test_consumer_lag_is_the_high_watermark_minus_the_committed_offset():
    # Partition 2 was never committed: ingest starts it at its low watermark, 4.
    assert consumer_lag({0: (0, 10), 1: (0, 3), 2: (4, 9)}, {0: 6, 1: 3}) == {0: 4, 1: 0, 2: 5}


def test_lake_offsets_are_those_of_the_apps_newest_events_commit(lake):
    assert lake_offsets(lake, APP) == {0: 6, 1: 3}
    assert lake_offsets(lake, "ingest:other") == {}
    # The newest commit is another writer's: past the newest `recent` ones, the whole history is read.
    assert commit_metadata(lake, "events", APP, recent=1)["end_offsets"] == {"0": 6, "1": 3}


def test_the_endpoint_serves_the_lakes_values(lake):
    _freshness(lake)
    stages = [StageSample("ingest", 2, True), StageSample("build", 0, False)]
    collector = PipelineCollector(lake, lag=LagSource(TOPIC, APP, lambda: {0: (0, 10), 1: (0, 3), 2: (4, 9)}),
                                  stages=lambda: stages)
    got = _served(collector)
    assert got["gemline_consumer_lag"] == {(("partition", "0"), ("topic", TOPIC)): 4,
                                           (("partition", "1"), ("topic", TOPIC)): 0,
                                           (("partition", "2"), ("topic", TOPIC)): 5}
    versions = {t: open_table(lake, t).version() for t in ("events", "examples", "quality", "freshness")}
    assert versions["events"] == 2 and versions["examples"] == 2
    assert got["gemline_table_version"] == {(("table", t),): v for t, v in versions.items()}
    assert got["gemline_rows"] == {(("table", t),): read_table(lake, t).num_rows for t in versions}
    assert got["gemline_rows"][(("table", "events"),)] == 8
    # examples@0 failed its only run; examples@2 failed but was released; events@1 passed.
    assert got["gemline_quarantined_versions"] == {(("table", "examples"),): 1, (("table", "events"),): 0}
    assert got["gemline_freshness_seconds"] == {
        (("hop", "ingest"), ("quantile", "0.5")): 1.5, (("hop", "ingest"), ("quantile", "0.95")): 2.5,
        (("hop", "ingest"), ("quantile", "0.99")): 3.5, (("hop", "train"), ("quantile", "0.5")): 30.0,
        (("hop", "train"), ("quantile", "0.95")): 60.0, (("hop", "train"), ("quantile", "0.99")): 90.0}
    assert got["gemline_stage_restarts_total"] == {(("stage", "ingest"),): 2, (("stage", "build"),): 0}
    assert got["gemline_stage_up"] == {(("stage", "ingest"),): 1, (("stage", "build"),): 0}
    assert "gemline_collect_errors_total" not in got


def test_a_missing_freshness_table_and_a_broken_broker_leave_the_rest(lake):
    def down():
        raise ConnectionError("broker down")

    got = _served(PipelineCollector(lake, lag=LagSource(TOPIC, APP, down)))
    assert "gemline_freshness_seconds" not in got and "gemline_consumer_lag" not in got
    assert got["gemline_collect_errors_total"] == {(("part", "kafka"),): 1}
    assert got["gemline_table_version"][(("table", "events"),)] == 2


def test_values_are_read_again_only_after_the_cache_time(lake):
    now = [100.0]
    collector = PipelineCollector(lake, tables=["events"], cache_s=5.0, clock=lambda: now[0])

    def version() -> float:
        family = next(f for f in collector.collect() if f.name == "gemline_table_version")
        return family.samples[0].value

    assert version() == 2
    commit_once(lake, "events", _rows(1), app_id=APP, version=2, metadata={"end_offsets": {"0": 7, "1": 3}})
    now[0] += 4.9
    assert version() == 2
    now[0] += 0.1
    assert version() == 3


def test_a_killed_stage_is_counted_as_a_restart(tmp_path):
    sleeper = StageCommand("sleeper", (sys.executable, "-c", "import time; time.sleep(600)"))
    sup = Supervisor([sleeper], log_dir=tmp_path / "logs", backoff_s=0.0)
    collector = PipelineCollector(Lake(str(tmp_path / "lake")), tables=[], stages=lambda: stage_samples(sup),
                                  cache_s=0.0)
    try:
        sup.start()
        first = sup.stages[0].pid
        before = _served(collector)
        os.kill(first, signal.SIGKILL)
        for _ in range(600):  # until the supervisor noticed the exit and started it again (bounded by polls)
            sup.poll()
            if sup.stages[0].pid not in (None, first):
                break
            time.sleep(0.05)
        after = _served(collector)
    finally:
        sup.stop(grace_s=5)
    assert before["gemline_stage_restarts_total"] == {(("stage", "sleeper"),): 0}
    assert after["gemline_stage_restarts_total"] == {(("stage", "sleeper"),): 1}
    assert after["gemline_stage_up"] == {(("stage", "sleeper"),): 1}


def test_cli_refuses_metrics_for_a_one_shot_build(capsys, tmp_path):
    from gemline.cli import main

    assert main(["build", "--metrics-port", "0", "--lake", str(tmp_path)]) == 2
    assert "--metrics-port is for the long-running `build --follow`" in capsys.readouterr().err


@pytest.mark.parametrize("seed", range(4))
def test_quarantined_versions_match_the_gates_decisions(tmp_path, seed):
    """Random validation histories (ties in run time, warnings, releases before, at and after the newest run, a
    release without any run): the column-wise rule refuses exactly the versions gate_decisions refuses."""
    rng = random.Random(seed)
    rows = []
    for table in ("events", "examples"):
        for version in range(8):
            for run in range(rng.randint(0, 3)):
                ts, run_id = rng.choice([1_000, 2_000, 3_000]), f"r{rng.randint(0, 9)}-{run}"
                for expectation in ("not_null", "range", "drift"):
                    rows.append({**_check(table, version, run_id, ts, rng.random() < 0.6),
                                 "expectation": expectation, "severity": rng.choice(["critical", "warning"])})
            if rng.random() < 0.4:
                rows.append({**_check(table, version, f"release-{version}", rng.choice([500, 2_000, 3_000, 4_000]),
                                      True), "expectation": RELEASE, "severity": "release"})
    lake = Lake(str(tmp_path / "lake"))
    append_quality_rows(lake, rows)
    expected = sorted((table, v) for table in ("events", "examples")
                      for v, d in gate_decisions(lake, table, range(8)).items() if d.validated and not d.allowed)
    got = quarantined_versions(read_table(lake, "quality"))
    assert list(zip(got["table"].to_pylist(), got["table_version"].to_pylist())) == expected
    assert 0 < len(expected) < 16  # the histories hold both verdicts


def test_a_release_is_seen_at_the_next_read(lake):
    collector = PipelineCollector(lake, tables=[], cache_s=0.0)

    def examples_quarantined() -> float:
        family = next(f for f in collector.collect() if f.name == "gemline_quarantined_versions")
        return next(s.value for s in family.samples if s.labels["table"] == "examples")

    assert examples_quarantined() == 1
    release(lake, "examples", 0, "a known gap", now_ms=5_000)
    assert examples_quarantined() == 0


def test_cli_build_follow_serves_metrics(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    for v in range(2):
        commit_once(lake, "examples", _rows(3, 3 * v), app_id="build", version=v)
    cmd = [sys.executable, "-m", "gemline.cli", "build", "--follow", "--interval-s", "60", "--metrics-port", "0",
           "--lake", lake.root]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = next((line for line in proc.stderr if line.startswith("metrics: port ")), "")
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # a full pipe would block the child
        got = scrape(int(line.split()[2].rstrip(",")))
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert got["gemline_table_version"] == {(("table", "examples"),): 1}
    assert got["gemline_rows"] == {(("table", "examples"),): 6}
    assert "gemline_consumer_lag" not in got  # no Kafka cluster configured: no lag metric
    assert proc.returncode == 0


def test_metrics_listen_on_loopback_unless_told_otherwise(tmp_path):
    from gemline.cli import build_parser
    from gemline.config import load_config
    from gemline.run import serving_metrics

    collector = PipelineCollector(Lake(str(tmp_path / "lake")), tables=[])
    server, _ = serve(collector, 0)
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.shutdown()
        server.server_close()
    config = load_config(overrides={"lake": str(tmp_path / "lake")})
    for addr, where in (("127.0.0.1", "this machine only"), ("0.0.0.0", "all interfaces")):
        said: list[str] = []
        with serving_metrics(config, 0, bootstrap=None, say=said.append, addr=addr):
            port = int(said[0].split()[2])
            assert scrape(port) is not None
        assert said[0] == f"metrics: port {port} on {addr}, {where} (http://127.0.0.1:{port}/metrics)"
    parser = build_parser()
    for command in (["run"], ["build", "--follow"], ["ingest", "--streaming"]):
        args, _ = parser.parse_known_args(command)
        assert args.metrics_addr == "127.0.0.1", command
    args, _ = parser.parse_known_args(["run", "--metrics-addr", "0.0.0.0"])
    assert args.metrics_addr == "0.0.0.0"
