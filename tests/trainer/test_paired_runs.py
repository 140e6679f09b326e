"""benchmarks.paired_runs: the rows and labels two logged runs are compared on, on a hand case."""

from __future__ import annotations

import pyarrow as pa
import pytest

from benchmarks.paired_runs import paired_groups

DAY = 86_400_000


def test_shared_versions_final_click_labels_and_one_row_order():
    examples = pa.table({
        "example_id": ["e2", "e1", "e3", "e4"],
        "event_time_ms": [2 * DAY, 0, 5 * DAY, 5 * DAY],
        "label_window_closed": [False, False, True, True],
        "label_click": [0, 1, 1, 0],
    })
    runs = {
        "gem": {2: {"e1": 0.9, "e2": 0.2}, 3: {"e3": 0.6, "e4": 0.1}},
        "dlrm": {2: {"e2": 0.3, "e1": 0.4}},  # never evaluated version 3
    }
    versions, labels, scores = paired_groups(examples, runs)
    # e2's click window (1 day) is still open at the version's newest impression (day 2): masked; e1's closed.
    assert versions == [2] and [y.tolist() for y in labels] == [[1.0]]
    assert {n: [s.tolist() for s in v] for n, v in scores.items()} == {"gem": [[0.9]], "dlrm": [[0.4]]}
    runs["dlrm"][3] = {"e3": 0.5}  # lacks e4, which gem scored
    with pytest.raises(KeyError):
        paired_groups(examples, runs)
