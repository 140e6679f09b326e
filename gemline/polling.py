"""The poll loop of the long-running stages that call a one-shot command again and again (``gemline train
--follow``, ``gemline distill --follow``).

Each call is the one-shot command a person would run by hand, so the restart story is that command's: a call
cut by Ctrl-C, SIGTERM or a crash is redone by the next run from what the lake has committed. An interrupt while
sleeping between calls ends the loop cleanly; one during a call propagates. While the stage waits (its input
table does not exist yet, or the stage before it has not got as far), it says so once, not at every poll.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from gemline.errors import MissingInputError

log = logging.getLogger(__name__)

R = TypeVar("R")


def sleep_or_stop(seconds: float) -> bool:
    """Sleep ``seconds``; True when Ctrl-C or SIGTERM (a KeyboardInterrupt in gemline's CLI) came meanwhile."""
    try:
        time.sleep(seconds)
    except KeyboardInterrupt:
        return True
    return False


def poll(call: Callable[[bool], R], *, name: str, interval_s: float, on_result: Callable[[R], object] | None = None,
         waiting: Callable[[R], str] | None = None, max_polls: int | None = None) -> int:
    """Run ``call(first)`` every ``interval_s`` seconds until interrupted; return the calls made.

    Args:
        call: one pass of the stage; ``first`` is True until a call has returned (a ``--from-scratch`` applies
            to the first pass that found its input, not to one that waited).
        name: the stage in the log lines ("train", "distill").
        interval_s: seconds between calls, >= 0.
        on_result: called with each returned result (the CLI prints a JSON line).
        waiting: why a returned result waits ('' when it does not); logged once per new reason.
        max_polls: stop after this many calls (tests); None: until interrupted.

    A :class:`~gemline.errors.MissingInputError` of a call (no input table yet) is a wait too, logged once.

    Raises:
        ValueError: ``interval_s < 0``; and what ``call`` raises besides MissingInputError.
    """
    if interval_s < 0:
        raise ValueError(f"{name} follow: expected interval_s >= 0, got {interval_s}")
    calls, started, said = 0, False, ""
    while max_polls is None or calls < max_polls:
        try:
            result = call(not started)
        except MissingInputError as exc:
            reason = str(exc)
        else:
            started = True
            reason = "" if waiting is None else waiting(result)
            if on_result is not None:
                on_result(result)
        if reason and reason != said:
            log.warning("%s waits: %s", name, reason)
        said = reason
        calls += 1
        if max_polls is not None and calls >= max_polls:
            break
        if sleep_or_stop(interval_s):
            break
    return calls


__all__ = ["poll", "sleep_or_stop"]
