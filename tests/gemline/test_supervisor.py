"""gemline.supervisor: a crashed or killed stage is started again with backoff; stopping reaches every stage."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from gemline.locks import LakeBusyError, exclusive
from gemline.supervisor import StageCommand, StageGaveUpError, StageState, Supervisor, restart_delay_s


def _python(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def _wait(condition, timeout_s: float = 30.0, supervisor: Supervisor | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        if supervisor is not None:
            supervisor.poll()
        time.sleep(0.02)


def test_restart_delay_doubles_up_to_the_cap():
    assert [restart_delay_s(n, base_s=1.0, cap_s=10.0) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert restart_delay_s(10_000, base_s=0.5, cap_s=60.0) == 60.0
    with pytest.raises(ValueError):
        restart_delay_s(0, base_s=1.0, cap_s=1.0)


def test_a_crashing_stage_is_restarted_with_backoff_until_it_stays_up(tmp_path):
    # The stage fails on its first two starts (counted in a file), then runs until stopped.
    counter = tmp_path / "starts"
    code = (f"import pathlib, time; p = pathlib.Path({str(counter)!r}); n = int(p.read_text()) if p.exists() else 0; "
            "p.write_text(str(n + 1)); print('start', n + 1, flush=True)\n"
            "if n < 2: raise SystemExit(3)\n"
            "time.sleep(60)")
    events: list[str] = []
    sup = Supervisor([StageCommand("flaky", _python(code))], log_dir=tmp_path / "logs", backoff_s=0.05,
                     max_backoff_s=1.0, healthy_after_s=30.0, on_event=events.append)
    sup.start()
    stage = sup.stages[0]
    _wait(lambda: stage.restarts == 2 and stage.process is not None and counter.read_text() == "3", supervisor=sup)
    assert stage.failures == 2 and stage.last_exit_code == 3
    exits = [e for e in events if "exited" in e]
    assert len(exits) == 2 and "exit 3" in exits[0] and "restarting in 0.1 s" in exits[1]  # 0.05 then 0.1
    codes = sup.stop(grace_s=10)
    assert codes == {"flaky": -signal.SIGTERM}
    assert stage.last_log_line() == "start 3"


def test_a_sigkilled_stage_is_started_again_and_stop_reaches_every_stage(tmp_path):
    # Each stage traps SIGTERM, writes that it stopped cleanly, and exits 0 (as gemline's --follow commands do).
    def stage_code(name: str) -> str:
        return ("import signal, sys, time, pathlib\n"
                f"def done(*_): pathlib.Path({str(tmp_path)!r}, {name!r} + '.stopped').write_text('clean'); sys.exit(0)\n"
                "signal.signal(signal.SIGTERM, done)\n"
                "print('up', flush=True)\n"
                "while True: time.sleep(0.05)")

    sup = Supervisor([StageCommand("a", _python(stage_code("a"))), StageCommand("b", _python(stage_code("b")))],
                     log_dir=tmp_path / "logs", backoff_s=0.05)
    sup.start()
    a, b = sup.stages
    _wait(lambda: a.last_log_line() == "up" and b.last_log_line() == "up")
    first_pid = a.pid
    assert first_pid is not None
    os.kill(first_pid, signal.SIGKILL)
    _wait(lambda: a.restarts == 1 and a.pid not in (None, first_pid), supervisor=sup)
    assert a.last_exit_code == -signal.SIGKILL and b.restarts == 0
    _wait(lambda: (tmp_path / "logs" / "a.log").read_text().count("up") == 2)
    codes = sup.stop(grace_s=10)
    assert codes == {"a": 0, "b": 0}
    assert (tmp_path / "a.stopped").read_text() == (tmp_path / "b.stopped").read_text() == "clean"
    sup.poll()
    assert all(s.process is None and s.restart_at is None for s in sup.stages), "nothing restarts after stop"


def test_a_stage_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    events: list[str] = []
    sup = Supervisor([StageCommand("stubborn", _python(code))], log_dir=tmp_path / "logs", on_event=events.append)
    sup.start()
    _wait(lambda: sup.stages[0].last_log_line() == "up")
    assert sup.stop(grace_s=0.5) == {"stubborn": -signal.SIGKILL}
    assert any("killed" in e for e in events)


def test_a_stop_last_service_outlives_the_stages_that_use_it(tmp_path):
    """The broker is stopped only after the stages: a stage that finishes its step on SIGTERM still finds it up."""
    service = ("import signal, sys, time, pathlib\n"
               f"up = pathlib.Path({str(tmp_path)!r}, 'service.up'); up.write_text('1')\n"
               "signal.signal(signal.SIGTERM, lambda *_: (up.unlink(), sys.exit(0)))\n"
               "print('up', flush=True)\n"
               "while True: time.sleep(0.05)")
    stage = ("import signal, sys, time, pathlib\n"
             f"root = pathlib.Path({str(tmp_path)!r})\n"
             "def done(*_):\n"
             "    time.sleep(0.5)  # the step in flight\n"
             "    (root / 'saw').write_text(str((root / 'service.up').exists())); sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, done)\n"
             "print('up', flush=True)\n"
             "while True: time.sleep(0.05)")
    sup = Supervisor([StageCommand("service", _python(service), stop_last=True), StageCommand("stage", _python(stage))],
                     log_dir=tmp_path / "logs")
    sup.start()
    _wait(lambda: all(s.last_log_line() == "up" for s in sup.stages))
    assert sup.stop(grace_s=10) == {"service": 0, "stage": 0}
    assert (tmp_path / "saw").read_text() == "True" and not (tmp_path / "service.up").exists()


def test_duplicate_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unique"):
        Supervisor([StageCommand("x", ("true",)), StageCommand("x", ("true",))], log_dir=tmp_path)


def test_a_job_that_finishes_is_not_restarted_unless_it_failed(tmp_path):
    events: list[str] = []
    sup = Supervisor([StageCommand("done", _python("print('ok')"), restart="on-failure"),
                      StageCommand("failed", _python("raise SystemExit(4)"), restart="on-failure"),
                      StageCommand("once", _python("raise SystemExit(5)"), restart="never")],
                     log_dir=tmp_path / "logs", backoff_s=0.05, on_event=events.append)
    sup.start(["done"])
    assert [s.pid is not None for s in sup.stages] == [True, False, False]
    sup.start()
    done, failed, once = sup.stages
    _wait(lambda: failed.restarts >= 1 and done.stopped and once.stopped, supervisor=sup)
    assert (done.last_exit_code, done.restarts, once.last_exit_code, once.restarts) == (0, 0, 5, 0)
    assert any("done: exited with exit 0" in e and "not restarted" in e for e in events)
    sup.stop(grace_s=5)


def test_a_closed_pipe_under_the_status_view_still_stops_every_stage(tmp_path):
    """`gemline run | head`: once head exits, writing the status raises BrokenPipeError; the stages run in their
    own sessions, so the supervisor must still stop them, or they outlive it."""
    def closed(line: str) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def render(sup: Supervisor) -> None:
        if sup.stages[0].last_log_line() == "up":
            raise BrokenPipeError(32, "Broken pipe")

    sup = Supervisor([StageCommand("stage", _python("import time; print('up', flush=True); time.sleep(60)"))],
                     log_dir=tmp_path / "logs", on_event=closed)
    with pytest.raises(BrokenPipeError):
        sup.run(poll_interval_s=0.02, render=render, grace_s=5.0)
    assert sup.stages[0].process is None and sup.stages[0].last_exit_code == -signal.SIGTERM


def test_a_stages_own_warnings_and_errors_reach_the_console_and_noise_does_not(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "ingest.log").write_text("WARNING:ingest.streaming:from an earlier run\n")  # not repeated
    code = ("import logging, sys, time; logging.basicConfig(); "
            "logging.getLogger('ingest.streaming').warning('ingest: Kafka at h:1 is unreachable'); "
            "logging.getLogger('ingest.rdkafka').error('FAIL connection refused'); "
            "logging.getLogger('apache_beam').warning('beam noise'); "
            "print('error: examples@3 is quarantined', file=sys.stderr); print('a progress line'); "
            "sys.stderr.flush(); sys.stdout.flush(); time.sleep(60)")
    events: list[str] = []
    sup = Supervisor([StageCommand("ingest", _python(code))], log_dir=logs, on_event=events.append)
    sup.start()
    relayed = lambda: [e for e in events if not e.startswith("ingest: started")]  # noqa: E731
    _wait(lambda: len(relayed()) >= 2, supervisor=sup)
    sup.poll()
    assert relayed() == ["ingest: WARNING:ingest.streaming:ingest: Kafka at h:1 is unreachable",
                         "ingest: error: examples@3 is quarantined"]
    sup.stop(grace_s=5)


def test_a_stage_that_keeps_exiting_with_a_permanent_error_stops_the_run_with_its_message(tmp_path):
    """Exit 2 (a GemlineError: bad config, missing input) is tried max_permanent_exits times, then the run stops
    every stage and raises the stage's one-line error; another exit code keeps being restarted."""
    counter = tmp_path / "starts"
    bad = (f"import pathlib, sys; p = pathlib.Path({str(counter)!r}); p.write_text(str(int(p.read_text()) + 1) "
           "if p.exists() else '1'); print('error: topic t does not exist', file=sys.stderr); sys.exit(2)")
    deadline = time.monotonic() + 60
    events: list[str] = []
    sup = Supervisor([StageCommand("ingest", _python(bad)), StageCommand("other", _python("import time; "
                                                                                          "time.sleep(600)"))],
                     log_dir=tmp_path / "logs", backoff_s=0.01, max_backoff_s=0.05, max_permanent_exits=3,
                     on_event=events.append)
    with pytest.raises(StageGaveUpError, match=r"ingest exited with exit 2 \(a permanent error\) 3 times in a "
                                               r"row; not restarted. Its error: topic t does not exist \(its log: "):
        sup.run(poll_interval_s=0.02, until=lambda: time.monotonic() > deadline, grace_s=5)
    assert counter.read_text() == "3", "exactly max_permanent_exits starts"
    assert [s.process for s in sup.stages] == [None, None] and sup.stages[1].last_exit_code == -signal.SIGTERM
    assert any(e.startswith("ingest: exited with exit 2") and "given up" in e for e in events)
    with pytest.raises(ValueError, match="max_permanent_exits"):
        Supervisor([], log_dir=tmp_path, max_permanent_exits=0)


