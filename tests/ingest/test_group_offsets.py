"""The ingested offsets are mirrored to the Kafka consumer group ``ingest.group_id`` after each events commit."""

from __future__ import annotations

import itertools
import logging
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from confluent_kafka import Producer

from gemline.cli import main
from gemline.config import GemlineConfig
from gemline.increments import latest_version
from gemline.lake import Lake, commit_metadata
from gemline.metrics import PipelineCollector
from gemline.run import kafka_lag_source
from ingest.broker import EmbeddedBroker
from ingest.config import IngestConfig, KafkaConfig
from ingest.kafka_clients import commit_group_offsets, group_offsets, make_client
from ingest.pipeline import app_id_for, mirror_to_group, run_ingest
from ingest.replay import ensure_topic
from ingest.schema import Event
from ingest.streaming import StreamingConfig, run_streaming
from tests.ingest.test_streaming import BASE_MS, REPO

PARTITIONS = 2
_ids = itertools.count()
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def broker():
    with EmbeddedBroker() as b:
        yield b


@pytest.fixture
def topic(broker) -> str:
    name = f"group-{next(_ids)}"
    ensure_topic(broker.bootstrap, name, PARTITIONS)
    return name


def _produce(bootstrap: str, topic: str, start: int, n: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "batch.num.messages": 1, "linger.ms": 0})
    for i in range(start, start + n):
        event = Event(event_id=f"e{i}", event_time_ms=BASE_MS + i * 60_000, user_id=f"u{i % 3}", item_id=f"i{i}",
                      domain="facebook", event_type="impression", position=1)
        producer.produce(topic, key=f"u{i % 3}".encode(), value=event.to_json(), partition=i % PARTITIONS)
    assert producer.flush(30) == 0


def _lake_offsets(lake, topic: str) -> dict[int, int]:
    meta = commit_metadata(lake.root, "events", app_id_for(topic)) or {}
    return {int(p): int(o) for p, o in meta.get("end_offsets", {}).items()}


def _high_watermarks(bootstrap: str, topic: str) -> dict[int, int]:
    client = make_client("confluent", bootstrap)
    try:
        return {p: high for p, (_, high) in client.end_offsets(topic).items()}
    finally:
        client.close()


def test_streaming_batches_commit_the_lake_offsets_to_the_group(broker, topic, tmp_path):
    lake, group = Lake(str(tmp_path / "lake")), f"{topic}-monitor"
    _produce(broker.bootstrap, topic, 0, 6)
    seen: list[dict[int, int]] = []

    def on_batch(result):
        seen.append(group_offsets(broker.bootstrap, group, topic, range(PARTITIONS)))
        if len(seen) == 1:
            assert seen[0] == _lake_offsets(lake, topic) == {0: 3, 1: 3}  # after batch 0, before more arrive
            _produce(broker.bootstrap, topic, 6, 5)

    summary = run_streaming(lake, KafkaConfig(topic=topic, partitions=PARTITIONS), IngestConfig(group_id=group),
                            StreamingConfig(commit_interval_s=0.01, max_batches=2), bootstrap=broker.bootstrap,
                            on_batch=on_batch)
    assert summary.committed == [0, 1]
    assert seen[1] == _lake_offsets(lake, topic) == _high_watermarks(broker.bootstrap, topic) == {0: 6, 1: 5}


