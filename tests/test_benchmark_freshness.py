"""benchmarks.freshness's helpers: the judged window and its per-stage lines, the pooled quantiles, the label
settings and the generator's sizing (the run itself is the benchmark, not a test)."""

from __future__ import annotations

import pytest

import benchmarks.freshness as bench
from benchmarks.freshness import Sample, last_window, pooled, trend_lines, window_start_s
from gemline.config import load_config
from gemline.lake import Lake
from gemline.waits import Trend
from ingest.generate import GenerateConfig, generate_records


def test_the_window_is_the_last_5_minutes_or_the_last_half():
    assert window_start_s(600.0) == 300.0 and window_start_s(900.0) == 600.0
    assert window_start_s(180.0) == 90.0, "shorter than two windows: its last half"
    ten = [Sample(30.0 * i, 0, None, 0) for i in range(1, 21)]
    assert [s.t_s for s in last_window(ten, 600.0)] == [30.0 * i for i in range(10, 21)]
    assert [s.t_s for s in last_window(ten[:6], 180.0)] == [90.0, 120.0, 150.0, 180.0]


def test_each_stage_gets_one_line_with_its_waits_and_verdict():
    lines = trend_lines({"build": Trend(30, 9.5, 17.25, 2.3, 0.078, False),
                         "train": Trend(29, 6.5, 35.6, 29.3, 0.0001, True), "distill": None,
                         "ingest": Trend(31, 150.0, 300.0, -300.0, 1.0, True, stalled=True)})
    assert lines == [
        "  build       30 inputs, wait median    9.5 max   17.2 s, fitted rise    +2.3 s (p=0.078): keeps up",
        "  train       29 inputs, wait median    6.5 max   35.6 s, fitted rise   +29.3 s (p=0.000): GROWING",
        "  distill   fewer than 3 inputs in the window",
        "  ingest      31 inputs, wait median  150.0 max  300.0 s, fitted rise  -300.0 s (p=1.000): STALLED (an input "
        "waits longer than any done)"]


def test_pooled_quantiles_are_the_row_weighted_means_of_the_versions():
    rows = [{"hop": "impression->trained", "rows": 100, "p50_s": 10.0, "p95_s": 20.0, "p99_s": 30.0},
            {"hop": "impression->trained", "rows": 300, "p50_s": 30.0, "p95_s": 40.0, "p99_s": 90.0},
            {"hop": "published->trained", "rows": 400, "p50_s": 1.0, "p95_s": 1.0, "p99_s": 1.0}]
    assert pooled(rows, "impression->trained") == pytest.approx((25.0, 35.0, 75.0, 400))
    assert pooled(rows, "impression->published") is None


def test_label_settings_of_defer_and_window():
    assert bench.label_settings("window", 60_000) == {"build.click_window_ms": "60000",
                                                      "build.conversion_window_ms": "60000"}
    assert bench.label_settings("defer", 60_000) == {"build.label_mode": "defer", "build.publish_delay_ms": "60000"}


def test_the_generator_is_sized_by_its_measured_events_per_session():
    cfg = GenerateConfig(num_users=1_000, days=2.0, seed=3)
    events = len(generate_records(cfg))
    per_session = events / (cfg.num_users * cfg.sessions_per_user_per_day * cfg.days)
    assert per_session == pytest.approx(bench.EVENTS_PER_SESSION, rel=0.05)
    settings = bench.generator_settings(2000.0, 10.0)
    days = float(settings["generate.days"])
    assert settings["generate.wall_clock"] == "true"
    assert settings["kafka.producer_batch_messages"] == "1"
    assert bench.generator_settings(2000.0, 10.0, 500)["kafka.producer_batch_messages"] == "500"
    assert days * int(settings["generate.num_users"]) * 2.0 * bench.EVENTS_PER_SESSION == pytest.approx(
        1.1 * 2000 * 600, rel=1e-4)


def test_stage_of_names_the_gemline_subcommand():
    assert bench.stage_of(["/venv/bin/python", "-m", "gemline.cli", "build", "--follow"]) == "build"
    assert bench.stage_of(["python", "/repo/gemline/cli.py", "train"]) == "train"
    assert bench.stage_of(["tansu", "broker", "--listener-url", "tcp://x"]) is None
    assert bench.stage_of(["python", "-m", "gemline.cli"]) is None, "no subcommand"


