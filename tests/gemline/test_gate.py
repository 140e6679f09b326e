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


def _sorted(table):
    return table.sort_by([("table", "ascending"), ("table_version", "ascending"), ("run_id", "ascending"),
                          ("expectation", "ascending")]).to_pylist()


def test_quality_ledger_equals_a_whole_read_through_appends_releases_compaction_and_deletes(tmp_path, monkeypatch):
    from gemline.gate import QUALITY_SCHEMA
    from gemline.increments import TableLedger
    from gemline.lake import read_table

    lake = str(tmp_path / "lake")
    ledger = TableLedger(lake, "quality", QUALITY_SCHEMA)
    assert ledger.rows() is None, "no quality table yet"
    append_quality_rows(lake, _run("events", 0))
    whole_reads = []
    real = ledger._read_whole
    monkeypatch.setattr(ledger, "_read_whole", lambda version: whole_reads.append(version) or real(version))
    assert _sorted(ledger.rows()) == _sorted(read_table(lake, "quality"))
    assert len(whole_reads) == 1, "the first look reads the table whole"
    for version in range(1, 4):
        append_quality_rows(lake, _run("events", version, success=version != 2))
    release(lake, "events", 2, "checked by hand", now_ms=9000)
    assert _sorted(ledger.rows()) == _sorted(read_table(lake, "quality"))
    assert len(whole_reads) == 1, "new commits are read by their added files only"
    assert ledger.rows().num_rows == 4 * 2 + 1
    DeltaTable(str(tmp_path / "lake" / "quality")).optimize.compact()
    assert _sorted(ledger.rows()) == _sorted(read_table(lake, "quality")), "a compaction adds no rows"
    assert len(whole_reads) == 1
    DeltaTable(str(tmp_path / "lake" / "quality")).delete("table_version = 1")
    rows = ledger.rows()
    assert len(whole_reads) == 2, "a delete makes the ledger read the table whole again"
    assert sorted({r["table_version"] for r in rows.to_pylist()}) == [0, 2, 3]


def test_quality_ledger_sees_a_table_recreated_under_the_same_path(tmp_path):
    import shutil

    from gemline.gate import QUALITY_SCHEMA
    from gemline.increments import TableLedger

    lake = str(tmp_path / "lake")
    for version in range(3):
        append_quality_rows(lake, _run("events", version))
    ledger = TableLedger(lake, "quality", QUALITY_SCHEMA)
    assert ledger.rows().num_rows == 6
    shutil.rmtree(tmp_path / "lake" / "quality")
    for version in range(7, 11):  # more commits than before: the next log entry the ledger looks for exists
        append_quality_rows(lake, _run("examples", version))
    assert {(r["table"], r["table_version"]) for r in ledger.rows().to_pylist()} == {("examples", v) for v in range(7, 11)}, \
        "the old table's rows must not survive its recreation"


def test_gate_decisions_follow_new_verdicts_in_one_process(tmp_path):
    from gemline.gate import gate_decisions

    lake = str(tmp_path / "lake")
    append_quality_rows(lake, _run("examples", 0, success=False))
    assert not gate_decisions(lake, "examples", [0, 1])[0].allowed
    assert not gate_decisions(lake, "examples", [0, 1])[1].validated
    append_quality_rows(lake, _run("examples", 1))
    release(lake, "examples", 0, "a known bad day", now_ms=5000)
    decided = gate_decisions(lake, "examples", [0, 1])
    assert decided[0].allowed and "released by hand" in decided[0].reason
    assert decided[1].allowed and decided[1].validated


def test_quality_ledger_merges_its_chunks_on_a_long_run(tmp_path):
    from gemline.gate import QUALITY_SCHEMA
    from gemline.increments import _MAX_CHUNKS, TableLedger
    from gemline.lake import read_table

    lake = str(tmp_path / "lake")
    append_quality_rows(lake, _run("events", 0))
    ledger = TableLedger(lake, "quality", QUALITY_SCHEMA)
    ledger.rows()
    for version in range(1, _MAX_CHUNKS + 6):
        append_quality_rows(lake, _run("events", version))
        rows = ledger.rows()
        assert rows.column(0).num_chunks <= _MAX_CHUNKS
    assert _sorted(rows) == _sorted(read_table(lake, "quality"))
    assert ledger.generation == 1, "read whole once, then by new commits only"
