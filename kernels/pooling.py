"""Segment sum / mean pooling dispatcher.

Shape letters: B batch, T total tokens, D trailing feature shape. Empty rows pool
to 0. Same result as fbgemm's ``segment_sum_csr`` for the sum.
"""

import torch

from kernels._checks import check_backend, check_jagged_float
from kernels.reference import pooling as _ref
from kernels.types import Backend, Jagged


def segment_sum(x: Jagged, *, backend: Backend = "reference", validate: bool = True) -> torch.Tensor:
    """``x.values (T, *D)`` -> ``(B, *D)`` row sums in x's dtype (float32 accumulation).

    Raises ValueError for a malformed x, TypeError for non-float values; ``validate=False`` skips the offsets
    checks (host syncs) for validated input.
    """
    check_backend(backend)
    if validate:
        check_jagged_float(x, "x")
    if backend == "reference":
        return _ref.segment_sum(x.values, x.offsets)
    from kernels.triton.pooling import segment_sum as _tri

    return _tri(x.values, x.offsets)


def segment_mean(x: Jagged, *, backend: Backend = "reference", validate: bool = True) -> torch.Tensor:
    """``x.values (T, *D)`` -> ``(B, *D)`` row means (0 for an empty row).

    Raises ValueError for a malformed x, TypeError for non-float values; ``validate=False`` skips the offsets
    checks (host syncs) for validated input.
    """
    check_backend(backend)
    if validate:
        check_jagged_float(x, "x")
    if backend == "reference":
        return _ref.segment_mean(x.values, x.offsets)
    from kernels.triton.pooling import segment_mean as _tri

    return _tri(x.values, x.offsets)
