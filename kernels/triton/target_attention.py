"""Triton target attention: one query per row against the row's jagged history.

Shape letters: B batch, T total history tokens, H heads, Dh head dim.
One program per (row, head x head-dim tile) streams the row's keys in BLOCK_L tiles
with an online softmax (Milakov & Gimelshein 2018; Dao et al. 2022 "FlashAttention",
alg. 1) and saves the log-sum-exp (B, H) float32 for the backward, a single pass that
recomputes the probabilities (FlashAttention sec. 3.1 recomputation) and writes dk, dv
per token and dq per row. Empty rows give out = 0, dq = 0.

Any head dim: the score q . k sums over the head dim in BLOCK_D (<= 128) chunks and
each output's head dim is split over the grid (nothing recomputed for Dh <= 128).
With one query per row the products are matrix-vector, so there is no ``tl.dot`` and
no tensor-core path: the kernel is bound by reading k and v once. Rows run longest
first; BLOCK_L (64..128) is autotuned per (power-of-two bucket of the mean row length, Dh, H).
"""

import torch
import triton
import triton.language as tl

from kernels.triton import _util
from kernels.triton._util import autotune_configs, block_for, d_tiles, length_bucket, longest_first

# (BLOCK_L, num_warps, num_stages)
TILES = [(64, 4, 2), (128, 4, 2), (128, 8, 3)]
TUNE_KEY = ["L_BUCKET", "Dh", "H"]


@triton.jit
def _index(start, pos, H, head, Dh, d_lo, BLOCK_D: tl.constexpr):
    # Element offsets of a (len(pos), BLOCK_D) tile of one head's tokens, columns [d_lo, d_lo + BLOCK_D).
    d = d_lo + tl.arange(0, BLOCK_D)
    return ((start + pos) * H + head)[:, None] * Dh + d[None, :], d < Dh


