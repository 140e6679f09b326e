"""Benchmark of the sequence and example build: Beam DirectRunner vs one polars process.

    python -m benchmarks.build --users 2000 --events-per-user 50 [--max-seq-len 256] [--batches 1]

Synthetic events (seeded numpy: users, items, two domains, impressions with clicks and
conversions following some of them) go into a fresh events table under a temp lake; then

- ``beam``: :func:`sequences.pipeline.run_build` with ``final=True`` (sequences, labels,
  features, examples, state), events/s = events / wall seconds, over ``--batches`` increments;
- ``polars``: the same per-impression computation in one polars process: newest N earlier events
  of the user (item, category, type, domain lists), click and conversion labels within the
  windows, user counters over 1 d / 7 d / all time. It skips the point-in-time check on append
  times, dedup and the Delta writes, so it is an optimistic reference.

The ratio beam / polars (goal >= 0.5) is printed last. ``--users 1000000`` is the peak-RSS run
(``ru_maxrss`` of this process, MiB, printed with the rates).
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa

DAY_MS = 24 * 3600 * 1000


def synthetic_events(users: int, events_per_user: int, seed: int = 0) -> pa.Table:
    """``users * events_per_user`` events rows of EVENTS_TABLE_SCHEMA over 14 days, seeded."""
    from ingest.schema import EVENTS_TABLE_SCHEMA

    rng = np.random.default_rng(seed)
    n = users * events_per_user
    t = rng.integers(0, 14 * DAY_MS, n)
    kinds = rng.choice(np.array(["impression", "click", "conversion", "engagement"]), n, p=[0.6, 0.15, 0.05, 0.2])
    user = rng.integers(0, users, n)
    item = rng.integers(0, max(10, users // 2), n)
    dates = (t // DAY_MS).astype("datetime64[D]").astype(str)
    return pa.table({
        "event_id": [f"e{i}" for i in range(n)],
        "event_time_ms": t,
        "user_id": [f"u{x}" for x in user],
        "item_id": [f"i{x}" for x in item],
        "domain": np.where(rng.random(n) < 0.5, "d1", "d2"),
        "event_type": kinds,
        "category": [f"c{x % 50}" for x in item],
        "position": pa.nulls(n, pa.int32()),
        "ad_format": pa.nulls(n, pa.string()),
        "age": pa.nulls(n, pa.int32()),
        "gender": pa.nulls(n, pa.string()),
        "location": pa.nulls(n, pa.string()),
        "schema_version": pa.array(np.ones(n, dtype=np.int32)),
        "created_ts_ms": t,
        "event_date": dates,
        "kafka_topic": ["bench"] * n,
        "kafka_partition": pa.array(np.zeros(n, dtype=np.int32)),
        "kafka_offset": np.arange(n),
        "event_time_us": t * 1000,
    }).select(EVENTS_TABLE_SCHEMA.names).cast(EVENTS_TABLE_SCHEMA)


def polars_reference(events: pa.Table, max_seq_len: int, click_ms: int, conversion_ms: int) -> pl.DataFrame:
    """Examples (one row per impression) computed in one polars process; see the module docstring."""
    df = pl.from_arrow(events).sort("user_id", "event_time_ms", "event_id")
    df = df.with_columns(pl.int_range(pl.len()).over("user_id").alias("rank"))
    lists = df.group_by("user_id").agg(
        [pl.col(c).alias(f"all_{c}") for c in ("item_id", "category", "event_type", "domain", "event_time_ms")])
    imps = df.filter(pl.col("event_type") == "impression").join(lists, on="user_id")
    start = (pl.col("rank") - max_seq_len).clip(lower_bound=0)
    imps = imps.with_columns(
        [pl.col(f"all_{c}").list.slice(start, pl.col("rank") - start).alias(f"seq_{c}")
         for c in ("item_id", "category", "event_type", "domain", "event_time_ms")]
    ).drop([f"all_{c}" for c in ("item_id", "category", "event_type", "domain", "event_time_ms")])
    for label, window in (("click", click_ms), ("conversion", conversion_ms)):
        hits = (imps.select("event_id", "user_id", "item_id", "domain", "event_time_ms")
                .join(df.filter(pl.col("event_type") == label)
                      .select("user_id", "item_id", "domain", pl.col("event_time_ms").alias("label_ms")),
                      on=["user_id", "item_id", "domain"])
                .filter((pl.col("label_ms") >= pl.col("event_time_ms"))
                        & (pl.col("label_ms") <= pl.col("event_time_ms") + window))
                .group_by("event_id").agg((pl.col("label_ms") - pl.col("event_time_ms")).min().alias(f"{label}_lat")))
        imps = imps.join(hits, on="event_id", how="left")
    counted = df.with_columns(
        pl.from_epoch("event_time_ms", time_unit="ms").alias("ts"),
        (pl.col("event_type") == "impression").cast(pl.Int64).alias("is_imp"),
        (pl.col("event_type") == "click").cast(pl.Int64).alias("is_click"),
    ).sort("ts")
    counters = counted.with_columns(
        *[pl.col(c).rolling_sum_by("ts", w, closed="left").over("user_id", "domain").alias(f"{c}_{w}")
          for c in ("is_imp", "is_click") for w in ("1d", "7d")],
        *[(pl.col(c).cum_sum() - pl.col(c)).over("user_id", "domain").alias(f"{c}_all") for c in ("is_imp", "is_click")],
    ).select("event_id", "is_imp_1d", "is_click_1d", "is_imp_7d", "is_click_7d", "is_imp_all", "is_click_all")
    return imps.join(counters, on="event_id", how="left")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=2000)
    parser.add_argument("--events-per-user", type=int, default=50)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--batches", type=int, default=1, help="incremental builds the events are split into")
    args = parser.parse_args(argv)

    from gemline.config import GemlineConfig
    from gemline.lake import commit_once
    from sequences.config import BuildConfig
    from sequences.pipeline import run_build

    events = synthetic_events(args.users, args.events_per_user)
    build = BuildConfig(max_seq_len=args.max_seq_len)
    with tempfile.TemporaryDirectory() as tmp:
        lake = str(Path(tmp) / "lake")
        config = GemlineConfig(lake=lake, build=build)
        order = np.argsort(events.column("event_time_ms").to_numpy(), kind="stable")
        parts = np.array_split(order, args.batches)
        beam_s = 0.0
        for k, part in enumerate(parts):
            commit_once(lake, "events", events.take(pa.array(part)), app_id="bench", version=k,
                        partition_by=["event_date"])
            start = time.perf_counter()
            result = run_build(config, final=k == len(parts) - 1)
            beam_s += time.perf_counter() - start
    start = time.perf_counter()
    reference = polars_reference(events, args.max_seq_len, build.click_window_ms, build.conversion_window_ms)
    polars_s = time.perf_counter() - start
    n = events.num_rows
    beam_rate, polars_rate = n / beam_s, n / polars_s
    print(f"events: {n}, examples: beam {result.num_examples}, polars {reference.height}")
    print(f"beam (DirectRunner, {args.batches} batch(es)): {beam_s:.1f} s, {beam_rate:,.0f} events/s")
    print(f"polars (one process): {polars_s:.2f} s, {polars_rate:,.0f} events/s")
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    print(f"ratio beam/polars: {beam_rate / polars_rate:.3f} (goal >= 0.5)")


if __name__ == "__main__":
    main()
