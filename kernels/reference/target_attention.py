"""Reference target attention: one query per row against that row's history.

Shape letters: B batch, T total history tokens, H heads, Dh head dim.
query (B, H, Dh); keys, values (T, H, Dh) jagged by offsets. Output row b is
softmax_j(q_b . k_j * scale) v_j over the row's tokens (DIN-style target attention,
Zhou et al. 2018, sec. 4.3, with dot-product scores); an empty row gives 0.
Computed in float32 without padding, reusing the reference jagged softmax and sum.
"""

import torch

from kernels.reference.pooling import segment_sum
from kernels.reference.softmax import jagged_softmax
from kernels.segments import token_rows


def target_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, scale: float
) -> torch.Tensor:
    """``query (B, H, Dh)``, ``keys/values (T, H, Dh)`` -> ``(B, H, Dh)`` in query's dtype."""
    rows = token_rows(offsets, keys.shape[0])
    scores = (query.float()[rows] * keys.float()).sum(-1) * scale
    probs = jagged_softmax(scores, offsets)
    out = segment_sum(probs.unsqueeze(-1) * values.float(), offsets)
    return out.to(query.dtype)
