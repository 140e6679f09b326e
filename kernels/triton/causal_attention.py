"""Triton causal self-attention inside each jagged row, no padding.

Shape letters: B batch, L_max longest row, T total tokens, H heads, Dh head dim;
q, k, v, out (T, H, Dh); lse (T, H) float32. Query i of a row sees keys j of the
same row with i - window < j <= i.

FlashAttention-2 structure (Dao 2023, "FlashAttention-2", alg. 1 forward, alg. 2
backward). Forward: programs over (row, BLOCK_M query tile, head x head-dim tile)
stream key tiles with an online softmax. Backward: one pass, programs over key tiles
recompute the probabilities once from the saved lse and accumulate dk, dv in
registers and dq with atomic adds into a float32 buffer (FlashAttention-2 sec. 3.1;
generative-recommenders' HSTU Triton backward does the same), instead of a second
kernel that recomputed q k^T and dO v^T per query tile.

Any head dim: q k^T and dO v^T sum over the head dim in BLOCK_D (<= 128) chunks,
and each output's head dim is split over the grid, so Dh = 160 runs two programs
per (tile, head), each recomputing the scores over all 160 columns and writing its
own 128 (or 32) output columns. For Dh <= 128 (one chunk) nothing is recomputed.

Scheduling: the row axis of the grid is a longest-first permutation of the rows and
query tiles run from the last (most keys) to the first, so the heaviest programs
start first. Tiles past a row's end exit after an empty loop; a window bounds the key
loop, so cost is O(T * window) instead of O(sum L_i^2). Tiles (BLOCK_M, BLOCK_N in
64..128) are autotuned per (power-of-two bucket of L_max, Dh, H).
"""

import torch
import triton
import triton.language as tl

from kernels.triton import _util
from kernels.triton._util import DotMode, autotune_configs, block_for, d_tiles, dot_mode, length_bucket, longest_first

