"""The "sdpa" causal attention (kernels.sdpa) against its reference twin: outputs and gradients.

Named edge cases (all-empty batch, B=1, length-1 rows, ragged rows with empty ones, a 150-token
row) and hypothesis-drawn lengths, windows None, 1, 3 and one longer than every row, float32 and
bfloat16 inputs. Both compute in float32; only the summation order differs (fused online softmax vs
matmul + softmax), hence float32 atol/rtol 1e-5/1e-4 and, for bfloat16 outputs, one bf16 rounding.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.causal_attention import causal_attention
from kernels.types import Jagged

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
WINDOWS = pytest.mark.parametrize("window", [None, 1, 3, 200], ids=["full", "w1", "w3", "w200"])


def twins(lengths: list[int], window: int | None, dtype: torch.dtype, seed: int, heads: int = 2, head_dim: int = 8):
    """Outputs and q/k/v gradients of both backends under one random upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(sum(lengths), heads, head_dim, generator=gen).to(dtype) for _ in range(3)]
    offsets = Jagged.from_lengths(inputs[0], lengths).offsets
    upstream = torch.randn(sum(lengths), heads, head_dim, generator=gen).to(dtype)
    results = {}
    for backend in ("reference", "sdpa"):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        out = causal_attention(*(Jagged(t, offsets) for t in leaves), window=window, backend=backend).values  # type: ignore[arg-type]
        out.backward(upstream)
        results[backend] = [out.detach()] + [leaf.grad for leaf in leaves]
    return results["reference"], results["sdpa"]


def assert_twins(ref: list[torch.Tensor], got: list[torch.Tensor], dtype: torch.dtype) -> None:
    for name, r, g in zip(("out", "dq", "dk", "dv"), ref, got):
        assert g is not None and r is not None, name
        assert g.dtype == dtype and g.shape == r.shape, name
        torch.testing.assert_close(g.float(), r.float(), **TOL[dtype], msg=lambda m, name=name: f"{name}: {m}")


@WINDOWS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sdpa_matches_reference(lengths, window, dtype):
    ref, got = twins(lengths, window, dtype, seed=sum(lengths) + (window or 0))
    assert_twins(ref, got, dtype)


@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=6))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_sdpa_matches_reference_drawn(lengths):
    for window in (None, 2):
        assert_twins(*twins(lengths, window, torch.float32, seed=len(lengths), heads=1, head_dim=16), torch.float32)


def test_sdpa_first_token_attends_only_itself():
    # Hand-checked: a row's first token sees one key, so its output is its own value exactly.
    v = torch.randn(5, 2, 4, generator=torch.Generator().manual_seed(3))
    x = Jagged.from_lengths(v, [3, 0, 2])
    out = causal_attention(x, x, x, backend="sdpa").values
    torch.testing.assert_close(out[[0, 3]], v[[0, 3]])


def test_unknown_backend_is_a_clear_error():
    x = Jagged.from_lengths(torch.zeros(2, 1, 4), [2])
    with pytest.raises(ValueError, match="backend must be one of"):
        causal_attention(x, x, x, backend="fast")  # type: ignore[arg-type]
