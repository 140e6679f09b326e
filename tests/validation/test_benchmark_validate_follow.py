"""benchmarks.validate_follow on a small stream: both paths replay the run's validations and agree."""

from __future__ import annotations

from benchmarks.validate_follow import follower_runs, main
from tests.validation.test_session import NOW, _replay, _steps


def test_the_benchmark_replays_a_runs_validations_on_both_paths(tmp_path, events_table, examples_table, capsys):
    run = tmp_path / "run"
    _replay(run, _steps(events_table, examples_table), None, NOW)
    runs = follower_runs(str(run))
    assert [(r["table"], r["table_version"]) for r in runs] == [
        ("events", 0), ("events", 2), ("examples", 0), ("events", 3), ("examples", 1), ("examples", 2),
        ("events", 5)]  # oldest first; the release is not a run

    main(["--lake", str(run), "--work", str(tmp_path / "work")])
    out = capsys.readouterr().out.splitlines()
    assert out[-2] == "same quality rows, profiles and verdicts: yes"
    assert out[-1].startswith("all: 5 versions, CPU-s per version fresh ")
