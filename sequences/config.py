"""Typed configuration of the sequence, label and example build."""

from __future__ import annotations

from dataclasses import dataclass

MS_PER_DAY = 24 * 3600 * 1000


@dataclass(frozen=True, kw_only=True)
class BuildConfig:
    """How sequences, labels and examples are built from `events`."""

    max_seq_len: int = 256
    """Newest N events kept per user sequence (and per example's history)."""
    click_window_ms: int = MS_PER_DAY
    """Attribution window of a click after its impression (ms)."""
    conversion_window_ms: int = 7 * MS_PER_DAY
    """Attribution window of a conversion after its impression (ms)."""
    ctr_prior_clicks: float = 1.0
    """Smoothed CTR pseudo-clicks a in (clicks + a) / (impressions + a + b)."""
    ctr_prior_non_clicks: float = 1.0
    """Smoothed CTR pseudo-non-clicks b in (clicks + a) / (impressions + a + b)."""

    def __post_init__(self) -> None:
        if self.max_seq_len < 1:
            raise ValueError(f"build.max_seq_len must be >= 1, got {self.max_seq_len}")
        for name in ("click_window_ms", "conversion_window_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"build.{name} must be > 0, got {getattr(self, name)}")
        for name in ("ctr_prior_clicks", "ctr_prior_non_clicks"):
            value = getattr(self, name)
            if not (value >= 0.0 and value < float("inf")):
                raise ValueError(f"build.{name} must be a finite number >= 0, got {value}")
        if self.ctr_prior_clicks + self.ctr_prior_non_clicks <= 0.0:
            raise ValueError(
                "build.ctr_prior_clicks + build.ctr_prior_non_clicks must be > 0 "
                f"(else the CTR of an unseen entity is 0/0), got {self.ctr_prior_clicks} + {self.ctr_prior_non_clicks}"
            )
