"""Launch choices of the Triton twins: the tl.dot precision, autotune candidates, the
longest-row-first schedule, and the low-precision (tensor-core) dot path run in the
interpreter with fp16 inputs (its bf16 tl.dot is broken, see kernels.triton._util.dot_mode)."""

import pytest
import torch

from kernels.reference.causal_attention import causal_attention as ref_causal
from kernels.triton import _util
from kernels.triton import causal_attention as tri_causal
from kernels.triton import target_attention as tri_target
from kernels.triton._util import DotMode, dot_mode

CUDA = torch.device("cuda")


@pytest.mark.parametrize(
    "dtype, capability, allow_tf32, expected",
    [
        (torch.bfloat16, (9, 0), False, DotMode(True, "ieee")),
        (torch.bfloat16, (8, 0), False, DotMode(True, "ieee")),
        (torch.bfloat16, (7, 5), False, DotMode(False, "ieee")),  # no bf16 tensor cores before Ampere
        (torch.float16, (7, 0), False, DotMode(True, "ieee")),
        (torch.float32, (9, 0), False, DotMode(False, "ieee")),
        (torch.float32, (9, 0), True, DotMode(False, "tf32")),
        (torch.float32, (7, 5), True, DotMode(False, "ieee")),  # no TF32 before Ampere
    ],
)
def test_dot_mode_on_cuda(monkeypatch, dtype, capability, allow_tf32, expected):
    monkeypatch.setattr(_util, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high" if allow_tf32 else "highest")
    assert dot_mode(dtype, CUDA) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dot_mode_interpreter_and_cpu_stay_fp32_ieee(dtype):
    assert _util.interpreting()  # conftest sets TRITON_INTERPRET=1
    assert dot_mode(dtype, CUDA) == DotMode(False, "ieee")
    assert dot_mode(dtype, torch.device("cpu")) == DotMode(False, "ieee")


def test_autotune_candidates(monkeypatch):
    [only] = _util.autotune_configs(("BLOCK_M", "BLOCK_N"), tri_causal.FWD_TILES)
    assert only.kwargs == {"BLOCK_M": 16, "BLOCK_N": 16}
    monkeypatch.setattr(_util, "interpreting", lambda: False)
    for blocks, tiles in [
        (("BLOCK_M", "BLOCK_N"), tri_causal.FWD_TILES),
        (("BLOCK_M", "BLOCK_N"), tri_causal.BWD_TILES),
        (("BLOCK_L",), tri_target.TILES),
    ]:
        configs = _util.autotune_configs(blocks, tiles)
        assert len(configs) == len(tiles) > 1
        assert all(set(c.kwargs) == set(blocks) and all(64 <= b <= 128 for b in c.kwargs.values()) for c in configs)
        assert [(c.num_warps, c.num_stages) for c in configs] == [t[-2:] for t in tiles]


def test_length_bucket_and_tiles():
    assert [_util.length_bucket(n) for n in (0, 1, 5, 64, 65, 4096)] == [1, 1, 8, 64, 128, 4096]
    assert [_util.block_for(d) for d in (8, 100, 128, 160, 256)] == [16, 128, 128, 128, 128]
    assert [_util.d_tiles(d, _util.block_for(d)) for d in (8, 128, 129, 160, 256, 257)] == [1, 1, 2, 2, 2, 3]


def test_longest_first():
    offsets = torch.tensor([0, 2, 2, 7, 10, 17])  # lengths 2, 0, 5, 3, 7
    assert _util.longest_first(offsets).tolist() == [4, 2, 3, 0, 1]
    ties = torch.tensor([0, 3, 3, 6, 6])  # lengths 3, 0, 3, 0: stable among equals
    assert _util.longest_first(ties).tolist() == [0, 2, 1, 3]
    assert _util.longest_first(torch.tensor([0])).tolist() == []


@pytest.mark.parametrize("head_dim", [8, 160])
def test_low_precision_dot_path_fp16(head_dim):
    # The tensor-core path keeps tiles in the input dtype and casts p and dS to it before
    # each dot; fp16 exercises that code in the interpreter. Tolerance: a few fp16 ulps of
    # values of order 1 (2^-10 relative each), against the reference in fp32.
    lengths = [3, 0, 18]
    offsets = torch.tensor([0, 3, 3, 21])
    gen = torch.Generator().manual_seed(40)
    base = [torch.randn(21, 1, head_dim, generator=gen).half() for _ in range(3)]
    grad = torch.randn(21, 1, head_dim, generator=gen).half()
    results = []
    for fn in (
        lambda q, k, v: ref_causal(q, k, v, offsets, max(lengths), None, 0.3),
        lambda q, k, v: tri_causal.causal_attention(q, k, v, offsets, max(lengths), None, 0.3, DotMode(True, "ieee")),
    ):
        leaves = [t.clone().requires_grad_(True) for t in base]
        out = fn(*leaves)
        out.backward(grad)
        results.append([out.detach().float()] + [t.grad.float() for t in leaves])
    for i, (ref, tri) in enumerate(zip(*results)):
        assert tri.abs().max() > 0.1, f"tensor {i} is (near) zero: the check would be vacuous"
        torch.testing.assert_close(tri, ref, atol=8e-3, rtol=8e-3, msg=lambda m: f"tensor {i}: {m}")


@pytest.mark.parametrize("block_m, block_n, window", [(32, 16, None), (16, 32, 9)])
def test_causal_attention_unequal_tiles(monkeypatch, block_m, block_n, window, make_jagged):
    # On CUDA the autotuner may pick BLOCK_M != BLOCK_N (e.g. 128 x 64); the key and query
    # ranges are rounded to different tiles then. Force such a config in the interpreter.
    import triton

    from tests.kernels.test_triton_twins import check_causal

    config = triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=1, num_stages=1)
    monkeypatch.setattr(tri_causal._causal_fwd_kernel, "configs", [config])
    monkeypatch.setattr(tri_causal._causal_bwd_kernel, "configs", [config])
    x = make_jagged([0, 40, 3, 17], (1, 8), torch.float32, seed=41)
    check_causal(x, torch.float32, seed=42, window=window)
