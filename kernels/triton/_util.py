"""Launch helpers shared by the Triton twins: tile widths, the dot precision, autotune
configurations and the longest-row-first schedule."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton

MAX_BLOCK_D = 128
"""Widest head-dimension tile; wider heads are covered by several tiles (a loop or grid axis)."""


def block_for(width: int, floor: int = 16, cap: int = MAX_BLOCK_D) -> int:
    """Power-of-two tile width covering ``width`` columns, clamped to [floor, cap].

    A width above ``cap`` needs ``cdiv(width, cap)`` tiles; every caller loops or
    launches over them (``d_tiles``).
    """
    return max(floor, min(cap, triton.next_power_of_2(max(width, 1))))


def d_tiles(width: int, block: int) -> int:
    """Number of ``block``-wide tiles covering ``width`` columns (at least 1)."""
    return max(1, triton.cdiv(width, block))


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


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1,
    read once by Triton itself into ``triton.knobs``)."""
    return bool(triton.knobs.runtime.interpret)


@dataclass(frozen=True)
class DotMode:
    """How a kernel feeds ``tl.dot``; both fields become constexpr kernel arguments.

    low_precision: tiles stay in the input dtype (bf16/fp16) and the probabilities
    are cast to it before ``p @ v`` (tensor cores, fp32 accumulation), as in
    FlashAttention-2 (Dao 2023, sec. 3); False upcasts every tile to fp32 first.
    input_precision: Triton's ``input_precision`` for fp32 operands, "ieee"
    (exact fp32 products) or "tf32" (tensor cores, 10-bit mantissa).
    """

    low_precision: bool
    input_precision: str


def dot_mode(dtype: torch.dtype, device: torch.device) -> DotMode:
    """The ``tl.dot`` precision for inputs of ``dtype`` on ``device``; accumulation is always fp32.

    - the interpreter or a non-CUDA device: fp32 "ieee" (the parity tests compare
      against the fp32 reference; the interpreter's bf16 ``tl.dot`` returns garbage
      in Triton 3.9, measured: errors of 1e10 on a 16x16 product);
    - bf16 on CUDA compute capability >= 8.0 (Ampere+) and fp16 on >= 7.0: low
      precision inputs (tensor cores);
    - fp32 on CUDA: "tf32" on >= 8.0 only where PyTorch's matmuls may use it
      (``torch.set_float32_matmul_precision("high")`` or "medium"; the default
      "highest" keeps "ieee"), so fp32 stays fp32 unless the user opted in.
    """
    if interpreting() or device.type != "cuda":
        return DotMode(False, "ieee")
    major, _ = torch.cuda.get_device_capability(device)
    if dtype == torch.bfloat16 and major >= 8 or dtype == torch.float16 and major >= 7:
        return DotMode(True, "ieee")
    if dtype == torch.float32 and major >= 8 and torch.get_float32_matmul_precision() != "highest":
        return DotMode(False, "tf32")
    return DotMode(False, "ieee")


def autotune_configs(blocks: tuple[str, ...], tiles: Sequence[tuple[int, ...]]) -> list[triton.Config]:
    """Autotune candidates: each tile tuple is one value per name in ``blocks``, then
    num_warps and num_stages. Under the interpreter a single config with every block
    16 wide, so tests stay fast and nothing is timed (one config is never benchmarked).
    """
    if interpreting():
        return [triton.Config(dict.fromkeys(blocks, 16), num_warps=1, num_stages=1)]
    configs = []
    for tile in tiles:
        *sizes, warps, stages = tile
        configs.append(triton.Config(dict(zip(blocks, sizes, strict=True)), num_warps=warps, num_stages=stages))
    return configs


def length_bucket(max_len: int) -> int:
    """Power-of-two bucket of the longest row, the autotune key (one tuning per bucket,
    not per batch)."""
    return triton.next_power_of_2(max(max_len, 1))


def longest_first(offsets: torch.Tensor) -> torch.Tensor:
    """``(B,) int64`` row indices sorted by length, longest first (ties by index).

    Launched as the grid's row axis, so the programs with the most work start first
    and short rows fill the tail instead of a long row finishing last. No host sync.
    """
    lengths = offsets[1:] - offsets[:-1]
    return torch.argsort(lengths, descending=True, stable=True)
