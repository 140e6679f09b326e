"""Jagged <-> padded conversion dispatcher.

Shape letters: B batch, L_max longest row (or the requested max_len), T total
tokens, D trailing feature shape. Semantics match fbgemm's
``jagged_to_padded_dense`` / ``dense_to_jagged``.
"""

import torch

from kernels._checks import check_backend, check_float, check_jagged_float
from kernels.reference import padding as _ref
from kernels.types import Backend, Jagged


def jagged_to_padded(
    x: Jagged, *, max_len: int | None = None, pad_value: float = 0.0, backend: Backend = "reference"
) -> torch.Tensor:
    """``x.values (T, *D)`` -> ``(B, max_len, *D)`` in x's dtype, differentiable.

    max_len None means L_max; rows longer than max_len are truncated (their tail gets
    zero gradient). Slots past a row's end hold pad_value. Raises ValueError for a
    malformed x or max_len < 0, TypeError for non-float values.
    """
    check_backend(backend)
    check_jagged_float(x, "x")
    if max_len is None:
        max_len = x.max_length()
    if max_len < 0:
        raise ValueError(f"max_len must be >= 0 or None (meaning the longest row), got {max_len}")
    if backend == "reference":
        return _ref.jagged_to_padded(x.values, x.offsets, max_len, pad_value)
    from kernels.triton.padding import jagged_to_padded as _tri

    return _tri(x.values, x.offsets, max_len, pad_value)


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor, *, backend: Backend = "reference") -> Jagged:
    """``padded (B, L, *D)`` -> Jagged with ``values (T, *D)``, T = offsets[-1].

    Every row must fit: raises ValueError if some offsets row is longer than L or
    B does not match ``offsets (B+1,)``; TypeError for non-int64 offsets.
    """
    check_backend(backend)
    check_float(padded, "padded")
    probe = Jagged(values=padded.new_empty((int(offsets[-1].item()) if offsets.numel() else 0, 0)), offsets=offsets)
    check_jagged_float(probe, "offsets")
    if padded.dim() < 2 or padded.shape[0] != probe.batch_size:
        raise ValueError(
            f"padded: expected shape ({probe.batch_size}, L, ...) for {probe.batch_size} rows, got {tuple(padded.shape)}"
        )
    if probe.max_length() > padded.shape[1]:
        raise ValueError(
            f"padded has L={padded.shape[1]} slots but the longest row needs {probe.max_length()};"
            " pad to at least the longest row"
        )
    if backend == "reference":
        values = _ref.padded_to_jagged(padded, offsets, probe.num_tokens)
    else:
        from kernels.triton.padding import padded_to_jagged as _tri

        values = _tri(padded, offsets, probe.num_tokens)
    return Jagged(values=values, offsets=offsets)
