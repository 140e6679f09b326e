"""seq_length counts: percentiles equal np.percentile, and a build's reported p50/p99 equal a read of every example."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemline.config import GemlineConfig
from gemline.lake import commit_metadata, read_table
from sequences.config import BuildConfig
from sequences.length_counts import METADATA_KEY, add_counts, count_lengths, percentile
from sequences.pipeline import APP_ID, length_counts, run_build
from tests.conftest import build_args, with_layout
from tests.sequences.test_pipeline import write_events

QS = (0.0, 1.0, 37.3, 50.0, 99.0, 100.0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2_048), max_size=400), st.sampled_from(QS))
def test_percentile_of_counts_equals_numpy_bit_for_bit(lengths, q):
    counts = count_lengths(np.array(lengths, dtype=np.int32))
    expected = float(np.percentile(np.array(lengths, dtype=np.int32), q)) if lengths else None
    assert percentile(counts, q) == expected


@given(st.lists(st.integers(0, 300), max_size=100), st.lists(st.integers(0, 300), max_size=100))
def test_counts_of_two_parts_add_up_to_the_counts_of_both(a, b):
    assert add_counts(count_lengths(np.array(a)), count_lengths(np.array(b))) == count_lengths(np.array(a + b))


@pytest.mark.parametrize(("lengths", "q", "message"), [
    ([3, -1], 50, "seq_length must be >= 0, got -1"),
    ([3], 101, r"q must be in \[0, 100\], got 101"),
])
def test_bad_input_is_refused(lengths, q, message):
    with pytest.raises(ValueError, match=message):
        percentile(count_lengths(np.array(lengths)), q)


def test_hand_checked_case():
    # sorted 1 1 2 4: p50 at virtual index 1.5 -> (1 + 2) / 2; p99 at 2.97 -> 2 + 0.97 * 2
    counts = count_lengths(np.array([4, 1, 2, 1]))
    assert counts == {"1": 2, "2": 1, "4": 1}
    assert percentile(counts, 50) == 1.5 and percentile(counts, 99) == pytest.approx(3.94)


@pytest.mark.slow
def test_build_reports_percentiles_of_every_example_without_reading_them(tmp_path, make_event, examples_layout):
    lake = str(tmp_path / "lake")
    build = BuildConfig(max_seq_len=4, click_window_ms=100, conversion_window_ms=1_000, events_gate="off")
    config = GemlineConfig(lake=lake, build=with_layout(build, examples_layout))
    rng = np.random.default_rng(7)
    t = 1_000
    for version in range(4):
        rows = []
        for i in range(int(rng.integers(3, 12))):
            t += int(rng.integers(1, 400))
            kind = str(rng.choice(["impression", "engagement", "click"]))
            rows.append(make_event(f"e{version}_{i}", t, kind, user=f"u{rng.integers(0, 3)}", item=f"i{rng.integers(0, 4)}"))
        write_events(lake, rows, version=version)
        result = run_build(*build_args(config), final=version == 3)
        lengths = read_table(lake, "examples", columns=["seq_length"]).column("seq_length").to_numpy()
        meta = commit_metadata(lake, "examples", APP_ID)
        assert meta is not None and meta[METADATA_KEY] == count_lengths(lengths)
        # A lake whose commit carries no counts (built before they were kept) gets them from the table.
        assert length_counts(lake, {}) == meta[METADATA_KEY]
        expected = [float(np.percentile(lengths, q)) if lengths.size else None for q in (50, 99)]
        assert [result.seq_length_p50, result.seq_length_p99] == expected
    assert lengths.size > 0 and len(set(lengths.tolist())) > 1  # the case is not degenerate
    again = run_build(*build_args(config))
    assert again.skipped and [again.seq_length_p50, again.seq_length_p99] == expected
