"""Streaming ingest: micro-batches committed exactly once while producers keep writing; clean stops."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pytest
from confluent_kafka import Producer

from gemline.cli import main
from gemline.config import GemlineConfig
from gemline.lake import committed_version, read_table
from ingest.broker import EmbeddedBroker
from ingest.config import IngestConfig, KafkaConfig
from ingest.kafka_source import plan_topic
from ingest.pipeline import app_id_for
from ingest.replay import ensure_topic
from ingest.schema import Event
from ingest.streaming import StreamingConfig, install_stop_signals, run_streaming
from tests.conftest import ingest_args

PARTITIONS = 3
BASE_MS = 1_749_000_000_000
REPO = Path(__file__).resolve().parents[2]
_topic_ids = itertools.count()

BAD_CONFIGS = [
    ({"commit_interval_s": 0}, "commit_interval_s: expected > 0 seconds, got 0"),
    ({"max_batches": 0}, "max_batches: expected >= 1 or None, got 0"),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD_CONFIGS)
def test_streaming_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StreamingConfig(**kwargs)


def test_streaming_flags_set_the_ingest_streaming_section(tmp_path):
    """--commit-interval-s / --max-batches are spellings of [ingest.streaming] keys: given, they win over the file."""
    from gemline.cli import _config, build_parser

    path = tmp_path / "gemline.toml"
    path.write_text("[ingest.streaming]\ncommit_interval_s = 2.5\nmax_batches = 9\n")
    argv = ["ingest", "--streaming", "--config", str(path)]
    parser = build_parser()
    assert _config(parser.parse_known_args(argv)[0]).ingest.streaming == StreamingConfig(commit_interval_s=2.5, max_batches=9)
    flagged = _config(parser.parse_known_args([*argv, "--commit-interval-s", "0.5", "--max-batches", "2"])[0])
    assert flagged.ingest.streaming == StreamingConfig(commit_interval_s=0.5, max_batches=2)


def test_cli_rejects_a_zero_interval(capsys, tmp_path):
    assert main(["ingest", "--streaming", "--commit-interval-s", "0", "--lake", str(tmp_path),
                 "--bootstrap", "127.0.0.1:1"]) == 2
    assert "commit_interval_s: expected > 0" in capsys.readouterr().err


def test_signals_set_the_stop_event_then_interrupt():
    # What was there before (Python's default_int_handler, or SIG_IGN when the test runner was started in the
    # background by a non-interactive shell) is what must be back afterwards.
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    stop = threading.Event()
    restore = install_stop_signals(stop)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.is_set()
        with pytest.raises(KeyboardInterrupt, match="second signal"):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        restore()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


# ---- against the embedded broker ------------------------------------------------------------

@pytest.fixture(scope="module")
def broker():
    with EmbeddedBroker() as b:
        yield b


@pytest.fixture
def topic(broker) -> str:
    name = f"stream-{next(_topic_ids)}"
    ensure_topic(broker.bootstrap, name, PARTITIONS)
    return name


def _config(lake, topic) -> GemlineConfig:
    return GemlineConfig(lake=str(lake), kafka=KafkaConfig(topic=topic, partitions=PARTITIONS), ingest=IngestConfig())


def _produce(bootstrap: str, topic: str, start: int, n: int, *, bad_every: int = 5) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "batch.num.messages": 1, "linger.ms": 0})
    for i in range(start, start + n):
        if i % bad_every == 0:
            value = b"{not json"
        else:
            value = Event(event_id=f"e{i}", event_time_ms=BASE_MS + i * 60_000, user_id=f"u{i % 4}",
                          item_id=f"i{i}", domain="facebook", event_type="impression", position=1).to_json()
        producer.produce(topic, key=f"u{i % 4}".encode(), value=value)
    assert producer.flush(30) == 0


def _coords(table: pa.Table | None) -> list[tuple[int, int]]:
    if table is None:
        return []
    return list(zip(table["kafka_partition"].to_pylist(), table["kafka_offset"].to_pylist()))


def assert_exactly_once(lake, bootstrap: str, topic: str, produced: int) -> None:
    """Every offset of the topic is in events, late_events or dead_letter, once, and nothing else is."""
    keys = [k for t in ("events", "late_events", "dead_letter") for k in _coords(read_table(lake, t))]
    offsets = {(r.partition, o) for r in plan_topic(bootstrap, topic, {}, previous=None).ranges
               for o in range(r.start, r.end)}
    assert len(offsets) == produced
    assert len(keys) == len(set(keys)), "a record was written twice"
    assert set(keys) == offsets, f"missing {sorted(offsets - set(keys))[:5]}, extra {sorted(set(keys) - offsets)[:5]}"


@pytest.mark.integration
def test_streaming_commits_what_arrives_between_batches_exactly_once(broker, topic, tmp_path):
    cfg = _config(tmp_path / "lake", topic)
    _produce(broker.bootstrap, topic, 0, 10)
    more = {1: (10, 7), 2: (17, 5)}  # after cycle k, produce (start, n)
    cycles: list[int] = []

    def on_batch(result):
        cycles.append(result.batch_version)
        if len(cycles) in more:
            _produce(broker.bootstrap, topic, *more[len(cycles)])

    summary = run_streaming(*ingest_args(cfg), StreamingConfig(commit_interval_s=0.01, max_batches=4),
                            bootstrap=broker.bootstrap, on_batch=on_batch)
    assert (summary.batches, summary.committed, summary.stopped_by) == (4, [0, 1, 2], "max_batches")
    assert cycles == [0, 1, 2, 3]  # the 4th cycle had nothing new: skipped, version 3 unused
    assert summary.events_written + summary.dead_letter_written == 22
    assert committed_version(cfg.lake, "events", app_id_for(topic)) == 2
    assert_exactly_once(cfg.lake, broker.bootstrap, topic, 22)


@pytest.mark.integration
def test_stop_event_ends_after_the_batch_in_flight(broker, topic, tmp_path):
    cfg = _config(tmp_path / "lake", topic)
    _produce(broker.bootstrap, topic, 0, 6)
    stop = threading.Event()
    summary = run_streaming(*ingest_args(cfg), StreamingConfig(commit_interval_s=3600), bootstrap=broker.bootstrap,
                            stop=stop, on_batch=lambda _: stop.set())
    assert (summary.batches, summary.committed, summary.stopped_by) == (1, [0], "stop")
    assert_exactly_once(cfg.lake, broker.bootstrap, topic, 6)


@pytest.mark.integration
def test_cli_streaming_runs_until_sigint(broker, topic, tmp_path):
    lake = tmp_path / "lake"
    _produce(broker.bootstrap, topic, 0, 8)
    cmd = [sys.executable, "-m", "gemline.cli", "ingest", "--streaming", "--commit-interval-s", "0.2",
           "--lake", str(lake), "--bootstrap", broker.bootstrap, "--topic", topic]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        _wait_for_rows(lake, 8, proc)
        _produce(broker.bootstrap, topic, 8, 5)  # arrives while the job runs
        _wait_for_rows(lake, 13, proc)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    summary = json.loads(out)
    # The 5 late messages may straddle two snapshots, so batches 1.. hold them.
    assert summary["stopped_by"] == "stop" and summary["committed"] == list(range(len(summary["committed"])))
    assert len(summary["committed"]) >= 2
    assert_exactly_once(lake, broker.bootstrap, topic, 13)


def _wait_for_rows(lake, rows: int, proc: subprocess.Popen) -> None:
    # Bounded by a count of short waits on the child, not by reading the clock.
    for _ in range(600):
        if proc.poll() is not None:
            raise AssertionError(f"streaming ingest exited early with code {proc.returncode}")
        if len(_coords(read_table(lake, "events"))) + len(_coords(read_table(lake, "dead_letter"))) >= rows:
            return
        try:
            proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
    raise AssertionError(f"the lake never reached {rows} rows")
