"""BuildConfig: the CTR prior fields reject bad values and load from --set overrides."""

from __future__ import annotations

import pytest

from gemline.config import load_config
from sequences.config import BuildConfig


@pytest.mark.parametrize(
    ("message", "kwargs"),
    [
        ("build.ctr_prior_clicks must be a finite number >= 0, got -1.0", {"ctr_prior_clicks": -1.0}),
        ("build.ctr_prior_non_clicks must be a finite number >= 0, got inf", {"ctr_prior_non_clicks": float("inf")}),
        ("build.ctr_prior_clicks must be a finite number >= 0, got nan", {"ctr_prior_clicks": float("nan")}),
        ("must be > 0 .else the CTR of an unseen entity is 0/0", {"ctr_prior_clicks": 0.0, "ctr_prior_non_clicks": 0.0}),
        ("build.max_seq_len must be >= 1, got 0", {"max_seq_len": 0}),
        ("build.examples_layout must be one of .'fat', 'pointer'., got 'thin'", {"examples_layout": "thin"}),
        ("build.engine must be one of .'auto', 'inprocess', 'beam'., got 'spark'", {"engine": "spark"}),
        ("build.shards must be 'auto' or an integer >= 1, got 0", {"shards": 0}),
        ("build.shards must be 'auto' or an integer >= 1, got 'many'", {"shards": "many"}),
        ("build.parallelism must be 'auto' or an integer >= 1, got 0", {"parallelism": 0}),
        ("build.parallelism must be 'auto' or an integer >= 1, got 'all'", {"parallelism": "all"}),
        (r"build.memory_budget_bytes must be >= 1 MiB \(1048576 bytes\), got 1000", {"memory_budget_bytes": 1000}),
    ],
)
def test_invalid_build_config(message, kwargs):
    with pytest.raises(ValueError, match=message):
        BuildConfig(**kwargs)


def test_prior_from_overrides():
    config = load_config(overrides={"build.ctr_prior_clicks": "2", "build.ctr_prior_non_clicks": "18.5"})
    assert (config.build.ctr_prior_clicks, config.build.ctr_prior_non_clicks) == (2.0, 18.5)


def test_examples_layout_from_overrides():
    assert load_config(overrides={"build.examples_layout": "fat"}).build.examples_layout == "fat"
    assert load_config().build.examples_layout == "pointer"