@triton.jit
def _scores(mat, vec, vec0, start, pos, ok, H, head, Dh, D_CHUNKS: tl.constexpr, BLOCK_D: tl.constexpr):
    # (len(pos),) float32 mat_j . vec over the whole head dim; vec points at this (row, head)'s
    # vector, whose chunk 0 comes preloaded (all of it when Dh <= BLOCK_D).
    idx, d_ok = _index(start, pos, H, head, Dh, 0, BLOCK_D)
    t = tl.load(mat + idx, mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    acc = tl.sum(t * vec0[None, :], axis=1)
    for c in tl.static_range(1, D_CHUNKS):
        idx, d_ok = _index(start, pos, H, head, Dh, c * BLOCK_D, BLOCK_D)
        t = tl.load(mat + idx, mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        d = c * BLOCK_D + tl.arange(0, BLOCK_D)
        part = tl.load(vec + d, mask=d < Dh, other=0.0).to(tl.float32)
        acc += tl.sum(t * part[None, :], axis=1)
    return acc


@triton.autotune(configs=autotune_configs(("BLOCK_L",), TILES), key=TUNE_KEY)
@triton.jit
def _target_fwd_kernel(
    q, k, v, offsets, rows, out, lse, H, Dh, scale, L_BUCKET,
    D_CHUNKS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):
    row = tl.load(rows + tl.program_id(0)).to(tl.int64)
    head = (tl.program_id(1) // D_CHUNKS).to(tl.int64)
    d_lo = (tl.program_id(1) % D_CHUNKS) * BLOCK_D
    start = tl.load(offsets + row)
    length = tl.load(offsets + row + 1) - start
    d0 = tl.arange(0, BLOCK_D)
    vec = (row * H + head) * Dh
    q0 = tl.load(q + vec + d0, mask=d0 < Dh, other=0.0).to(tl.float32)
    m = float("-inf")
    denom = 0.0  # the softmax denominator (flash attention's l)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for b in range(0, length, BLOCK_L):
        pos = b + tl.arange(0, BLOCK_L).to(tl.int64)
        ok = pos < length
        s = tl.where(ok, _scores(k, q + vec, q0, start, pos, ok, H, head, Dh, D_CHUNKS, BLOCK_D) * scale, float("-inf"))
        # Every visited tile holds at least one real key, so m_new is finite.
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        denom = denom * alpha + tl.sum(p, axis=0)
        idx, d_ok = _index(start, pos, H, head, Dh, d_lo, BLOCK_D)
        vt = tl.load(v + idx, mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * vt, axis=0)
        m = m_new
    nonempty = length > 0
    res = tl.where(nonempty, acc / tl.where(nonempty, denom, 1.0), 0.0)
    d = d_lo + d0
    tl.store(out + vec + d, res.to(out.dtype.element_ty), mask=d < Dh)
    if d_lo == 0:
        tl.store(lse + row * H + head, tl.where(nonempty, m + tl.log(tl.where(nonempty, denom, 1.0)), 0.0))


@triton.autotune(configs=autotune_configs(("BLOCK_L",), TILES), key=TUNE_KEY)
@triton.jit
def _target_bwd_kernel(
    q, k, v, offsets, rows, lse, delta, dout, dq, dk, dv, H, Dh, scale, L_BUCKET,
    D_CHUNKS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):
    row = tl.load(rows + tl.program_id(0)).to(tl.int64)
    head = (tl.program_id(1) // D_CHUNKS).to(tl.int64)
    d_lo = (tl.program_id(1) % D_CHUNKS) * BLOCK_D
    start = tl.load(offsets + row)
    length = tl.load(offsets + row + 1) - start
    d0 = tl.arange(0, BLOCK_D)
    vec = (row * H + head) * Dh
    q0 = tl.load(q + vec + d0, mask=d0 < Dh, other=0.0).to(tl.float32)
    g0 = tl.load(dout + vec + d0, mask=d0 < Dh, other=0.0).to(tl.float32)
    d = d_lo + d0
    qd = tl.load(q + vec + d, mask=d < Dh, other=0.0).to(tl.float32)
    gd = tl.load(dout + vec + d, mask=d < Dh, other=0.0).to(tl.float32)
    row_lse = tl.load(lse + row * H + head)
    row_delta = tl.load(delta + row * H + head)
    dq_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for b in range(0, length, BLOCK_L):
        pos = b + tl.arange(0, BLOCK_L).to(tl.int64)
        ok = pos < length
        s = _scores(k, q + vec, q0, start, pos, ok, H, head, Dh, D_CHUNKS, BLOCK_D) * scale
        p = tl.where(ok, tl.exp(s - row_lse), 0.0)
        dp = _scores(v, dout + vec, g0, start, pos, ok, H, head, Dh, D_CHUNKS, BLOCK_D)
        ds = p * (dp - row_delta)
        idx, d_ok = _index(start, pos, H, head, Dh, d_lo, BLOCK_D)
        tile_ok = ok[:, None] & d_ok[None, :]
        kt = tl.load(k + idx, mask=tile_ok, other=0.0).to(tl.float32)
        dq_acc += tl.sum(ds[:, None] * kt, axis=0) * scale
        tl.store(dk + idx, (ds[:, None] * qd[None, :] * scale).to(dk.dtype.element_ty), mask=tile_ok)
        tl.store(dv + idx, (p[:, None] * gd[None, :]).to(dv.dtype.element_ty), mask=tile_ok)
    tl.store(dq + vec + d, dq_acc.to(dq.dtype.element_ty), mask=d < Dh)


def _launch(query: torch.Tensor, tokens: int) -> tuple[tuple[int, int], dict]:
    batch, heads, head_dim = query.shape
    block_d = block_for(head_dim)
    chunks = d_tiles(head_dim, block_d)
    # Keyed on the mean row length (T / B, known on the host), not the longest row, which
    # would cost a device sync here.
    mean_len = triton.cdiv(tokens, max(batch, 1))
    return (batch, heads * chunks), dict(L_BUCKET=length_bucket(mean_len), D_CHUNKS=chunks, BLOCK_D=block_d)


class TargetAttention(torch.autograd.Function):
    """query (B, H, Dh), keys/values (T, H, Dh) -> (B, H, Dh)."""

    @staticmethod
    def forward(ctx, query, keys, values, offsets, scale):
        query, keys, values = query.contiguous(), keys.contiguous(), values.contiguous()
        batch, heads, head_dim = query.shape
        out = _util.empty(tuple(query.shape), query)
        lse = _util.empty((batch, heads), query, torch.float32)
        rows = longest_first(offsets)
        if batch and heads and head_dim:
            grid, meta = _launch(query, keys.shape[0])
            _target_fwd_kernel[grid](query, keys, values, offsets, rows, out, lse, heads, head_dim, scale, **meta)
        ctx.save_for_backward(query, keys, values, offsets, rows, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        query, keys, values, offsets, rows, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        batch, heads, head_dim = query.shape
        delta = (dout.float() * out.float()).sum(-1).contiguous()
        dq = _util.empty(tuple(query.shape), query)
        dk = _util.empty(tuple(keys.shape), keys)
        dv = _util.empty(tuple(values.shape), values)
        if batch and heads and head_dim:
            grid, meta = _launch(query, keys.shape[0])
            _target_bwd_kernel[grid](
                query, keys, values, offsets, rows, lse, delta, dout, dq, dk, dv, heads, head_dim, ctx.scale, **meta
            )
        return dq, dk, dv, None, None


def target_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, scale: float
) -> torch.Tensor:
    """Triton twin of ``kernels.reference.target_attention.target_attention`` (differentiable)."""
    return TargetAttention.apply(query, keys, values, offsets, scale)
