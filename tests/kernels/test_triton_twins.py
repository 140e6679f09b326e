"""Every Triton op against its PyTorch reference: outputs and gradients.

Inputs: named edge cases (all-empty batch, B=1, length-1 rows, lengths off the
16-wide tile, a 150-token row) in float32 and bfloat16, plus hypothesis-drawn
lengths in float32. Outputs are NaN-prefilled (conftest), so unwritten elements fail.
Tolerances: float32 atol/rtol 1e-5/1e-4 (only summation order differs); bfloat16
2e-2/2e-2 (one bf16 ulp is 2^-7 relative; both paths compute in float32 and round once,
but the interpreter's float32->bf16 cast may round differently from torch's).
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.causal_attention import causal_attention
from kernels.padding import jagged_to_padded, padded_to_jagged
from kernels.pooling import segment_mean, segment_sum
from kernels.softmax import jagged_softmax
from kernels.target_attention import target_attention
from kernels.types import Jagged

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
HYP = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def run_both(fn, inputs: list[torch.Tensor], seed: int):
    """Run fn(backend, *leaves) on both backends with a shared random upstream grad.

    Returns [(out_ref, out_tri), (grad_ref_i, grad_tri_i)...] as float32.
    """
    results = {}
    for backend in ("reference", "triton"):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        out = fn(backend, *leaves)
        gen = torch.Generator().manual_seed(seed)
        upstream = torch.randn(out.shape, generator=gen).to(out.dtype)
        out.backward(upstream)
        results[backend] = [out.detach().float()] + [leaf.grad.float() for leaf in leaves]
    return list(zip(results["reference"], results["triton"]))


def assert_twins(pairs, dtype):
    for i, (ref, tri) in enumerate(pairs):
        assert not torch.isnan(tri).any(), f"tensor {i}: triton left NaN (unwritten) elements"
        torch.testing.assert_close(tri, ref, **TOL[dtype], msg=lambda m: f"tensor {i} (0=output, then grads): {m}")


def check_padding(x: Jagged, dtype, seed: int, max_len: int | None, pad_value: float):
    def fn(backend, values):
        return jagged_to_padded(Jagged(values, x.offsets), max_len=max_len, pad_value=pad_value, backend=backend)

    assert_twins(run_both(fn, [x.values], seed), dtype)

    def back(backend, padded):
        return padded_to_jagged(padded, x.offsets, backend=backend).values

    padded = jagged_to_padded(x, pad_value=pad_value)
    assert_twins(run_both(back, [padded], seed), dtype)


def check_pooling(x: Jagged, dtype, seed: int):
    for op in (segment_sum, segment_mean):
        assert_twins(run_both(lambda b, v: op(Jagged(v, x.offsets), backend=b), [x.values], seed), dtype)


def check_softmax(x: Jagged, dtype, seed: int):
    fn = lambda b, v: jagged_softmax(Jagged(v, x.offsets), backend=b).values  # noqa: E731
    assert_twins(run_both(fn, [x.values], seed), dtype)


def check_causal(x: Jagged, dtype, seed: int, window: int | None):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(x.values.shape, generator=gen).to(dtype) for _ in range(3))

    def fn(backend, q, k, v):
        j = lambda t: Jagged(t, x.offsets)  # noqa: E731
        return causal_attention(j(q), j(k), j(v), window=window, backend=backend).values

    assert_twins(run_both(fn, [q, k, v], seed), dtype)


def check_target(x: Jagged, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(x.values.shape, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn((x.batch_size, *x.values.shape[1:]), generator=gen).to(dtype)

    def fn(backend, q, k, v):
        return target_attention(q, Jagged(k, x.offsets), Jagged(v, x.offsets), backend=backend)

    assert_twins(run_both(fn, [q, k, v], seed), dtype)


@DTYPES
def test_padding_edge_cases(lengths, dtype, make_jagged):
    x = make_jagged(lengths, (3, 5), dtype, seed=1)
    check_padding(x, dtype, seed=2, max_len=None, pad_value=-7.0)
    check_padding(x, dtype, seed=3, max_len=4, pad_value=0.0)


@DTYPES
def test_pooling_edge_cases(lengths, dtype, make_jagged):
    check_pooling(make_jagged(lengths, (6,), dtype, seed=4), dtype, seed=5)


@DTYPES
@pytest.mark.parametrize("heads", [None, 3], ids=["1d", "heads3"])
def test_softmax_edge_cases(lengths, dtype, heads, make_jagged):
    feature = () if heads is None else (heads,)
    check_softmax(make_jagged(lengths, feature, dtype, seed=6), dtype, seed=7)


@DTYPES
@pytest.mark.parametrize("window", [None, 5])
def test_causal_attention_edge_cases(lengths, dtype, window, make_jagged):
    # One head here to keep the interpreter fast; the hypothesis test covers H=2.
    check_causal(make_jagged(lengths, (1, 8), dtype, seed=8), dtype, seed=9, window=window)


@pytest.mark.slow
@DTYPES
@pytest.mark.parametrize("window", [1, 20])
def test_causal_attention_more_windows(lengths, dtype, window, make_jagged):
    check_causal(make_jagged(lengths, (2, 8), dtype, seed=12), dtype, seed=13, window=window)


@DTYPES
def test_target_attention_edge_cases(lengths, dtype, make_jagged):
    check_target(make_jagged(lengths, (2, 8), dtype, seed=10), dtype, seed=11)


@HYP
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_all_ops_random_lengths(data, seed, lengths_strategy, make_jagged):
    lengths = data.draw(lengths_strategy, label="lengths")
    dim = data.draw(st.integers(1, 20), label="dim")
    x = make_jagged(lengths, (dim,), torch.float32, seed)
    check_padding(x, torch.float32, seed, max_len=data.draw(st.none() | st.integers(0, 45)), pad_value=1.5)
    check_pooling(x, torch.float32, seed)
    check_softmax(make_jagged(lengths, (2,), torch.float32, seed), torch.float32, seed)
    heads_x = make_jagged(lengths, (2, dim), torch.float32, seed)
    check_causal(heads_x, torch.float32, seed, window=data.draw(st.none() | st.integers(1, 45), label="window"))
    check_target(heads_x, torch.float32, seed)


# Head dims past the 128-wide tile: 160 is one full tile plus a 32-column remainder, 256 two
# full tiles. Rows of a few tokens with an empty row, the longest row in the middle (it is
# scheduled first), 1-2 heads, fp32 ieee: the interpreter is slow at these widths.
WIDE = pytest.mark.parametrize("heads, head_dim", [(1, 160), (2, 256)], ids=["h1_d160", "h2_d256"])


@WIDE
@pytest.mark.parametrize("window", [None, 2])
def test_causal_attention_wide_heads(heads, head_dim, window, make_jagged):
    x = make_jagged([2, 0, 19, 3], (heads, head_dim), torch.float32, seed=20)
    check_causal(x, torch.float32, seed=21, window=window)


@WIDE
def test_target_attention_wide_heads(heads, head_dim, make_jagged):
    check_target(make_jagged([2, 0, 19, 3], (heads, head_dim), torch.float32, seed=22), torch.float32, seed=23)


@WIDE
def test_attention_wide_heads_all_empty(heads, head_dim, make_jagged):
    x = make_jagged([0, 0], (heads, head_dim), torch.float32, seed=24)
    check_causal(x, torch.float32, seed=25, window=None)
    check_target(x, torch.float32, seed=25)


def test_attention_wide_heads_random_rows(make_jagged):
    # Random lengths in 0..6 (a third empty on average) at head dim 160, two heads.
    gen = torch.Generator().manual_seed(26)
    lengths = torch.randint(0, 7, (5,), generator=gen).mul(torch.rand(5, generator=gen) > 0.33).tolist()
    x = make_jagged(lengths, (2, 160), torch.float32, seed=27)
    check_causal(x, torch.float32, seed=28, window=None)
    check_target(x, torch.float32, seed=28)


def test_feature_ops_wider_than_one_tile(make_jagged):
    # Padding and pooling tile the flattened width (here 300 > 128) over the grid, softmax
    # the heads (here 130 > 64): every tile must be covered.
    x = make_jagged([2, 0, 17], (3, 100), torch.float32, seed=29)
    check_padding(x, torch.float32, seed=30, max_len=None, pad_value=0.5)
    check_pooling(x, torch.float32, seed=31)
    check_softmax(make_jagged([2, 0, 17], (130,), torch.float32, seed=32), torch.float32, seed=33)
