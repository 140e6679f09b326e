"""gemline.polling: a follower waits for its input, looking every watch_s seconds, and runs a pass at least every
interval_s; all on a fake clock (tests/conftest.py FakeClock), no wall clock."""

from __future__ import annotations

import pytest

from gemline.errors import MissingInputError
from gemline.polling import ReportThrottle, poll, wait_for_input


class Input:
    """A follower's input: its version grows at the times given (``clock.at``); counts the looks."""

    def __init__(self, clock, times=()):
        self.version, self.looks = 0, 0
        for t in times:
            clock.at(t, self.commit)

    def commit(self):
        self.version += 1

    def __call__(self):
        self.looks += 1
        return self.version


def test_a_version_mid_wait_wakes_at_the_next_look_not_at_the_interval(fake_clock):
    probe = Input(fake_clock, [3.5])
    wake = wait_for_input(probe, 0, interval_s=60, watch_s=1, sleep=fake_clock.sleep, clock=fake_clock)
    assert (wake, fake_clock.now, fake_clock.sleeps, probe.looks) == ("changed", 4.0, [1, 1, 1, 1], 5)


def test_an_idle_wait_lasts_interval_s_looking_every_watch_s(fake_clock):
    probe = Input(fake_clock)
    wake = wait_for_input(probe, 0, interval_s=10, watch_s=3, sleep=fake_clock.sleep, clock=fake_clock)
    assert (wake, fake_clock.now, fake_clock.sleeps, probe.looks) == ("interval", 10.0, [3, 3, 3, 1], 4)


def test_a_version_committed_during_the_pass_starts_the_next_at_once(fake_clock):
    probe = Input(fake_clock)
    probe.commit()  # seen was 0 before the pass
    assert wait_for_input(probe, 0, interval_s=10, watch_s=1, sleep=fake_clock.sleep, clock=fake_clock) == "changed"
    assert fake_clock.sleeps == [] and probe.looks == 1


def test_a_minimum_gap_holds_a_woken_pass_but_not_the_interval_s_one(fake_clock):
    """Seen at the look at 2 s; the pass that just ended started at -1 s with a 7 s gap: it starts at 6 s."""
    probe = Input(fake_clock, [1.5])
    wake = wait_for_input(probe, 0, interval_s=30, watch_s=1, earliest=6.0, sleep=fake_clock.sleep, clock=fake_clock)
    assert (wake, fake_clock.now, fake_clock.sleeps, probe.looks) == ("changed", 6.0, [1, 1, 4], 3)
    later = Input(fake_clock, [8.2])  # a gap past the interval: the interval's pass comes first
    assert wait_for_input(later, 0, interval_s=4, watch_s=1, earliest=50.0, sleep=fake_clock.sleep,
                          clock=fake_clock) == "changed"
    assert fake_clock.now == 10.0 and fake_clock.sleeps[3:] == [1, 1, 1, 1]


def test_without_watching_the_wait_is_one_sleep_of_interval_s(fake_clock):
    probe = Input(fake_clock, [1.0])
    for watch, kept in ((None, probe), (1.0, None)):
        fake_clock.sleeps.clear()
        assert wait_for_input(kept, 0, interval_s=10, watch_s=watch, sleep=fake_clock.sleep,
                              clock=fake_clock) == "interval"
        assert fake_clock.sleeps == [10]
    assert probe.looks == 0


def test_an_interrupt_while_watching_ends_the_wait():
    from tests.conftest import FakeClock

    clock = FakeClock(stop_at=2.0)
    probe = Input(clock)
    assert wait_for_input(probe, 0, interval_s=10, watch_s=1, sleep=clock.sleep, clock=clock) == "stopped"
    assert clock.sleeps == [1, 1] and probe.looks == 2


@pytest.mark.parametrize("interval_s, watch_s, message", [
    (-1.0, 1.0, "expected interval_s >= 0 and watch_s > 0 or None, got -1.0, 1.0"),
    (10.0, 0.0, "expected interval_s >= 0 and watch_s > 0 or None, got 10.0, 0.0"),
    (10.0, -2.0, "expected interval_s >= 0 and watch_s > 0 or None, got 10.0, -2.0"),
    (float("nan"), 1.0, "got nan, 1.0"),
])
def test_bad_waits_are_refused(fake_clock, interval_s, watch_s, message):
    with pytest.raises(ValueError, match=message):
        wait_for_input(Input(fake_clock), 0, interval_s=interval_s, watch_s=watch_s, sleep=fake_clock.sleep,
                       clock=fake_clock)


