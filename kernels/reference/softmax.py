"""Reference softmax over each jagged row (pure PyTorch, differentiable).

Shape letters: B batch, T total tokens, H heads. scores (T, H); each (row, head)
column is normalised over that row's tokens. Computed in float32.
"""

import torch

from kernels.segments import token_rows


def jagged_softmax(scores: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``scores (T, H)`` -> ``(T, H)`` probabilities summing to 1 over every row."""
    batch = offsets.numel() - 1
    rows = token_rows(offsets, scores.shape[0])
    x = scores.float()
    index = rows.view(-1, 1).expand_as(x)
    # The max is only a shift for stability: detaching it leaves the gradient exact.
    row_max = x.new_full((batch, x.shape[1]), float("-inf")).scatter_reduce(
        0, index, x.detach(), reduce="amax", include_self=True
    )
    e = torch.exp(x - row_max[rows])
    denom = x.new_zeros((batch, x.shape[1])).index_add(0, rows, e)
    return (e / denom[rows]).to(scores.dtype)
