"""validate_table end to end on small Delta tables: reports, quality rows and the gate's decision."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from gemline.config import GemlineConfig
from gemline.gate import gate_decision, release
from gemline.lake import Lake, commit_once, read_table
from ingest.config import IngestConfig
from sequences.config import BuildConfig
from tests.conftest import quality_sections
from validation.config import ValidationConfig
from validation.run import latest_report, validate_table

T0 = 1_700_000_000_000
NOW = T0 + 10 * 86_400_000


def config(lake) -> GemlineConfig:
    return GemlineConfig(
        lake=str(lake),
        ingest=IngestConfig(domains=("facebook", "instagram")),
        build=BuildConfig(max_seq_len=4),
        # dead_letter_min_records=0: the hand-made batches here have a few records, and their rates are judged.
        validation=ValidationConfig(min_label_rate=0.1, max_label_rate=0.9, min_event_time_ms=T0 - 1000,
                                    dead_letter_min_records=0),
    )


OFFSETS = {"offset_ranges": [[0, 0, 6]], "end_offsets": {"0": 6}}


def test_events_pass_then_a_critical_failure_quarantines_until_released(tmp_path, events_table):
    cfg = config(tmp_path)
    commit_once(tmp_path, "events", events_table(6), app_id="ingest:gemline.events", version=0, metadata=OFFSETS)
    commit_once(
        tmp_path, "events", events_table(2, changes={0: {"event_id": "e6", "kafka_offset": 6},
                                    1: {"event_id": "e7", "event_type": "hover", "kafka_offset": 7}}),
        app_id="ingest:gemline.events", version=1, metadata={"offset_ranges": [[0, 6, 8]], "end_offsets": {"0": 8}},
    )

    ok = validate_table(Lake.for_config(cfg), "events", 0, now_ms=NOW, **quality_sections(cfg))
    assert ok.passed and ok.failures == [] and ok.num_rows == 6 and ok.table_version == 0
    assert gate_decision(tmp_path, "events", 0).allowed

    bad = validate_table(Lake.for_config(cfg), "events", now_ms=NOW + 1,
                         **quality_sections(cfg))  # latest = version 1: the 2 rows it added are judged
    assert bad.table_version == 1 and bad.num_rows == 2 and not bad.passed
    # the ingest batch of version 1 has 2 records against 6 before: a volume drift warning beside it
    assert [f[:2] for f in bad.failures] == [("in_set:event_type", "critical"), ("drift:num_rows", "warning")]
    assert bad.failures[1][2] == "2 vs 6 over 1 batches: relative change 0.667 (max 0.5)"
    assert not gate_decision(tmp_path, "events", 1).allowed
    assert "in_set:event_type" in gate_decision(tmp_path, "events", 1).reason

    report = json.loads(bad.report_json.read_text())
    assert report["verdict"] == "QUARANTINED" and report["table"] == "events" and report["table_version"] == 1
    # the offsets of that very version's commit, not the newest one of the app
    assert report["source"]["offset_ranges"] == [[0, 6, 8]]
    assert report["code_version"]["gemline"] == "0.1.0" and report["code_version"]["git"]
    by_name = {e["expectation"]: e for e in report["expectations"]}
    assert by_name["in_set:event_type"] == {**by_name["in_set:event_type"], "severity": "critical", "success": False}
    assert json.loads(ok.report_json.read_text())["source"]["offset_ranges"] == [[0, 0, 6]]

    page = bad.report_html.read_text()
    assert '<div id="verdict" class="verdict QUARANTINED">QUARANTINED</div>' in page
    assert "data:image/png;base64," in page and "in_set:event_type" in page

    # quality: one row per expectation per run
    quality = read_table(tmp_path, "quality").to_pylist()
    assert len(quality) == 2 * len(report["expectations"])
    assert {r["report_path"] for r in quality} == {str(ok.report_json), str(bad.report_json)}

    release(tmp_path, "events", 1, "hover is a new event type, accepted", now_ms=NOW + 2)
    assert gate_decision(tmp_path, "events", 1).allowed
    assert latest_report(Lake(str(tmp_path)), "events") == ("QUARANTINED", bad.report_html)
    assert latest_report(Lake(str(tmp_path)), "events", 0) == ("PASSED", ok.report_html)


def test_examples_warning_only_passes_the_gate(tmp_path, examples_table):
    cfg = config(tmp_path)
    # all facebook rows clicked: label rate 1.0 > 0.9 is a warning, not a quarantine
    table = examples_table(8, changes={0: {"label_click": 1}, 4: {"label_click": 1}})
    commit_once(tmp_path, "examples", table, app_id="build", version=0, mode="overwrite", metadata={"events_version": 3})
    result = validate_table(Lake.for_config(cfg), "examples", now_ms=NOW, **quality_sections(cfg))
    assert result.passed
    assert [f[:2] for f in result.failures] == [("label_rate:facebook", "warning")]
    assert result.failures[0][2] == "1.0"
    assert gate_decision(tmp_path, "examples", 0).allowed
    report = json.loads(result.report_json.read_text())
    assert report["verdict"] == "PASSED" and report["source"]["events_version"] == 3
    page = result.report_html.read_text()
    assert '<div id="verdict" class="verdict PASSED">PASSED</div>' in page
    # seq length, its p50/p99 per domain, click rate, per domain/day, feature distributions, drift
    assert page.count("data:image/png;base64,") == 6


def test_examples_leakage_quarantines(tmp_path, examples_table):
    cfg = config(tmp_path)
    table = examples_table(8, changes={2: {"seq_event_time_ms": [T0, T0 + 2000]}})
    commit_once(tmp_path, "examples", table, app_id="build", version=0, mode="overwrite", metadata={"events_version": 0})
    result = validate_table(Lake.for_config(cfg), "examples", 0, now_ms=NOW, **quality_sections(cfg))
    assert not result.passed and [f[:2] for f in result.failures] == [("leakage", "critical")]
    assert not gate_decision(tmp_path, "examples", 0).allowed


def test_empty_table_is_quarantined_as_empty(tmp_path, events_table):
    commit_once(tmp_path, "events", events_table(0), app_id="ingest:gemline.events", version=0)
    result = validate_table(Lake.for_config(config(tmp_path)), "events", now_ms=NOW,
                            **quality_sections(config(tmp_path)))
    assert [f[:2] for f in result.failures] == [("empty", "critical")]
    assert not gate_decision(tmp_path, "events", 0).allowed
    assert "QUARANTINED" in result.report_html.read_text()


BAD_CALLS = [
    ("dead_letter", None, "no quality suite"),
    ("features/user", None, "does not exist"),
    ("events", None, "does not exist"),
]


@pytest.mark.parametrize("table,version,message", BAD_CALLS)
def test_bad_calls_raise_value_error(tmp_path, table, version, message):
    with pytest.raises(ValueError, match=message):
        validate_table(Lake.for_config(config(tmp_path)), table, version, now_ms=NOW,
                       **quality_sections(config(tmp_path)))


def test_version_out_of_range_raises(tmp_path, events_table):
    commit_once(tmp_path, "events", events_table(2), app_id="ingest:gemline.events", version=0)
    with pytest.raises(ValueError, match=r"version must be in \[0, 0\], got 5"):
        validate_table(Lake.for_config(config(tmp_path)), "events", 5, now_ms=NOW, **quality_sections(config(tmp_path)))


def test_latest_report_without_reports_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="gemline validate"):
        latest_report(Lake(str(tmp_path)), "events")


def test_revalidation_appends_a_run_and_the_gate_reads_the_newest(tmp_path, events_table):
    # the same version fails under a config without "instagram", then passes once it is known
    commit_once(tmp_path, "events", events_table(4), app_id="ingest:gemline.events", version=0)
    strict = GemlineConfig(lake=str(tmp_path), ingest=IngestConfig(domains=("facebook",)),
                           validation=ValidationConfig(min_event_time_ms=T0 - 1000))
    first = validate_table(Lake.for_config(strict), "events", now_ms=NOW, **quality_sections(strict))
    assert [f[:2] for f in first.failures] == [("in_set:domain", "critical")]
    assert not gate_decision(tmp_path, "events", 0).allowed
    second = validate_table(Lake.for_config(config(tmp_path)), "events", now_ms=NOW + 1,
                            **quality_sections(config(tmp_path)))
    assert second.passed and gate_decision(tmp_path, "events", 0).allowed
    quality = read_table(tmp_path, "quality").to_pylist()
    assert len({r["run_id"] for r in quality}) == 2
    assert latest_report(Lake(str(tmp_path)), "events")[0] == "PASSED"  # the report file holds the newest run


def test_dead_letter_rate_of_the_ingest_batch_quarantines_the_events_version(tmp_path, events_table):
    from ingest.schema import DEAD_LETTER_SCHEMA

    # batch 0: offsets [0, 10): 6 events, 4 dead-letter records (40% > the 10% critical rate);
    # a dead-letter row of another batch (offset 12) must not count
    meta = {"offset_ranges": [{"topic": "gemline.events", "partition": 0, "start": 0, "end": 10}], "end_offsets": {"0": 10}}
    dead = pa.Table.from_pylist(
        [dict(reason="not_json", detail="x", raw=b"{", kafka_topic="gemline.events", kafka_partition=0, kafka_offset=o,
              created_ts_ms=T0) for o in (6, 7, 8, 12)],
        schema=DEAD_LETTER_SCHEMA,
    )
    commit_once(tmp_path, "dead_letter", dead, app_id="ingest:gemline.events", version=0, metadata=meta)
    commit_once(tmp_path, "events", events_table(6), app_id="ingest:gemline.events", version=0, metadata=meta)
    result = validate_table(Lake.for_config(config(tmp_path)), "events", 0, now_ms=NOW,
                            **quality_sections(config(tmp_path)))
    assert [f[:2] for f in result.failures] == [("dead_letter_rate:warning", "warning"),
                                                ("dead_letter_rate:critical", "critical")]
    assert result.failures[1][2] == "0.3333 (3 of 9 records); max 0.1"
    decision = gate_decision(tmp_path, "events", 0)
    assert not decision.allowed and "dead_letter_rate:critical" in decision.reason


def test_dead_letters_of_an_earlier_broker_at_the_same_offsets_do_not_count(tmp_path, events_table):
    """After `ingest --reset-topic` (a restarted embedded broker numbers offsets from 0 again) the new batch's
    range covers offsets the old broker's dead letters had: only the batch's own dead letters count."""
    from ingest.schema import DEAD_LETTER_SCHEMA

    app = "ingest:gemline.events"
    old = {"offset_ranges": [{"topic": "gemline.events", "partition": 0, "start": 0, "end": 12}]}
    dead = pa.Table.from_pylist(
        [dict(reason="not_json", detail="x", raw=b"{", kafka_topic="gemline.events", kafka_partition=0, kafka_offset=o,
              created_ts_ms=T0) for o in range(6, 12)], schema=DEAD_LETTER_SCHEMA)
    commit_once(tmp_path, "dead_letter", dead, app_id=app, version=0, metadata=old)
    commit_once(tmp_path, "events", events_table(6), app_id=app, version=0, metadata=old)
    # The new broker's batch: offsets [0, 12) again, 6 good events, no dead letter (an empty part).
    new = {"offset_ranges": [{"topic": "gemline.events", "partition": 0, "start": 0, "end": 12}], "reset": "new broker"}
    commit_once(tmp_path, "dead_letter", dead.slice(0, 0), app_id=app, version=1, metadata=new)
    commit_once(tmp_path, "events", events_table(6), app_id=app, version=1, metadata=new)
    lake = Lake.for_config(config(tmp_path))
    first = validate_table(lake, "events", 0, now_ms=NOW, **quality_sections(config(tmp_path)))
    second = validate_table(lake, "events", 1, now_ms=NOW + 1, **quality_sections(config(tmp_path)))
    assert [f[2] for f in first.failures if f[0] == "dead_letter_rate:critical"] == ["0.5 (6 of 12 records); max 0.1"]
    assert not [f for f in second.failures if f[0].startswith("dead_letter_rate")]  # (event ids repeat: not this test)
    # A third batch with its own dead letter counts that one only.
    third = {"offset_ranges": [{"topic": "gemline.events", "partition": 0, "start": 0, "end": 12}]}
    commit_once(tmp_path, "dead_letter", dead.slice(0, 1), app_id=app, version=2, metadata=third)
    commit_once(tmp_path, "events", events_table(6), app_id=app, version=2, metadata=third)
    report = validate_table(lake, "events", 2, now_ms=NOW + 2, **quality_sections(config(tmp_path)))
    assert [f[2] for f in report.failures if f[0] == "dead_letter_rate:critical"] == [
        "0.1429 (1 of 7 records); max 0.1"]


def test_drift_against_the_previous_passed_batches(tmp_path, examples_table):
    # versions 0 and 1 pass with 8 rows; version 2 is quarantined (a leak) with 2 rows and must not join the
    # baseline; version 3 has 16 rows: +100% against the 8-row baseline of versions 0 and 1
    strict = GemlineConfig(
        lake=str(tmp_path), ingest=IngestConfig(domains=("facebook", "instagram")), build=BuildConfig(max_seq_len=4),
        validation=ValidationConfig(min_event_time_ms=T0 - 1000, drift_severity="critical", max_null_rate_change=1.0,
                                    max_mean_change=10.0, max_quantile_change=10.0, max_label_rate_change=10.0),
    )
    tables = [examples_table(8), examples_table(8), examples_table(2, {1: {"seq_event_time_ms": [T0 + 5000]}}),
              examples_table(16)]
    results = []
    for version, table in enumerate(tables):
        commit_once(tmp_path, "examples", table, app_id="build", version=version, mode="overwrite")
        results.append(validate_table(Lake.for_config(strict), "examples", version, now_ms=NOW + version,
                                      **quality_sections(strict)))
    assert [r.passed for r in results] == [True, True, False, False]
    assert [f[:2] for f in results[3].failures] == [("drift:num_rows", "critical")]
    assert results[3].failures[0][2] == "16 vs 8 over 2 batches: relative change 1 (max 0.5)"
    assert not gate_decision(tmp_path, "examples", 3).allowed
    report = json.loads(results[3].report_json.read_text())
    assert [h["table_version"] for h in report["history"]] == [0, 1]
    assert report["profile"]["num_rows"] == 16.0
    profiles = read_table(tmp_path, "quality_profiles").to_pylist()
    assert {(r["table_version"], r["passed"]) for r in profiles} == {(0, True), (1, True), (2, False), (3, False)}


def test_examples_versions_are_judged_on_the_rows_they_added(tmp_path, examples_table):
    cfg = config(tmp_path)
    bad = examples_table(8, changes={2: {"seq_event_time_ms": [T0, T0 + 2000]}})  # leaks: quarantined
    good = examples_table(8).set_column(0, "example_id", pa.array([f"later-{i}" for i in range(8)]))
    commit_once(tmp_path, "examples", bad, app_id="build", version=0, metadata={"events_version": 0})
    commit_once(tmp_path, "examples", good, app_id="build", version=1, metadata={"events_version": 1})
    first = validate_table(Lake.for_config(cfg), "examples", 0, now_ms=NOW, **quality_sections(cfg))
    second = validate_table(Lake.for_config(cfg), "examples", 1, now_ms=NOW, **quality_sections(cfg))
    assert not first.passed and second.passed, "one bad build does not fail every later version"
    assert (first.num_rows, second.num_rows) == (8, 8)  # each version's own rows, not the table's 16
    assert not gate_decision(tmp_path, "examples", 0).allowed and gate_decision(tmp_path, "examples", 1).allowed
    # A compaction adds no rows: judged on none (not on the whole table, as a growing run's compactions were),
    # and it passes, so the followers go on.
    assert DeltaTable(str(tmp_path / "examples")).optimize.compact()["numFilesRemoved"] == 2
    compacted = validate_table(Lake.for_config(cfg), "examples", 2, now_ms=NOW, **quality_sections(cfg))
    assert compacted.num_rows == 0 and compacted.passed and compacted.failures == [("empty", "warning",
                                                                                     compacted.failures[0][2])]
    assert gate_decision(tmp_path, "examples", 2).allowed
    profiled = {r["table_version"] for r in read_table(tmp_path, "quality_profiles").to_pylist()}
    assert profiled == {0, 1}, "no rows: no profile in the later versions' drift baseline"


def _unexpected(observed: str) -> int:
    """The unexpected count of a custom check's one-line summary ("N of M unexpected...")."""
    return int(observed.split(" of ")[0])


