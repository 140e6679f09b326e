"""The poll loop of the long-running stages that call a one-shot command again and again (``gemline train
--follow``, ``gemline distill --follow``), and the wait between two passes of any follower (:func:`wait_for_input`,
also used by ``build --follow`` and ``validate --follow``, :mod:`gemline.follow`).

A follower does not sleep a fixed interval after every pass: it looks at its input every ``watch_s`` seconds
(a cheap check, e.g. :class:`gemline.increments.LogTip`: one file-existence check per table) and starts the next
pass as soon as the input changed, or after ``interval_s`` at the latest. Each of the four hops from an events
commit to a trained model (validate events, build, validate examples, train) then waits about ``watch_s / 2``
instead of ``interval_s / 2`` plus a pass on average, when the stage is idle as its input arrives (the build
keeps a minimum gap between its passes, ``build.min_gap_s``).

Each call is the one-shot command a person would run by hand, so the restart story is that command's: a call
cut by Ctrl-C, SIGTERM or a crash is redone by the next run from what the lake has committed. An interrupt while
sleeping between calls ends the loop cleanly; one during a call propagates. While the stage waits (its input
table does not exist yet, or the stage before it has not got as far), it says so once, not at every poll.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Literal, TypeVar

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


Wake = Literal["changed", "interval", "stopped"]
"""Why :func:`wait_for_input` returned: the input changed, ``interval_s`` passed, or Ctrl-C/SIGTERM came."""


def wait_for_input(probe: Callable[[], Hashable] | None, seen: Hashable, *, interval_s: float,
                   watch_s: float | None, earliest: float | None = None,
                   sleep: Callable[[float], bool] | None = None, clock: Callable[[], float] = time.monotonic) -> Wake:
    """Wait until ``probe()`` differs from ``seen`` (looking every ``watch_s`` seconds, first at once) or
    ``interval_s`` seconds have passed, whichever comes first.

    Args:
        probe: a cheap look at the follower's input (e.g. Delta log versions); None: no watching, the wait is
            ``interval_s``.
        seen: what ``probe()`` returned before the pass that just ended, so a version committed during the pass
            starts the next one at once.
        watch_s: seconds between two looks, > 0; None: no watching.
        earliest: a change seen before this ``clock()`` time waits until then (a follower's minimum gap between
            the starts of two passes, for a stage whose pass has a large fixed cost); the interval's pass does
            not. None: no minimum.
        sleep: ``sleep(seconds) -> stopped`` (default :func:`sleep_or_stop`); tests pass a fake with ``clock``.
        clock: seconds, monotonic.

    Returns:
        "changed", "interval" or "stopped" (Ctrl-C or SIGTERM while waiting).

    Raises:
        ValueError: ``interval_s < 0`` or ``watch_s <= 0``; and what ``probe`` raises.

    A follower's input arrives at its writer's cadence (ingest commits every
    ``ingest.streaming.commit_interval_s``, 5 s; validation and the build once per version), so waking on it
    cannot run passes more often than that, and a pass that takes longer finds more rows, not more passes.
    """
    if not interval_s >= 0 or (watch_s is not None and not watch_s > 0):
        raise ValueError(f"wait_for_input: expected interval_s >= 0 and watch_s > 0 or None, got {interval_s}, "
                         f"{watch_s}")
    sleep = sleep_or_stop if sleep is None else sleep
    if probe is None or watch_s is None:
        return "stopped" if sleep(interval_s) else "interval"
    deadline = clock() + interval_s
    while True:
        if probe() != seen:
            if earliest is not None and (gap := min(earliest, deadline) - clock()) > 0 and sleep(gap):
                return "stopped"
            return "changed"
        if sleep(max(0.0, min(deadline - clock(), watch_s))):
            return "stopped"
        if clock() >= deadline:
            return "interval"


REPORT_CPU_SHARE = 0.02
"""The share of one core a follower's report pages may take (:class:`ReportThrottle`)."""


@dataclass
class ReportThrottle:
    """When a long-running follower (``train --follow``, ``distill --follow``) redraws its report page: at its first
    chance, then once ``every_s`` seconds have passed since the last drawing and the drawing's own CPU time is at most
    ``share`` of the time since (a drawing of c CPU-seconds waits at least c / share seconds).

    A report reads every metric row of the run and draws them all, so a drawing costs more the longer the run: ten
    minutes into ``benchmarks.freshness`` the teacher's report was 11.6 % of the trainer's CPU at one drawing a
    minute (py-spy, 2026-12-03). With the share its pages take at most ``share`` of a core however long the run.

    Args:
        every_s: the shortest time between two drawings (seconds, >= 0).
        share: in (0, 1]; 1.0 leaves ``every_s`` alone for any drawing shorter than it.
        clock: seconds, monotonic (tests pass a fake).

    Raises:
        ValueError: ``every_s < 0`` or ``share`` outside (0, 1].
    """

    every_s: float
    share: float = REPORT_CPU_SHARE
    clock: Callable[[], float] = time.monotonic
    _last: float | None = field(default=None, init=False)
    _gap_s: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if not self.every_s >= 0 or not 0 < self.share <= 1:
            raise ValueError(f"ReportThrottle: expected every_s >= 0 and 0 < share <= 1, got {self.every_s}, {self.share}")

    def due(self) -> bool:
        """Whether the next call should draw the page."""
        return self._last is None or self.clock() - self._last >= self._gap_s

    def drawn(self, cpu_s: float) -> None:
        """Record a drawing that just ended, which took ``cpu_s`` CPU-seconds."""
        self._last = self.clock()
        self._gap_s = max(self.every_s, cpu_s / self.share)


