"""Typed configuration of data-quality validation and the training gate."""

from __future__ import annotations

from dataclasses import dataclass

MS_PER_DAY = 24 * 3600 * 1000


@dataclass(frozen=True, kw_only=True)
class ValidationConfig:
    """Bounds the quality suites check."""

    min_label_rate: float = 0.0
    """Lowest acceptable click rate of a domain's examples in a batch (a warning below it)."""
    max_label_rate: float = 1.0
    """Highest acceptable click rate of a domain's examples in a batch (a warning above it)."""
    min_event_time_ms: int = 631_152_000_000
    """Earliest sane event time, ms since epoch UTC (default 1990-01-01: older than every dataset adapted)."""
    max_future_skew_ms: int = MS_PER_DAY
    """An event time later than (validation clock + this) fails the event-time range check (ms)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_label_rate <= self.max_label_rate <= 1.0:
            raise ValueError(
                f"need 0 <= min_label_rate <= max_label_rate <= 1, got {self.min_label_rate}, {self.max_label_rate}"
            )
        if self.min_event_time_ms < 0:
            raise ValueError(f"validation.min_event_time_ms must be >= 0, got {self.min_event_time_ms}")
        if self.max_future_skew_ms < 0:
            raise ValueError(f"validation.max_future_skew_ms must be >= 0, got {self.max_future_skew_ms}")
