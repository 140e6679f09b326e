"""``gemline run``: every stage of the pipeline kept running on one machine, each in its own process.

    broker (embedded, when no --bootstrap) -> [generate --rate R] -> ingest --streaming -> validate --follow
    (events, examples) -> build --follow -> train --follow -> [distill --follow]

``distill --follow`` (the per-domain students, trainer.distill) runs with the trainer when it logs teacher
predictions (:func:`runs_distill`).

A :class:`gemline.supervisor.Supervisor` starts them, restarts a crashed stage with backoff and stops them all
on Ctrl-C or SIGTERM: the generator first, then (with the embedded broker, whose records end with its process)
ingest is left to catch up with what the broker holds, bounded by ``RunPlan.drain_timeout_s``, then the other
stages, then the broker. Before any stage starts, the topic is created (embedded broker, or a generator), so ingest
never starts on a missing topic; and with the embedded broker on a lake that already ingested from an earlier
one (a restart of ``gemline run``), ingest first starts over on the new broker's topic (``gemline ingest
--reset-topic``): the lake's offsets are of a broker that no longer exists. Each stage is the same command a person would run alone (a deployment runs them on
separate machines the same way); each commits idempotently, so a restarted stage neither loses nor doubles
anything. The configuration reaches the children as ``--set`` flags of every non-default setting, except the
lake's storage options (they may hold secrets, which never go on a command line: ``ps`` shows it to every user),
which go in a 0600 TOML file in a private temporary folder, as for torchrun's ranks.

With a terminal, a live status table (rich) shows each stage's state, restarts and last log line, its last
version, rows done and lag (:mod:`gemline.progress`), and the newest version of the lake's main tables; without
one, one line per start, exit and restart.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table as RichTable

from gemline.config import GemlineConfig, config_overrides, save_run_settings
from gemline.increments import latest_version
from gemline.lake import Lake, is_remote
from gemline.metrics import LOCAL_ADDR, LagSource, PipelineCollector, StageSample, lake_offsets, serve
from gemline.progress import StageProgress, dead_letter_warning, last_ingest_dead_letter, pipeline_progress
from gemline.supervisor import StageCommand, Supervisor, last_readable_line
from gemline.tables import Table
from ingest.broker import accepts, free_port
from ingest.replay import ensure_topic

log = logging.getLogger(__name__)

GEMLINE = (sys.executable, "-m", "gemline.cli")
"""How a child runs a gemline command: the same interpreter and code as the supervisor."""


@dataclass(frozen=True)
class RunPlan:
    """What ``gemline run`` keeps running.

    Attributes:
        bootstrap: the Kafka cluster ("HOST:PORT"); None starts the embedded broker on ``broker_port``.
        broker_port: the embedded broker's port (0: a free one, chosen at start).
        generate_rate: events/s of a synthetic ``gemline generate`` stage; None: no generator.
        interval_s: the longest wait between the passes of ``build --follow`` and ``validate --follow``; None:
            the build's ``build.interval_s`` from the configuration, validation 10 s.
        poll_interval_s: the longest wait between the runs of ``train --follow`` (and ``distill --follow``).
        watch_s: seconds between each follower's looks for new input, which starts its next pass at once
            (:func:`gemline.polling.wait_for_input`); None: a pass every interval.
        train: run the continuous trainer.
        metrics_port: serve Prometheus metrics (:mod:`gemline.metrics`) on this port from the supervisor
            process (0: a free one, printed); None: no metrics endpoint.
        metrics_addr: the interface they listen on (loopback by default; ``0.0.0.0`` for every interface).
        drain_timeout_s: with the embedded broker, the longest wait (s) at a stop for ingest to consume what the
            broker holds, after the generator stopped (what is left then is lost with the broker, and said).
        distill_nice: added to ``distill --follow``'s niceness (:class:`gemline.supervisor.StageCommand`): the
            students are off the freshness path (they follow the teacher, nothing waits for them), so on a full
            machine they take what ingest, validation, the build and the trainer leave; 0: the same priority.
    """

    bootstrap: str | None = None
    broker_port: int = 0
    generate_rate: float | None = None
    interval_s: float | None = None
    poll_interval_s: float = 10.0
    watch_s: float | None = 1.0
    train: bool = True
    metrics_port: int | None = None
    metrics_addr: str = LOCAL_ADDR
    drain_timeout_s: float = 60.0
    distill_nice: int = 10

    def __post_init__(self) -> None:
        from gemline.errors import BadConfigError

        if not 0 <= self.distill_nice <= 19:
            raise BadConfigError(f"--distill-nice must be in 0..19, got {self.distill_nice}")

        if not self.drain_timeout_s >= 0:
            raise BadConfigError(f"--drain-timeout-s must be >= 0, got {self.drain_timeout_s}")
        if self.watch_s is not None and not self.watch_s > 0:
            raise BadConfigError(f"--watch-s must be > 0 seconds (or none), got {self.watch_s}")


def wait_for_port(host: str, port: int, timeout_s: float) -> bool:
    """True once something accepts TCP connections on (host, port), False after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if accepts(host, port):
            return True
        time.sleep(0.2)
    return False


