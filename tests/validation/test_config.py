"""ValidationConfig rejects bounds that make no sense, naming the field."""

from __future__ import annotations

import pytest

from validation.config import ValidationConfig

BAD = [
    ({"min_label_rate": 0.5, "max_label_rate": 0.4}, "min_label_rate <= max_label_rate"),
    ({"max_label_rate": 1.5}, "max_label_rate <= 1"),
    ({"min_label_rate": -0.1}, "0 <= min_label_rate"),
    ({"min_event_time_ms": -1}, "validation.min_event_time_ms must be >= 0, got -1"),
    ({"max_future_skew_ms": -5}, "validation.max_future_skew_ms must be >= 0, got -5"),
    ({"dead_letter_warning_rate": 0.2, "dead_letter_critical_rate": 0.1}, "dead_letter_warning_rate <= dead_letter_critical_rate"),
    ({"dead_letter_critical_rate": 1.5}, "dead_letter_critical_rate <= 1"),
    ({"drift_history_batches": 0}, "validation.drift_history_batches must be >= 1, got 0"),
    ({"drift_severity": "fatal"}, "drift_severity must be 'warning' or 'critical', got 'fatal'"),
    ({"max_volume_change": -0.1}, "validation.max_volume_change must be >= 0, got -0.1"),
    ({"max_null_rate_change": -1.0}, "validation.max_null_rate_change must be >= 0"),
    ({"gx_sample_rows": 0}, "validation.gx_sample_rows must be >= 1 or none, got 0"),
    ({"follow_report_plots": "never"}, "validation.follow_report_plots must be 'always' or 'quarantined', got 'never'"),
]


@pytest.mark.parametrize("kwargs,message", BAD)
def test_bad_bounds_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ValidationConfig(**kwargs)


def test_defaults_accept_every_dataset_era():
    cfg = ValidationConfig()
    assert cfg.min_event_time_ms == 631_152_000_000  # 1990-01-01T00:00:00Z: MovieLens starts in 1995
    assert cfg.max_future_skew_ms == 86_400_000
