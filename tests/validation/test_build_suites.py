"""Suites of the sequences and feature tables, and the dead-letter / drift / sampling pieces, on hand-made batches."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest

from features.definitions import COUNTER_NAMES, USER_FEATURES
from sequences.schema import SEQUENCES_SCHEMA
from validation.build_suites import validate_features, validate_sequences
from validation.config import ValidationConfig
from validation.dead_letter import dead_letter_checks, in_ranges
from validation.profiles import change, drift_checks, profile_batch
from validation.suites import check_unique, sample_indices

from .conftest import DOMAINS, NOW_MS, T0_MS, relaxed


def failed(results) -> dict[str, str]:
    return {r.name: r.severity for r in results if not r.success}


def sequence_row(i: int, **overrides) -> dict:
    """User u<i> with i % 3 events, 1 s apart, the newest at as_of = T0 + 10 s."""
    k = i % 3
    times = [T0_MS + 10_000 - (k - 1 - j) * 1000 for j in range(k)]
    row = dict(
        user_id=f"u{i}", seq_item_ids=[f"i{j}" for j in range(k)], seq_categories=["c"] * k,
        seq_event_types=["click"] * k, seq_domains=["facebook"] * k, seq_event_time_ms=times, seq_length=k,
        seq_truncated=0, as_of_ms=T0_MS + 10_000, seq_event_ids=[f"e{j}" for j in range(k)], seq_created_ts_ms=times,
    )
    row.update(overrides)
    return {f.name: row.get(f.name, [] if pa.types.is_list(f.type) else 0) for f in SEQUENCES_SCHEMA}


def sequences(changes: dict[int, dict] | None = None, n: int = 6) -> pa.Table:
    rows = [sequence_row(i, **(changes or {}).get(i, {})) for i in range(n)]
    return pa.Table.from_pylist(rows, schema=relaxed(SEQUENCES_SCHEMA))


SEQ_BOUNDS = dict(max_seq_len=4, min_time_ms=T0_MS - 1000, max_time_ms=NOW_MS)

SEQUENCE_CASES = [
    ("element after as_of", {2: {"seq_event_time_ms": [T0_MS, T0_MS + 11_000]}}, {"leakage": "critical"}),
    ("not time-ascending", {2: {"seq_event_time_ms": [T0_MS + 9000, T0_MS]}}, {"seq_time_ascending": "critical"}),
    ("duplicate user", {3: {"user_id": "u0"}}, {"unique:user_id": "critical"}),
    ("null user", {3: {"user_id": None}}, {"not_null:user_id": "critical"}),
    ("seq_length disagrees", {1: {"seq_length": 3}}, {"seq_length_matches_lists": "critical"}),
    ("as_of before the sane range", {0: {"as_of_ms": 5}}, {"range:as_of_ms": "critical"}),
]


def test_valid_sequences_pass():
    assert failed(validate_sequences(sequences(), **SEQ_BOUNDS)) == {}


@pytest.mark.parametrize("changes,expected", [c[1:] for c in SEQUENCE_CASES], ids=[c[0] for c in SEQUENCE_CASES])
def test_sequences_suite_names_the_failed_check(changes, expected):
    assert failed(validate_sequences(sequences(changes), **SEQ_BOUNDS)) == expected


def test_empty_sequences_fail_as_empty():
    assert failed(validate_sequences(sequences(n=0), **SEQ_BOUNDS)) == {"empty": "critical"}


def feature_row(i: int, **overrides) -> dict:
    row = {name: (0.5 if name.startswith("ctr_") else i) for name in COUNTER_NAMES}
    row.update(user_id=f"u{i}", domain=DOMAINS[i % 2], as_of_ms=T0_MS + 10_000, event_ts_ms=T0_MS + i,
               created_ts_ms=T0_MS + i + 5, event_date="2023-11-14", age=30, gender=None, location=None)
    row.update(overrides)
    return row


def features(changes: dict[int, dict] | None = None, n: int = 6) -> pa.Table:
    # columns the feature view may add later get neutral values (the contract grows)
    rows = [{f.name: feature_row(i, **(changes or {}).get(i, {})).get(f.name, 0 if pa.types.is_integer(f.type) else "")
             for f in USER_FEATURES.schema} for i in range(n)]
    return pa.Table.from_pylist(rows, schema=relaxed(USER_FEATURES.schema))


FEATURE_BOUNDS = dict(domains=DOMAINS, min_time_ms=T0_MS - 1000, max_time_ms=NOW_MS)

FEATURE_CASES = [
    ("negative counter", {1: {"clicks_7d": -1}}, {"range:clicks_7d": "critical"}),
    ("zero smoothed ctr", {1: {"ctr_1h": 0.0}}, {"range:ctr_1h": "critical"}),
    ("feature newer than as_of", {2: {"event_ts_ms": T0_MS + 20_000}}, {"point_in_time": "critical"}),
    ("duplicate (user, domain)", {2: {"user_id": "u0"}}, {"unique:user_id+domain": "critical"}),
    ("null domain", {2: {"domain": None}}, {"not_null:domain": "critical"}),
    ("unknown domain", {2: {"domain": "myspace"}}, {"in_set:domain": "critical"}),
]


def test_valid_features_pass():
    assert failed(validate_features(features(), "features/user", **FEATURE_BOUNDS)) == {}


@pytest.mark.parametrize("changes,expected", [c[1:] for c in FEATURE_CASES], ids=[c[0] for c in FEATURE_CASES])
def test_features_suite_names_the_failed_check(changes, expected):
    assert failed(validate_features(features(changes), "features/user", **FEATURE_BOUNDS)) == expected


def test_unknown_feature_view_raises():
    with pytest.raises(ValueError, match="no feature suite for 'features/ad'"):
        validate_features(features(), "features/ad", **FEATURE_BOUNDS)


DEAD_LETTER_CASES = [
    # (events, dead, failed checks) with warning above 0.01 and critical above 0.10
    (99, 1, {}),  # exactly 0.01 is allowed
    (98, 2, {"dead_letter_rate:warning": "warning"}),
    (89, 11, {"dead_letter_rate:warning": "warning", "dead_letter_rate:critical": "critical"}),
    (0, 0, {}),
]


@pytest.mark.parametrize("num_events,num_dead,expected", DEAD_LETTER_CASES)
def test_dead_letter_rate_thresholds(num_events, num_dead, expected):
    results = dead_letter_checks(num_events, num_dead, warning_rate=0.01, critical_rate=0.10)
    assert failed(results) == expected
    total = num_events + num_dead
    assert results[0].details["observed_value"] == (num_dead / total if total else 0.0)


@pytest.mark.parametrize("num_events,num_dead,min_records,critical_fails,why", [
    (0, 3, 20, False, "no good events to quarantine"),     # a poison-only batch: dead letters kept, stream goes on
    (0, 500, 20, False, "no good events to quarantine"),
    (2, 1, 20, False, "fewer than 20 records"),            # a micro-batch
    (14, 5, 20, False, "fewer than 20 records"),
    (15, 5, 20, True, ""),                                 # 20 records, rate 0.25: judged
    (2, 1, 0, True, ""),                                   # min_records 0 judges every batch
])
def test_the_critical_rate_judges_only_batches_it_can_protect(num_events, num_dead, min_records, critical_fails, why):
    warning, critical = dead_letter_checks(num_events, num_dead, warning_rate=0.01, critical_rate=0.10,
                                           min_records=min_records)
    assert not warning.success, "the warning reports every batch's rate"
    assert critical.success is not critical_fails and why in critical.observed


def test_in_ranges_selects_the_batch_records():
    table = pa.table({"kafka_partition": [0, 0, 1, 1, 0], "kafka_offset": [5, 6, 6, 7, 9]})
    got = in_ranges(table, [{"topic": "t", "partition": 0, "start": 5, "end": 7}, [1, 7, 8]])
    assert got.to_pylist() == [{"kafka_partition": 0, "kafka_offset": 5}, {"kafka_partition": 0, "kafka_offset": 6},
                               {"kafka_partition": 1, "kafka_offset": 7}]
    with pytest.raises(ValueError, match="expected"):
        in_ranges(table, [[0, 1]])


def test_unique_counts_every_row_of_a_duplicated_key_and_skips_nulls():
    table = pa.table({"a": ["x", "y", "x", None, None, "z"], "b": [1, 1, 1, 1, 1, 2]})
    got = check_unique(table, ["a", "b"])
    assert got["unexpected_count"] == 2 and got["partial_unexpected_list"] == [0, 2] and not got["success"]
    assert check_unique(table, ["b", "a"])["unexpected_count"] == 2


def test_sample_indices_are_strided_and_deterministic():
    assert sample_indices(10, None) is None and sample_indices(10, 10) is None
    assert sample_indices(10, 4).to_pylist() == [0, 2, 5, 7]


def test_drift_hand_checked():
    config = ValidationConfig(drift_history_batches=2, max_volume_change=0.5, max_null_rate_change=0.1)
    history = [{"num_rows": 1000.0}, {"num_rows": 100.0, "null_rate:x": 0.0}, {"num_rows": 120.0, "null_rate:x": 0.1}]
    current = {"num_rows": 170.0, "null_rate:x": 0.3, "mean:f": 2.0}
    results = {r.name: r for r in drift_checks(current, history, config)}
    # baseline over the newest K=2 batches: 110 rows, null rate 0.05
    assert results["drift:num_rows"].details["baseline"] == 110.0
    assert math.isclose(results["drift:num_rows"].details["change"], 60 / 110)
    assert not results["drift:num_rows"].success and results["drift:num_rows"].severity == "warning"
    assert math.isclose(results["drift:null_rate:x"].details["change"], 0.25) and not results["drift:null_rate:x"].success
    assert results["drift:mean:f"].success and results["drift:mean:f"].observed == "no history"


def test_drift_severity_and_zero_baseline():
    config = ValidationConfig(drift_severity="critical")
    (result,) = drift_checks({"label_rate:label_click": 0.2}, [{"label_rate:label_click": 0.0}], config)
    assert result.severity == "critical" and not result.success and result.details["change"] == "inf"
    assert change(0.0, 0.0, "relative") == 0.0


def test_profile_of_a_batch(examples_table):
    profile = profile_batch(examples_table(8))
    assert profile["num_rows"] == 8.0
    assert profile["label_rate:label_click"] == 0.5  # clicks 0,0,1,1,0,0,1,1
    assert profile["label_rate:label_click:facebook"] == 0.5  # rows 0,2,4,6 -> 0,1,0,1
    assert profile["null_rate:ad_format"] == 1.0 and profile["null_rate:example_id"] == 0.0
    assert profile["mean:f_user_clicks"] == 3.5 and profile["p50:f_user_clicks"] == 3.5
    # facebook rows 0,2,4,6 have seq lengths 0,2,1,0
    assert profile["seq_length_p50:facebook"] == 0.5
    assert profile_batch(examples_table(0)) == {"num_rows": 0.0}
