"""Triton softmax over each jagged row.

Shape letters: B batch, T total tokens, H heads. scores (T, H). One program per
(row, H tile): pass 1 keeps an online max and rescaled sum (Milakov & Gimelshein 2018,
"Online normalizer calculation for softmax", alg. 3), pass 2 writes exp(x - m) / s.
Backward: dx = y * (dy - sum_row(y * dy)).
"""

import torch
import triton
import triton.language as tl

from kernels.triton import _util
from kernels.triton._util import block_for

BLOCK_L = 16


@triton.jit
def _softmax_fwd_kernel(x, offsets, y, H, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    start = tl.load(offsets + row)
    length = tl.load(offsets + row + 1) - start
    h_ok = h < H
    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for b in range(0, length, BLOCK_L):
        pos = b + tl.arange(0, BLOCK_L).to(tl.int64)
        ok = (pos < length)[:, None] & h_ok[None, :]
        t = tl.load(x + (start + pos)[:, None] * H + h[None, :], mask=ok, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(t, axis=0))
        # Padding heads stay at -inf; shift by 0 there to avoid (-inf) - (-inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(t - m_safe[None, :]), axis=0)
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.where(s > 0.0, s, 1.0)
    for b in range(0, length, BLOCK_L):
        pos = b + tl.arange(0, BLOCK_L).to(tl.int64)
        ok = (pos < length)[:, None] & h_ok[None, :]
        t = tl.load(x + (start + pos)[:, None] * H + h[None, :], mask=ok, other=float("-inf")).to(tl.float32)
        p = tl.exp(t - m_safe[None, :]) / s[None, :]
        tl.store(y + (start + pos)[:, None] * H + h[None, :], p.to(y.dtype.element_ty), mask=ok)


@triton.jit
def _softmax_bwd_kernel(y, dy, offsets, dx, H, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    start = tl.load(offsets + row)
    length = tl.load(offsets + row + 1) - start
    h_ok = h < H
    dot = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for b in range(0, length, BLOCK_L):
        pos = b + tl.arange(0, BLOCK_L).to(tl.int64)
        ok = (pos < length)[:, None] & h_ok[None, :]
        idx = (start + pos)[:, None] * H + h[None, :]
        yt = tl.load(y + idx, mask=ok, other=0.0).to(tl.float32)
        gt = tl.load(dy + idx, mask=ok, other=0.0).to(tl.float32)
        dot += tl.sum(yt * gt, axis=0)
    for b in range(0, length, BLOCK_L):
        pos = b + tl.arange(0, BLOCK_L).to(tl.int64)
        ok = (pos < length)[:, None] & h_ok[None, :]
        idx = (start + pos)[:, None] * H + h[None, :]
        yt = tl.load(y + idx, mask=ok, other=0.0).to(tl.float32)
        gt = tl.load(dy + idx, mask=ok, other=0.0).to(tl.float32)
        tl.store(dx + idx, (yt * (gt - dot[None, :])).to(dx.dtype.element_ty), mask=ok)


def _grid(offsets: torch.Tensor, heads: int) -> tuple[tuple[int, int], int]:
    block_h = block_for(heads, floor=1, cap=64)
    return (offsets.numel() - 1, triton.cdiv(heads, block_h)), block_h


class JaggedSoftmax(torch.autograd.Function):
    """scores (T, H) -> probabilities (T, H), normalised within each row and head."""

    @staticmethod
    def forward(ctx, scores, offsets):
        scores = scores.contiguous()
        y = _util.empty(tuple(scores.shape), scores)
        if scores.shape[0] and scores.shape[1]:
            grid, block_h = _grid(offsets, scores.shape[1])
            _softmax_fwd_kernel[grid](scores, offsets, y, scores.shape[1], BLOCK_L=BLOCK_L, BLOCK_H=block_h)
        ctx.save_for_backward(y, offsets)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, offsets = ctx.saved_tensors
        dx = _util.empty(tuple(y.shape), y)
        if y.shape[0] and y.shape[1]:
            grid, block_h = _grid(offsets, y.shape[1])
            _softmax_bwd_kernel[grid](y, dy.contiguous(), offsets, dx, y.shape[1], BLOCK_L=BLOCK_L, BLOCK_H=block_h)
        return dx, None


def jagged_softmax(scores: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``kernels.reference.softmax.jagged_softmax`` (differentiable)."""
    return JaggedSoftmax.apply(scores, offsets)
