"""Jagged constructors and validate_jagged error messages."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.types import Jagged, validate_jagged


def test_from_lengths_builds_offsets_hand_checked():
    x = Jagged.from_lengths(torch.arange(5.0).view(5, 1), [3, 0, 2])
    assert x.offsets.tolist() == [0, 3, 3, 5]
    assert x.lengths.tolist() == [3, 0, 2]
    assert (x.batch_size, x.num_tokens, x.max_length()) == (3, 5, 3)


def test_from_dense_concatenates_rows():
    x = Jagged.from_dense([torch.ones(2, 4), torch.zeros(0, 4), torch.full((1, 4), 2.0)])
    assert x.offsets.tolist() == [0, 2, 2, 3]
    assert x.values[:, 0].tolist() == [1.0, 1.0, 2.0]


def test_empty_is_valid_and_all_rows_empty():
    x = Jagged.empty(4, (2, 3), dtype=torch.bfloat16)
    validate_jagged(x)
    assert x.values.shape == (0, 2, 3) and x.lengths.tolist() == [0, 0, 0, 0] and x.max_length() == 0


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=6))
def test_from_lengths_round_trips_lengths(lengths):
    x = Jagged.from_lengths(torch.zeros(sum(lengths), 2), lengths)
    assert x.lengths.tolist() == lengths
    assert [r.shape[0] for r in torch.split(x.values, lengths)] == lengths


BAD = [
    ("offsets\\[-1\\]=7 but values has 5 rows", Jagged(torch.zeros(5, 2), torch.tensor([0, 3, 7]))),
    ("offsets\\[0\\] must be 0, got 1", Jagged(torch.zeros(5, 2), torch.tensor([1, 3, 5]))),
    ("non-decreasing", Jagged(torch.zeros(5, 2), torch.tensor([0, 4, 2, 5]))),
    ("shape \\(B\\+1,\\)", Jagged(torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64))),
    ("0-d tensor", Jagged(torch.tensor(1.0), torch.tensor([0]))),
]


@pytest.mark.parametrize("message, x", BAD, ids=[m[:20] for m, _ in BAD])
def test_validate_rejects(message, x):
    with pytest.raises(ValueError, match=message):
        validate_jagged(x)


def test_validate_rejects_int32_offsets_with_fix():
    with pytest.raises(TypeError, match="int64.*offsets.to\\(torch.int64\\)"):
        validate_jagged(Jagged(torch.zeros(2, 1), torch.tensor([0, 2], dtype=torch.int32)))


@pytest.mark.parametrize(
    "message, call",
    [
        ("lengths must be >= 0", lambda: Jagged.from_lengths(torch.zeros(1, 1), [2, -1])),
        ("offsets\\[-1\\]=3 but values has 2 rows", lambda: Jagged.from_lengths(torch.zeros(2, 1), [1, 2])),
        ("at least one row", lambda: Jagged.from_dense([])),
        ("row 1 has shape", lambda: Jagged.from_dense([torch.zeros(1, 2), torch.zeros(1, 3)])),
        ("batch_size must be >= 0", lambda: Jagged.empty(-1)),
    ],
)
def test_constructors_reject(message, call):
    with pytest.raises(ValueError, match=message):
        call()
