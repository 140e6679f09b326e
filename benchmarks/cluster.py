"""Benchmark ingest (and optionally build) on a Dask LocalCluster with 1 and 2 worker processes vs the DirectRunner.

``python -m benchmarks.cluster [--events N] [--partitions P] [--workers 1,2] [--build] [--seed S]``

Synthetic traffic (``ingest.generate``, 3 days, ``num_users`` sized to about ``--events``; use
``--events 2000000`` for millions) is produced once to the embedded broker. Then each runner
ingests the same snapshot into a fresh lake with ``ingest.pipeline.run_ingest`` (plan, Beam
pipeline, staging, dedup, the three commits), and with ``--build`` runs ``sequences.pipeline.run_build``
(``final=True``) on it. Cluster start-up is timed apart and excluded from the job times.

Reported per run: wall seconds and events/s (events committed / wall seconds of the job), and
the 2-worker/1-worker throughput ratio. Every run must commit the same number of events and
dead-letter rows, or the benchmark fails. Wall time on a shared 2-core host varies with what
else runs: read the numbers as a rough comparison, not a capacity figure.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from gemline.cluster import dask_beam_args
from gemline.config import GemlineConfig
from gemline.lake import Lake, read_table
from ingest.broker import EmbeddedBroker
from ingest.config import KafkaConfig
from ingest.generate import GenerateConfig, generate_records, stream_records
from ingest.pipeline import run_ingest
from sequences.config import BuildConfig

EVENTS_PER_USER = 48  # ~ 3 days x 2 sessions/day x (5 ads + 3 engagements) with the generator's defaults
NOW_MS = 1_800_000_000_000  # fixed ingest clock, after every generated event


@dataclass(frozen=True)
class Run:
    """One runner's result on the shared snapshot."""

    runner: str
    ingest_s: float
    events: int
    dead_letter: int
    build_s: float | None = None
    examples: int | None = None

    @property
    def events_per_s(self) -> float:
        """Committed events per wall second of the ingest job."""
        return self.events / self.ingest_s


def _run(name: str, lake: Path, bootstrap: str, topic: str, partitions: int, beam_args: list[str],
         build: bool) -> Run:
    config = GemlineConfig(lake=str(lake), kafka=KafkaConfig(topic=topic, partitions=partitions),
                           build=BuildConfig(events_gate="off"))  # timing, not the quality gate
    began = time.perf_counter()
    result = run_ingest(Lake.for_config(config), config.kafka, config.ingest, bootstrap=bootstrap, beam_args=beam_args,
                        now_ms=NOW_MS)
    ingest_s = time.perf_counter() - began
    build_s = examples = None
    if build:
        from sequences.pipeline import run_build

        began = time.perf_counter()
        run_build(Lake.for_config(config), config.build, beam_args=beam_args, final=True)
        build_s = time.perf_counter() - began
        examples = read_table(lake, "examples").num_rows
    return Run(name, ingest_s, result.events_written, result.dead_letter_written, build_s, examples)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print one line per runner; returns the exit code.

    Raises:
        RuntimeError: two runners committed different row counts.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=300_000, help="approximate events to generate")
    parser.add_argument("--partitions", type=int, default=4, help="Kafka partitions (the ingest parallelism)")
    parser.add_argument("--workers", default="1,2", help="comma-separated Dask worker-process counts")
    parser.add_argument("--build", action="store_true", help="also time the build on each lake")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from distributed import LocalCluster

    workers = [int(w) for w in args.workers.split(",")]
    gen = GenerateConfig(num_users=max(10, args.events // EVENTS_PER_USER), bad_rate=0.001, seed=args.seed)
    records = generate_records(gen)
    topic = "bench-cluster"
    runs: list[Run] = []
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        stream_records(records, bootstrap=broker.bootstrap, topic=topic, partitions=args.partitions)
        print(f"produced {len(records)} records in {time.perf_counter() - began:.1f} s "
              f"({args.partitions} partitions)", flush=True)
        plans = [("DirectRunner", None), *((f"Dask x{n}", n) for n in workers)]
        for name, n in tqdm(plans, desc="runners", unit="run"):
            lake = Path(tmp) / name.replace(" ", "_")
            if n is None:
                runs.append(_run(name, lake, broker.bootstrap, topic, args.partitions, [], args.build))
                continue
            began = time.perf_counter()
            with LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
                print(f"{name}: cluster up in {time.perf_counter() - began:.1f} s", flush=True)
                runs.append(_run(name, lake, broker.bootstrap, topic, args.partitions,
                                 dask_beam_args(cluster.scheduler_address), args.build))
    for run in runs:
        build = "" if run.build_s is None else f"  build {run.build_s:7.1f} s ({run.examples} examples)"
        print(f"{run.runner:>14}: ingest {run.ingest_s:7.1f} s  {run.events_per_s:9.0f} events/s  "
              f"({run.events} events, {run.dead_letter} dead-letter){build}")
    counts = {(r.events, r.dead_letter, r.examples) for r in runs}
    if len(counts) != 1:
        raise RuntimeError(f"runners disagree on committed rows: {counts}")
    by_name = {r.runner: r for r in runs}
    if "Dask x1" in by_name and "Dask x2" in by_name:
        ratio = by_name["Dask x2"].events_per_s / by_name["Dask x1"].events_per_s
        print(f"ingest throughput 2 workers / 1 worker: {ratio:.2f}")
        if args.build:
            print(f"build time 1 worker / 2 workers: {by_name['Dask x1'].build_s / by_name['Dask x2'].build_s:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
