"""Argument checks shared by the dispatchers (the only place shapes are checked)."""

import torch

from kernels.types import BACKENDS, Jagged, validate_jagged

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_backend(backend: str, allowed: tuple[str, ...] = BACKENDS) -> None:
    """Raise ValueError unless backend is one of ``allowed`` (default: "reference" or "triton")."""
    if backend not in allowed:
        raise ValueError(f"backend must be one of {allowed}, got {backend!r}")


def check_float(t: torch.Tensor, name: str) -> None:
    """Raise TypeError unless t is float32/bfloat16/float16."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected dtype in {FLOAT_DTYPES}, got {t.dtype}; cast with .float()")


def check_jagged_float(x: Jagged, name: str, min_dim: int = 1) -> None:
    """validate_jagged, then require float values with at least min_dim dims."""
    validate_jagged(x, name=name)
    check_float(x.values, f"{name}.values")
    if x.values.dim() < min_dim:
        raise ValueError(f"{name}.values: expected at least {min_dim} dims, got shape {tuple(x.values.shape)}")


def check_same_offsets(a: Jagged, b: Jagged, names: str) -> None:
    """Raise ValueError unless two jagged inputs share the same row boundaries."""
    if a.offsets.shape != b.offsets.shape or not torch.equal(a.offsets, b.offsets):
        raise ValueError(
            f"{names}: expected identical offsets, got {a.offsets.tolist()[:10]} vs {b.offsets.tolist()[:10]}"
        )


def check_attention_shapes(t: torch.Tensor, name: str, heads: int, head_dim: int) -> None:
    """Raise ValueError unless t has shape (*, H, Dh) matching the query."""
    if t.dim() != 3 or t.shape[1:] != (heads, head_dim):
        raise ValueError(f"{name}: expected shape (N, {heads}, {head_dim}), got {tuple(t.shape)}")
