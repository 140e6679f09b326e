"""gemline.waits: each input's wait for its stage (hand-checked cases) and the verdict on their trend."""

from __future__ import annotations

import json
import math
import time

import pyarrow as pa
import pytest

from gemline.gate import RELEASE, append_quality_rows
from gemline.lake import Lake, commit_once
from gemline.progress import DISTILL_CHECKPOINTS
from gemline.waits import (
    Commit,
    Wait,
    build_waits,
    commits,
    distill_waits,
    ingest_waits,
    stage_waits,
    train_waits,
    validate_waits,
    wait_trend,
)
from trainer.freshness import HOPS

APP = "ingest:gemline.events"


def _ingested(version: int, at_ms: int, newest_ms: int) -> Commit:
    last = {"0": {"offset": 1, "timestamp_ms": newest_ms - 500}, "1": {"offset": 1, "timestamp_ms": newest_ms}}
    return Commit(version, at_ms, {"app_id": APP, "topic_identity": {"last": last}})


EVENTS = [_ingested(0, 1_000, 400), _ingested(1, 2_000, 1_500), Commit(2, 3_000, {}), _ingested(3, 4_000, 3_000),
          _ingested(4, 9_000, 8_500)]
"""events@2 is a compaction (no metadata); events@4 comes after the window's end (8,000 ms)."""


def test_ingest_waits_are_commit_time_minus_the_newest_message_and_the_messages_in_kafka_wait_since():
    assert ingest_waits(EVENTS, APP, 8_000, pending=False) == [Wait(400, 0.6, True), Wait(1_500, 0.5, True),
                                                               Wait(3_000, 1.0, True)]
    # Messages still in Kafka: one more input, arrived at the newest commit (4,000 ms), 4 s so far.
    assert ingest_waits(EVENTS, APP, 8_000, pending=True)[-1] == Wait(4_000, 4.0, False)
    assert ingest_waits(EVENTS, "ingest:other", 8_000, pending=True) == []


def test_build_waits_run_to_the_first_examples_commit_that_read_the_version():
    examples = [Commit(0, 2_500, {"app_id": "build", "events_version": 1}), Commit(1, 2_600, {}),  # a compaction
                Commit(2, 9_500, {"app_id": "build", "events_version": 3})]
    # events@0 and @1 built at 2,500 ms; events@3 built after the window's end: 8,000 - 4,000 so far.
    assert build_waits(EVENTS, examples, APP, "build", 8_000) == [Wait(1_000, 1.5, True), Wait(2_000, 0.5, True),
                                                                   Wait(4_000, 4.0, False)]


def test_validate_waits_run_to_the_first_run_at_or_after_the_version():
    inputs = {"events": [EVENTS[0], EVENTS[1], EVENTS[3]], "examples": [Commit(0, 2_500, {})]}
    # events validation judged events@1 at 2,200 ms (covering @0) and nothing later; examples@0 at 2,700.
    runs = {"events": [(1, 2_200)], "examples": [(0, 2_700)]}
    assert validate_waits(inputs, runs, 8_000) == [Wait(1_000, 1.2, True), Wait(2_000, 0.2, True),
                                                   Wait(2_500, 0.2, True), Wait(4_000, 4.0, False)]


def test_train_waits_are_the_versions_median_and_an_untrained_version_waits_since_its_commit():
    published = [Commit(3, 1_000, {}), Commit(5, 2_000, {}), Commit(6, 3_000, {}), Commit(7, 9_000, {})]
    trained = {3: (4.5, 5_500), 5: (2.0, 9_000)}  # examples@5 trained after the window's end
    assert train_waits(published, trained, 8_000) == [Wait(1_000, 4.5, True), Wait(2_000, 6.0, False),
                                                      Wait(3_000, 5.0, False)]


def test_distill_waits_follow_the_teacher_and_leave_out_a_version_recorded_without_a_time():
    teacher = {0: 1_000, 1: 2_000, 2: 3_000, 3: 9_000}
    assert distill_waits(teacher, {0: 1_500, 1: None}, 8_000) == [Wait(1_000, 0.5, True), Wait(3_000, 5.0, False)]


def _line(slope: float, noise: list[float]) -> list[Wait]:
    """Waits of 31 inputs 10 s apart over a 300 s window, rising ``slope`` s per s, plus ``noise``."""
    return [Wait(10_000 * i, 5.0 + slope * 10 * i + noise[i % len(noise)], True) for i in range(31)]


NOISE = [2.0, -3.0, 1.0, -1.5, 3.0, -2.0, 0.5]


def test_a_wait_rising_10_s_over_the_window_grows_a_small_or_flat_or_falling_one_does_not():
    growing = wait_trend(_line(0.05, NOISE), 0, 300_000)  # 5 % short of the rate: 15 s over 5 minutes
    assert growing is not None and growing.growing and growing.rise_s == pytest.approx(15.0, abs=2.5)
    slight = wait_trend(_line(0.01, [0.0]), 0, 300_000)  # an exact 3 s rise: significant, too small to matter
    assert slight is not None and not slight.growing and slight.rise_s == pytest.approx(3.0)
    assert wait_trend(_line(0.01, [0.0]), 0, 300_000, rise_s=2.0).growing, "the threshold is the caller's"
    noise = wait_trend(_line(0.0, [10.0, -10.0, 5.0]), 0, 300_000)
    assert noise is not None and not noise.growing and noise.median_s == 10.0 and noise.max_s == 15.0
    assert not wait_trend(_line(-0.1, NOISE), 0, 300_000).growing  # type: ignore[union-attr]
    flat = wait_trend(_line(0.0, [0.0]), 0, 300_000)
    assert flat is not None and not flat.growing and math.isnan(flat.p)


