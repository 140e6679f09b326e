"""Quality suites of the build's other tables: ``sequences`` and ``features/user`` / ``features/item``.

Same shape as :mod:`validation.suites` (GX expectations for sets and ranges, exact pyarrow checks
for not-null, uniqueness, leakage and sequence order). Point in time:

- ``sequences``: every element time at or before the row's ``as_of_ms`` (``leakage``), oldest first;
- ``features/*``: ``event_ts_ms <= as_of_ms`` (``point_in_time``), counters >= 0, CTRs in (0, inf)
  (smoothed CTRs are never 0 and may exceed 1 on short windows, see ``features/definitions.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from features.definitions import COUNTER_NAMES, ITEM_FEATURES, USER_FEATURES, FeatureView
from sequences.schema import SEQUENCES_SCHEMA
from validation.suites import (
    CheckResult,
    _common,
    _Custom,
    _gxe,
    _named,
    _rows_result,
    _unique,
    check_leakage,
    check_not_null,
    check_schema_types,
    check_seq_ascending,
    check_seq_lengths,
    run_specs,
)

FEATURE_VIEWS: dict[str, FeatureView] = {USER_FEATURES.name: USER_FEATURES, ITEM_FEATURES.name: ITEM_FEATURES}


def validate_sequences(
    table: pa.Table, *, max_seq_len: int, min_time_ms: int, max_time_ms: int, sample_rows: int | None = None
) -> list[CheckResult]:
    """Run the ``sequences`` suite (schema ``SEQUENCES_SCHEMA``: one row per user as of ``as_of_ms``).

    Checks: empty, columns, schema types, not-null on every column, unique ``user_id``,
    ``seq_length`` in [0, max_seq_len] and equal to every list's length, ``as_of_ms`` in
    [min_time_ms, max_time_ms] (ms since epoch UTC), sequences time-ascending, no element after
    ``as_of_ms``. Never raises for bad data.
    """
    gxe = _gxe()
    specs: list = [
        _named(gxe.ExpectTableRowCountToBeBetween(min_value=1), "empty", "critical"),
        _named(gxe.ExpectTableColumnsToMatchSet(column_set=list(SEQUENCES_SCHEMA.names), exact_match=False),
               "columns", "critical"),
        _Custom("schema_types", "critical", lambda t: check_schema_types(t, SEQUENCES_SCHEMA)),
        *[_Custom(f"not_null:{f.name}", "critical", functools.partial(check_not_null, column=f.name))
          for f in SEQUENCES_SCHEMA],
        _unique(["user_id"]),
        _named(gxe.ExpectColumnValuesToBeBetween(column="seq_length", min_value=0, max_value=max_seq_len),
               "range:seq_length", "critical"),
        _named(gxe.ExpectColumnValuesToBeBetween(column="as_of_ms", min_value=min_time_ms, max_value=max_time_ms),
               "range:as_of_ms", "critical"),
        _Custom("seq_length_matches_lists", "critical", check_seq_lengths),
        _Custom("seq_time_ascending", "critical", check_seq_ascending),
        _Custom("leakage", "critical", functools.partial(check_leakage, anchor_column="as_of_ms", strict=False)),
    ]
    return run_specs(specs, table, sample_rows=sample_rows)


def check_point_in_time(table: pa.Table) -> dict[str, Any]:
    """Rows whose ``event_ts_ms`` (newest event reflected) is after ``as_of_ms``: a feature from the future."""
    late = pc.fill_null(pc.greater(table.column("event_ts_ms"), table.column("as_of_ms")), False).combine_chunks()
    return _rows_result(pc.indices_nonzero(late), None, table.num_rows)


def validate_features(
    table: pa.Table,
    name: str,
    *,
    domains: Sequence[str],
    min_time_ms: int,
    max_time_ms: int,
    sample_rows: int | None = None,
) -> list[CheckResult]:
    """Run the suite of feature table ``name`` (``"features/user"`` or ``"features/item"``).

    Checks: empty, columns, schema types, not-null on required columns, unique entity keys,
    domain in set, ``event_ts_ms`` in [min_time_ms, max_time_ms] (ms since epoch UTC), counters
    >= 0, CTRs > 0, ``point_in_time``. Never raises for bad data.

    Raises:
        ValueError: ``name`` is not a feature view.
    """
    if name not in FEATURE_VIEWS:
        raise ValueError(f"no feature suite for {name!r}; expected one of {sorted(FEATURE_VIEWS)}")
    view = FEATURE_VIEWS[name]
    gxe = _gxe()
    specs = _common(view.schema, domains=domains, time_column="event_ts_ms", min_time_ms=min_time_ms,
                    max_time_ms=max_time_ms)
    specs.append(_unique(list(view.entity_keys)))
    specs.append(_Custom("schema_types", "critical", lambda t: check_schema_types(t, view.schema)))
    for counter in COUNTER_NAMES:
        if counter.startswith("ctr_"):
            exp = gxe.ExpectColumnValuesToBeBetween(column=counter, min_value=0, strict_min=True)
        else:
            exp = gxe.ExpectColumnValuesToBeBetween(column=counter, min_value=0)
        specs.append(_named(exp, f"range:{counter}", "critical"))
    specs.append(_Custom("point_in_time", "critical", check_point_in_time))
    return run_specs(specs, table, sample_rows=sample_rows)