def test_a_second_signal_while_stopping_kills_every_stage_and_frees_the_lake_lock(tmp_path):
    """A stage that ignores SIGTERM and forked a worker sharing its lock: the first Ctrl-C starts a graceful stop
    (60 s of grace), the second kills the stage's whole process group at once; nothing is orphaned, the lock is free."""
    lake = tmp_path / "lake"
    stage = ("import fcntl, os, pathlib, signal, time\n"
             "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
             f"path = pathlib.Path({str(lake)!r}, '_locks', 'ingest.lock'); path.parent.mkdir(parents=True)\n"
             "fd = os.open(path, os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX)\n"
             "if os.fork() == 0: time.sleep(600)\n"  # the worker inherits the locked descriptor
             "print('up', flush=True); time.sleep(600)")
    said: list[str] = []

    def on_event(line: str) -> None:
        said.append(line)
        if line.startswith("stopping every stage"):
            os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, while the stop waits on the grace

    sup = Supervisor([StageCommand("ingest", _python(stage))], log_dir=tmp_path / "logs", on_event=on_event)

    def first_ctrl_c() -> bool:
        if sup.stages[0].last_log_line() == "up" and "sent" not in said:
            said.append("sent")
            os.kill(os.getpid(), signal.SIGINT)
        return False

    before = signal.getsignal(signal.SIGINT)
    assert sup.run(poll_interval_s=0.02, until=first_ctrl_c, grace_s=60) == 130
    assert sup.stages[0].last_exit_code == -signal.SIGKILL and sup.stages[0].process is None
    assert any(line.startswith("second signal: killing") for line in said)
    for _ in range(200):  # the worker's SIGKILL is delivered asynchronously: bounded by a count of tries
        try:
            with exclusive(lake, "ingest"):
                break
        except LakeBusyError:
            time.sleep(0.05)
    else:
        raise AssertionError("the lake's ingest lock is still held: a stage's process outlived the supervisor")
    assert signal.getsignal(signal.SIGINT) is before, "the caller's handler is back"


