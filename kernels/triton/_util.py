"""Launch helpers shared by the Triton twins."""

import torch
import triton


def block_for(width: int, floor: int = 16, cap: int = 128) -> int:
    """Power-of-two tile width covering ``width`` columns, clamped to [floor, cap]."""
    return max(floor, min(cap, triton.next_power_of_2(max(width, 1))))


def flat_width(shape: tuple[int, ...]) -> int:
    """Product of the trailing feature shape (1 for a (T,) tensor)."""
    width = 1
    for s in shape:
        width *= s
    return width


def empty(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Uninitialised kernel output on like's device (tests patch this to fill NaN,
    so an element a kernel forgets to write fails the comparison)."""
    return torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)