class LongWait:
    """Says once, at WARNING, that a follower has made no progress for longer than ``intervals`` of its passes'
    intervals (``interval_s``; at least 60 s) while its input waits, and why: the INFO line at the start of a wait is
    the usual lag of a stage behind the one before it; a wait that lasts is what an operator must see. Said again
    only after the stage progressed in between."""

    def __init__(self, interval_s: float, *, intervals: int = 3, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit_s = max(intervals * interval_s, 60.0)
        self.clock = clock
        self.since: float | None = None
        self.said = False

    def note(self, stage: str, reason: str, progressed: bool) -> bool:
        """Record the pass just done: ``reason`` why its newest input waits ('': none waits), ``progressed``
        whether it did work; return whether this call said the warning."""
        now = self.clock()
        if progressed or not reason:
            self.since, self.said = None, False
            return False
        if self.since is None:
            self.since = now
        if self.said or now - self.since < self.limit_s:
            return False
        self.said = True
        log.warning("%s has made no progress for %.0f s: %s", stage, now - self.since, reason)
        return True


def poll(call: Callable[[bool], R], *, name: str, interval_s: float, on_result: Callable[[R], object] | None = None,
         waiting: Callable[[R], str] | None = None, max_polls: int | None = None,
         watch: Callable[[], Hashable] | None = None, watch_s: float | None = None,
         sleep: Callable[[float], bool] | None = None, clock: Callable[[], float] = time.monotonic) -> int:
    """Run ``call(first)`` again whenever ``watch()`` changes (looked at every ``watch_s`` seconds) and at least
    every ``interval_s`` seconds, until interrupted; return the calls made (:func:`wait_for_input`).

    Args:
        call: one pass of the stage; ``first`` is True until a call has returned (a ``--from-scratch`` applies
            to the first pass that found its input, not to one that waited).
        name: the stage in the log lines ("train", "distill").
        interval_s: the longest wait between calls (seconds, >= 0): a call runs at least that often.
        on_result: called with each returned result (the CLI prints a JSON line).
        waiting: why a returned result waits ('' when it does not); logged once per new reason.
        max_polls: stop after this many calls (tests); None: until interrupted.
        watch: a cheap look at the call's input (what it waits for); None: a call every ``interval_s``.
        watch_s: seconds between two looks (> 0); None: no watching.
        sleep, clock: as for :func:`wait_for_input` (tests).

    A :class:`~gemline.errors.MissingInputError` of a call (no input table yet) is a wait too, logged once.

    Raises:
        ValueError: ``interval_s < 0`` or ``watch_s <= 0``; and what ``call`` raises besides MissingInputError.
    """
    if interval_s < 0:
        raise ValueError(f"{name} follow: expected interval_s >= 0, got {interval_s}")
    if watch_s is not None and not watch_s > 0:
        raise ValueError(f"{name} follow: expected watch_s > 0 seconds, got {watch_s}")
    calls, started, said = 0, False, ""
    patience = LongWait(interval_s, clock=clock)
    while max_polls is None or calls < max_polls:
        seen = None if watch is None else watch()
        try:
            result = call(not started)
        except MissingInputError as exc:
            reason, missing = str(exc), True
        else:
            started, missing = True, False
            reason = "" if waiting is None else waiting(result)
            if on_result is not None:
                on_result(result)
        if reason and reason != said:
            # A missing input is news; a stage a version behind the one before it is the usual lag (INFO), said
            # at WARNING only once it lasts (LongWait: the same reason for several intervals).
            log.log(logging.WARNING if missing else logging.INFO, "%s waits: %s", name, reason)
        patience.note(name, reason, progressed=reason != said)
        said = reason
        calls += 1
        if max_polls is not None and calls >= max_polls:
            break
        if wait_for_input(watch, seen, interval_s=interval_s, watch_s=watch_s, sleep=sleep, clock=clock) == "stopped":
            break
    return calls


__all__ = ["Wake", "poll", "sleep_or_stop", "wait_for_input"]