def test_stop_phases_producer_then_drain_then_stages_then_service(tmp_path):
    """The producer stops first; the drain runs while the consumer and the service still run (until nothing is
    left, or its timeout, said with what is left); then the consumer, then the service."""
    def stage(name: str) -> tuple[str, ...]:
        return _python("import signal, sys, time, pathlib\n"
                       f"def done(*_): pathlib.Path({str(tmp_path)!r}, {name!r}).write_text(str(time.monotonic_ns()))"
                       "; sys.exit(0)\n"
                       "signal.signal(signal.SIGTERM, done)\nprint('up', flush=True)\nwhile True: time.sleep(0.02)")

    sup = Supervisor([StageCommand("broker", stage("broker"), stop_last=True),
                      StageCommand("generate", stage("generate"), stop_first=True),
                      StageCommand("ingest", stage("ingest"))], log_dir=tmp_path / "logs")
    sup.start()
    _wait(lambda: all(s.last_log_line() == "up" for s in sup.stages))
    seen: list[tuple[int | None, ...]] = []

    def lag() -> int:
        seen.append(tuple(s.pid for s in sup.stages))
        return 2 - len(seen)  # 1 record left, then caught up

    assert sup.stop(grace_s=10, drain=lag) == {"broker": 0, "generate": 0, "ingest": 0}
    assert len(seen) == 2 and all(b is not None and g is None and i is not None for b, g, i in seen)
    stopped = {name: int((tmp_path / name).read_text()) for name in ("generate", "ingest", "broker")}
    assert stopped["generate"] < stopped["ingest"] < stopped["broker"]

    said: list[str] = []
    sup = Supervisor([StageCommand("ingest", stage("ingest2"))], log_dir=tmp_path / "logs2", on_event=said.append)
    sup.start()
    _wait(lambda: sup.stages[0].last_log_line() == "up")
    assert sup.stop(grace_s=10, drain=lambda: 7, drain_timeout_s=0.0) == {"ingest": 0}
    assert "drain: 7 records still not consumed after 0 s; stopping the stages anyway" in said
    with pytest.raises(ValueError, match="exclude"):
        StageCommand("x", ("true",), stop_first=True, stop_last=True)


