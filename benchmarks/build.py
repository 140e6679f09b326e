"""Benchmark of the sequence and example build: Beam DirectRunner vs one polars process.

    python -m benchmarks.build --users 2000 --events-per-user 50 [--max-seq-len 256] [--batches 1]

Synthetic events (seeded numpy: users, items, two domains, impressions with clicks and
conversions following some of them) go into a fresh events table under a temp lake; then

- ``beam``: :func:`sequences.pipeline.run_build` with ``final=True`` (sequences, labels,
  features, examples, state), events/s = events / wall seconds, over ``--batches`` increments;
- ``polars``: the same per-impression computation in one polars process: newest N earlier events
  of the user, cross-domain and in the impression's domain (item, category, type, domain, time
  and time-delta lists), click and conversion labels within the windows, user counters over
  1 d / 7 d / all time; and the newest N events per user (the sequences table); then both written
  to Delta (examples partitioned by date, one ``write_deltalake`` each), as the build must store
  what it computes. It skips the point-in-time check on append times, dedup, the feature tables
  and the build state, so it is an optimistic reference. Its compute-only time is printed too.

The ratio beam / polars (goal >= 0.5) is printed last, preceded by the ratio against the
compute-only time.

``--compare-layouts [--max-seq-lens 128,2048]`` instead builds the same events with
``build.examples_layout`` "fat" and "pointer" (issue 15) at each max length, each build in a fresh child process (so each peak RSS is its own), and prints per
layout: build events/s, bytes of ``examples`` per example, bytes of ``history``, peak RSS; then,
on the pointer lake, the batch-time materialization rate (examples/s of reading the users'
history and encoding the rows' sequences, :func:`trainer.data.encode_examples`) against GEM's
training rate (examples/s of forward + backward + optimiser, :func:`benchmarks.train.examples_per_second`)
on batches of those very rows, and the ratio (goal >= 5). Each build also reports its CPU seconds
(events per CPU-second: the share of a shared machine a build gets moves its wall time, not its CPU time)
and its peak RSS per build phase (:class:`benchmarks.rss.RssPhases`); ``--repeats R`` builds everything R
times, interleaved, and prints medians and per-round ratios; ``--no-feed`` skips the GEM comparison. ``--pareto ALPHA`` draws events per user from a Pareto law capped at
``--max-events-per-user`` instead (the one-million-user run:
``--users 1000000 --pareto 1.5 --max-events-per-user 1000``), and the peak RSS (``ru_maxrss`` of
this process, MiB) and the Delta size of the lake (bytes on disk) are printed with the rates.

``--follow-cache`` instead builds the ``--batches`` increments twice in this process, pass for pass
interleaved on two lakes: each pass read fresh from Delta, and each pass sharing one
:class:`sequences.state_cache.BuildStateCache` (what ``build --follow`` does); it prints the CPU seconds
(user + system of this process, polars' threads included) of every pass of both, their ratio, and
checks that the two lakes hold the same rows (``--batches 4 --parallelism 1``: README "Pointer layout"'s
4 x 50,000-event measurement).
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
from deltalake import write_deltalake

DAY_MS = 24 * 3600 * 1000


def synthetic_events(users: int, events_per_user: int, seed: int = 0, *, pareto: float | None = None,
                     max_events_per_user: int = 1000) -> pa.Table:
    """Events rows of EVENTS_TABLE_SCHEMA over 14 days, seeded: ``users * events_per_user`` spread
    uniformly over users, or (``pareto``) per-user counts ``min(max_events_per_user,
    1 + floor(Pareto(alpha)))`` — a heavy tail of very active users."""
    from ingest.schema import EVENTS_TABLE_SCHEMA

    rng = np.random.default_rng(seed)
    if pareto is None:
        n = users * events_per_user
        user = rng.integers(0, users, n)
    else:
        counts = np.minimum(max_events_per_user, 1 + np.floor(rng.pareto(pareto, users)).astype(np.int64))
        user = np.repeat(np.arange(users), counts)
        n = user.size
    t = rng.integers(0, 14 * DAY_MS, n)
    kinds = rng.choice(np.array(["impression", "click", "conversion", "engagement"]), n, p=[0.6, 0.15, 0.05, 0.2])
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
        "kafka_generation": pa.array(np.zeros(n, dtype=np.int32)),
    }).select(EVENTS_TABLE_SCHEMA.names).cast(EVENTS_TABLE_SCHEMA)


def _with_history(imps: pl.DataFrame, df: pl.DataFrame, keys: list[str], max_len: int, prefix: str,
                  columns: tuple[str, ...]) -> pl.DataFrame:
    """``imps`` with the newest ``max_len`` earlier events of its ``keys`` group as ``prefix``-lists."""
    ranked = df.with_columns(pl.int_range(pl.len()).over(keys).alias("_rank"))
    lists = ranked.group_by(keys).agg([pl.col(c).alias(f"_all_{c}") for c in columns])
    rank = imps.join(ranked.select("event_id", "_rank"), on="event_id").join(lists, on=keys)
    start = (pl.col("_rank") - max_len).clip(lower_bound=0)
    return rank.with_columns(
        [pl.col(f"_all_{c}").list.slice(start, pl.col("_rank") - start).alias(f"{prefix}{c}") for c in columns]
    ).with_columns(
        (pl.col("event_time_ms") - pl.col(f"{prefix}event_time_ms")).alias(f"{prefix}time_delta_ms")
    ).drop(["_rank", *[f"_all_{c}" for c in columns]])


def polars_reference(events: pa.Table, max_seq_len: int, click_ms: int,
                     conversion_ms: int) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(examples, sequences) computed in one polars process; see the module docstring.

    Examples: one row per impression with the newest ``max_seq_len`` earlier events of the user
    (cross-domain) and of the user in the impression's domain (item, category, type, domain, time
    and time-delta lists), labels and user counters. Sequences: the newest ``max_seq_len`` events
    of each user."""
    df = pl.from_arrow(events).sort("user_id", "event_time_ms", "event_id")
    columns = ("item_id", "category", "event_type", "domain", "event_time_ms")
    imps = df.filter(pl.col("event_type") == "impression")
    imps = _with_history(imps, df, ["user_id"], max_seq_len, "seq_", columns)
    imps = _with_history(imps, df, ["user_id", "domain"], max_seq_len, "seq_same_domain_",
                         tuple(c for c in columns if c != "domain"))
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
    sequences = df.group_by("user_id").agg([pl.col(c).tail(max_seq_len).alias(f"seq_{c}") for c in columns])
    return imps.join(counters, on="event_id", how="left"), sequences


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def _commit_batches(lake: str, events: pa.Table, batches: int) -> int:
    """Commit ``events`` in event-time order as ``batches`` versions of LAKE/events (0, 1, ...); the count."""
    from gemline.lake import commit_once

    order = np.argsort(events.column("event_time_ms").to_numpy(), kind="stable")
    parts = np.array_split(order, batches)
    for k, part in enumerate(parts):
        commit_once(lake, "events", events.take(pa.array(part)), app_id="bench", version=k, partition_by=["event_date"])
    return len(parts)


