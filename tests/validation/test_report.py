"""Report building and HTML rendering, without GX: verdicts, escaping, plots that cannot be drawn."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from validation.report import build_report, draw_plots, render_html, verdict, write_report
from validation.suites import CheckResult


def check(name: str, severity: str, success: bool, observed: str = "0") -> CheckResult:
    return CheckResult(name, severity, success, observed, "custom:test", {})


VERDICTS = [
    ([], "PASSED"),
    ([check("a", "critical", True)], "PASSED"),
    ([check("a", "critical", True), check("w", "warning", False)], "PASSED"),
    ([check("a", "critical", False), check("w", "warning", True)], "QUARANTINED"),
]


@pytest.mark.parametrize("results,expected", VERDICTS)
def test_verdict_is_quarantined_only_by_a_failed_critical(results, expected):
    assert verdict(results) == expected


def report_for(results) -> dict:
    return build_report(
        table="examples", table_version=7, num_rows=3, results=results, run_id="r1", run_ts_ms=123, source=None
    )


def test_html_escapes_observed_values_and_shows_verdict_first():
    report = report_for([check("in_set:domain", "critical", False, '1 of 3 unexpected, e.g. ["<script>x</script>"]')])
    page = render_html(report, {})
    assert "<script>x</script>" not in page and "&lt;script&gt;" in page
    body = page[page.index("<body>") :]
    assert body.index('class="verdict QUARANTINED"') < body.index("<h1>")
    assert "not recorded" in page  # no source metadata


def test_plots_of_a_batch_missing_columns_are_marked_unavailable(tmp_path):
    data = pa.table({"domain": ["facebook"], "event_date": ["2023-11-14"]})  # no seq_length, no label_click
    plots = draw_plots("examples", data)
    assert plots["Sequence length"].startswith("unavailable: KeyError")
    assert plots["Click rate per domain"].startswith("unavailable:")
    assert not plots["Examples per domain and day"].startswith("unavailable")
    json_path, html_path = write_report(tmp_path, report_for([check("empty", "critical", True, "1")]), data)
    assert json.loads(json_path.read_text())["verdict"] == "PASSED"
    assert "unavailable: KeyError" in html_path.read_text()
    assert json_path == tmp_path / "_quality" / "examples" / "7" / "report.json"


def test_plots_leave_no_pyplot_figure_open_even_when_one_fails():
    # pyplot keeps every figure it made until closed: a daemon validating thousands of versions would grow.
    import matplotlib.pyplot as plt

    before = set(plt.get_fignums())
    good = pa.table({"domain": ["facebook", "instagram"], "event_date": ["2023-11-14"] * 2, "seq_length": [3, 5],
                     "label_click": [1, 0], "f": [0.5, 1.5]})
    broken = pa.table({"domain": ["facebook"], "event_date": ["2023-11-14"]})
    drawn = [draw_plots("examples", data, report={"table_version": 1, "profile": {"num_rows": 2}}) for data in (good, broken)]
    assert not drawn[0]["Sequence length"].startswith("unavailable")
    assert drawn[1]["Sequence length"].startswith("unavailable")
    assert set(plt.get_fignums()) == before


def test_source_metadata_names_the_metadata_of_the_version_asked_not_the_newest(tmp_path):
    import pyarrow as pa

    from gemline.lake import commit_once
    from validation.report import source_metadata

    lake = str(tmp_path / "lake")
    for batch in range(4):
        commit_once(lake, "t", pa.table({"x": [batch]}), app_id="ingest", version=batch,
                    metadata={"batch": batch})
    assert [source_metadata(lake, "t", v)["batch"] for v in range(4)] == [0, 1, 2, 3]
    assert source_metadata(lake, "t", 7) is None, "a version past the newest has no commit"


def test_source_metadata_from_the_version_log_entry_equals_the_history(tmp_path):
    from deltalake import write_deltalake

    from gemline.lake import commit_once
    from validation.report import source_metadata, source_metadata_from_history

    rows = pa.table({"x": [1, 2]})
    commit_once(tmp_path, "t", rows, app_id="a", version=0, metadata={"offset_ranges": [[0, 0, 2]]})
    write_deltalake(str(tmp_path / "t"), rows, mode="append")  # written outside commit_once: no gemline metadata
    commit_once(tmp_path, "t", rows, app_id="a", version=1, metadata={"events_version": 7})
    got = [source_metadata(tmp_path, "t", v) for v in range(4)]
    assert got == [source_metadata_from_history(tmp_path, "t", v) for v in range(4)]
    assert got == [{"offset_ranges": [[0, 0, 2]], "app_id": "a", "txn_version": 0}, None,
                   {"events_version": 7, "app_id": "a", "txn_version": 1}, None]
    assert source_metadata(tmp_path, "missing", 0) is None  # version 3 above and this: no log entry, the history
