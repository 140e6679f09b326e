"""build --follow and validate --follow (gemline.follow): each pass does what a person would run next, and a
quarantined events version holds the build until it is released."""

from __future__ import annotations

import pyarrow as pa
import pytest

from gemline.config import GemlineConfig
from gemline.follow import follow_build, follow_validate
from gemline.gate import gate_decision, release
from gemline.lake import commit_once, open_table
from ingest.config import IngestConfig
from ingest.schema import EVENTS_TABLE_SCHEMA
from sequences.config import BuildConfig
from validation.config import ValidationConfig

T0_MS = 1_700_000_000_000  # 2023-11-14T22:13:20Z


def _event(event_id: str, s: int, event_type: str, user: str, item: str) -> dict:
    return {"event_id": event_id, "event_time_ms": T0_MS + s * 1000, "user_id": user, "item_id": item,
            "domain": "facebook", "event_type": event_type, "category": "c", "position": None, "ad_format": None,
            "age": None, "gender": None, "location": None, "schema_version": 1, "created_ts_ms": T0_MS + s * 1000 + 1}


def _write(lake: str, rows: list[dict], version: int) -> None:
    first = version * 100
    table = pa.Table.from_pylist(
        [{**r, "event_date": "2023-11-14", "kafka_topic": "gemline.events", "kafka_partition": 0,
          "kafka_offset": first + i} for i, r in enumerate(rows)], schema=EVENTS_TABLE_SCHEMA)
    commit_once(lake, "events", table, app_id="ingest:gemline.events", version=version, partition_by=["event_date"],
                metadata={"offset_ranges": [[0, first, first + len(rows)]]})


def test_validate_and_build_follow_the_events_and_wait_at_a_quarantine(tmp_path, examples_layout, caplog):
    lake = str(tmp_path / "lake")
    config = GemlineConfig(lake=lake, ingest=IngestConfig(domains=("facebook",)),
                           build=BuildConfig(max_seq_len=4, click_window_ms=10_000, conversion_window_ms=20_000,
                                             examples_layout=examples_layout),
                           validation=ValidationConfig(min_event_time_ms=T0_MS - 1000, dead_letter_min_records=0))
    _write(lake, [_event("a1", 0, "impression", "u1", "i1"), _event("a2", 1, "click", "u1", "i1")], 0)

    with caplog.at_level("INFO", logger="gemline.follow"):
        nothing = follow_build(config, interval_s=0, max_passes=1)
    assert nothing.done == [] and "never validated" in str(nothing.waiting), "the build waits for validation"
    # Validation a pass behind is a follower's normal lag: said at INFO, not as a warning.
    assert [r.levelname for r in caplog.records if "build waits" in r.getMessage()] == ["INFO"]
    checked = follow_validate(config, ["events", "examples"], interval_s=0, max_passes=2)
    assert [(d["table"], d["version"], d["passed"]) for d in checked.done] == [("events", 0, True)], \
        "one validation per version: the second pass finds nothing new"
    caplog.clear()
    with caplog.at_level("INFO", logger="gemline.follow"):
        built = follow_build(config, interval_s=0, max_passes=2)
    assert [(d["table"], d["version"]) for d in built.done] == [("events", 0)] and built.waiting == ""
    # The one impression waits for its 20 s window (wait mode): said once, with the way to publish sooner.
    assert [r.getMessage().split("; to train sooner")[0] for r in caplog.records if r.levelname == "WARNING"] == [
        "nothing published yet (build.label_mode=wait publishes an impression when its longest attribution window "
        "closes; fnw/defer after build.publish_delay_ms): 1 impressions wait for their attribution windows (the "
        "longest: 20 s)"]
    examples_after_0 = open_table(lake, "examples").version()

    # events@1 repeats an event id: validation quarantines it and the build waits at it.
    _write(lake, [_event("b1", 30, "impression", "u2", "i2"), _event("b1", 30, "impression", "u2", "i2")], 1)
    checked = follow_validate(config, ["events", "examples"], interval_s=0, max_passes=1)
    examples_now = open_table(lake, "examples").version()
    # events@1 quarantined; the examples versions of the first build are empty (every window still open):
    # judged on the rows they added, nothing to quarantine.
    assert [(d["table"], d["version"], d["passed"]) for d in checked.done] == [
        ("events", 1, False), *[("examples", v, True) for v in range(examples_now + 1)]]
    # validation.follow_report_plots = "quarantined" (the default): only the quarantined version's report has plots
    pages = {d["version"]: d["report"].read_text() for d in checked.done if d["table"] == "events"}
    assert "data:image/png;base64," in pages[1]
    assert "data:image/png;base64," not in (tmp_path / "lake/_quality/events/0/report.html").read_text()
    assert "validation.follow_report_plots" in (tmp_path / "lake/_quality/events/0/report.html").read_text()
    caplog.clear()
    with caplog.at_level("INFO", logger="gemline.follow"):
        held = follow_build(config, interval_s=0, max_passes=2)
    assert held.done == [] and "events@1 is quarantined" in held.waiting, "version 0 is built already; 1 waits"
    assert [r.levelname for r in caplog.records if "build waits" in r.getMessage()] == ["WARNING"], "a quarantine is news"
    assert open_table(lake, "examples").version() == examples_after_0

    release(lake, "events", 1, "a known replay duplicate")
    assert gate_decision(lake, "events", 1).allowed
    resumed = follow_build(config, interval_s=0, max_passes=1)
    assert [(d["table"], d["version"]) for d in resumed.done] == [("events", 1)]
    checked = follow_validate(config, ["examples"], interval_s=0, max_passes=1)
    newest = open_table(lake, "examples").version()
    versions = [d["version"] for d in checked.done]
    assert versions == sorted(set(versions)) and versions, "each examples version validated once, in order"
    assert all(gate_decision(lake, "examples", v).validated for v in range(newest + 1))
    assert follow_validate(config, ["examples"], interval_s=0, max_passes=1).done == []


