"""gemline run: every stage under one supervisor; a stage SIGKILLed mid-stream is restarted and every Kafka
record ends up exactly once in events, dead_letter or late_events, and every example once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gemline.run
from gemline.config import load_config, load_stage_config
from gemline.errors import BadConfigError
from gemline.increments import latest_version
from gemline.lake import commit_metadata, read_table
from gemline.run import RunPlan, config_flags, run_pipeline, runs_distill, stage_commands
from sequences.pipeline import APP_ID

INGESTED = ("events", "dead_letter", "late_events")


def test_stage_commands_carry_the_config_but_never_a_secret(tmp_path):
    config = load_config(overrides={"lake": "s3://bucket/lake", "lake_storage_options.AWS_SECRET_ACCESS_KEY": "s3cr3t",
                                    "build.max_seq_len": "64"})
    flags = config_flags(config, tmp_path / "options.toml")
    stages = stage_commands(RunPlan(generate_rate=100.0, interval_s=3.0), "127.0.0.1:9092", flags)
    assert [s.name for s in stages] == ["generate", "ingest", "validate", "build", "train"]
    assert [s.restart for s in stages] == ["on-failure", "always", "always", "always", "always"]
    for stage in stages:
        argv = " ".join(stage.argv)
        assert "s3cr3t" not in argv and "--config " + str(tmp_path / "options.toml") in argv
        assert "--set build.max_seq_len=64" in argv and "--set lake=s3://bucket/lake" in argv
    assert "--follow --table events,examples --interval-s 3.0" in " ".join(stages[2].argv)
    assert "--interval-s 3.0" in " ".join(stages[3].argv)
    plain = stage_commands(RunPlan(train=False), "h:1", ["--set", "build.interval_s=4"])
    assert [s.name for s in plain] == ["ingest", "validate", "build"]
    # Without a plan interval the build keeps build.interval_s (carried in the flags), validation runs every 10 s.
    assert "--interval-s" not in plain[2].argv and "--interval-s 10.0" in " ".join(plain[1].argv)
    # Every follower looks for new input every second (--watch-s), or only waits its interval with none.
    for plan, value in ((RunPlan(), "1.0"), (RunPlan(watch_s=0.5), "0.5"), (RunPlan(watch_s=None), "none")):
        argvs = {s.name: " ".join(s.argv) for s in stage_commands(plan, "h:1", [], distill=True)}
        assert {name for name, argv in argvs.items() if f"--watch-s {value}" in argv} == {
            "validate", "build", "train", "distill"}
    with pytest.raises(BadConfigError, match="--watch-s must be > 0 seconds"):
        RunPlan(watch_s=0.0)


def test_distill_follows_with_the_trainer_when_the_teacher_logs_predictions(tmp_path, monkeypatch):
    assert runs_distill(load_config()), "the default teacher is GEM, which logs its predictions"
    assert not runs_distill(load_config(overrides={"trainer.model": "dlrm"})), "no teacher predictions: no students"
    assert not runs_distill(load_config(overrides={"distill.follow_in_run": "false"}))
    assert runs_distill(load_config(overrides={"trainer.model": "dlrm", "distill.follow_in_run": "true"}))
    stages = stage_commands(RunPlan(poll_interval_s=7.0), "h:1", ["--set", "lake=L"], distill=True)
    assert [s.name for s in stages] == ["ingest", "validate", "build", "train", "distill"]
    assert " ".join(stages[-1].argv).endswith(
        "gemline.cli distill --follow --poll-interval-s 7.0 --watch-s 1.0 --set lake=L")
    # Off the freshness path, the students yield the CPU to the other stages (gemline run --distill-nice).
    assert [s.nice for s in stages] == [0, 0, 0, 0, 10]
    assert stage_commands(RunPlan(distill_nice=0), "h:1", [], distill=True)[-1].nice == 0
    with pytest.raises(BadConfigError, match="--distill-nice must be in 0..19"):
        RunPlan(distill_nice=-1)
    assert [s.name for s in stage_commands(RunPlan(train=False), "h:1", [], distill=True)] == ["ingest", "validate",
                                                                                               "build"]

    # Every stage a sleeper that prints its command line: the supervisor starts distill with the others, then
    # stops them all.
    sleeper = (sys.executable, "-c", "import sys, time; print(*sys.argv[1:], flush=True); time.sleep(600)")
    monkeypatch.setattr(gemline.run, "GEMLINE", sleeper)
    config = load_config(overrides={"lake": str(tmp_path / "lake"), "build.label_mode": "defer"})
    seen: dict[str, int | None] = {}
    nice: dict[str, int] = {}

    def all_up(sup) -> bool:
        seen.update({s.command.name: s.pid for s in sup.stages})
        up = all(s.process is not None and s.last_log_line() for s in sup.stages)
        if up:  # each stage's niceness, read while it runs
            nice.update({s.command.name: os.getpriority(os.PRIO_PROCESS, s.pid) for s in sup.stages})
        return up

    said: list[str] = []
    assert run_pipeline(config, RunPlan(bootstrap="127.0.0.1:1"), log_dir=tmp_path / "logs", say=said.append,
                        live=False, until=all_up) == 0
    assert list(seen) == ["ingest", "validate", "build", "train", "distill"] and all(seen.values())
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert nice == {"ingest": own, "validate": own, "build": own, "train": own, "distill": min(19, own + 10)}
    assert any(line.startswith("distill: started (pid ") and line.endswith(", nice +10)") for line in said), said
    # The run's settings stay with the lake: a stage started alone there later builds with defer too.
    assert load_stage_config(None, {"lake": str(tmp_path / "lake")}).build.label_mode == "defer"
    assert (tmp_path / "logs" / "distill.log").read_text().startswith(
        "distill --follow --poll-interval-s 10.0 --watch-s 1.0")
    for name, pid in seen.items():
        assert pid is not None
        with pytest.raises(ProcessLookupError):  # stopped and reaped with the others
            os.kill(pid, 0)


@pytest.mark.slow
@pytest.mark.integration
def test_sigkilled_ingest_then_build_under_gemline_run_lose_and_double_nothing(tmp_path):
    """SIGKILL the streaming ingest after its first commit, then the build in the middle of a pass (its staging
    folder exists), one at a time, while the generator produces: each is restarted (the supervisor says so), and
    once everything is ingested and built, every Kafka record is in events, dead_letter or late_events once and
    every example once."""
    lake = tmp_path / "lake"
    config = load_config(overrides={"lake": str(lake), "generate.num_users": "40", "generate.days": "0.3",
                                    "ingest.streaming.commit_interval_s": "1", "build.shards": "2",
                                    # 1 min and 10 min windows: most of the 0.3 day closes, so examples exist
                                    "build.click_window_ms": "60000", "build.conversion_window_ms": "600000"})
    state = {"phase": "ingest", "deadline": time.monotonic() + 300, "checked": 0.0, "built_up_to": None,
             "flowing_at_kill": {}, "metrics": None}
    said: list[str] = []

    def stage(sup, name):
        return sup.stages[[s.command.name for s in sup.stages].index(name)]

    def produced(sup) -> int | None:
        log = stage(sup, "generate").log_path
        lines = [line for line in log.read_text().splitlines() if line.startswith("{")] if log.exists() else []
        return json.loads(lines[-1])["produced"] if lines else None

    def rows() -> int:
        tables = [read_table(str(lake), t) for t in INGESTED]
        return sum(t.num_rows for t in tables if t is not None)

    def building() -> bool:
        staging = lake / "_staging" / APP_ID
        return staging.is_dir() and any(staging.iterdir())

    def until(sup) -> bool:
        assert time.monotonic() < state["deadline"], f"gemline run did not finish within 300 s (at {state})"
        ingest, build = stage(sup, "ingest"), stage(sup, "build")
        if state["phase"] == "ingest" and (lake / "events" / "_delta_log").is_dir() and ingest.pid is not None:
            os.kill(ingest.pid, signal.SIGKILL)  # after its first commit, maybe while a batch is in flight
            state["flowing_at_kill"]["ingest"] = stage(sup, "generate").process is not None
            state["phase"] = "build"
        elif state["phase"] == "build" and ingest.restarts >= 1 and build.pid is not None and building():
            os.kill(build.pid, signal.SIGKILL)  # in the middle of a pass: staged files, maybe some commits
            state["flowing_at_kill"]["build"] = stage(sup, "generate").process is not None
            state["phase"] = "finish"
        if state["phase"] != "finish" or build.restarts < 1 or time.monotonic() - state["checked"] < 2:
            return False
        state["checked"] = time.monotonic()
        total = produced(sup)
        if total is None or stage(sup, "generate").process is not None or rows() < total:
            return False
        newest = latest_version(str(lake), "events")
        built = (commit_metadata(str(lake), "examples", APP_ID) or {}).get("events_version")
        state["built_up_to"] = (newest, built)
        if built is None or built != newest:
            return False
        state["metrics"] = _settled_metrics(said, sup, lake)
        return True

    # ~200 events at 8 events/s: the generator still produces when ingest is killed (the build, which waits for
    # validated events, is killed while it produces or soon after).
    assert run_pipeline(config, RunPlan(generate_rate=8.0, interval_s=1.0, train=False, metrics_port=0), live=False,
                        until=until, say=said.append) == 0
    assert state["flowing_at_kill"]["ingest"], "ingest was killed after the generator finished: raise the rate's run"
    for name in ("ingest", "build"):
        assert any(line.startswith(f"{name}: exited with signal SIGKILL") and "restarting in" in line
                   for line in said), said
        assert sum(line.startswith(f"{name}: started (pid") for line in said) >= 2, said
    tables = {t: read_table(str(lake), t) for t in INGESTED}
    keys = [k for t in tables.values() if t is not None
            for k in zip(t["kafka_partition"].to_pylist(), t["kafka_offset"].to_pylist())]
    log = lake / "_run" / "logs" / "generate.log"
    total = json.loads([line for line in log.read_text().splitlines() if line.startswith("{")][-1])["produced"]
    assert len(keys) == len(set(keys)) == total, "every record once: none lost, none doubled"
    events = tables["events"]
    assert len(set(events["event_id"].to_pylist())) == events.num_rows
    examples = read_table(str(lake), "examples", columns=["example_id"])["example_id"].to_pylist()
    assert examples and len(set(examples)) == len(examples), "every example once"
    # What the /metrics endpoint served once everything was ingested and built: no lag on any partition, the
    # restarts after the SIGKILLs, the lake's events version.
    got, restarts, version = state["metrics"]
    assert got["gemline_consumer_lag"] == {(("partition", str(p)), ("topic", config.kafka.topic)): 0
                                           for p in range(config.kafka.partitions)}
    for name in ("ingest", "build"):
        assert got["gemline_stage_restarts_total"][(("stage", name),)] == restarts[name] >= 1
        assert got["gemline_stage_up"][(("stage", name),)] == 1
    assert got["gemline_table_version"][(("table", "events"),)] == version


def _settled_metrics(said: list[str], sup, lake) -> tuple[dict, dict[str, int], int | None]:
    """A scrape of gemline run's endpoint once its cached values caught up with the lake (no lag left), with
    the supervisor's restarts per stage and the events version at that scrape."""
    from tests.gemline.test_metrics import scrape

    port = int(next(line for line in said if line.startswith("metrics: port ")).split()[2].rstrip(","))
    for _ in range(60):  # the collector caches 5 s: bounded by a count of scrapes
        got = scrape(port)
        if not any(got.get("gemline_consumer_lag", {"-": 1}).values()):
            break
        time.sleep(0.5)
    return got, {s.command.name: s.restarts for s in sup.stages}, latest_version(str(lake), "events")