def _build_committed(lake: str, versions: int, build, beam_args: list[str]) -> dict[str, Any]:
    """One layout's build in this (child) process, of events already committed (:func:`_commit_batches`):
    ``events@0`` .. ``events@versions-1`` one after the other, so its peak RSS is the build's alone,
    not also the events table a harness would hand it. Returns wall seconds, CPU seconds of this
    process (user + system: the DirectRunner runs in it; less sensitive than wall time to other jobs
    on the machine), examples, bytes, peak RSS (MiB) and the peak per build phase
    (:class:`benchmarks.rss.RssPhases`, key ``phases``)."""
    import sequences.pipeline as pipeline
    from benchmarks.rss import RssPhases, high_water_mib
    from gemline.lake import Lake, commit_once
    from sequences.pipeline import run_build

    phases = RssPhases()
    for name in ("_emit_table", "_shard_pieces", "_item_shard_step", "_user_shard_step", "_write_part",
                 "commit_files", "tidy", "_result_from_lake"):
        phases.watch(pipeline, name)
    with tempfile.TemporaryDirectory() as tmp:  # warm-up, as main's
        warm = str(Path(tmp) / "lake")
        commit_once(warm, "events", synthetic_events(5, 4, seed=1), app_id="bench", version=0,
                    partition_by=["event_date"])
        run_build(Lake(warm), build, final=True)
    seconds = cpu = 0.0
    for k in range(versions):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = run_build(Lake(lake), build, events_version=k, final=k == versions - 1, beam_args=beam_args)
        seconds += time.perf_counter() - start
        cpu += time.process_time() - start_cpu
    return {"seconds": seconds, "cpu_seconds": cpu, "examples": result.num_examples, "examples_bytes": _dir_bytes(Path(lake) / "examples"),
            "history_bytes": _dir_bytes(Path(lake) / "history"),
            "rss_mib": high_water_mib(), "phases": phases.stop()}