def test_the_cpu_budget_is_cores_and_cpu_seconds_per_thousand_events_between_two_samples():
    first = Sample(30.0, 0, 0, 0, generated=10_000, cpu_s={"build": 5.0, "train": 20.0})
    last = Sample(130.0, 0, 0, 0, generated=210_000, cpu_s={"build": 45.0, "train": 80.0, "generate": 10.0})
    budget = {name: (cores, per_k) for name, cores, per_k in bench.cpu_budget(first, last)}
    # 100 s and 200,000 events: build 40 CPU-s = 0.4 cores = 0.2 CPU-s per 1k events.
    assert budget["build"] == pytest.approx((0.4, 0.2))
    assert budget["train"] == pytest.approx((0.6, 0.3))
    assert budget["generate"] == pytest.approx((0.1, 0.05)), "a stage seen only later starts from 0"
    assert budget["total"] == pytest.approx((1.1, 0.55))
    assert [name for name, _, _ in bench.cpu_budget(first, last)] == ["generate", "build", "train", "total"]
    no_events = Sample(130.0, 0, 0, 0, generated=10_000, cpu_s={"build": 6.0})
    assert dict((n, p) for n, _, p in bench.cpu_budget(first, no_events))["build"] is None
    with pytest.raises(ValueError, match="two samples"):
        bench.cpu_budget(first, Sample(130.0, 0, 0, 0))
    lines = bench.budget_lines(first, last, "test")
    assert "200,000 events generated = 2000 events/s" in lines[0]
    assert any(line.split()[:3] == ["build", "0.40", "0.200"] for line in lines)


def test_the_cpu_meter_counts_a_grandchild_to_its_gemline_ancestor_and_keeps_an_exited_ones_time():
    import subprocess
    import sys

    # A stand-in "gemline.cli build" whose child burns 0.3 CPU-s, says so, then waits for the end of stdin.
    burn = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
            "print('burnt', flush=True)\nsys.stdin.read()")
    parent = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {burn!r}])"
    proc = subprocess.Popen([sys.executable, "-c", parent, "gemline.cli", "build"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "burnt"
        meter = bench.CpuMeter(proc.pid)
        alive = meter.read()
        proc.stdin.close()  # the child, then the parent, exit
        proc.wait(timeout=60)
        after = meter.read()
    finally:
        proc.kill()
        proc.wait()
    assert set(alive) == {"build", "benchmark"} and len(meter.seen) == 2
    assert alive["build"] >= 0.3, "the grandchild's burn counts to its gemline ancestor's stage"
    assert after["build"] == pytest.approx(alive["build"]), "the exited processes keep their last reading"


def test_compressed_windows_span_the_generated_time_the_real_windows_span():
    """10 minutes at 2000 events/s: 1.1 x 600 s of wall time carry generate.days of behaviour; the windows shrink
    by that factor, the trainer's click window equal to the build's."""
    settings = bench.generator_settings(2000.0, 10.0)
    compression = bench.time_compression(settings, 10.0)
    assert compression == pytest.approx(float(settings["generate.days"]) * 86_400 / 660)
    assert 1000 < compression < 1100  # 8.15 days in 660 s
    windows = bench.compressed_windows(compression)
    assert int(windows["build.click_window_ms"]) == round(86_400_000 / compression)
    assert int(windows["build.conversion_window_ms"]) == round(7 * 86_400_000 / compression)
    assert windows["trainer.click_window_ms"] == windows["build.click_window_ms"]
    # The settings load: the trainer's window equals the build's, as the application requires.
    config = load_config(overrides=windows)
    assert config.build.click_window_ms == config.trainer.click_window_ms == int(windows["build.click_window_ms"])


def test_load_lines_count_each_commits_rows_at_its_commit_minute(tmp_path, monkeypatch):
    """examples@0 (one first publication, one correction) committed 5 s into the run, examples@1 (one + two) at
    185 s; the rows' created_ts_ms (the impression's arrival) play no part."""
    import pyarrow as pa
    from deltalake import write_deltalake

    from gemline.waits import Commit

    began = 1_000_000
    for ids in ([None, "a"], [None, "b", "c"]):
        write_deltalake(str(tmp_path / "examples"), pa.table({
            "created_ts_ms": pa.array([0] * len(ids), pa.int64()),
            "corrects_example_id": pa.array(ids, pa.string())}), mode="append")
    monkeypatch.setattr(bench, "commits", lambda lake, table: [Commit(0, began + 5_000, {}),
                                                               Commit(1, began + 185_000, {})])
    lines = bench.load_lines(Lake(str(tmp_path)), began)
    assert lines == ["examples rows published per minute of the run, by commit (first publications + corrections): "
                     "0: 1+1, 1: 0+0, 2: 0+0, 3: 1+2"]
    assert bench.load_lines(Lake(str(tmp_path / "none")), began) == []
