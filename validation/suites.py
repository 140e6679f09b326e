"""Quality suites of the ``events`` and ``examples`` tables, built in code.

Each suite is a list of named checks with a severity (``critical`` fails the batch and closes
the gate; ``warning`` is reported only). Most checks are Great Expectations 1.x class-based
expectations run on one ephemeral context per process, against a pandas dataframe batch
(GX docs, "Connect to dataframe data" and "Create an Expectation"). What GX cannot express is
computed here with pyarrow and reported in the same shape (:class:`CheckResult`):

- ``schema_types``: Arrow column types against the table contract (pandas loses them);
- ``seq_length_matches_lists``: ``seq_length`` equals the length of every sequence list;
- ``leakage``: no element of ``seq_event_time_ms`` at or after the example's ``event_time_ms``
  (a point-in-time join must only see the past);
- ``seq_time_ascending``: every sequence oldest first, as the contract says;
- ``finite:<f_*>``: dense features finite or null (pandas turns NaN into null, so GX can't tell);
- ``not_null:<column>`` and ``unique:<key>``: exact over every row (GX would see only a sample);
- ``seq_length_p99:<domain>``: p50/p99 of sequence lengths per domain (warning above max_seq_len).

Large batches: GX's per-row value checks (sets, ranges, label-rate means) run on a deterministic
strided sample of ``ValidationConfig.gx_sample_rows`` rows (marked ``sampled_rows`` in their
details); everything listed above stays exact. A rare out-of-set value outside the sample can
therefore pass ``in_set``; leakage, duplicates, nulls and broken sequences cannot.

Shape letters: N rows in the batch, T = total number of sequence elements over the N rows.

Any exception inside one check becomes a failed result carrying the exception message; the other
checks still run. An empty batch fails the critical check ``empty``.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ingest.schema import EVENT_TYPES, EVENTS_TABLE_SCHEMA
from sequences.schema import EXAMPLES_BASE_SCHEMA, LABELS, SEQUENCE_FEATURES, dense_feature_names, pointer_schema

Severity = Literal["critical", "warning"]
SEVERITIES: tuple[str, ...] = ("critical", "warning")
SEQUENCE_TIME_COLUMN = "seq_event_time_ms"
LIST_COLUMNS: tuple[str, ...] = (*SEQUENCE_FEATURES, SEQUENCE_TIME_COLUMN)
_MAX_SAMPLES = 5


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one named check on one batch.

    ``observed`` is a short human-readable summary (the observed value, the unexpected count with
    examples, or ``error: <message>`` when the check raised); ``details`` is the GX result dict
    (``observed_value`` or ``element_count``/``unexpected_count``/``partial_unexpected_list``),
    JSON-serialisable, for custom checks in the same keys.
    """

    name: str
    severity: Severity
    success: bool
    observed: str
    kind: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Custom:
    name: str
    severity: Severity
    fn: Callable[[pa.Table], dict[str, Any]]
    """Returns a GX-shaped result dict with an extra boolean key ``success``."""


@functools.cache
def _batch_definition():
    """One ephemeral GX context, pandas data source and whole-dataframe batch definition per process.

    GX is slow to import and to build contexts (seconds), so every validation reuses this one.
    """
    import great_expectations as gx
    import great_expectations.execution_engine.pandas_execution_engine as pandas_engine
    from great_expectations.data_context.types.base import ProgressBarsConfig

    # GX fingerprints every pandas batch below HASH_THRESHOLD bytes (an md5 of pandas' row hashes, kept only as
    # a batch marker nothing here reads): 17 % of `validate --follow`'s CPU on the freshness benchmark's stream
    # (py-spy, 2026-12-03). A threshold of 0 skips it; the results are the same (tests/validation).
    pandas_engine.HASH_THRESHOLD = 0
    context = gx.get_context(mode="ephemeral")
    # one bar per metric batch floods the logs; validate_table shows its own progress instead
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    asset = context.data_sources.add_pandas("gemline").add_dataframe_asset("batch")
    return asset.add_batch_definition_whole_dataframe("whole")


def _gxe():
    import great_expectations.expectations as gxe

    return gxe


