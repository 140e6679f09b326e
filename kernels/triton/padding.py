"""Triton jagged <-> padded conversion.

Shape letters: B batch, L padded length, T total tokens, D flattened feature width.
One program per (row, D tile) walks its row in BLOCK_L chunks, so a long row costs
loop iterations, not extra programs. Each kernel is the other's backward.
"""

import torch
import triton
import triton.language as tl

from kernels.triton import _util
from kernels.triton._util import block_for, flat_width

BLOCK_L = 16


@triton.jit
def _jagged_to_padded_kernel(values, offsets, out, D, L, pad_value, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    start = tl.load(offsets + row)
    length = tl.load(offsets + row + 1) - start
    d_ok = d < D
    for s in range(0, L, BLOCK_L):
        pos = s + tl.arange(0, BLOCK_L).to(tl.int64)
        in_row = (pos < length)[:, None] & d_ok[None, :]
        x = tl.load(values + (start + pos)[:, None] * D + d[None, :], mask=in_row, other=0.0).to(tl.float32)
        x = tl.where(in_row, x, pad_value)
        dst = out + (row * L + pos)[:, None] * D + d[None, :]
        tl.store(dst, x.to(out.dtype.element_ty), mask=(pos < L)[:, None] & d_ok[None, :])


@triton.jit
def _padded_to_jagged_kernel(padded, offsets, out, D, L, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    start = tl.load(offsets + row)
    length = tl.load(offsets + row + 1) - start
    d_ok = d < D
    for s in range(0, length, BLOCK_L):
        pos = s + tl.arange(0, BLOCK_L).to(tl.int64)
        in_row = pos < length
        # Positions past L were truncated on the way in: they read (and get) zero.
        src_ok = (in_row & (pos < L))[:, None] & d_ok[None, :]
        x = tl.load(padded + (row * L + pos)[:, None] * D + d[None, :], mask=src_ok, other=0.0).to(tl.float32)
        dst = out + (start + pos)[:, None] * D + d[None, :]
        tl.store(dst, x.to(out.dtype.element_ty), mask=in_row[:, None] & d_ok[None, :])


def _to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int, pad_value: float) -> torch.Tensor:
    batch = offsets.numel() - 1
    feature = tuple(values.shape[1:])
    width = flat_width(feature)
    out = _util.empty((batch, max_len, *feature), values)
    if batch == 0 or max_len == 0 or width == 0:
        return out.fill_(pad_value) if out.numel() else out
    block_d = block_for(width)
    grid = (batch, triton.cdiv(width, block_d))
    _jagged_to_padded_kernel[grid](
        values.contiguous(), offsets, out, width, max_len, float(pad_value), BLOCK_L=BLOCK_L, BLOCK_D=block_d
    )
    return out


def _to_jagged(padded: torch.Tensor, offsets: torch.Tensor, num_tokens: int) -> torch.Tensor:
    batch, length = padded.shape[0], padded.shape[1]
    feature = tuple(padded.shape[2:])
    width = flat_width(feature)
    out = _util.empty((num_tokens, *feature), padded)
    if num_tokens == 0 or width == 0:
        return out
    block_d = block_for(width)
    grid = (batch, triton.cdiv(width, block_d))
    _padded_to_jagged_kernel[grid](padded.contiguous(), offsets, out, width, length, BLOCK_L=BLOCK_L, BLOCK_D=block_d)
    return out


class JaggedToPadded(torch.autograd.Function):
    """values (T, *D) -> padded (B, max_len, *D); backward gathers the grad back."""

    @staticmethod
    def forward(ctx, values, offsets, max_len, pad_value):
        ctx.save_for_backward(offsets)
        ctx.num_tokens = values.shape[0]
        return _to_padded(values, offsets, max_len, pad_value)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        return _to_jagged(grad, offsets, ctx.num_tokens), None, None, None


class PaddedToJagged(torch.autograd.Function):
    """padded (B, L, *D) -> values (T, *D); backward scatters the grad, zero-padded."""

    @staticmethod
    def forward(ctx, padded, offsets, num_tokens):
        ctx.save_for_backward(offsets)
        ctx.max_len = padded.shape[1]
        return _to_jagged(padded, offsets, num_tokens)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        return _to_padded(grad, offsets, ctx.max_len, 0.0), None, None


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int, pad_value: float) -> torch.Tensor:
    """Triton twin of ``kernels.reference.padding.jagged_to_padded`` (differentiable)."""
    return JaggedToPadded.apply(values, offsets, max_len, pad_value)


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Triton twin of ``kernels.reference.padding.padded_to_jagged`` (differentiable)."""
    return PaddedToJagged.apply(padded, offsets, num_tokens)
