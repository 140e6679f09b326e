"""The demo stops before the build when the events gate refuses it (the stages themselves are stubbed)."""

from __future__ import annotations

import json
import types
from pathlib import Path

from rich.console import Console

import gemline.demo as demo
import ingest.datasets
import ingest.pipeline
import ingest.replay
import sequences.pipeline
import validation.run
from gemline.config import GemlineConfig
from gemline.gate import GateClosedError, GateDecision


class _NoBroker:
    bootstrap = "127.0.0.1:1"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_demo_stops_at_the_events_gate(tmp_path, monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(demo, "EmbeddedBroker", _NoBroker)
    monkeypatch.setattr(ingest.datasets, "load_records", lambda *a, **k: list(range(6)))
    monkeypatch.setattr(ingest.replay, "replay", lambda *a, **k: None)
    monkeypatch.setattr(ingest.pipeline, "run_ingest", lambda *a, **k: types.SimpleNamespace(
        events_written=5, dead_letter_written=1, skipped=False))

    def validate(config, table, version=None, **kwargs):
        calls.append(("validate", table))
        return types.SimpleNamespace(table=table, table_version=2, passed=False, report_html="r.html")

    refused = GateDecision("events", 2, False, "events@2 is quarantined: critical expectations failed: unique:event_id")

    def build(*args, **kwargs):
        calls.append(("build",))
        raise GateClosedError(refused, "build")

    monkeypatch.setattr(validation.run, "validate_table", validate)
    monkeypatch.setattr(sequences.pipeline, "run_build", build)
    console = Console(record=True, width=400)
    summary = demo.run_demo(GemlineConfig(lake=str(tmp_path)), console=console, increments=1)

    assert calls == [("validate", "events"), ("build",)]  # no examples validation, no training
    # MovieLens is from 1997: the demo lowers ingest.min_event_time_ms (default 2000-01-01) and says so.
    assert [r.getMessage() for r in caplog.records if r.name == "gemline.demo" and r.levelname == "WARNING"] == [
        f"ingest.min_event_time_ms=946684800000 is overridden at run time: using {ingest.datasets.EARLIEST_EVENT_MS['movielens']}, "
        "the earliest event of movielens (else its events would be dead-lettered as too_early_event_time)"]
    assert (summary["quality_passed"], summary["examples"], summary["auc"]) == (False, None, None)
    text = console.export_text()
    assert ("build refused: events@2 is quarantined: critical expectations failed: unique:event_id; inspect it "
            "(`gemline report --table events --version 2`), then `gemline quality release 2 --table events "
            '--reason "..."` to let it through') in text
    saved = json.loads(Path(summary["summary_path"]).read_text())
    assert saved["quality_reports"]["events"] == {"version": 2, "passed": False, "report_html": "r.html"}


def test_demo_names_an_undefined_auc_instead_of_printing_nan(tmp_path, monkeypatch):
    import math

    import trainer.train

    monkeypatch.setattr(demo, "EmbeddedBroker", _NoBroker)
    monkeypatch.setattr(ingest.datasets, "load_records", lambda *a, **k: list(range(5)))
    monkeypatch.setattr(ingest.replay, "replay", lambda *a, **k: None)
    monkeypatch.setattr(ingest.pipeline, "run_ingest", lambda *a, **k: types.SimpleNamespace(
        events_written=5, dead_letter_written=0, skipped=False))
    monkeypatch.setattr(validation.run, "validate_table", lambda config, table, version=None, **k: types.SimpleNamespace(
        table=table, table_version=1, passed=True, report_html="r.html"))
    monkeypatch.setattr(sequences.pipeline, "run_build", lambda *a, **k: types.SimpleNamespace(
        num_examples=40, seq_length_p50=3, seq_length_p99=9, examples_version=1))
    overall = {"auc": math.nan, "ne": math.nan, "calibration": math.nan, "base_rate": 0.0, "count": 40,
               "undefined": {"auc": "no positive labels among 40 examples"}}
    metrics = {"click": {"overall": overall, "by_domain": {"movielens": overall}}}
    monkeypatch.setattr(trainer.train, "run_training", lambda *a, **k: types.SimpleNamespace(
        metrics=metrics, eval_date="2026-01-02", train_examples=30, eval_examples=10, checkpoint_path="ck"))
    console = Console(record=True, width=400)
    summary = demo.run_demo(GemlineConfig(lake=str(tmp_path)), console=console, increments=1)
    assert summary["auc"] is None and summary["ne"] is None
    text = console.export_text()
    assert "nan" not in text.lower().replace("nanoseconds", "")
    assert "click auc is undefined on the eval day 2026-01-02: no positive labels among 40 examples" in text
    saved = Path(summary["summary_path"]).read_text()
    assert json.loads(saved)["auc"] is None
    assert "NaN" not in saved, "strict JSON: a NaN inside per_domain is written as null"


def test_demo_increments_split_the_records_in_order_and_train_continuously(tmp_path, monkeypatch):
    import trainer.continuous
    import trainer.train

    replayed, builds, consumed = [], [], []
    monkeypatch.setattr(demo, "EmbeddedBroker", _NoBroker)
    monkeypatch.setattr(ingest.datasets, "load_records", lambda *a, **k: list(range(10)))
    monkeypatch.setattr(ingest.replay, "replay", lambda records, **k: replayed.append(list(records)))
    monkeypatch.setattr(ingest.pipeline, "run_ingest", lambda *a, **k: types.SimpleNamespace(
        events_written=3, dead_letter_written=0, skipped=False))
    monkeypatch.setattr(validation.run, "validate_table", lambda config, table, version=None, **k: types.SimpleNamespace(
        table=table, table_version=version or 0, passed=True, report_html="r.html"))

    def build(lake, config, beam_args=None, final=False):
        builds.append(final)
        return types.SimpleNamespace(num_examples=10, seq_length_p50=1, seq_length_p99=2,
                                     examples_version=len(builds))

    def once(lake, tc, from_scratch=False, on_predictions=None):
        consumed.append(from_scratch)
        version = len(builds)
        rows = [] if version == 1 else [{"examples_version": version, "rows": 7, "auc": 0.6, "ne": 0.9}]
        return types.SimpleNamespace(progressive=rows, report_path="report.html")

    monkeypatch.setattr(sequences.pipeline, "run_build", build)
    monkeypatch.setattr(trainer.continuous, "run_once", once)
    monkeypatch.setattr(trainer.train, "run_training", lambda *a, **k: types.SimpleNamespace(
        metrics={"click": {"overall": {"auc": 0.7, "ne": 0.8, "calibration": 1.0}, "by_domain": {}}},
        eval_date="d", train_examples=1, eval_examples=1, checkpoint_path="ck"))
    summary = demo.run_demo(GemlineConfig(lake=str(tmp_path)), console=Console(record=True, width=300),
                            increments=3)
    assert replayed == [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]]  # event-time order kept, every record once
    assert builds == [False, False, True]  # only the last build closes every attribution window
    assert consumed == [True, False, False]
    assert summary["progressive"] == [{"increment": 2, "examples_version": 2, "rows": 7, "auc": 0.6, "ne": 0.9},
                                      {"increment": 3, "examples_version": 3, "rows": 7, "auc": 0.6, "ne": 0.9}]
    assert summary["events_ingested"] == 9 and summary["auc"] == 0.7
    saved = json.loads(Path(summary["summary_path"]).read_text())
    assert saved["progressive"] == summary["progressive"]


def test_demo_prints_the_students_and_the_teachers_inference_rates():
    summary = {"run_id": "r", "dataset": "d", "events_in": 1, "events_ingested": 1, "dead_letter": 0, "examples": 1,
               "seq_len_p50": 1, "seq_len_p99": 1, "quality_passed": True, "eval_date": None, "auc": None, "ne": None,
               "calibration": None, "wall_seconds": 1.0, "quality_reports": {}, "summary_path": "s.json",
               "distill": {"report": "distill.html", "versions": [], "click": [
                   {"domain": "obd_men", "variant": "alone", "rows": 10, "ne": 1.0, "auc": 0.5, "calibration": 1.0,
                    "transfer_ratio": None}],
                   "inference": {"rows": 10, "batch_size": 4, "threads": 1, "teacher_model": "gem", "teacher": 7922.4,
                                 "students": {"alone": 1_110_000.0, "aux_head": 1_412_345.6}}}}
    console = Console(record=True, width=400)
    demo._print_summary(console, summary)
    text = console.export_text()
    assert "CPU inference, examples/s: teacher (gem) 7,922; students alone 1,110,000, aux_head 1,412,346" in text
    assert "undefined" in text
