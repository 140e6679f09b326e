"""benchmarks.follow_watch: the hop simulation on a hand-checked case, and the cost measurement runs."""

from __future__ import annotations

from benchmarks.follow_watch import measure_cost, simulate


def test_one_events_version_through_the_four_hops_by_hand():
    """events@47 s; passes of 1, 2 and 3 s (validate, build, train); interval 10 s.

    A pass every 10 s: validate at 50 (waited 3, verdict at 51), build at 60 (waited 9, examples at 62), validate
    at 71 (9, verdict at 72), train at 80 (8), trained at 83: 36 s. A look a second: validate at 47 (0, verdict
    48), build at 48 (0, examples 50), validate at 50 (0, verdict 51), train at 51 (0), trained at 54: 7 s.
    """
    timer = simulate(minutes=1.5, commit_s=47, pass_s=(1, 2, 3), interval_s=10, watch_s=None)
    watcher = simulate(minutes=1.5, commit_s=47, pass_s=(1, 2, 3), interval_s=10, watch_s=1)
    assert timer == {"validate events": [3.0], "build": [9.0], "validate examples": [9.0], "train": [8.0],
                     "events -> trained": [36.0]}
    assert watcher == {"validate events": [0.0], "build": [0.0], "validate examples": [0.0], "train": [0.0],
                       "events -> trained": [7.0]}


def test_every_events_version_goes_through_four_passes_at_most_once():
    for watch_s in (None, 1.0):
        waits = simulate(minutes=10, commit_s=5, pass_s=(3, 8, 10), interval_s=10, watch_s=watch_s)
        trained = waits["events -> trained"]
        # 119 events versions (5 .. 595 s), each validated once; the last ones are not trained by the end.
        assert len(waits["validate events"]) == 119 and 100 <= len(trained) <= 119
        assert min(trained) >= 3 + 8 + 3 + 10, "validate, build, validate, train: no hop skipped"
        assert min(min(w) for w in waits.values()) >= 0


def test_the_cost_measurement_reports_each_kind_of_look(tmp_path):
    cost = measure_cost(str(tmp_path / "lake"), commits=3, checks=20)
    assert list(cost) == ["LogTip.advance", "GateWatch", "latest_version (baseline)"]
    assert all(v >= 0 for v in cost.values())


def test_measured_hops_join_the_commit_times_by_hand(monkeypatch):
    """events@0,1,2 at 1, 6, 11 s; verdicts on events@0 at 3 s and on events@2 (covering 1) at 13 s; examples@0
    built from events@2 at 16 s, judged at 20 s, its freshness row at 30 s."""
    import pyarrow as pa

    import benchmarks.follow_watch as bench

    commits = {"events": {0: (1000, {}), 1: (6000, {}), 2: (11000, {})},
               "examples": {0: (16000, {"events_version": 2})},
               "quality": {0: (3000, {"app_id": "validate:r1"}), 1: (13000, {"app_id": "validate:r2"}),
                           2: (20000, {"app_id": "validate:r3"}), 3: (25000, {"app_id": "quality:release"})}}
    tables = {"quality": pa.Table.from_pylist([
                  {"table": "events", "table_version": 0, "run_id": "r1"},
                  {"table": "events", "table_version": 2, "run_id": "r2"},
                  {"table": "examples", "table_version": 0, "run_id": "r3"},
                  {"table": "examples", "table_version": 0, "run_id": "release-1"}]),
              "freshness": pa.Table.from_pylist([{"examples_version": 0, "wall_time_ms": 30000}])}
    monkeypatch.setattr(bench, "_commits", lambda lake, table: commits[str(table)])
    monkeypatch.setattr(bench, "read_table", lambda lake, table, columns=None: tables[str(table)])
    assert bench.measured_hops("lake") == {"validate events": [2.0, 7.0, 2.0], "build": [13.0, 3.0, 3.0],
                                           "validate examples": [4.0], "train": [10.0]}
