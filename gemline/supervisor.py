"""A small process supervisor: keeps each stage of the pipeline running in its own process.

``gemline run`` starts every stage (streaming ingest, ``build --follow``, ``validate --follow``, ``train --follow``)
as a child process under a :class:`Supervisor`. A child that exits while the supervisor is not stopping (a crash,
a SIGKILL, an unexpected exit 0) is started again after an exponential backoff, and the supervisor says so. Each
stage commits idempotently to the lake, so a restarted stage redoes at most its half-done batch and writes
nothing twice. Stopping (Ctrl-C or SIGTERM to the supervisor) goes in phases: the ``stop_first`` stages (a
producer), then an optional drain (``gemline run``: ingest catches up with what the producer sent), then the other
stages, last started first, then the ``stop_last`` stages (the broker they use). Each phase sends SIGTERM, so a
child finishes its step in flight and exits, and SIGKILLs a child still running after the grace period. A second
Ctrl-C or SIGTERM while stopping skips the rest of the grace and the drain: every stage left is SIGKILLed with its
process group and reaped, so none outlives the supervisor holding the lake's locks.

A stage that keeps exiting with :data:`PERMANENT_EXIT` (a :class:`gemline.errors.GemlineError`: bad config, missing
input...) is given up after ``max_permanent_exits`` starts in a row, and the run stops with its error
(:class:`StageGaveUpError`). Not at the first: exit 2 also covers conditions that heal on their own (the lake
lock of a stage still exiting, a broker not answering yet, a commit conflict), so a few backed-off tries are kept.

Children run in their own sessions (``start_new_session``): a Ctrl-C in the terminal reaches the supervisor only,
which then stops the children in order, instead of every process at once. Their stdout and stderr go to one log
file per stage.

Nothing outlives the supervisor, however it dies: each child inherits the read end of a pipe whose write end only the
supervisor holds (its lifeline, named by :data:`gemline.process.SUPERVISOR_FD_ENV`); a gemline stage watches it
(:func:`gemline.process.watch_lifeline`), and when the supervisor is gone -- SIGKILL, the OOM killer -- it stops as
on SIGTERM and is SIGKILLed with its process group after :data:`gemline.process.LIFELINE_GRACE_S`. ``on_spawn``
lets the caller record the children's pids for a later run to check (``gemline run``'s run record).

The restart policy follows the usual supervisor shape (systemd's ``Restart=always`` with ``RestartSec``, Erlang/OTP
supervisors' restart intensity): the delay doubles with each consecutive failure up to a cap, and a child that
stayed up for ``healthy_after_s`` seconds counts as healthy again, so its next crash waits the base delay.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from gemline.errors import GemlineError
from gemline.process import SUPERVISOR_FD_ENV

log = logging.getLogger(__name__)

PERMANENT_EXIT = 2
"""The exit status of a gemline command that ended with a :class:`gemline.errors.GemlineError` of exit 2."""


class StageGaveUpError(GemlineError, RuntimeError):
    """A supervised stage exited with :data:`PERMANENT_EXIT` ``max_permanent_exits`` times in a row (exit 2); the
    message names the stage, its last ``error:`` line and its log."""

RELAYED = re.compile(r"^(?:(?:WARNING|ERROR|CRITICAL):(?:ingest|sequences|features|trainer|validation|gemline)"
                     r"(?:\.(?!rdkafka:)[\w.]+)?:|error: )")
"""Log lines of a stage the supervisor repeats on its console: our packages' warnings and errors (an unreachable
broker, a quarantined version) and the CLI's one-line errors; not librdkafka's per-retry lines (``ingest.rdkafka``)
nor third-party noise, which stay in the stage's log file."""


@dataclass(frozen=True)
class StageCommand:
    """One supervised stage: a name, the command line of its process (``argv[0]`` an executable), and when it
    is started again after it exits: ``always`` (a stage that runs until stopped), ``on-failure`` (a job that
    may finish: exit 0 is done) or ``never``. A ``stop_last`` stage (a service the others use, the embedded
    broker) is stopped only once the others have exited, so they finish their step in flight against it; a
    ``stop_first`` stage (a producer, ``gemline generate``) before them, so what it sent can still be drained.
    ``nice`` (>= 0) is added to the stage's scheduling niceness over the supervisor's (POSIX ``setpriority`` on
    its process group: every thread and child): a stage off the freshness path (``distill --follow``) then takes
    only the CPU the others leave when the machine is full, and all it wants when it is not.

    Raises:
        ValueError: both ``stop_first`` and ``stop_last``; a negative ``nice`` (raising a priority needs root).
    """

    name: str
    argv: tuple[str, ...]
    restart: Literal["always", "on-failure", "never"] = "always"
    stop_last: bool = False
    stop_first: bool = False
    nice: int = 0

    def __post_init__(self) -> None:
        if self.stop_first and self.stop_last:
            raise ValueError(f"StageCommand {self.name!r}: stop_first and stop_last exclude each other")
        if self.nice < 0:
            raise ValueError(f"StageCommand {self.name!r}: nice must be >= 0, got {self.nice}")