def _produced(lake) -> int:
    """What the last generator run reported the broker acknowledged (its {"produced": N} line)."""
    log = lake / "_run" / "logs" / "generate.log"
    return json.loads([line for line in log.read_text().splitlines() if line.startswith("{")][-1])["produced"]


def _ingested_keys(lake) -> list[tuple[int, int]]:
    """(kafka_partition, kafka_offset) of every row in events, dead_letter and late_events."""
    tables = [read_table(str(lake), t) for t in INGESTED]
    return [k for t in tables if t is not None for k in zip(t["kafka_partition"].to_pylist(),
                                                             t["kafka_offset"].to_pylist())]


@pytest.mark.slow
@pytest.mark.integration
def test_a_stopped_run_keeps_every_acknowledged_record_and_starts_again_on_its_own_lake(tmp_path, monkeypatch):
    """Stopped while the generator still produces, `gemline run` (embedded broker) stops the generator, lets ingest
    consume what the broker holds, then the rest: every record the generator reported acknowledged is in events,
    dead_letter or late_events. Its topic exists before ingest starts (no restart). Run again on the same lake with
    a new embedded broker, ingest starts over on the new topic (a `reset` batch) instead of exiting 2 forever, and
    the second generator's records join the first's, none lost or doubled. Only generate and ingest run: the
    other stages are not what this checks."""
    only = ("generate", "ingest")
    full = gemline.run.stage_commands
    monkeypatch.setattr(gemline.run, "stage_commands",
                        lambda *a, **k: [s for s in full(*a, **k) if s.name in only])
    lake = tmp_path / "lake"
    settings = {"lake": str(lake), "generate.num_users": "40", "generate.days": "0.2",
                "ingest.streaming.commit_interval_s": "2"}
    said: list[str] = []

    def stop_while_producing(sup) -> bool:
        generate = sup.stages[[s.command.name for s in sup.stages].index("generate")]
        assert generate.process is not None, "the generator finished before ingest committed: lower the rate"
        return latest_version(str(lake), "events") is not None  # ingest committed while more is being sent

    plan = RunPlan(generate_rate=10.0, train=False)
    assert run_pipeline(load_config(overrides=settings), plan, say=said.append, live=False,
                        until=stop_while_producing) == 0
    first = _produced(lake)
    keys = _ingested_keys(lake)
    assert 0 < first == len(keys) == len(set(keys)), (first, len(keys), said)
    assert any(line.startswith("drain: every record in the broker is consumed") for line in said), said
    assert not any(line.startswith("ingest: exited") for line in said), "ingest started once, on an existing topic"

    said.clear()

    config = load_config(overrides={**settings, "generate.seed": "1"})  # new event ids
    assert run_pipeline(config, plan, say=said.append, live=False,
                        until=lambda sup: len(_ingested_keys(lake)) > first) == 0
    assert any(line.startswith("the lake's Kafka offsets are of an earlier embedded broker") for line in said), said
    assert '"reset": true' in (lake / "_run" / "logs" / "ingest.log").read_text(), "the reset batch is committed"
    assert not any(line.startswith("ingest: exited") for line in said), said
    ids = [i for t in ("events", "late_events") for i in read_table(str(lake), t)["event_id"].to_pylist()]
    assert len(_ingested_keys(lake)) == len(ids) == len(set(ids)) == first + _produced(lake), "each record once"


