"""Benchmark the ingest job (Kafka -> Beam -> Delta) against a plain consumer loop, end to end.

``python -m benchmarks.ingest [--events N] [--partitions P] [--batch-records B] [--seed S]``

Synthetic traffic (``ingest.generate``) is produced once to the embedded broker, in large record
batches as real producers send them (``benchmarks.ingest_rss.produce_batched``; ``--one-per-batch``
produces one message per batch instead, as ``gemline replay`` does on tansu, which makes every
consumer pay a record batch's overhead per message); then, in this process, on two fresh lakes:

* baseline: a confluent-kafka consumer ``assign``-ed to every partition reads [0, high watermark),
  each ``B`` messages become one Arrow batch (message fields straight into column lists with the
  cyclic GC paused, as the pipeline's source does), are parsed by the same vectorised
  ``ingest.vectorized.parse_batch``, and are appended to Delta (events, dead_letter) with one ``write_deltalake`` per batch and
  table. No exactly-once bookkeeping, no dedup, no lateness.
* pipeline: ``ingest.pipeline.run_ingest`` (plan, read and parse in process or, with ``--engine beam``, on Beam's
  DirectRunner with staging, dedup, lateness, the three idempotent commits).

Reported per run (each run ``--repeat`` times, alternating, on fresh lakes): wall seconds, CPU
seconds of this process (all threads), events/s and events per CPU-second ("per core"); the last
line is the ratio pipeline/baseline of events per CPU-second of the best (least CPU) run of each,
so that one-time costs in the process (the first Beam pipeline's set-up) and load spikes from
other jobs weigh less.
Both runs see the same broker and host; numbers on a shared machine vary run to run.
"""

from __future__ import annotations

import argparse
import gc
import logging
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
from deltalake import write_deltalake
from tqdm import tqdm

from benchmarks.ingest_rss import message_of, produce_batched
from gemline.config import GemlineConfig
from gemline.lake import Lake, read_table, table_uri
from ingest.broker import EmbeddedBroker
from ingest.config import IngestConfig, KafkaConfig
from ingest.datasets.types import event_time_sort_key
from ingest.generate import GenerateConfig, generate_records, stream_records
from ingest.kafka_clients import gc_paused
from ingest.kafka_source import RECORDS_SCHEMA
from ingest.pipeline import run_ingest
from ingest.replay import ensure_topic
from ingest.vectorized import parse_batch

TOPIC = "bench.events"


@dataclass(frozen=True)
class Run:
    """One timed ingest of the whole topic."""

    name: str
    events: int
    """Rows written to events + dead_letter (+ late_events)."""
    wall_s: float
    cpu_s: float

    @property
    def per_s(self) -> float:
        """Events per wall second."""
        return self.events / self.wall_s

    @property
    def per_cpu_s(self) -> float:
        """Events per CPU-second of this process (events/s per core)."""
        return self.events / self.cpu_s