def config_flags(config: GemlineConfig, private_config: Path | None) -> list[str]:
    """The flags that rebuild ``config`` in a child gemline command: ``--config`` of the private options file
    (when there is one) and ``--set KEY=VALUE`` per non-default setting (the storage options excluded)."""
    flags = [] if private_config is None else ["--config", str(private_config)]
    for pair in config_overrides(config):
        flags += ["--set", pair]
    return flags


def runs_distill(config: GemlineConfig) -> bool:
    """Whether ``gemline run`` starts ``distill --follow`` (with the trainer): ``distill.follow_in_run``, by
    default whether the teacher logs predictions (the students' supervision)."""
    chosen = config.distill.follow_in_run
    return config.trainer.logs_teacher_predictions if chosen is None else chosen


def stage_commands(plan: RunPlan, bootstrap: str, flags: list[str], *, distill: bool = False) -> list[StageCommand]:
    """The stages for ``plan`` (the embedded broker not included), in start order; with ``distill`` (and
    ``plan.train``) ``distill --follow`` last, polling as often as the trainer."""
    kafka = ["--bootstrap", bootstrap]
    stages = []
    if plan.generate_rate is not None:
        # A finite synthetic log: done when it exits 0; restarted only after a failure. Stopped first, so ingest
        # can still consume what it sent.
        stages.append(StageCommand("generate", (*GEMLINE, "generate", "--rate", str(plan.generate_rate), *kafka,
                                                *flags), restart="on-failure", stop_first=True))
    # The build's cadence is build.interval_s (in ``flags``) unless the plan sets one for both stages.
    build_interval = [] if plan.interval_s is None else ["--interval-s", str(plan.interval_s)]
    watch = ["--watch-s", str(plan.watch_s).lower()]  # "none" for None; the build's flag wins over build.watch_s
    stages += [
        StageCommand("ingest", (*GEMLINE, "ingest", "--streaming", *kafka, *flags)),
        StageCommand("validate", (*GEMLINE, "validate", "--follow", "--table", "events,examples", "--interval-s",
                                  str(10.0 if plan.interval_s is None else plan.interval_s), *watch, *flags)),
        StageCommand("build", (*GEMLINE, "build", "--follow", *build_interval, *watch, *flags)),
    ]
    if plan.train:
        stages.append(StageCommand("train", (*GEMLINE, "train", "--follow", "--poll-interval-s",
                                             str(plan.poll_interval_s), *watch, *flags)))
        if distill:
            stages.append(StageCommand("distill", (*GEMLINE, "distill", "--follow", "--poll-interval-s",
                                                   str(plan.poll_interval_s), *watch, *flags),
                                       nice=plan.distill_nice))
    return stages


def kafka_lag_source(config: GemlineConfig, bootstrap: str, *, timeout_s: float = 5.0) -> LagSource:
    """The consumer lag of ``config.kafka.topic`` against the ingest job's committed offsets, its watermarks
    read through one ``config.kafka.client`` client kept for all scrapes (made at the first)."""
    from ingest.kafka_clients import make_client
    from ingest.pipeline import app_id_for

    clients: list[Any] = []

    def watermarks() -> dict[int, tuple[int, int]]:
        if not clients:
            clients.append(make_client(config.kafka.client, bootstrap, timeout_s=timeout_s))
        return clients[0].end_offsets(config.kafka.topic)

    return LagSource(config.kafka.topic, app_id_for(config.kafka.topic), watermarks)


