"""gemline.process: the console script ends through os._exit after the atexit handlers, with sys.exit's status."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import atexit, sys
from gemline.process import run_and_exit
atexit.register(lambda: print("atexit ran", flush=True))
def main():
    print("working")
    {body}
run_and_exit(main)
"""


@pytest.mark.parametrize(("body", "status", "stderr_has"), [
    ("return 0", 0, ""),
    ("return 3", 3, ""),
    ("return None", 0, ""),
    ("raise SystemExit(2)", 2, ""),
    ("raise SystemExit('error: a message')", 1, "error: a message"),
    ("raise RuntimeError('a bug')", 1, "Traceback"),
    ("raise KeyboardInterrupt", 1, "KeyboardInterrupt"),
])
def test_the_status_of_sys_exit_and_the_atexit_handlers_run(body, status, stderr_has):
    proc = subprocess.run([sys.executable, "-c", _SCRIPT.format(body=body)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == status
    assert proc.stdout.splitlines() == ["working", "atexit ran"], "stdout flushed, atexit handlers run once"
    assert stderr_has in proc.stderr


def test_the_console_script_goes_through_it(tmp_path):
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["gemline"] == "gemline.cli:entry"
    proc = subprocess.run([sys.executable, "-m", "gemline.cli", "train", "--lake", str(tmp_path / "lake"), "--once"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    # No examples table yet: a one-line error (MissingInputError), exit 2.
    assert proc.returncode == 2 and proc.stderr.startswith("error: no examples table") and len(proc.stderr.splitlines()) == 1


def test_a_child_set_to_die_with_its_parent_does(tmp_path):
    import os
    import time

    # parent: starts a long-sleeping child with die_with_parent, prints its pid, then waits.
    parent_code = ("import subprocess, sys, time\n"
                   "from gemline.process import die_with_parent\n"
                   "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
                   "preexec_fn=die_with_parent)\n"
                   "print(child.pid, flush=True)\n"
                   "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    os.kill(child_pid, 0)  # alive
    parent.kill()  # SIGKILL: no handler of the parent runs
    parent.wait(timeout=30)
    deadline = time.monotonic() + 30
    while True:
        try:
            os.kill(child_pid, 0)
            state = open(f"/proc/{child_pid}/stat").read().split()[2]
            if state == "Z":  # a zombie waiting for init to reap it is dead
                break
        except (ProcessLookupError, FileNotFoundError):
            break
        assert time.monotonic() < deadline, "the child outlived its SIGKILLed parent"
        time.sleep(0.05)
