"""gemline.increments: every row a data-changing commit added is read exactly once from any cursor; compactions
are never re-read; a recreated table, a vacuumed file or a missing log entry stop the reader with CursorError."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from gemline.increments import Cursor, CursorError, latest_version, read_from, read_increment, table_id

SCHEMA = pa.schema([("example_id", pa.string()), ("value", pa.int64()), ("event_date", pa.string())])


def _rows(start: int, n: int, date: str) -> pa.Table:
    return pa.table({"example_id": [f"x{i}" for i in range(start, start + n)], "value": list(range(start, start + n)),
                     "event_date": [date] * n}, schema=SCHEMA)


@pytest.fixture
def lake(tmp_path):
    uri = str(tmp_path / "examples")
    write_deltalake(uri, _rows(0, 7, "2026-01-01"), partition_by=["event_date"])  # v0
    write_deltalake(uri, pa.concat_tables([_rows(7, 4, "2026-01-01"), _rows(11, 6, "2026-01-02")]), mode="append",
                    partition_by=["event_date"])  # v1: two files, one per partition
    write_deltalake(uri, _rows(17, 0, "2026-01-03"), mode="append", partition_by=["event_date"])  # v2: no rows
    write_deltalake(uri, _rows(17, 5, "2026-01-03"), mode="append", partition_by=["event_date"])  # v3
    return tmp_path


def _read(lake, cursor, **kw) -> tuple[list[int], list[tuple[int, int, Cursor]]]:
    values, steps = [], []
    for version, batch, after in read_from(lake, "examples", cursor, **kw):
        if batch is not None:
            values += batch.column("value").to_pylist()
        steps.append((version, 0 if batch is None else batch.num_rows, after))
    return values, steps


def test_every_row_once_in_bounded_batches_with_hand_checked_cursors(lake):
    tid = table_id(lake, "examples")
    values, steps = _read(lake, Cursor(tid, 0), batch_rows=3)
    assert sorted(values) == list(range(22)) and values[:7] == list(range(7)) and values[-5:] == list(range(17, 22))
    assert all(n <= 3 for _, n, _ in steps)
    assert steps[:3] == [(0, 3, Cursor(tid, 0, 0, 3)), (0, 3, Cursor(tid, 0, 0, 6)), (0, 1, Cursor(tid, 1, 0, 0))]
    assert (2, 0, Cursor(tid, 3, 0, 0)) in steps  # the empty version is passed, no rows
    assert steps[-1][2] == Cursor(tid, 4, 0, 0)
    assert sorted(n for v, n, _ in steps if v == 1) == [1, 3, 3, 3]  # two files of v1 (4 and 6 rows), batches <= 3


def test_resuming_from_any_cursor_reads_the_rest_exactly(lake):
    tid = table_id(lake, "examples")
    everything, steps = _read(lake, Cursor(tid, 0), batch_rows=2)
    assert sorted(everything) == list(range(22))
    consumed = 0
    for _, n, after in steps:
        consumed += n
        rest, _ = _read(lake, after, batch_rows=5)
        assert rest == everything[consumed:], after  # prefix up to a cursor + the rest from it = each row once


def test_partition_columns_and_until_version(lake):
    tid = table_id(lake, "examples")
    batches = [b for _, b, _ in read_from(lake, "examples", Cursor(tid, 1), until_version=1,
                                          columns=["example_id", "event_date"]) if b is not None]
    table = pa.Table.from_batches(batches)
    assert table.column_names == ["example_id", "event_date"]
    assert sorted(zip(table["example_id"].to_pylist(), table["event_date"].to_pylist()))[:2] == [
        ("x10", "2026-01-01"), ("x11", "2026-01-02")]
    assert table.num_rows == 10 and read_increment(lake, "examples", 1).num_records == 10
    assert list(read_from(lake, "examples", Cursor(tid, 9))) == []  # past the newest version: nothing, no error


def test_a_compaction_is_never_read_again(lake):
    uri = str(lake / "examples")
    DeltaTable(uri).optimize.compact()
    compacted = latest_version(lake, "examples")
    inc = read_increment(lake, "examples", compacted)
    assert inc.operation == "OPTIMIZE" and inc.files == ()
    tid = table_id(lake, "examples")
    values, steps = _read(lake, Cursor(tid, 0), batch_rows=100)
    assert sorted(values) == list(range(22)), "the compacted copies of the rows are not read a second time"
    assert steps[-1] == (compacted, 0, Cursor(tid, compacted + 1, 0, 0))


def test_a_new_column_is_null_in_older_files(lake):
    uri = str(lake / "examples")
    wider = _rows(22, 2, "2026-01-04").append_column("weight", pa.array([0.5, 2.0]))
    write_deltalake(uri, wider, mode="append", partition_by=["event_date"], schema_mode="merge")
    tid = table_id(lake, "examples")
    table = pa.Table.from_batches([b for _, b, _ in read_from(lake, "examples", Cursor(tid, 3)) if b is not None])
    assert table["weight"].to_pylist() == [None] * 5 + [0.5, 2.0]


def test_vacuumed_file_recreated_table_and_missing_log_are_refused(lake):
    uri = str(lake / "examples")
    tid = table_id(lake, "examples")
    DeltaTable(uri).optimize.compact()
    DeltaTable(uri).vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    with pytest.raises(CursorError, match="examples@0: data file .* is gone \\(vacuumed\\?\\)"):
        list(read_from(lake, "examples", Cursor(tid, 0)))

    shutil.rmtree(uri)
    write_deltalake(uri, _rows(0, 3, "2026-01-01"), partition_by=["event_date"])
    with pytest.raises(CursorError, match="examples was recreated: its table id is .*--from-scratch"):
        list(read_from(lake, "examples", Cursor(tid, 0)))

    new_id = table_id(lake, "examples")
    (lake / "examples" / "_delta_log" / f"{0:020d}.json").rename(lake / "moved.json")
    (lake / "examples" / "_delta_log" / "_last_checkpoint").unlink(missing_ok=True)
    with pytest.raises(CursorError):
        list(read_from(lake, "examples", Cursor(new_id, 0)))


def test_bad_arguments():
    with pytest.raises(ValueError, match=">= 0"):
        Cursor("t", -1)
    assert Cursor.from_dict(Cursor("t", 3, 2, 1).to_dict()) == Cursor("t", 3, 2, 1)


class _CountingFs:
    """A pyarrow filesystem that counts ``get_file_info`` calls (the looks of a LogTip)."""

    def __init__(self, fs):
        self._fs, self.looks = fs, 0

    def get_file_info(self, path):
        self.looks += 1
        return self._fs.get_file_info(path)


def test_log_tip_follows_commits_with_one_look_when_nothing_is_new(tmp_path):
    from gemline.increments import LogTip

    tip = LogTip(tmp_path, "examples")
    tip._fs = fs = _CountingFs(tip._fs)
    assert tip.advance() is None and fs.looks == 1, "no table yet: one look for version 0's log entry"
    uri = str(tmp_path / "examples")
    write_deltalake(uri, _rows(0, 3, "2026-01-01"), partition_by=["event_date"])
    assert tip.advance() == 0 and fs.looks == 3  # 0 found, 1 not
    for i in range(30):  # a longer log costs an idle look nothing more
        write_deltalake(uri, _rows(3 + i, 1, "2026-01-01"), mode="append", partition_by=["event_date"])
    assert tip.advance() == 30 and fs.looks == 3 + 31
    before = fs.looks
    assert [tip.advance() for _ in range(5)] == [30] * 5 and fs.looks - before == 5, "one look per idle check"
    DeltaTable(uri).optimize.compact()  # a compaction is a commit too: the tip moves (its rows are not new)
    assert tip.advance() == 31 == latest_version(tmp_path, "examples")


def test_log_tip_opens_an_existing_table_once(lake):
    from gemline.increments import LogTip

    tip = LogTip(lake, "examples")
    assert tip.version is None and tip.advance() == 3 == tip.version


def test_added_files_carry_the_column_bounds_of_their_stats(lake):
    files = read_increment(lake, "examples", 1).files
    assert sorted((f.min_values["value"], f.max_values["value"], f.min_values["example_id"]) for f in files) == [
        (7, 10, "x10"), (11, 16, "x11")]