def _reference_seconds(events: pa.Table, max_seq_len: int, build) -> tuple[float, float]:
    """(wall, CPU) seconds of :func:`polars_reference` on ``events`` (its compute only, no write)."""
    start, start_cpu = time.perf_counter(), time.process_time()
    polars_reference(events, max_seq_len, build.click_window_ms, build.conversion_window_ms)
    return time.perf_counter() - start, time.process_time() - start_cpu


def _materialize_vs_gem(lake: str, gem_batch: int, gem_steps: int) -> tuple[int, float, float]:
    """(rows, materialization examples/s, GEM training examples/s) on the pointer lake's examples."""
    import torch

    from benchmarks.train import examples_per_second
    from gemline.lake import read_table
    from trainer.config import TrainerConfig
    from trainer.data import encode_examples, fit_normalizer, make_batch, pointer_history

    table = read_table(lake, "examples")
    assert table is not None, "the pointer build wrote examples"
    normalizer = fit_normalizer(table)
    start = time.perf_counter()
    data = encode_examples(table, 100_003, normalizer, pointer_history(lake, table))
    rate = table.num_rows / (time.perf_counter() - start)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    batches = [make_batch(data, rng.integers(0, len(data), gem_batch)) for _ in range(gem_steps)]
    gem = TrainerConfig(model="gem", num_embeddings=100_003, embedding_dim=16)
    _, gem_rate = examples_per_second(gem, batches, 2, len(normalizer.names))
    return table.num_rows, rate, gem_rate


