"""The examples suite's sequence checks on pointer rows + history (no lists materialized) agree with the
fat checks on the same events, and catch a seeded leak, a bad pointer and a missing impression."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import sequences.materialize as materialize
from sequences.materialize import to_pointers
from tests.sequences.conftest import event
from tests.sequences.test_materialize import CONFIG, EVENTS, MODES, _events, build_batches
from validation.pointer_checks import pointer_sequence_checks, summarize_pointers
from validation.suites import check_leakage, check_seq_ascending, check_seq_lengths

_FAT = {"seq_length_matches_lists": check_seq_lengths, "leakage": check_leakage, "seq_time_ascending": check_seq_ascending}


def _flagged(checks, table: pa.Table) -> dict[str, tuple[bool, int]]:
    return {name: (r["success"], r["unexpected_count"]) for name, fn in checks.items() for r in [fn(table)]}


def _no_lists(monkeypatch):
    """Materializing a list while checking pointers fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("the pointer checks materialized a list")

    monkeypatch.setattr(materialize.SequenceIndex, "lists", refuse)
    monkeypatch.setattr(materialize, "materialize_examples", refuse)


def _newest(lists: pa.ChunkedArray) -> list[int | None]:
    return [seq[-1] if seq else None for seq in lists.to_pylist()]


@settings(max_examples=10, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(EVENTS, st.integers(1, 3), st.sampled_from(MODES))
def test_pointer_checks_agree_with_the_fat_checks(rows, parts, config):
    """Backfills, late impressions, truncation (N = 3), correction rows: the summaries equal what the
    materialized lists give, and both suites pass every row."""
    events = _events(rows)
    batches = [sorted(events[k::parts], key=lambda e: e["created_ts_ms"]) for k in range(parts)]
    fat, history = build_batches(batches, config)
    pointers = to_pointers(fat)
    summaries = summarize_pointers(pointers, history, config)
    for prefix in ("seq_", "seq_same_domain_"):
        summary = summaries[prefix]
        want_len = pc.list_value_length(fat.column(f"{prefix}event_time_ms")).to_numpy(zero_copy_only=False)
        assert summary.lengths.tolist() == want_len.tolist()
        assert summary.truncated.tolist() == fat.column(f"{prefix}truncated").to_pylist()
        lowest = np.iinfo(np.int64).min
        assert [None if t == lowest else t for t in summary.newest_ms.tolist()] == _newest(
            fat.column(f"{prefix}event_time_ms"))
        assert not summary.unordered.any()
    checks, extra = pointer_sequence_checks(pointers, history, config)
    assert [(r.name, r.success) for r in extra] == [("pointers_materialize", True)]
    assert _flagged(checks, pointers) == _flagged(_FAT, fat) == dict.fromkeys(_FAT, (True, 0))


def _seeded():
    """A fat lake's rows and history, N = 3: u1's impression at 9_000 after five events (truncated 2)."""
    first = [event(f"a{i}", 1_000 * i, "engagement") for i in range(1, 6)]
    first += [event("imp1", 9_000, "impression"), event("imp2", 9_500, "impression", user="u2")]
    fat, history = build_batches([first], CONFIG)
    return fat.sort_by("example_id"), history


def _set(table: pa.Table, example_id: str, column: str, value) -> pa.Table:
    values = table.column(column).to_pylist()
    values[table.column("example_id").to_pylist().index(example_id)] = value
    return table.set_column(table.schema.get_field_index(column), column,
                            pa.array(values, table.schema.field(column).type))


def test_a_seeded_leak_is_leakage_in_both_layouts(monkeypatch):
    """imp1 moved to 5_000, the time of its newest element: the fat rows leak an element, the pointer rows
    claim one more visible event than the rule finds; both flag imp1 and only imp1."""
    fat, history = _seeded()
    by_id = {r["example_id"]: r for r in fat.to_pylist()}
    assert by_id["imp1"]["seq_event_time_ms"] == [3_000, 4_000, 5_000] and by_id["imp1"]["seq_truncated"] == 2
    leaky = _set(fat, "imp1", "event_time_ms", 5_000)
    _no_lists(monkeypatch)
    checks, _ = pointer_sequence_checks(to_pointers(leaky), history, CONFIG)
    fat_leak, pointer_leak = check_leakage(leaky), checks["leakage"](to_pointers(leaky))
    assert fat_leak["partial_unexpected_list"] == pointer_leak["partial_unexpected_list"] == ["imp1"]
    assert not fat_leak["success"] and not pointer_leak["success"]


def test_a_bad_pointer_and_a_missing_impression_fail(monkeypatch):
    fat, history = _seeded()
    _no_lists(monkeypatch)
    bad = _set(to_pointers(fat), "imp2", "seq_same_domain_length", 1)  # u2 has no history: 0 rebuilt
    checks, extra = pointer_sequence_checks(bad, history, CONFIG)
    lengths = checks["seq_length_matches_lists"](bad)
    assert (lengths["success"], lengths["partial_unexpected_list"]) == (False, ["imp2"])
    assert checks["leakage"](bad)["partial_unexpected_list"] == ["imp2"]  # it claims an event u2 never had
    assert checks["seq_time_ascending"](bad)["success"] and extra[0].success

    lost = history.filter(pc.not_equal(history.column("event_id"), "imp1"))
    checks, extra = pointer_sequence_checks(to_pointers(fat), lost, CONFIG)
    assert (extra[0].name, extra[0].success) == ("pointers_materialize", False)
    assert "missing from history" in extra[0].observed
    with pytest.raises(ValueError, match="missing from history"):
        checks["leakage"](to_pointers(fat))


@settings(max_examples=10, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(EVENTS, st.integers(2, 4), st.sampled_from(MODES))
def test_summaries_of_several_batches_at_once_split_into_each_batchs_own(rows, parts, config):
    """A validator behind summarizes several versions' pointer rows in one pass (ValidationSession.
    prefetch_pointer_summaries): each part of the split equals the summaries of its rows alone."""
    from validation.pointer_checks import split_summaries

    events = _events(rows)
    batches = [sorted(events[k::2], key=lambda e: e["created_ts_ms"]) for k in range(2)]
    fat, history = build_batches(batches, config)
    pointers = to_pointers(fat)
    bounds = sorted({0, pointers.num_rows, *np.linspace(0, pointers.num_rows, parts + 1).astype(int).tolist()})
    pieces = [pointers.slice(lo, hi - lo) for lo, hi in zip(bounds[:-1], bounds[1:])]
    together = split_summaries(summarize_pointers(pointers, history, config), [p.num_rows for p in pieces])
    for piece, part in zip(pieces, together, strict=True):
        alone = summarize_pointers(piece, history, config)
        for prefix in alone:
            for field in ("lengths", "truncated", "newest_ms", "newest_created_ms", "unordered"):
                assert getattr(part[prefix], field).tolist() == getattr(alone[prefix], field).tolist(), (prefix, field)
