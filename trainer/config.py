"""Typed configuration of the trainer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Model size and optimisation of the CPU trainer."""

    embedding_dim: int = 16
    """Width D of every embedding table."""
    num_embeddings: int = 100_003
    """Rows per hashed id table (ids are hashed modulo this)."""
    batch_size: int = 512
    """Examples per step."""
    epochs: int = 2
    """Passes over the training days."""
    learning_rate: float = 3e-3
    """Adam learning rate of the dense part (and Adagrad of the embeddings)."""
    seed: int = 0
    """Seed of parameter init and data order."""
    embedding_learning_rate: float | None = None
    """Adagrad learning rate of the embedding tables; None uses ``learning_rate``."""
    hidden_dims: tuple[int, ...] = (64, 32)
    """Widths of the shared MLP layers under the click and conversion heads."""
    init_from: Literal["scratch", "latest"] = "scratch"
    """Start from fresh parameters, or from the lake's latest checkpoint (model, optimisers, step, RNG; an unfinished run on the same version continues where it stopped)."""
    checkpoint_every_steps: int | None = None
    """Also checkpoint every this many steps, so a crashed run resumed with init_from=latest loses at most that many; None: only at the end."""
    torch_threads: int | None = 1
    """Torch intra-op threads during run_training (restored after); None keeps torch's default of one per core.

    One by default: this model's ops are tiny, and on a shared CPU torch's parallel scatter and
    repeat_interleave paths were measured 4x slower end to end with 2 threads than with 1."""

    def __post_init__(self) -> None:
        for name in ("embedding_dim", "num_embeddings", "batch_size", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        if self.learning_rate <= 0:
            raise ValueError(f"trainer.learning_rate must be > 0, got {self.learning_rate}")
        if self.num_embeddings < 2:
            raise ValueError(f"trainer.num_embeddings must be >= 2 (row 0 is reserved for null ids), got {self.num_embeddings}")
        if self.embedding_learning_rate is not None and self.embedding_learning_rate <= 0:
            raise ValueError(f"trainer.embedding_learning_rate must be > 0 or none, got {self.embedding_learning_rate}")
        if not self.hidden_dims or any(width < 1 for width in self.hidden_dims):
            raise ValueError(f"trainer.hidden_dims must be a non-empty tuple of widths >= 1, got {self.hidden_dims}")
        if self.checkpoint_every_steps is not None and self.checkpoint_every_steps < 1:
            raise ValueError(f"trainer.checkpoint_every_steps must be >= 1 or none, got {self.checkpoint_every_steps}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"trainer.torch_threads must be >= 1 or none, got {self.torch_threads}")
        if self.init_from not in ("scratch", "latest"):
            raise ValueError(f"trainer.init_from must be 'scratch' or 'latest', got {self.init_from!r}")
