""":class:`sequences.pointer_summaries.PointerSummaries` against its reference, ``sequence_summary`` over the
whole history: builds committed one by one to a lake's ``history``, each build's examples summarized as a
follower would (with the fold and the cache exercised), on random streams with late events, backfills and
label corrections; and a hand case naming which path answered each row."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import write_deltalake
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from gemline.lake import table_uri
from sequences.materialize import SequenceSummary, sequence_summary, to_pointers
from sequences.pointer_summaries import PointerSummaries

from .conftest import event
from .test_materialize import EVENTS, MODES, _events, build_steps


def _assert_twin(got: SequenceSummary, want: SequenceSummary, rows: pa.Table) -> None:
    """Equal fields, and ``newest_created_ms`` an upper bound that reaches the reference's leakage verdict."""
    np.testing.assert_array_equal(got.lengths, want.lengths)
    np.testing.assert_array_equal(got.truncated, want.truncated)
    np.testing.assert_array_equal(got.newest_ms, want.newest_ms)
    np.testing.assert_array_equal(got.unordered, want.unordered)
    nonempty = want.lengths > 0
    assert np.all(got.newest_created_ms[nonempty] >= want.newest_created_ms[nonempty])
    created = rows.column("created_ts_ms").to_numpy()
    np.testing.assert_array_equal(nonempty & (got.newest_created_ms > created), nonempty & (want.newest_created_ms > created))


def _follow(tmp_path, batches, config, **kwargs) -> PointerSummaries:
    """Commit each build's history, then summarize its examples with one follower; compare with the reference."""
    lake = str(tmp_path / "lake")
    examples, history = build_steps(batches, config)
    summaries = PointerSummaries(lake, config.max_seq_len, config.same_domain_seq_len, **kwargs)
    for n, (published, added) in enumerate(zip(examples, history, strict=True)):
        write_deltalake(table_uri(lake, "history"), added, mode="append", partition_by=["user_bucket"])
        rows = to_pointers(published)
        cross, same = summaries.summarize(rows)
        whole = pa.concat_tables(history[:n + 1])
        _assert_twin(cross, sequence_summary(rows, whole, config.max_seq_len), rows)
        _assert_twin(same, sequence_summary(rows, whole, config.same_domain_seq_len, same_domain=True), rows)
    return summaries


@settings(max_examples=15, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(EVENTS, st.integers(1, 4), st.sampled_from(MODES), st.sampled_from([(0, 0), (1, 10**9)]))
def test_pointer_summaries_equal_the_whole_history(tmp_path_factory, rows, parts, config, fold):
    """Every build's examples, folded after each batch (margin 0) or never: the same summaries as the reference."""
    events = _events(rows)
    batches = [sorted(events[k::parts], key=lambda e: e["created_ts_ms"]) for k in range(parts)]
    margin, min_rows = fold
    _follow(tmp_path_factory.mktemp("s"), batches, config, margin_builds=margin, min_fold_rows=min_rows)


def test_hand_case_paths(tmp_path):
    """N = 3. u1: three engagements (build 0), an impression at 10 s (build 1) and its late click at 50 s (build 2),
    an impression of u1 at 20 s appended with build 2 and one of u2 whose earlier event (build 1) is a backfill
    stamped with a later append time. Defer with a 1 s waiting window: the 10 s impression is published in build 2 as a negative
    with a correction for its late click; the last build closes every window, so each impression also gets its
    negative corrections. Answers: the first impression from the counts (3 earlier events, all
    kept: length 3, truncated 0), its correction from the cache, the 20 s impression from the counts (4 earlier,
    length 3, truncated 1), u2's from the reference (its earlier event appended after it)."""
    config = dataclasses.replace(MODES[2], max_seq_len=3, max_same_domain_seq_len=2, publish_delay_ms=1_000)
    old = [event(f"e{i}", 1_000 * i, "engagement", item="i9") for i in (1, 2, 3)]
    batches = [old,
               [event("imp1", 10_000, "impression", item="i1", created_ts_ms=10_001),
                event("bf", 5_000, "engagement", user="u2", created_ts_ms=90_000)],
               [event("clk1", 50_000, "click", item="i1", created_ts_ms=50_001),
                event("imp2", 20_000, "impression", item="i2", created_ts_ms=60_000),
                event("imp3", 30_000, "impression", user="u2", item="i2", created_ts_ms=30_000)]]
    summaries = _follow(tmp_path, batches, config, margin_builds=10, min_fold_rows=10**9)
    examples, _ = build_steps(batches, config)
    last = to_pointers(examples[2])
    corrections = last.filter(pc.is_valid(last.column("corrects_example_id")))
    assert set(corrections.column("corrects_example_id").to_pylist()) == {"imp1", "imp2", "imp3"}
    assert "imp1#click" in corrections.column("example_id").to_pylist()
    cross, _ = summaries.summarize(last)  # again: every row is now a cache hit
    anchors = pc.coalesce(last.column("corrects_example_id"), last.column("example_id")).to_pylist()
    assert summaries.reference_rows == anchors.count("imp3") == 3, "imp3's rows in the first pass; nothing else"
    by_id = dict(zip(last.column("example_id").to_pylist(), zip(cross.lengths, cross.truncated, strict=True), strict=True))
    assert by_id["imp1#click"] == (3, 0) and by_id["imp2"] == (3, 1)
