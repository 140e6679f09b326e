""":class:`sequences.sorted_history.SortedHistory` against its reference, ``sequence_index`` over the whole
history: builds committed one by one to a lake's ``history``, each build's examples indexed as the trainer's
follower would, on random streams with late events, backfills, truncation (N = 3) and label corrections; a
hand case names which rows the window answers; a row that disagrees with history raises as the reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import write_deltalake
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from gemline.lake import table_uri
from sequences import sorted_history
from sequences.materialize import SequenceIndex, sequence_index, to_pointers
from sequences.sorted_history import SortedHistory

from .conftest import event
from .test_materialize import EVENTS, MODES, _events, build_steps


def _lists(index: SequenceIndex) -> list[list[str]]:
    ids = index.events.column("event_id").to_pylist()
    return [[ids[j] for j in index.index[a:b]] for a, b in zip(index.offsets[:-1], index.offsets[1:], strict=True)]


def _assert_twin(got: SequenceIndex, want: SequenceIndex) -> None:
    assert _lists(got) == _lists(want)
    np.testing.assert_array_equal(got.offsets, want.offsets)
    np.testing.assert_array_equal(got.truncated, want.truncated)
    np.testing.assert_array_equal(got.query_ms, want.query_ms)
    assert got.time_deltas().to_pylist() == want.time_deltas().to_pylist()


def _follow(tmp_path, batches, config) -> SortedHistory:
    lake = str(tmp_path / "lake")
    examples, history = build_steps(batches, config)
    sorted_rows = SortedHistory(lake)
    for n, (published, added) in enumerate(zip(examples, history, strict=True)):
        write_deltalake(table_uri(lake, "history"), added, mode="append", partition_by=["user_bucket"])
        rows = to_pointers(published)
        whole = pa.concat_tables(history[:n + 1])
        for max_len, same in ((config.max_seq_len, False), (config.same_domain_seq_len, True)):
            _assert_twin(sorted_rows.sequence_index(rows, max_len, same_domain=same),
                         sequence_index(rows, whole, max_len, same_domain=same))
    return sorted_rows


@settings(max_examples=15, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(EVENTS, st.integers(1, 4), st.sampled_from(MODES), st.sampled_from([0, 64]))
def test_sorted_history_equals_the_whole_history(tmp_path_factory, rows, parts, config, slack):
    """Windows of exactly N events (slack 0: many rows need the reference) or wider."""
    events = _events(rows)
    batches = [sorted(events[k::parts], key=lambda e: e["created_ts_ms"]) for k in range(parts)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sorted_history, "WINDOW_SLACK", slack)
        _follow(tmp_path_factory.mktemp("s"), batches, config)


def test_hand_case_window_and_reference(tmp_path):
    """N = 3. u1: five engagements (build 0), an impression at 10 s (build 1): its window holds the newest 3 of
    five old events (truncated 2), no reference. u2: an impression at 30 s (build 1) and, in build 0, an event
    at 40 s: an old event after the row's time, so the row goes to the reference."""
    config = dataclasses.replace(MODES[0], max_seq_len=3, max_same_domain_seq_len=2)
    batches = [[*[event(f"e{i}", 1_000 * i, "engagement", item="i9") for i in range(1, 6)],
                event("late", 40_000, "engagement", user="u2", created_ts_ms=40_001)],
               [event("imp1", 10_000, "impression", created_ts_ms=50_000),
                event("imp2", 30_000, "impression", user="u2", created_ts_ms=50_000)]]
    examples, _ = build_steps(batches, config)
    got = _follow(tmp_path, batches, config)
    rows = to_pointers(examples[1]).sort_by("example_id")
    assert rows.column("example_id").to_pylist() == ["imp1", "imp2"]
    before = got.reference_rows
    index = got.sequence_index(rows, 3)
    assert _lists(index)[0] == ["e3", "e4", "e5"] and index.truncated[0] == 2
    assert got.reference_rows - before == 1, "imp2 only"
    bad = rows.set_column(rows.schema.get_field_index("seq_truncated"), "seq_truncated", pa.array([1, 0], pa.int64()))
    with pytest.raises(ValueError, match="seq_truncated unlike the stored value"):
        got.sequence_index(bad, 3)
    lost = rows.set_column(rows.schema.get_field_index("example_id"), "example_id",
                           pc.binary_join_element_wise(rows.column("example_id"), "?", ""))
    with pytest.raises(ValueError, match="missing from history"):
        got.sequence_index(lost, 3)



def test_hand_case_a_window_of_the_rows_own_build(tmp_path, monkeypatch):
    """N = 3, windows of exactly 3 events. u1: e1..e5 (build 0); f1..f3 then an impression (build 1). The window
    holds f1..f3 (all shown, kept); before it, e3..e5 are the newest 3 of build 0, shown but not kept: 6 shown,
    truncated = (5 - 3) + 6 - 3 = 5, answered without the reference."""
    monkeypatch.setattr(sorted_history, "WINDOW_SLACK", 0)
    config = dataclasses.replace(MODES[0], max_seq_len=3, max_same_domain_seq_len=2)
    batches = [[event(f"e{i}", 1_000 * i, "engagement", item="i9") for i in range(1, 6)],
               [*[event(f"f{i}", 10_000 + 1_000 * i, "engagement", item="i8") for i in range(1, 4)],
                event("imp", 20_000, "impression", created_ts_ms=30_000)]]
    held = _follow(tmp_path, batches, config)
    examples, _ = build_steps(batches, config)
    rows = to_pointers(examples[1])
    before = held.reference_rows
    index = held.sequence_index(rows, 3)
    assert _lists(index) == [["f1", "f2", "f3"]] and index.truncated.tolist() == [5]
    assert held.reference_rows == before


