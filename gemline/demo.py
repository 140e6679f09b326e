"""`gemline demo`: the whole path on one machine, on a real dataset.

broker (embedded unless kafka.bootstrap is set) -> replay -> ingest -> validate events ->
build -> validate examples -> train on all days but the last -> evaluate on the last ->
a summary table, also written to ``LAKE/_runs/<run_id>/summary.json``.

The demo topic is ``<kafka.topic>.<dataset>`` (plus ``.limit<N>``): replay is deterministic, so a
second demo against the same lake finds the same offsets already committed and ingests nothing,
which is the exactly-once contract at work rather than a special case.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from gemline.config import GemlineConfig
from gemline.lake import Lake, is_remote, lake_fs
from gemline.tables import Table as LakeTable
from ingest.broker import EmbeddedBroker
from ingest.datasets import EARLIEST_EVENT_MS
from sequences.config import MS_PER_DAY
from trainer.metrics import describe_undefined, nan_to_none

log = logging.getLogger(__name__)


def _demo_topic(config: GemlineConfig, dataset: str, limit: int | None) -> str:
    return f"{config.kafka.topic}.{dataset}" + (f".limit{limit}" if limit is not None else "")


def run_demo(
    config: GemlineConfig,
    *,
    dataset: str = "movielens",
    path: str | None = None,
    limit: int | None = None,
    beam_args: list[str] | None = None,
    console: Console | None = None,
    nproc: int = 1,
    increments: int = 6,
    on_predictions: Any = None,
) -> dict[str, Any]:
    """Run every stage once and return the summary dict (also written as summary.json).

    Keys: run_id, dataset, events_in, events_ingested, dead_letter, examples, seq_len_p50,
    seq_len_p99, quality_passed, quality_reports, auc, ne, calibration, eval_date, summary_path.

    ``increments`` > 1 splits the dataset's records, in event-time order, into that many parts of equal
    size; each is replayed, ingested, validated, built, validated and consumed by a continuous training run
    (``trainer.continuous.run_once``: evaluated on each new examples version before training on it), and
    ``summary["progressive"]`` lists ``{"increment", "examples_version", "rows", "auc", "ne"}`` per
    evaluated version. The one-shot run on all days but the last follows on the final version either way.

    ``on_predictions`` (a ``trainer.continuous.PredictionsHook``) sees each progressive evaluation's predictions.

    ``nproc`` > 1 trains through torchrun with that many local processes
    (trainer.launch.train_with_torchrun; ``trainer.model`` gem, dlrm or ranker).

    When the events gate refuses the build (gemline.gate.GateClosedError: the ingested events
    are quarantined), the demo stops there with ``quality_passed`` False and ``examples`` None,
    after printing the refusal and the release command.

    Raises:
        ValueError: an unknown dataset, or a dataset that needs ``path`` without one.
    """
    from gemline.gate import GateClosedError
    from ingest.datasets import load_records
    from ingest.pipeline import run_ingest, uses_beam
    from ingest.replay import replay
    from sequences.pipeline import run_build
    from trainer.continuous import run_once
    from trainer.train import run_training
    from validation.run import QualityResult, validate_table

    console = console or Console()
    run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    topic = _demo_topic(config, dataset, limit)
    config = dataclasses.replace(config, kafka=dataclasses.replace(config.kafka, topic=topic))
    floor = EARLIEST_EVENT_MS.get(dataset)
    if floor is not None and floor < config.ingest.min_event_time_ms:  # MovieLens is from 1997-98
        log.warning("ingest.min_event_time_ms=%d is overridden at run time: using %d, the earliest event of %s "
                    "(else its events would be dead-lettered as too_early_event_time)",
                    config.ingest.min_event_time_ms, floor, dataset)
        config = dataclasses.replace(config, ingest=dataclasses.replace(config.ingest, min_event_time_ms=floor))
    config = _dataset_windows(config, dataset)
    remote = is_remote(config.lake)
    if not remote:
        Path(config.lake).mkdir(parents=True, exist_ok=True)
    lake_name = str(config.lake) if remote else str(Path(config.lake).resolve())
    summary: dict[str, Any] = {"run_id": run_id, "dataset": dataset, "lake": lake_name}
    lake = Lake.for_config(config)

    def validate(table: str, version: int | None = None) -> QualityResult:
        return validate_table(lake, table, version, validation=config.validation, ingest=config.ingest,
                              build=config.build)
    started = time.monotonic()

    with contextlib.ExitStack() as stack:
        bootstrap = config.kafka.bootstrap
        if bootstrap is None:
            broker = stack.enter_context(EmbeddedBroker())
            bootstrap = broker.bootstrap
            console.print(f"[bold]broker[/] embedded tansu at {bootstrap}")
        else:
            console.print(f"[bold]broker[/] {bootstrap}")

        records = load_records(dataset, path=path, limit=limit, progress=True)
        summary["events_in"] = len(records)
        summary.update({"events_ingested": 0, "dead_letter": 0, "examples": None, "seq_len_p50": None,
                        "seq_len_p99": None, "auc": None, "ne": None, "calibration": None, "eval_date": None,
                        "progressive": []})
        reports: dict[str, Any] = {}
        parts = _increments(len(records), increments)
        # A fresh embedded broker holds a new topic: a lake that already read this demo topic starts over on it
        # deliberately (what it already holds comes back as duplicates and is dropped).
        reset = bootstrap != config.kafka.bootstrap and _has_offsets(config)
        built = events_quality = examples_quality = None
        validated_examples = None
        engine = "Beam" if uses_beam(config.ingest, beam_args) else "in process"
        for k, (lo, hi) in enumerate(parts):
            label = f"increment {k + 1}/{len(parts)}" if len(parts) > 1 else dataset
            console.rule(f"{label}: replay {hi - lo} records -> {topic}, ingest ({engine})")
            replay(records[lo:hi], bootstrap=bootstrap, topic=topic, partitions=config.kafka.partitions,
                   batch_messages=config.kafka.producer_batch_messages)
            ingested = run_ingest(lake, config.kafka, config.ingest, bootstrap=bootstrap, beam_args=beam_args,
                                  reset_topic=reset)
            reset = False
            summary["events_ingested"] += ingested.events_written
            summary["dead_letter"] += ingested.dead_letter_written
            summary["ingest_skipped"] = ingested.skipped
            if ingested.skipped:
                console.print("ingest: every offset of this topic is already in the lake; nothing added")
            events_quality = validate(LakeTable.EVENTS)
            reports[LakeTable.EVENTS] = _quality_line(console, events_quality)
            final = k == len(parts) - 1  # a bounded replay: the last build closes every attribution window
            try:
                built = run_build(lake, config.build, beam_args=beam_args, final=final)
            except GateClosedError as exc:
                # The events gate holds the build: nothing is built or trained on quarantined events.
                console.print(str(exc), style="red", markup=False)
                summary["quality_passed"] = False
                summary["quality_reports"] = reports
                return _finish(config, console, run_id, summary, started)
            if built.examples_version is None or built.examples_version == validated_examples:
                continue
            examples_quality = validate(LakeTable.EXAMPLES, built.examples_version)
            reports[LakeTable.EXAMPLES] = _quality_line(console, examples_quality)
            validated_examples = built.examples_version
            if len(parts) > 1:
                consumed = run_once(lake, config.trainer, from_scratch=k == 0, on_predictions=on_predictions)
                for row in consumed.progressive:
                    summary["progressive"].append({"increment": k + 1, **row})
                    console.print(f"progressive: examples@{row['examples_version']} ({row['rows']} rows) evaluated "
                                  f"before training on it: click AUC {_fmt(row['auc'])}, NE {_fmt(row['ne'])}")
                summary["continuous_report"] = consumed.report_path
        assert built is not None and events_quality is not None
    if len(parts) > 1 and summary.get("continuous_report") and _teacher_logged(config):
        summary["distill"] = _distill(lake, config, console)
    summary["examples"] = built.num_examples
    summary["seq_len_p50"] = built.seq_length_p50
    summary["seq_len_p99"] = built.seq_length_p99
    if examples_quality is None:
        examples_quality = validate(LakeTable.EXAMPLES, built.examples_version)
        reports[LakeTable.EXAMPLES] = _quality_line(console, examples_quality)
    summary["quality_passed"] = bool(events_quality.passed and examples_quality.passed)
    summary["quality_reports"] = reports

    if examples_quality.passed:
        console.rule("train (TorchRec) on all days but the last; evaluate on the last")
        if nproc > 1:
            from trainer.launch import train_with_torchrun

            trained = train_with_torchrun(lake, config.trainer, nproc, examples_version=built.examples_version)
        else:
            trained = run_training(config.trainer, lake, examples_version=built.examples_version)
        if trained is None:  # only a launcher that did not host rank 0 gets None; the demo launches all ranks
            raise RuntimeError("demo: the sharded run returned no result (rank 0 ran elsewhere?)")
        click = nan_to_none(trained.metrics["click"]["overall"])  # summary.json is JSON: no NaN
        for line in describe_undefined(trained.metrics, scope=f"eval day {trained.eval_date}"):
            console.print(f"[yellow]{line}[/]")
        summary.update(
            auc=click["auc"], ne=click["ne"], calibration=click["calibration"], eval_date=trained.eval_date,
            train_examples=trained.train_examples, eval_examples=trained.eval_examples,
            per_domain=trained.metrics["click"]["by_domain"],
            checkpoint=str(trained.checkpoint_path),
        )
    else:
        console.print(f"[red]examples@{built.examples_version} quarantined: not trained on[/]")
    return _finish(config, console, run_id, summary, started)


DATASET_WINDOWS_MS: dict[str, tuple[int, int]] = {
    "openbandit": (3_600_000, 3_600_000),
    "taobao": (MS_PER_DAY, MS_PER_DAY),
}
"""The demo's attribution windows (click, conversion; ms) of the datasets whose span the defaults (1 day, 7 days)
do not fit. Open Bandit logs its click with its round, has no conversion and spans 7 days: the 7-day window
would hold every example back to the last increment, leaving the continuous run (and its students) nothing to
evaluate. The Taobao UserBehavior sample spans 9 days (2017-11-25 to 12-03, China time): under the 7-day
conversion window a ``wait`` build publishes nothing until the 7th day, so the progressive protocol scored 92% of
the rows with a model trained on the first 1.2 days' 6,309, and only the first 2 days' impressions (15,803 of
75,872) ever had a closed window. One day keeps 840 of the 918 buys (92%) that follow a view of the same item within 7 days (carts: the
click window is 1 day either way) and publishes each increment 1 day after its events (README, "Comparing models
on the progressive protocol")."""


def _dataset_windows(config: GemlineConfig, dataset: str) -> GemlineConfig:
    """``config`` with the build's attribution windows of :data:`DATASET_WINDOWS_MS` for ``dataset``, where it keeps
    the default windows (a window set in the file or by --set stays)."""
    windows = DATASET_WINDOWS_MS.get(dataset)
    defaults = type(config.build)()
    if windows is None or (config.build.click_window_ms, config.build.conversion_window_ms) != (
            defaults.click_window_ms, defaults.conversion_window_ms):
        return config
    click_ms, conversion_ms = windows
    log.warning("demo: %s gets its own attribution windows: build.click_window_ms=%d, build.conversion_window_ms=%d "
                "(set either to keep your own)", dataset, click_ms, conversion_ms)
    return dataclasses.replace(config, build=dataclasses.replace(config.build, click_window_ms=click_ms,
                                                                 conversion_window_ms=conversion_ms))


def _increments(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` consecutive [lo, hi) index ranges of equal size (+-1) covering ``n`` records.

    Raises:
        ValueError: ``parts < 1``.
    """
    if parts < 1:
        raise ValueError(f"demo: expected increments >= 1, got {parts}")
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo] or [(0, n)]


def _distill(lake: Lake, config: GemlineConfig, console: Console) -> dict[str, Any]:
    """New per-domain students (trainer.distill) over every version the continuous teacher consumed: the click rows
    of their report's summary (per domain and variant, with the transfer ratio) and the report's path."""
    from trainer.distill import run_distill_once

    console.rule("distill: per-domain students learn from the labels and the teacher's logged predictions")
    result = run_distill_once(lake, config.trainer, config.distill, from_scratch=True)
    assert result.report is not None
    click = [r for r in result.report["summary"] if r["task"] == "click"]
    return {"report": result.report_path, "click": click, "versions": result.versions,
            "inference": result.report.get("inference")}


def _teacher_logged(config: GemlineConfig) -> bool:
    """Whether the continuous teacher logged predictions (``teacher_predictions`` exists): students need them,
    and a teacher that is not GEM or has ``trainer.log_teacher_predictions`` off logs none."""
    from gemline.lake import open_table

    return open_table(config.lake, LakeTable.TEACHER_PREDICTIONS, storage_options=config.lake_storage_options) is not None


def _has_offsets(config: GemlineConfig) -> bool:
    from gemline.lake import committed_version
    from ingest.pipeline import app_id_for

    return committed_version(config.lake, LakeTable.EVENTS, app_id_for(config.kafka.topic),
                             storage_options=config.lake_storage_options) is not None


def _finish(config: GemlineConfig, console: Console, run_id: str, summary: dict[str, Any],
            started: float) -> dict[str, Any]:
    """Add the wall time and the summary path to ``summary``, write and print it; return it."""
    summary["wall_seconds"] = round(time.monotonic() - started, 1)
    summary["summary_path"] = _write_summary(config, run_id, summary)
    _print_summary(console, summary)
    return summary


def _write_summary(config: GemlineConfig, run_id: str, summary: dict[str, Any]) -> str:
    """Write ``LAKE/_runs/<run_id>/summary.json`` (through ``lake_fs`` on an object store); its path or URI."""
    from trainer.metrics import nan_to_none

    text = json.dumps(nan_to_none(summary), indent=2, default=str, allow_nan=False)
    if is_remote(config.lake):
        fs, root = lake_fs(config.lake, config.lake_storage_options)
        with fs.open_output_stream(f"{root}/_runs/{run_id}/summary.json") as out:
            out.write(text.encode("utf-8"))
        return f"{str(config.lake).rstrip('/')}/_runs/{run_id}/summary.json"
    out = Path(config.lake) / "_runs" / run_id / "summary.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return str(out)


def _quality_line(console: Console, result: Any) -> dict[str, Any]:
    verdict = "PASSED" if result.passed else "QUARANTINED"
    colour = "green" if result.passed else "red"
    console.print(f"{result.table}@{result.table_version}: [{colour}]{verdict}[/]  report: {result.report_html}")
    return {"version": result.table_version, "passed": result.passed, "report_html": str(result.report_html)}


def _fmt(value: Any) -> str:
    if value is None:
        return "undefined (see above)"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.4f}"
    return str(value)


def _print_summary(console: Console, summary: dict[str, Any]) -> None:
    table = Table(title=f"gemline demo {summary['run_id']} ({summary['dataset']})", show_header=False)
    rows = [
        ("events in (replayed)", summary["events_in"]),
        ("events ingested", summary["events_ingested"]),
        ("dead-lettered", summary["dead_letter"]),
        ("examples", summary["examples"]),
        ("sequence length p50 / p99", f"{summary['seq_len_p50']} / {summary['seq_len_p99']}"),
        ("quality verdict", "PASSED" if summary["quality_passed"] else "QUARANTINED"),
        ("eval day", summary["eval_date"]),
        ("AUC (click, eval day)", summary["auc"]),
        ("NE (click, eval day)", summary["ne"]),
        ("calibration (click)", summary["calibration"]),
        ("wall time (s)", summary["wall_seconds"]),
    ]
    for name, value in rows:
        table.add_row(name, _fmt(value))
    console.print(table)
    if summary.get("progressive"):
        prog = Table(title="continuous training: each examples version evaluated before training on it")
        for column in ("increment", "examples version", "rows", "click AUC", "click NE"):
            prog.add_column(column, justify="right")
        for row in summary["progressive"]:
            prog.add_row(str(row["increment"]), str(row["examples_version"]), str(row["rows"]), _fmt(row["auc"]),
                         _fmt(row["ne"]))
        console.print(prog)
        console.print(f"continuous run report: {summary.get('continuous_report')}")
    if summary.get("distill"):
        students = Table(title="distillation (click, rows with a teacher prediction, progressive, pooled over versions)",
                         caption="transfer ratio = (NE alone - NE variant) / (NE alone - NE teacher); undefined where "
                                 "the teacher's NE is not below the student alone's")
        for column in ("domain", "variant", "rows", "NE", "AUC", "calibration", "transfer ratio"):
            students.add_column(column, justify="right", no_wrap=column in ("domain", "variant"))
        for row in summary["distill"]["click"]:
            students.add_row(row["domain"], row["variant"], str(row["rows"]), _fmt(row["ne"]), _fmt(row["auc"]),
                             _fmt(row["calibration"]),
                             "undefined" if row["transfer_ratio"] is None else _fmt(row["transfer_ratio"]))
        console.print(students)
        rates = summary["distill"].get("inference")
        if rates:
            per_student = ", ".join(f"{v} {r:,.0f}" for v, r in rates["students"].items())
            console.print(f"CPU inference, examples/s: teacher ({rates['teacher_model']}) {rates['teacher']:,.0f}; "
                          f"students {per_student}")
        console.print(f"distill report: {summary['distill']['report']}")
    for name, report in summary["quality_reports"].items():
        console.print(f"quality report {name}@{report['version']}: {report['report_html']}")
    console.print(f"summary: {summary['summary_path']}")
