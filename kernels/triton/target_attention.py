"""Triton target attention: one query per row against the row's jagged history.

Shape letters: B batch, T total history tokens, H heads, Dh head dim.
One program per (row, head) streams the row's keys in BLOCK_L tiles with an online
softmax (Milakov & Gimelshein 2018; Dao et al. 2022 "FlashAttention", alg. 1) and
saves the log-sum-exp (B, H) float32 for the backward, which recomputes the
probabilities (FlashAttention sec. 3.1 recomputation) and writes dk, dv per token
and dq per row. Empty rows give out = 0, dq = 0.
"""

import torch
import triton
import triton.language as tl

from kernels.triton import _util
from kernels.triton._util import block_for

BLOCK_L = 16


@triton.jit
def _target_fwd_kernel(q, k, v, offsets, out, lse, H, Dh, scale, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    start = tl.load(offsets + row)
    length = tl.load(offsets + row + 1) - start
    d = tl.arange(0, BLOCK_D)
    d_ok = d < Dh
    qv = tl.load(q + (row * H + head) * Dh + d, mask=d_ok, other=0.0).to(tl.float32)
    m = float("-inf")
    denom = 0.0  # the softmax denominator (flash attention's l)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for b in range(0, length, BLOCK_L):
        pos = b + tl.arange(0, BLOCK_L).to(tl.int64)
        ok = pos < length
        tok = ((start + pos) * H + head)[:, None] * Dh + d[None, :]
        kt = tl.load(k + tok, mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        vt = tl.load(v + tok, mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        s = tl.where(ok, tl.sum(kt * qv[None, :], axis=1) * scale, float("-inf"))
        # Every visited tile holds at least one real key, so m_new is finite.
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        denom = denom * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * vt, axis=0)
        m = m_new
    nonempty = length > 0
    res = tl.where(nonempty, acc / tl.where(nonempty, denom, 1.0), 0.0)
    tl.store(out + (row * H + head) * Dh + d, res.to(out.dtype.element_ty), mask=d_ok)
    tl.store(lse + row * H + head, tl.where(nonempty, m + tl.log(tl.where(nonempty, denom, 1.0)), 0.0))


@triton.jit
def _target_bwd_kernel(
    q, k, v, offsets, lse, delta, dout, dq, dk, dv, H, Dh, scale, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    start = tl.load(offsets + row)
    length = tl.load(offsets + row + 1) - start
    d = tl.arange(0, BLOCK_D)
    d_ok = d < Dh
    qidx = (row * H + head) * Dh + d
    qv = tl.load(q + qidx, mask=d_ok, other=0.0).to(tl.float32)
    go = tl.load(dout + qidx, mask=d_ok, other=0.0).to(tl.float32)
    row_lse = tl.load(lse + row * H + head)
    row_delta = tl.load(delta + row * H + head)
    dq_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for b in range(0, length, BLOCK_L):
        pos = b + tl.arange(0, BLOCK_L).to(tl.int64)
        ok = pos < length
        tile_ok = ok[:, None] & d_ok[None, :]
        tok = ((start + pos) * H + head)[:, None] * Dh + d[None, :]
        kt = tl.load(k + tok, mask=tile_ok, other=0.0).to(tl.float32)
        vt = tl.load(v + tok, mask=tile_ok, other=0.0).to(tl.float32)
        s = tl.sum(kt * qv[None, :], axis=1) * scale
        p = tl.where(ok, tl.exp(s - row_lse), 0.0)
        dp = tl.sum(vt * go[None, :], axis=1)
        ds = p * (dp - row_delta)
        dq_acc += tl.sum(ds[:, None] * kt, axis=0) * scale
        tl.store(dk + tok, (ds[:, None] * qv[None, :] * scale).to(dk.dtype.element_ty), mask=tile_ok)
        tl.store(dv + tok, (p[:, None] * go[None, :]).to(dv.dtype.element_ty), mask=tile_ok)
    tl.store(dq + qidx, dq_acc.to(dq.dtype.element_ty), mask=d_ok)


class TargetAttention(torch.autograd.Function):
    """query (B, H, Dh), keys/values (T, H, Dh) -> (B, H, Dh)."""

    @staticmethod
    def forward(ctx, query, keys, values, offsets, scale):
        query, keys, values = query.contiguous(), keys.contiguous(), values.contiguous()
        batch, heads, head_dim = query.shape
        out = _util.empty(tuple(query.shape), query)
        lse = _util.empty((batch, heads), query, torch.float32)
        if batch and heads and head_dim:
            _target_fwd_kernel[(batch, heads)](
                query, keys, values, offsets, out, lse, heads, head_dim, scale,
                BLOCK_L=BLOCK_L, BLOCK_D=block_for(head_dim),
            )
        ctx.save_for_backward(query, keys, values, offsets, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        query, keys, values, offsets, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        batch, heads, head_dim = query.shape
        delta = (dout.float() * out.float()).sum(-1).contiguous()
        dq = _util.empty(tuple(query.shape), query)
        dk = _util.empty(tuple(keys.shape), keys)
        dv = _util.empty(tuple(values.shape), values)
        if batch and heads and head_dim:
            _target_bwd_kernel[(batch, heads)](
                query, keys, values, offsets, lse, delta, dout, dq, dk, dv, heads, head_dim, ctx.scale,
                BLOCK_L=BLOCK_L, BLOCK_D=block_for(head_dim),
            )
        return dq, dk, dv, None, None


def target_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, scale: float
) -> torch.Tensor:
    """Triton twin of ``kernels.reference.target_attention.target_attention`` (differentiable)."""
    return TargetAttention.apply(query, keys, values, offsets, scale)