# (BLOCK_M, BLOCK_N, num_warps, num_stages), after FlashAttention-2's Triton tutorial. The last,
# unpipelined 64 x 64 tile is the fallback that fits shared memory where the others do not
# (fp32 "ieee" at head dim 160: 279 KB with 3 stages vs 115 KB with 1, compiled for sm_90; an
# H100/H200 block gets 227 KB; the autotuner skips configs that fail to launch).
FWD_TILES = [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 2), (128, 128, 8, 2), (64, 64, 4, 1)]
BWD_TILES = [(64, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (128, 128, 8, 1), (64, 64, 4, 1)]
TUNE_KEY = ["L_BUCKET", "Dh", "H"]


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
def _index(start, pos, length, H, head, Dh, d_lo, BLOCK_D: tl.constexpr):
    # Element offsets of a (len(pos), BLOCK_D) tile of one head, columns [d_lo, d_lo + BLOCK_D),
    # and the mask of those inside the row and the head dim.
    d = d_lo + tl.arange(0, BLOCK_D)
    idx = ((start + pos) * H + head)[:, None] * Dh + d[None, :]
    ok = (pos < length)[:, None] & (d < Dh)[None, :]
    return idx, ok


@triton.jit
def _tile(ptr, start, pos, length, H, head, Dh, d_lo, BLOCK_D: tl.constexpr, LOW: tl.constexpr):
    # Load a tile (see _index); masked elements read 0. fp32 unless LOW keeps the input dtype.
    idx, ok = _index(start, pos, length, H, head, Dh, d_lo, BLOCK_D)
    t = tl.load(ptr + idx, mask=ok, other=0.0)
    if not LOW:
        t = t.to(tl.float32)
    return t, idx, ok


@triton.jit
def _dot_rows(
    a_ptr, a_pos, a0, b_ptr, b_pos, b0, start, length, H, head, Dh,
    D_CHUNKS: tl.constexpr, BLOCK_D: tl.constexpr, LOW: tl.constexpr, PRECISION: tl.constexpr,
):
    # a @ b^T over the whole head dim, fp32: chunk 0 of both comes preloaded (all of Dh
    # when Dh <= BLOCK_D), later chunks are loaded here.
    acc = tl.dot(a0, tl.trans(b0), input_precision=PRECISION)
    for c in tl.static_range(1, D_CHUNKS):
        a, _, _ = _tile(a_ptr, start, a_pos, length, H, head, Dh, c * BLOCK_D, BLOCK_D, LOW)
        b, _, _ = _tile(b_ptr, start, b_pos, length, H, head, Dh, c * BLOCK_D, BLOCK_D, LOW)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    return acc


@triton.autotune(configs=autotune_configs(("BLOCK_M", "BLOCK_N"), FWD_TILES), key=TUNE_KEY)
@triton.jit
def _causal_fwd_kernel(
    q, k, v, offsets, rows, out, lse, H, Dh, window, scale, L_BUCKET,
    LOW: tl.constexpr, PRECISION: tl.constexpr, D_CHUNKS: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.load(rows + tl.program_id(0)).to(tl.int64)
    q_lo = (tl.num_programs(1) - 1 - tl.program_id(1)).to(tl.int64) * BLOCK_M
    head = (tl.program_id(2) // D_CHUNKS).to(tl.int64)
    d_lo = (tl.program_id(2) % D_CHUNKS) * BLOCK_D
    start = tl.load(offsets + row)
    length = tl.load(offsets + row + 1) - start
    m_pos = q_lo + tl.arange(0, BLOCK_M).to(tl.int64)
    q0, _, _ = _tile(q, start, m_pos, length, H, head, Dh, 0, BLOCK_D, LOW)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    lo, hi = _key_range(q_lo, length, window, BLOCK_M, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        n_pos = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        k0, _, _ = _tile(k, start, n_pos, length, H, head, Dh, 0, BLOCK_D, LOW)
        s = _dot_rows(q, m_pos, q0, k, n_pos, k0, start, length, H, head, Dh, D_CHUNKS, BLOCK_D, LOW, PRECISION)
        s = tl.where(_allowed(m_pos, n_pos, length, window), s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A query may see no key of this tile yet: shift by 0 to avoid (-inf) - (-inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt, _, _ = _tile(v, start, n_pos, length, H, head, Dh, d_lo, BLOCK_D, LOW)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        m_i = m_new
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o_idx, o_ok = _index(start, m_pos, length, H, head, Dh, d_lo, BLOCK_D)
    tl.store(out + o_idx, (acc / l_safe[:, None]).to(out.dtype.element_ty), mask=o_ok)
    # Every head-dim tile computed the same lse; the first one writes it.
    lse_len = tl.where(d_lo == 0, length, 0)
    tl.store(lse + (start + m_pos) * H + head, m_i + tl.log(l_safe), mask=m_pos < lse_len)


@triton.autotune(
    configs=autotune_configs(("BLOCK_M", "BLOCK_N"), BWD_TILES), key=TUNE_KEY, reset_to_zero=["dq"]
)
@triton.jit
def _causal_bwd_kernel(
    q, k, v, offsets, rows, lse, delta, dout, dq, dk, dv, H, Dh, window, scale, L_BUCKET,
    LOW: tl.constexpr, PRECISION: tl.constexpr, D_CHUNKS: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.load(rows + tl.program_id(0)).to(tl.int64)
    # Early key tiles are seen by the most queries (causal), so they go first as they are.
    n_lo = tl.program_id(1).to(tl.int64) * BLOCK_N
    head = (tl.program_id(2) // D_CHUNKS).to(tl.int64)
    d_lo = (tl.program_id(2) % D_CHUNKS) * BLOCK_D
    start = tl.load(offsets + row)
    length = tl.load(offsets + row + 1) - start
    n_pos = n_lo + tl.arange(0, BLOCK_N).to(tl.int64)
    k0, _, _ = _tile(k, start, n_pos, length, H, head, Dh, 0, BLOCK_D, LOW)
    v0, _, _ = _tile(v, start, n_pos, length, H, head, Dh, 0, BLOCK_D, LOW)
    if D_CHUNKS == 1:
        kd = k0
    else:
        kd, _, _ = _tile(k, start, n_pos, length, H, head, Dh, d_lo, BLOCK_D, LOW)
    dk_acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv_acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    # Queries that can see this key tile: i in [n_lo, n_lo + BLOCK_N - 1 + window).
    q_lo = (n_lo // BLOCK_M) * BLOCK_M
    q_hi = tl.minimum(length, n_lo + BLOCK_N - 1 + window)
    q_hi = tl.where(n_lo < length, q_hi, q_lo)
    for m0 in range(q_lo, q_hi, BLOCK_M):
        m_pos = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
        m_ok = m_pos < length
        q0, _, _ = _tile(q, start, m_pos, length, H, head, Dh, 0, BLOCK_D, LOW)
        g0, _, _ = _tile(dout, start, m_pos, length, H, head, Dh, 0, BLOCK_D, LOW)
        lse_t = tl.load(lse + (start + m_pos) * H + head, mask=m_ok, other=0.0)
        delta_t = tl.load(delta + (start + m_pos) * H + head, mask=m_ok, other=0.0)
        s = _dot_rows(q, m_pos, q0, k, n_pos, k0, start, length, H, head, Dh, D_CHUNKS, BLOCK_D, LOW, PRECISION)
        p = tl.exp(tl.where(_allowed(m_pos, n_pos, length, window), s * scale - lse_t[:, None], float("-inf")))
        dp = _dot_rows(dout, m_pos, g0, v, n_pos, v0, start, length, H, head, Dh, D_CHUNKS, BLOCK_D, LOW, PRECISION)
        ds = (p * (dp - delta_t[:, None])).to(k0.dtype)
        if D_CHUNKS == 1:
            qd = q0
            gd = g0
        else:
            qd, _, _ = _tile(q, start, m_pos, length, H, head, Dh, d_lo, BLOCK_D, LOW)
            gd, _, _ = _tile(dout, start, m_pos, length, H, head, Dh, d_lo, BLOCK_D, LOW)
        dv_acc += tl.dot(tl.trans(p.to(gd.dtype)), gd, input_precision=PRECISION)
        dk_acc += tl.dot(tl.trans(ds), qd, input_precision=PRECISION)
        dq_part = tl.dot(ds, kd, input_precision=PRECISION) * scale
        dq_idx, dq_ok = _index(start, m_pos, length, H, head, Dh, d_lo, BLOCK_D)
        tl.atomic_add(dq + dq_idx, dq_part, mask=dq_ok, sem="relaxed")  # only atomicity is needed
    kv_idx, kv_ok = _index(start, n_pos, length, H, head, Dh, d_lo, BLOCK_D)
    tl.store(dk + kv_idx, (dk_acc * scale).to(dk.dtype.element_ty), mask=kv_ok)
    tl.store(dv + kv_idx, dv_acc.to(dv.dtype.element_ty), mask=kv_ok)


def _launch_args(q: torch.Tensor, offsets: torch.Tensor, max_len: int, mode: DotMode) -> dict:
    head_dim = q.shape[2]
    block_d = block_for(head_dim)
    return dict(
        L_BUCKET=length_bucket(max_len), LOW=mode.low_precision, PRECISION=mode.input_precision,
        D_CHUNKS=d_tiles(head_dim, block_d), BLOCK_D=block_d,
    )


class CausalAttention(torch.autograd.Function):
    """q, k, v (T, H, Dh) -> out (T, H, Dh), causal (optionally windowed) per row."""

    @staticmethod
    def forward(ctx, q, k, v, offsets, max_len, window, scale, mode):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        tokens, heads, head_dim = q.shape
        out = _util.empty(tuple(q.shape), q)
        lse = _util.empty((tokens, heads), q, torch.float32)
        rows = longest_first(offsets)
        if tokens and heads and head_dim:
            meta = _launch_args(q, offsets, max_len, mode)
            batch, chunks = offsets.numel() - 1, meta["D_CHUNKS"]
            _causal_fwd_kernel[lambda m: (batch, triton.cdiv(max_len, m["BLOCK_M"]), heads * chunks)](
                q, k, v, offsets, rows, out, lse, heads, head_dim, window, scale, **meta
            )
        ctx.save_for_backward(q, k, v, offsets, rows, out, lse)
        ctx.max_len, ctx.window, ctx.scale, ctx.mode = max_len, window, scale, mode
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, offsets, rows, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        tokens, heads, head_dim = q.shape
        delta = (dout.float() * out.float()).sum(-1).contiguous()
        # dq gathers atomic adds from every key tile: it must start at zero, in float32.
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = _util.empty(tuple(k.shape), k), _util.empty(tuple(v.shape), v)
        if tokens and heads and head_dim:
            meta = _launch_args(q, offsets, ctx.max_len, ctx.mode)
            batch, chunks, max_len = offsets.numel() - 1, meta["D_CHUNKS"], ctx.max_len
            _causal_bwd_kernel[lambda m: (batch, triton.cdiv(max_len, m["BLOCK_N"]), heads * chunks)](
                q, k, v, offsets, rows, lse, delta, dout, dq, dk, dv, heads, head_dim, ctx.window, ctx.scale, **meta
            )
        return dq.to(q.dtype), dk, dv, None, None, None, None, None


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    window: int | None,
    scale: float,
    mode: DotMode | None = None,
) -> torch.Tensor:
    """Triton twin of ``kernels.reference.causal_attention.causal_attention`` (differentiable).

    mode None picks :func:`kernels.triton._util.dot_mode` for q's dtype and device;
    tests pass one to run the low-precision path in the interpreter.
    """
    # "No window" is a window as long as the longest row: it never excludes a key.
    effective = max(max_len, 1) if window is None else min(window, max(max_len, 1))
    mode = dot_mode(q.dtype, q.device) if mode is None else mode
    return CausalAttention.apply(q, k, v, offsets, max_len, effective, scale, mode)
