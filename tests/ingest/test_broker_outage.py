"""Streaming ingest through a Kafka outage: it waits with backoff, says so once per outage and once when the
cluster is back, and afterwards every record produced before and after the outage is in the lake exactly once.

The embedded broker (tansu) keeps its data in memory only (``ingest.broker``; its s3:// engine did not keep
the data of a restarted broker against moto here), so a broker process ended and started again would come
back empty. The outage here is the broker process stopped with SIGSTOP and resumed with SIGCONT: its port
stays bound (the kernel still completes handshakes) and nothing answers, which ingest meets as requests
that time out after ``ingest.read_timeout_s``; the refused-connection case is the unit test's.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from gemline.config import GemlineConfig
from gemline.errors import BrokerTimeoutError, BrokerUnreachableError
from ingest.broker import EmbeddedBroker
from ingest.config import IngestConfig, KafkaConfig
from ingest.pipeline import IngestResult
from ingest.streaming import StreamingConfig, run_streaming
from tests.conftest import ingest_args
from tests.ingest.test_streaming import PARTITIONS, _coords, _produce, assert_exactly_once

REPO = Path(__file__).resolve().parents[2]
OUTAGE_S = 30.0
"""How long the broker stays stopped: the issue's 30 s (the whole test stays under a minute on a quiet machine)."""


def test_unreachable_cluster_is_retried_with_backoff_and_said_once_per_outage(tmp_path, monkeypatch, caplog):
    # Try k of run_ingest: ok, 3 refusals (one outage), ok, 1 timeout (a second outage), ok.
    script = ["ok", "refused", "refused", "refused", "ok", "timeout", "ok"]
    tries: list[float] = []
    waits: list[float] = []

    def fake_run_ingest(*args, **kwargs):
        outcome = script[len(tries)]
        tries.append(time.monotonic())
        if outcome == "refused":
            raise BrokerUnreachableError("connection refused by 127.0.0.1:1")
        if outcome == "timeout":
            raise BrokerTimeoutError("no answer within 3 s")
        return IngestResult(batch_version=len(tries), events_written=2, dead_letter_written=1, offset_ranges=(),
                            skipped=False)

    stop = threading.Event()
    real_wait = stop.wait
    monkeypatch.setattr(stop, "wait", lambda s: waits.append(s) or real_wait(0))
    monkeypatch.setattr("ingest.streaming.run_ingest", fake_run_ingest)
    cfg = GemlineConfig(lake=str(tmp_path / "lake"), kafka=KafkaConfig(topic="t"), ingest=IngestConfig())
    streaming = StreamingConfig(commit_interval_s=0.01, max_batches=3, retry_backoff_s=0.5, max_retry_backoff_s=1.5)
    with caplog.at_level(logging.WARNING, logger="ingest.streaming"):
        summary = run_streaming(*ingest_args(cfg), streaming, bootstrap="127.0.0.1:1", stop=stop)
    assert (summary.batches, summary.committed, summary.outages, summary.failed_tries) == (3, [1, 5, 7], 2, 4)
    assert (summary.events_written, summary.dead_letter_written) == (6, 3)
    # The backoffs between failed tries: 0.5, 1.0, 1.5 (capped) in the first outage, 0.5 again in the second.
    assert [w for w in waits if w >= 0.5] == [0.5, 1.0, 1.5, 0.5]
    lines = [r.getMessage() for r in caplog.records]
    assert sum("is unreachable" in line for line in lines) == 2, lines
    assert sum("reachable again after 3 failed tries" in line for line in lines) == 1, lines
    assert sum("reachable again after 1 failed tries" in line for line in lines) == 1, lines
    assert "connection refused by 127.0.0.1:1" in lines[0]


def test_streaming_config_rejects_a_backoff_above_its_cap():
    with pytest.raises(ValueError, match="retry_backoff_s <= max_retry_backoff_s"):
        StreamingConfig(retry_backoff_s=5.0, max_retry_backoff_s=1.0)


@pytest.fixture(scope="module")
def broker():
    with EmbeddedBroker() as b:
        yield b


@pytest.fixture
def topic(broker) -> str:
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for fut in admin.create_topics([NewTopic("outage", num_partitions=PARTITIONS, replication_factor=1)]).values():
        fut.result(timeout=30)
    return "outage"


@pytest.mark.integration
@pytest.mark.slow
def test_streaming_ingest_waits_out_a_stopped_broker_and_loses_nothing(broker, topic, tmp_path):
    lake = tmp_path / "lake"
    stderr_path = tmp_path / "ingest.stderr"
    _produce(broker.bootstrap, topic, 0, 10)
    cmd = [sys.executable, "-m", "gemline.cli", "ingest", "--streaming", "--commit-interval-s", "0.5",
           "--lake", str(lake), "--bootstrap", broker.bootstrap, "--topic", topic,
           "--set", f"kafka.partitions={PARTITIONS}", "--set", "ingest.read_timeout_s=3",
           "--set", "ingest.streaming.retry_backoff_s=0.5", "--set", "ingest.streaming.max_retry_backoff_s=2"]
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
    assert broker._proc is not None
    tansu = broker._proc.pid
    try:
        _wait_for(lambda: _rows(lake) >= 10, proc, "the first 10 records in the lake")
        os.kill(tansu, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            _wait_for(lambda: "is unreachable" in stderr_path.read_text(), proc,
                      "ingest to say that Kafka is unreachable", timeout_s=OUTAGE_S)
            time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - stopped_at)))
        finally:
            os.kill(tansu, signal.SIGCONT)
        assert proc.poll() is None, "ingest exited during the outage"
        _produce(broker.bootstrap, topic, 10, 7)
        _wait_for(lambda: _rows(lake) >= 17, proc, "the 7 records produced after the outage in the lake")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = stderr_path.read_text()
    assert proc.returncode == 0, log[-3000:]
    summary = json.loads(out)
    assert summary["outages"] == 1 and summary["failed_tries"] >= 1, summary
    assert log.count("is unreachable") == 1 and log.count("reachable again") == 1, log[-3000:]
    assert_exactly_once(str(lake), broker.bootstrap, topic, 17)


def _rows(lake: Path) -> int:
    from gemline.lake import read_table

    return sum(len(_coords(read_table(str(lake), t))) for t in ("events", "dead_letter", "late_events"))


def _wait_for(cond, proc: subprocess.Popen, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"ingest exited with {proc.returncode} while waiting for {what}")
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout_s:.0f} s")
