"""Which local Beam runner ``DirectRunner`` means in gemline: Beam's DirectRunner minus its Prism attempt.

Since Beam 2.6x, ``--runner=DirectRunner`` (``SwitchingDirectRunner``) first tries the Prism
runner, a Go binary it downloads from GitHub on first use, and falls back to the FnApiRunner
(or, for ``TestStream`` and real-time timers, the BundleBasedDirectRunner) when that fails. So
the same pipeline ran on Prism on a machine with internet access and on the FnApiRunner on one
without, and on the second paid a failed download (a DNS lookup, TLS set-up, a job server start)
on every run: ~2% of an ingest micro-batch's CPU in ``py-spy``. gemline's pipelines are
tested on the FnApiRunner and the BundleBasedDirectRunner, so ``DirectRunner`` runs there,
everywhere. Prism stays available by name (``--runner=PrismRunner``).

Source: ``apache_beam.runners.direct.direct_runner.SwitchingDirectRunner.run_pipeline`` (Beam
2.77): Prism is skipped for interactive runs, which is the one effect of ``is_interactive()``.
"""

from __future__ import annotations

from collections.abc import Sequence

from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.runners.direct.direct_runner import SwitchingDirectRunner

LOCAL_RUNNER = "gemline.beam_runner.LocalDirectRunner"
"""Fully qualified name of :class:`LocalDirectRunner` for Beam's ``--runner`` flag."""

_DIRECT_NAMES = frozenset({"directrunner", "direct", "switchingdirectrunner"})


class LocalDirectRunner(SwitchingDirectRunner):
    """Beam's DirectRunner without the Prism attempt: the FnApiRunner for batch pipelines, the
    BundleBasedDirectRunner for what the FnApiRunner lacks (``TestStream``, real-time timers)."""

    def run_pipeline(self, pipeline, options):
        """Run ``pipeline`` locally; see ``SwitchingDirectRunner.run_pipeline``."""
        self.is_interactive()  # the switch's only Prism opt-out (see the module docstring)
        return super().run_pipeline(pipeline, options)


def local_runner_args(beam_args: Sequence[str]) -> list[str]:
    """``beam_args`` with the DirectRunner, named or left as Beam's default, replaced by
    :data:`LOCAL_RUNNER`; any other runner (Dask, Flink, Dataflow, ``PrismRunner``) is kept.

    Appends ``--runner=...``: Beam's flag parser takes the last occurrence.
    """
    args = list(beam_args)
    runner = PipelineOptions(args).view_as(StandardOptions).runner
    if runner is None or (isinstance(runner, str) and runner.lower() in _DIRECT_NAMES):
        args.append(f"--runner={LOCAL_RUNNER}")
    return args
