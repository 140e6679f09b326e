"""Peak memory of bounded ingest over a large topic: N synthetic events, Kafka -> Beam -> Delta.

``python -m benchmarks.ingest_rss --events N [--partitions P] [--max-offsets-per-partition M] [--seed S]``

Three processes, so that each one's peak RSS is its own:

1. this one starts the embedded broker (tansu, in-memory storage) and reports at the end;
2. ``produce``: generates the traffic chunk by chunk (``ingest.generate`` once, then the chunk
   replayed with fresh event ids and shifted times, so memory does not grow with N) and produces
   it in large record batches. tansu reports a partition's high watermark as (base offset of its
   last batch) + 1, so each partition ends with one single-message batch that makes the
   watermark exact (see ``ingest.config.KafkaConfig.producer_batch_messages``);
3. ``ingest``: :func:`ingest.pipeline.ingest_backlog` with ``max_offsets_per_partition = M``:
   batches of at most P x M messages until caught up. It prints its peak RSS (``ru_maxrss`` of
   the process, and of its children if any) after the first batch and at the end, in MiB: with
   bounded batches the peak stays flat as N grows.

The last line reads ``peak RSS ingest: X MiB for N events``. Source of ``ru_maxrss`` units
(KiB on Linux): getrusage(2).
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

TOPIC = "bench.rss"
CHUNK_USERS = 600  # ~50k generated events per chunk


def _peak_mib(who: int) -> float:
    """Peak resident set size of ``who`` (``resource.RUSAGE_SELF`` / ``RUSAGE_CHILDREN``), MiB."""
    return resource.getrusage(who).ru_maxrss / 1024


def produce_batched(bootstrap: str, topic: str, messages: Iterable[tuple[bytes | None, bytes]], partitions: int,
                    *, progress: tqdm | None = None) -> int:
    """Produce (key, value) ``messages`` round-robin over ``partitions`` in large record batches, then
    one closing single-message batch per partition; return the messages produced (closing ones included).

    tansu reports a partition's high watermark as (base offset of its last batch) + 1: the closing
    message makes the last batch one message long, so the watermark is exact and a bounded snapshot
    reads everything. Real producers batch like this; one message per batch (what ``gemline replay``
    does on tansu) makes the consumer pay a batch's overhead per message.

    Raises:
        RuntimeError: messages still unacknowledged after 30 minutes.
    """
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "batch.num.messages": 10_000, "linger.ms": 20,
                         "queue.buffering.max.messages": 500_000, "queue.buffering.max.kbytes": 512 * 1024})
    sent = 0
    for key, value in messages:
        while True:
            try:
                producer.produce(topic, key=key, value=value, partition=sent % partitions)
                break
            except BufferError:
                producer.poll(0.05)
        sent += 1
        if progress is not None and sent % 10_000 == 0:
            progress.update(10_000)
    if producer.flush(1_800) != 0:
        raise RuntimeError("produce: messages still unacknowledged after 30 min")
    closer = Producer({"bootstrap.servers": bootstrap, "batch.num.messages": 1, "linger.ms": 0})
    for p in range(partitions):
        closer.produce(topic, key=b"end", value=b'{"benchmark": "end of partition"}', partition=p)
        closer.flush(60)
    return sent + partitions


def message_of(record: Any) -> tuple[bytes | None, bytes]:
    """The Kafka (key, value) of a generated record: an ``Event`` as JSON, a ``RawRecord`` as is."""
    from ingest.schema import Event

    if isinstance(record, Event):
        return record.key, record.to_json()
    return record.key, record.value


def _chunked_traffic(num_events: int, seed: int, state: dict) -> Iterator[tuple[bytes | None, bytes]]:
    """``num_events`` messages: one generated chunk, replayed with fresh event ids and shifted times."""
    from ingest.generate import GenerateConfig, generate_records
    from ingest.schema import Event

    base = generate_records(GenerateConfig(seed=seed, num_users=CHUNK_USERS, days=1.0, bad_rate=0.002))
    rows = []
    for rec in base:
        key, value = message_of(rec)
        rows.append((key, json.loads(value) if isinstance(rec, Event) else value))
    times = [v["event_time_ms"] for _, v in rows if isinstance(v, dict)]
    span_ms = max(times) - min(times) + 1_000
    sent, chunk = 0, 0
    while sent < num_events:
        for key, value in rows[: num_events - sent]:
            if isinstance(value, dict):
                value = dict(value, event_id=f"{value['event_id']}~{chunk}",
                             event_time_ms=value["event_time_ms"] + chunk * span_ms)
                state["last_ms"] = max(state.get("last_ms", 0), value["event_time_ms"])
                value = json.dumps(value, separators=(",", ":")).encode()
            yield key, value
            sent += 1
        chunk += 1


def produce(bootstrap: str, topic: str, num_events: int, partitions: int, seed: int) -> dict:
    """Produce ``num_events`` synthetic messages (+ one closing message per partition); return counts and rates."""
    state: dict = {}
    began, cpu = time.perf_counter(), time.process_time()
    with tqdm(total=num_events, desc="produce", unit="msg", disable=None) as progress:
        sent = produce_batched(bootstrap, topic, _chunked_traffic(num_events, seed, state), partitions,
                               progress=progress)
    wall = time.perf_counter() - began
    return {"produced": sent, "produce_wall_s": wall, "produce_per_s": sent / wall,
            "produce_cpu_s": time.process_time() - cpu, "now_ms": state["last_ms"] + 60_000,
            "produce_peak_rss_mib": _peak_mib(resource.RUSAGE_SELF)}


def ingest(bootstrap: str, topic: str, lake: str, partitions: int, max_offsets: int, now_ms: int) -> dict:
    """Ingest the whole topic in capped batches; return rows written, timing and peak RSS."""
    from gemline.lake import Lake
    from ingest.config import IngestConfig, KafkaConfig
    from ingest.pipeline import ingest_backlog

    kafka = KafkaConfig(topic=topic, partitions=partitions)
    ingest_cfg = IngestConfig(max_offsets_per_partition=max_offsets)
    began, cpu = time.perf_counter(), time.process_time()
    rows, batches, first_peak = 0, 0, None
    with tqdm(desc="ingest", unit="msg", disable=None) as progress:
        while True:
            done = ingest_backlog(Lake(lake), kafka, ingest_cfg, bootstrap=bootstrap, now_ms=now_ms, max_batches=1)
            if not done:
                break
            res = done[0]
            written = res.events_written + res.dead_letter_written + res.late_events_written + res.duplicates_dropped
            rows += written
            batches += 1
            progress.update(written)
            progress.set_postfix(peak_rss_mib=f"{_peak_mib(resource.RUSAGE_SELF):.0f}")
            if first_peak is None:
                first_peak = _peak_mib(resource.RUSAGE_SELF)
    wall = time.perf_counter() - began
    return {"ingested": rows, "batches": batches, "ingest_wall_s": wall, "ingest_cpu_s": time.process_time() - cpu,
            "peak_rss_after_first_batch_mib": first_peak, "peak_rss_mib": _peak_mib(resource.RUSAGE_SELF),
            "children_peak_rss_mib": _peak_mib(resource.RUSAGE_CHILDREN)}


def _child(argv: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.ingest_rss", *argv], check=True, stdout=subprocess.PIPE,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    """Parse flags; run as the orchestrator, or as its ``produce`` / ``ingest`` child."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", nargs="?", choices=["produce", "ingest"], help=argparse.SUPPRESS)
    parser.add_argument("--events", type=int, default=1_000_000, help="messages to produce (default 1000000)")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--max-offsets-per-partition", type=int, default=100_000,
                        help="ingest.max_offsets_per_partition: a batch holds at most P x this many messages")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    parser.add_argument("--lake", help=argparse.SUPPRESS)
    parser.add_argument("--now-ms", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.events < 1 or args.partitions < 1 or args.max_offsets_per_partition < 1:
        parser.error("--events, --partitions and --max-offsets-per-partition must be >= 1")
    logging.basicConfig(level=logging.WARNING)
    if args.role == "produce":
        print(json.dumps(produce(args.bootstrap, TOPIC, args.events, args.partitions, args.seed)))
        return
    if args.role == "ingest":
        print(json.dumps(ingest(args.bootstrap, TOPIC, args.lake, args.partitions, args.max_offsets_per_partition,
                                args.now_ms)))
        return

    from ingest.broker import EmbeddedBroker
    from ingest.replay import ensure_topic

    common = ["--partitions", str(args.partitions), "--seed", str(args.seed)]
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory(prefix="gemline-rss-") as tmp:
        ensure_topic(broker.bootstrap, TOPIC, args.partitions)
        made = _child(["produce", "--bootstrap", broker.bootstrap, "--events", str(args.events), *common])
        got = _child(["ingest", "--bootstrap", broker.bootstrap, "--lake", str(Path(tmp) / "lake"),
                      "--now-ms", str(made["now_ms"]), "--max-offsets-per-partition",
                      str(args.max_offsets_per_partition), *common])
    report = {**made, **got}
    for key, value in report.items():
        print(f"{key:<34}{value:>16.1f}" if isinstance(value, float) else f"{key:<34}{value:>16}")
    if got["ingested"] != made["produced"]:
        print(f"MISMATCH: produced {made['produced']}, ingested {got['ingested']}")
    print(f"peak RSS ingest: {got['peak_rss_mib']:.0f} MiB for {made['produced']} events "
          f"({got['batches']} batches of <= {args.partitions} x {args.max_offsets_per_partition})")


if __name__ == "__main__":
    main()
