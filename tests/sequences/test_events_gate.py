"""The events quality gate holds the build: only passed or released ``events`` versions are built.

The decision rules (gemline.gate.require_allowed) are checked on hand-written ``quality`` rows;
one slow test runs the real path: a version with duplicate event ids is validated (GX), refused by
the build and by `gemline build` (one line, exit 3), released with `gemline quality release
--table events`, then built.
"""

from __future__ import annotations

import pyarrow as pa
import pytest

from gemline.cli import main
from gemline.config import GemlineConfig
from gemline.gate import GateClosedError, append_quality_rows, release, require_allowed
from gemline.lake import Lake, commit_once, open_table, read_table
from ingest.config import IngestConfig
from ingest.schema import EVENTS_TABLE_SCHEMA
from sequences.config import BuildConfig
from sequences.pipeline import run_build
from tests.conftest import build_args, quality_sections
from validation.config import ValidationConfig
from validation.run import validate_table

from .conftest import event

T0_MS = 1_700_000_000_000  # 2023-11-14T22:13:20Z
NOW_MS = T0_MS + 10 * 86_400_000
DOMAINS = ("facebook", "instagram")


def _check(version: int, expectation: str, success: bool, run_ts_ms: int, severity: str = "critical") -> dict:
    return {"table": "events", "table_version": version, "run_id": f"run-{run_ts_ms}", "run_ts_ms": run_ts_ms,
            "expectation": expectation, "severity": severity, "success": success, "observed": "",
            "report_path": ""}


def _passed(version: int, ts: int) -> list[dict]:
    return [_check(version, "unique:event_id", True, ts), _check(version, "drift:num_rows", False, ts, "warning")]


def _quarantined(version: int, ts: int) -> list[dict]:
    return [_check(version, "unique:event_id", False, ts), _check(version, "not_null:event_id", True, ts)]


RELEASE_1 = 'then `gemline quality release 1 --table events --reason "..."` to let it through'

# (quality rows, version, since, expected message or None when allowed)
CASES = [
    ([], 0, None, "build refused: events@0 was never validated; run `gemline validate --table events --version 0` first"),
    (_passed(0, 10), 0, None, None),
    (_passed(0, 10) + _quarantined(1, 20), 1, 0,
     "build refused: events@1 is quarantined: critical expectations failed: unique:event_id; inspect it "
     f"(`gemline report --table events --version 1`), {RELEASE_1}"),
    # A quarantined version in between is not read past, even when the target passed.
    (_passed(0, 10) + _quarantined(1, 20) + _passed(2, 30), 2, None,
     "build refused: events@1 is quarantined: critical expectations failed: unique:event_id; inspect it "
     f"(`gemline report --table events --version 1`), {RELEASE_1}"),
    # ... but one already built (since=1) is not read again.
    (_passed(0, 10) + _quarantined(1, 20) + _passed(2, 30), 2, 1, None),
    # Never-validated versions in between are covered by the target's validation (every row since the last one validated).
    (_passed(3, 30), 3, None, None),
    # The newest run decides: a later passing run opens the gate, a later failing one closes it.
    (_quarantined(0, 10) + _passed(0, 20), 0, None, None),
    (_passed(0, 10) + _quarantined(0, 20), 0, None,
     "build refused: events@0 is quarantined: critical expectations failed: unique:event_id; inspect it "
     '(`gemline report --table events --version 0`), then `gemline quality release 0 --table events '
     '--reason "..."` to let it through'),
]


@pytest.mark.parametrize(("rows", "version", "since", "message"), CASES)
def test_require_allowed(tmp_path, rows, version, since, message):
    append_quality_rows(tmp_path, rows)
    if message is None:
        decision = require_allowed(tmp_path, "events", version, since=since, reader="build")
        assert (decision.table, decision.table_version, decision.allowed) == ("events", version, True)
    else:
        with pytest.raises(GateClosedError) as info:
            require_allowed(tmp_path, "events", version, since=since, reader="build")
        assert str(info.value) == message
        assert "\n" not in str(info.value)


def test_a_release_after_the_failed_run_opens_the_gate(tmp_path):
    append_quality_rows(tmp_path, _quarantined(0, 10))
    with pytest.raises(GateClosedError):
        require_allowed(tmp_path, "events", 0, reader="build")
    release(tmp_path, "events", 0, "duplicates are a known replay", now_ms=11)
    decision = require_allowed(tmp_path, "events", 0, reader="build")
    assert decision.reason == "events@0 released by hand: duplicates are a known replay"


