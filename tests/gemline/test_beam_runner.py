from __future__ import annotations

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.runners.portability import prism_runner
from apache_beam.testing.util import assert_that, equal_to

from gemline.beam_runner import LOCAL_RUNNER, local_runner_args


def _runner(args: list[str]) -> str | None:
    return PipelineOptions(args).view_as(StandardOptions).runner


@pytest.mark.parametrize("args", [[], ["--runner=DirectRunner"], ["--runner", "DirectRunner"], ["--runner=direct"],
                                  ["--runner=dask", "--runner=DirectRunner"], ["--direct_num_workers=2"]])
def test_the_direct_runner_named_or_by_default_becomes_the_local_runner(args):
    out = local_runner_args(args)
    assert _runner(out) == LOCAL_RUNNER
    assert out[: len(args)] == args, "the caller's flags are kept, in order"


@pytest.mark.parametrize("args", [["--runner=gemline.cluster.GemlineDaskRunner"], ["--runner=PrismRunner"],
                                  ["--runner=FlinkRunner", "--flink_master=localhost:8081"]])
def test_other_runners_are_left_alone(args):
    assert local_runner_args(args) == args


def test_the_local_runner_runs_a_pipeline_without_trying_prism(monkeypatch):
    tried = []
    monkeypatch.setattr(prism_runner.PrismRunner, "run_pipeline",
                        lambda self, *a, **k: tried.append(1) or pytest.fail("Prism was tried"))
    with beam.Pipeline(options=PipelineOptions(local_runner_args([]))) as p:
        out = p | beam.Create([1, 2, 3]) | beam.Map(lambda x: x * 10) | beam.CombineGlobally(sum)
        assert_that(out, equal_to([60]))
    assert tried == []
