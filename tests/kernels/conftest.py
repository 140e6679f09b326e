"""Kernel test set-up: Triton runs on CPU through its interpreter.

TRITON_INTERPRET must be set before anything imports triton, hence at the very top.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kernels.types import Jagged  # noqa: E402

# Named edge cases every op is checked on. BLOCK sizes are 16, so 17 and 33 are not
# multiples of a tile; 150 spans ten tiles.
LENGTH_CASES = {
    "all_empty": [0, 0, 0],
    "batch1": [5],
    "length1_rows": [1, 1, 0, 1],
    "ragged_with_empty": [0, 1, 16, 17, 0, 33],
    "long_row": [3, 150, 0],
}


@pytest.fixture(params=list(LENGTH_CASES.values()), ids=list(LENGTH_CASES))
def lengths(request) -> list[int]:
    """Row lengths of one named edge case."""
    return request.param


@pytest.fixture(scope="session")
def lengths_strategy():
    """Hypothesis strategy for row lengths: B in 1..5, L_i in 0..40 (empty rows likely)."""
    return st.lists(st.one_of(st.just(0), st.just(1), st.integers(0, 40)), min_size=1, max_size=5)


@pytest.fixture(scope="session")
def make_jagged():
    """Factory: random Jagged with given lengths, feature shape, dtype and seed."""

    def make(lengths: list[int], feature: tuple[int, ...], dtype: torch.dtype, seed: int) -> Jagged:
        gen = torch.Generator().manual_seed(seed)
        values = torch.randn((sum(lengths), *feature), generator=gen).to(dtype)
        return Jagged.from_lengths(values, lengths)

    return make


@pytest.fixture(autouse=True)
def nan_filled_outputs(monkeypatch):
    """Kernel outputs start as NaN, so an element a kernel never writes fails."""
    import kernels.triton._util as util

    def nan_empty(shape, like, dtype=None):
        return torch.full(shape, float("nan"), dtype=like.dtype if dtype is None else dtype, device=like.device)

    monkeypatch.setattr(util, "empty", nan_empty)
