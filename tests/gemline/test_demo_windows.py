"""gemline demo: datasets whose span the default attribution windows do not fit get their own (Open Bandit: labels
known at the impression; the 9-day Taobao sample: 1-day windows), so their increments publish examples before the
last one; windows a person set stay. A hand-checked Taobao case goes from CSV lines through the label join."""

from __future__ import annotations

import dataclasses
from collections import Counter

from gemline.config import load_config
from gemline.demo import _dataset_windows
from ingest.datasets.taobao import map_line
from ingest.schema import Event, sorted_unique_events
from sequences.labels import label_impressions

DAY_MS = 86_400_000


def test_open_bandit_gets_one_hour_windows_unless_set():
    config = load_config()
    short = _dataset_windows(config, "openbandit").build
    assert (short.click_window_ms, short.conversion_window_ms) == (3_600_000, 3_600_000)
    assert _dataset_windows(config, "movielens") is config
    mine = load_config(overrides={"build.conversion_window_ms": "7200000"})
    assert _dataset_windows(mine, "openbandit") is mine


def test_taobao_gets_one_day_windows_unless_set():
    config = load_config()
    assert (config.build.click_window_ms, config.build.conversion_window_ms) == (DAY_MS, 7 * DAY_MS)
    taobao = _dataset_windows(config, "taobao").build
    assert (taobao.click_window_ms, taobao.conversion_window_ms) == (DAY_MS, DAY_MS)
    mine = load_config(overrides={"build.conversion_window_ms": str(3 * DAY_MS)})
    assert _dataset_windows(mine, "taobao") is mine


def _labels(lines: list[str], conversion_window_ms: int) -> dict:
    seen: Counter[str] = Counter()
    events = [map_line(line, seen) for line in lines]
    assert all(isinstance(e, Event) for e in events)
    rows = sorted_unique_events(dataclasses.asdict(e) for e in events)
    return label_impressions(rows, click_window_ms=DAY_MS, conversion_window_ms=conversion_window_ms,
                             watermark_ms=max(r["event_time_ms"] for r in rows))


def test_taobao_lines_hand_checked_through_the_label_join():
    t = 1_511_568_000  # 2017-11-25 00:00 UTC, unix seconds as in the CSV
    lines = [
        f"7,100,9,pv,{t}",             # viewed, carted 10 min later, bought 2 days later
        f"7,100,9,cart,{t + 600}",
        f"7,100,9,buy,{t + 2 * 86_400}",
        f"7,200,9,cart,{t + 60}",      # carted first, viewed 5 min later: that view is no click
        f"7,200,9,pv,{t + 360}",
        f"7,300,9,pv,{t + 86_400}",    # viewed exactly 1 day before the newest event: window just closed
        f"7,400,9,pv,{t + 86_401}",    # 1 s later: still open
    ]
    one_day = _labels(lines, DAY_MS)
    a, b, c, d = ("taobao:7:100:%d:impression" % t, "taobao:7:200:%d:impression" % (t + 360),
                  "taobao:7:300:%d:impression" % (t + 86_400), "taobao:7:400:%d:impression" % (t + 86_401))
    assert set(one_day) == {a, b, c, d}
    # Seconds become ms: the cart 600 s after the view is a click of latency 600,000 ms.
    assert (one_day[a].label_click, one_day[a].click_latency_ms) == (1, 600_000)
    # The buy 2 days after the view is outside the 1-day conversion window, inside the default 7 days.
    assert one_day[a].label_conversion == 0
    seven_days = _labels(lines, 7 * DAY_MS)
    assert (seven_days[a].label_conversion, seven_days[a].conversion_latency_ms) == (1, 2 * DAY_MS)
    assert one_day[b].label_click == 0
    assert [one_day[k].label_window_closed for k in (a, b, c, d)] == [True, True, True, False]
    # Under 7 days no impression of these 2 days has a closed window: the old split's censoring.
    assert not any(v.label_window_closed for v in seven_days.values())
