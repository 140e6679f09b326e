"""Causal self-attention inside each jagged row through PyTorch's fused SDPA (the CPU fast path).

Shape letters: B batch, L_max longest row, T total tokens, H heads, Dh head dim.
Same semantics as kernels.reference.causal_attention (its twin, tested equal in
tests/kernels/test_sdpa_twin.py): token i of a row attends to tokens j of the same row with
``i - window < j <= i``. q, k and v are padded once, together, then
``torch.nn.functional.scaled_dot_product_attention`` (PyTorch docs, "scaled_dot_product_attention":
``is_causal=True``, or a boolean ``attn_mask`` where True takes part, for a window) runs the fused
kernel (FlashAttention-style on CPU), which never materialises the (B, H, L, L) probabilities for
autograd the way the reference's matmul + masked softmax does. Padded keys sit after every valid
token of a row, so the causal mask alone keeps them out of valid queries; padded queries are dropped.
"""

import torch
import torch.nn.functional as F

from kernels.segments import token_positions, token_rows


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """``q, k, v (T, H, Dh)`` -> ``(T, H, Dh)`` in q's dtype, computed in float32 like the reference."""
    batch, (num_tokens, heads, head_dim) = offsets.numel() - 1, q.shape
    rows = token_rows(offsets, num_tokens)
    # One flat slot per token, shared by the padding and the unpadding: index_copy / index_select on
    # the (B*L) axis, whose backwards (index_select / index_add) are cheap, unlike a two-index gather's.
    slots = rows * max_len + token_positions(offsets, rows)
    qkv = torch.stack((q, k, v), dim=1).float()  # (T, 3, H, Dh): one padding pass instead of three
    padded = qkv.new_zeros(batch * max_len, 3, heads, head_dim).index_copy(0, slots, qkv)
    pq, pk, pv = padded.view(batch, max_len, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, L, Dh)
    if window is None:
        out = F.scaled_dot_product_attention(pq, pk, pv, is_causal=True, scale=scale)
    else:
        i = torch.arange(max_len, device=q.device).view(-1, 1)
        j = torch.arange(max_len, device=q.device).view(1, -1)
        allowed = (j <= i) & (j > i - window)  # the diagonal always takes part: no empty softmax row
        out = F.scaled_dot_product_attention(pq, pk, pv, attn_mask=allowed, scale=scale)
    flat = out.transpose(1, 2).reshape(batch * max_len, heads, head_dim)
    return flat.index_select(0, slots).to(q.dtype)
