"""Reference jagged <-> padded conversion (pure PyTorch, differentiable).

Shape letters: B batch, L padded length, T total tokens, D trailing feature shape.
Same semantics as fbgemm's ``jagged_to_padded_dense`` / ``dense_to_jagged``: rows
longer than L are truncated.
"""

import torch

from kernels.segments import token_positions, token_rows


def jagged_to_padded(
    values: torch.Tensor, offsets: torch.Tensor, max_len: int, pad_value: float
) -> torch.Tensor:
    """``values (T, *D)`` -> ``(B, max_len, *D)``; slots past a row's end hold pad_value."""
    batch = offsets.numel() - 1
    out = values.new_full((batch, max_len, *values.shape[1:]), pad_value)
    rows = token_rows(offsets, values.shape[0])
    pos = token_positions(offsets, rows)
    keep = pos < max_len
    # index_copy on the flattened (B*max_len) slot axis: far faster on CPU than a
    # two-index index_put, and still differentiable in values.
    slots = rows[keep] * max_len + pos[keep]
    flat = out.view(batch * max_len, *values.shape[1:]).index_copy(0, slots, values[keep])
    return flat.view_as(out)


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``padded (B, L, *D)`` -> ``values (T, *D)``; tokens at positions >= L read 0."""
    rows = token_rows(offsets, num_tokens)
    pos = token_positions(offsets, rows)
    # One extra zero slot per row: tokens past L (truncated) gather it.
    zero_slot = padded.new_zeros((padded.shape[0], 1, *padded.shape[2:]))
    extended = torch.cat([padded, zero_slot], dim=1)
    return extended[rows, pos.clamp(max=padded.shape[1])]
