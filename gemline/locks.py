"""One writer per stage per lake: an exclusive lock file under ``LAKE/_locks/``.

Two ingests (or two builds) of the same lake at once share a staging directory and race between
"is this batch version already committed?" and the commit; delta-rs accepts a repeated app
transaction version, so the loser can double the rows. The lock makes the second run fail at
once with a message instead.

``fcntl.flock`` on a local file: the kernel drops the lock when its holder exits, ``kill -9``
included, so a crashed run never leaves a stale lock. Object-store lakes (``s3://...``) have no
such primitive and are not locked: run one writer per stage there.

Source: flock(2).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from gemline.errors import GemlineError
from gemline.lake import Lake, is_remote


class LakeBusyError(GemlineError, RuntimeError):
    """Another process holds the lock of this stage on this lake (exit 2: wait, or stop the other run)."""


@contextlib.contextmanager
def exclusive(lake: str | Path, name: str) -> Iterator[None]:
    """Hold ``LAKE/_locks/<name>.lock`` exclusively for the block; no-op for an object-store lake.

    A lake directory this call had to create is removed again afterwards if the block wrote nothing into it.

    The file's text names the holder (pid, host, start time, UTC) for the error of a second run.

    Raises:
        LakeBusyError: another process holds it.
    """
    if is_remote(lake):
        yield
        return
    root = Path(lake)
    made_root = not root.exists()
    path = root / "_locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = path.read_text(encoding="utf-8", errors="replace").strip() or "unknown"
            raise LakeBusyError(f"another {name} is running on this lake ({holder}); wait for it to finish: "
                                f"two at once would race on the same batch") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                     f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}".encode())
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock
        if made_root and _only_locks(root):
            # A stage that found no input (a mistyped --lake) leaves no lake behind it.
            shutil.rmtree(root, ignore_errors=True)


def _only_locks(root: Path) -> bool:
    try:
        return [p.name for p in root.iterdir()] == ["_locks"]
    except OSError:
        return False


_F = TypeVar("_F", bound=Callable[..., Any])


def holding(name: str) -> Callable[[_F], _F]:
    """Decorator: run the function with :func:`exclusive` ``(root, name)`` held, where the function's
    first argument is a :class:`gemline.lake.Lake` (the stages' entry points: ``run_ingest(lake, ...)``,
    ``run_build(lake, ...)``, ``run_once(lake, ...)``).

    Raises:
        LakeBusyError: another process holds the lock (before the function runs).
        TypeError: the first argument is not a Lake (before the function runs).
    """

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def locked(first: Any, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(first, Lake):
                raise TypeError(f"{fn.__qualname__}: expected a gemline.lake.Lake first, got {type(first).__name__}")
            with exclusive(first.root, name):
                return fn(first, *args, **kwargs)

        return locked  # type: ignore[return-value]

    return wrap
