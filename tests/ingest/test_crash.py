"""Crash injection: SIGKILL the ingest job at seeded random points, then check the lake is as if it never died.

Each kill hits a fresh process. To afford a dozen kills in CI, the processes are forked from a
"zygote" that imported Beam, delta-rs and gemline once (a cold import takes seconds, an ingest of
a few hundred records well under one): the child is a real, separate process running
``gemline.cli.main(["ingest", ...])``, and SIGKILL gives it no chance to clean up, like a
machine failure. The zygote forks before any Kafka client or Beam thread exists.

The deterministic crash between the ``dead_letter`` and ``events`` commits replaces
``ingest.pipeline.commit_once`` in that child only (a fault hook handed in by the test, nothing
read from the environment): after committing ``dead_letter`` the child exits with status 137.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import selectors
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from gemline.lake import committed_version, read_table
from ingest.broker import EmbeddedBroker
from ingest.pipeline import app_id_for
from ingest.schema import Event

pytestmark = pytest.mark.integration

SEED = 20260115
PARTITIONS = 3
CHUNK = 120  # messages produced per phase
KILLS_PER_PHASE = 4
PHASES = 3
KILL_AT = (0.15, 1.05)  # kill after this fraction of a full run's duration: the whole run, commits included
REPO = Path(__file__).resolve().parents[2]
_topic_ids = itertools.count()

ZYGOTE = r'''
import json, os, sys, time
import apache_beam, deltalake, confluent_kafka, pyarrow.dataset  # noqa: F401  (warm imports)
import apache_beam.runners.direct.direct_runner  # noqa: F401
import apache_beam.runners.portability.fn_api_runner  # noqa: F401
import ingest.pipeline
from gemline.cli import main


def crash_between_commits():
    real = ingest.pipeline.commit_once

    def commit_then_die(lake, table, data, **kw):
        done = real(lake, table, data, **kw)
        if table == "dead_letter":
            os._exit(137)
        return done

    ingest.pipeline.commit_once = commit_then_die


for line in sys.stdin:
    cmd = json.loads(line)
    pid = os.fork()
    if pid == 0:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        if cmd.get("crash_between_commits"):
            crash_between_commits()
        try:
            rc = main(cmd["argv"])
        except BaseException:
            rc = 1
        os._exit(rc)
    started = time.monotonic()
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"elapsed_s": time.monotonic() - started, "status": status, "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                      "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}), flush=True)
'''


class Zygote:
    """Forks ingest runs on request; :meth:`run` kills one after ``kill_after_s`` (None: let it finish)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)

    def run(self, argv: list[str], *, kill_after_s: float | None = None,
            crash_between_commits: bool = False) -> dict:
        self.proc.stdin.write(json.dumps({"argv": argv, "crash_between_commits": crash_between_commits}) + "\n")
        self.proc.stdin.flush()
        pid = json.loads(self._readline(300))["pid"]
        killed = False
        if kill_after_s is not None and not self._sel.select(timeout=kill_after_s):
            os.kill(pid, signal.SIGKILL)
            killed = True
        result = json.loads(self._readline(300))
        result["killed"] = killed
        return result

    def _readline(self, timeout_s: float) -> str:
        if not self._sel.select(timeout=timeout_s):
            raise AssertionError("zygote gave no answer")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"zygote exited with {self.proc.wait()}")
        return line

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def broker():
    with EmbeddedBroker() as b:
        yield b


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def _topic(broker) -> str:
    name = f"crash-{next(_topic_ids)}"
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for fut in admin.create_topics([NewTopic(name, num_partitions=PARTITIONS, replication_factor=1)]).values():
        fut.result(timeout=30)
    return name


def _produce(bootstrap: str, topic: str, start: int, n: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "batch.num.messages": 1, "linger.ms": 0})
    for i in range(start, start + n):
        if i % 9 == 0:
            value = b"{truncated"
        elif i % 13 == 0:
            value = Event(event_id=f"e{i}", event_time_ms=1_749_000_000_000 + i, user_id="u", item_id="i",
                          domain="tiktok", event_type="click").to_json()
        else:
            value = Event(event_id=f"e{i}", event_time_ms=1_749_000_000_000 + i * 1_000, user_id=f"u{i % 7}",
                          item_id=f"i{i % 11}", domain="instagram", event_type="impression",
                          position=i % 5 + 1).to_json()
        producer.produce(topic, key=f"u{i % 7}".encode(), value=value)
    assert producer.flush(30) == 0


