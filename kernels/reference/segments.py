"""Token-to-row index maps for jagged tensors (pure PyTorch).

Shape letters: B batch size, T total tokens, offsets (B+1,) int64.
"""

import torch


def token_rows(offsets: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``(T,) int64`` row index of every token: row i repeated L_i times."""
    lengths = offsets[1:] - offsets[:-1]
    rows = torch.arange(lengths.numel(), device=offsets.device, dtype=torch.int64)
    return torch.repeat_interleave(rows, lengths, output_size=num_tokens)


def token_positions(offsets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``(T,) int64`` position of every token inside its row (0 .. L_i - 1)."""
    return torch.arange(rows.numel(), device=offsets.device, dtype=torch.int64) - offsets[rows]
