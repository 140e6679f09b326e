"""Typed configuration of data-quality validation, drift detection and the training gate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gemline.errors import BadConfigError

MS_PER_DAY = 24 * 3600 * 1000


@dataclass(frozen=True, kw_only=True)
class ValidationConfig:
    """Bounds the quality suites check, drift thresholds against history, and GX sampling."""

    min_label_rate: float = 0.0
    """Lowest acceptable click rate of a domain's examples in a batch (a warning below it)."""
    max_label_rate: float = 1.0
    """Highest acceptable click rate of a domain's examples in a batch (a warning above it)."""
    min_event_time_ms: int = 631_152_000_000
    """Earliest sane event time, ms since epoch UTC (default 1990-01-01: older than every dataset adapted)."""
    max_future_skew_ms: int = MS_PER_DAY
    """An event time later than (validation clock + this) fails the event-time range check (ms)."""
    dead_letter_warning_rate: float = 0.01
    """Dead-letter rows / (events + dead-letter rows) of one ingest batch above this is a warning."""
    dead_letter_critical_rate: float = 0.10
    """Dead-letter fraction of one ingest batch above this is critical (quarantines the events version)."""
    dead_letter_min_records: int = 20
    """The critical dead-letter rate judges only batches of at least this many records (and with good events):
    a micro-batch's rate says little, and a few poison messages must not block the stream."""
    drift_history_batches: int = 5
    """K: drift compares a batch's profile with the mean of the previous K passed batches of the same table."""
    drift_severity: Literal["warning", "critical"] = "warning"
    """Severity of drift checks (the safe default reports drift without closing the gate)."""
    max_volume_change: float = 0.5
    """Largest relative change of the batch row count against its history, |x - h| / |h|."""
    max_label_rate_change: float = 0.5
    """Largest relative change of a label rate (overall and per domain) against its history."""
    max_null_rate_change: float = 0.1
    """Largest absolute change of a column's null fraction against its history (rates near 0 make ratios explode)."""
    max_mean_change: float = 0.5
    """Largest relative change of a numeric feature's mean against its history."""
    max_quantile_change: float = 1.0
    """Largest relative change of a numeric feature's p50 / p99 against its history."""
    follow_report_plots: Literal["always", "quarantined"] = "quarantined"
    """Which reports ``validate --follow`` draws plots in: every one, or only a quarantined version's (a passed
    version's report then lists its checks without plots; ``gemline validate --table T --version V`` draws them).
    Drawing them (matplotlib) was about 70 % of the CPU of validating an examples version and half of an events
    one, at every version of a stream. One-shot validation always draws them."""
    gx_sample_rows: int | None = 200_000
    """Batches larger than this run GX's per-row value checks on a deterministic sample of this many rows; None: all rows."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_label_rate <= self.max_label_rate <= 1.0:
            raise BadConfigError(
                f"need 0 <= min_label_rate <= max_label_rate <= 1, got {self.min_label_rate}, {self.max_label_rate}"
            )
        if self.min_event_time_ms < 0:
            raise BadConfigError(f"validation.min_event_time_ms must be >= 0, got {self.min_event_time_ms}")
        if self.max_future_skew_ms < 0:
            raise BadConfigError(f"validation.max_future_skew_ms must be >= 0, got {self.max_future_skew_ms}")
        if not 0.0 <= self.dead_letter_warning_rate <= self.dead_letter_critical_rate <= 1.0:
            raise BadConfigError(
                "need 0 <= dead_letter_warning_rate <= dead_letter_critical_rate <= 1, got "
                f"{self.dead_letter_warning_rate}, {self.dead_letter_critical_rate}"
            )
        if self.dead_letter_min_records < 0:
            raise BadConfigError(f"validation.dead_letter_min_records must be >= 0, got {self.dead_letter_min_records}")
        if self.drift_history_batches < 1:
            raise BadConfigError(f"validation.drift_history_batches must be >= 1, got {self.drift_history_batches}")
        if self.drift_severity not in ("warning", "critical"):
            raise BadConfigError(f"validation.drift_severity must be 'warning' or 'critical', got {self.drift_severity!r}")
        for name in ("max_volume_change", "max_label_rate_change", "max_null_rate_change", "max_mean_change",
                     "max_quantile_change"):
            if getattr(self, name) < 0:
                raise BadConfigError(f"validation.{name} must be >= 0, got {getattr(self, name)}")
        if self.follow_report_plots not in ("always", "quarantined"):
            raise BadConfigError("validation.follow_report_plots must be 'always' or 'quarantined', got "
                                 f"{self.follow_report_plots!r}")
        if self.gx_sample_rows is not None and self.gx_sample_rows < 1:
            raise BadConfigError(f"validation.gx_sample_rows must be >= 1 or none, got {self.gx_sample_rows}")
