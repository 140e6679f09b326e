"""gemline.gate.GateWatch: a follower of the gate's verdicts on one table wakes on a validation run or a release
of that table's versions, not on those of another table nor on a compaction of ``quality``."""

from __future__ import annotations

from deltalake import DeltaTable

from gemline.gate import GateWatch, append_quality_rows, release


def _run(table: str, version: int, success: bool = True, run: str = "") -> list[dict]:
    """The rows of one validation run of ``table@version``: two critical expectations."""
    return [{"table": table, "table_version": version, "run_id": run or f"{table}-{version}", "run_ts_ms": 1000 + version,
             "expectation": name, "severity": "critical", "success": success, "observed": "", "report_path": ""}
            for name in ("row_count", "unique_ids")]


def test_gate_watch_counts_the_commits_about_its_table(tmp_path):
    lake = str(tmp_path / "lake")
    events, examples = GateWatch(lake, "events"), GateWatch(lake, "examples")
    assert (events(), examples()) == (0, 0), "no quality table yet"
    append_quality_rows(lake, _run("events", 0))
    assert (events(), examples()) == (1, 0), "the table's creation is a commit about events"
    append_quality_rows(lake, _run("examples", 0))
    append_quality_rows(lake, _run("examples", 1, success=False))
    assert (events(), examples()) == (1, 2)
    release(lake, "examples", 1, "a known bad day", now_ms=5000)
    append_quality_rows(lake, _run("events", 1))
    assert (events(), examples()) == (2, 3), "a release is a verdict too"
    assert (events(), examples()) == (2, 3), "nothing new: nothing counted"
    DeltaTable(str(tmp_path / "lake" / "quality")).optimize.compact()  # rewrites rows, adds none
    assert (events(), examples()) == (2, 3)


def test_a_commit_about_several_tables_wakes_each_and_history_counts_for_nothing(tmp_path):
    lake = str(tmp_path / "lake")
    append_quality_rows(lake, _run("examples", 0))
    late = GateWatch(lake, "examples")
    assert late() == 0, "the verdicts before the first look are not new"
    append_quality_rows(lake, [*_run("events", 2, run="both"), *_run("examples", 1, run="both")])
    # The stats bound the commit's table column to events..examples: both wake; tables outside those bounds not.
    watches = {t: GateWatch(lake, t) for t in ("events", "examples", "dead_letter", "sequences")}
    assert {t: w() for t, w in watches.items()} == dict.fromkeys(watches, 0)
    assert late() == 1
    append_quality_rows(lake, [*_run("events", 3, run="again"), *_run("examples", 2, run="again")])
    assert {t: w() for t, w in watches.items()} == {"events": 1, "examples": 1, "dead_letter": 0, "sequences": 0}
