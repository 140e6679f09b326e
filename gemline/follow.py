"""``gemline build --follow`` and ``gemline validate --follow``: a stage that keeps up with the one before it.

Each is a loop of the stage's one-shot command, run again as soon as its input has a version it can use, looked
for every ``watch_s`` seconds (:func:`gemline.polling.wait_for_input`), and at least every ``interval_s``
seconds, as ``gemline train --follow`` is for the trainer (the build no sooner than ``build.min_gap_s`` after its
last pass started). Every pass is what a person would run by hand, so the restart story is the one-shot
command's: a pass cut by Ctrl-C, SIGTERM or a crash is redone by the next run from what the lake has committed,
and nothing is written twice. An interrupt while waiting between passes ends the loop cleanly.

- the build follows ``events``: each pass builds the newest events version the quality gate allows (passed, or
  released by hand); it wakes on a new verdict about ``events`` in the gate's ``quality`` table
  (:class:`gemline.gate.GateWatch`), not on a new events version, which it could not build before validation
  judged it; while the newest is not validated yet, or a version on the way is quarantined, it says so
  once and waits (the build's own gate check, :func:`gemline.gate.require_allowed`, decides);
- validation follows the tables it is given: each pass validates every version not validated yet, in order
  (for ``events`` only the newest: events validation judges the rows of every version since the last one
  validated, so the versions before it are covered, see README "The events gate"); it wakes on a new version of
  any of them (:class:`gemline.increments.LogTip`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gemline.config import GemlineConfig
from gemline.gate import GateClosedError, GateWatch, gate_decisions
from gemline.increments import LogTip, latest_version
from gemline.lake import Lake
from gemline.polling import LongWait, sleep_or_stop, wait_for_input
from gemline.tables import Table

if TYPE_CHECKING:
    from sequences.config import BuildConfig
    from sequences.pipeline import BuildResult

log = logging.getLogger(__name__)


@dataclass
class FollowState:
    """What a follow loop did so far (the CLI prints one JSON line per pass that did something)."""

    passes: int = 0
    done: list[dict[str, Any]] = field(default_factory=list)
    """One record per version built or validated: ``{"table", "version", ...}``."""
    waiting: str = ""
    """Why the newest version waited in the last pass (not validated yet, quarantined); '' when nothing waits."""


@dataclass(frozen=True)
class Waiting:
    """How a follow loop waits between passes (:func:`gemline.polling.wait_for_input`).

    Attributes:
        interval_s: the longest wait (seconds, >= 0): a pass runs at least this often.
        watch_s: seconds between two looks at the input (> 0); None: no looking, a pass every ``interval_s``.
        min_gap_s: the shortest time from the start of a pass to the start of one woken by new input (>= 0).
        sleep: ``sleep(seconds) -> stopped``; None: :func:`gemline.polling.sleep_or_stop` (tests pass a fake).
        clock: monotonic seconds (tests pass a fake advanced by ``sleep``).

    Raises:
        ValueError: ``interval_s < 0``, ``watch_s <= 0`` or ``min_gap_s < 0``.
    """

    interval_s: float
    watch_s: float | None = 1.0
    min_gap_s: float = 0.0
    sleep: Callable[[float], bool] | None = None
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        if not self.interval_s >= 0:
            raise ValueError(f"follow: expected interval_s >= 0, got {self.interval_s}")
        if self.watch_s is not None and not self.watch_s > 0:
            raise ValueError(f"follow: expected watch_s > 0 seconds (or None: no watching), got {self.watch_s}")
        if not self.min_gap_s >= 0:
            raise ValueError(f"follow: expected min_gap_s >= 0 seconds, got {self.min_gap_s}")


def _loop(one_pass: Callable[[FollowState], None], state: FollowState, waiting: Waiting,
          probe: Callable[[], Hashable], max_passes: int | None) -> FollowState:
    watch = probe if waiting.watch_s is not None else None
    while max_passes is None or state.passes < max_passes:
        seen = None if watch is None else watch()  # before the pass: a version committed during it wakes the next
        started = waiting.clock()
        one_pass(state)
        state.passes += 1
        if max_passes is not None and state.passes >= max_passes:
            break
        # sleep_or_stop is looked up here, not bound at import: tests replace it to stand for Ctrl-C.
        if wait_for_input(watch, seen, interval_s=waiting.interval_s, watch_s=waiting.watch_s,
                          earliest=started + waiting.min_gap_s if waiting.min_gap_s else None,
                          sleep=waiting.sleep or sleep_or_stop, clock=waiting.clock) == "stopped":
            break
    return state


def _latest(lake: Lake, table: str) -> int | None:
    return latest_version(lake.root, table, storage_options=lake.storage_options)


def _newest_allowed(lake: Lake, gate: str = "required") -> tuple[int | None, str, bool]:
    """The newest ``events`` version the gate allows (None if none), why the newest version is not allowed
    ('' when it is, or when there is no events table), and whether that newest version was validated at all
    (False: validation has not reached it yet, the usual lag of a stage behind the one before it). With ``gate``
    ``"off"`` (``build.events_gate``) every version is allowed: the newest one, unjudged."""
    newest = _latest(lake, Table.EVENTS)
    if newest is None or gate == "off":
        return newest, "", True
    decisions = gate_decisions(lake, Table.EVENTS, range(newest + 1))
    allowed = [v for v, d in decisions.items() if d.allowed]
    last = decisions[newest]
    return (max(allowed) if allowed else None), ("" if last.allowed else last.reason), last.validated


def nothing_published_hint(build: BuildConfig, result: BuildResult) -> str | None:
    """One line when a ``label_mode = "wait"`` build has published nothing yet while impressions wait for their
    attribution windows (a synthetic or replayed log shorter than the longest window never publishes: the
    trainer then waits with nothing said); None otherwise."""
    from sequences.config import NOTHING_PUBLISHED

    if build.label_mode != "wait" or result.num_examples or not result.num_pending:
        return None
    longest_ms = max(build.click_window_ms, build.conversion_window_ms)
    longest = (f"{longest_ms / 86_400_000:g} days" if longest_ms >= 86_400_000 else
               f"{longest_ms / 3_600_000:g} h" if longest_ms >= 3_600_000 else f"{longest_ms / 1000:g} s")
    return (f"{NOTHING_PUBLISHED}: {result.num_pending} impressions wait for their attribution windows (the "
            f"longest: {longest}); to train sooner, publish early with late-label corrections: --set "
            "build.label_mode=defer --set build.publish_delay_ms=60000 (docs/training.md, \"Late labels: wait, fnw, defer\")")


def follow_build(config: GemlineConfig, *, interval_s: float | None = None, beam_args: Sequence[str] | None = None,
                 on_pass: Callable[[FollowState], None] | None = None,
                 max_passes: int | None = None, waiting: Waiting | None = None) -> FollowState:
    """Build each new gate-allowed ``events`` version until interrupted (module docstring).

    Args:
        interval_s: the longest wait between passes (s); None: ``config.build.interval_s``.
        beam_args: Beam pipeline flags of every build.
        on_pass: called after each pass with the loop's state.
        max_passes: stop after this many passes (tests); None: until interrupted.
        waiting: how to wait between passes; None: ``interval_s``, ``config.build.watch_s`` and
            ``config.build.min_gap_s``.

    Raises:
        ValueError: ``interval_s < 0``; and what :func:`sequences.pipeline.run_build` raises, except
            :class:`~gemline.gate.GateClosedError`, which makes the loop wait.
    """
    from sequences.pipeline import run_build
    from sequences.state_cache import BuildStateCache

    lake = Lake.for_config(config)
    hinted = False
    cache = BuildStateCache()  # the buffer a pass reads, kept for the next one (sequences.state_cache)
    if waiting is None:
        waiting = Waiting(config.build.interval_s if interval_s is None else interval_s, config.build.watch_s,
                          config.build.min_gap_s)
    patience = LongWait(waiting.interval_s, clock=waiting.clock)

    def one_pass(state: FollowState) -> None:
        nonlocal hinted
        before, built = state.waiting, len(state.done)
        version, state.waiting, validated = _newest_allowed(lake, config.build.events_gate)
        if version is not None:
            try:
                result = run_build(lake, config.build, events_version=version, beam_args=list(beam_args or []),
                                   state_cache=cache)
            except GateClosedError as exc:  # a version on the way is quarantined or not validated yet
                state.waiting = str(exc)
            else:
                if not result.skipped:
                    state.done.append({"table": str(Table.EVENTS), "version": version, "published": result.num_published})
                    log.info("built events@%d: %d examples published", version, result.num_published)
                    hint = None if hinted else nothing_published_hint(config.build, result)
                    if hint is not None:
                        log.warning("%s", hint)
                        hinted = True
        if state.waiting and state.waiting != before:  # said once, not at every pass
            # Validation a pass behind is the normal lag of a follower (INFO); a quarantine is news.
            log.log(logging.INFO if not validated else logging.WARNING, "build waits: %s", state.waiting)
        patience.note("build", state.waiting, len(state.done) > built)
        if on_pass is not None:
            on_pass(state)

    # Without the gate, a new events version (not a verdict about one) is what the build waits for.
    probe = GateWatch(lake, Table.EVENTS) if config.build.events_gate != "off" else (lambda: _latest(lake, Table.EVENTS))
    return _loop(one_pass, FollowState(), waiting, probe, max_passes)


def follow_validate(config: GemlineConfig, tables: Sequence[str], *, interval_s: float = 30.0,
                    on_pass: Callable[[FollowState], None] | None = None,
                    max_passes: int | None = None, watch_s: float | None = 1.0,
                    waiting: Waiting | None = None) -> FollowState:
    """Validate each new version of ``tables`` until interrupted (module docstring).

    Args:
        interval_s: the longest wait between passes (s).
        watch_s: seconds between two looks for a new version of ``tables``; None: a pass every ``interval_s``.
        waiting: how to wait between passes (tests); None: ``interval_s`` and ``watch_s``.

    Raises:
        ValueError: ``interval_s < 0`` or no table; and what :func:`validation.run.validate_table` raises.
    """
    from sequences.pointer_summaries import PointerSummaries
    from validation.run import validate_table
    from validation.session import ValidationSession

    if not tables:
        raise ValueError("follow_validate: expected at least one table")
    lake = Lake.for_config(config)
    # The pointer checks' sequence summaries follow history by increments, at a cost that follows each
    # version's rows (sequences.pointer_summaries). The session keeps quality and quality_profiles in memory
    # across versions (validation.session).
    session = ValidationSession(lake, pointer_summaries=PointerSummaries(lake, config.build.max_seq_len,
                                                                         config.build.same_domain_seq_len))

    def one_pass(state: FollowState) -> None:
        state.waiting = ""
        for table in tables:
            newest = _latest(lake, table)
            if newest is None:
                continue
            session.refresh()
            validated = session.validated(table)
            todo = [v for v in range(newest + 1) if v not in validated]
            if table == Table.EVENTS:
                todo = [newest] if newest in todo else []
            elif table == Table.EXAMPLES:  # a validator behind: every version's pointer checks from one history pass
                session.prefetch_pointer_summaries(todo, config.build)
            for version in todo:
                result = validate_table(lake, table, version, validation=config.validation, ingest=config.ingest,
                                        build=config.build, plots=config.validation.follow_report_plots,
                                        session=session)
                state.done.append({"table": table, "version": version, "passed": result.passed,
                                   "report": result.report_html})
                log.info("%s@%d: %s", table, version, "PASSED" if result.passed else "QUARANTINED")
        if on_pass is not None:
            on_pass(state)

    tips = [LogTip(lake.root, table, storage_options=lake.storage_options) for table in tables]
    return _loop(one_pass, FollowState(), Waiting(interval_s, watch_s) if waiting is None else waiting,
                 lambda: tuple(tip.advance() for tip in tips), max_passes)