@pytest.mark.integration
def test_a_ctrl_c_before_the_stages_start_leaves_no_broker(tmp_path, monkeypatch):
    """Ctrl-C while the topic is being created (the embedded broker already up): the interrupt propagates (the CLI's
    one line) and the broker is stopped, not left listening."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gemline.run, "ensure_topic", interrupted)
    said: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(load_config(overrides={"lake": str(tmp_path / "lake")}), RunPlan(train=False),
                     say=said.append, live=False)
    pid = int(next(line for line in said if line.startswith("broker: started")).split("pid ")[1].rstrip(")"))
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(pid, 0)


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` now (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_nothing_outlives_a_sigkilled_supervisor_and_the_next_run_cleans_up(tmp_path):
    """SIGKILL `gemline run` (no Ctrl-C, no SIGTERM: the OOM killer's way): every stage, the broker and the generator
    stop within 15 s (the supervisor's lifeline), freeing their locks; the next `gemline run` on the lake says what
    the dead one left, removes its private folder, and starts."""
    lake = tmp_path / "lake"
    out = open(tmp_path / "run.log", "wb")
    run = subprocess.Popen([*gemline.run.GEMLINE, "run", "--lake", str(lake), "--no-train", "--generate-rate", "20",
                            "--set", "generate.num_users=40"], stdout=out, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, start_new_session=True)
    record_path = lake / "_run" / "supervisor.json"
    deadline = time.monotonic() + 120
    record: dict = {}
    while time.monotonic() < deadline:
        if record_path.is_file():
            record = json.loads(record_path.read_text())
            if {"broker", "generate", "ingest", "build"} <= set(record["stages"]):
                break
        assert run.poll() is None, (tmp_path / "run.log").read_text()
        time.sleep(0.5)
    assert {"broker", "generate", "ingest", "build"} <= set(record.get("stages", {})), record
    time.sleep(2)  # the stages are up and hold their locks
    left = _descendants(run.pid)
    assert set(record["stages"].values()) <= left
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(p) for p in left):
        time.sleep(0.25)
    assert not [p for p in left if _alive(p)], "a process of the killed run is still running"
    assert Path(record["private_dir"]).is_dir(), "a SIGKILLed run cannot remove its folder itself"

    said: list[str] = []
    config = load_config(overrides={"lake": str(lake), "generate.num_users": "40"})
    assert run_pipeline(config, RunPlan(train=False), say=said.append, live=False,
                        until=lambda sup: all(s.process is not None for s in sup.stages)) == 0
    found = next(line for line in said if "did not stop cleanly" in line)
    assert f"pid {run.pid}" in found and "options folder" in found and "removed" in found, found
    assert not Path(record["private_dir"]).exists()
    assert any(line.startswith("gemline run: ") and "stages" in line for line in said), said
    assert not record_path.exists(), "a run that stopped removes its record"
