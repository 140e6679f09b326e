"""Ending a gemline process without the native teardown that can abort it after its work is done.

With the pinned deltalake 1.6.6 and pyarrow 25, a process that read a Delta table through pyarrow can die at
interpreter exit with ``terminate called without an active exception`` (SIGABRT, exit 134) although every read,
write and commit had finished: a native worker thread is still joinable when the C++ static destructors run
(delta-io/delta-rs#2184, apache/arrow#34314). A scheduler running ``gemline train --once`` daily would see a
failed run one time in a few. :func:`exit_process` runs the Python ``atexit`` handlers (logging, multiprocessing,
tempfile finalizers), flushes the standard streams and leaves with ``os._exit``, which skips exactly that native
teardown; nothing is left buffered in Python, and Delta commits are durable when their call returns.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn


def exit_code_of(code: object) -> int:
    """The status ``sys.exit(code)`` would give: None -> 0, an int -> itself, anything else is printed to
    stderr -> 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def exit_process(code: int) -> NoReturn:
    """Run the ``atexit`` handlers, flush stdout and stderr, and end the process with ``code`` via ``os._exit``
    (see the module docstring for why)."""
    atexit._run_exitfuncs()  # what interpreter shutdown would run first; stable since Python 3.0
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`gemline ... | head`) must not turn into a traceback
            pass
    os._exit(code)


def run_and_exit(main: Callable[[], object]) -> NoReturn:
    """Call ``main`` and end the process with its return value as the exit status, as ``sys.exit(main())``
    would (a ``SystemExit`` keeps its status; any other exception prints its traceback and exits 1), but
    through :func:`exit_process`."""
    try:
        code = exit_code_of(main())
    except SystemExit as exc:
        code = exit_code_of(exc.code)
    except BaseException:  # a bug: the traceback the interpreter would print, then status 1
        traceback.print_exc()
        code = 1
    exit_process(code)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: signal.Signals = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``;
    elsewhere nothing); exit at once if the parent is already gone. Also usable as ``Popen(preexec_fn=...)``
    (``functools.partial`` for another signal): the setting survives ``exec``.

    Why: torchrun starts each rank in a session of its own, so a SIGKILLed ``gemline train --nproc N`` (the OOM
    killer, ``kill -9``, a scheduler) would leave torchrun and its ranks training on without the lake's lock,
    beside the next trainer. With this on torchrun (parent: the launcher) and on every rank (parent: torchrun),
    the whole job dies with the launcher, and the next run resumes from the last complete checkpoint. The
    embedded broker uses it with SIGTERM, so a killed test or job leaves no broker behind.

    Raises:
        OSError: prctl failed.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the setting took: it will never fire
        os._exit(1)


SUPERVISOR_FD_ENV = "GEMLINE_SUPERVISOR_FD"
"""Names, in a stage's environment, the file descriptor of its supervisor's lifeline (:func:`watch_lifeline`)."""

LIFELINE_GRACE_S = 10.0
"""Seconds a stage whose supervisor is gone has to stop cleanly (SIGTERM) before its process group is SIGKILLed."""


def watch_lifeline(fd: int, *, grace_s: float = LIFELINE_GRACE_S, say: Callable[[str], None] | None = None) -> bool:
    """In a stage started by :class:`gemline.supervisor.Supervisor`: watch the read end ``fd`` of the supervisor's
    pipe from a daemon thread. The supervisor alone holds the write end, so the read returns (EOF) exactly when it is
    gone, by any signal, ``kill -9`` and the OOM killer included; the stage then SIGTERMs itself (its clean stop:
    the step in flight, reports, locks) and, ``grace_s`` seconds later, SIGKILLs its process group. Unlike
    ``PR_SET_PDEATHSIG`` (:func:`die_with_parent`) this fires on the death of the supervisor process, not of the
    thread that forked the stage, and works on any POSIX system.

    Returns:
        True when the watch started; False when ``fd`` is not an open pipe (a stale environment: nothing watched).
    """
    import stat
    import threading
    import time

    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
    except OSError:
        return False

    def watch() -> None:
        while True:
            try:
                if not os.read(fd, 64):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        (say or (lambda line: print(line, file=sys.stderr, flush=True)))(
            f"the supervisor (gemline run) is gone: stopping (SIGTERM; SIGKILL after {grace_s:g} s)")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        try:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        finally:
            os._exit(137)

    threading.Thread(target=watch, name="gemline-lifeline", daemon=True).start()
    return True
