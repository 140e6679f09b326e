"""Validate one Delta version of a table: suite, drift, reports, ``quality`` rows; and find the latest report.

    read table@version -> suite (validation.suites / validation.build_suites)
                       -> events only: dead-letter rate of the ingest batch (validation.dead_letter)
                       -> profile of the batch, drift against the previous K passed batches
                          (validation.profiles; profile appended to ``quality_profiles``)
                       -> report.json/html (validation.report)
                       -> one quality row per check (gemline.gate) -> QualityResult

``events`` and ``examples`` are append-only, and a version is judged on the rows it added: ``examples`` on the
rows of that one version; ``events`` on the rows of every version since the newest one validated before it
(so validating the newest version covers the never-validated ones in between, as the gate and the build
expect), with the event ids they may repeat looked up among the earlier rows. The first validation, or one
after a commit that removed files, reads the whole table. The batch profiled for ``events`` is the ingest
batch of that version (the rows of its commit's Kafka offset ranges); the other tables are rebuilt whole by
each build, so the batch is the table.

Validating the same version again appends a second run to ``quality``; the gate reads the newest.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from tqdm import tqdm

from gemline.errors import BadConfigError, MissingInputError
from gemline.gate import append_quality_rows, last_validated_before
from gemline.increments import Cursor, read_from, read_increment, rows_added, table_id
from gemline.lake import Lake, commit_version_of, lake_fs, open_table, read_table
from gemline.tables import Table
from ingest.config import IngestConfig
from sequences.config import BuildConfig
from sequences.history_tail import HistoryTail
from sequences.materialize import read_history
from sequences.pointer_summaries import PointerSummaries
from validation.build_suites import FEATURE_VIEWS, validate_features, validate_sequences
from validation.config import ValidationConfig
from validation.dead_letter import dead_letter_checks, in_ranges
from validation.pointer_checks import Summaries, checks_from_summaries, pointer_sequence_checks, summary_checks
from validation.profiles import append_profile, drift_checks, profile_batch, profile_history
from validation.report import PASSED, build_report, report_dir, source_metadata, verdict, write_report
from validation.session import SeenEventIds, ValidationSession
from validation.suites import SEQUENCE_TIME_COLUMN, CheckResult, validate_events, validate_examples

VALIDATED_TABLES: tuple[str, ...] = (Table.EVENTS, Table.SEQUENCES, Table.EXAMPLES, *FEATURE_VIEWS)


@dataclass(frozen=True)
class QualityResult:
    """Outcome of one validation run of ``table@table_version``.

    ``passed`` is True when no critical check failed; ``failures`` lists every failed check
    (critical and warning) as (expectation, severity, observed).
    """

    table: str
    table_version: int
    passed: bool
    num_rows: int
    failures: list[tuple[str, str, str]]
    report_json: Path | str
    report_html: Path | str


def _run_suite(validation: ValidationConfig, ingest: IngestConfig, build: BuildConfig, table: str, data,
               now_ms: int, sequence_checks: dict | None = None, earlier: pa.Table | None = None) -> list[CheckResult]:
    bounds: dict[str, Any] = dict(
        domains=ingest.domains,
        min_time_ms=validation.min_event_time_ms,
        max_time_ms=now_ms + validation.max_future_skew_ms,
    )
    sample_rows = validation.gx_sample_rows
    if table == Table.EVENTS:
        return validate_events(data, **bounds, sample_rows=sample_rows, dedup_window_ms=ingest.dedup_window_ms,
                               earlier=earlier, empty_severity="critical" if earlier is None else "warning")
    if table == Table.SEQUENCES:
        return validate_sequences(data, max_seq_len=build.max_seq_len, min_time_ms=bounds["min_time_ms"],
                                  max_time_ms=bounds["max_time_ms"], sample_rows=sample_rows)
    if table in FEATURE_VIEWS:
        return validate_features(data, table, **bounds, sample_rows=sample_rows)
    return validate_examples(
        data,
        **bounds,
        max_seq_len=build.max_seq_len,
        min_label_rate=validation.min_label_rate,
        max_label_rate=validation.max_label_rate,
        sample_rows=sample_rows,
        empty_severity="warning" if table in INCREMENTAL else "critical",
        sequence_checks=sequence_checks,
    )


def _batch_dead_letters(lake: Lake, source: dict) -> pa.Table | None:
    """The ``dead_letter`` rows (partition, offset) of the ingest batch that committed this events version: the
    dead-letter commit of the same app transaction (ingest commits dead letters, then late events, then events,
    under one (app_id, batch) pair). Offsets alone would also match an earlier broker's records at the same
    offsets, after a ``--reset-topic`` (a restarted embedded broker numbers from 0 again). A commit from before
    the app transaction was recorded in the metadata falls back to the whole table."""
    columns = ["kafka_partition", "kafka_offset"]
    app_id, txn = source.get("app_id"), source.get("txn_version")
    if app_id is None or txn is None:
        return read_table(lake.root, Table.DEAD_LETTER, columns=columns, storage_options=lake.delta_options)
    version = commit_version_of(lake.root, Table.DEAD_LETTER, app_id, int(txn), storage_options=lake.delta_options)
    if version is None:
        return None  # the batch had no dead letters: its empty part was not committed
    return rows_added(lake.root, Table.DEAD_LETTER, version, columns=columns, storage_options=lake.delta_options)


def _batch(lake: Lake, validation: ValidationConfig, table: str, data,
           source: dict | None) -> tuple[object, list[CheckResult]]:
    """(the batch to profile, the dead-letter checks): for ``events``, the rows of the commit's offset ranges."""
    ranges = (source or {}).get("offset_ranges")
    if table != Table.EVENTS or not ranges or "kafka_offset" not in data.column_names:
        return data, []
    batch = in_ranges(data, ranges)
    dead = _batch_dead_letters(lake, source or {})
    num_dead = 0 if dead is None else in_ranges(dead, ranges).num_rows
    checks = dead_letter_checks(batch.num_rows, num_dead, warning_rate=validation.dead_letter_warning_rate,
                                critical_rate=validation.dead_letter_critical_rate,
                                min_records=validation.dead_letter_min_records)
    return batch, checks