def test_an_empty_group_id_commits_nothing(broker, topic, tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    _produce(broker.bootstrap, topic, 0, 4)
    result = run_ingest(lake, KafkaConfig(topic=topic), IngestConfig(group_id=""), bootstrap=broker.bootstrap)
    assert not result.skipped and _lake_offsets(lake, topic) == {0: 2, 1: 2}
    assert group_offsets(broker.bootstrap, IngestConfig().group_id, topic, range(PARTITIONS)) == {}


def test_a_failed_group_commit_warns_and_the_batch_stays_committed(broker, topic, tmp_path, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise RuntimeError("coordinator not available")

    monkeypatch.setattr("ingest.pipeline.commit_group_offsets", refuse)
    lake, group = Lake(str(tmp_path / "lake")), f"{topic}-monitor"
    _produce(broker.bootstrap, topic, 0, 4)
    with caplog.at_level(logging.WARNING, logger="ingest.pipeline"):
        result = run_ingest(lake, KafkaConfig(topic=topic), IngestConfig(group_id=group), bootstrap=broker.bootstrap)
    assert (result.skipped, result.events_written) == (False, 4)
    assert _lake_offsets(lake, topic) == {0: 2, 1: 2}
    assert group_offsets(broker.bootstrap, group, topic, range(PARTITIONS)) == {}
    assert f"consumer group {group!r} failed (RuntimeError: coordinator not available)" in caplog.text


def test_a_broker_that_does_not_answer_costs_the_timeout_and_a_warning(caplog):
    silent = socket.socket()  # accepts connections (the listen backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    bootstrap = f"127.0.0.1:{silent.getsockname()[1]}"
    try:
        with caplog.at_level(logging.WARNING, logger="ingest.pipeline"):
            assert not mirror_to_group(KafkaConfig(), IngestConfig(), bootstrap, {0: 3}, timeout_s=1.0)
    finally:
        silent.close()
    assert "failed (BrokerTimeoutError: group 'gemline-ingest': no commit within 1 s" in caplog.text


def test_explicit_offsets_are_committed_without_joining_the_group(broker, topic):
    group = f"{topic}-simple"
    commit_group_offsets(broker.bootstrap, group, topic, {0: 7, 1: 3}, timeout_s=10)
    assert group_offsets(broker.bootstrap, group, topic, range(PARTITIONS)) == {0: 7, 1: 3}
    commit_group_offsets(broker.bootstrap, group, topic, {1: 4}, timeout_s=10)
    assert group_offsets(broker.bootstrap, group, topic, range(PARTITIONS)) == {0: 7, 1: 4}


def test_the_lag_metric_is_produced_minus_ingested_as_a_group_lag_monitor_sees_it(broker, topic, tmp_path):
    group = f"{topic}-monitor"
    config = GemlineConfig(lake=str(tmp_path / "lake"), kafka=KafkaConfig(topic=topic, partitions=PARTITIONS),
                           ingest=IngestConfig(group_id=group))
    lake = Lake.for_config(config)
    _produce(broker.bootstrap, topic, 0, 6)
    run_ingest(lake, config.kafka, config.ingest, bootstrap=broker.bootstrap)
    _produce(broker.bootstrap, topic, 6, 5)  # not ingested: offsets 6, 8, 10 on partition 0; 7, 9 on 1
    collector = PipelineCollector(lake, tables=[], lag=kafka_lag_source(config, broker.bootstrap))
    family = next(f for f in collector.collect() if f.name == "gemline_consumer_lag")
    lag = {int(s.labels["partition"]): s.value for s in family.samples}
    assert lag == {0: 3, 1: 2}
    high, committed = _high_watermarks(broker.bootstrap, topic), group_offsets(broker.bootstrap, group, topic, [0, 1])
    assert {p: high[p] - committed[p] for p in high} == lag


def test_cli_streaming_ingest_serves_metrics(broker, topic, tmp_path):
    from tests.gemline.test_metrics import scrape

    lake = tmp_path / "lake"
    _produce(broker.bootstrap, topic, 0, 6)
    cmd = [sys.executable, "-m", "gemline.cli", "ingest", "--streaming", "--commit-interval-s", "0.2", "--metrics-port",
           "0", "--lake", str(lake), "--bootstrap", broker.bootstrap, "--topic", topic]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = next((line for line in proc.stderr if line.startswith("metrics: port ")), "")
        port = int(line.split()[2].rstrip(","))
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # a full pipe would block the child
        for _ in range(600):  # until the first batch is in the lake (bounded by polls)
            if latest_version(str(lake), "events") is not None:
                break
            time.sleep(0.1)
        got = scrape(port)  # the first scrape reads anew
        assert got["gemline_consumer_lag"] == {(("partition", "0"), ("topic", topic)): 0,
                                               (("partition", "1"), ("topic", topic)): 0}
        assert got["gemline_rows"][(("table", "events"),)] == 6
        assert "gemline_stage_restarts_total" not in got  # no supervisor in a single-stage command
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0


def test_cli_refuses_metrics_for_a_one_shot_ingest(capsys, tmp_path):
    assert main(["ingest", "--metrics-port", "0", "--lake", str(tmp_path), "--bootstrap", "127.0.0.1:1"]) == 2
    assert "--metrics-port is for the long-running `ingest --streaming`" in capsys.readouterr().err
