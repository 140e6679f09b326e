"""Early publication with late labels (sequences.publish): hand-checked plans per mode, batch independence,
the vectorised build equal to the reference in fnw/defer, wait's output for a waiting window >= the longest
attribution window, and orphan labels."""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from sequences.config import BuildConfig
from sequences.publish import NO_LABEL, ORPHAN_LABELS_SCHEMA, deadlines, orphan_labels, plan_publication

from .conftest import event
from .test_incremental import CONFIG as INCREMENTAL_CONFIG
from .test_incremental import DAY, EVENTS, by_days, events_of, run_batches
from .test_vectorized import CONFIG as VECTOR_CONFIG
from .test_vectorized import compare_batches

HAND = BuildConfig(click_window_ms=30, conversion_window_ms=100, publish_delay_ms=5, state_lookback_ms=30 * DAY)


def _emissions(mode: str, click_latency: int, conversion_latency: int, closes: list[int]) -> list[tuple]:
    """What one impression at t=0 gets at each close point: (close, "first"|task, label)."""
    config = dataclasses.replace(HAND, label_mode=mode)
    latency = {"click": np.array([click_latency]), "conversion": np.array([conversion_latency])}
    out, old = [], None
    for close in closes:
        plan = plan_publication(np.array([0]), deadlines(["d"], config), latency, np.array([old is None]), config, old, close)
        if plan.first[0]:
            out.append((close, "first"))
        out += [(close, task, int(label)) for task, label in zip(plan.correction_task, plan.correction_label,
                                                                 strict=True)]
        if not plan.keep[0]:
            out.append((close, "done"))
            break
        old = close
    return out


def test_hand_checked_plans_per_mode():
    # Click at 20 ms (after the 5 ms waiting window, inside its 30 ms window), no conversion.
    closes = [4, 5, 25, 99, 100]
    assert _emissions("wait", 20, NO_LABEL, closes) == [(100, "first"), (100, "done")]
    assert _emissions("fnw", 20, NO_LABEL, closes) == [(5, "first"), (25, "click", 1), (100, "done")]
    assert _emissions("defer", 20, NO_LABEL, closes) == [
        (5, "first"), (25, "click", 1), (100, "conversion", 0), (100, "done")]
    # A click inside the waiting window needs no correction; defer still closes the conversion as a real negative.
    assert _emissions("defer", 3, NO_LABEL, closes) == [(5, "first"), (100, "conversion", 0), (100, "done")]
    # Clicked late and converted late: one positive correction per label, none negative.
    assert _emissions("defer", 20, 60, [5, 50, 70, 100]) == [
        (5, "first"), (50, "click", 1), (70, "conversion", 1), (100, "done")]
    # The click window (30) closes without a click: a real negative for click at its own window's end.
    assert _emissions("defer", NO_LABEL, 60, [5, 30, 60, 100]) == [
        (5, "first"), (30, "click", 0), (60, "conversion", 1), (100, "done")]
    # First seen after every point has passed: everything at once, in one build.
    assert _emissions("defer", 20, NO_LABEL, [150]) == [
        (150, "first"), (150, "click", 1), (150, "conversion", 0), (150, "done")]


def _modes(config: BuildConfig, delay_ms: int):
    return [dataclasses.replace(config, label_mode=m, publish_delay_ms=delay_ms) for m in ("fnw", "defer")]