def restart_delay_s(failures: int, *, base_s: float, cap_s: float) -> float:
    """Seconds to wait before the restart after ``failures`` consecutive failures (>= 1): ``base_s * 2**(failures
    - 1)``, at most ``cap_s``.

    Raises:
        ValueError: ``failures < 1``.
    """
    if failures < 1:
        raise ValueError(f"restart_delay_s: expected failures >= 1, got {failures}")
    return min(cap_s, base_s * 2 ** min(failures - 1, 32))


@dataclass
class StageState:
    """What the supervisor knows of one stage (shown by the status view)."""

    command: StageCommand
    log_path: Path
    process: subprocess.Popen | None = None
    started_at: float | None = None
    """Monotonic seconds when the current process started; None while waiting to restart."""
    restarts: int = 0
    failures: int = 0
    """Consecutive exits without a healthy run in between (sets the backoff)."""
    last_exit_code: int | None = None
    restart_at: float | None = None
    """Monotonic seconds when a restart is due; None when running or stopped."""
    stopped: bool = False
    permanent_exits: int = 0
    """Consecutive exits with :data:`PERMANENT_EXIT` without a healthy run in between."""
    last_error: str = ""
    """The stage's last relayed one-line error (its ``error: ...`` line without that prefix), or ''."""
    _log: IO[bytes] | None = field(default=None, repr=False)
    _read_to: int | None = field(default=None, repr=False)
    """Byte offset of the log up to which :meth:`new_log_lines` has read; None: not started (the log's end)."""

    @property
    def pid(self) -> int | None:
        """The running process's id, None when not running."""
        return None if self.process is None else self.process.pid

    def state(self, now: float) -> str:
        """``running``, ``restarting in N s``, ``not started`` or ``stopped (exit C)``."""
        if self.process is not None:
            return "running"
        if self.restart_at is not None:
            return f"restarting in {max(0.0, self.restart_at - now):.0f} s"
        if self.last_exit_code is None:
            return "not started"
        return f"stopped (exit {self.last_exit_code})"

    def new_log_lines(self, max_bytes: int = 65536) -> list[str]:
        """Complete lines appended to the stage's log since the last call (at most ``max_bytes`` read per call; a
        longer backlog is read over the next calls). The first call starts at the log's end at that time, so lines
        of an earlier run of the pipeline are not repeated."""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, 2)
                size = fh.tell()
                if self._read_to is None or self._read_to > size:
                    self._read_to = size
                fh.seek(self._read_to)
                chunk = fh.read(max_bytes)
        except OSError:
            return []
        end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next call
        self._read_to += end
        return [line.strip() for line in chunk[:end].decode("utf-8", "replace").splitlines() if line.strip()]

    def last_log_line(self, max_bytes: int = 4096) -> str:
        """The last readable line of the stage's log (read from its last ``max_bytes``: :func:`last_readable_line`),
        or ''."""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, 2)
                size = fh.tell()
                fh.seek(max(0, size - max_bytes))
                tail = fh.read().decode("utf-8", "replace")
        except OSError:
            return ""
        # A window that starts inside the file starts inside a line: that part line is no line to show.
        return last_readable_line(tail if size <= max_bytes else tail.partition("\n")[2])


_JSON_OPENERS = ("{", "[")
_JSON_CLOSERS = ("}", "]")


def _json_summary(document: object) -> str:
    """``JSON: key=value ...`` of a JSON object's top-level entries (a table or list as its size); a list as its
    length: one line for the live table of what a stage printed as indented JSON."""
    if not isinstance(document, dict):
        return f"JSON: a list of {len(document)}" if isinstance(document, list) else f"JSON: {document!r}"

    def shown(value: object) -> str:
        if isinstance(value, dict):
            return f"{{{len(value)}}}"
        if isinstance(value, list):
            return f"[{len(value)}]"
        return json.dumps(value)

    return "JSON: " + " ".join(f"{key}={shown(value)}" for key, value in document.items())