def _pointer_checks(lake: Lake, build: BuildConfig, table: str, data: pa.Table, tail: HistoryTail | None = None,
                    index: PointerSummaries | None = None) -> tuple[dict | None, list[CheckResult]]:
    """For pointer-layout ``examples`` rows (no list columns, ``build.examples_layout = "pointer"``): the
    suite's sequence checks computed exactly on the pointers and ``history`` without materializing the
    lists (:mod:`validation.pointer_checks`), and the ``pointers_materialize`` result; (None, []) otherwise.
    ``index``: a long-running validator's summaries kept with ``history`` (first choice); ``tail``: its history
    (read by increments, compacted); neither: the users' whole history."""
    if table != Table.EXAMPLES or SEQUENCE_TIME_COLUMN in data.column_names:
        return None, []
    if index is not None:
        def summarize() -> Summaries:
            cross, same = index.summarize(data)
            return {"seq_": cross, "seq_same_domain_": same}

        return summary_checks(data, summarize)
    if tail is None:
        return pointer_sequence_checks(data, read_history(lake.root, data.column("user_id"),
                                                          storage_options=lake.delta_options), build)
    history, cut = tail.history_for(data)
    return pointer_sequence_checks(data, history, build, cut)


INCREMENTAL = (Table.EXAMPLES,)
"""Tables validated on the rows each version added rather than the whole table at that version."""

_MS_PER_DAY = 86_400_000