def compare_layouts(events: pa.Table, build, lengths: list[int], batches: int, beam_args: list[str],
                    gem_batch: int = 256, gem_steps: int = 6, layouts: tuple[str, ...] = ("fat", "pointer"),
                    repeats: int = 1, feed: bool = True, reference: bool = True,
                    parallelism: tuple[int | str, ...] = ()) -> None:
    """Print the fat/pointer comparison of ``--compare-layouts`` at each max length (module docstring).

    ``parallelism``: with two or more values, each layout is built at each ``build.parallelism`` (rows
    labelled ``LAYOUT pP``, interleaved like the rounds); with none or one, ``build``'s own.

    With ``repeats`` > 1 every (length, layout) build runs that many times, interleaved (round r builds
    every length and layout before round r + 1), so a change of the machine's load hits all of them
    alike; the table shows the median seconds and the throughput ratios are given per round.
    ``reference``: each round also times :func:`polars_reference` at each length (compute only, in a child
    process, after the builds of that length), and each build's rate is given against it: the ratio of two
    rates measured minutes apart on the same machine moves less with its load than either rate.
    """
    import dataclasses
    import multiprocessing
    import os
    import statistics
    from concurrent.futures import ProcessPoolExecutor

    n = events.num_rows
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    feeds = {}
    refs: dict[int, list[tuple[float, float]]] = {}
    load_before = os.getloadavg()
    variants = [(f"{layout} p{p}" if len(parallelism) > 1 else layout, layout, p)
                for layout in layouts for p in (parallelism if len(parallelism) > 1 else (build.parallelism,))]
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(repeats):
            for length in lengths:
                for label, layout, workers in variants:
                    config = dataclasses.replace(build, examples_layout=layout, max_seq_len=length, parallelism=workers)
                    lake = str(Path(tmp) / f"{layout}-{length}")
                    versions = _commit_batches(lake, events, batches)
                    # A fresh (spawned, not forked) process per build: each peak RSS is that build's own.
                    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                        runs.setdefault((label, length), []).append(
                            pool.submit(_build_committed, lake, versions, config, beam_args).result())
                    if layout == "pointer" and feed and round_ == 0 and length not in feeds:
                        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                            feeds[length] = pool.submit(_materialize_vs_gem, lake, gem_batch, gem_steps).result()
                    shutil.rmtree(lake, ignore_errors=True)
                if reference:
                    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                        refs.setdefault(length, []).append(
                            pool.submit(_reference_seconds, events, length, build).result())
    stats: dict[tuple[str, int], dict] = {key: {**done[0], "seconds": statistics.median(r["seconds"] for r in done),
                                                "cpu_seconds": statistics.median(r["cpu_seconds"] for r in done),
                   "rss_mib": max(r["rss_mib"] for r in done)} for key, done in runs.items()}
    print(f"events: {n}, examples: {stats[next(iter(stats))]['examples']:.0f}, rounds: {repeats}, "
          f"load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f} (cores: {os.cpu_count()})")
    print(f"{'layout':11s} {'max len':>7s} {'events/s':>10s} {'events/CPU-s':>12s} {'examples B/example':>19s} "
          f"{'history MiB':>12s} {'peak RSS MiB':>13s}")
    for (layout, length), st in stats.items():
        print(f"{layout:11s} {length:7d} {n / st['seconds']:10,.0f} {n / st['cpu_seconds']:12,.0f} "
              f"{st['examples_bytes'] / max(st['examples'], 1):19,.0f} "
              f"{st['history_bytes'] / 2**20:12.1f} {st['rss_mib']:13,.0f}")
        if length in refs:
            wall, cpu = (statistics.median(r[i] for r in refs[length]) for i in (0, 1))
            print(f"  polars reference (compute only, one process): {n / wall:,.0f} events/s, {n / cpu:,.0f} per CPU-s; "
                  f"build / reference: {wall / st['seconds']:.2f} (wall), {cpu / st['cpu_seconds']:.2f} (CPU)")
        for kind, peaks in st["phases"].items():
            print(f"  {kind} peak RSS MiB by phase: {', '.join(f'{k} {v:,.0f}' for k, v in peaks.items())}")
    for (label, layout, workers), length in ((v, length) for v in variants for length in lengths):
        first = next(v[0] for v in variants if v[1] == layout)
        if label != first:  # the same layout at another parallelism: wall and CPU seconds against the first, per round
            print(f"{label} / {first} at {length}, per round: events/s " + ", ".join(
                f"{a['seconds'] / b['seconds']:.2f}" for a, b in zip(runs[first, length], runs[label, length], strict=True))
                + "; events per CPU-s " + ", ".join(f"{a['cpu_seconds'] / b['cpu_seconds']:.2f}" for a, b in zip(
                    runs[first, length], runs[label, length], strict=True)))
    for length in lengths:
        if length not in feeds:
            continue
        rows, rate, gem_rate = feeds[length]
        both = ("fat", length) in stats and ("pointer", length) in stats
        ratio = f"{stats['fat', length]['seconds'] / stats['pointer', length]['seconds']:.2f}" if both else "-"
        print(f"max len {length}: pointer/fat build throughput {ratio}; "
              f"materialization (history read + index + hashing, {rows} rows) {rate:,.0f} examples/s vs GEM training "
              f"(batch {gem_batch}, 1 thread) {gem_rate:,.0f} examples/s: ratio {rate / gem_rate:.1f} (goal >= 5)")
    if len(lengths) > 1:
        lo, hi = min(lengths), max(lengths)
        for layout in dict.fromkeys(label for label, _, _ in variants):
            for clock in ("seconds", "cpu_seconds"):
                per_round = [a[clock] / b[clock] for a, b in zip(runs[layout, lo], runs[layout, hi], strict=True)]
                speed = stats[layout, lo][clock] / stats[layout, hi][clock]
                print(f"{layout}: build throughput ({'wall' if clock == 'seconds' else 'CPU'} time) at {hi} / at {lo}: "
                      f"{speed:.2f} of the medians, per round {', '.join(f'{x:.2f}' for x in per_round)} (goal >= 0.8)")