def test_an_interrupt_while_waiting_ends_the_loop(monkeypatch):
    import gemline.polling as polling

    def interrupted(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(polling.time, "sleep", interrupted)
    assert polling.sleep_or_stop(5.0) is True


def test_the_cli_follow_loops_print_each_version_and_stop_cleanly_while_waiting(tmp_path, capsys, monkeypatch):
    import json

    import gemline.follow as follow
    from gemline.cli import main

    lake = str(tmp_path / "lake")
    _write(lake, [_event("a1", 0, "impression", "u1", "i1"), _event("a2", 1, "click", "u1", "i1")], 0)
    sets = ["--lake", lake, "--set", "ingest.domains=facebook", "--set", f"validation.min_event_time_ms={T0_MS - 1000}"]

    monkeypatch.setattr(follow, "sleep_or_stop", lambda seconds: True)  # Ctrl-C or SIGTERM between two passes
    assert main(["validate", "--follow", "--table", "events,examples", "--interval-s", "0", *sets]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["table"], r["version"], r["passed"]) for r in lines] == [("events", 0, True)]
    assert main(["build", "--follow", "--interval-s", "0", *sets]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["table"], r["version"]) for r in lines] == [("events", 0)]


def test_build_follow_interval_and_watch_are_config_keys_and_the_flags_override_them(tmp_path, capsys, monkeypatch):
    import gemline.follow as follow
    from gemline.cli import main

    waits: list[tuple[float, float | None]] = []
    gaps: list[float | None] = []

    def stopped(probe, seen, *, interval_s, watch_s, earliest, sleep, clock):
        waits.append((interval_s, watch_s))
        gaps.append(None if earliest is None else earliest - clock())
        return "stopped"

    monkeypatch.setattr(follow, "_newest_allowed", lambda lake, gate="required": (None, "", True))  # an empty lake: nothing to build
    monkeypatch.setattr(follow, "wait_for_input", stopped)
    config = tmp_path / "gemline.toml"
    config.write_text("[build]\ninterval_s = 4.5\nwatch_s = 0.25\n")
    lake = ["--lake", str(tmp_path / "lake")]
    assert main(["build", "--follow", *lake]) == 0
    assert main(["build", "--follow", "--config", str(config), *lake]) == 0
    assert main(["build", "--follow", "--config", str(config), "--set", "build.interval_s=7", *lake]) == 0
    assert main(["build", "--follow", "--config", str(config), "--set", "build.interval_s=7", "--interval-s", "2",
                 "--watch-s", "3", *lake]) == 0
    assert main(["build", "--follow", "--set", "build.watch_s=none", *lake]) == 0
    assert main(["build", "--follow", "--watch-s", "none", "--config", str(config), *lake]) == 0
    assert waits == [(10.0, 1.0), (4.5, 0.25), (7.0, 0.25), (2.0, 3.0), (10.0, None), (4.5, None)]
    assert all(g is not None and 9.0 < g <= 10.0 for g in gaps), "a woken pass 10 s after the last one started"
    assert main(["build", "--follow", "--set", "build.min_gap_s=0", *lake]) == 0
    assert gaps[-1] is None, "no minimum gap"
    assert main(["build", "--follow", "--set", "build.min_gap_s=-1", *lake]) == 2
    assert "build.min_gap_s must be >= 0 seconds, got -1.0" in capsys.readouterr().err
    assert main(["build", "--follow", "--set", "build.interval_s=-1", *lake]) == 2
    assert "build.interval_s must be >= 0 seconds, got -1.0" in capsys.readouterr().err
    assert main(["build", "--follow", "--set", "build.watch_s=0", *lake]) == 2
    assert "build.watch_s must be > 0 seconds (or unset: no watching), got 0.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["build", "--follow", "--watch-s", "0", *lake])
    assert "expected seconds > 0 or none, got '0'" in capsys.readouterr().err


