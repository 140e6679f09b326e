"""validate --follow's ValidationSession against fresh reads: the same quality rows, profiles and reports (twins)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import write_deltalake

from gemline.config import GemlineConfig
from gemline.gate import gate_decisions, last_validated_before, release
from gemline.lake import Lake, commit_once, read_table
from ingest.config import IngestConfig
from sequences.config import BuildConfig
from tests.conftest import quality_sections
from validation.config import ValidationConfig
from validation.profiles import profile_history
from validation.run import validate_table
from validation.session import ValidationSession

T0 = 1_700_000_000_000
NOW = T0 + 10 * 86_400_000
APP = "ingest:gemline.events"


def config(lake) -> GemlineConfig:
    # drift critical on volume only: a batch of another size is quarantined, so the baseline must skip it
    return GemlineConfig(
        lake=str(lake), ingest=IngestConfig(domains=("facebook", "instagram")), build=BuildConfig(max_seq_len=4),
        validation=ValidationConfig(min_label_rate=0.1, max_label_rate=0.9, min_event_time_ms=T0 - 1000,
                                    dead_letter_min_records=0, drift_severity="critical", max_null_rate_change=1.0,
                                    max_mean_change=10.0, max_quantile_change=10.0, max_label_rate_change=10.0))


def _events(events_table, first: int, n: int, changes: dict | None = None) -> pa.Table:
    """Events ``first .. first + n - 1`` (ids, offsets and times follow the index)."""
    table = events_table(first + n, changes)
    return table.slice(first, n)


def _steps(events_table, examples_table) -> list:
    """Commits and validations of a small stream, in order: ("commit", table, data, txn) or ("validate", table,
    version) or ("release", table, version); events@2 is quarantined (a bad type), examples@1 by its volume."""
    def commit(first, n, txn, changes=None):
        rng = {"offset_ranges": [[0, first, first + n]], "end_offsets": {"0": first + n}}
        return ("commit", "events", _events(events_table, first, n, changes), txn, rng)

    ex_later = examples_table(16).set_column(0, "example_id", pa.array([f"b{i}" for i in range(16)]))
    ex_third = examples_table(8).set_column(0, "example_id", pa.array([f"c{i}" for i in range(8)]))
    return [
        commit(0, 6, 0), ("validate", "events", 0),
        commit(6, 6, 1), commit(12, 6, 2, {14: {"event_type": "hover"}}), ("validate", "events", 2),
        ("commit", "examples", examples_table(8), 0, {"events_version": 2}), ("validate", "examples", 0),
        ("release", "events", 2),
        commit(18, 6, 3, {18: {"event_id": "e13"}}), ("validate", "events", 3),  # a repeat of an earlier id
        ("commit", "examples", ex_later, 1, {"events_version": 3}), ("validate", "examples", 1),
        ("commit", "examples", ex_third, 2, {"events_version": 3}), ("validate", "examples", 2),
        commit(24, 6, 4), commit(30, 6, 5), ("validate", "events", 5),
    ]


def _replay(lake_dir, steps, session: ValidationSession | None, now: int) -> list:
    cfg = config(lake_dir)
    lake = Lake.for_config(cfg)
    results = []
    for i, step in enumerate(steps):
        if step[0] == "commit":
            _, table, data, txn, meta = step
            commit_once(lake_dir, table, data, app_id=APP if table == "events" else "build", version=txn,
                        metadata=meta)
        elif step[0] == "release":
            release(lake_dir, step[1], step[2], "accepted by hand", now_ms=now + i)
        else:
            r = validate_table(lake, step[1], step[2], now_ms=now + i, session=session, **quality_sections(cfg))
            report = json.loads(r.report_json.read_text())
            del report["run_id"]
            results.append((r.table, r.table_version, r.passed, r.num_rows, r.failures, report))
            if session is not None:  # its answers equal the reads, every step
                session.refresh()
                for table in ("events", "examples"):
                    decisions = gate_decisions(lake_dir, table, range(8))
                    assert session.validated(table) == {v for v, d in decisions.items() if d.validated}
                    for v in range(8):
                        assert session.last_validated_before(table, v) == last_validated_before(lake_dir, table, v)
                        assert session.profile_history(table, v, 5) == profile_history(lake_dir, table, v, 5)
    return results


def _rows(lake_dir, table, drop) -> list[tuple]:
    data = read_table(lake_dir, table)
    keep = [c for c in data.column_names if c not in drop]
    return sorted(tuple(r.values()) for r in data.select(keep).to_pylist())


@pytest.mark.parametrize("now", [NOW, T0 + 60_000])
def test_a_session_gives_the_quality_rows_profiles_and_reports_of_fresh_reads(tmp_path, events_table,
                                                                                 examples_table, now):
    fresh_dir, session_dir = tmp_path / "fresh", tmp_path / "session"
    steps = _steps(events_table, examples_table)
    fresh = _replay(fresh_dir, steps, None, now)
    session = ValidationSession(Lake(str(session_dir)))
    mine = _replay(session_dir, steps, session, now)

    assert mine == fresh
    # a clock near the events' times: the ids of events@2 and @5 were new, not read among the earlier rows;
    # events@3's repeat of e13 was (ten days later, the events' partitions are too old to be kept)
    assert session.events_ids.skips == (2 if now < NOW else 0)
    # the stream is not trivial: a quarantine by a check, a repeat of an earlier id, one by drift, a release
    assert [(t, v, p) for t, v, p, *_ in fresh] == [
        ("events", 0, True), ("events", 2, False), ("examples", 0, True), ("events", 3, False),
        ("examples", 1, False), ("examples", 2, True), ("events", 5, True)]
    assert [f[0] for f in fresh[3][4]] == ["unique:event_id"]
    assert fresh[5][5]["history"][0]["table_version"] == 0  # examples@1 (quarantined) is not in the baseline
    assert fresh[6][3] == 12  # events@4 and 5: the rows since events@3
    assert _rows(session_dir, "quality", ("run_id", "report_path")) == _rows(fresh_dir, "quality",
                                                                             ("run_id", "report_path"))
    assert _rows(session_dir, "quality_profiles", ("run_id",)) == _rows(fresh_dir, "quality_profiles", ("run_id",))


def test_a_session_reads_a_rewritten_quality_table_whole_again(tmp_path, events_table):
    lake = Lake(str(tmp_path))
    commit_once(tmp_path, "events", events_table(6), app_id=APP, version=0,
                metadata={"offset_ranges": [[0, 0, 6]], "end_offsets": {"0": 6}})
    session = ValidationSession(lake)
    cfg = config(tmp_path)
    validate_table(lake, "events", 0, now_ms=NOW, session=session, **quality_sections(cfg))
    session.refresh()
    assert session.validated("events") == {0} and session.last_validated_before("events", 1) == 0
    before = session._quality.whole_reads
    # someone rewrites quality without events@0's run (an overwrite: files removed, not an append)
    quality = read_table(tmp_path, "quality")
    write_deltalake(str(tmp_path / "quality"), quality.filter(pc.equal(quality["table"], "nothing")), mode="overwrite")
    session.refresh()
    assert session.validated("events") == set() and session.last_validated_before("events", 1) is None
    assert session._quality.whole_reads == before + 1