def last_readable_line(text: str) -> str:
    """The last line of a log's ``text`` a person can read alone, for the status table's log-line column; '' when
    none.

    Stages print results as indented JSON (``json.dumps(..., indent=2)``: ``{``, then ``  "key": value,`` lines,
    then ``}`` at the start of a line), whose last line alone (``}``, or ``"gaps": []``) said nothing: a complete
    document at the end becomes :func:`_json_summary` of it; its lines, and those of a document still being written
    or cut by the window, are passed over for the last line before them. A line that starts with whitespace, or is
    only a bracket, counts as such a fragment (a one-line JSON record is a line like any other).
    """
    lines = [line.rstrip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    i = len(lines) - 1
    while i >= 0:
        line = lines[i]
        if line.rstrip(",") in _JSON_CLOSERS:
            start = next((j for j in range(i, -1, -1) if lines[j] in _JSON_OPENERS), None)
            if start is not None:
                try:
                    return _json_summary(json.loads("\n".join(lines[start:i + 1])))
                except ValueError:  # not one document after all: look above its first line
                    pass
                i = start - 1
                continue
        if line[0].isspace() or line.rstrip(",") in (*_JSON_OPENERS, *_JSON_CLOSERS):
            i -= 1
            continue
        return line.strip()
    return ""


class Supervisor:
    """Keeps ``commands`` running (module docstring).

    Args:
        commands: the stages, started in this order and stopped in reverse order.
        log_dir: one ``<name>.log`` per stage (appended to across restarts).
        backoff_s: the first restart delay (s); it doubles with each consecutive failure.
        max_backoff_s: the longest restart delay (s).
        healthy_after_s: a process that ran this long (s) resets its stage's failure count.
        max_permanent_exits: starts in a row ending with :data:`PERMANENT_EXIT` after which a stage is given up
            and the run stops (module docstring).
        on_event: called with one line per start, exit and restart (besides the log).
        on_spawn: called after each start with ``{stage: pid}`` of every stage running.

    Raises:
        ValueError: two stages with one name, a negative delay, or ``max_permanent_exits < 1``.
    """

    def __init__(self, commands: Sequence[StageCommand], *, log_dir: Path, backoff_s: float = 1.0,
                 max_backoff_s: float = 60.0, healthy_after_s: float = 60.0, max_permanent_exits: int = 5,
                 on_event: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 on_spawn: Callable[[dict[str, int]], None] | None = None) -> None:
        names = [c.name for c in commands]
        if len(set(names)) != len(names):
            raise ValueError(f"Supervisor: stage names must be unique, got {names}")
        if min(backoff_s, max_backoff_s, healthy_after_s) < 0:
            raise ValueError("Supervisor: delays must be >= 0")
        if max_permanent_exits < 1:
            raise ValueError(f"Supervisor: max_permanent_exits must be >= 1, got {max_permanent_exits}")
        self.log_dir = Path(log_dir)
        self.stages = [StageState(c, self.log_dir / f"{c.name}.log") for c in commands]
        self.backoff_s, self.max_backoff_s, self.healthy_after_s = backoff_s, max_backoff_s, healthy_after_s
        self.on_event = on_event
        self.clock = clock
        self.max_permanent_exits = max_permanent_exits
        self.stopping = False
        self.escalated = False
        """A second signal came while stopping: what is left is SIGKILLed at once."""
        self.gave_up: str | None = None
        """Why the run stops on its own: a stage given up (module docstring); None while none is."""
        self._signal: int | None = None
        self.on_spawn = on_spawn
        self._lifeline: tuple[int, int] | None = None
        """(read, write) ends of the pipe each child watches (module docstring); opened at the first start."""

    def _say(self, line: str) -> None:
        log.info("%s", line)
        if self.on_event is not None:
            try:
                self.on_event(line)
            except OSError:  # a closed terminal or pipe (`gemline run | head`) must not stop the supervision
                pass

    def _spawn(self, stage: StageState) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if stage._log is None:
            stage._log = open(stage.log_path, "ab")
            stage.new_log_lines()  # from here on: a log kept from an earlier run is not relayed again
        if self._lifeline is None:
            self._lifeline = os.pipe()  # both ends close-on-exec: only pass_fds hands the read end to a child
        read = self._lifeline[0]
        stage.process = subprocess.Popen(stage.command.argv, stdout=stage._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=(read,),
                                         env={**os.environ, SUPERVISOR_FD_ENV: str(read)})
        stage.started_at, stage.restart_at = self.clock(), None
        self._say(f"{stage.command.name}: started (pid {stage.process.pid}{_lower_priority(stage)})")
        if self.on_spawn is not None:
            self.on_spawn({s.command.name: s.process.pid for s in self.stages
                           if s.process is not None and s.process.poll() is None})

    def start(self, names: Sequence[str] | None = None) -> None:
        """Start the processes of the stages ``names`` (all when None) that were never started, in order."""
        for stage in self.stages:
            if (names is None or stage.command.name in names) and stage.started_at is None \
                    and stage.restart_at is None and not stage.stopped and stage.process is None:
                self._spawn(stage)

    def _relay(self, stage: StageState) -> None:
        if stage._log is None:
            return
        for line in stage.new_log_lines():
            if RELAYED.match(line):
                self._say(f"{stage.command.name}: {line}")
                if line.startswith("error: "):
                    stage.last_error = line.removeprefix("error: ")

    def poll(self) -> None:
        """Relay the stages' new warnings and errors (:data:`RELAYED`), notice exited processes, schedule their
        restarts, and start the restarts that are due."""
        now = self.clock()
        for stage in self.stages:
            self._relay(stage)
            if stage.process is not None:
                code = stage.process.poll()
                if code is None:
                    continue
                self._relay(stage)  # what it wrote between the read above and its exit (its error line)
                ran = now - (stage.started_at or now)
                stage.process, stage.started_at, stage.last_exit_code = None, None, code
                if self.stopping or stage.stopped:
                    continue
                policy = stage.command.restart
                if policy == "never" or (policy == "on-failure" and code == 0):
                    stage.stopped = True
                    self._say(f"{stage.command.name}: exited with {_describe(code)} after {ran:.1f} s; not restarted "
                              f"(restart={policy})")
                    continue
                healthy = ran >= self.healthy_after_s
                stage.failures = 1 if healthy else stage.failures + 1
                stage.permanent_exits = (0 if code != PERMANENT_EXIT else 1 if healthy else stage.permanent_exits + 1)
                if stage.permanent_exits >= self.max_permanent_exits:
                    stage.stopped = True
                    self.gave_up = (f"{stage.command.name} exited with exit {code} (a permanent error) "
                                    f"{stage.permanent_exits} times in a row; not restarted. Its error: "
                                    f"{stage.last_error or 'none printed'} (its log: {stage.log_path})")
                    self._say(f"{stage.command.name}: exited with {_describe(code)} after {ran:.1f} s; given up, "
                              "stopping the run")
                    continue
                delay = restart_delay_s(stage.failures, base_s=self.backoff_s, cap_s=self.max_backoff_s)
                stage.restart_at = now + delay
                self._say(f"{stage.command.name}: exited with {_describe(code)} after {ran:.1f} s; restarting in "
                          f"{delay:.1f} s (restart {stage.restarts + 1}; its log: {stage.log_path})")
            elif stage.restart_at is not None and now >= stage.restart_at and not self.stopping:
                stage.restarts += 1
                self._spawn(stage)

    def stop(self, grace_s: float = 30.0, *, drain: Callable[[], int] | None = None,
             drain_timeout_s: float = 60.0) -> dict[str, int | None]:
        """Stop every stage in phases (module docstring): the ``stop_first`` stages; ``drain`` (when given); the
        others, last started first; the ``stop_last`` stages. Each phase SIGTERMs its running stages, waits up to
        ``grace_s`` for all and SIGKILLs the rest; after :meth:`escalate`, at once. Return each stage's exit code
        (None: was not running).

        Args:
            drain: the number of records still to consume (ingest's lag); called about once a second until it
                returns 0, ``drain_timeout_s`` seconds passed (said, with what was left) or :meth:`escalate`.
                An exception it raises ends the drain (said).
        """
        self.stopping = True
        for stage in self.stages:
            stage.restart_at = None
        self._stop_group([s for s in reversed(self.stages) if s.command.stop_first], grace_s)
        if drain is not None:
            self._drain(drain, drain_timeout_s)
        self._stop_group([s for s in reversed(self.stages) if not (s.command.stop_first or s.command.stop_last)],
                         grace_s)
        self._stop_group([s for s in reversed(self.stages) if s.command.stop_last], grace_s)
        for stage in self.stages:
            if stage._log is not None:
                stage._log.close()
                stage._log = None
        if self._lifeline is not None:  # every child is stopped: the pipe has done its work
            for fd in self._lifeline:
                os.close(fd)
            self._lifeline = None
        return {s.command.name: s.last_exit_code for s in self.stages}

    def escalate(self) -> None:
        """Stop without grace: the stop in progress SIGKILLs every stage left (with its process group) at once and
        skips the drain. Safe in a signal handler."""
        if not self.escalated:
            self.escalated = True
            self._say("second signal: killing every stage left now (SIGKILL)")

    def _drain(self, remaining: Callable[[], int], timeout_s: float) -> None:
        started = time.monotonic()
        while not self.escalated:
            try:
                left = remaining()
            except Exception as exc:  # noqa: BLE001 (a drain that cannot measure must not block the stop)
                self._say(f"drain: stopped ({exc}); stopping the stages")
                return
            if self.escalated:
                return
            waited = time.monotonic() - started
            if left <= 0:
                self._say(f"drain: every record in the broker is consumed ({waited:.1f} s)")
                return
            if waited >= timeout_s:
                self._say(f"drain: {left} records still not consumed after {timeout_s:.0f} s; stopping the stages "
                          "anyway")
                return
            time.sleep(min(1.0, max(0.0, timeout_s - waited)))

    def _stop_group(self, stages: list[StageState], grace_s: float) -> None:
        running = [s for s in stages if s.process is not None]
        for stage in running:
            if not self.escalated and stage.process is not None and stage.process.poll() is None:
                stage.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(s.process is not None and s.process.poll() is None for s in running):
            if self.escalated or time.monotonic() >= deadline:
                for stage in running:
                    if stage.process is not None and stage.process.poll() is None:
                        if not self.escalated:
                            self._say(f"{stage.command.name}: still running {grace_s:.0f} s after SIGTERM; killed")
                        _kill_group(stage.process)
                break
            time.sleep(0.05)
        for stage in running:
            assert stage.process is not None
            stage.process.wait()
            stage.last_exit_code = stage.process.returncode
            stage.process, stage.stopped = None, True

    def run(self, *, poll_interval_s: float = 0.5, until: Callable[[], bool] | None = None,
            render: Callable[[Supervisor], None] | None = None, grace_s: float = 30.0,
            drain: Callable[[], int] | None = None, drain_timeout_s: float = 60.0) -> int:
        """Start the stages and keep them running until ``until()`` is true, Ctrl-C or SIGTERM; then :meth:`stop`
        them (with ``drain``). A second Ctrl-C or SIGTERM while stopping :meth:`escalate` s. Signals are handled
        only when called from the main thread.

        Returns:
            0 when stopped by ``until`` or SIGTERM, 130 after Ctrl-C.

        Raises:
            StageGaveUpError: a stage was given up (module docstring); every stage is stopped first.
        """
        def on_signal(signum: int, frame: object) -> None:
            if self._signal is None:
                self._signal = signum  # the loop ends at its next check; stop() runs outside the handler
            else:
                self.escalate()

        handled = (signal.SIGINT, signal.SIGTERM)
        main = threading.current_thread() is threading.main_thread()
        previous = {sig: signal.signal(sig, on_signal) for sig in handled} if main else {}
        try:
            self.start()
            while self._signal is None and self.gave_up is None and (until is None or not until()):
                self.poll()
                if render is not None:
                    render(self)
                if self._signal is None and self.gave_up is None:
                    time.sleep(poll_interval_s)
        except KeyboardInterrupt:  # a SIGINT before the handler was in place, or raised by a callback
            self._signal = signal.SIGINT
        finally:
            if self._signal is None:
                self._signal = -1  # stopping for another reason: a signal from here on escalates
            self._say("stopping every stage (SIGTERM; each finishes its step in flight; a second Ctrl-C kills them)")
            try:
                codes = self.stop(grace_s, drain=drain, drain_timeout_s=drain_timeout_s)
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
            self._say("stopped: " + ", ".join(f"{name} {_describe(c)}" for name, c in codes.items()))
        if self.gave_up is not None:
            raise StageGaveUpError(self.gave_up)
        return 130 if self._signal == signal.SIGINT else 0


def _lower_priority(stage: StageState) -> str:
    """Add ``stage.command.nice`` to the niceness of the stage's new process group (it leads one:
    ``start_new_session``); returns what the start line says of it ('' for nice 0).

    PRIO_PGRP sets every thread of every process in the group (Linux's setpriority), and threads and children
    made later inherit it, so no preexec_fn (unsafe in a supervisor with threads) is needed. A platform without it,
    or a process already gone, starts at the normal priority, and the line says so."""
    if not stage.command.nice or stage.process is None:
        return ""
    try:
        own = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PGRP, stage.process.pid, min(19, own + stage.command.nice))
    except (AttributeError, OSError) as exc:
        return f", priority not lowered: {exc}"
    return f", nice +{stage.command.nice}"


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL ``process`` and its process group (it leads one: ``start_new_session``), so a worker it forked
    does not outlive it holding an inherited lock."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:  # the group is gone, or the process leads none: the process alone
        pass
    process.kill()


def _describe(code: int | None) -> str:
    if code is None:
        return "not running"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"