def _rows(lake, table: str) -> list[dict]:
    data: pa.Table | None = read_table(lake, table)
    if data is None:
        return []
    return sorted(data.to_pylist(), key=lambda r: (r["kafka_partition"], r["kafka_offset"]))


def _assert_same_lake(crashy, clean) -> None:
    assert _rows(clean, "events") and _rows(clean, "dead_letter"), "the clean run wrote nothing to compare"
    for table in ("events", "dead_letter", "late_events"):
        got, want = _rows(crashy, table), _rows(clean, table)
        keys = [(r["kafka_partition"], r["kafka_offset"]) for r in got]
        assert len(keys) == len(set(keys)), f"{table}: a record written twice"
        if table == "events":
            assert [(r["kafka_partition"], r["kafka_offset"], r["event_id"]) for r in got] == [
                (r["kafka_partition"], r["kafka_offset"], r["event_id"]) for r in want]
        assert got == want  # every column: the batches decided exactly as the clean run did


def _state(lake, topic: str, phase: int) -> str:
    app = app_id_for(topic)
    dead, events = committed_version(lake, "dead_letter", app), committed_version(lake, "events", app)
    if events == phase:
        return "committed"
    if dead == phase:
        return "between-commits"
    return "staging" if (Path(lake) / "_staging" / "ingest" / str(phase)).exists() else "before-staging"


def test_random_sigkills_leave_the_same_lake_as_a_clean_run(broker, zygote, tmp_path):
    rng = random.Random(SEED)
    topic = _topic(broker)
    clean, crashy = tmp_path / "clean", tmp_path / "crashy"

    def argv(lake):
        return ["ingest", "--lake", str(lake), "--bootstrap", broker.bootstrap, "--topic", topic]

    kills, states, full_run_s = 0, [], float("inf")
    for phase in range(PHASES):
        _produce(broker.bootstrap, topic, phase * CHUNK, CHUNK)
        clean_run = zygote.run(argv(clean))
        assert clean_run["code"] == 0, clean_run
        # The fastest full run seen: the other engineers' tests share the cores, and a slow clean run
        # would otherwise stretch the delays past the end of most runs.
        full_run_s = min(full_run_s, clean_run["elapsed_s"])
        for _ in range(KILLS_PER_PHASE):
            delay = rng.uniform(*KILL_AT) * full_run_s
            result = zygote.run(argv(crashy), kill_after_s=delay)
            assert result["code"] == 0 or result["signal"] == signal.SIGKILL, result
            kills += result["killed"]
            states.append(f"{delay:.2f}s:{_state(crashy, topic, phase)}")
        completion = zygote.run(argv(crashy))  # completes whatever the kills left
        assert completion["code"] == 0, completion
        # Batch boundaries must match the clean run's for the row comparison to be meaningful.
        assert committed_version(crashy, "events", app_id_for(topic)) == phase
    # Where the kills landed (not asserted: it depends on the machine's speed).
    print(f"seed={SEED}: {kills} of {PHASES * KILLS_PER_PHASE} runs killed; states after each: {states}")
    assert kills >= 1, "every run finished before its kill: the test checked nothing"
    _assert_same_lake(crashy, clean)


def test_kill_between_dead_letter_and_events_commits_recovers(broker, zygote, tmp_path):
    topic = _topic(broker)
    clean, crashy = tmp_path / "clean", tmp_path / "crashy"
    argv = ["ingest", "--bootstrap", broker.bootstrap, "--topic", topic, "--lake"]
    _produce(broker.bootstrap, topic, 0, 40)
    assert zygote.run([*argv, str(clean)])["code"] == 0

    crashed = zygote.run([*argv, str(crashy)], crash_between_commits=True)
    assert crashed["code"] == 137
    app = app_id_for(topic)
    assert committed_version(crashy, "dead_letter", app) == 0
    assert committed_version(crashy, "events", app) is None

    _produce(broker.bootstrap, topic, 1000, 6)  # must not leak into the recovered batch
    assert zygote.run([*argv, str(crashy)])["code"] == 0
    assert committed_version(crashy, "events", app) == 0
    _assert_same_lake(crashy, clean)