def _jsonable(value: Any) -> Any:
    """Plain JSON values from GX/numpy results (NaN and inf become strings so JSON stays valid)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            value = value.item()
        except (TypeError, ValueError):
            return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def summarize(details: dict[str, Any]) -> str:
    """One-line observed value of a GX-shaped result dict."""
    if "observed_value" in details:
        return json.dumps(_jsonable(details["observed_value"]))
    if details.get("unexpected_count") == 0:
        return f"0 of {details.get('element_count')} unexpected"
    if "unexpected_count" in details:
        sample = _jsonable(details.get("partial_unexpected_list", [])[:_MAX_SAMPLES])
        return f"{details['unexpected_count']} of {details.get('element_count')} unexpected, e.g. {json.dumps(sample)}"
    return json.dumps(_jsonable(details))


def _error(name: str, severity: Severity, kind: str, message: str) -> CheckResult:
    return CheckResult(name, severity, False, f"error: {message}", kind, {"exception_message": message})


# ---------------------------------------------------------------- custom (pyarrow) checks


def _rows_result(bad_rows: pa.Array, ids: pa.ChunkedArray | None, num_rows: int, extra: dict | None = None) -> dict:
    """GX map-expectation shape from the indices of failing rows (sample labelled by id when given)."""
    bad = sorted(set(bad_rows.to_pylist()))
    sample = bad[:_MAX_SAMPLES] if ids is None else ids.take(pa.array(bad[:_MAX_SAMPLES], pa.int64())).to_pylist()
    return {
        "success": not bad,
        "element_count": num_rows,
        "unexpected_count": len(bad),
        "partial_unexpected_list": sample,
        **(extra or {}),
    }


def _ids(table: pa.Table) -> pa.ChunkedArray | None:
    for name in ("example_id", "event_id"):
        if name in table.column_names:
            return table.column(name)
    return None


def check_schema_types(table: pa.Table, expected: pa.Schema) -> dict[str, Any]:
    """Columns of ``expected`` present in ``table`` whose Arrow type differs (missing ones are ``columns``'s job)."""
    mismatched = {
        f.name: {"expected": str(f.type), "got": str(table.schema.field(f.name).type)}
        for f in expected
        if f.name in table.column_names and not table.schema.field(f.name).type.equals(f.type)
    }
    return {"success": not mismatched, "observed_value": mismatched or "all types match"}


def check_leakage(table: pa.Table, anchor_column: str = "event_time_ms", *, strict: bool = True) -> dict[str, Any]:
    """Rows with a sequence element at or after the row's own time (point-in-time violation).

    Reads ``seq_event_time_ms`` list<int64> (N rows, T elements) and ``anchor_column`` int64 (N,),
    both ms since epoch UTC. With ``strict`` (examples) an element equal to the example time counts
    as leakage: the contract (``sequences/schema.py``) keeps only events strictly before the example.
    Without it (``sequences`` rows, anchored at ``as_of_ms``) only elements after the anchor leak.
    """
    seq = table.column(SEQUENCE_TIME_COLUMN).combine_chunks()
    parents = pc.list_parent_indices(seq)
    anchor = pc.take(table.column(anchor_column).combine_chunks(), parents)
    compare = pc.greater_equal if strict else pc.greater
    leaked = pc.fill_null(compare(pc.list_flatten(seq), anchor), False)
    result = _rows_result(pc.filter(parents, leaked), _ids(table), table.num_rows)
    result["leaked_elements"] = int(pc.sum(leaked).as_py() or 0)
    return result


def check_seq_ascending(table: pa.Table) -> dict[str, Any]:
    """Rows whose ``seq_event_time_ms`` is not time-ascending (oldest first, ties allowed), as the contract says.

    The trainer's truncation to the newest ``max_seq_len`` events relies on that order.
    """
    seq = table.column(SEQUENCE_TIME_COLUMN).combine_chunks()
    flat = pc.list_flatten(seq)
    parents = pc.list_parent_indices(seq)
    if len(flat) < 2:
        return _rows_result(pa.array([], pa.int64()), _ids(table), table.num_rows)
    same_row = pc.equal(parents.slice(1), parents.slice(0, len(parents) - 1))
    descending = pc.less(flat.slice(1), flat.slice(0, len(flat) - 1))
    bad = pc.fill_null(pc.and_(same_row, descending), False)
    return _rows_result(pc.filter(parents.slice(1), bad), _ids(table), table.num_rows)


def check_seq_lengths(table: pa.Table) -> dict[str, Any]:
    """Rows whose ``seq_length`` differs from the length of any sequence list (null lists count as wrong)."""
    seq_length = pc.cast(table.column("seq_length"), pa.int64())
    wrong = pa.array([False] * table.num_rows, pa.bool_())
    for name in LIST_COLUMNS:
        lengths = pc.list_value_length(table.column(name))
        differs = pc.fill_null(pc.not_equal(pc.cast(lengths, pa.int64()), seq_length), True)
        wrong = pc.or_(wrong, differs.combine_chunks())
    rows = pc.indices_nonzero(wrong)
    return _rows_result(rows, _ids(table), table.num_rows)


def check_finite(table: pa.Table, column: str) -> dict[str, Any]:
    """Rows whose float column holds NaN or +-inf (null is allowed)."""
    values = table.column(column)
    if not pa.types.is_floating(values.type):
        raise TypeError(f"{column}: expected a float64 dense feature, got {values.type}; cast it in the build")
    bad = pc.invert(pc.fill_null(pc.is_finite(values), True)).combine_chunks()
    return _rows_result(pc.indices_nonzero(bad), _ids(table), table.num_rows)


def check_not_null(table: pa.Table, column: str) -> dict[str, Any]:
    """Null count of a column GX does not see (list columns are kept out of the pandas batch)."""
    nulls = pc.is_null(table.column(column)).combine_chunks()
    return _rows_result(pc.indices_nonzero(nulls), _ids(table), table.num_rows)


def check_unique(table: pa.Table, columns: Sequence[str]) -> dict[str, Any]:
    """Rows whose (non-null) key ``columns`` value occurs more than once, counted exactly over the whole batch.

    Same counting as GX's ``ExpectColumnValuesToBeUnique`` (every row of a duplicated key is
    unexpected; rows with a null key part are skipped: the not-null check carries them).
    """
    keys = table.select(list(columns))
    valid = pa.array([True] * table.num_rows, pa.bool_())
    for name in columns:
        valid = pc.and_(valid, pc.is_valid(keys.column(name)).combine_chunks())
    indexed = keys.append_column("__row", pa.array(range(table.num_rows), pa.int64())).filter(valid)
    counts = indexed.group_by(list(columns)).aggregate([("__row", "count")])
    dup_keys = counts.filter(pc.greater(counts["__row_count"], 1)).drop_columns(["__row_count"])
    if dup_keys.num_rows == 0:
        return _rows_result(pa.array([], pa.int64()), _ids(table), table.num_rows)
    bad = indexed.join(dup_keys, keys=list(columns), join_type="inner").column("__row")
    return _rows_result(bad.combine_chunks(), _ids(table), table.num_rows)


def check_unique_within(table: pa.Table, key: str, time_column: str, window_ms: int,
                        earlier: pa.Table | None = None) -> dict[str, Any]:
    """Rows whose non-null ``key`` occurs again within ``window_ms`` of ``time_column`` (ms): duplicates as
    the ingest job defines them (``IngestConfig.dedup_window_ms``, ``ingest.dedup.drop_duplicates``), so
    that the gate and the dedup agree; copies farther apart are distinct events sharing an id. Every
    row of a too-close pair is unexpected, as in :func:`check_unique`.

    ``earlier``: rows (``key``, ``time_column``) already judged, that ``table``'s rows may repeat (an
    increment's history: at least every earlier row of one of its keys within ``window_ms`` of one of its
    rows). Then only pairs with a member in ``table`` count, and their earlier members count too
    (``earlier_unexpected`` of them; ``element_count`` adds the earlier rows compared), so the union of
    the rows flagged by the increments of a table equals the rows flagged by one check of the whole table
    (in key and time order a too-close pair is adjacent, and stays adjacent among fewer rows).
    """
    # Sorted by (key, time), a too-close pair is always adjacent; Arrow sorts and compares in C (a Python sort
    # of every row's tuple was the costliest step of validating a growing events table).
    n_old = 0 if earlier is None else earlier.num_rows
    n = table.num_rows
    keys, times = table.column(key), table.column(time_column)
    if earlier is not None and n_old:
        keys = pa.chunked_array([*keys.chunks, *earlier.column(key).cast(keys.type).chunks], keys.type)
        times = pa.chunked_array([*times.chunks, *earlier.column(time_column).cast(times.type).chunks], times.type)
    valid = pc.and_(pc.is_valid(keys), pc.is_valid(times))
    rows = np.flatnonzero(valid.to_numpy(zero_copy_only=False))  # pc.indices_nonzero crashed on an empty table
    bad = np.zeros(0, dtype=np.int64)
    if len(rows) >= 2:
        both = pa.table({"k": keys.filter(valid), "t": times.filter(valid)})
        order = pc.sort_indices(both, sort_keys=[("k", "ascending"), ("t", "ascending")])  # stable: ties by row
        k = both.column("k").take(order)
        t = both.column("t").take(order).to_numpy(zero_copy_only=False).astype(np.int64)
        where = rows[order.to_numpy(zero_copy_only=False)]
        same = pc.equal(k.slice(1), k.slice(0, len(k) - 1)).to_numpy(zero_copy_only=False)
        close = same & (t[1:] - t[:-1] <= window_ms)
        if n_old:  # a pair of earlier rows was judged with them
            close &= (where[:-1] < n) | (where[1:] < n)
        bad = np.unique(np.concatenate([where[:-1][close], where[1:][close]]))
    mine, theirs = bad[bad < n], bad[bad >= n] - n
    result = _rows_result(pa.array(mine, pa.int64()), _ids(table), n)
    if earlier is not None:
        old_ids = earlier.column(key).take(pa.array(theirs[: _MAX_SAMPLES], pa.int64())).to_pylist()
        result.update(success=len(bad) == 0, element_count=n + n_old, unexpected_count=len(bad),
                      earlier_unexpected=len(theirs),
                      partial_unexpected_list=(result["partial_unexpected_list"] + old_ids)[:_MAX_SAMPLES])
    return result


def _run_custom(check: _Custom, table: pa.Table) -> CheckResult:
    kind = f"custom:{check.name.split(':')[0]}"
    try:
        details = _jsonable(check.fn(table))
    except Exception as exc:  # a broken check must not hide the others: it fails with its message
        return _error(check.name, check.severity, kind, f"{type(exc).__name__}: {exc}")
    success = bool(details.pop("success"))
    return CheckResult(check.name, check.severity, success, summarize(details), kind, details)


# ---------------------------------------------------------------- GX expectations


def _named(expectation, name: str, severity: Severity):
    """Tag a GX expectation with our check name (in ``meta``) and GX's own ``severity`` field."""
    kwargs = expectation.dict(exclude_unset=True, exclude={"meta", "severity"})
    return type(expectation)(**kwargs, meta={"name": name}, severity=severity)


def _common(expected: pa.Schema, *, domains: Sequence[str], time_column: str, min_time_ms: int,
            max_time_ms: int, empty_severity: Severity = "critical") -> list:
    """Row count, columns, exact not-null on required columns (scalar and list), domain set, time range.

    A set or range check lets nulls through, so every column checked by one also has its not-null.
    """
    gxe = _gxe()
    specs: list = [
        _named(gxe.ExpectTableRowCountToBeBetween(min_value=1), "empty", empty_severity),
        _named(
            gxe.ExpectTableColumnsToMatchSet(column_set=list(expected.names), exact_match=False), "columns", "critical"
        ),
    ]
    specs += [
        _Custom(f"not_null:{f.name}", "critical", functools.partial(check_not_null, column=f.name))
        for f in expected
        if not f.nullable
    ]
    specs.append(_named(gxe.ExpectColumnValuesToBeInSet(column="domain", value_set=list(domains)), "in_set:domain", "critical"))
    specs.append(
        _named(
            gxe.ExpectColumnValuesToBeBetween(column=time_column, min_value=min_time_ms, max_value=max_time_ms),
            f"range:{time_column}",
            "critical",
        )
    )
    return specs


def _unique(columns: Sequence[str]) -> _Custom:
    return _Custom(f"unique:{'+'.join(columns)}", "critical", lambda t: check_unique(t, columns))


def sample_indices(num_rows: int, sample_rows: int | None) -> pa.Array | None:
    """Deterministic evenly strided row indices (int64, ascending) when ``num_rows > sample_rows``, else None.

    Striding, not random draws, so re-validating a version samples the very same rows and every
    partition (the table is read in partition order) is represented.
    """
    if sample_rows is None or num_rows <= sample_rows:
        return None
    return pa.array((np.arange(sample_rows, dtype=np.int64) * num_rows) // sample_rows)


def run_specs(specs: list, table: pa.Table, *, sample_rows: int | None = None) -> list[CheckResult]:
    """Run GX expectations and custom checks of ``specs`` on ``table``; results in spec order.

    Custom (pyarrow) checks always read every row. GX expectations read the deterministic sample of
    :func:`sample_indices` when the batch has more than ``sample_rows`` rows (GX on pandas costs
    seconds per million rows per expectation); their ``details`` then carry ``sampled_rows``.
    """
    exps = [s for s in specs if not isinstance(s, _Custom)]
    custom = [s for s in specs if isinstance(s, _Custom)]
    names = [s.name if isinstance(s, _Custom) else s.meta["name"] for s in specs]
    take = sample_indices(table.num_rows, sample_rows)
    frame = _frame(table if take is None else table.take(take))
    # GX applies a row condition by filtering the whole frame, every column copied (a fifth of the examples
    # suite's CPU with three per-domain label rates): each conditional expectation reads a frame of its columns.
    whole: list = []
    narrow: dict[tuple[str, ...], list] = {}
    for exp in exps:
        reads = _columns_read(exp)
        if reads is not None and set(reads) <= set(frame.columns):
            narrow.setdefault(reads, []).append(exp)
        else:
            whole.append(exp)
    gx_results = _run_gx(whole, frame) if whole else []
    for reads, group in narrow.items():
        gx_results += _run_gx(group, frame[list(reads)])
    if take is not None:
        gx_results = [
            CheckResult(r.name, r.severity, r.success, f"{r.observed} (sample of {len(take)} rows)", r.kind,
                        {**r.details, "sampled_rows": len(take)})
            for r in gx_results
        ]
    return _order(gx_results + [_run_custom(c, table) for c in custom], names)


def _columns_read(expectation) -> tuple[str, ...] | None:
    """The columns a GX column expectation with a row condition reads (its column, then those of the condition,
    sorted); None for any other expectation, or a condition whose columns are not known here."""
    condition = getattr(expectation, "row_condition", None)
    column = getattr(expectation, "column", None)
    if condition is None or not isinstance(column, str):
        return None
    names: set[str] = set()
    todo = [condition]
    while todo:
        part = todo.pop()
        if hasattr(part, "conditions"):  # and / or of conditions
            todo.extend(part.conditions)
        elif isinstance(getattr(getattr(part, "column", None), "name", None), str):
            names.add(part.column.name)
        else:
            return None  # a string condition or a kind not known here: the whole frame
    return (column, *sorted(names - {column}))


def _run_gx(expectations: list, frame) -> list[CheckResult]:
    """Validate ``expectations`` on one pandas batch; each raising expectation becomes a failed result."""
    import great_expectations as gx

    suite = gx.ExpectationSuite(name="gemline", expectations=expectations)
    batch = _batch_definition().get_batch(batch_parameters={"dataframe": frame})
    try:
        return [_from_gx(r) for r in batch.validate(suite, result_format="SUMMARY").results]
    except Exception:  # GX normally catches per expectation; if the run itself broke, isolate one by one
        out = []
        for exp in expectations:
            try:
                out.append(_from_gx(batch.validate(exp, result_format="SUMMARY")))
            except Exception as exc:
                severity = getattr(exp.severity, "value", exp.severity)
                out.append(_error(exp.meta["name"], severity, exp.expectation_type, f"{type(exc).__name__}: {exc}"))
        return out


def _from_gx(result) -> CheckResult:
    config = result.expectation_config
    name = config.meta["name"]
    severity = getattr(config.severity, "value", config.severity)
    kind = config.type
    info = result.exception_info or {}
    messages = [info["exception_message"]] if info.get("raised_exception") else []
    messages += [v["exception_message"] for v in info.values() if isinstance(v, dict) and v.get("raised_exception")]
    if messages:
        return _error(name, severity, kind, "; ".join(sorted(set(messages))))
    details = _jsonable(dict(result.result))
    return CheckResult(name, severity, bool(result.success), summarize(details), kind, details)


def _frame(table: pa.Table):
    """The batch as pandas (GX's pandas source). List columns come along by name only, as int8 zero
    placeholders, for the column-set check: no GX expectation reads them (custom checks do), and a GX that
    fingerprints the batch (see :func:`_batch_definition`) pickles a frame of list columns, ~1 ms per row."""
    scalar = [f.name for f in table.schema if not pa.types.is_list(f.type)]
    frame = table.select(scalar).to_pandas()
    for f in table.schema:
        if pa.types.is_list(f.type):
            frame[f.name] = np.zeros(table.num_rows, dtype=np.int8)
    return frame


def _order(results: list[CheckResult], names: list[str]) -> list[CheckResult]:
    rank = {n: i for i, n in enumerate(names)}
    return sorted(results, key=lambda r: rank[r.name])


# ---------------------------------------------------------------- suites


def validate_events(
    table: pa.Table, *, domains: Sequence[str], min_time_ms: int, max_time_ms: int, sample_rows: int | None = None,
    dedup_window_ms: int | None = None, earlier: pa.Table | None = None, empty_severity: Severity = "critical",
) -> list[CheckResult]:
    """Run the events suite on a batch of the ``events`` table (schema ``EVENTS_TABLE_SCHEMA``).

    Args:
        table: N rows; any columns (missing or mistyped ones fail ``columns`` / ``schema_types``).
        domains: known domains (``config.ingest.domains``).
        min_time_ms, max_time_ms: inclusive sane range of ``event_time_ms``, ms since epoch UTC.
        sample_rows: GX value checks read a deterministic sample of this many rows when N is larger
            (see :func:`run_specs`); None reads all rows.
        dedup_window_ms: ``unique:event_id`` flags only ids repeated within this many ms of event
            time (``IngestConfig.dedup_window_ms``); None: any repeat.
        earlier: when ``table`` is an increment (the rows of versions not validated yet), the
            (``event_id``, ``event_time_ms``) of the earlier rows it may repeat (:func:`check_unique_within`);
            needs ``dedup_window_ms``.
        empty_severity: of the ``empty`` check (``warning`` for an increment: a commit without good events).

    Returns:
        One result per check, in suite order. Never raises for bad data.

    Raises:
        ValueError: ``earlier`` without ``dedup_window_ms``.
    """
    gxe = _gxe()
    if earlier is not None and dedup_window_ms is None:
        raise ValueError("validate_events: earlier rows need dedup_window_ms (what counts as a repeat)")
    specs = _common(EVENTS_TABLE_SCHEMA, domains=domains, time_column="event_time_ms", min_time_ms=min_time_ms,
                    max_time_ms=max_time_ms, empty_severity=empty_severity)
    specs.append(_named(gxe.ExpectColumnValuesToBeInSet(column="event_type", value_set=list(EVENT_TYPES)), "in_set:event_type", "critical"))
    if dedup_window_ms is None:
        specs.append(_unique(["event_id"]))
    else:  # what ingest calls a duplicate: the same id within the dedup window
        specs.append(_Custom("unique:event_id", "critical",
                             lambda t: check_unique_within(t, "event_id", "event_time_ms", dedup_window_ms, earlier)))
    specs.append(_Custom("schema_types", "critical", lambda t: check_schema_types(t, EVENTS_TABLE_SCHEMA)))
    return run_specs(specs, table, sample_rows=sample_rows)


def check_seq_length_p99(table: pa.Table, domain: str, max_seq_len: int) -> dict[str, Any]:
    """p50 and p99 of ``seq_length`` (events) of one domain's rows; fails when p99 exceeds ``max_seq_len``."""
    mask = pc.fill_null(pc.equal(table.column("domain"), domain), False)
    lengths = table.filter(mask).column("seq_length").drop_null().to_numpy().astype(np.float64)
    if lengths.size == 0:
        return {"success": True, "observed_value": {"p50": None, "p99": None, "rows": 0}}
    p50, p99 = float(np.percentile(lengths, 50)), float(np.percentile(lengths, 99))
    return {"success": p99 <= max_seq_len, "observed_value": {"p50": p50, "p99": p99, "rows": int(lengths.size)}}


def _domains(table: pa.Table) -> list[str]:
    if "domain" not in table.column_names:
        return []
    return sorted(d for d in pc.unique(table.column("domain")).to_pylist() if d is not None)


def validate_examples(
    table: pa.Table,
    *,
    domains: Sequence[str],
    min_time_ms: int,
    max_time_ms: int,
    max_seq_len: int,
    min_label_rate: float,
    max_label_rate: float,
    sample_rows: int | None = None,
    empty_severity: Severity = "critical",
    sequence_checks: Mapping[str, Callable[[pa.Table], dict[str, Any]]] | None = None,
) -> list[CheckResult]:
    """Run the examples suite on a batch of the ``examples`` table (contract in ``sequences/schema.py``).

    ``empty_severity``: of the ``empty`` check (no rows). ``warning`` for an increment, the rows one version
    added: a build that published nothing (every attribution window still open) has nothing to quarantine.

    Besides the events-like checks: labels in {0, 1}; ``seq_length`` in [0, max_seq_len] and equal to
    every list's length; no leakage; sequences time-ascending; the click rate of each domain present
    in [min_label_rate, max_label_rate] (warning, ``label_rate:<domain>``); per domain the p50/p99
    of ``seq_length`` (warning ``seq_length_p99:<domain>``, fails above max_seq_len); every ``f_*``
    finite or null. ``sample_rows`` as in :func:`validate_events` (the label rate is then the
    sample's: an estimate).

    ``sequence_checks``: for rows without list columns (the pointer layout,
    :mod:`validation.pointer_checks`), the functions computing ``seq_length_matches_lists``,
    ``leakage`` and ``seq_time_ascending`` (table -> GX-shaped dict with ``success``); the
    contract's list columns are then not expected. None: computed from the lists.

    Returns:
        One result per check, in suite order. Never raises for bad data.
    """
    gxe = _gxe()
    base = EXAMPLES_BASE_SCHEMA if sequence_checks is None else pointer_schema(EXAMPLES_BASE_SCHEMA)
    checks: Mapping[str, Callable[[pa.Table], dict[str, Any]]] = sequence_checks or {
        "seq_length_matches_lists": check_seq_lengths, "leakage": check_leakage,
        "seq_time_ascending": check_seq_ascending}
    specs = _common(base, domains=domains, time_column="event_time_ms", min_time_ms=min_time_ms,
                    max_time_ms=max_time_ms, empty_severity=empty_severity)
    specs.append(_unique(["example_id"]))
    for label in LABELS:
        specs.append(_named(gxe.ExpectColumnValuesToBeInSet(column=label, value_set=[0, 1]), f"in_set:{label}", "critical"))
    specs.append(
        _named(
            gxe.ExpectColumnValuesToBeBetween(column="seq_length", min_value=0, max_value=max_seq_len),
            "range:seq_length",
            "critical",
        )
    )
    from great_expectations.expectations.row_conditions import Column  # GX is slow to import: only when needed

    present = _domains(table) if "label_click" in table.column_names else []
    for domain in present:
        specs.append(
            _named(
                gxe.ExpectColumnMeanToBeBetween(
                    column="label_click",
                    min_value=min_label_rate,
                    max_value=max_label_rate,
                    row_condition=Column("domain") == domain,  # a GX Condition (strings deprecated in GX 1.9)
                ),
                f"label_rate:{domain}",
                "warning",
            )
        )
    specs += [
        _Custom("schema_types", "critical", lambda t: check_schema_types(t, base)),
        *[_Custom(name, "critical", checks[name]) for name in ("seq_length_matches_lists", "leakage",
                                                                 "seq_time_ascending")],
        *[_Custom(f"seq_length_p99:{d}", "warning",
                  functools.partial(check_seq_length_p99, domain=d, max_seq_len=max_seq_len)) for d in present],
        *[_Custom(f"finite:{c}", "critical", functools.partial(check_finite, column=c)) for c in dense_feature_names(table.schema)],
    ]
    return run_specs(specs, table, sample_rows=sample_rows)