@contextlib.contextmanager
def serving_metrics(config: GemlineConfig, port: int | None, *, bootstrap: str | None,
                    stages: Callable[[], list[StageSample]] | None = None,
                    say: Callable[[str], None] | None = None, addr: str = LOCAL_ADDR) -> Iterator[None]:
    """Serve :mod:`gemline.metrics` for ``config``'s lake on ``addr:port`` (port 0: a free one; None: nothing is
    served; ``addr``: loopback by default) from a daemon thread while the block runs, and say where first; the lag
    metric only with a ``bootstrap``, the stage metrics only with ``stages``.

    Raises:
        OSError: the port is taken.
    """
    if port is None:
        yield
        return
    lag = None if bootstrap is None else kafka_lag_source(config, bootstrap)
    server, bound = serve(PipelineCollector(Lake.for_config(config), lag=lag, stages=stages), port, addr=addr)
    where = "this machine only" if addr == LOCAL_ADDR else "all interfaces" if addr in ("0.0.0.0", "::") else addr
    host = LOCAL_ADDR if addr in ("0.0.0.0", "::") else f"[{addr}]" if ":" in addr else addr
    try:
        (say or (lambda line: print(line, file=sys.stderr, flush=True)))(
            f"metrics: port {bound} on {addr}, {where} (http://{host}:{bound}/metrics)")
        yield
    finally:
        server.shutdown()
        server.server_close()


def stage_samples(sup: Supervisor) -> list[StageSample]:
    """Each supervised stage's name, restarts and whether its process runs, for the metrics."""
    return [StageSample(s.command.name, s.restarts, s.process is not None) for s in sup.stages]


STATUS_COLUMNS = ("stage", "state", "pid", "up", "restarts", "last", "rows", "lag", "last log line")
NARROW_COLUMNS = ("stage", "state", "restarts", "last", "rows", "lag")
"""The status table's columns on a terminal narrower than 120 characters: the numbers, not the log line."""
_MIN_WIDTHS = {"stage": 8, "rows": 9, "lag": 14}
_NARROW_MAX_WIDTHS = {"state": 11, "restarts": 3, "last": 15}


def status_view(sup: Supervisor, lake: Lake, tables: tuple[str, ...] = (Table.EVENTS, Table.EXAMPLES),
                progress: Mapping[str, StageProgress] | None = None, width: int | None = None) -> Group:
    """The live status: one row per stage (state, restarts, and from ``progress`` the last version, rows done and
    lag: :mod:`gemline.progress`), then the newest version of ``tables``; ``width``: the terminal's columns
    (under 120: :data:`NARROW_COLUMNS`)."""
    now = time.monotonic()
    progress = progress or {}
    columns = NARROW_COLUMNS if width is not None and width < 120 else STATUS_COLUMNS
    stages = RichTable(title="gemline run (Ctrl-C stops every stage)", expand=True)
    for column in columns:
        stages.add_column(column, overflow="ellipsis", no_wrap=True, ratio=1 if column == "last log line" else None,
                          min_width=_MIN_WIDTHS.get(column), justify="right" if column in ("rows", "lag") else "left",
                          max_width=_NARROW_MAX_WIDTHS.get(column) if columns is NARROW_COLUMNS else None)
    for s in sup.stages:
        p = progress.get(s.command.name, StageProgress())
        cells = {"stage": s.command.name, "state": s.state(now), "pid": str(s.pid or ""),
                 "up": "" if s.started_at is None else f"{now - s.started_at:.0f} s", "restarts": str(s.restarts),
                 "last": p.last, "rows": p.rows_cell(),
                 "lag": "" if p.lag is None else f"{p.lag:,} {p.lag_unit if p.lag != 1 else p.lag_unit[:-1]}", "last log line": s.last_log_line()[-120:]}
        stages.add_row(*(cells[c] for c in columns))
    versions = ", ".join(f"{t}@{v}" if (v := latest_version(lake.root, t, storage_options=lake.storage_options))
                         is not None else f"{t}: none yet" for t in tables)
    return Group(stages, f"lake {lake.root}: {versions}")


RUN_RECORD = "supervisor.json"
"""``LAKE/_run/supervisor.json`` (a local lake; else under the system temp folder, per lake): the running
``gemline run``'s pid, start, private options folder and stages' pids, removed when it stops. One found at a start
is what a run that died without stopping left (:func:`clean_after_dead_run`)."""


