"""Jagged softmax dispatcher.

Shape letters: B batch, T total tokens, H heads. Scores (T,) or (T, H); each head's
scores are normalised over the tokens of their own row (empty rows produce nothing).
"""

from kernels._checks import check_backend, check_jagged_float
from kernels.reference import softmax as _ref
from kernels.types import Backend, Jagged


def jagged_softmax(scores: Jagged, *, backend: Backend = "reference", validate: bool = True) -> Jagged:
    """``scores.values (T,)`` or ``(T, H)`` -> Jagged probabilities of the same shape
    and dtype, summing to 1 over every non-empty row (float32 inside).

    Raises ValueError for a malformed input or values with more than 2 dims,
    TypeError for non-float values; ``validate=False`` skips the offsets checks (host syncs) for validated input.
    """
    check_backend(backend)
    if validate:
        check_jagged_float(scores, "scores")
    values = scores.values
    if values.dim() > 2:
        raise ValueError(f"scores.values: expected (T,) or (T, H), got {tuple(values.shape)}; flatten the heads")
    flat = values.unsqueeze(-1) if values.dim() == 1 else values
    if backend == "reference":
        out = _ref.jagged_softmax(flat, scores.offsets)
    else:
        from kernels.triton.softmax import jagged_softmax as _tri

        out = _tri(flat, scores.offsets)
    return scores.with_values(out.view_as(values))