def _event_dates(min_ms: int, max_ms: int) -> list[str]:
    """Every UTC ``event_date`` (``YYYY-MM-DD``) from the day of ``min_ms`` to that of ``max_ms``, ms since epoch."""
    days = np.arange(min_ms // _MS_PER_DAY, max_ms // _MS_PER_DAY + 1).astype("datetime64[D]")
    return [str(d) for d in days]


def _events_increment(lake: Lake, version: int, window_ms: int, since: int | None,
                      seen: SeenEventIds | None = None) -> tuple[pa.Table, pa.Table] | None:
    """(the rows ``events`` gained after the newest version validated before ``version``, up to ``version``;
    the (event_id, event_time_ms) of the rows before them that they may repeat: same id, event date within
    ``window_ms`` of theirs), or None when the whole table must be judged: no earlier version was validated
    (``since``, the newest version validated before ``version``, is None), or a commit since then removed files
    (an overwrite or a compaction: new rows may sit in rewritten files).

    The earlier rows are read as the ingest job's dedup reads them (``event_date`` partitions, then the ids):
    two columns of the recent days, not the table; not at all when ``seen`` (a session's hashes of the ids of
    ``events@since``) shows that none of the new ids is among them.
    """
    root, opts = lake.root, lake.delta_options
    if since is None:
        return None
    if any(read_increment(root, Table.EVENTS, v, storage_options=opts).removed for v in range(since + 1, version + 1)):
        return None
    tid = table_id(root, Table.EVENTS, storage_options=opts)
    assert tid is not None, "validate_table opened the table"
    batches = [b for _, b, _ in read_from(root, Table.EVENTS, Cursor(tid, since + 1), until_version=version,
                                          storage_options=opts) if b is not None]
    if batches:
        new = pa.Table.from_batches(batches)
    else:  # versions without new rows (a metadata change): nothing to judge but the schema
        dt = open_table(root, Table.EVENTS, version, storage_options=opts)
        assert dt is not None
        new = pa.schema(dt.schema().to_arrow()).empty_table()
    times, ids = new["event_time_ms"].drop_null(), pc.unique(new["event_id"].drop_null())
    pair = pa.schema([("event_id", pa.string()), ("event_time_ms", pa.int64())])
    if len(times) == 0 or len(ids) == 0:
        return new, pair.empty_table()
    lo, hi = pc.min(times).as_py() - window_ms, pc.max(times).as_py() + window_ms
    dates = _event_dates(lo, hi)
    if seen is not None and seen.none_of(ids, dates, since):
        return new, pair.empty_table()
    before = open_table(root, Table.EVENTS, since, storage_options=opts)
    if before is None:
        return new, pair.empty_table()
    wanted = (pc.field("event_date").isin(dates) & pc.field("event_id").isin(ids)
              & (pc.field("event_time_ms") >= lo) & (pc.field("event_time_ms") <= hi))
    earlier = before.to_pyarrow_dataset().to_table(columns=["event_id", "event_time_ms"], filter=wanted)
    return new, earlier.cast(pair)


def _remember_ids(lake: Lake, seen: SeenEventIds, since: int | None, version: int, data: pa.Table,
                  increment: bool, now_ms: int, window_ms: int) -> None:
    """Let ``seen`` cover ``events@version``: add an increment's rows to what covers ``events@since``; else
    (a whole table judged, a session's first increment, another validator's run in between) start again from
    the rows of ``events@version`` in the partitions that events of up to a day before ``now_ms`` look in."""
    if increment and since is not None and seen.version == since:
        seen.extend(since, version, data)
        return
    first_date = _event_dates(now_ms - _MS_PER_DAY - window_ms, now_ms)[0]
    if not increment:
        seen.reset(version, data, first_date)
        return
    dt = open_table(lake.root, Table.EVENTS, version, storage_options=lake.delta_options)
    assert dt is not None, "validate_table read this version"
    rows = dt.to_pyarrow_dataset().to_table(columns=["event_id", "event_date"],
                                            filter=pc.field("event_date") >= first_date)
    seen.reset(version, rows, first_date)


def validate_table(
    lake: Lake,
    table: str,
    version: int | None = None,
    *,
    validation: ValidationConfig,
    ingest: IngestConfig,
    build: BuildConfig,
    now_ms: int | None = None,
    plots: Literal["always", "quarantined"] = "always",
    history_tail: HistoryTail | None = None,
    session: ValidationSession | None = None,
) -> QualityResult:
    """Validate ``table`` at Delta ``version`` (latest when None) and record the outcome.

    ``examples`` (:data:`INCREMENTAL`) is judged on the rows that version added (none for a compaction: no
    drift checks then, and no profile appended); ``events`` on the rows added
    since the newest version validated before it (the whole table when none was, or a commit since removed
    files), its ``unique:event_id`` against the earlier rows too, plus the dead-letter rate of its ingest
    batch; the other tables on the whole table at that version.

    Args:
        lake: the lake of ``table``, the ``quality`` tables and the reports.
        table: one of :data:`VALIDATED_TABLES`.
        version: Delta version to validate; None takes the latest.
        validation: the bounds, label rates, dead-letter rates, drift settings and GX sample size.
        ingest: ``domains`` and ``dedup_window_ms`` (what ingest admitted is what is checked).
        build: ``max_seq_len`` (of ``sequences`` and ``examples``).
        now_ms: validation clock, ms since epoch UTC (upper bound of sane event times and the run's
            timestamp in ``quality``); None reads the wall clock.
        plots: draw the report's plots always, or only when the version is quarantined
            (``validate --follow``: ``ValidationConfig.follow_report_plots``).
        history_tail: pointer-layout ``examples`` only: the ``history`` a long-running validator keeps
            (``validate --follow``, :class:`sequences.history_tail.HistoryTail`, built with ``build``'s
            lengths); None reads the whole history of the version's users (or the session's tail).
        session: a long-running validator's :class:`validation.session.ValidationSession` (``validate
            --follow``): which version was validated last and the drift baseline come from its in-memory
            ``quality`` and ``quality_profiles``, brought up to date here, instead of whole reads of them; the
            outcome is the same. None reads the tables.

    Returns:
        The :class:`QualityResult`; its reports are under ``LAKE/_quality/<table>/<version>/``.

    Raises:
        BadConfigError: ``table`` has no suite, or ``version`` is not one of the table's.
        MissingInputError: the table does not exist.
    """
    if table not in VALIDATED_TABLES:
        raise BadConfigError(f"no quality suite for table {table!r}; expected one of {VALIDATED_TABLES}")
    ts = int(time.time() * 1000) if now_ms is None else now_ms
    root, opts = lake.root, lake.delta_options
    dt = open_table(root, table, storage_options=opts)
    if dt is None:
        raise MissingInputError(f"table {table!r} does not exist under lake {root!r}; run the stage that writes it first")
    latest = dt.version()
    table_version = latest if version is None else version
    if not 0 <= table_version <= latest:
        raise BadConfigError(f"{table}: version must be in [0, {latest}], got {table_version}")

    if session is not None:
        session.refresh()
        history_tail = history_tail or session.history_tail

    steps = tqdm(total=5, desc=f"validate {table}@{table_version}", unit="step")
    # examples is append-only: a version is judged on the rows it added (the increment a trainer consumes),
    # so the cost does not grow with the table and one bad build does not fail every later version.
    added = rows_added(root, table, table_version, storage_options=opts) if table in INCREMENTAL else None
    if table in INCREMENTAL and added is None:
        # A compaction (or metadata change) added no rows: its rows were judged in the versions that added them.
        # Judging it as the whole table (as before) cost O(table) per compaction and grew with the run.
        added = pa.schema(dt.schema().to_arrow()).empty_table()
    earlier, since = None, None
    if table == Table.EVENTS:
        since = (last_validated_before(root, Table.EVENTS, table_version, storage_options=opts) if session is None
                 else session.last_validated_before(Table.EVENTS, table_version))
        increment = _events_increment(lake, table_version, ingest.dedup_window_ms, since,
                                      None if session is None else session.events_ids)
        added, earlier = (None, None) if increment is None else increment
    data = added if added is not None else read_table(root, table, table_version, storage_options=opts)
    assert data is not None, "the table exists (opened above) and table_version is one of its versions"
    source = source_metadata(root, table, table_version, storage_options=opts)
    steps.update()
    prefetched = (None if session is None or table != Table.EXAMPLES
                  else session.take_pointer_summaries(table_version, data.num_rows))
    sequence_checks, pointer_results = (checks_from_summaries(data, prefetched) if prefetched is not None
                                        else _pointer_checks(lake, build, table, data, history_tail,
                                                             None if session is None else session.pointer_summaries))
    results = pointer_results + _run_suite(validation, ingest, build, table, data, ts, sequence_checks, earlier)
    steps.update()
    batch, dead_checks = _batch(lake, validation, table, data, source)
    profile = profile_batch(batch)
    k = validation.drift_history_batches
    history = (profile_history(root, table, table_version, k, storage_options=opts) if session is None
               else session.profile_history(table, table_version, k))
    # A version that added no rows (a compaction, a build that published nothing) has no distribution to
    # drift: its `empty` check says what there is to say, and its profile stays out of later baselines.
    no_rows = table in INCREMENTAL and data.num_rows == 0
    results = results + dead_checks + ([] if no_rows else drift_checks(profile, [p for _, p in history], validation))
    steps.update()
    run_id = f"{ts:013d}-{uuid.uuid4().hex[:8]}"
    report = build_report(
        table=table,
        table_version=table_version,
        num_rows=data.num_rows,
        results=results,
        run_id=run_id,
        run_ts_ms=ts,
        source=source,
        profile=profile,
        history=history,
    )
    json_path, html_path = write_report(root, report, data, storage_options=opts,
                                        plots=plots == "always" or report["verdict"] != PASSED)
    # One app transaction per run on both tables: a retried write of this run lands once.
    app_id = f"validate:{run_id}"
    if not no_rows:
        append_profile(root, table=table, table_version=table_version, run_id=run_id, run_ts_ms=ts,
                       passed=verdict(results) == PASSED, profile=profile, app_id=app_id, storage_options=opts,
                       snapshot=None if session is None else session.snapshot(Table.QUALITY_PROFILES))
    steps.update()
    append_quality_rows(
        root,
        [
            {
                "table": table,
                "table_version": table_version,
                "run_id": run_id,
                "run_ts_ms": ts,
                "expectation": r.name,
                "severity": r.severity,
                "success": r.success,
                "observed": r.observed,
                "report_path": str(json_path),
            }
            for r in results
        ],
        app_id=app_id,
        storage_options=opts,
        snapshot=None if session is None else session.snapshot(Table.QUALITY),
    )
    steps.update()
    steps.close()
    if session is not None and table == Table.EVENTS and "event_date" in data.column_names:
        _remember_ids(lake, session.events_ids, since, table_version, data, added is not None, ts,
                      ingest.dedup_window_ms)
    return QualityResult(
        table=table,
        table_version=table_version,
        passed=report["verdict"] == PASSED,
        num_rows=data.num_rows,
        failures=[(r.name, r.severity, r.observed) for r in results if not r.success],
        report_json=json_path,
        report_html=html_path,
    )


def latest_report(lake: Lake, table: str, version: int | None = None) -> tuple[str, Path | str]:
    """(verdict, path of report.html) of the newest report of ``table`` (at ``version`` if given).

    A local lake gives a ``Path``; an object-store lake (``s3://...``) the report's URI, read
    through ``gemline.lake.lake_fs`` with the lake's storage options.

    Raises:
        BadConfigError: ``table`` has no suite.
        MissingInputError: no report exists for that table (or version); validate it first.
    """
    if table not in VALIDATED_TABLES:
        raise BadConfigError(f"no quality suite (so no report) for table {table!r}; reports exist for {VALIDATED_TABLES}")
    if lake.is_remote:
        return _latest_remote_report(lake.root, table, version, lake.delta_options)
    if version is None:
        root = Path(lake.root) / "_quality" / table
        versions = sorted(int(p.name) for p in root.glob("*") if p.name.isdigit() and (p / "report.json").is_file())
        if not versions:
            raise MissingInputError(f"no quality report for {table!r} under {root}; run `gemline validate --table {table}`")
        version = versions[-1]
    out = report_dir(lake.root, table, version)
    if not (out / "report.json").is_file():
        raise MissingInputError(f"no quality report for {table}@{version} at {out}; run `gemline validate --table {table} --version {version}`")
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    return report["verdict"], out / "report.html"


def _latest_remote_report(
    lake: str, table: str, version: int | None, storage_options: dict[str, str] | None
) -> tuple[str, str]:
    fs, root = lake_fs(lake, storage_options)
    base = f"{root}/_quality/{table}"

    def has_report(v: int) -> bool:
        return fs.get_file_info(f"{base}/{v}/report.json").type == pafs.FileType.File

    if version is None:
        infos = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
        versions = sorted(int(i.base_name) for i in infos if i.base_name.isdigit() and has_report(int(i.base_name)))
        if not versions:
            raise MissingInputError(f"no quality report for {table!r} under {lake}/_quality/{table}; run `gemline validate --table {table}`")
        version = versions[-1]
    if not has_report(version):
        raise MissingInputError(f"no quality report for {table}@{version} under {lake}; run `gemline validate --table {table} --version {version}`")
    with fs.open_input_stream(f"{base}/{version}/report.json") as fh:
        report = json.loads(fh.read().decode("utf-8"))
    return report["verdict"], f"{lake.rstrip('/')}/_quality/{table}/{version}/report.html"
