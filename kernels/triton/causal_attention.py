"""Triton causal self-attention inside each jagged row, no padding.

Shape letters: B batch, L_max longest row, T total tokens, H heads, Dh head dim;
q, k, v, out (T, H, Dh); lse (T, H) float32. Query i of a row sees keys j of the
same row with i - window < j <= i.

FlashAttention-2 structure (Dao 2023, "FlashAttention-2", alg. 1 forward, alg. 2
backward): programs over (row, BLOCK_M query tile, head) stream key tiles with an
online softmax; the backward recomputes probabilities from the saved lse with one
kernel for dk/dv (per key tile) and one for dq (per query tile), so no atomics.
Tiles past a row's end exit after an empty loop; a window bounds the key loop, so
cost is O(T * window) instead of O(sum L_i^2).
"""

import torch
import triton
import triton.language as tl

from kernels.triton import _util
from kernels.triton._util import block_for

BLOCK_M = 16
BLOCK_N = 16


@triton.jit
def _key_range(q_lo, length, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Keys a query tile [q_lo, q_lo + BLOCK_M) can see, rounded out to key tiles.
    hi = tl.minimum(q_lo + BLOCK_M, length)
    lo = tl.maximum(q_lo - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.where(q_lo < length, hi, lo)
    return lo, hi


@triton.jit
def _allowed(m_pos, n_pos, length, window):
    return (
        (n_pos[None, :] <= m_pos[:, None])
        & (n_pos[None, :] > m_pos[:, None] - window)
        & (n_pos < length)[None, :]
        & (m_pos < length)[:, None]
    )


@triton.jit
def _tile(ptr, start, pos, length, H, head, Dh, BLOCK_D: tl.constexpr):
    # Load a (len(pos), BLOCK_D) float32 tile of one head; rows past the end read 0.
    d = tl.arange(0, BLOCK_D)
    idx = ((start + pos) * H + head)[:, None] * Dh + d[None, :]
    ok = (pos < length)[:, None] & (d < Dh)[None, :]
    return tl.load(ptr + idx, mask=ok, other=0.0).to(tl.float32), idx, ok


@triton.jit
def _causal_fwd_kernel(
    q, k, v, offsets, out, lse, H, Dh, window, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    q_lo = tl.program_id(1).to(tl.int64) * BLOCK_M
    head = tl.program_id(2).to(tl.int64)
    start = tl.load(offsets + row)
    length = tl.load(offsets + row + 1) - start
    m_pos = q_lo + tl.arange(0, BLOCK_M).to(tl.int64)
    qt, q_idx, q_ok = _tile(q, start, m_pos, length, H, head, Dh, BLOCK_D)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    lo, hi = _key_range(q_lo, length, window, BLOCK_M, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        n_pos = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        kt, _, _ = _tile(k, start, n_pos, length, H, head, Dh, BLOCK_D)
        vt, _, _ = _tile(v, start, n_pos, length, H, head, Dh, BLOCK_D)
        s = tl.dot(qt, tl.trans(kt), input_precision="ieee") * scale
        s = tl.where(_allowed(m_pos, n_pos, length, window), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A query may see no key of this tile yet: shift by 0 to avoid (-inf) - (-inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
        m_i = m_new
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    tl.store(out + q_idx, (acc / l_safe[:, None]).to(out.dtype.element_ty), mask=q_ok)
    m_ok = m_pos < length
    tl.store(lse + (start + m_pos) * H + head, m_i + tl.log(l_safe), mask=m_ok)


@triton.jit
def _causal_dkdv_kernel(
    q, k, v, offsets, lse, delta, dout, dk, dv, H, Dh, window, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n_lo = tl.program_id(1).to(tl.int64) * BLOCK_N
    head = tl.program_id(2).to(tl.int64)
    start = tl.load(offsets + row)
    length = tl.load(offsets + row + 1) - start
    n_pos = n_lo + tl.arange(0, BLOCK_N).to(tl.int64)
    kt, k_idx, k_ok = _tile(k, start, n_pos, length, H, head, Dh, BLOCK_D)
    vt, _, _ = _tile(v, start, n_pos, length, H, head, Dh, BLOCK_D)
    dk_acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv_acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    # Queries that can see this key tile: i in [n_lo, n_lo + BLOCK_N - 1 + window).
    q_lo = (n_lo // BLOCK_M) * BLOCK_M
    q_hi = tl.minimum(length, n_lo + BLOCK_N - 1 + window)
    q_hi = tl.where(n_lo < length, q_hi, q_lo)
    for m0 in range(q_lo, q_hi, BLOCK_M):
        m_pos = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
        m_ok = m_pos < length
        qt, _, _ = _tile(q, start, m_pos, length, H, head, Dh, BLOCK_D)
        gt, _, _ = _tile(dout, start, m_pos, length, H, head, Dh, BLOCK_D)
        lse_t = tl.load(lse + (start + m_pos) * H + head, mask=m_ok, other=0.0)
        delta_t = tl.load(delta + (start + m_pos) * H + head, mask=m_ok, other=0.0)
        s = tl.dot(qt, tl.trans(kt), input_precision="ieee") * scale
        s = tl.where(_allowed(m_pos, n_pos, length, window), s - lse_t[:, None], float("-inf"))
        p = tl.exp(s)
        dv_acc += tl.dot(tl.trans(p), gt, input_precision="ieee")
        dp = tl.dot(gt, tl.trans(vt), input_precision="ieee")
        ds = p * (dp - delta_t[:, None])
        dk_acc += tl.dot(tl.trans(ds), qt, input_precision="ieee") * scale
    tl.store(dk + k_idx, dk_acc.to(dk.dtype.element_ty), mask=k_ok)
    tl.store(dv + k_idx, dv_acc.to(dv.dtype.element_ty), mask=k_ok)


@triton.jit
def _causal_dq_kernel(
    q, k, v, offsets, lse, delta, dout, dq, H, Dh, window, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    q_lo = tl.program_id(1).to(tl.int64) * BLOCK_M
    head = tl.program_id(2).to(tl.int64)
    start = tl.load(offsets + row)
    length = tl.load(offsets + row + 1) - start
    m_pos = q_lo + tl.arange(0, BLOCK_M).to(tl.int64)
    m_ok = m_pos < length
    qt, q_idx, q_ok = _tile(q, start, m_pos, length, H, head, Dh, BLOCK_D)
    gt, _, _ = _tile(dout, start, m_pos, length, H, head, Dh, BLOCK_D)
    lse_t = tl.load(lse + (start + m_pos) * H + head, mask=m_ok, other=0.0)
    delta_t = tl.load(delta + (start + m_pos) * H + head, mask=m_ok, other=0.0)
    dq_acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    lo, hi = _key_range(q_lo, length, window, BLOCK_M, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        n_pos = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        kt, _, _ = _tile(k, start, n_pos, length, H, head, Dh, BLOCK_D)
        vt, _, _ = _tile(v, start, n_pos, length, H, head, Dh, BLOCK_D)
        s = tl.dot(qt, tl.trans(kt), input_precision="ieee") * scale
        s = tl.where(_allowed(m_pos, n_pos, length, window), s - lse_t[:, None], float("-inf"))
        p = tl.exp(s)
        dp = tl.dot(gt, tl.trans(vt), input_precision="ieee")
        ds = p * (dp - delta_t[:, None])
        dq_acc += tl.dot(ds, kt, input_precision="ieee") * scale
    tl.store(dq + q_idx, dq_acc.to(dq.dtype.element_ty), mask=q_ok)


def _grid(offsets: torch.Tensor, max_len: int, heads: int, block: int) -> tuple[int, int, int]:
    return (offsets.numel() - 1, triton.cdiv(max_len, block), heads)


class CausalAttention(torch.autograd.Function):
    """q, k, v (T, H, Dh) -> out (T, H, Dh), causal (optionally windowed) per row."""

    @staticmethod
    def forward(ctx, q, k, v, offsets, max_len, window, scale):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        tokens, heads, head_dim = q.shape
        out = _util.empty(tuple(q.shape), q)
        lse = _util.empty((tokens, heads), q, torch.float32)
        if tokens and heads and head_dim:
            _causal_fwd_kernel[_grid(offsets, max_len, heads, BLOCK_M)](
                q, k, v, offsets, out, lse, heads, head_dim, window, scale,
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=block_for(head_dim),
            )
        ctx.save_for_backward(q, k, v, offsets, out, lse)
        ctx.max_len, ctx.window, ctx.scale = max_len, window, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, offsets, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        tokens, heads, head_dim = q.shape
        delta = (dout.float() * out.float()).sum(-1).contiguous()
        dq, dk, dv = _util.empty(tuple(q.shape), q), _util.empty(tuple(k.shape), k), _util.empty(tuple(v.shape), v)
        if tokens and heads and head_dim:
            common = (heads, head_dim, ctx.window, ctx.scale)
            blocks = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=block_for(head_dim))
            _causal_dkdv_kernel[_grid(offsets, ctx.max_len, heads, BLOCK_N)](
                q, k, v, offsets, lse, delta, dout, dk, dv, *common, **blocks
            )
            _causal_dq_kernel[_grid(offsets, ctx.max_len, heads, BLOCK_M)](
                q, k, v, offsets, lse, delta, dout, dq, *common, **blocks
            )
        return dq, dk, dv, None, None, None, None


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Triton twin of ``kernels.reference.causal_attention.causal_attention`` (differentiable)."""
    # "No window" is a window as long as the longest row: it never excludes a key.
    effective = max(max_len, 1) if window is None else min(window, max(max_len, 1))
    return CausalAttention.apply(q, k, v, offsets, max_len, effective, scale)
