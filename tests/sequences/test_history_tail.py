"""The bounded history reads of pointer-layout rows equal the whole-history reads (their reference):
the heavy-key candidates (numpy per (key, build) pair) equal the join's, and a history compacted up to a
horizon (:mod:`sequences.history_tail`) rebuilds every example of a later build exactly, its truncation
counts included; a :class:`HistoryTail` on a lake reads only what each commit added and falls back to
the whole history for an example at or before its horizon."""

from __future__ import annotations

import dataclasses

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import sequences.materialize as materialize
from gemline.config import GemlineConfig
from gemline.increments import latest_version, rows_added
from gemline.lake import read_table
from sequences.history_tail import HistoryTail, compact, no_cut
from sequences.materialize import HistoryCut, materialize_examples, read_history, to_pointers
from sequences.pipeline import run_build
from tests.conftest import build_args

from .conftest import event
from .test_materialize import CONFIG, EVENTS, MODES, _events, build_batches
from .test_pipeline import CONFIG as PIPELINE
from .test_pipeline import _events as pipeline_events
from .test_pipeline import write_events


def _materialize(pointers: pa.Table, history: pa.Table, config, *, heavy_rows: int, cut: HistoryCut | None = None):
    old = materialize.HEAVY_KEY_ROWS
    materialize.HEAVY_KEY_ROWS = heavy_rows
    try:
        return materialize_examples(pointers, history, config, cut=cut)
    finally:
        materialize.HEAVY_KEY_ROWS = old


def _builds(pointers: pa.Table, history: pa.Table) -> np.ndarray:
    """(n,) the build each pointer row's sequence is cut at (its anchor's history row)."""
    anchor = pc.coalesce(pointers.column("corrects_example_id"), pointers.column("example_id")) \
        if "corrects_example_id" in pointers.column_names else pointers.column("example_id")
    frame = pl.DataFrame({"user_id": pointers.column("user_id"), "event_id": anchor}).with_row_index("_i")
    builds = pl.DataFrame(history.select(["user_id", "event_id", "build"]))
    return frame.join(builds, on=["user_id", "event_id"], how="left").sort("_i").get_column("build").to_numpy()


def _compacted(history: pa.Table, horizons: list[int], config) -> tuple[pa.Table, HistoryCut]:
    rows, cut = pl.DataFrame(history.select(materialize._HISTORY_COLUMNS)), no_cut()
    for horizon in horizons:
        rows, cut = compact(rows, cut, horizon, config.max_seq_len, config.same_domain_seq_len)
    return rows.to_arrow(), cut


@settings(max_examples=15, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(EVENTS, st.integers(1, 4), st.sampled_from(MODES), st.lists(st.integers(-1, 3), max_size=3))
def test_heavy_keys_and_compacted_history_equal_the_whole_history(rows, parts, config, horizons):
    events = _events(rows)
    batches = [sorted(events[k::parts], key=lambda e: e["created_ts_ms"]) for k in range(parts)]
    examples, history = build_batches(batches, config)
    pointers = to_pointers(examples)
    want = _materialize(pointers, history, config, heavy_rows=2**62)  # the join for every key: the reference
    assert want.to_pylist() == examples.select(want.schema.names).to_pylist()
    assert _materialize(pointers, history, config, heavy_rows=0).to_pylist() == want.to_pylist()  # numpy for every key
    tail, cut = _compacted(history, horizons, config)
    later = _builds(pointers, history) > cut.horizon
    mask = pa.array(later)
    for heavy_rows in (0, 2**62):
        got = _materialize(pointers.filter(mask), tail, config, heavy_rows=heavy_rows, cut=cut)
        assert got.to_pylist() == want.filter(mask).to_pylist()
    if not later.all():
        with pytest.raises(ValueError, match="compacted up to build|missing from history"):  # an impression cut or kept
            materialize_examples(pointers, tail, config, cut=cut)


def test_compaction_hand_case():
    """N = 3 cross-domain, 2 same-domain; six events of u1 in build 0 (d1: a1 a3 a5, d2: a2 a4 a6), one in
    build 1: compacting at 0 keeps the newest 3 (a4 a5 a6) and each domain's newest 2 (a3 a5, a4 a6), so a1
    and a2 are cut (u1: 2; d1: 1, d2: 1); build 1's row stays; a horizon not past the last one changes nothing."""
    config = dataclasses.replace(CONFIG, max_seq_len=3, max_same_domain_seq_len=2)
    first = [event(f"a{i}", 1_000 * i, "engagement", domain="d1" if i % 2 else "d2") for i in range(1, 7)]
    examples, history = build_batches([first, [event("imp", 9_000, "impression", domain="d1")]], config)
    rows, cut = _compacted(history, [0], config)
    assert sorted(rows.column("event_id").to_pylist()) == ["a3", "a4", "a5", "a6", "imp"]
    assert cut.horizon == 0 and cut.users.to_dicts() == [{"user_id": "u1", "cut": 2}]
    assert sorted(cut.domains.rows()) == [("u1", "d1", 1), ("u1", "d2", 1)]
    again = compact(pl.DataFrame(rows), cut, 0, 3, 2)
    assert again[0].height == rows.num_rows and again[1] is cut
    imp = examples.filter(pc.equal(examples.column("example_id"), "imp"))
    assert imp.column("seq_truncated").to_pylist() == [3] and imp.column("seq_same_domain_truncated").to_pylist() == [1]
    got = materialize_examples(to_pointers(imp), rows, config, cut=cut)
    assert got.to_pylist() == imp.select(got.schema.names).to_pylist()


@pytest.mark.slow
def test_history_tail_on_a_lake_reads_increments_and_falls_back(tmp_path, make_event):
    """Three builds: the tail answers each build's examples with the rows of the users it read increment by
    increment (equal to read_history's rebuild); compacted past an example's build, it answers that batch
    with the whole history (a fallback counted in ``full_reads``)."""
    lake = str(tmp_path / "lake")
    config = GemlineConfig(lake=lake, build=dataclasses.replace(PIPELINE, examples_layout="pointer"))
    build = config.build
    tail = HistoryTail(lake, build.max_seq_len, build.same_domain_seq_len, margin_builds=0, min_compact_rows=0)
    batches = [pipeline_events(make_event),
               [make_event("b_imp2", 2_500, "impression", user="u2", item="i3"),
                make_event("a_late", 1_100, "impression", item="i3")],
               [make_event("c_imp", 3_000, "impression", user="u2", item="i1")]]
    for version, batch in enumerate(batches):
        write_events(lake, batch, version=version)
        run_build(*build_args(config), final=version == len(batches) - 1)
        added = rows_added(lake, "examples", latest_version(lake, "examples"))
        assert added is not None and added.num_rows
        rows, cut = tail.history_for(added)
        assert cut is not None and tail.full_reads == 0
        whole = read_table(lake, "history")
        assert whole is not None and tail.rows.height + tail.cut.users.get_column("cut").sum() == whole.num_rows
        want = materialize_examples(added, read_history(lake, added.column("user_id")), build)
        assert materialize_examples(added, rows, build, cut=cut).to_pylist() == want.to_pylist()
    assert tail.cut.horizon >= 0, "compacted up to the build before the last batch's"
    examples = read_table(lake, "examples")
    assert examples is not None
    rows, cut = tail.history_for(examples)  # the first build's examples: before the horizon
    assert cut is None and tail.full_reads == 1
    want = materialize_examples(examples, read_history(lake, examples.column("user_id")), build)
    assert materialize_examples(examples, rows, build).to_pylist() == want.to_pylist()
