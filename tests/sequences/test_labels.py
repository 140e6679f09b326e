"""Label join: hand-computed windows, latencies, window closure and rejected inputs."""

from __future__ import annotations

import pytest

from ingest.schema import sorted_unique_events
from sequences.labels import Labels, label_impressions

H = 3600 * 1000


def test_hand_computed_label_join(make_event):
    # Impression at t=10h on i1; click window 1h, conversion window 5h.
    events = sorted_unique_events([
        make_event("click_before", 9 * H, "click"),             # before the impression: ignored
        make_event("imp", 10 * H, "impression"),
        make_event("click_other_item", 10 * H + 5, "click", item="i2"),  # another item: ignored
        make_event("click_other_domain", 10 * H + 6, "click", domain="d2"),  # another domain: ignored
        make_event("click_in", 10 * H + 1_000, "click"),        # inside [t, t + 1h]
        make_event("click_out", 11 * H + 1, "click"),           # 1 ms after the click window
        make_event("conv_out", 15 * H + 1, "conversion"),       # 1 ms after the conversion window
    ])
    labels = label_impressions(events, click_window_ms=H, conversion_window_ms=5 * H, watermark_ms=15 * H + 1)
    assert labels == {
        "imp": Labels(label_click=1, label_conversion=0, click_latency_ms=1_000, conversion_latency_ms=None,
                      label_window_closed=True)
    }


def test_window_edges_are_inclusive_and_one_label_serves_several_impressions(make_event):
    events = sorted_unique_events([
        make_event("imp1", 0, "impression"),
        make_event("imp2", 30, "impression"),
        make_event("conv", 100, "conversion"),
        make_event("click", 100, "click"),
    ])
    labels = label_impressions(events, click_window_ms=100, conversion_window_ms=70, watermark_ms=100)
    # imp1: click exactly at t + 100 counts; conversion at t + 100 is outside its 70 ms window.
    assert labels["imp1"] == Labels(1, 0, 100, None, True)
    # imp2: the same click (70 ms later) and the conversion exactly at t + 70 both count.
    assert labels["imp2"] == Labels(1, 1, 70, 70, True)


def test_label_at_impression_time_counts_and_window_open_until_watermark(make_event):
    events = sorted_unique_events([make_event("b_imp", 50, "impression"), make_event("a_click", 50, "click")])
    labels = label_impressions(events, click_window_ms=10, conversion_window_ms=10, watermark_ms=59)
    assert labels["b_imp"] == Labels(1, 0, 0, None, False)
    closed = label_impressions(events, click_window_ms=10, conversion_window_ms=10, watermark_ms=60)
    assert closed["b_imp"].label_window_closed is True


def test_no_impressions_gives_no_labels(make_event):
    assert label_impressions([make_event("c", 1, "click")], click_window_ms=1, conversion_window_ms=1,
                             watermark_ms=1) == {}
    assert label_impressions([], click_window_ms=1, conversion_window_ms=1, watermark_ms=0) == {}


@pytest.mark.parametrize(
    ("message", "build", "windows"),
    [
        ("must be sorted", lambda ev: [ev("b", 2, "impression"), ev("a", 1, "click")], (1, 1)),
        ("one user's events", lambda ev: [ev("a", 1, "impression"), ev("b", 2, "click", user="u2")], (1, 1)),
        ("windows must be > 0", lambda ev: [ev("a", 1, "impression")], (0, 1)),
        ("windows must be > 0", lambda ev: [ev("a", 1, "impression")], (1, -5)),
    ],
)
def test_invalid_inputs_raise(make_event, message, build, windows):
    with pytest.raises(ValueError, match=message):
        label_impressions(build(make_event), click_window_ms=windows[0], conversion_window_ms=windows[1],
                          watermark_ms=10)
