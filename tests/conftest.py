"""Session-wide test set-up.

Triton runs on the CPU through its interpreter in every test: TRITON_INTERPRET must be set before anything
imports triton, and test modules of any directory may import the trainer (and so the kernels) while pytest
collects them, before ``tests/kernels/conftest.py`` is read.
"""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


def ingest_args(config):
    """``(lake, kafka, ingest)`` of a root ``GemlineConfig``: the leading arguments of ``run_ingest``,
    ``ingest_backlog``, ``backfill_late_events`` and ``run_streaming``, for tests that build one config."""
    from gemline.lake import Lake  # here, not at the top: this conftest loads first for every test (kernels too)

    return Lake.for_config(config), config.kafka, config.ingest


def build_args(config):
    """``(lake, build)`` of a root ``GemlineConfig``: the leading arguments of ``run_build``."""
    from gemline.lake import Lake

    return Lake.for_config(config), config.build


def trainer_args(config):
    """``(lake, trainer)`` of a root ``GemlineConfig``: the leading arguments of ``trainer.continuous.run_once``,
    ``follow``, ``trainer.compare.run_compare`` and ``trainer.launch.train_with_torchrun``."""
    from gemline.lake import Lake

    return Lake.for_config(config), config.trainer


def quality_sections(config):
    """The config sections ``validate_table`` takes by keyword, from a root ``GemlineConfig``."""
    return {"validation": config.validation, "ingest": config.ingest, "build": config.build}


EXAMPLES_LAYOUTS = ("fat", "pointer")
"""``build.examples_layout`` values the build-level tests run on (issue 15: every build test passes on both)."""


@pytest.fixture(params=EXAMPLES_LAYOUTS)
def examples_layout(request):
    """A build-level test runs once per layout; it reads examples back fat with
    ``sequences.materialize.read_examples`` so its assertions hold on both."""
    return request.param


def with_layout(build, layout):
    """``build`` (a ``BuildConfig``) with ``examples_layout = layout``."""
    import dataclasses

    return dataclasses.replace(build, examples_layout=layout)


class FakeClock:
    """A monotonic clock that only a follower's sleep moves, for the follow loops (gemline.polling): call it for the
    time (seconds), pass :meth:`sleep` as their ``sleep``. ``at(t, action)`` runs ``action()`` once the clock
    reaches ``t`` (a version committed mid-wait); ``stop_at`` makes the first sleep that reaches it report
    Ctrl-C. No wall clock: a test asserts on :attr:`sleeps` and on the times it records."""

    def __init__(self, stop_at=None):
        self.now, self.sleeps, self.stop_at, self._due = 0.0, [], stop_at, []

    def __call__(self):
        return self.now

    def at(self, t, action):
        self._due = sorted([*self._due, (t, len(self._due), action)], key=lambda d: d[:2])

    def sleep(self, seconds):
        assert seconds >= 0, f"slept {seconds} s"
        self.sleeps.append(seconds)
        self.now += seconds
        while self._due and self._due[0][0] <= self.now:
            self._due.pop(0)[2]()
        return self.stop_at is not None and self.now >= self.stop_at


@pytest.fixture
def fake_clock():
    """A :class:`FakeClock` at 0 s."""
    return FakeClock()