def _follow_config(lake: str, examples_layout: str = "fat") -> GemlineConfig:
    return GemlineConfig(lake=lake, ingest=IngestConfig(domains=("facebook",)),
                         build=BuildConfig(max_seq_len=4, click_window_ms=10_000, conversion_window_ms=20_000,
                                           examples_layout=examples_layout),
                         validation=ValidationConfig(min_event_time_ms=T0_MS - 1000, dead_letter_min_records=0))


def test_validate_follow_wakes_on_a_new_events_version_and_is_idle_otherwise(tmp_path, fake_clock):
    """events@1 lands at 12.3 s, mid-wait of a 60 s interval: validated at the next look (13 s); then nothing new,
    and the next pass is the interval's."""
    from gemline.follow import Waiting

    lake = str(tmp_path / "lake")
    _write(lake, [_event("a1", 0, "impression", "u1", "i1")], 0)
    fake_clock.at(12.3, lambda: _write(lake, [_event("b1", 30, "impression", "u2", "i2")], 1))
    passes: list[tuple[float, list]] = []
    follow_validate(_follow_config(lake), ["events", "examples"], max_passes=3,
                    waiting=Waiting(60.0, 1.0, sleep=fake_clock.sleep, clock=fake_clock),
                    on_pass=lambda state: passes.append((fake_clock.now, [d["version"] for d in state.done])))
    assert passes == [(0.0, [0]), (13.0, [0, 1]), (73.0, [0, 1])]
    assert fake_clock.sleeps == [1.0] * 13 + [1.0] * 60, "a look a second, no busy loop"


def test_build_follow_wakes_on_a_verdict_about_events_not_on_an_unvalidated_version(tmp_path, fake_clock):
    """events@1 lands at 5 s (not validated: no pass), its verdict at 20.5 s (a pass at 21 s); a verdict about
    examples at 30 s wakes nothing; the idle pass comes interval_s after the last."""
    from gemline.follow import Waiting
    from gemline.gate import append_quality_rows

    lake = str(tmp_path / "lake")
    config = _follow_config(lake)
    _write(lake, [_event("a1", 0, "impression", "u1", "i1")], 0)
    follow_validate(config, ["events"], max_passes=1)
    examples_verdict = [{"table": "examples", "table_version": 0, "run_id": "x", "run_ts_ms": 1, "expectation": "e",
                         "severity": "warning", "success": True, "observed": "", "report_path": ""}]
    fake_clock.at(5.0, lambda: _write(lake, [_event("b1", 30, "impression", "u2", "i2")], 1))
    fake_clock.at(20.5, lambda: follow_validate(config, ["events"], max_passes=1))
    fake_clock.at(30.0, lambda: append_quality_rows(lake, examples_verdict))
    passes: list[tuple[float, list]] = []
    follow_build(config, max_passes=3, waiting=Waiting(45.0, 1.0, sleep=fake_clock.sleep, clock=fake_clock),
                 on_pass=lambda state: passes.append((fake_clock.now, [d["version"] for d in state.done])))
    assert passes == [(0.0, [0]), (21.0, [0, 1]), (66.0, [0, 1])]