def run_record_path(lake: Lake) -> Path:
    """Where :data:`RUN_RECORD` of a run on ``lake`` is kept."""
    if is_remote(lake.root):
        import hashlib

        digest = hashlib.sha1(lake.root.encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"gemline-run-{digest}.json"
    return Path(lake.root) / "_run" / RUN_RECORD


def _gemline_process(pid: int) -> bool:
    """Whether ``pid`` runs now and is a gemline command (its command line names gemline): a pid from an old record
    may have been reused by an unrelated process, which must not be signalled."""
    try:
        return b"gemline" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        if sys.platform.startswith("linux"):
            return False
        try:  # no /proc: alive is the best we can tell
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def clean_after_dead_run(lake: Lake, say: Callable[[str], None], *, grace_s: float = 10.0) -> list[str]:
    """Before a ``gemline run`` starts on ``lake``: find what an earlier run that did not stop left (its
    :data:`RUN_RECORD`), stop its stages still running (SIGTERM to each process group, SIGKILL after ``grace_s``),
    remove its private options folder, say what was found in one line, and return those findings.

    Raises:
        gemline.locks.LakeBusyError: the recorded run is alive: another ``gemline run`` runs on this lake.
    """
    from gemline.locks import LakeBusyError

    path = run_record_path(lake)
    try:
        record = json.loads(path.read_text())
        pid, started_ms = int(record["pid"]), int(record.get("started_ms", 0))
    except FileNotFoundError:
        return []
    except (ValueError, KeyError, TypeError):
        record, pid, started_ms = {}, -1, 0
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started_ms / 1000))
    if pid > 0 and pid != os.getpid() and _gemline_process(pid):
        raise LakeBusyError(f"another `gemline run` (pid {pid}, started {started}) runs on this lake: stop it first "
                            f"(Ctrl-C in its terminal, or kill -TERM {pid})")
    found: list[str] = []
    stages = {str(k): int(v) for k, v in (record.get("stages") or {}).items()}
    alive = {name: p for name, p in stages.items() if p > 0 and _gemline_process(p)}
    for p in alive.values():
        with contextlib.suppress(OSError):
            os.killpg(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline and any(_gemline_process(p) for p in alive.values()):
        time.sleep(0.2)
    for name, p in alive.items():
        if _gemline_process(p):
            with contextlib.suppress(OSError):
                os.killpg(p, signal.SIGKILL)
        found.append(f"stage {name} (pid {p}) still running: stopped")
    private = str(record.get("private_dir") or "")
    if private and Path(private).name.startswith("gemline-run-") and Path(private).is_dir():
        shutil.rmtree(private, ignore_errors=True)
        found.append(f"its options folder {private}: removed")
    say(f"gemline run: the previous run on this lake (pid {pid}, started {started}) did not stop cleanly; "
        + ("; ".join(found) if found else "nothing of it was left running"))
    path.unlink(missing_ok=True)
    return found


def _write_record(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def run_pipeline(config: GemlineConfig, plan: RunPlan, *, log_dir: Path | None = None,
                 say: Callable[[str], None] | None = None, live: bool | None = None,
                 until: Callable[[Supervisor], bool] | None = None) -> int:
    """Run every stage until Ctrl-C or SIGTERM (module docstring); return 130 after Ctrl-C, else 0.

    Args:
        log_dir: one log per stage (default ``LAKE/_run/logs`` for a local lake, a temporary folder otherwise).
        say: where start/exit/restart lines go (default stderr).
        live: show the live status table (default: when stdout is a terminal).
        until: stop when this returns True, called with the supervisor at each poll (tests).

    Raises:
        gemline.errors.BrokerUnreachableError: the embedded broker did not listen within 60 s.
        gemline.errors.MissingInputError: ingest could not start over on a new embedded broker's topic.
        gemline.errors.BadConfigError: the topic exists with another partition count than ``kafka.partitions``.
        gemline.supervisor.StageGaveUpError: a stage kept exiting with a permanent error (its message).
        gemline.locks.LakeBusyError: another ``gemline run`` runs on this lake (:func:`clean_after_dead_run`).
    """
    lake = Lake.for_config(config)
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    live = sys.stdout.isatty() if live is None else live
    # Saved before any stage starts: a stage run alone on this lake later takes them as defaults (gemline.config).
    save_run_settings(config)
    clean_after_dead_run(lake, say)
    record_path = run_record_path(lake)
    try:
        with tempfile.TemporaryDirectory(prefix="gemline-run-") as private:  # 0700: only this user reads it
            record = {"pid": os.getpid(), "started_ms": int(time.time() * 1000), "private_dir": private, "stages": {}}
            _write_record(record_path, record)
            return _run_stages(config, plan, lake, private, say, live, log_dir, until,
                               lambda pids: _write_record(record_path, {**record, "stages": pids}))
    finally:
        record_path.unlink(missing_ok=True)


def _run_stages(config: GemlineConfig, plan: RunPlan, lake: Lake, private: str, say: Callable[[str], None],
                live: bool, log_dir: Path | None, until: Callable[[Supervisor], bool] | None,
                on_spawn: Callable[[dict[str, int]], None]) -> int:
    """:func:`run_pipeline` inside its private folder and run record."""
    from gemline.errors import BrokerUnreachableError
    from trainer.launch import write_private_config  # the spelling of a config file's lake and its options

    options_file = (write_private_config(lake, Path(private) / "options.toml")
                    if config.lake_storage_options else None)
    flags = config_flags(config, options_file)
    logs = log_dir or (Path(private) / "logs" if is_remote(config.lake) else Path(config.lake) / "_run" / "logs")
    broker: list[StageCommand] = []
    bootstrap = plan.bootstrap or config.kafka.bootstrap
    port = 0
    if not bootstrap:
        port = plan.broker_port or free_port()
        bootstrap = f"127.0.0.1:{port}"
        broker = [StageCommand("broker", (*GEMLINE, "broker", "--port", str(port)), stop_last=True)]
    stages = stage_commands(plan, bootstrap, flags, distill=runs_distill(config))
    sup = Supervisor([*broker, *stages], log_dir=logs, on_event=say, on_spawn=on_spawn)
    try:
        if broker:
            sup.start(["broker"])
            if not wait_for_port("127.0.0.1", port, 60.0):
                raise BrokerUnreachableError(f"the embedded broker did not listen on 127.0.0.1:{port} within "
                                             f"60 s; its log: {sup.stages[0].log_path}")
        if broker or plan.generate_rate is not None:
            ensure_topic(bootstrap, config.kafka.topic, config.kafka.partitions)
        if broker and _ingested_offsets(config, lake):
            say(f"the lake's Kafka offsets are of an earlier embedded broker, whose records were in memory and "
                f"are gone: ingest starts over on this broker's topic ({config.kafka.topic!r}, `gemline ingest "
                "--reset-topic`, recorded as `reset` in the events commit)")
            _reset_topic(bootstrap, flags, sup.log_dir / "ingest.log")
            if plan.generate_rate is not None:
                say(f"generate: if generate.seed={config.generate.seed} generated into this lake before, it sends "
                    "the same event ids again: ingest drops them as duplicates (or dead-letters them as "
                    "conflicts); new traffic needs another generate.seed and a generate.start_ms after the lake's newest "
                    "event (traffic from an earlier start lands behind the watermark, in late_events)")
    except BaseException:
        try:
            sup.stop(grace_s=5)  # the broker must not outlive a failed or interrupted start
        except KeyboardInterrupt:  # a second Ctrl-C: kill it now rather than leave it
            sup.escalate()
            sup.stop(grace_s=0)
        raise
    say(f"gemline run: {len(sup.stages)} stages, Kafka at {bootstrap}, logs in {logs}")
    drain = _ingest_lag(config, lake, bootstrap, sup) if broker and any(
        s.name == "ingest" for s in stages) else None
    lag = kafka_lag_source(config, bootstrap, timeout_s=2.0)  # a down broker must not hold the view long
    progress = (lambda: pipeline_progress(lake, ingest_app_id=lag.app_id, watermarks=lag.watermarks)) if live else None
    watch = dead_letter_watch(lake, lag.app_id, say)
    with serving_metrics(config, plan.metrics_port, bootstrap=bootstrap, stages=lambda: stage_samples(sup),
                         say=say, addr=plan.metrics_addr):
        return _supervise(sup, lake, progress, None if until is None else (lambda: until(sup)), drain,
                          plan.drain_timeout_s, watch)


def dead_letter_watch(lake: Lake, app_id: str, say: Callable[[str], None]) -> Callable[[], None]:
    """A check for the run's loop that says :func:`gemline.progress.dead_letter_warning` once, the first time the
    newest batch of the ingest writer ``app_id`` dead-lettered more than half its records (a rerun with the same
    ``generate.seed`` dead-letters every record as ``duplicate_conflict``, which the table alone did not show)."""
    said = [False]

    def check() -> None:
        if said[0]:
            return
        try:
            line = dead_letter_warning(last_ingest_dead_letter(lake, app_id))
        except Exception as exc:  # noqa: BLE001 - a table being created; a warning must never stop the run
            log.debug("dead-letter share unknown: %s", exc)
            return
        if line is not None:
            said[0] = True
            say(line)

    return check


def _ingested_offsets(config: GemlineConfig, lake: Lake) -> bool:
    """Whether the lake's ingest committed any record of ``config.kafka.topic`` (an end offset above 0)."""
    from ingest.pipeline import app_id_for

    return any(offset > 0 for offset in lake_offsets(lake, app_id_for(config.kafka.topic)).values())


def _reset_topic(bootstrap: str, flags: list[str], log_path: Path) -> None:
    """Run ``gemline ingest --reset-topic`` once (its output appended to ``log_path``): a batch that records the
    new topic's identity and offsets, so the streaming ingest and its restarts read it as the lake's own.

    Raises:
        gemline.errors.MissingInputError: it failed (the message names its log).
    """
    from gemline.errors import MissingInputError

    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        start = log.tell()
        code = subprocess.run([*GEMLINE, "ingest", "--reset-topic", "--bootstrap", bootstrap, *flags], stdout=log,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False).returncode
    if code != 0:
        with open(log_path, "rb") as log:
            log.seek(start)
            said = last_readable_line(log.read()[-8192:].decode("utf-8", errors="replace"))
        raise MissingInputError(f"`gemline ingest --reset-topic` on the new embedded broker exited with {code}"
                                f"{f' ({said})' if said else ''}; its log: {log_path}")


def _ingest_lag(config: GemlineConfig, lake: Lake, bootstrap: str, sup: Supervisor) -> Callable[[], int]:
    """Records the broker holds that the lake's ingest has not committed yet, summed over the partitions (the
    drain at a stop). The ends are read as ingest's planner reads them (:func:`ingest.kafka_source.plan_topic`:
    past a high watermark that lags the last record batch).

    Raises (from the callable):
        RuntimeError: the ingest stage is not running (nothing would consume the rest).
    """
    from ingest.kafka_source import plan_topic
    from ingest.pipeline import app_id_for

    app_id = app_id_for(config.kafka.topic)
    ingest = next(s for s in sup.stages if s.command.name == "ingest")

    def remaining() -> int:
        if ingest.process is None or ingest.process.poll() is not None:
            raise RuntimeError("ingest is not running")
        snapshot = plan_topic(bootstrap, config.kafka.topic, {}, previous=None, client=config.kafka.client,
                              timeout_s=config.ingest.read_timeout_s)
        done = lake_offsets(lake, app_id)
        return sum(max(0, r.end - done.get(r.partition, r.start)) for r in snapshot.ranges)

    return remaining


PROGRESS_EVERY_S = 5.0
"""Seconds between two reads of the stages' progress for the live view (each reads the quality, freshness and
Delta logs: :mod:`gemline.progress`); the stage states refresh every second."""


def _supervise(sup: Supervisor, lake: Lake, progress: Callable[[], Mapping[str, StageProgress]] | None,
               stop: Callable[[], bool] | None, drain: Callable[[], int] | None, drain_timeout_s: float,
               watch: Callable[[], None] | None = None) -> int:
    """Run the supervisor; with ``progress`` (a terminal), under the live status table; ``watch`` is called every
    :data:`PROGRESS_EVERY_S` seconds (:func:`dead_letter_watch`)."""
    if progress is None:
        checked = [-PROGRESS_EVERY_S]

        def check(s: Supervisor) -> None:
            if watch is not None and time.monotonic() - checked[0] >= PROGRESS_EVERY_S:
                watch()
                checked[0] = time.monotonic()

        return sup.run(until=stop, render=check, drain=drain, drain_timeout_s=drain_timeout_s)
    console = Console()
    with Live(status_view(sup, lake, width=console.width), console=console, refresh_per_second=2,
              transient=False) as view:
        last = {"view": 0.0, "progress": -PROGRESS_EVERY_S}
        seen: dict[str, Mapping[str, StageProgress]] = {"progress": {}}

        def render(s: Supervisor) -> None:
            now = time.monotonic()
            if now - last["view"] < 1.0:  # reading the Delta logs once a second is plenty
                return
            if now - last["progress"] >= PROGRESS_EVERY_S:
                seen["progress"] = progress()
                if watch is not None:
                    watch()
                last["progress"] = now
            view.update(status_view(s, lake, progress=seen["progress"], width=console.width))
            last["view"] = time.monotonic()

        code = sup.run(until=stop, render=render, drain=drain, drain_timeout_s=drain_timeout_s)
        view.update(status_view(sup, lake, progress=seen["progress"], width=console.width))  # the stopped states
        return code
