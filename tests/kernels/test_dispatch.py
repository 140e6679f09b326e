"""Dispatcher argument checks (tables of bad inputs) and the lazy triton import."""

import subprocess
import sys

import pytest
import torch

from kernels.causal_attention import causal_attention
from kernels.padding import jagged_to_padded, padded_to_jagged
from kernels.pooling import segment_sum
from kernels.softmax import jagged_softmax
from kernels.target_attention import target_attention
from kernels.types import Jagged

J = Jagged.from_lengths(torch.zeros(5, 2, 4), [2, 3])
J_OTHER = Jagged.from_lengths(torch.zeros(5, 2, 4), [3, 2])
Q = torch.zeros(2, 2, 4)

VALUE_ERRORS = [
    ("backend must be one of", lambda: segment_sum(J, backend="cuda")),
    ("max_len must be >= 0", lambda: jagged_to_padded(J, max_len=-1)),
    ("longest row needs 3", lambda: padded_to_jagged(torch.zeros(2, 2, 4), J.offsets)),
    ("expected shape \\(2, L", lambda: padded_to_jagged(torch.zeros(3, 4, 4), J.offsets)),
    ("expected \\(T,\\) or \\(T, H\\)", lambda: jagged_softmax(J)),
    ("window must be >= 1", lambda: causal_attention(J, J, J, window=0)),
    ("identical offsets", lambda: causal_attention(J, J_OTHER, J)),
    ("expected shape \\(N, 2, 4\\)", lambda: causal_attention(J, Jagged.from_lengths(torch.zeros(5, 2, 3), [2, 3]), J)),
    ("q.values: expected shape \\(T, H, Dh\\)", lambda: causal_attention(*(Jagged.from_lengths(torch.zeros(5, 8), [2, 3]),) * 3)),
    ("query has B=3 rows", lambda: target_attention(torch.zeros(3, 2, 4), J, J)),
    ("query: expected shape \\(B, H, Dh\\)", lambda: target_attention(torch.zeros(2, 8), J, J)),
    ("offsets\\[-1\\]=9 but values has 5 rows", lambda: segment_sum(Jagged(torch.zeros(5, 2), torch.tensor([0, 9])))),
]


@pytest.mark.parametrize("message, call", VALUE_ERRORS, ids=[m[:24] for m, _ in VALUE_ERRORS])
def test_value_errors(message, call):
    with pytest.raises(ValueError, match=message):
        call()


TYPE_ERRORS = [
    ("expected dtype in", lambda: segment_sum(Jagged.from_lengths(torch.zeros(2, 2, dtype=torch.int64), [2]))),
    ("differs from q dtype", lambda: causal_attention(J, Jagged(J.values.bfloat16(), J.offsets), J)),
    ("differs from query dtype", lambda: target_attention(Q.bfloat16(), J, J)),
    ("must be int64", lambda: segment_sum(Jagged(torch.zeros(2, 1), torch.tensor([0, 2], dtype=torch.int32)))),
]


@pytest.mark.parametrize("message, call", TYPE_ERRORS, ids=[m[:24] for m, _ in TYPE_ERRORS])
def test_type_errors(message, call):
    with pytest.raises(TypeError, match=message):
        call()


def test_dispatchers_do_not_import_triton():
    code = (
        "import sys, kernels.padding, kernels.pooling, kernels.softmax, kernels.causal_attention,"
        " kernels.target_attention; print('triton' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
