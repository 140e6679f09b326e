"""The build's row state (buffer, pending) is appended to and pruned by file, not rewritten: builds over K
increments leave every table as one build over all the events does, the files of rows that stay are
left in place, and a pass reads only the pending rows with something due."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pyarrow as pa
import pytest

from gemline.config import GemlineConfig
from gemline.lake import Lake, commit_metadata, open_table, read_table
from gemline.tables import Table
from sequences.config import BuildConfig
from sequences.pipeline import _OUTPUTS, APP_ID, due_pending, run_build
from sequences.publish import deadlines, needs_labels
from sequences.state_cache import PendingKeys
from tests.conftest import build_args, with_layout
from tests.gemline.conftest import moto_endpoint, s3_bucket  # noqa: F401  (moto_endpoint: a fixture)

from .conftest import event
from .test_pipeline import write_events

HOUR = 3_600_000
DAY = 24 * HOUR
CONFIG = BuildConfig(max_seq_len=3, click_window_ms=DAY, conversion_window_ms=2 * DAY, state_lookback_ms=30 * DAY,
                     label_mode="defer", publish_delay_ms=6 * HOUR, events_gate="off")
CUTS_DAYS = (32.0, 32.5, 33.0, 33.5)
"""Increments end at these days: a long first one (its pending file holds rows that leave at the next
build and rows that stay: the file is rewritten), then three of half a day, much shorter than the
conversion window (their pending rows stay, and so do their files); past the 30-day lookback, so old
events leave the buffer."""
_BATCH_DEPENDENT = {"examples": ("published_watermark_ms",), "history": ("build",), "orphan_labels": ("close_ms",)}
"""Columns that say when a row was written, which depends on the batching by design."""


def _events() -> list[dict]:
    rng = random.Random(11)
    rows = []
    for n in range(300):
        # Half over the first 30 days (they leave the buffer), half over the last days (the pending state).
        first, last = (0, 30) if n % 2 else (30, CUTS_DAYS[-1])
        t = int(rng.uniform(first, last) * DAY)
        rows.append(event(f"e{n:03d}", t, rng.choice(["impression", "impression", "click", "conversion", "engagement"]),
                          user=rng.choice(["u1", "u2", "u3"]), item=rng.choice(["i1", "i2", "i3"]),
                          domain=rng.choice(["d1", "d2"]), category=rng.choice([None, "c1"])))
    # Entities some increments leave untouched: u4 and i4 only in the first, u5 and i5 only in the last.
    for n, (day, kind) in enumerate([(31.0, "impression"), (31.2, "click"), (32.1, "impression"),
                                     (33.1, "impression"), (33.2, "click"), (33.3, "impression")]):
        user, item = ("u4", "i4") if day < CUTS_DAYS[0] else ("u5", "i5") if day >= CUTS_DAYS[2] else ("u1", "i1")
        rows.append(event(f"x{n}", int(day * DAY), kind, user=user, item=item, domain="d1", category="c1"))
    return sorted(rows, key=lambda e: (e["event_time_ms"], e["event_id"]))


def _increments(events: list[dict]) -> list[list[dict]]:
    out, start = [], 0.0
    for end in CUTS_DAYS:
        out.append([e for e in events if start * DAY <= e["event_time_ms"] < end * DAY])
        start = end
    return out


def _tables(lake) -> dict[str, list[str]]:
    out = {}
    for name in _OUTPUTS:
        table = read_table(lake, name)
        rows = [] if table is None else table.drop_columns(list(_BATCH_DEPENDENT.get(name, ()))).to_pylist()
        out[name] = sorted(json.dumps(r, sort_keys=True, default=str) for r in rows)
    return out


def _files(lake, table: str) -> list[str]:
    dt = open_table(lake, table)
    return [] if dt is None else sorted(pa.table(dt.get_add_actions(flatten=True)).column("path").to_pylist())


@pytest.mark.parametrize("layout", ["fat", "pointer"])
def test_increments_equal_one_build_table_for_table_and_keep_files_of_staying_rows(tmp_path, layout):
    events = _events()
    whole = GemlineConfig(lake=str(tmp_path / "whole"), build=with_layout(CONFIG, layout))
    write_events(whole.lake, events, version=0)
    run_build(*build_args(whole))

    parts = GemlineConfig(lake=str(tmp_path / "parts"), build=with_layout(CONFIG, layout))
    kept_files: list[str] = []
    for n, batch in enumerate(_increments(events)):
        write_events(parts.lake, batch, version=n)
        before = set(_files(parts.lake, Table.BUILD_PENDING))
        run_build(*build_args(parts))
        after = _files(parts.lake, Table.BUILD_PENDING)
        kept_files += [f for f in after if "-kept-" in f]
        # Rows the later builds add (t >= 32 d) stay past the last close (33.5 d - 2 d): their files are
        # neither read nor rewritten; only files holding rows of the first build leave.
        added_later = {f for f in before if "-user-" in f and "build000000" not in f}
        assert added_later <= set(after), f"build {n} rewrote {sorted(added_later - set(after))}"

    assert kept_files, "no pending file held both leaving and staying rows: the case misses the rewrite"
    got, want = _tables(parts.lake), _tables(whole.lake)
    assert want[Table.BUILD_PENDING] and want[Table.BUILD_BUFFER] and want[Table.BUILD_EVICTED]  # the state is used
    assert len(want[Table.BUILD_BUFFER]) < len(events)  # and events older than the lookback left the buffer
    for name in _OUTPUTS:
        assert got[name] == want[name], f"{name} differs"

    # Closing every window publishes the rest alike and empties the pending state.
    run_build(*build_args(whole), final=True)
    run_build(*build_args(parts), final=True)
    got, want = _tables(parts.lake), _tables(whole.lake)
    assert not got[Table.BUILD_PENDING]
    for name in _OUTPUTS:
        assert got[name] == want[name], f"{name} differs after the final build"


def test_due_pending_reads_exactly_the_rows_with_a_point_due(tmp_path, make_event, monkeypatch):
    """From a pending table of many rows, the rows whose first publication or (defer, no label) window
    close falls in (old close, close], plus those a new click makes a late positive (impression in
    [click - click window, click - waiting window)); compared with the rules applied to every row."""
    lake = str(tmp_path / "lake")
    config = GemlineConfig(lake=lake, build=CONFIG)
    events = _events()
    write_events(lake, [e for e in events if e["event_time_ms"] < CUTS_DAYS[0] * DAY], version=0)
    run_build(*build_args(config))
    pending = read_table(lake, Table.BUILD_PENDING)
    meta = commit_metadata(lake, Table.EXAMPLES, APP_ID)
    old_close = meta["close_ms"]
    close = old_close + 12 * HOUR
    t = pending.column("event_time_ms").to_numpy()
    rule = needs_labels(t, deadlines(pending.column("domain").to_pylist(), CONFIG), np.zeros(len(t), dtype=bool),
                        CONFIG, old_close, close)
    # A click at the close point on a row it makes a late positive (the table's row order is the files').
    row = int(np.flatnonzero((t >= close - CONFIG.click_window_ms) & (t < close - CONFIG.publish_delay_ms))[0])
    label = make_event("late", close, "click", user=pending.column("user_id")[row].as_py(),
                       item=pending.column("item_id")[row].as_py(), domain=pending.column("domain")[row].as_py())
    hit = np.array([(u, i, d) == (label["user_id"], label["item_id"], label["domain"]) for u, i, d in zip(
        *(pending.column(c).to_pylist() for c in ("user_id", "item_id", "domain")), strict=True)])
    hit &= (t >= close - CONFIG.click_window_ms) & (t < close - CONFIG.publish_delay_ms)
    assert hit.any()
    version = open_table(lake, Table.BUILD_PENDING).version()
    labels = pa.Table.from_pylist([label])
    for labelled, expected in ((labels.slice(0, 0), rule), (labels, rule | hit)):
        got = due_pending(lake, version, labelled, CONFIG, old_close, close)
        assert sorted(got.column("example_id").to_pylist()) == sorted(
            pending.column("example_id").filter(pa.array(expected)).to_pylist())
        assert 0 < got.num_rows < pending.num_rows  # some rows are due, not all
    assert due_pending(lake, version, labels, dataclasses.replace(CONFIG, label_mode="wait"), old_close,
                       old_close).num_rows == 0  # nothing due, and wait has no late positives
    # Keys held across calls (sequences.state_cache.PendingKeys): the same rows, the second call reads no file.
    keys = PendingKeys()
    want = sorted(due_pending(lake, version, labels, CONFIG, old_close, close).column("example_id").to_pylist())
    for call in range(2):
        got = due_pending(lake, version, labels, CONFIG, old_close, close, key_cache=keys)
        assert sorted(got.column("example_id").to_pylist()) == want
    assert keys.files_read == keys.files_reused == len(open_table(lake, Table.BUILD_PENDING, version).file_uris()) > 0
    # The due rows themselves come from the whole rows held: the very table the row-group read gives, row for row.
    read = due_pending(lake, version, labels, CONFIG, old_close, close)
    assert keys.rows_taken == 2 * read.num_rows > 0 and keys.whole_nbytes > 0
    assert due_pending(lake, version, labels, CONFIG, old_close, close, key_cache=keys).equals(read)
    # Over the budget (build.memory_budget_bytes // PENDING_ROWS_SHARE): keys only, the rows read from Delta.
    import sequences.pipeline as pipeline

    monkeypatch.setattr(pipeline, "PENDING_ROWS_SHARE", CONFIG.memory_budget_bytes + 1)  # a budget of 0 bytes
    lean = PendingKeys()
    assert due_pending(lake, version, labels, CONFIG, old_close, close, key_cache=lean).equals(read)
    assert lean.files_read > 0 and lean.whole_nbytes == lean.rows_taken == 0
    assert lean.take(np.arange(1, dtype=np.int64)) is None


def test_compact_state_merges_small_files_only_when_many_and_leaves_large_ones(tmp_path, monkeypatch):
    from deltalake import write_deltalake

    import sequences.pipeline as pipeline
    from gemline.hygiene import HygieneConfig

    lake, hygiene = str(tmp_path), HygieneConfig(compact_min_files=2)
    large = pa.table({"x": np.arange(20_000, dtype=np.int64)})
    write_deltalake(f"{lake}/t", large)
    [large_file] = _files(lake, "t")
    monkeypatch.setattr(pipeline, "STATE_FILE_BYTES", open_table(lake, "t").get_add_actions(flatten=True)
                        .column("size_bytes")[0].as_py() - 1)  # the first file counts as large
    for n in range(pipeline.STATE_COMPACT_FACTOR * 2 - 1):
        write_deltalake(f"{lake}/t", pa.table({"x": np.array([100_000 + n], dtype=np.int64)}), mode="append")
    files = _files(lake, "t")
    assert pipeline.compact_state(lake, "t", hygiene) == 0 and _files(lake, "t") == files  # one too few
    write_deltalake(f"{lake}/t", pa.table({"x": np.array([200_000], dtype=np.int64)}), mode="append")
    assert pipeline.compact_state(lake, "t", hygiene) == 8  # the eight small files, not the large one
    after = _files(lake, "t")
    assert len(after) == 2 and large_file in after
    assert sorted(read_table(lake, "t").column("x").to_pylist()) == [*range(20_000), *range(100_000, 100_007), 200_000]


@pytest.mark.slow
@pytest.mark.integration
def test_row_state_on_an_object_store_lake_equals_one_build(moto_endpoint):  # noqa: F811  (the fixture)
    """On S3 (moto_server) the pending rows a pass reads and the files it removes or rewrites are found by
    their paths in the remote table: two increments leave the tables one build over all the events does."""
    opts = s3_bucket(moto_endpoint, "rowstate")
    whole, parts = Lake("s3://rowstate/whole", opts), Lake("s3://rowstate/parts", opts)
    events = _events()
    write_events(whole, events, version=0)
    run_build(whole, CONFIG)
    later = [e for e in events if e["event_time_ms"] >= CUTS_DAYS[0] * DAY]
    for n, batch in enumerate(([e for e in events if e["event_time_ms"] < CUTS_DAYS[0] * DAY], later)):
        write_events(parts, batch, version=n)
        run_build(parts, CONFIG)
    got, want = _tables(parts), _tables(whole)
    assert want[Table.BUILD_PENDING]
    for name in _OUTPUTS:
        assert got[name] == want[name], f"{name} differs"
    assert any("-kept-" in f for f in _files(parts, Table.BUILD_PENDING))  # a partly leaving file was rewritten


def test_row_groups_holding_keeps_the_groups_whose_time_range_holds_a_time(tmp_path):
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    from sequences.pipeline import _row_groups_holding

    # Row groups of 4 rows: times [0..30], [40..70], [80..110], [120..150] (step 10).
    pq.write_table(pa.table({"event_time_ms": pa.array(range(0, 160, 10), pa.int64())}), tmp_path / "p.parquet",
                   row_group_size=4)
    fragments = list(ds.dataset(tmp_path / "p.parquet", format="parquet").get_fragments())
    # 35 falls between groups 0 and 1 (neither holds it), 70 is group 1's max, 150 group 3's max.
    (narrowed,) = _row_groups_holding(fragments, np.array([150, 35, 70]))
    assert [g.id for g in narrowed.row_groups] == [1, 3]
    assert narrowed.to_table().column("event_time_ms").to_pylist() == [40, 50, 60, 70, 120, 130, 140, 150]


def test_pending_row_groups_hold_about_a_megabyte_in_either_layout(tmp_path):
    """Fat pending rows carry their sequences (256 a group); pointer rows are ~65 bytes (16,384 a group): a late
    pass decoded nearly every 256-row group of a pointer lake, 8 of its 19 CPU-s (issue 20). Written files follow."""
    import pyarrow.parquet as pq

    from sequences.config import BuildConfig
    from sequences.examples import pending_schema
    from sequences.pipeline import _write_state_aware, pending_row_group_rows

    fat, pointer = (pending_schema(BuildConfig(examples_layout=layout)) for layout in ("fat", "pointer"))
    assert (pending_row_group_rows(fat), pending_row_group_rows(pointer)) == (256, 16_384)
    rows = 20_000
    table = pa.table({"event_time_ms": pa.array(np.arange(rows)[::-1], pa.int64()),
                      "example_id": pa.array([f"e{i}" for i in range(rows)])})
    lake = str(tmp_path / "lake")
    (added,) = _write_state_aware(lake, Table.BUILD_PENDING, table, "part-0", None)
    meta = pq.ParquetFile(f"{lake}/{Table.BUILD_PENDING}/{added['path']}").metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [16_384, rows - 16_384]
