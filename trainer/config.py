"""Typed configuration of the trainer."""

from __future__ import annotations

from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        for name in ("embedding_dim", "num_embeddings", "batch_size", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        if self.learning_rate <= 0:
            raise ValueError(f"trainer.learning_rate must be > 0, got {self.learning_rate}")