def test_the_log_line_column_summarises_indented_json_and_skips_its_fragments(tmp_path):
    """Issue 20: the live table showed `}` or `"gaps": []` of a stage's indented JSON result. Hand cases."""
    import json

    from gemline.supervisor import last_readable_line

    result = {"batch_version": 3, "events_written": 120, "offset_ranges": [{"partition": 0}], "skipped": False,
              "reset": None, "rules": {"a": 1, "b": 2}}
    printed = "INFO:ingest: batch 3 committed\n" + json.dumps(result, indent=2) + "\n"
    assert last_readable_line(printed) == ('JSON: batch_version=3 events_written=120 offset_ranges=[1] skipped=false '
                                           "reset=null rules={2}")
    # A document still being written (no closing brace yet): what came before it, the previous one's summary.
    partial = "{\n  \"run_id\": \"abc\",\n  \"versions\": [\n"
    assert last_readable_line(printed + partial) == last_readable_line(printed)
    assert last_readable_line("INFO:ingest: batch 3 committed\n" + partial) == "INFO:ingest: batch 3 committed"
    # A line after the document is the last line; a one-line JSON record is a line like any other.
    assert last_readable_line(printed + "WARNING: slow\n") == "WARNING: slow"
    assert last_readable_line('{"produced": 5}\n') == '{"produced": 5}'
    # Only fragments (the window began inside the document): nothing readable.
    assert last_readable_line('  "a": 1,\n  "b": 2\n}\n') == ""
    assert last_readable_line("") == "" and last_readable_line("\r\n  \n") == ""
    # The stage's method: a 64-byte window that starts inside the log drops its part line.
    log = tmp_path / "ingest.log"
    log.write_text("x" * 100 + "\nfirst full line\n" + json.dumps({"n": 1}, indent=2) + "\n")
    stage = StageState(StageCommand("ingest", ("true",)), log)
    assert stage.last_log_line(max_bytes=30) == "JSON: n=1"
    assert stage.last_log_line(max_bytes=5) == ""  # " 1\n}\n": a part line and a brace
