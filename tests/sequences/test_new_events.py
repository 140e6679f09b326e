"""new_event_rows: only the rows appended since the last built version, across a compaction too."""

from __future__ import annotations

from deltalake import DeltaTable

from gemline.lake import table_uri
from sequences.pipeline import new_event_rows

from .test_pipeline import write_events


def _ids(table):
    return sorted(table.column("event_id").to_pylist())


def test_new_rows_by_added_files_then_by_offsets_after_compaction(tmp_path, make_event):
    lake = str(tmp_path / "lake")
    write_events(lake, [make_event("a", 1, "impression"), make_event("b", 2, "click")], version=0)
    write_events(lake, [make_event("c", 3, "impression")], version=1)
    assert _ids(new_event_rows(lake, None, 1)) == ["a", "b", "c"]
    assert _ids(new_event_rows(lake, 0, 1)) == ["c"]
    assert _ids(new_event_rows(lake, 1, 1)) == []
    DeltaTable(table_uri(lake, "events")).optimize.compact()  # version 2 rewrites a, b, c into one file
    write_events(lake, [make_event("d", 4, "engagement")], version=2)  # version 3
    assert _ids(new_event_rows(lake, 1, 3)) == ["d"]
    assert _ids(new_event_rows(lake, 0, 3)) == ["c", "d"]
    assert new_event_rows(lake, 1, 3, columns=["event_time_ms"]).column_names == ["event_time_ms"]
