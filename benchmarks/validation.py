"""Validation time as a fraction of build time, at one million example rows.

    python -m benchmarks.validation [--examples 1000000] [--build-events 20000]

Validation: a synthetic ``examples`` table of ``--examples`` rows (numpy/pyarrow, seeded; every
contract column, three dense features, sequences of 0..20 events) committed to a scratch lake and
validated with :func:`validation.run.validate_table` (read, suite, profile, drift, report with
plots, quality rows): timed at full size.

Build: :func:`sequences.pipeline.run_build` (Beam DirectRunner) on synthetic events over three
days (70% impressions; click and conversion windows set to one hour so nearly every impression's
labels are final and it is published as an example) is timed at two small sizes (``--build-events``,
e.g. 2000 and 6000 events) and extrapolated to ``--examples`` examples with the straight line
through both points (a fixed cost: Beam start-up and nine table commits, plus a cost per example):
the build at one million examples would take far longer than this benchmark should. The
extrapolated figure is printed as such.

GX per-row value checks (sets, ranges, label rates) run on a deterministic strided sample of
``validation.gx_sample_rows`` rows; not-null, uniqueness, leakage, sequence order and lengths,
finiteness and schema are exact pyarrow checks over every row (see ``validation.suites.run_specs``).
The last line printed is the fraction.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import pyarrow as pa

from gemline.config import load_config
from gemline.lake import Lake, commit_once
from ingest.schema import EVENTS_TABLE_SCHEMA
from sequences.schema import EXAMPLES_BASE_SCHEMA

T0_MS = 1_700_000_000_000
DAY_MS = 86_400_000
DOMAINS = np.array(["facebook", "instagram", "whatsapp"], dtype=object)


def _lists(lengths: np.ndarray, values: pa.Array) -> pa.ListArray:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def synthetic_examples(n: int, seed: int = 0) -> pa.Table:
    """``n`` valid examples rows in the current contract (plus ``f_a``, ``f_b``, ``f_c`` float64)."""
    rng = np.random.default_rng(seed)
    times = T0_MS + np.sort(rng.integers(0, 7 * DAY_MS, n))
    lengths = rng.integers(0, 21, n)
    total = int(lengths.sum())
    parents = np.repeat(np.arange(n), lengths)
    # element j of row i sits (j+1) s before the example, oldest first
    rank = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    seq_times = times[parents] - (np.repeat(lengths, lengths) - rank) * 1000
    domain = DOMAINS[rng.integers(0, 3, n)]
    cols: dict[str, pa.Array] = {
        "example_id": pa.array(np.char.add("x", np.arange(n).astype(str)).astype(object)),
        "event_time_ms": pa.array(times),
        "event_date": pa.array((np.datetime64(T0_MS, "ms") + (times - T0_MS).astype("timedelta64[ms]")).astype("datetime64[D]").astype(str).astype(object)),
        "user_id": pa.array(np.char.add("u", rng.integers(0, 50_000, n).astype(str)).astype(object)),
        "item_id": pa.array(np.char.add("i", rng.integers(0, 5_000, n).astype(str)).astype(object)),
        "domain": pa.array(domain),
        "seq_length": pa.array(lengths.astype(np.int32)),
        "seq_event_time_ms": _lists(lengths, pa.array(seq_times)),
        "label_click": pa.array((rng.random(n) < 0.1).astype(np.int32)),
        "label_conversion": pa.array((rng.random(n) < 0.01).astype(np.int32)),
    }
    item_values = pa.array(np.char.add("i", rng.integers(0, 5_000, total).astype(str)).astype(object))
    for f in EXAMPLES_BASE_SCHEMA:
        if f.name in cols:
            continue
        if f.name.startswith("seq_") and pa.types.is_list(f.type) and "same_domain" not in f.name and "delta" not in f.name:
            cols[f.name] = _lists(lengths, item_values)
        elif pa.types.is_list(f.type):
            cols[f.name] = _lists(np.zeros(n, dtype=np.int64), pa.array([], f.type.value_type))
        elif pa.types.is_integer(f.type):
            cols[f.name] = pa.array(times if f.name.endswith("_ms") and f.nullable is False else np.zeros(n), f.type)
        elif pa.types.is_boolean(f.type):
            cols[f.name] = pa.array(np.ones(n, dtype=bool))
        else:
            cols[f.name] = pa.array(np.full(n, "v", dtype=object), f.type)
    for name in ("f_a", "f_b", "f_c"):
        cols[name] = pa.array(rng.normal(size=n))
    schema = pa.schema([*EXAMPLES_BASE_SCHEMA, *[pa.field(x, pa.float64()) for x in ("f_a", "f_b", "f_c")]])
    return pa.Table.from_arrays([pa.array(cols[f.name]).cast(f.type) for f in schema], schema=schema)


def synthetic_events(n: int, seed: int = 0) -> pa.Table:
    """``n`` events over 3 days, 2K users, 500 items; 70% impressions, 20% clicks, 10% conversions."""
    rng = np.random.default_rng(seed)
    times = T0_MS + np.sort(rng.integers(0, 3 * DAY_MS, n))
    kinds = rng.choice(np.array(["impression", "click", "conversion"], dtype=object), n, p=[0.7, 0.2, 0.1])
    cols = {
        "event_id": np.char.add("e", np.arange(n).astype(str)).astype(object),
        "event_time_ms": times,
        "user_id": np.char.add("u", rng.integers(0, 2_000, n).astype(str)).astype(object),
        "item_id": np.char.add("i", rng.integers(0, 500, n).astype(str)).astype(object),
        "domain": DOMAINS[rng.integers(0, 3, n)],
        "event_type": kinds,
        "category": np.char.add("c", rng.integers(0, 20, n).astype(str)).astype(object),
        "position": rng.integers(0, 10, n).astype(np.int32),
        "schema_version": np.ones(n, dtype=np.int32),
        "created_ts_ms": times + 5,
        "event_date": (np.datetime64(T0_MS, "ms") + (times - T0_MS).astype("timedelta64[ms]")).astype("datetime64[D]").astype(str).astype(object),
        "kafka_topic": np.full(n, "gemline.events", dtype=object),
        "kafka_partition": np.zeros(n, dtype=np.int32),
        "kafka_offset": np.arange(n),
    }
    arrays = [pa.array(cols[f.name], f.type) if f.name in cols else pa.nulls(n, f.type) for f in EVENTS_TABLE_SCHEMA]
    return pa.Table.from_arrays(arrays, schema=EVENTS_TABLE_SCHEMA)


def _time_build(num_events: int) -> tuple[int, float]:
    """(examples published, seconds) of ``run_build`` on ``num_events`` synthetic events in a scratch lake."""
    from sequences.pipeline import run_build

    with tempfile.TemporaryDirectory() as lake:
        config = load_config(overrides={"lake": lake, "ingest.domains": ",".join(DOMAINS),
                                        "build.click_window_ms": "3600000", "build.conversion_window_ms": "3600000",
                                        "build.events_gate": "off"})  # the build is timed here, unvalidated
        commit_once(lake, "events", synthetic_events(num_events), app_id="bench", version=0,
                    partition_by=["event_date"])
        start = time.perf_counter()
        built = run_build(Lake.for_config(config), config.build)
        return built.num_examples, time.perf_counter() - start


def main() -> None:
    """Run both timings and print them; the fraction (validation s / scaled build s) comes last."""
    from validation.run import validate_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1_000_000)
    parser.add_argument("--build-events", default="2000,6000", help="two event counts to time the build at")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as lake:
        config = load_config(overrides={"lake": lake, "ingest.domains": ",".join(DOMAINS), "build.max_seq_len": "20"})
        examples = synthetic_examples(args.examples)
        commit_once(lake, "examples", examples, app_id="bench", version=0, mode="overwrite",
                    partition_by=["event_date"])
        start = time.perf_counter()
        result = validate_table(Lake.for_config(config), "examples", 0, now_ms=T0_MS + 30 * DAY_MS,
                                validation=config.validation, ingest=config.ingest, build=config.build)
        validation_s = time.perf_counter() - start
        print(f"validation of {args.examples} examples: {validation_s:.1f} s, verdict "
              f"{'PASSED' if result.passed else 'QUARANTINED'}, failures {result.failures}")
    points = [_time_build(int(n)) for n in args.build_events.split(",")]
    (e1, t1), (e2, t2) = points[0], points[-1]
    if len(points) != 2 or e2 <= e1:
        raise ValueError(f"--build-events needs two sizes whose builds publish more examples, got {points}")
    slope = (t2 - t1) / (e2 - e1)
    scaled = t1 + slope * (args.examples - e1)
    for examples, seconds in points:
        print(f"build: {examples} examples published in {seconds:.1f} s")
    print(f"build extrapolated to {args.examples} examples: {scaled:.0f} s ({slope * 1e3:.3f} ms/example "
          f"marginal, {t1 - slope * e1:.1f} s fixed)")
    print(f"validation / build time at {args.examples} examples: {validation_s / scaled:.3f}")


if __name__ == "__main__":
    main()
