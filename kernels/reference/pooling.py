"""Reference segment sum / mean pooling over jagged rows (pure PyTorch).

Shape letters: B batch, T total tokens, D trailing feature shape. Empty rows pool to 0.
"""

import torch

from kernels.segments import token_rows


def segment_sum(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``values (T, *D)`` -> ``(B, *D)``, sum of each row, accumulated in float32."""
    batch = offsets.numel() - 1
    rows = token_rows(offsets, values.shape[0])
    acc = values.new_zeros((batch, *values.shape[1:]), dtype=torch.float32)
    return acc.index_add(0, rows, values.float()).to(values.dtype)


def segment_mean(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``values (T, *D)`` -> ``(B, *D)``, mean of each row (0 for an empty row)."""
    batch = offsets.numel() - 1
    rows = token_rows(offsets, values.shape[0])
    acc = values.new_zeros((batch, *values.shape[1:]), dtype=torch.float32)
    acc = acc.index_add(0, rows, values.float())
    count = (offsets[1:] - offsets[:-1]).clamp(min=1).to(torch.float32)
    return (acc / count.view(-1, *([1] * (values.dim() - 1)))).to(values.dtype)