def test_poll_runs_at_each_new_version_and_otherwise_every_interval_s(fake_clock):
    """Versions at 2.5 and 30.2 s; each call takes 0.5 s (hand-checked times below)."""
    probe = Input(fake_clock, [2.5, 30.2])
    started = []

    def call(first):
        started.append(fake_clock.now)
        fake_clock.now += 0.5  # the pass's own time
        return probe.version

    calls = poll(call, name="train", interval_s=20, max_polls=5, watch=probe, watch_s=1,
                 sleep=fake_clock.sleep, clock=fake_clock)
    # 0: the first call, ends at 0.5; looks at 0.5, 1.5 and 2.5 (the sleep to 2.5 committed the version): woken.
    # 2.5: the second call, ends at 3.0; idle: a look every second until 23.0 (interval_s after its end): a call.
    # 23.0: ends at 23.5; looks at 23.5 ... 29.5, 30.5: the version of 30.2 is seen at 30.5: a call.
    # 30.5: ends at 31.0; idle until 51.0: the fifth call.
    assert calls == 5 and started == [0.0, 2.5, 23.0, 30.5, 51.0]
    gaps = [b - a - 0.5 for a, b in zip(started, started[1:])]
    assert max(gaps) <= 20, "an idle follower still runs a pass every interval_s"


def test_poll_waits_for_a_missing_input_and_wakes_when_it_appears(fake_clock, caplog):
    """A MissingInputError is a wait: the next call comes at the first look that sees the input, not at the
    interval; said once."""
    probe = Input(fake_clock, [7.2])
    started = []

    def call(first):
        started.append((fake_clock.now, first))
        if probe.version == 0:
            raise MissingInputError("no examples table yet")
        return probe.version

    with caplog.at_level("WARNING", logger="gemline.polling"):
        calls = poll(call, name="train", interval_s=30, max_polls=3, watch=probe, watch_s=2,
                     sleep=fake_clock.sleep, clock=fake_clock)
    assert calls == 3 and started == [(0.0, True), (8.0, True), (38.0, False)]
    assert [r.getMessage() for r in caplog.records] == ["train waits: no examples table yet"]


def test_report_throttle_waits_every_s_or_its_cpu_share_of_the_last_drawing():
    now = {"s": 0.0}
    reports = ReportThrottle(60.0, 0.02, clock=lambda: now["s"])
    assert reports.due()  # the first chance draws
    reports.drawn(0.5)  # 0.5 CPU-s / 0.02 = 25 s < 60 s: every_s rules
    now["s"] = 59.0
    assert not reports.due()
    now["s"] = 60.0
    assert reports.due()
    reports.drawn(3.0)  # 3 CPU-s / 0.02 = 150 s: the share rules
    now["s"] = 60.0 + 149.0
    assert not reports.due()
    now["s"] = 60.0 + 150.0
    assert reports.due()
    alone = ReportThrottle(60.0, 1.0, clock=lambda: now["s"])
    alone.drawn(3.0)  # share 1.0: only a drawing longer than every_s would stretch the wait
    now["s"] += 60.0
    assert alone.due()


@pytest.mark.parametrize(("every_s", "share"), [(-1.0, 0.02), (60.0, 0.0), (60.0, 1.5)])
def test_report_throttle_rejects_bad_settings(every_s, share):
    with pytest.raises(ValueError, match="ReportThrottle"):
        ReportThrottle(every_s, share)


def test_a_lag_is_said_at_info_and_a_lasting_one_at_warning_once(fake_clock, caplog):
    """A follower a version behind says so at INFO (the usual lag); the same reason for several intervals (at least
    60 s) becomes one WARNING."""
    results = iter([1, 1, 1, 1, 1, 2])

    with caplog.at_level("INFO", logger="gemline.polling"):
        poll(lambda first: next(results), name="distill", interval_s=30, max_polls=6, watch=None,
             waiting=lambda r: f"the teacher has not consumed examples@{r} yet", sleep=fake_clock.sleep,
             clock=fake_clock)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "distill waits: the teacher has not consumed examples@1 yet"),
        ("WARNING", "distill has made no progress for 90 s: the teacher has not consumed examples@1 yet"),
        ("INFO", "distill waits: the teacher has not consumed examples@2 yet")]
