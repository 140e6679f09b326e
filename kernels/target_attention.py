"""Target attention dispatcher: one query per row against that row's history.

Shape letters: B batch, T total history tokens, H heads, Dh head dim. This is the
candidate-item-to-user-history attention of DIN (Zhou et al. 2018, sec. 4.3) with
scaled dot-product scores (Vaswani et al. 2017, sec. 3.2.1).
"""

import math

import torch

from kernels._checks import check_attention_shapes, check_backend, check_float, check_jagged_float, check_same_offsets
from kernels.reference import target_attention as _ref
from kernels.types import Backend, Jagged


def target_attention(
    query: torch.Tensor,
    keys: Jagged,
    values: Jagged,
    *,
    scale: float | None = None,
    backend: Backend = "reference",
    validate: bool = True,
) -> torch.Tensor:
    """``query (B, H, Dh)`` attends over row b of ``keys/values.values (T, H, Dh)``.

    Returns ``(B, H, Dh)`` in query's dtype: softmax_j(q_b . k_j * scale) v_j, with
    scale None meaning 1/sqrt(Dh); an empty row gives 0. Differentiable in query,
    keys and values. Raises ValueError on shape/offset mismatch, TypeError on
    non-float or mixed dtypes. ``validate=False`` skips the checks that read offsets (host syncs, graph breaks
    under torch.compile), for callers whose offsets were validated where the batch was built.
    """
    check_backend(backend)
    check_float(query, "query")
    if query.dim() != 3:
        raise ValueError(f"query: expected shape (B, H, Dh), got {tuple(query.shape)}")
    batch, heads, head_dim = query.shape
    for name, x in (("keys", keys), ("values", values)):
        if validate:
            check_jagged_float(x, name)
        check_attention_shapes(x.values, f"{name}.values", heads, head_dim)
        if x.values.dtype != query.dtype:
            raise TypeError(f"{name}.values dtype {x.values.dtype} differs from query dtype {query.dtype}")
    if validate:
        check_same_offsets(keys, values, "keys/values")
    if keys.batch_size != batch:
        raise ValueError(f"query has B={batch} rows but keys.offsets describes {keys.batch_size} rows")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if backend == "reference":
        return _ref.target_attention(query, keys.values, values.values, keys.offsets, scale)
    from kernels.triton.target_attention import target_attention as _tri

    return _tri(query, keys.values, values.values, keys.offsets, scale)