def test_nothing_published_hint_only_for_a_wait_build_with_impressions_waiting():
    """Hand cases: the hint names the longest window and the settings that publish sooner; no hint once anything
    was published, with nothing pending, or in an early-publishing mode."""
    from gemline.follow import nothing_published_hint
    from sequences.config import NOTHING_PUBLISHED
    from sequences.pipeline import BuildResult

    def result(examples: int, pending: int) -> BuildResult:
        return BuildResult(events_version=3, examples_version=2, num_examples=examples, num_sequences=5,
                           num_user_features=5, num_item_features=5, seq_length_p50=None, seq_length_p99=None,
                           skipped=False, num_published=0, num_pending=pending)

    hint = nothing_published_hint(BuildConfig(), result(0, 40))
    assert hint is not None and hint.startswith(f"{NOTHING_PUBLISHED}: 40 impressions wait for their attribution "
                                                "windows (the longest: 7 days)")
    assert "--set build.label_mode=defer --set build.publish_delay_ms=60000" in hint
    assert nothing_published_hint(BuildConfig(), result(1, 40)) is None
    assert nothing_published_hint(BuildConfig(), result(0, 0)) is None
    assert nothing_published_hint(BuildConfig(label_mode="defer", publish_delay_ms=60_000), result(0, 40)) is None


def test_a_validator_behind_summarizes_the_pointer_rows_of_several_versions_at_once(tmp_path):
    """ValidationSession.prefetch_pointer_summaries: each examples version's part equals its rows' own summaries
    from their users' whole history (the reference path), and is handed out once."""
    from gemline.increments import rows_added
    from gemline.lake import Lake
    from sequences.history_tail import HistoryTail
    from sequences.materialize import read_history
    from validation.pointer_checks import summarize_pointers
    from validation.session import ValidationSession

    lake = str(tmp_path / "lake")
    config = _follow_config(lake, "pointer")
    for version in range(4):  # each version closes the windows of the one before: a build publishes per version
        s = 100 * version  # versions of different sizes and histories: a part cut at the wrong row shows
        _write(lake, [_event(f"v{version}a", s, "impression", "u1", "i1"), _event(f"v{version}b", s + 1, "click", "u1", "i1"),
                      *[_event(f"v{version}i{k}", s + 2 + k, "impression", f"u{k % 2 + 2}", f"i{k}") for k in range(version + 1)]],
               version)
        follow_validate(config, ["events"], interval_s=0, max_passes=1)
        follow_build(config, interval_s=0, max_passes=1)
    with_rows = [v for v in range(open_table(lake, "examples").version() + 1) if rows_added(lake, "examples", v) is not None]
    assert len(with_rows) >= 3, with_rows
    session = ValidationSession(Lake(lake), HistoryTail(Lake(lake), config.build.max_seq_len, config.build.same_domain_seq_len))
    session.prefetch_pointer_summaries(with_rows, config.build)
    for version in with_rows:
        rows = rows_added(lake, "examples", version)
        alone = summarize_pointers(rows, read_history(lake, rows.column("user_id")), config.build)
        got = session.take_pointer_summaries(version, rows.num_rows)
        assert got is not None, version
        for prefix in alone:
            for field in ("lengths", "truncated", "newest_ms", "newest_created_ms", "unordered"):
                assert getattr(got[prefix], field).tolist() == getattr(alone[prefix], field).tolist()
        assert session.take_pointer_summaries(version, rows.num_rows) is None, "handed out once"