def test_build_config_refuses_an_unknown_events_gate():
    with pytest.raises(ValueError, match="build.events_gate must be 'required' or 'off', got 'warn'"):
        BuildConfig(events_gate="warn")
    assert BuildConfig().events_gate == "required"


def _write(lake: str, rows: list[dict], version: int) -> None:
    first_offset = version * 100
    table = pa.Table.from_pylist(
        [{**r, "event_date": "2023-11-14", "kafka_topic": "gemline.events", "kafka_partition": 0,
          "kafka_offset": first_offset + i} for i, r in enumerate(rows)],
        schema=EVENTS_TABLE_SCHEMA,
    )
    commit_once(lake, "events", table, app_id="ingest:gemline.events", version=version, partition_by=["event_date"],
                metadata={"offset_ranges": [[0, first_offset, first_offset + len(rows)]]})


def _ev(event_id: str, s: int, event_type: str, user: str, item: str, domain: str = "facebook") -> dict:
    return event(event_id, T0_MS + s * 1000, event_type, user=user, item=item, domain=domain, category="c")


@pytest.mark.slow
def test_quarantined_events_stop_the_build_until_released(tmp_path, capsys):
    lake = str(tmp_path / "lake")
    config = GemlineConfig(
        lake=lake, ingest=IngestConfig(domains=DOMAINS),
        build=BuildConfig(max_seq_len=4, click_window_ms=10_000, conversion_window_ms=20_000),
        validation=ValidationConfig(min_event_time_ms=T0_MS - 1000),
    )
    _write(lake, [_ev("a1", 0, "impression", "u1", "i1"), _ev("a2", 1, "click", "u1", "i1"),
                  _ev("b1", 2, "impression", "u2", "i2", "instagram"), _ev("b2", 3, "engagement", "u2", "i3")], 0)
    # Never validated: refused before anything is written.
    with pytest.raises(GateClosedError, match=r"events@0 was never validated; run `gemline validate --table events"):
        run_build(*build_args(config))
    assert open_table(lake, "examples") is None
    assert validate_table(Lake.for_config(config), "events", now_ms=NOW_MS, **quality_sections(config)).passed
    first = run_build(*build_args(config), final=True)
    assert (first.events_version, first.skipped, first.num_examples) == (0, False, 2)

    # Version 1 writes event ids straight to the table twice (a1 again, c1 twice).
    _write(lake, [_ev("a1", 0, "impression", "u1", "i1"), _ev("c1", 40, "impression", "u3", "i1"),
                  _ev("c1", 40, "impression", "u3", "i1")], 1)
    verdict = validate_table(Lake.for_config(config), "events", now_ms=NOW_MS + 1, **quality_sections(config))
    assert (verdict.table_version, verdict.passed) == (1, False)
    assert [f[:2] for f in verdict.failures if f[1] == "critical"] == [("unique:event_id", "critical")]

    examples_version = open_table(lake, "examples").version()
    with pytest.raises(GateClosedError) as info:
        run_build(*build_args(config), final=True)
    assert str(info.value) == (
        "build refused: events@1 is quarantined: critical expectations failed: unique:event_id; inspect it "
        f"(`gemline report --table events --version 1`), {RELEASE_1}")
    assert (info.value.decision.table, info.value.decision.table_version) == ("events", 1)
    assert open_table(lake, "examples").version() == examples_version  # nothing built

    capsys.readouterr()
    assert main(["build", "--lake", lake, "--set", "build.max_seq_len=4", "--final"]) == 3
    err = capsys.readouterr().err
    assert err == f"error: {info.value}\n"  # one line, no traceback

    assert main(["quality", "release", "1", "--table", "events", "--reason", "replayed duplicates, checked",
                 "--lake", lake]) == 0
    assert capsys.readouterr().out == "events@1 released by hand: replayed duplicates, checked\n"
    built = run_build(*build_args(config), final=True)
    assert (built.events_version, built.skipped) == (1, False)
    ids = sorted(read_table(lake, "examples", columns=["example_id"]).column("example_id").to_pylist())
    assert ids == ["a1", "b1", "c1"]  # c1 built once its version was released