def _synthetic(num_events: int, seed: int) -> list:
    """About ``num_events`` generated records (the generator's size knob is users; cut to exactly N)."""
    cfg = GenerateConfig(seed=seed, num_users=max(10, num_events // 90), days=3.0)
    records = generate_records(cfg)
    while len(records) < num_events:
        cfg = replace(cfg, num_users=cfg.num_users * 2)
        records = generate_records(cfg)
    return records[:num_events]


def baseline(bootstrap: str, lake: Path, config: IngestConfig, batch_records: int, now_ms: int) -> int:
    """Plain consumer loop + parse_batch + one Delta append per batch and table; returns rows written."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-baseline", "enable.auto.commit": False,
                         "enable.partition.eof": False, "auto.offset.reset": "earliest"})
    parts = sorted(consumer.list_topics(TOPIC, timeout=30).topics[TOPIC].partitions)
    ends = {p: consumer.get_watermark_offsets(TopicPartition(TOPIC, p), timeout=30, cached=False)[1] for p in parts}
    consumer.assign([TopicPartition(TOPIC, p, 0) for p in parts])
    remaining, written = sum(ends.values()), 0
    args = dict(domains=config.domains, now_ms=now_ms, max_future_skew_ms=config.max_future_skew_ms,
                retention_ms=config.retention_ms, min_event_time_ms=config.min_event_time_ms,
                max_message_bytes=config.max_message_bytes)
    with tqdm(total=remaining, desc="baseline", unit="msg", disable=None) as progress:
        while remaining > 0:
            with gc_paused():  # as the pipeline's source does: see ingest.kafka_clients.gc_paused
                msgs = consumer.consume(num_messages=min(batch_records, remaining), timeout=5.0)
                if not msgs:
                    raise TimeoutError(f"baseline: no message in 5 s with {remaining} left")
                msgs = [m for m in msgs if m.error() is None]
                batch = pa.RecordBatch.from_arrays(
                    [pa.array([m.topic() for m in msgs], pa.string()),
                     pa.array([m.partition() for m in msgs], pa.int32()),
                     pa.array([m.offset() for m in msgs], pa.int64()), pa.array([m.key() for m in msgs], pa.binary()),
                     pa.array([m.value() for m in msgs], pa.binary()),
                     pa.array([m.timestamp()[1] for m in msgs], pa.int64()), pa.nulls(len(msgs), pa.int64())],
                    schema=RECORDS_SCHEMA)
            events, dead = parse_batch(batch, **args)
            write_deltalake(table_uri(lake, "events"), events, mode="append", partition_by=["event_date"])
            write_deltalake(table_uri(lake, "dead_letter"), dead, mode="append")
            written += events.num_rows + dead.num_rows
            remaining -= len(msgs)
            progress.update(len(msgs))
    consumer.close()
    return written


def _timed(name: str, fn) -> Run:
    wall, cpu = time.perf_counter(), time.process_time()
    events = fn()
    return Run(name, events, time.perf_counter() - wall, time.process_time() - cpu)


def main(argv: list[str] | None = None) -> None:
    """Parse flags, produce the traffic, time both runs, print the table and the ratio last."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=20_000, help="messages to produce (default 20000)")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--batch-records", type=int, default=IngestConfig.batch_max_records,
                        help=f"messages per Arrow batch, both runs (default {IngestConfig.batch_max_records})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", choices=("auto", "inprocess", "beam"), default=IngestConfig.engine,
                        help="ingest.engine of the pipeline run (default: the config's, in process here)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="time each run this many times on fresh lakes; the ratio uses the best (least CPU) of each")
    parser.add_argument("--one-per-batch", action="store_true",
                        help="produce one message per Kafka record batch (as gemline replay on tansu)")
    args = parser.parse_args(argv)
    if args.events < 1 or args.repeat < 1:
        parser.error(f"--events and --repeat must be >= 1, got {args.events} and {args.repeat}")
    logging.basicConfig(level=logging.WARNING)

    records = _synthetic(args.events, args.seed)
    now_ms = max(getattr(r, "event_time_ms", 0) or 0 for r in records) + 60_000
    ingest_cfg = IngestConfig(batch_max_records=args.batch_records, engine=args.engine)
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory(prefix="gemline-bench-") as tmp:
        ensure_topic(broker.bootstrap, TOPIC, args.partitions)
        if args.one_per_batch:
            stream_records(records, bootstrap=broker.bootstrap, topic=TOPIC, partitions=args.partitions)
        else:
            ordered = sorted(records, key=event_time_sort_key)
            produce_batched(broker.bootstrap, TOPIC, (message_of(r) for r in ordered), args.partitions)
            del ordered
        # An ingest process does not hold the generated records: N live Python objects would make
        # every cyclic garbage collection in the timed runs scan them.
        del records
        gc.collect()
        runs: list[Run] = []
        for rep in range(args.repeat):
            lake = Path(tmp) / f"base{rep}"
            runs.append(_timed("baseline", lambda: baseline(broker.bootstrap, lake, ingest_cfg, args.batch_records,
                                                            now_ms)))
            base_rows = read_table(lake, "events").num_rows
            cfg = GemlineConfig(lake=str(Path(tmp) / f"pipe{rep}"),
                                kafka=KafkaConfig(topic=TOPIC, partitions=args.partitions), ingest=ingest_cfg)

            def pipeline() -> int:
                res = run_ingest(Lake.for_config(cfg), cfg.kafka, cfg.ingest, bootstrap=broker.bootstrap, now_ms=now_ms)
                return res.events_written + res.dead_letter_written + res.late_events_written + res.duplicates_dropped

            runs.append(_timed("pipeline", pipeline))
            pipe_rows = read_table(cfg.lake, "events").num_rows
    print(f"{'run':<10}{'messages':>10}{'wall s':>9}{'cpu s':>8}{'events/s':>11}{'events/cpu-s':>14}")
    for run in runs:
        print(f"{run.name:<10}{run.events:>10}{run.wall_s:>9.2f}{run.cpu_s:>8.2f}{run.per_s:>11.0f}{run.per_cpu_s:>14.0f}")
    print(f"events rows: baseline {base_rows}, pipeline {pipe_rows} (the pipeline also drops duplicate deliveries)")
    base = min((r for r in runs if r.name == "baseline"), key=lambda r: r.cpu_s)
    pipe = min((r for r in runs if r.name == "pipeline"), key=lambda r: r.cpu_s)
    print(f"best of {args.repeat}: baseline {base.per_cpu_s:.0f}, pipeline {pipe.per_cpu_s:.0f} events per CPU-second")
    print(f"ratio pipeline/baseline: {pipe.per_cpu_s / base.per_cpu_s:.2f} per core, {pipe.per_s / base.per_s:.2f} wall")


if __name__ == "__main__":
    main()
