"""benchmarks.progressive_split picks the rows of the last two examples commits, first rows only, in time order."""

import pyarrow as pa
import pytest

from benchmarks.progressive_split import last_two_commits


def test_last_two_commits_split_by_published_watermark_and_drop_corrections():
    table = pa.table({
        "example_id": ["a", "b", "c", "d", "e", "f"],
        "event_time_ms": [5, 1, 3, 2, 9, 4],
        "published_watermark_ms": [100, 100, 200, 300, 300, 300],
        "corrects_example_id": [None, None, None, None, "d", None],
    })
    older, last = last_two_commits(table)
    assert older["example_id"].to_pylist() == ["c"]
    assert last["example_id"].to_pylist() == ["d", "f"]  # time order; "e" is a correction of "d"


def test_last_two_commits_needs_two_commits():
    table = pa.table({"example_id": ["a"], "event_time_ms": [1], "published_watermark_ms": [7],
                      "corrects_example_id": pa.array([None], pa.string())})
    with pytest.raises(ValueError, match=r"need rows of >= 2 examples commits .* got \[7\]"):
        last_two_commits(table)
