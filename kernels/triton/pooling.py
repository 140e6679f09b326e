"""Triton segment sum / mean pooling over jagged rows.

Shape letters: B batch, T total tokens, D flattened feature width. One program per
(row, D tile) accumulates its row in float32; an empty row writes 0.
"""

import torch
import triton
import triton.language as tl

from kernels.triton import _util
from kernels.triton._util import block_for, flat_width

BLOCK_L = 16


@triton.jit
def _pool_fwd_kernel(values, offsets, out, D, MEAN: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    start = tl.load(offsets + row)
    length = tl.load(offsets + row + 1) - start
    d_ok = d < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for s in range(0, length, BLOCK_L):
        pos = s + tl.arange(0, BLOCK_L).to(tl.int64)
        ok = (pos < length)[:, None] & d_ok[None, :]
        x = tl.load(values + (start + pos)[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
        acc += tl.sum(x, axis=0)
    if MEAN:
        acc = acc / tl.maximum(length, 1).to(tl.float32)
    tl.store(out + row * D + d, acc.to(out.dtype.element_ty), mask=d_ok)


@triton.jit
def _pool_bwd_kernel(grad, offsets, out, D, MEAN: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    start = tl.load(offsets + row)
    length = tl.load(offsets + row + 1) - start
    d_ok = d < D
    g = tl.load(grad + row * D + d, mask=d_ok, other=0.0).to(tl.float32)
    if MEAN:
        g = g / tl.maximum(length, 1).to(tl.float32)
    for s in range(0, length, BLOCK_L):
        pos = s + tl.arange(0, BLOCK_L).to(tl.int64)
        ok = (pos < length)[:, None] & d_ok[None, :]
        tile = tl.zeros((BLOCK_L, BLOCK_D), dtype=tl.float32) + g[None, :]
        tl.store(out + (start + pos)[:, None] * D + d[None, :], tile.to(out.dtype.element_ty), mask=ok)


def _launch(kernel, src: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor, mean: bool) -> torch.Tensor:
    width = flat_width(tuple(out.shape[1:]))
    batch = offsets.numel() - 1
    if batch == 0 or width == 0:
        return out
    block_d = block_for(width)
    kernel[(batch, triton.cdiv(width, block_d))](
        src.contiguous(), offsets, out, width, MEAN=mean, BLOCK_L=BLOCK_L, BLOCK_D=block_d
    )
    return out


class SegmentPool(torch.autograd.Function):
    """values (T, *D) -> (B, *D) row sum (mean=False) or mean (mean=True)."""

    @staticmethod
    def forward(ctx, values, offsets, mean):
        ctx.save_for_backward(offsets)
        ctx.mean = mean
        ctx.num_tokens = values.shape[0]
        out = _util.empty((offsets.numel() - 1, *values.shape[1:]), values)
        return _launch(_pool_fwd_kernel, values, offsets, out, mean)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        out = _util.empty((ctx.num_tokens, *grad.shape[1:]), grad)
        if ctx.num_tokens == 0:
            return out, None, None
        return _launch(_pool_bwd_kernel, grad, offsets, out, ctx.mean), None, None


def segment_sum(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``kernels.reference.pooling.segment_sum`` (differentiable)."""
    return SegmentPool.apply(values, offsets, False)


def segment_mean(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``kernels.reference.pooling.segment_mean`` (differentiable)."""
    return SegmentPool.apply(values, offsets, True)