def test_the_followers_pointer_summaries_give_the_checks_of_the_whole_history(tmp_path):
    """validate --follow's pointer checks come from sequences.pointer_summaries (counts kept with history,
    corrections from the cache): each examples version's three sequence checks and pointers_materialize equal
    those from its users' whole history; an impression missing from history fails pointers_materialize."""
    import pyarrow.compute as pc

    from gemline.increments import rows_added
    from gemline.lake import Lake
    from sequences.pointer_summaries import PointerSummaries
    from validation.run import _pointer_checks

    lake = str(tmp_path / "lake")
    config = _follow_config(lake, "pointer")
    index = PointerSummaries(Lake(lake), config.build.max_seq_len, config.build.same_domain_seq_len,
                             margin_builds=0, min_fold_rows=0)
    checked = 0
    for version in range(4):
        s = 100 * version
        _write(lake, [_event(f"v{version}a", s, "impression", "u1", "i1"), _event(f"v{version}b", s + 1, "click", "u1", "i1"),
                      *[_event(f"v{version}i{k}", s + 2 + k, "impression", f"u{k % 2 + 2}", f"i{k}") for k in range(version + 1)]],
               version)
        follow_validate(config, ["events"], interval_s=0, max_passes=1)
        follow_build(config, interval_s=0, max_passes=1)
        rows = rows_added(lake, "examples", open_table(lake, "examples").version())
        if rows is None or not rows.num_rows:
            continue
        got, got_extra = _pointer_checks(Lake(lake), config.build, "examples", rows, index=index)
        want, want_extra = _pointer_checks(Lake(lake), config.build, "examples", rows)
        assert [(r.name, r.success) for r in got_extra] == [(r.name, r.success) for r in want_extra] == [
            ("pointers_materialize", True)]
        assert {name: check(rows) for name, check in got.items()} == {name: check(rows) for name, check in want.items()}
        checked += 1
    assert checked >= 3 and index.reference_rows == 0, "every row answered from the counts or the cache"
    stranger = rows.set_column(rows.schema.get_field_index("example_id"), "example_id",
                               pc.binary_join_element_wise(rows.column("example_id"), "?", ""))
    if "corrects_example_id" in stranger.column_names:
        stranger = stranger.drop_columns(["corrects_example_id"])
    _, extra = _pointer_checks(Lake(lake), config.build, "examples", stranger, index=index)
    assert (extra[0].name, extra[0].success) == ("pointers_materialize", False)
    assert "missing from history" in extra[0].observed


def test_build_follow_honours_events_gate_off_and_wakes_on_new_events(tmp_path, fake_clock):
    """With build.events_gate = "off" the follower builds every events version as it lands, never validated (the
    one-shot build's behaviour), and a new version, not a verdict, wakes it."""
    from dataclasses import replace

    from gemline.follow import Waiting

    lake = str(tmp_path / "lake")
    config = _follow_config(lake)
    config = replace(config, build=replace(config.build, events_gate="off"))
    _write(lake, [_event("a1", 0, "impression", "u1", "i1")], 0)
    fake_clock.at(5.0, lambda: _write(lake, [_event("b1", 30, "impression", "u2", "i2")], 1))
    passes: list[tuple[float, list, str]] = []
    follow_build(config, max_passes=2, waiting=Waiting(45.0, 1.0, sleep=fake_clock.sleep, clock=fake_clock),
                 on_pass=lambda state: passes.append((fake_clock.now, [d["version"] for d in state.done],
                                                      state.waiting)))
    assert passes == [(0.0, [0], ""), (5.0, [0, 1], "")]


def test_a_wait_without_progress_is_said_once_at_warning(caplog):
    from gemline.polling import LongWait

    now = [0.0]
    wait = LongWait(10.0, clock=lambda: now[0])  # three intervals, at least 60 s
    said = []
    with caplog.at_level("WARNING", logger="gemline.polling"):
        for t, reason, progressed in [(0, "events@3 is not validated yet", False), (30, "events@4 ...", False),
                                      (61, "events@4 is not validated yet", False), (90, "x", False),
                                      (100, "", True), (120, "events@9 is quarantined", False),
                                      (185, "events@9 is quarantined", False)]:
            now[0] = float(t)
            said.append(wait.note("build", reason, progressed))
    assert said == [False, False, True, False, False, False, True]
    assert [r.getMessage() for r in caplog.records] == [
        "build has made no progress for 61 s: events@4 is not validated yet",
        "build has made no progress for 65 s: events@9 is quarantined"]