def test_events_versions_are_judged_on_their_new_rows_and_agree_with_the_whole_table(tmp_path, events_table):
    from validation.suites import validate_events

    cfg = config(tmp_path)
    day = 86_400_000
    # v0: e0-e3; v1: e4 and a second e1 5 s after the first (a duplicate across versions); v2: e5, e2 again two
    # days later (outside the 1-day dedup window: another event) and e4 again 1 s later (a duplicate of v1's row);
    # v3: e6 alone (clean, though the table it joins holds duplicates)
    def rows(offsets, changes):
        return events_table(len(offsets), changes={i: {"kafka_offset": o, **changes.get(i, {})} for i, o in enumerate(offsets)})

    versions = [
        events_table(4),
        rows([4, 5], {0: {"event_id": "e4"}, 1: {"event_id": "e1", "event_time_ms": T0 + 6000}}),
        rows([6, 7, 8], {0: {"event_id": "e5"}, 1: {"event_id": "e2", "event_time_ms": T0 + 2000 + 2 * day,
                                                    "event_date": "2023-11-16"},
                         2: {"event_id": "e4", "event_time_ms": T0 + 1000}}),
        rows([9], {0: {"event_id": "e6"}}),
    ]
    for v, table in enumerate(versions):
        commit_once(tmp_path, "events", table, app_id="ingest:gemline.events", version=v)
    lake = Lake.for_config(cfg)
    bounds = dict(domains=cfg.ingest.domains, min_time_ms=cfg.validation.min_event_time_ms, max_time_ms=NOW + day)

    def whole(v):
        results = validate_events(read_table(tmp_path, "events", v), **bounds, dedup_window_ms=cfg.ingest.dedup_window_ms)
        return next(r for r in results if r.name == "unique:event_id")

    incremental = []
    for v in range(4):
        result = validate_table(lake, "events", v, now_ms=NOW, **quality_sections(cfg))
        assert result.num_rows == versions[v].num_rows  # only the rows the version added
        report = json.loads(result.report_json.read_text())
        incremental.append(next(e for e in report["expectations"] if e["expectation"] == "unique:event_id"))
    assert [e["success"] for e in incremental] == [True, False, False, True]
    assert [whole(v).success for v in range(4)] == [True, False, False, False]
    # a version passes the whole-table check iff it and every version before it pass theirs
    assert all(whole(v).success == all(e["success"] for e in incremental[: v + 1]) for v in range(4))
    # v1 flags both copies of e1 (the earlier one too), as the whole table does; the increments' flags add up to
    # the whole table's
    assert _unexpected(incremental[1]["observed"]) == _unexpected(whole(1).observed) == 2
    assert [_unexpected(e["observed"]) for e in incremental] == [0, 2, 2, 0]
    assert _unexpected(whole(3).observed) == 4
    assert [gate_decision(tmp_path, "events", v).allowed for v in range(4)] == [True, False, False, True]

    # validating v3 right after v0 judges the rows of v1-v3 together: every duplicate is found again
    again = tmp_path / "again"
    for v, table in enumerate(versions):
        commit_once(again, "events", table, app_id="ingest:gemline.events", version=v)
    lake = Lake.for_config(config(again))
    validate_table(lake, "events", 0, now_ms=NOW, **quality_sections(cfg))
    skipped = validate_table(lake, "events", 3, now_ms=NOW, **quality_sections(cfg))
    assert skipped.num_rows == 6 and [f[0] for f in skipped.failures] == ["unique:event_id"]
    assert _unexpected(skipped.failures[0][2]) == 4

    # a version that adds no row has nothing to quarantine (as an empty examples increment)
    commit_once(again, "events", events_table(0), app_id="ingest:gemline.events", version=4)
    empty = validate_table(lake, "events", 4, now_ms=NOW, **quality_sections(cfg))
    assert empty.passed and empty.num_rows == 0 and ("empty", "warning") in [f[:2] for f in empty.failures]
