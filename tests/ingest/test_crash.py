"""Crash injection: SIGKILL the ingest job at seeded random points, then check the lake is as if it never died.

Each kill hits a fresh process. To afford a dozen kills in CI, the processes are forked from a
"zygote" that imported Beam, delta-rs and gemline once (a cold import takes seconds, an ingest of
a few hundred records well under one): the child is a real, separate process running
``gemline.cli.main(["ingest", ...])``, and SIGKILL gives it no chance to clean up, like a
machine failure. The zygote forks before any Kafka client or Beam thread exists.

Where a kill lands does not depend on the machine's speed: the child records *kill points*, the
entry and exit of every step of the job (plan, Beam run, Kafka batch claims, parses, staging
writes and renames, reading the staged rows, dedup, lateness, each commit, cleanup: :data:`STEPS`),
and SIGKILLs itself at the n-th point with a given label, drawn by a seeded RNG from the points of
the clean run of the same phase: one anywhere, one among the commits, one between the
``dead_letter`` and ``events`` commits. A fourth kill fires a short seeded delay after its point
(a timer thread sends the SIGKILL), to land inside a step too, e.g. a Delta commit with its data
files written but no log entry yet; where that one lands varies with load, but the lake must be
right wherever it is.

The deterministic crash between the ``dead_letter`` and ``events`` commits replaces
``gemline.lake.commit_once`` in that child only (a fault hook handed in by the test, nothing
read from the environment): after committing ``dead_letter`` the child exits with status 137.
"""

from __future__ import annotations

import itertools
import json
import random
import selectors
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from confluent_kafka import Producer

from gemline.lake import committed_version, read_table
from ingest.broker import EmbeddedBroker
from ingest.pipeline import app_id_for
from ingest.replay import ensure_topic
from ingest.schema import Event

pytestmark = pytest.mark.integration

SEED = 20260115
PARTITIONS = 3
CHUNK = 120  # messages produced per phase
KILLS_PER_PHASE = 4
PHASES = 3
MAX_DELAY_S = 0.3  # the delayed kills fire up to this long after their kill point
HANG_S = 600  # a run that gives no answer this long is hung (a run here takes about a second)
REPO = Path(__file__).resolve().parents[2]
_topic_ids = itertools.count()

STEPS = (
    ("ingest.pipeline", "_plan_batch"), ("ingest.pipeline", "_run_beam"), ("ingest.kafka_source", "claim_batch"),
    ("ingest.vectorized", "parse_batch"), ("pyarrow.feather", "write_feather"), ("os", "replace"),
    ("ingest.pipeline", "read_staged"), ("ingest.pipeline", "_run_in_process"), ("ingest.pipeline", "in_kafka_order"),
    ("ingest.pipeline", "committed_ids"), ("ingest.pipeline", "drop_duplicates"),
    ("ingest.pipeline", "split_late"), ("gemline.lake", "commit_once"),
    ("shutil", "rmtree"),
)
"""(module, function) of every step whose entry and exit are kill points; each is called through its
module at run time, so replacing the module attribute in the child intercepts it."""

ZYGOTE = r'''
import importlib, json, os, signal, sys, threading, time
import apache_beam, deltalake, confluent_kafka, pyarrow.dataset, pyarrow.feather  # noqa: F401  (warm imports)
import apache_beam.runners.direct.direct_runner  # noqa: F401
import apache_beam.runners.portability.fn_api_runner  # noqa: F401
import gemline.lake
import ingest.pipeline  # noqa: F401  (warm import)
from gemline.cli import main


def crash_between_commits():
    real = gemline.lake.commit_once

    def commit_then_die(lake, table, data, **kw):
        done = real(lake, table, data, **kw)
        if table == "dead_letter":
            os._exit(137)
        return done

    gemline.lake.commit_once = commit_then_die


def install_kill_points(steps, kill_at, delay_s):
    """Record each step's entry and exit as a point ``name:in`` / ``name:out``; SIGKILL this process
    (after ``delay_s``) at the ``kill_at = [label, n]``: the n-th point with that label."""
    seen, counts = [], {}
    lock = threading.Lock()

    def point(label):
        with lock:
            seen.append(label)
            counts[label] = counts.get(label, 0) + 1
            hit = kill_at is not None and [label, counts[label]] == kill_at
        if hit and delay_s:
            threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGKILL)).start()
        elif hit:
            os.kill(os.getpid(), signal.SIGKILL)

    for module, name in steps:
        mod = importlib.import_module(module)
        real = getattr(mod, name)

        def step(*args, _real=real, _name=name, **kwargs):
            point(_name + ":in")
            out = _real(*args, **kwargs)
            point(_name + ":out")
            return out

        setattr(mod, name, step)
    return seen


for line in sys.stdin:
    cmd = json.loads(line)
    pid = os.fork()
    if pid == 0:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        if cmd.get("crash_between_commits"):
            crash_between_commits()
        points = install_kill_points(cmd["steps"], cmd.get("kill_at"), cmd.get("delay_s", 0.0))
        try:
            rc = main(cmd["argv"])
        except BaseException:
            rc = 1
        with open(cmd["points_path"], "w") as f:
            json.dump(points, f)
        os._exit(rc)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"status": status, "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                      "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}), flush=True)
'''


