"""due_pending in wait mode reads the keys of only the row groups that can be due: the same rows as reading all."""

from __future__ import annotations

import dataclasses
import logging

import pytest

import sequences.pipeline as pipeline
from gemline.config import GemlineConfig
from gemline.lake import read_table
from gemline.tables import Table
from sequences.config import BuildConfig
from sequences.pipeline import _shortest_publish_delay_ms, run_build
from tests.conftest import build_args

from .test_pipeline import write_events

CONFIG = BuildConfig(click_window_ms=100, conversion_window_ms=4_000,
                     events_gate="off", examples_layout="fat", label_mode="wait", engine="inprocess")


@pytest.mark.parametrize(("overrides", "expected"), [
    ((), 2_000),
    (("d1:conversion:3000",), 2_000),
    (("d1:conversion:1500",), 1_500),
    (("d1:click:2500", "d2:conversion:500", "d2:click:400"), 500),
])
def test_shortest_publish_delay_is_the_least_over_every_domain(overrides, expected):
    config = BuildConfig(click_window_ms=100, conversion_window_ms=2_000, window_overrides=overrides)
    assert _shortest_publish_delay_ms(config) == expected


@pytest.mark.slow
def test_wait_mode_reads_only_row_groups_that_can_be_due_and_returns_what_a_full_read_returns(
        tmp_path, make_event, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="sequences.pipeline")
    lake = str(tmp_path / "lake")
    config = GemlineConfig(lake=lake, build=dataclasses.replace(CONFIG, window_overrides=("d1:conversion:6000",)))
    real = pipeline.due_pending
    calls = []

    def twin(*args, **kwargs):
        due = real(*args, **kwargs)
        every = real(*args, **{**kwargs, "row_groups": "all"})
        assert sorted(due.to_pylist(), key=str) == sorted(every.to_pylist(), key=str)
        calls.append(due.num_rows)
        return due

    monkeypatch.setattr(pipeline, "due_pending", twin)
    for n in range(6):  # 200 impressions a pass, 1 s of event time apart: 4-6 passes wait in the state
        rows = [make_event(f"p{n}_{k}", n * 1_000 + k, "impression", user=f"u{k % 7}", item=f"i{k % 5}",
                           domain=f"d{k % 2}") for k in range(0, 1_000, 5)]
        rows += [make_event(f"p{n}_c{k}", n * 1_000 + k + 50, "click", user=f"u{k % 7}", item=f"i{k % 5}",
                            domain=f"d{k % 2}") for k in range(0, 1_000, 35)]
        write_events(lake, rows * 1, version=n)
        run_build(*build_args(config))
    assert len(calls) == 5 and sum(calls) > 0
    # Some pass skipped row groups whose impressions could not be due yet (most of a late pass's pending state).
    searched = [tuple(map(int, r.getMessage().split("from ")[1].split(" row")[0].split(" of "))) for r in caplog.records
                if r.getMessage().startswith("due_pending: keys read from")]
    assert len(searched) == 5 and any(0 < kept < total for kept, total in searched)
    assert read_table(lake, Table.EXAMPLES).num_rows > 0