@settings(max_examples=15, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(EVENTS)
def test_fnw_and_defer_do_not_depend_on_batching(raw):
    events = events_of(raw)
    daily = by_days(events, 1)
    for config in _modes(INCREMENTAL_CONFIG, 3 * 3_600_000):
        whole = run_batches([events] if events else [[]], config)[0]
        by_day = run_batches(daily, config)[0]
        assert whole == by_day
        firsts = [r for r in whole if r["corrects_example_id"] is None]
        assert len(firsts) == sum(e["event_type"] == "impression" for e in events)  # each impression once
        wait = {r["example_id"]: r for r in run_batches(daily, dataclasses.replace(config, label_mode="wait"))[0]}
        for row in whole:  # a correction carries its impression's features and the label wait gives it
            if row["corrects_example_id"] is None:
                continue
            task = row["correction_task"]
            final = wait[row["corrects_example_id"]]
            assert row[f"label_{task}"] == final[f"label_{task}"]
            assert row["event_time_ms"] == final["event_time_ms"] and row["seq_item_ids"] == final["seq_item_ids"]
            assert row["example_id"] == f"{row['corrects_example_id']}#{task}"
        # No label counted twice: per impression and label at most one positive row.
        positives = defaultdict(int)
        for row in whole:
            for task in ("click", "conversion"):
                if row[f"label_{task}"] and row["correction_task"] in (None, task):
                    positives[(row["corrects_example_id"] or row["example_id"], task)] += 1
        assert set(positives.values()) <= {1}
        assert {k for k, v in positives.items()} == {
            (i, task) for i, r in wait.items() for task in ("click", "conversion") if r[f"label_{task}"]}


@pytest.mark.parametrize("mode", ["fnw", "defer"])
def test_waiting_window_at_least_the_longest_window_publishes_what_wait_publishes(mode):
    rng = random.Random(7)
    events = []
    for i in range(80):
        t = rng.randint(0, 6 * 24) * 3_600_000
        events.append(event(f"e{i}", t, rng.choice(["impression", "impression", "click", "conversion"]),
                            user=rng.choice(["u1", "u2"]), item=rng.choice(["i1", "i2"]),
                            domain=rng.choice(["d1", "d2"])))
    events.sort(key=lambda e: e["event_time_ms"])
    daily = by_days(events, 1)
    wait = run_batches(daily, INCREMENTAL_CONFIG)
    early = run_batches(daily, dataclasses.replace(INCREMENTAL_CONFIG, label_mode=mode, publish_delay_ms=DAY))
    assert early[0] == wait[0] and len(wait[0]) > 20
    assert sum(r["label_click"] for r in wait[0]) > 0  # the case has labels to publish


@pytest.mark.parametrize("mode", ["fnw", "defer"])
def test_vectorised_equals_reference_with_early_publication(mode, monkeypatch):
    config = dataclasses.replace(VECTOR_CONFIG, label_mode=mode, publish_delay_ms=2 * 3_600_000,
                                 publish_delay_overrides=("d2:0",))
    rng = random.Random(3)
    events = []
    for i in range(90):
        t = rng.randint(0, 10 * 24) * 3_600_000
        events.append(event(f"e{i}", t, rng.choice(["impression", "impression", "click", "conversion", "click"]),
                            user=rng.choice(["u1", "u2", "u3"]), item=rng.choice(["i1", "i2"]),
                            domain=rng.choice(["d1", "d2"]), created_ts_ms=t + rng.randint(1, 5)))
    events.append(event("orphan", 3 * DAY, "click", user="u9", item="i9"))  # no impression
    events.sort(key=lambda e: e["created_ts_ms"])
    impressions = sum(e["event_type"] == "impression" for e in events)
    assert compare_batches([events[:30], events[30:60], events[60:]], config) > impressions  # corrections too


def test_orphan_labels_no_impression_and_expired():
    labels = pa.Table.from_pylist([
        {"event_id": "c1", "user_id": "u", "item_id": "i", "domain": "d", "event_type": "click", "event_time_ms": 500,
         "created_ts_ms": 900},
        {"event_id": "c2", "user_id": "u", "item_id": "other", "domain": "d", "event_type": "click",
         "event_time_ms": 500, "created_ts_ms": 900},
        {"event_id": "c3", "user_id": "u", "item_id": "i", "domain": "d", "event_type": "click", "event_time_ms": 650,
         "created_ts_ms": 900},
    ])
    impressions = pa.Table.from_pylist([{"event_id": "imp", "user_id": "u", "item_id": "i", "domain": "d",
                                         "event_time_ms": 400}])
    config = dataclasses.replace(HAND, click_window_ms=300, conversion_window_ms=300)  # wait: decided at t + 300
    out = orphan_labels(labels, impressions, set(), config, old_close_ms=700, close_ms=800)
    assert out.schema.equals(ORPHAN_LABELS_SCHEMA)
    # c1 and c3 arrived after imp was published at 700 (expired); c2 never had an impression.
    assert [(r["event_id"], r["reason"], r["close_ms"]) for r in out.to_pylist()] == [
        ("c1", "expired", 800), ("c2", "no_impression", 800), ("c3", "expired", 800)]
    # The impression is new in this build: it is published now with both clicks.
    assert orphan_labels(labels, impressions, {"imp"}, config, 700, 800).column("event_id").to_pylist() == ["c2"]
    # defer with a 50 ms waiting window: imp's first row was decided at 450 (before c1 at 500), and c1's own
    # point 500 <= 700: expired; c3 at 650 also <= 700: expired. With the old close point at 600, c3 is not.
    defer = dataclasses.replace(config, label_mode="defer", publish_delay_ms=50)
    assert orphan_labels(labels, impressions, set(), defer, 600, 800).column("event_id").to_pylist() == ["c1", "c2"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["feed", "search", "d", ""]), max_size=60), st.integers(1, 4),
       st.sampled_from(["wait", "fnw", "defer"]))
def test_deadlines_of_an_arrow_column_equal_those_of_its_names(domains, chunks, mode):
    """The fast path (an Arrow column, dictionary-encoded) twins the reference (a list of names, one per row)."""
    config = BuildConfig(label_mode=mode, publish_delay_ms=500, window_overrides=("feed:click:7000", "search:conversion:9000"),
                         publish_delay_overrides=("search:200",))
    column = pa.chunked_array([pa.array(domains[k::chunks], pa.string()) for k in range(chunks)], pa.string())
    reference, fast = deadlines(column.to_pylist(), config), deadlines(column, config)
    for name in ("delay", "longest"):
        assert np.array_equal(getattr(fast, name), getattr(reference, name)) and getattr(fast, name).dtype == np.int64
    assert fast.window.keys() == reference.window.keys()
    assert all(np.array_equal(fast.window[task], reference.window[task]) for task in reference.window)
    if "feed" in domains:  # the overrides are looked up per row, not the first row's for all
        assert fast.window["click"][column.to_pylist().index("feed")] == 7_000


def test_a_null_domain_is_refused():
    with pytest.raises(ValueError, match=r"a pending row needs a domain, got 1 null\(s\)"):
        deadlines(pa.array(["feed", None]), BuildConfig())
