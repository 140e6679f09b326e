"""Each check fails on an input built to fail it, and only that check (plus named companions)."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.schema import EVENTS_TABLE_SCHEMA
from validation.suites import check_leakage, check_seq_ascending, check_seq_lengths, validate_events, validate_examples

T0 = 1_700_000_000_000


def failed(results) -> dict[str, str]:
    return {r.name: r.severity for r in results if not r.success}


def test_valid_batches_pass_every_check(events_table, examples_table, bounds, example_bounds):
    ev = validate_events(events_table(), **bounds)
    ex = validate_examples(examples_table(), **example_bounds)
    assert failed(ev) == {} and failed(ex) == {}
    names = {r.name for r in ex}
    assert {"empty", "leakage", "seq_length_matches_lists", "finite:f_user_clicks", "label_rate:facebook"} <= names
    assert {"empty", "unique:event_id", "in_set:event_type", "schema_types"} <= {r.name for r in ev}


def test_gx_batches_are_not_fingerprinted_and_still_judged(events_table, bounds, monkeypatch):
    import great_expectations.execution_engine.pandas_execution_engine as pandas_engine

    calls = []
    monkeypatch.setattr(pandas_engine, "hash_pandas_dataframe", lambda df: calls.append(len(df)) or "x")
    results = {r.name: r for r in validate_events(events_table(changes={1: {"domain": "myspace"}}), **bounds)}
    assert calls == [] and results["in_set:domain"].details["unexpected_count"] == 1


EVENT_CASES = [
    # (id, changes per row, expected failed checks)
    ("unknown domain", {1: {"domain": "myspace"}}, {"in_set:domain": "critical"}),
    # a set check lets nulls through: the not-null beside it must catch them
    ("null domain", {1: {"domain": None}}, {"not_null:domain": "critical"}),
    ("unknown event type", {2: {"event_type": "hover"}}, {"in_set:event_type": "critical"}),
    ("null event type", {2: {"event_type": None}}, {"not_null:event_type": "critical"}),
    ("event time before the sane range", {0: {"event_time_ms": 0}}, {"range:event_time_ms": "critical"}),
    ("event time in the future", {0: {"event_time_ms": T0 + 365 * 86_400_000}}, {"range:event_time_ms": "critical"}),
    ("duplicate event id", {3: {"event_id": "e0"}}, {"unique:event_id": "critical"}),
    ("null user id", {4: {"user_id": None}}, {"not_null:user_id": "critical"}),
]


@pytest.mark.parametrize("changes,expected", [c[1:] for c in EVENT_CASES], ids=[c[0] for c in EVENT_CASES])
def test_events_suite_names_the_failed_check(events_table, bounds, changes, expected):
    assert failed(validate_events(events_table(changes=changes), **bounds)) == expected


def test_events_unexpected_values_are_reported(events_table, bounds):
    results = {r.name: r for r in validate_events(events_table(changes={1: {"domain": "myspace"}}), **bounds)}
    assert results["in_set:domain"].details["unexpected_count"] == 1
    assert results["in_set:domain"].details["partial_unexpected_list"] == ["myspace"]
    assert results["in_set:domain"].observed.startswith("1 of 6 unexpected")


def test_empty_batch_fails_as_empty(events_table, examples_table, bounds, example_bounds):
    assert failed(validate_events(events_table(0), **bounds)) == {"empty": "critical"}
    assert failed(validate_examples(examples_table(0), **example_bounds)) == {"empty": "critical"}


def test_an_empty_increment_of_examples_is_a_warning_only(examples_table, example_bounds):
    # A build that published nothing (every window still open) adds an empty examples version.
    results = validate_examples(examples_table(0), **example_bounds, empty_severity="warning")
    assert failed(results) == {"empty": "warning"}
    assert failed(validate_examples(examples_table(), **example_bounds, empty_severity="warning")) == {}


def test_missing_column_fails_columns_and_its_checks_without_crashing(events_table, bounds):
    table = events_table().drop_columns(["event_type"])
    results = {r.name: r for r in validate_events(table, **bounds)}
    assert not results["columns"].success
    assert results["columns"].details["details"]["mismatched"]["missing"] == ["event_type"]
    # the expectations on the missing column fail with GX's message; the others still ran and passed
    assert not results["in_set:event_type"].success
    assert "event_type" in results["in_set:event_type"].observed and results["in_set:event_type"].observed.startswith("error:")
    assert results["unique:event_id"].success and results["in_set:domain"].success


def test_wrong_arrow_type_fails_schema_types(events_table, bounds):
    schema = EVENTS_TABLE_SCHEMA.set(EVENTS_TABLE_SCHEMA.get_field_index("kafka_offset"), pa.field("kafka_offset", pa.string()))
    table = events_table(changes={i: {"kafka_offset": str(i)} for i in range(6)}, schema=schema)
    results = {r.name: r for r in validate_events(table, **bounds)}
    assert failed(results.values()) == {"schema_types": "critical"}
    assert results["schema_types"].details["observed_value"] == {"kafka_offset": {"expected": "int64", "got": "string"}}


def test_all_null_column_is_a_failed_check_not_a_crash(examples_table, example_bounds):
    table = examples_table(changes={i: {"event_time_ms": None} for i in range(8)})
    got = failed(validate_examples(table, **example_bounds))
    assert got["not_null:event_time_ms"] == "critical"
    # leakage can't be decided against a null time: not counted as leaked, the not-null check carries it
    assert "leakage" not in got


EXAMPLE_CASES = [
    ("click label 2", {3: {"label_click": 2}}, {"in_set:label_click": "critical"}),
    ("conversion label -1", {3: {"label_conversion": -1}}, {"in_set:label_conversion": "critical"}),
    ("null click label", {3: {"label_click": None}}, {"not_null:label_click": "critical"}),
    (
        "sequence longer than max_seq_len",
        {2: {"seq_item_ids": ["a"] * 5, "seq_categories": ["c"] * 5, "seq_event_types": ["click"] * 5,
             "seq_domains": ["facebook"] * 5, "seq_event_time_ms": [T0 - 5] * 5, "seq_length": 5}},
        # one facebook row of 4 at length 5: its p99 (4.88) exceeds max_seq_len 4 too
        {"range:seq_length": "critical", "seq_length_p99:facebook": "warning"},
    ),
    ("seq_length disagrees with the lists", {2: {"seq_length": 1}}, {"seq_length_matches_lists": "critical"}),
    ("one list shorter than the others", {2: {"seq_domains": ["facebook"]}}, {"seq_length_matches_lists": "critical"}),
    # row 2 is at T0+2000 with history [T0+0, T0+1000]: an element at the example's own time leaks
    ("leakage at the example time", {2: {"seq_event_time_ms": [T0, T0 + 2000]}}, {"leakage": "critical"}),
    ("sequence not time-ascending", {2: {"seq_event_time_ms": [T0 + 1000, T0]}}, {"seq_time_ascending": "critical"}),
    ("leakage after the example time", {2: {"seq_event_time_ms": [T0, T0 + 9000]}}, {"leakage": "critical"}),
    ("NaN dense feature", {1: {"f_user_clicks": math.nan}}, {"finite:f_user_clicks": "critical"}),
    ("inf dense feature", {1: {"f_user_clicks": -math.inf}}, {"finite:f_user_clicks": "critical"}),
    ("unknown domain", {0: {"domain": "myspace"}}, {"in_set:domain": "critical", "label_rate:myspace": "warning"}),
    ("null sequence list", {2: {"seq_item_ids": None}}, {"not_null:seq_item_ids": "critical", "seq_length_matches_lists": "critical"}),
    # facebook rows are 0, 2, 4, 6 with clicks 0, 1, 0, 1: all clicks gives rate 1.0 > 0.9
    ("click rate above max", {0: {"label_click": 1}, 4: {"label_click": 1}}, {"label_rate:facebook": "warning"}),
    ("click rate below min", {3: {"label_click": 0}, 7: {"label_click": 0}}, {"label_rate:instagram": "warning"}),
]


@pytest.mark.parametrize("changes,expected", [c[1:] for c in EXAMPLE_CASES], ids=[c[0] for c in EXAMPLE_CASES])
def test_examples_suite_names_the_failed_check(examples_table, example_bounds, changes, expected):
    assert failed(validate_examples(examples_table(changes=changes), **example_bounds)) == expected


def test_leakage_reports_the_leaking_example(examples_table, example_bounds):
    table = examples_table(changes={5: {"seq_event_time_ms": [T0 + 5000, T0 + 6000]}})
    leak = {r.name: r for r in validate_examples(table, **example_bounds)}["leakage"]
    assert leak.details["unexpected_count"] == 1
    assert leak.details["partial_unexpected_list"] == ["x5"]
    assert leak.details["leaked_elements"] == 2


def test_missing_sequence_column_fails_its_custom_checks_with_the_message(examples_table, example_bounds):
    table = examples_table().drop_columns(["seq_event_time_ms"])
    results = {r.name: r for r in validate_examples(table, **example_bounds)}
    assert not results["leakage"].success and results["leakage"].observed.startswith("error: KeyError")
    assert not results["columns"].success
    assert results["in_set:label_click"].success and results["finite:f_user_clicks"].success


# ---------------------------------------------------------------- custom checks against loop references

histories = st.lists(
    st.tuples(st.integers(0, 50), st.lists(st.integers(0, 60), max_size=5)), max_size=8
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(histories)
def test_leakage_matches_a_loop(rows):
    table = pa.table(
        {
            "example_id": [f"x{i}" for i in range(len(rows))],
            "event_time_ms": pa.array([t for t, _ in rows], pa.int64()),
            "seq_event_time_ms": pa.array([s for _, s in rows], pa.list_(pa.int64())),
        }
    )
    got = check_leakage(table)
    leaking = [f"x{i}" for i, (t, s) in enumerate(rows) if any(e >= t for e in s)]
    assert got["success"] == (not leaking)
    assert got["unexpected_count"] == len(leaking)
    assert got["partial_unexpected_list"] == leaking[:5]
    assert got["leaked_elements"] == sum(e >= t for t, s in rows for e in s)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 4), st.lists(st.integers(0, 4), min_size=5, max_size=5)), max_size=8))
def test_seq_lengths_matches_a_loop(rows):
    # each row: a seq_length and the lengths of the five list columns
    names = ["seq_item_ids", "seq_categories", "seq_event_types", "seq_domains", "seq_event_time_ms"]
    cols = {"seq_length": pa.array([n for n, _ in rows], pa.int32())}
    for j, name in enumerate(names):
        typ = pa.int64() if name == "seq_event_time_ms" else pa.string()
        vals = [[0 if typ == pa.int64() else "a"] * lens[j] for _, lens in rows]
        cols[name] = pa.array(vals, pa.list_(typ))
    got = check_seq_lengths(pa.table(cols))
    bad = [i for i, (n, lens) in enumerate(rows) if any(x != n for x in lens)]
    assert got["unexpected_count"] == len(bad) and got["success"] == (not bad)
    assert got["partial_unexpected_list"] == bad[:5]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(histories)
def test_seq_ascending_matches_a_loop(rows):
    table = pa.table(
        {
            "example_id": [f"x{i}" for i in range(len(rows))],
            "seq_event_time_ms": pa.array([s for _, s in rows], pa.list_(pa.int64())),
        }
    )
    got = check_seq_ascending(table)
    bad = [f"x{i}" for i, (_, s) in enumerate(rows) if any(b < a for a, b in zip(s, s[1:]))]
    assert got["unexpected_count"] == len(bad) and got["success"] == (not bad)
    assert got["partial_unexpected_list"] == bad[:5]


def test_a_suite_run_that_raises_falls_back_to_one_expectation_at_a_time(monkeypatch, events_table, bounds):
    import great_expectations as gx

    from validation import suites

    real = suites._batch_definition()

    class FlakyBatch:
        """Raises on whole-suite runs and on the event-type set check; delegates the rest to GX."""

        def __init__(self, batch):
            self.batch = batch

        def validate(self, expect, result_format):
            if isinstance(expect, gx.ExpectationSuite) or expect.meta["name"] == "in_set:event_type":
                raise RuntimeError("boom")
            return self.batch.validate(expect, result_format=result_format)

    class FlakyDefinition:
        def get_batch(self, batch_parameters):
            return FlakyBatch(real.get_batch(batch_parameters=batch_parameters))

    monkeypatch.setattr(suites, "_batch_definition", FlakyDefinition)
    results = {r.name: r for r in validate_events(events_table(changes={1: {"domain": "myspace"}}), **bounds)}
    assert results["in_set:event_type"].observed == "error: RuntimeError: boom"
    assert failed(results.values()) == {"in_set:event_type": "critical", "in_set:domain": "critical"}


def test_unique_event_id_agrees_with_the_ingest_dedup_window(events_table, bounds):
    from ingest.dedup import drop_duplicates

    table = events_table()
    times = table["event_time_ms"].to_pylist()
    ids = table["event_id"].to_pylist()
    hour = 3_600_000
    # Row 1 repeats row 0's id 2 h later (distinct events to the dedup), row 3 repeats row 2's id 1 s later.
    ids[1], times[1] = ids[0], times[0] + 2 * hour
    ids[3], times[3] = ids[2], times[2] + 1000
    table = table.set_column(table.schema.get_field_index("event_id"), "event_id", pa.array(ids, pa.string()))
    table = table.set_column(table.schema.get_field_index("event_time_ms"), "event_time_ms", pa.array(times, pa.int64()))
    results = {r.name: r for r in validate_events(table, **bounds, dedup_window_ms=hour)}
    assert not results["unique:event_id"].success
    assert results["unique:event_id"].details["unexpected_count"] == 2  # rows 2 and 3 only
    kept, dropped = drop_duplicates(table, table.slice(0, 0).select(["event_id", "event_time_ms"]), hour)
    assert dropped == 1  # the dedup drops exactly the pair the check flags, and keeps rows 0 and 1
    results = {r.name: r for r in validate_events(kept, **bounds, dedup_window_ms=hour)}
    assert results["unique:event_id"].success


def test_unique_within_flags_exactly_the_rows_of_too_close_pairs_of_a_reference_scan():
    from validation.suites import check_unique_within

    rng = np.random.default_rng(7)
    n = 2_000
    keys = [None if rng.random() < 0.05 else f"e{rng.integers(0, 600)}" for _ in range(n)]
    times = [None if rng.random() < 0.05 else int(rng.integers(0, 50)) * 1000 for _ in range(n)]
    table = pa.table({"event_id": pa.array(keys, pa.string()), "event_time_ms": pa.array(times, pa.int64())})
    window = 3000
    # Reference: every pair of rows with one id at most `window` ms apart (ties and chains included).
    expected = {i for i in range(n) for j in range(n) if i != j and keys[i] is not None and keys[i] == keys[j]
                and times[i] is not None and times[j] is not None and abs(times[i] - times[j]) <= window}
    result = check_unique_within(table, "event_id", "event_time_ms", window)
    assert 0 < len(expected) < n
    assert (result["success"], result["unexpected_count"]) == (False, len(expected))
    assert check_unique_within(table.slice(0, 1), "event_id", "event_time_ms", window)["success"]
    assert check_unique_within(table.slice(0, 0), "event_id", "event_time_ms", window)["unexpected_count"] == 0
    nulls = pa.table({"event_id": pa.array([None, None], pa.string()), "event_time_ms": pa.array([1, 1], pa.int64())})
    assert check_unique_within(nulls, "event_id", "event_time_ms", window)["success"]


def test_conditional_expectations_judge_a_frame_of_their_columns_as_gx_judges_the_whole_frame(examples_table,
                                                                                            example_bounds):
    """The per-domain label rates (GX row conditions) run on a frame of (label_click, domain) only: every result,
    details included, as GX gives on the whole frame, on a batch where one domain's rate fails."""
    import great_expectations.expectations as gxe
    from great_expectations.expectations.row_conditions import Column

    from validation import suites

    table = examples_table(changes={0: {"label_click": 1}, 4: {"label_click": 1}})  # facebook's rate 1.0 > 0.9
    rate = gxe.ExpectColumnMeanToBeBetween(column="label_click", min_value=0, max_value=0.5,
                                           row_condition=Column("domain") == "facebook")
    assert suites._columns_read(rate) == ("label_click", "domain")
    assert suites._columns_read(gxe.ExpectColumnValuesToNotBeNull(column="domain")) is None
    narrow = validate_examples(table, **example_bounds)
    original = suites._columns_read
    try:
        suites._columns_read = lambda expectation: None  # every expectation on the whole frame
        whole = validate_examples(table, **example_bounds)
    finally:
        suites._columns_read = original
    assert [(r.name, r.severity, r.success, r.observed, r.details) for r in narrow] == [
        (r.name, r.severity, r.success, r.observed, r.details) for r in whole]
    assert not {r.name: r for r in narrow}["label_rate:facebook"].success
    assert {r.name: r.success for r in narrow}["label_rate:instagram"]
