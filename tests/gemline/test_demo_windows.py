"""gemline demo: a dataset whose labels are known at the impression (Open Bandit) gets short attribution windows,
so its increments publish examples before the last one; windows a person set stay."""

from __future__ import annotations

from gemline.config import load_config
from gemline.demo import _dataset_windows


def test_open_bandit_gets_one_hour_windows_unless_set():
    config = load_config()
    short = _dataset_windows(config, "openbandit").build
    assert (short.click_window_ms, short.conversion_window_ms) == (3_600_000, 3_600_000)
    assert _dataset_windows(config, "movielens") is config
    mine = load_config(overrides={"build.conversion_window_ms": "7200000"})
    assert _dataset_windows(mine, "openbandit") is mine
