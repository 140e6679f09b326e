"""Typed configuration of data-quality validation and the training gate."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ValidationConfig:
    """Bounds the quality suites check."""

    min_label_rate: float = 0.0
    """Lowest acceptable click rate of a batch of examples (critical below it)."""
    max_label_rate: float = 1.0
    """Highest acceptable click rate of a batch of examples (critical above it)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_label_rate <= self.max_label_rate <= 1.0:
            raise ValueError(
                f"need 0 <= min_label_rate <= max_label_rate <= 1, got {self.min_label_rate}, {self.max_label_rate}"
            )
