"""Reference causal self-attention inside each jagged row (pure PyTorch).

Shape letters: B batch, L_max longest row, T total tokens, H heads, Dh head dim.
q, k, v (T, H, Dh). Token i of a row attends to tokens j of the same row with
``i - window < j <= i`` (all ``j <= i`` when window is None); softmax(q k^T * scale) v
as in Vaswani et al. 2017, sec. 3.2.1. Computed in float32 on a padded copy.
"""

import torch

from kernels.reference.padding import jagged_to_padded, padded_to_jagged


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """``q, k, v (T, H, Dh)`` -> ``(T, H, Dh)`` in q's dtype."""
    # At least 2 padded slots (the extra ones masked like any padding): under torch.compile ``max_len`` is a
    # data-dependent size, and inductor's batched matmul asks whether it is 1, which it cannot decide; a length
    # of at least 2 answers that without changing any output.
    max_len = torch.sym_max(max_len, 2)
    qp, kp, vp = (jagged_to_padded(t.float(), offsets, max_len, 0.0).transpose(1, 2) for t in (q, k, v))
    i = torch.arange(max_len, device=q.device).view(-1, 1)
    j = torch.arange(max_len, device=q.device).view(1, -1)
    # Only causal/window terms: the diagonal is always allowed, so no softmax row is
    # empty (an all -inf row would give NaN gradients that leak into valid keys).
    allowed = j <= i
    if window is not None:
        allowed = allowed & (j > i - window)
    scores = (qp @ kp.transpose(-1, -2)) * scale
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    out = (probs @ vp).transpose(1, 2)
    return padded_to_jagged(out, offsets, q.shape[0]).to(q.dtype)
