"""benchmarks.pointer_history pairs each examples version with the history version its build wrote, and its
replay (old and new path checked equal inside) prints the totals of every version it replayed."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from benchmarks.pointer_history import build_versions, main
from gemline.config import GemlineConfig
from sequences.pipeline import run_build
from tests.conftest import build_args
from tests.sequences.conftest import event
from tests.sequences.test_pipeline import CONFIG as PIPELINE
from tests.sequences.test_pipeline import _events as pipeline_events
from tests.sequences.test_pipeline import write_events


@pytest.mark.slow
def test_replay_of_a_two_build_lake(tmp_path, monkeypatch, capsys):
    lake = str(tmp_path / "lake")
    config = GemlineConfig(lake=lake, build=dataclasses.replace(PIPELINE, examples_layout="pointer"))
    batches = [pipeline_events(event), [event("b_imp2", 2_500, "impression", user="u2", item="i3")]]
    for version, batch in enumerate(batches):
        write_events(lake, batch, version=version)
        run_build(*build_args(config), final=version == len(batches) - 1)
    examples, history = build_versions(lake, "examples"), build_versions(lake, "history")
    assert sorted(examples.values()) == sorted(history.values()) == [0, 1]  # one commit of each per build
    monkeypatch.setattr(sys, "argv", ["pointer_history", "--lake", lake])
    main()
    out = capsys.readouterr().out
    assert out.count("examples@") == 2 and "all versions (2 versions" in out
