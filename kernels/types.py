"""The jagged batch type shared by every kernel.

Shape letters: B batch size, L_i length of row i, L_max = max_i L_i, T = sum_i L_i
(total tokens), D feature width (any trailing shape, e.g. (H, Dh) for attention).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

Backend = Literal["reference", "triton"]
"""Which twin a dispatcher runs: the pure PyTorch reference (default) or Triton."""

BACKENDS: tuple[Backend, ...] = ("reference", "triton")

AttentionBackend = Literal["reference", "sdpa", "triton"]
"""Causal attention's twins: :data:`Backend`'s, plus "sdpa", PyTorch's fused
``scaled_dot_product_attention`` on one padded copy (kernels.sdpa; the CPU fast path)."""

ATTENTION_BACKENDS: tuple[AttentionBackend, ...] = ("reference", "sdpa", "triton")


@dataclass(frozen=True)
class Jagged:
    """A batch of B variable-length rows stored without padding.

    ``values (T, *F)`` holds the rows back to back; ``offsets (B+1,) int64`` marks
    where each row starts, so row i is ``values[offsets[i]:offsets[i+1]]`` and has
    ``lengths[i] = offsets[i+1] - offsets[i]`` tokens. Same layout as TorchRec's
    ``JaggedTensor`` / fbgemm's ``jagged_to_padded_dense`` inputs::

        rows      r0: [a b c]   r1: []   r2: [d e]      (B=3, lengths=[3, 0, 2])
        values    [ a | b | c | d | e ]                  (T=5 rows of width D)
        offsets   [ 0,          3,  3,      5 ]          (B+1 entries, int64)
                    ^r0 start   ^r1 ^r2     ^T

    The constructor is cheap and checks nothing; call :func:`validate_jagged` at
    package boundaries.
    """

    values: torch.Tensor
    offsets: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        """``(B,) int64`` number of tokens per row."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def batch_size(self) -> int:
        """B, the number of rows (empty rows included)."""
        return self.offsets.numel() - 1

    @property
    def num_tokens(self) -> int:
        """T = sum of lengths = number of rows of ``values``."""
        return self.values.shape[0]

    def max_length(self) -> int:
        """L_max, the longest row (0 for an all-empty or B=0 batch); syncs to host."""
        if self.batch_size == 0:
            return 0
        return int(self.lengths.max().item())

    def with_values(self, values: torch.Tensor) -> Jagged:
        """Same offsets, new ``values (T, *F')``; used for outputs of per-token ops."""
        return Jagged(values=values, offsets=self.offsets)

    @classmethod
    def empty(
        cls,
        batch_size: int,
        feature_shape: Sequence[int] = (),
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> Jagged:
        """B rows, all empty: ``values (0, *feature_shape)``, ``offsets`` all zero."""
        if batch_size < 0:
            raise ValueError(f"batch_size must be >= 0, got {batch_size}")
        return cls(
            values=torch.empty((0, *feature_shape), dtype=dtype, device=device),
            offsets=torch.zeros(batch_size + 1, dtype=torch.int64, device=device),
        )

    @classmethod
    def from_lengths(cls, values: torch.Tensor, lengths: torch.Tensor | Sequence[int]) -> Jagged:
        """Wrap ``values (T, *F)`` split into rows of ``lengths (B,)`` (any int dtype).

        Raises ValueError if a length is negative or ``sum(lengths) != T``.
        """
        lengths_t = torch.as_tensor(lengths, dtype=torch.int64, device=values.device)
        if lengths_t.dim() != 1:
            raise ValueError(f"lengths must be 1-D (B,), got shape {tuple(lengths_t.shape)}")
        if bool((lengths_t < 0).any()):
            raise ValueError(f"lengths must be >= 0, got {lengths_t.tolist()}")
        offsets = torch.zeros(lengths_t.numel() + 1, dtype=torch.int64, device=values.device)
        torch.cumsum(lengths_t, dim=0, out=offsets[1:])
        out = cls(values=values, offsets=offsets)
        validate_jagged(out)
        return out

    @classmethod
    def from_dense(cls, rows: Sequence[torch.Tensor]) -> Jagged:
        """Concatenate per-row tensors ``rows[i] (L_i, *F)`` (like TorchRec's
        ``JaggedTensor.from_dense``). All rows must share ``F`` and dtype; B=0 is
        rejected because the feature shape would be unknown (use :meth:`empty`)."""
        if len(rows) == 0:
            raise ValueError("from_dense needs at least one row; use Jagged.empty(0, F) for B=0")
        feature = tuple(rows[0].shape[1:])
        for i, r in enumerate(rows):
            if r.dim() < 1 or tuple(r.shape[1:]) != feature or r.dtype != rows[0].dtype:
                raise ValueError(
                    f"row {i} has shape {tuple(r.shape)} dtype {r.dtype}, expected (L_i, *{feature})"
                    f" dtype {rows[0].dtype} like row 0"
                )
        return cls.from_lengths(torch.cat(list(rows), dim=0), [r.shape[0] for r in rows])


def validate_jagged(x: Jagged, *, name: str = "x") -> None:
    """Check the layout invariants of ``x``; raise ValueError/TypeError saying
    expected vs got.

    Checks: offsets is a 1-D int64 tensor with at least one entry, on the same
    device as values; offsets[0] == 0; offsets non-decreasing; offsets[-1] == T.
    Syncs to host (reads offsets[-1]).
    """
    if not isinstance(x, Jagged):
        raise TypeError(f"{name}: expected Jagged, got {type(x).__name__}")
    off, val = x.offsets, x.values
    if off.dtype != torch.int64:
        raise TypeError(
            f"{name}.offsets must be int64 (index arithmetic can pass 2^31), got {off.dtype};"
            " cast with offsets.to(torch.int64)"
        )
    if off.dim() != 1 or off.numel() < 1:
        raise ValueError(f"{name}.offsets must have shape (B+1,), got {tuple(off.shape)}")
    if val.dim() < 1:
        raise ValueError(f"{name}.values must have shape (T, ...), got a 0-d tensor")
    if off.device != val.device:
        raise ValueError(f"{name}: offsets on {off.device} but values on {val.device}")
    first, last = int(off[0].item()), int(off[-1].item())
    if first != 0:
        raise ValueError(f"{name}.offsets[0] must be 0, got {first}")
    if off.numel() > 1 and bool((off[1:] < off[:-1]).any()):
        raise ValueError(f"{name}.offsets must be non-decreasing, got {off.tolist()[:20]}")
    if last != val.shape[0]:
        raise ValueError(f"{name}: offsets[-1]={last} but values has {val.shape[0]} rows")