def follow_passes(events: pa.Table, build, batches: int) -> None:
    """Print the CPU seconds of each incremental pass without and with a shared state cache (``--follow-cache``,
    module docstring); both lakes are built in this process, pass by pass, which of the two first alternating."""
    import os

    from gemline.lake import Lake, commit_once, read_table
    from sequences.pipeline import _OUTPUTS, run_build
    from sequences.state_cache import BuildStateCache

    with tempfile.TemporaryDirectory() as tmp:  # warm-up (imports, first-call costs), as main's
        warm = str(Path(tmp) / "lake")
        commit_once(warm, "events", synthetic_events(5, 4, seed=1), app_id="bench", version=0,
                    partition_by=["event_date"])
        run_build(Lake(warm), build, final=True)
    cache = BuildStateCache()
    order = np.argsort(events.column("event_time_ms").to_numpy(), kind="stable")
    parts = np.array_split(order, batches)
    load_before = os.getloadavg()[0]
    cpu: dict[str, list[float]] = {"fresh": [], "cached": []}
    with tempfile.TemporaryDirectory() as tmp:
        lakes = {kind: str(Path(tmp) / kind) for kind in cpu}
        for k, part in enumerate(parts):
            # The order alternates: the second build of a pair ran ~0.2 CPU-s cheaper even with no buffer to cache.
            for kind in (("fresh", "cached") if k % 2 == 0 else ("cached", "fresh")):
                lake = lakes[kind]
                commit_once(lake, "events", events.take(pa.array(part)), app_id="bench", version=k,
                            partition_by=["event_date"])
                start = time.process_time()
                run_build(Lake(lake), build, final=k == len(parts) - 1,
                          state_cache=cache if kind == "cached" else None)
                cpu[kind].append(time.process_time() - start)
        same = all(sorted(map(str, read_table(lakes["fresh"], name).to_pylist()))
                   == sorted(map(str, read_table(lakes["cached"], name).to_pylist())) for name in _OUTPUTS)
    print(f"events: {events.num_rows} in {batches} passes; load average before {load_before:.1f}, "
          f"after {os.getloadavg()[0]:.1f} (cores: {os.cpu_count()}); same rows in every table: {same}")
    print(f"{'pass':>4s} {'fresh CPU-s':>12s} {'cached CPU-s':>13s} {'cached / fresh':>15s}")
    for k, (a, b) in enumerate(zip(cpu["fresh"], cpu["cached"], strict=True)):
        print(f"{k:4d} {a:12.2f} {b:13.2f} {b / a:15.2f}")
    print(f"all  {sum(cpu['fresh']):12.2f} {sum(cpu['cached']):13.2f} {sum(cpu['cached']) / sum(cpu['fresh']):15.2f}; "
          f"cache: {cache.stats.files_read} buffer files read, {cache.stats.files_reused} reused, "
          f"{cache.stats.files_resplit} split again for another shard count, "
          f"{cache.nbytes / 2**20:.0f} MiB held")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=2000)
    parser.add_argument("--events-per-user", type=int, default=50)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--batches", type=int, default=1, help="incremental builds the events are split into")
    parser.add_argument("--pareto", type=float, default=None, help="Pareto alpha of events per user (else uniform)")
    parser.add_argument("--max-events-per-user", type=int, default=1000)
    parser.add_argument("--shards", default="auto", help="build.shards: a number or auto")
    parser.add_argument("--parallelism", default="auto",
                        help="build.parallelism (shard steps at once, in process): a number or auto (the cores); "
                        "comma-separated with --compare-layouts: each is built, interleaved, e.g. 1,auto")
    parser.add_argument("--beam-args", default="", help="Beam pipeline flags for the build, space-separated "
                        "(e.g. '--direct_num_workers=2 --direct_running_mode=multi_threading')")
    parser.add_argument("--max-seq-lens", default=None,
                        help="--compare-layouts: comma-separated max lengths built on the same events (e.g. 128,2048)")
    parser.add_argument("--layouts", default="fat,pointer", help="--compare-layouts: the layouts built")
    parser.add_argument("--repeats", type=int, default=1,
                        help="--compare-layouts: interleaved rounds of every build (medians and per-round ratios)")
    parser.add_argument("--no-feed", action="store_true",
                        help="--compare-layouts: skip the materialization vs GEM training measurement")
    parser.add_argument("--no-reference", action="store_true",
                        help="--compare-layouts: skip the polars reference (its compute time in a child process)")
    parser.add_argument("--follow-cache", action="store_true",
                        help="CPU-s per incremental pass, fresh vs sharing a state cache (build --follow), same process")
    parser.add_argument("--compare-layouts", action="store_true",
                        help="build with examples_layout fat and pointer, and time the pointer materialization vs GEM")
    args = parser.parse_args(argv)

    from gemline.lake import Lake, commit_once
    from sequences.config import BuildConfig
    from sequences.pipeline import run_build

    events = synthetic_events(args.users, args.events_per_user, pareto=args.pareto,
                              max_events_per_user=args.max_events_per_user)
    shards = args.shards if args.shards == "auto" else int(args.shards)
    parallelism = [p if p == "auto" else int(p) for p in args.parallelism.split(",")]
    build = BuildConfig(max_seq_len=args.max_seq_len, shards=shards, events_gate="off",  # raw synthetic events
                        parallelism=parallelism[0])
    if args.follow_cache:
        follow_passes(events, build, args.batches)
        return
    if args.compare_layouts:
        lengths = [int(x) for x in args.max_seq_lens.split(",")] if args.max_seq_lens else [args.max_seq_len]
        compare_layouts(events, build, lengths, args.batches, args.beam_args.split(),
                        layouts=tuple(args.layouts.split(",")), repeats=args.repeats, feed=not args.no_feed,
                        reference=not args.no_reference, parallelism=tuple(parallelism))
        return
    # Warm-up: Beam imports its runner modules lazily on the first pipeline (seconds of one-time
    # start-up); build a tiny lake once so the timed runs measure the build, not the imports.
    with tempfile.TemporaryDirectory() as tmp:
        warm = str(Path(tmp) / "lake")
        commit_once(warm, "events", synthetic_events(5, 4, seed=1), app_id="bench", version=0,
                    partition_by=["event_date"])
        run_build(Lake(warm), build, final=True)
    with tempfile.TemporaryDirectory() as tmp:
        lake = str(Path(tmp) / "lake")
        order = np.argsort(events.column("event_time_ms").to_numpy(), kind="stable")
        parts = np.array_split(order, args.batches)
        beam_s = 0.0
        for k, part in enumerate(parts):
            commit_once(lake, "events", events.take(pa.array(part)), app_id="bench", version=k,
                        partition_by=["event_date"])
            start = time.perf_counter()
            result = run_build(Lake(lake), build, final=k == len(parts) - 1, beam_args=args.beam_args.split())
            beam_s += time.perf_counter() - start
        build_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        lake_bytes = sum(p.stat().st_size for p in Path(lake).rglob("*") if p.is_file() and "events" not in p.parts)
        start = time.perf_counter()
        reference, sequences = polars_reference(events, args.max_seq_len, build.click_window_ms,
                                                build.conversion_window_ms)
        compute_s = time.perf_counter() - start
        write_deltalake(str(Path(tmp) / "reference" / "examples"), reference.with_columns(
            pl.from_epoch("event_time_ms", time_unit="ms").dt.strftime("%Y-%m-%d").alias("event_date")).to_arrow(),
            partition_by=["event_date"])
        write_deltalake(str(Path(tmp) / "reference" / "sequences"), sequences.to_arrow())
        polars_s = time.perf_counter() - start
    n = events.num_rows
    beam_rate, polars_rate, compute_rate = n / beam_s, n / polars_s, n / compute_s
    print(f"events: {n}, users: {args.users}, examples: beam {result.num_examples}, polars {reference.height}")
    print(f"beam (DirectRunner {args.beam_args or 'defaults'}, {args.batches} batch(es), {args.shards} shards): "
          f"{beam_s:.1f} s, "
          f"{beam_rate:,.0f} events/s")
    print(f"polars (one process): compute {compute_s:.2f} s ({compute_rate:,.0f} events/s), "
          f"with the examples Delta write {polars_s:.2f} s ({polars_rate:,.0f} events/s)")
    print(f"peak RSS: {build_rss_mib:.0f} MiB after the Beam build, "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB after the polars reference; "
          f"build tables on disk: {lake_bytes / 2**20:.0f} MiB")
    print(f"ratio beam/polars compute only: {beam_rate / compute_rate:.3f}")
    print(f"ratio beam/polars: {beam_rate / polars_rate:.3f} (goal >= 0.5)")


if __name__ == "__main__":
    main()
