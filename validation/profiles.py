"""Per-batch profiles and drift checks against the previous K passed batches of the same table.

A profile is a flat ``{metric: value}`` dict of one batch (float64 values):

- ``num_rows`` (volume, rows);
- ``null_rate:<column>`` for every scalar column (fraction of rows, 0..1) but the correction columns;
- ``label_rate:<label>`` and ``label_rate:<label>:<domain>`` for the examples labels, over first rows (a
  correction row of an early-published impression, :mod:`sequences.publish`, is left out);
- ``mean:<c>``, ``p50:<c>``, ``p99:<c>`` for every numeric feature column ``c``;
- ``seq_length_p50:<domain>`` / ``seq_length_p99:<domain>`` where the batch has sequences.

Profiles are appended to the ``quality_profiles`` Delta table (one row per metric per run). Drift
compares a metric with the mean of the same metric over the previous K passed versions of the
table (``ValidationConfig.drift_history_batches``): relative change ``|x - h| / |h|`` for volume,
label rates, means and quantiles, absolute change for null rates (a rate near 0 makes any ratio
explode). This follows the metric-history anomaly checks of Deequ (Schelter et al., "Automating
Large-Scale Data Quality Verification", PVLDB 11(12), 2018, section 4 "Incremental computation"
and anomaly detection on metric time series; Deequ docs, ``RelativeRateOfChangeStrategy`` and
``AbsoluteChangeStrategy``), simplified to a mean-of-K baseline.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gemline import tables
from gemline.increments import ledger
from gemline.lake import StorageOptions
from gemline.tables import Table
from sequences.schema import LABELS
from validation.config import ValidationConfig
from validation.suites import CheckResult

if TYPE_CHECKING:
    from deltalake import DeltaTable

PROFILES_SCHEMA = pa.schema(
    [
        pa.field("table", pa.string(), nullable=False),
        pa.field("table_version", pa.int64(), nullable=False),
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("run_ts_ms", pa.int64(), nullable=False),  # ms since epoch UTC
        pa.field("passed", pa.bool_(), nullable=False),  # the run's verdict: only passed runs form the history
        pa.field("metric", pa.string(), nullable=False),
        pa.field("value", pa.float64(), nullable=False),
    ]
)

_NOT_FEATURES = ("kafka_", "label_", "schema_version")

_CORRECTION_COLUMNS = ("corrects_example_id", "correction_task")
"""Null only on first rows: their null rate is the share of corrections in a batch, not a data defect."""


def numeric_features(schema: pa.Schema) -> list[str]:
    """Integer and float columns worth a distribution: not times (``*_ms``), offsets, labels or versions."""
    return [
        f.name
        for f in schema
        if (pa.types.is_integer(f.type) or pa.types.is_floating(f.type))
        and not f.name.endswith("_ms")
        and not f.name.startswith(_NOT_FEATURES)
    ]


def _finite(column: pa.ChunkedArray) -> np.ndarray:
    values = column.drop_null().to_numpy().astype(np.float64)
    return values[np.isfinite(values)]


def profile_batch(data: pa.Table) -> dict[str, float]:
    """The profile of one batch (see the module docstring); an empty batch profiles as ``num_rows`` 0 only
    (its rates and quantiles are undefined).
    """
    n = data.num_rows
    out: dict[str, float] = {"num_rows": float(n)}
    if n == 0:
        return out
    for f in data.schema:
        if not pa.types.is_list(f.type) and f.name not in _CORRECTION_COLUMNS:
            out[f"null_rate:{f.name}"] = data.column(f.name).null_count / n
    if "corrects_example_id" in data.column_names:
        # Label rates are those of impressions: a correction row repeats one with one label (sequences.publish).
        data = data.filter(pc.is_null(data.column("corrects_example_id")))
    domains = data.column("domain") if "domain" in data.column_names else None
    for label in (x for x in LABELS if x in data.column_names):
        values = pc.cast(data.column(label), pa.float64())
        mean = pc.mean(values).as_py()
        if mean is not None:
            out[f"label_rate:{label}"] = mean
        if domains is not None:
            grouped = pa.table({"d": domains, "v": values}).group_by("d").aggregate([("v", "mean")])
            for d, m in zip(grouped["d"].to_pylist(), grouped["v_mean"].to_pylist()):
                if d is not None and m is not None:
                    out[f"label_rate:{label}:{d}"] = m
    for name in numeric_features(data.schema):
        values = _finite(data.column(name))
        if values.size:
            out[f"mean:{name}"] = float(values.mean())
            out[f"p50:{name}"] = float(np.percentile(values, 50))
            out[f"p99:{name}"] = float(np.percentile(values, 99))
    out.update(seq_length_by_domain(data))
    return out


def seq_length_by_domain(data: pa.Table) -> dict[str, float]:
    """``seq_length_p50:<domain>`` and ``seq_length_p99:<domain>`` (events) of a batch with ``seq_length`` and ``domain``."""
    if "seq_length" not in data.column_names or "domain" not in data.column_names or data.num_rows == 0:
        return {}
    lengths = data.column("seq_length").to_numpy(zero_copy_only=False)
    domains = np.asarray(data.column("domain").to_pylist(), dtype=object)
    out = {}
    for d in sorted({x for x in domains if x is not None}):
        sel = lengths[(domains == d) & ~np.isnan(lengths.astype(np.float64))]
        if sel.size:
            out[f"seq_length_p50:{d}"] = float(np.percentile(sel, 50))
            out[f"seq_length_p99:{d}"] = float(np.percentile(sel, 99))
    return out


def _rule(metric: str, config: ValidationConfig) -> tuple[str, float]:
    """(``relative`` | ``absolute``, threshold) of a metric."""
    if metric == "num_rows":
        return "relative", config.max_volume_change
    if metric.startswith("null_rate:"):
        return "absolute", config.max_null_rate_change
    if metric.startswith("label_rate:"):
        return "relative", config.max_label_rate_change
    if metric.startswith("mean:"):
        return "relative", config.max_mean_change
    return "relative", config.max_quantile_change


def change(value: float, baseline: float, mode: str) -> float:
    """``|value - baseline|`` (absolute) or ``|value - baseline| / |baseline|`` (relative; inf when the
    baseline is 0 and the value is not)."""
    diff = abs(value - baseline)
    if mode == "absolute":
        return diff
    if baseline == 0:
        return 0.0 if diff == 0 else math.inf
    return diff / abs(baseline)


def drift_checks(
    current: Mapping[str, float], history: Sequence[Mapping[str, float]], config: ValidationConfig
) -> list[CheckResult]:
    """One ``drift:<metric>`` check per metric of ``current``, against the mean of that metric over ``history``.

    Args:
        current: the batch's profile.
        history: profiles of the previous passed batches, oldest first (at most K are used, the newest).
        config: thresholds and the severity of drift checks.

    Returns:
        Results in metric order; a metric absent from every history profile passes with observed
        ``"no history"`` (nothing to compare with yet).
    """
    recent = list(history)[-config.drift_history_batches:]
    out = []
    for metric in sorted(current):
        past = [h[metric] for h in recent if metric in h]
        name = f"drift:{metric}"
        if not past:
            out.append(CheckResult(name, config.drift_severity, True, "no history", "drift", {"history": 0}))
            continue
        mode, threshold = _rule(metric, config)
        baseline = float(np.mean(past))
        delta = change(current[metric], baseline, mode)
        details = {
            "observed_value": current[metric],
            "baseline": baseline,
            "history": len(past),
            "change": delta if math.isfinite(delta) else "inf",
            "mode": mode,
            "threshold": threshold,
        }
        observed = f"{current[metric]:.6g} vs {baseline:.6g} over {len(past)} batches: {mode} change {delta:.3g} (max {threshold:g})"
        out.append(CheckResult(name, config.drift_severity, delta <= threshold, observed, "drift", details))
    return out


def append_profile(
    lake: str | Path, *, table: str, table_version: int, run_id: str, run_ts_ms: int, passed: bool,
    profile: Mapping[str, float], app_id: str | None = None, storage_options: StorageOptions | None = None,
    snapshot: DeltaTable | None = None,
) -> bool:
    """Append one run's profile to ``quality_profiles`` in one commit, once (non-finite values are skipped).

    The commit is the app transaction ``(app_id, 0)`` (:func:`gemline.tables.commit`; None:
    ``validate:<run_id>``): a retry of the same run's write writes nothing. ``snapshot``: a long-running
    writer's open handle of ``quality_profiles`` (:func:`gemline.lake.commit_once`).

    Returns:
        True if this call committed; False when no value is finite or the run's profile is already there.

    Raises:
        gemline.lake.CommitConflictError: another writer committed the same app transaction meanwhile.
    """
    rows = [
        dict(table=table, table_version=table_version, run_id=run_id, run_ts_ms=run_ts_ms, passed=passed, metric=m,
             value=float(v))
        for m, v in sorted(profile.items())
        if math.isfinite(v)
    ]
    if not rows:
        return False
    return tables.commit(lake, Table.QUALITY_PROFILES, pa.Table.from_pylist(rows, schema=PROFILES_SCHEMA),
                         app_id=app_id or f"validate:{run_id}", version=0, storage_options=storage_options,
                       snapshot=snapshot)


def profile_history(lake: str | Path, table: str, before_version: int, k: int, *,
                    storage_options: StorageOptions | None = None) -> list[tuple[int, dict[str, float]]]:
    """(version, profile) of up to ``k`` versions of ``table`` below ``before_version``, oldest first.

    Only a version whose newest run passed counts (a quarantined batch must not become the baseline).
    Returns [] when ``quality_profiles`` does not exist yet.
    """
    # The table gains a commit per validation run: a process's ledger reads only the new ones.
    data = ledger(lake, Table.QUALITY_PROFILES, PROFILES_SCHEMA, storage_options=storage_options).rows()
    if data is None:
        return []
    mask = pc.and_(pc.equal(data["table"], table), pc.less(data["table_version"], before_version))
    rows = data.filter(mask).to_pylist()
    newest: dict[int, tuple[int, str]] = {}
    for r in rows:
        key = (r["run_ts_ms"], r["run_id"])
        if r["table_version"] not in newest or key > newest[r["table_version"]]:
            newest[r["table_version"]] = key
    profiles: dict[int, dict[str, float]] = {}
    passed: dict[int, bool] = {}
    for r in rows:
        if (r["run_ts_ms"], r["run_id"]) == newest[r["table_version"]]:
            profiles.setdefault(r["table_version"], {})[r["metric"]] = r["value"]
            passed[r["table_version"]] = r["passed"]
    kept = sorted(v for v in profiles if passed[v])[-k:]
    return [(v, profiles[v]) for v in kept]
