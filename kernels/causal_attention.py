"""Causal self-attention within each jagged row (no padding) dispatcher.

Shape letters: B batch, L_max longest row, T total tokens, H heads, Dh head dim.
Token i of a row attends to tokens j of the same row with i - window < j <= i, i.e.
the `window` most recent keys including itself (all earlier keys when None):
softmax(q k^T * scale) v, Vaswani et al. 2017, sec. 3.2.1.
"""

import math

from kernels._checks import check_attention_shapes, check_backend, check_jagged_float, check_same_offsets
from kernels.reference import causal_attention as _ref
from kernels.sdpa import causal_attention as _sdpa
from kernels.types import ATTENTION_BACKENDS, AttentionBackend, Jagged


def causal_attention(
    q: Jagged,
    k: Jagged,
    v: Jagged,
    *,
    window: int | None = None,
    scale: float | None = None,
    backend: AttentionBackend = "reference",
    validate: bool = True,
) -> Jagged:
    """``q, k, v .values (T, H, Dh)`` sharing offsets -> Jagged ``(T, H, Dh)`` in q's dtype.

    scale None means 1/sqrt(Dh); window None means full causal. Differentiable in
    q, k, v. Raises ValueError on shape/offset mismatch or window < 1, TypeError on
    non-float or mixed dtypes. backend: "reference" (the oracle), "sdpa" (its fused PyTorch twin, the CPU
    fast path, benchmarks.kernels ``--cpu-attention``) or "triton" (CUDA). ``validate=False`` skips the checks
    that read offsets (host syncs, graph breaks under torch.compile), for callers whose offsets were validated
    where the batch was built.
    """
    check_backend(backend, ATTENTION_BACKENDS)
    if validate:
        check_jagged_float(q, "q")
    if q.values.dim() != 3:
        raise ValueError(f"q.values: expected shape (T, H, Dh), got {tuple(q.values.shape)}")
    _, heads, head_dim = q.values.shape
    for name, x in (("k", k), ("v", v)):
        if validate:
            check_jagged_float(x, name)
            check_same_offsets(q, x, f"q/{name}")
        check_attention_shapes(x.values, f"{name}.values", heads, head_dim)
        if x.values.dtype != q.values.dtype:
            raise TypeError(f"{name}.values dtype {x.values.dtype} differs from q dtype {q.values.dtype}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 (number of most recent keys) or None, got {window}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    max_len = q.max_length()
    if backend == "reference":
        out = _ref.causal_attention(q.values, k.values, v.values, q.offsets, max_len, window, scale)
    elif backend == "sdpa":
        out = _sdpa.causal_attention(q.values, k.values, v.values, q.offsets, max_len, window, scale)
    else:
        from kernels.triton.causal_attention import causal_attention as _tri

        out = _tri(q.values, k.values, v.values, q.offsets, max_len, window, scale)
    return q.with_values(out)