def test_hand_case_an_impression_sharing_its_millisecond(tmp_path, monkeypatch):
    """N = 3. u1: e1..e4 (build 0), then "a-click" and the impression "b-imp" at the same 10 s (build 1): the
    held order puts a-click first, so the impression is found second among the events of its millisecond; its
    sequence is e2..e4 (truncated 1), as the reference's. With a tie limit of 1 it is looked up among its user's
    rows instead, with the same answer; the other impression (u2, alone at its time) never is."""
    config = dataclasses.replace(MODES[0], max_seq_len=3, max_same_domain_seq_len=2)
    batches = [[event(f"e{i}", 1_000 * i, "engagement", item="i9") for i in range(1, 5)],
               [event("a-click", 10_000, "engagement", item="i7", created_ts_ms=9_000),
                event("b-imp", 10_000, "impression", created_ts_ms=20_000),
                event("c-imp", 12_000, "impression", user="u2", created_ts_ms=20_000)]]
    held = _follow(tmp_path, batches, config)
    examples, _ = build_steps(batches, config)
    rows = to_pointers(examples[1]).sort_by("example_id")
    assert rows.column("example_id").to_pylist() == ["b-imp", "c-imp"]
    for limit, lookups in ((64, 0), (1, 1)):
        monkeypatch.setattr(sorted_history, "TIE_LIMIT", limit)
        before = held.anchor_lookups
        index = held.sequence_index(rows, 3)
        assert _lists(index)[0] == ["e2", "e3", "e4"] and index.truncated[0] == 1
        assert held.anchor_lookups - before == lookups


def test_running_extremes_stay_within_each_key():
    rng = np.random.default_rng(7)
    kc = np.sort(rng.integers(0, 6, 200))
    values = rng.integers(-50, 1_000, 200)
    want_max, want_min = np.empty(200, np.int64), np.empty(200, np.int64)
    for key in np.unique(kc):
        run = np.flatnonzero(kc == key)
        want_max[run] = np.maximum.accumulate(values[run])
        want_min[run] = np.minimum.accumulate(values[run][::-1])[::-1]
    np.testing.assert_array_equal(sorted_history._within_keys(kc, values, np.maximum), want_max)
    np.testing.assert_array_equal(sorted_history._within_keys(kc, values, np.minimum, reverse=True), want_min)
    with pytest.raises(ValueError, match="running maximum forward"):
        sorted_history._within_keys(kc, values, np.minimum)


@pytest.mark.parametrize("ties", [False, True])
def test_merging_added_rows_orders_them_as_a_sort_of_everything(ties, monkeypatch):
    import polars as pl

    sorts: list[int] = []
    real_init = sorted_history._Sorted.__init__
    monkeypatch.setattr(sorted_history._Sorted, "__init__",
                        lambda self, *args: sorts.append(1) or real_init(self, *args))

    rng = np.random.default_rng(3 + ties)

    def rows(n, added):
        return pl.DataFrame({"user_id": [f"u{u}" for u in rng.integers(0, 7, n)],
                             "domain": [f"d{d}" for d in rng.integers(0, 2, n)],
                             "event_id": [f"e{2 * i + added:04d}" for i in range(n)],  # interleaved ids
                             "event_time_ms": rng.choice(1_000, n, replace=False) * 2 + 1 - added * (not ties),
                             "created_ts_ms": rng.integers(0, 10_000, n), "build": rng.integers(0, 5, n)})

    held, added = rows(120, False), rows(40, True)  # without ties: the added times are even, the held ones odd
    if ties:  # half the added rows at a held row's user, domain and millisecond: their event ids order them
        half = held.head(20).select("user_id", "domain", "event_time_ms")
        added = pl.concat([added.head(20).drop("user_id", "domain", "event_time_ms").hstack(half).select(held.columns),
                           added.tail(20)])
    placed: list[int] = []
    real_place = sorted_history._Sorted._place_ties
    monkeypatch.setattr(sorted_history._Sorted, "_place_ties",
                        lambda self, at, end, tied, *args: placed.append(tied.size) or real_place(self, at, end, tied, *args))
    for keys in (["user_id"], ["user_id", "domain"]):
        whole = pl.concat([held, added])
        base = sorted_history._Sorted(held, keys)
        before = len(sorts)
        merged = base.merged(added, whole)
        assert len(sorts) == before, "the added rows are merged in (ties placed by event id), nothing sorted again"
        fresh = sorted_history._Sorted(whole, keys)
        assert np.all(np.diff(merged.key) >= 0), "one search key order"

        def view(s):  # each row with what was derived for it, in (key, time, event id) order: codes may differ
            return (s.sorted_rows().select(*keys, "event_time_ms", "event_id", "build")
                    .with_columns(suf=s.suffix_min, pre=s.prefix_max, made=s.prefix_created)
                    .sort(*keys, "event_time_ms", "event_id"))

        assert view(merged).equals(view(fresh)) and merged.sorted_rows().height == 160

        def per_key(s):  # each key's event ids in the held order
            return s.sorted_rows().group_by(keys, maintain_order=True).agg("event_id").sort(keys)

        assert per_key(merged).equals(per_key(fresh)), "within a key: by time, then event id"
        np.testing.assert_array_equal(merged.build_positions, np.sort(merged.build * 161 + np.arange(160)))
    assert (min(placed) >= 20 if ties else placed == []), placed
