"""Prometheus metrics of a running pipeline, read from the lake, Kafka and the supervisor when scraped.

``gemline run --metrics-port PORT`` (and ``ingest --streaming`` / ``build --follow``) serve these on
``http://127.0.0.1:PORT/metrics`` in the Prometheus text format (``--metrics-addr ADDR`` listens elsewhere, e.g.
``0.0.0.0`` for every interface):

=========================================== ======================================================================
``gemline_consumer_lag{topic,partition}``   Kafka high watermark minus the lake's committed offset (messages)
``gemline_table_version{table}``            newest Delta version of each table that exists
``gemline_rows{table}``                     rows in each table's newest version (Delta ``numRecords`` stats)
``gemline_quarantined_versions{table}``     versions the quality gate holds quarantined now (:mod:`gemline.gate`)
``gemline_stage_restarts_total{stage}``     restarts of each supervised stage
``gemline_stage_up{stage}``                 1 while the stage's process runs, else 0
``gemline_freshness_seconds{hop,quantile}`` newest p50/p95/p99 of each hop of the ``freshness`` table, if any
``gemline_collect_errors_total{part}``      reads that failed (the other parts are still served)
=========================================== ======================================================================

Values are read at scrape time by a custom collector (prometheus_client's ``Collector`` protocol, the
"custom collectors" pattern of its documentation), and kept ``cache_s`` seconds, so any number of scrapers
costs one read of the Delta logs per interval. The lake's committed offsets are the ``end_offsets`` the
ingest job records in its ``events`` commits (the source of truth; the consumer group only mirrors them).
This module knows neither Kafka clients nor the supervisor: the application passes callables for them.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gemline.gate import RELEASE
from gemline.lake import Lake, commit_metadata, open_table, read_table
from gemline.tables import Table

log = logging.getLogger(__name__)

QUANTILES = (("0.5", "p50_s"), ("0.95", "p95_s"), ("0.99", "p99_s"))


@dataclass(frozen=True)
class LagSource:
    """Where consumer lag comes from.

    Attributes:
        topic: the Kafka topic.
        app_id: the ingest job's writer id, whose ``events`` commits record ``end_offsets`` (``ingest:<topic>``).
        watermarks: returns, per partition, (low, high) watermark offsets now; may raise (counted, lag skipped).
    """

    topic: str
    app_id: str
    watermarks: Callable[[], Mapping[int, tuple[int, int]]]


@dataclass(frozen=True)
class StageSample:
    """One supervised stage as the metrics see it: its name, restarts so far, and whether it runs now."""

    name: str
    restarts: int
    running: bool


def consumer_lag(watermarks: Mapping[int, tuple[int, int]], committed: Mapping[int, int]) -> dict[int, int]:
    """Messages behind per partition: high watermark minus the committed offset (the low watermark for a
    partition never committed, as ingest then starts there), never below 0."""
    return {p: max(0, high - committed.get(p, low)) for p, (low, high) in sorted(watermarks.items())}


def lake_offsets(lake: Lake, app_id: str) -> dict[int, int]:
    """The ``end_offsets`` (partition -> next offset to read) of ``app_id``'s newest ``events`` commit; {} when
    it never committed."""
    meta = commit_metadata(lake, Table.EVENTS, app_id) or {}
    return {int(p): int(o) for p, o in meta.get("end_offsets", {}).items()}


def table_rows(dt: Any) -> int:
    """Rows in a Delta table's current version: the sum of its files' ``numRecords`` statistics (no data read).

    Raises:
        ValueError: a file has no ``numRecords`` statistic (written without stats).
    """
    actions = pa.table(dt.get_add_actions(flatten=True))
    if actions.num_rows == 0:
        return 0
    counts = actions["num_records"]
    if counts.null_count:
        raise ValueError(f"{dt.table_uri}: {counts.null_count} files have no numRecords statistic")
    return int(pc.sum(counts).as_py())


QUALITY_DECISION_COLUMNS = ("table", "table_version", "run_id", "run_ts_ms", "expectation", "severity", "success")
"""The ``quality`` columns a gate decision reads (``observed`` and ``report_path``, long strings, are left out)."""


def quarantined(lake: Lake, version: int | None = None) -> dict[str, int]:
    """Per table named in the ``quality`` table (at ``version``, latest when None), how many validated versions
    the gate refuses; {} without a ``quality`` table. One read of the table, decided column-wise
    (:func:`quarantined_versions`)."""
    quality = read_table(lake, Table.QUALITY, version, columns=list(QUALITY_DECISION_COLUMNS))
    if quality is None:
        return {}
    refused = quarantined_versions(quality)
    counts = pc.value_counts(refused["table"]).to_pylist() if refused.num_rows else []
    return {table: 0 for table in quality["table"].unique().to_pylist()} | {
        c["values"]: c["counts"] for c in counts}


def quarantined_versions(quality: pa.Table) -> pa.Table:
    """The (table, table_version) pairs that :func:`gemline.gate.gate_decision` refuses although validated,
    from rows of ``QUALITY_SCHEMA``: a critical expectation failed in the version's newest run (highest
    ``run_ts_ms``, then highest ``run_id``), and no release row at or after that run's time.

    The same rule as the gate's per-version ``_decide``, over every version at once with Arrow joins and group-bys
    (the gate decides a few versions per call; the metrics ask about all of them every few seconds).
    """
    keys = ["table", "table_version"]
    is_release = pc.equal(quality["expectation"], RELEASE)
    checks, releases = quality.filter(pc.invert(is_release)), quality.filter(is_release)
    newest_ts = checks.group_by(keys).aggregate([("run_ts_ms", "max")])
    at_newest = checks.join(newest_ts, keys, join_type="inner")
    at_newest = at_newest.filter(pc.equal(at_newest["run_ts_ms"], at_newest["run_ts_ms_max"]))
    newest_run = at_newest.group_by(keys).aggregate([("run_id", "max")])
    last = checks.join(newest_run, keys, join_type="inner")
    last = last.filter(pc.and_(pc.equal(last["run_id"], last["run_id_max"]),
                               pc.and_(pc.equal(last["severity"], "critical"), pc.invert(last["success"]))))
    failed = last.group_by(keys).aggregate([])
    later = releases.select([*keys, "run_ts_ms"]).join(newest_ts, keys, join_type="inner")
    released = later.filter(pc.greater_equal(later["run_ts_ms"], later["run_ts_ms_max"])).group_by(keys).aggregate([])
    return failed.join(released, keys, join_type="left anti").select(keys).sort_by([(k, "ascending") for k in keys])


def freshness(lake: Lake) -> dict[str, dict[str, float]]:
    """Per hop, the quantile columns of its row with the highest ``examples_version`` in the ``freshness``
    table; {} when the table does not exist."""
    rows = read_table(lake, Table.FRESHNESS, columns=["hop", "examples_version", *(c for _, c in QUANTILES)])
    if rows is None:
        return {}
    newest: dict[str, dict[str, Any]] = {}
    for row in rows.to_pylist():
        hop = row["hop"]
        if hop not in newest or row["examples_version"] >= newest[hop]["examples_version"]:
            newest[hop] = row
    return {hop: {c: float(r[c]) for _, c in QUANTILES if r[c] is not None} for hop, r in sorted(newest.items())}


class PipelineCollector(Collector):
    """Collects the metrics of the module docstring, at most once per ``cache_s`` seconds.

    Args:
        lake: the lake the stages write.
        tables: the tables whose version and rows are reported (default: every registered table that exists,
            and ``freshness``).
        lag: where consumer lag comes from; None: no lag metric.
        stages: returns the supervised stages; None: no stage metrics.
        cache_s: seconds a collected set of values is served again before the next read.
        clock: monotonic seconds (tests).
    """

    def __init__(self, lake: Lake, *, tables: Sequence[str] | None = None, lag: LagSource | None = None,
                 stages: Callable[[], Iterable[StageSample]] | None = None, cache_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lake, self.lag, self.stages, self.cache_s, self.clock = lake, lag, stages, cache_s, clock
        self.tables = tuple(tables if tables is not None else map(str, Table))
        self.errors: dict[str, int] = {}
        self._lock = threading.Lock()
        self._cached: tuple[float, list[Metric]] | None = None
        self._quality: tuple[int, dict[str, int]] | None = None
        """(quality table version, its counts of quarantined versions per table)."""

    def describe(self) -> Iterator[Metric]:
        """Nothing: registering must not read the lake (prometheus_client calls ``collect`` when there is no
        ``describe``), and the metric names are not checked against other collectors."""
        return iter(())

    def collect(self) -> Iterator[Metric]:
        """The metric families, read anew when the cached ones are older than ``cache_s``."""
        with self._lock:  # concurrent scrapes wait for one read instead of each reading the lake
            now = self.clock()
            if self._cached is None or now - self._cached[0] >= self.cache_s:
                self._cached = (now, self._read())
            return iter(self._cached[1])

    def _guarded(self, part: str, read: Callable[[], Any], default: Any) -> Any:
        try:
            return read()
        except Exception as exc:  # one unreadable part (broker down, a table mid-rewrite) must not hide the rest
            self.errors[part] = self.errors.get(part, 0) + 1
            log.warning("metrics: reading %s failed: %s: %s", part, type(exc).__name__, exc)
            return default

    def _read(self) -> list[Metric]:
        families: list[Metric] = []
        if self.lag is not None:
            families.append(self._lag(self.lag))
        families += self._tables()
        quarantine = GaugeMetricFamily("gemline_quarantined_versions",
                                       "Table versions the quality gate holds quarantined now", labels=["table"])
        for table, count in self._guarded("quality", self._quarantined, {}).items():
            quarantine.add_metric([table], count)
        families.append(quarantine)
        fresh = GaugeMetricFamily("gemline_freshness_seconds", "Newest freshness quantiles per hop (seconds)",
                                  labels=["hop", "quantile"])
        for hop, values in self._guarded("freshness", lambda: freshness(self.lake), {}).items():
            for quantile, column in QUANTILES:
                if column in values:
                    fresh.add_metric([hop, quantile], values[column])
        families.append(fresh)
        if self.stages is not None:
            families += self._stages(self.stages)
        errors = CounterMetricFamily("gemline_collect_errors", "Metric reads that failed, by part", labels=["part"])
        for part, count in sorted(self.errors.items()):
            errors.add_metric([part], count)
        families.append(errors)
        return families

    def _quarantined(self) -> dict[str, int]:
        # The whole quality table is decided again only when it has a new version: it grows by a validation
        # run's rows per table version (~300,000 rows a day) and changes only when validation runs.
        dt = open_table(self.lake, Table.QUALITY)
        if dt is None:
            return {}
        version = dt.version()
        if self._quality is None or self._quality[0] != version:
            self._quality = (version, quarantined(self.lake, version))
        return self._quality[1]

    def _lag(self, lag: LagSource) -> Metric:
        family = GaugeMetricFamily("gemline_consumer_lag", "Kafka messages not yet committed to the lake",
                                   labels=["topic", "partition"])
        marks = self._guarded("kafka", lag.watermarks, None)
        committed = self._guarded("offsets", lambda: lake_offsets(self.lake, lag.app_id), None)
        if marks is not None and committed is not None:
            for partition, behind in consumer_lag(marks, committed).items():
                family.add_metric([lag.topic, str(partition)], behind)
        return family

    def _tables(self) -> list[Metric]:
        version = GaugeMetricFamily("gemline_table_version", "Newest committed Delta version", labels=["table"])
        rows = GaugeMetricFamily("gemline_rows", "Rows in the newest version of the table", labels=["table"])
        for table in self.tables:
            dt = self._guarded(f"table:{table}", functools.partial(open_table, self.lake, table), None)
            if dt is None:
                continue
            version.add_metric([table], dt.version())
            count = self._guarded(f"rows:{table}", functools.partial(table_rows, dt), None)
            if count is not None:
                rows.add_metric([table], count)
        return [version, rows]

    def _stages(self, stages: Callable[[], Iterable[StageSample]]) -> list[Metric]:
        restarts = CounterMetricFamily("gemline_stage_restarts", "Restarts of a supervised stage", labels=["stage"])
        up = GaugeMetricFamily("gemline_stage_up", "1 while the stage's process runs", labels=["stage"])
        for s in stages():
            restarts.add_metric([s.name], s.restarts)
            up.add_metric([s.name], 1 if s.running else 0)
        return [restarts, up]


LOCAL_ADDR = "127.0.0.1"
"""Where metrics listen unless told otherwise: this machine only. The metrics name tables, topics and stage states;
widening that to a network is a decision (``--metrics-addr 0.0.0.0``), not a default."""


def serve(collector: Collector, port: int, *, addr: str = LOCAL_ADDR) -> tuple[Any, int]:
    """Serve ``collector``'s metrics over HTTP on ``addr:port`` (0: a free port) from a daemon thread
    (``prometheus_client.start_http_server``), in a registry of its own. ``addr``: the interface, loopback by
    default (:data:`LOCAL_ADDR`); ``"0.0.0.0"`` or ``"::"`` for every interface.

    Returns:
        (the WSGI server, to ``shutdown()``; the port it listens on).

    Raises:
        OSError: the port is taken or not ours to bind.
    """
    registry = CollectorRegistry()
    registry.register(collector)
    server, _ = start_http_server(port, addr=addr, registry=registry)
    return server, int(server.server_port)