def test_a_stopped_stage_grows_and_only_the_windows_inputs_count():
    kept_up = [Wait(10_000 * i, 5.0, True) for i in range(25)]
    # Stopped at 245 s: the inputs since wait (300 s - arrival) so far, 50 s for the oldest, 10 s past the done ones.
    stopped = kept_up + [Wait(10_000 * i, (300_000 - 10_000 * i) / 1000, False) for i in range(25, 31)]
    trend = wait_trend(stopped, 0, 300_000)
    assert trend is not None and trend.growing and trend.stalled
    dead = [Wait(10_000 * i, (300_000 - 10_000 * i) / 1000, False) for i in range(31)]  # stopped all window
    trend = wait_trend(dead, 0, 300_000)
    assert trend is not None and trend.rise_s < 0 and trend.growing and trend.stalled, "a falling line, yet stopped"
    working = kept_up + [Wait(250_000, 8.0, False)]  # the newest input, in flight: waited less than 5 + 10 s
    trend = wait_trend(working, 0, 300_000)
    assert trend is not None and not trend.growing and not trend.stalled
    assert wait_trend(stopped, 0, 240_000).inputs == 25  # type: ignore[union-attr]
    assert wait_trend(stopped, 10_000, 25_000) is None, "fewer than 3 inputs"
    with pytest.raises(ValueError, match="empty"):
        wait_trend(stopped, 5, 5)


def _rows(n: int, start: int = 0) -> pa.Table:
    return pa.table({"x": pa.array(range(start, start + n), pa.int64())})


def test_stage_waits_read_each_stage_from_the_lake(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    for v in range(3):
        last = {"0": {"offset": v, "timestamp_ms": int(time.time() * 1000) - 200}}
        commit_once(lake, "events", _rows(2, 2 * v), app_id=APP, version=v,
                    metadata={"end_offsets": {"0": v + 1}, "topic_identity": {"last": last}})
    commit_once(lake, "examples", _rows(2), app_id="build", version=0, metadata={"events_version": 1})
    commit_once(lake, "examples", _rows(0), app_id="build", version=1, metadata={"events_version": 2})
    events, examples = commits(lake, "events"), commits(lake, "examples")
    assert [c.version for c in events] == [0, 1, 2] and examples[0].meta["events_version"] == 1
    now = examples[-1].timestamp_ms + 1_000
    check = {"run_id": "r", "expectation": "not_null", "severity": "critical", "success": True, "observed": "",
             "report_path": ""}
    append_quality_rows(lake, [{**check, "table": "events", "table_version": 2, "run_ts_ms": now - 500},
                               {**check, "table": "examples", "table_version": 0, "run_ts_ms": now - 400},
                               {**check, "table": "examples", "table_version": 1, "run_ts_ms": now - 900,
                                "expectation": RELEASE}])  # a release is no validation run
    fresh = [{"run_id": "t", "examples_version": 0, "hop": hop, "rows": 2, "p50_s": 3.0, "p95_s": 3.0, "p99_s": 3.0,
              "step_first": 1, "step_last": 1, "published_ms": examples[0].timestamp_ms, "wall_time_ms": now - 300}
             for hop in HOPS]
    commit_once(lake, "freshness", pa.Table.from_pylist(fresh), app_id="trainer", version=0)
    meta = tmp_path / "lake" / DISTILL_CHECKPOINTS / "step-1" / "meta.json"
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"extra": {"versions": [{"version": 0, "rows": 2, "distilled_ms": now - 100}]}}))

    got = stage_waits(lake, ingest_app_id=APP, until_ms=now, ingest_pending=False)
    assert [w.done for w in got["ingest"]] == [True] * 3 and all(0 < w.wait_s < 60 for w in got["ingest"])
    t = [c.timestamp_ms for c in events]
    assert got["build"] == [Wait(t[0], (examples[0].timestamp_ms - t[0]) / 1000, True),
                            Wait(t[1], (examples[0].timestamp_ms - t[1]) / 1000, True),
                            Wait(t[2], (examples[1].timestamp_ms - t[2]) / 1000, True)]
    # events@0..2 by the one run at events@2; examples@0 judged, examples@1 only released: not done.
    assert sorted(got["validate"], key=lambda w: (w.arrived_ms, w.wait_s)) == sorted(
        [*(Wait(x, (now - 500 - x) / 1000, True) for x in t), Wait(examples[0].timestamp_ms,
                                                                    (now - 400 - examples[0].timestamp_ms) / 1000, True),
         Wait(examples[1].timestamp_ms, (now - examples[1].timestamp_ms) / 1000, False)],
        key=lambda w: (w.arrived_ms, w.wait_s))
    assert got["train"] == [Wait(examples[0].timestamp_ms, 3.0, True)], "examples@1 added no rows: not an input"
    assert got["distill"] == [Wait(now - 300, 0.2, True)]
    assert "distill" not in stage_waits(lake, ingest_app_id=APP, until_ms=now, distill=False)