class Zygote:
    """Forks ingest runs on request; :meth:`run` makes one SIGKILL itself at kill point ``kill_at`` (None: none)."""

    def __init__(self, points_path: Path) -> None:
        self._points_path = points_path
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)

    def run(self, argv: list[str], *, kill_at: tuple[str, int] | None = None, delay_s: float = 0.0,
            crash_between_commits: bool = False) -> dict:
        """Run one ingest, SIGKILLed at the ``kill_at[1]``-th point labelled ``kill_at[0]`` (None: not killed).

        The result has ``code`` / ``signal``, ``killed``, and ``points``: the labels of the points
        passed, in order (None when killed).
        """
        self._points_path.unlink(missing_ok=True)
        self.proc.stdin.write(json.dumps({"argv": argv, "crash_between_commits": crash_between_commits,
                                          "steps": STEPS, "kill_at": kill_at, "delay_s": delay_s,
                                          "points_path": str(self._points_path)}) + "\n")
        self.proc.stdin.flush()
        json.loads(self._readline(HANG_S))  # the child's pid
        result = json.loads(self._readline(HANG_S))
        result["killed"] = result["signal"] == signal.SIGKILL
        result["points"] = json.loads(self._points_path.read_text()) if self._points_path.exists() else None
        return result

    def _readline(self, timeout_s: float) -> str:
        # A guard against a hung child only; no result depends on how long a run takes.
        if not self._sel.select(timeout=timeout_s):
            raise AssertionError(f"zygote gave no answer in {timeout_s} s")
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
def zygote(tmp_path_factory):
    z = Zygote(tmp_path_factory.mktemp("zygote") / "points")
    yield z
    z.close()


def _topic(broker) -> str:
    name = f"crash-{next(_topic_ids)}"
    ensure_topic(broker.bootstrap, name, PARTITIONS)
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


@pytest.mark.parametrize("engine", ["beam", "inprocess"])
def test_random_sigkills_leave_the_same_lake_as_a_clean_run(broker, zygote, tmp_path, engine):
    rng = random.Random(SEED)
    topic = _topic(broker)
    clean, crashy = tmp_path / "clean", tmp_path / "crashy"

    def argv(lake):
        # A generous Kafka read timeout: a loaded machine must slow a run down, not fail it.
        return ["ingest", "--lake", str(lake), "--bootstrap", broker.bootstrap, "--topic", topic,
                "--set", f"ingest.read_timeout_s={HANG_S / 2}", "--set", f"ingest.engine={engine}"]

    kills, states, immediate_states = 0, [], set()
    for phase in range(PHASES):
        _produce(broker.bootstrap, topic, phase * CHUNK, CHUNK)
        clean_run = zygote.run(argv(clean))
        assert clean_run["code"] == 0 and clean_run["points"], clean_run
        points = clean_run["points"]
        read = "read_staged:out" if engine == "beam" else "_run_in_process:out"
        assert read in points, points  # the engine asked for read the batch
        commit_part = points.index(read)  # from here on: dedup, lateness, the three commits
        # From the dead_letter commit's exit to the events commit's entry (late_events in between).
        between = (points.index("commit_once:out"), len(points) - points[::-1].index("commit_once:in"))
        for i in range(KILLS_PER_PHASE):
            # Kill 0 anywhere, kill 1 among the commits, kill 2 between the dead_letter and events
            # commits (uniform draws rarely land in those short stretches), kill 3 anywhere after a
            # delay. Kill 0 hits a lake in the clean run's state, so it passes the same points and
            # surely lands; the next runs redo or recover the batch, passing those points again.
            index = [rng.randrange(len(points)), rng.randrange(commit_part, len(points)), rng.randrange(*between),
                     rng.randrange(len(points))][i]
            label = points[index]
            kill_at = (label, points[: index + 1].count(label))
            delay_s = 0.0 if i < 3 else rng.uniform(0.0, MAX_DELAY_S)
            result = zygote.run(argv(crashy), kill_at=kill_at, delay_s=delay_s)
            assert result["code"] == 0 or result["killed"], result
            if i == 0:
                assert result["killed"], f"phase {phase}: kill point {kill_at} not reached"
            state = _state(crashy, topic, phase)
            kills += result["killed"]
            if result["killed"] and delay_s == 0.0:
                immediate_states.add(state)
            states.append(f"{kill_at[0]}#{kill_at[1]}+{delay_s:.2f}s:{'killed' if result['killed'] else 'ran'}:{state}")
        completion = zygote.run(argv(crashy))  # completes whatever the kills left
        assert completion["code"] == 0, completion
        # Batch boundaries must match the clean run's for the row comparison to be meaningful.
        assert committed_version(crashy, "events", app_id_for(topic)) == phase
    print(f"seed={SEED}: {kills} of {PHASES * KILLS_PER_PHASE} runs killed; after each: {states}")
    # Immediate kills land where they are drawn, whatever the load: the seeded draws reach staging (the
    # Beam path's; the in-process path stages nothing) and the gap between the dead_letter and events commits.
    wanted = {"staging", "between-commits"} if engine == "beam" else {"before-staging", "between-commits"}
    assert wanted <= immediate_states, immediate_states
    _assert_same_lake(crashy, clean)


def test_kill_between_dead_letter_and_events_commits_recovers(broker, zygote, tmp_path):
    topic = _topic(broker)
    clean, crashy = tmp_path / "clean", tmp_path / "crashy"
    argv = ["ingest", "--bootstrap", broker.bootstrap, "--topic", topic, "--set", f"ingest.read_timeout_s={HANG_S / 2}",
            "--lake"]
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
