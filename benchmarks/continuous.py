"""Continuous training: does the incremental reader keep GEM fed, what does a ``--once`` run cost, and how
much memory does consuming one large version take.

``python -m benchmarks.continuous [--rows N] [--steps S] [--big-rows M] [--max-len L]``

1. One synthetic ``examples`` version of N rows (shaped like the build's table: sparse ids, three aligned
   history lists with lengths uniform in [0, L], dense features, three domains) is written to a temporary
   lake. The reader (``gemline.increments.read_from`` + ``trainer.data.encode_examples`` + batching, all
   that stands between the lake and a training step) is timed over it, then GEM trains S steps on batches
   of the same rows, in the same process: the ratio reader rows/s over GEM rows/s must stay above 5.
2. The fixed cost of ``gemline train --once`` (``trainer.continuous.run_once``): a lake holding one 64-row
   version, from the call to its return (gate read, checkpoint lookup, model build, one step, checkpoint,
   run report).
3. Peak RSS of a child process that consumes a version of M rows with ``run_once`` (model ``lr``, so that
   the data path, not the model, dominates): the goal is under 2 GB for 1,000,000 rows.
Printed last: the reader / GEM ratio.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from deltalake import WriterProperties, write_deltalake

from gemline.lake import ROW_GROUP_ROWS, Lake
from sequences.schema import EXAMPLES_BASE_SCHEMA

DENSE = ("f_user_ctr_7d", "f_item_ctr_7d", "f_seq_length")
SCHEMA = pa.schema([*EXAMPLES_BASE_SCHEMA, *[pa.field(n, pa.float64()) for n in DENSE]])
DOMAINS = np.array(["feed", "reels", "marketplace"], dtype=object)


def synthetic_examples(rows: int, max_len: int, seed: int = 0) -> pa.Table:
    """``rows`` examples of SCHEMA, built column-wise (seconds for a million rows)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len + 1, rows)
    offsets = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])

    def ids(prefix: str, high: int, n: int) -> pa.Array:
        numbers = pa.array(rng.integers(0, high, n)).cast(pa.string())
        return pc.binary_join_element_wise(pa.scalar(prefix), numbers, "")

    def lists(values: pa.Array) -> pa.Array:
        return pa.ListArray.from_arrays(pa.array(offsets), values)

    click = rng.random(rows) < 0.1
    columns = {
        "example_id": pc.binary_join_element_wise(pa.scalar("x"), pa.array(np.arange(rows)).cast(pa.string()), ""),
        "event_time_ms": pa.array(1_700_000_000_000 + np.arange(rows, dtype=np.int64)),
        "event_date": pa.array(["2026-01-01"] * rows),
        "user_id": ids("u", 50_000, rows), "item_id": ids("i", 20_000, rows),
        "domain": pa.array(DOMAINS[rng.integers(0, 3, rows)]), "category": ids("c", 200, rows),
        "position": ids("", 5, rows), "ad_format": pa.array(["video"] * rows), "age": pa.nulls(rows, pa.int32()),
        "gender": pa.array(["f"] * rows), "location": pa.array(["us"] * rows),
        "seq_item_ids": lists(ids("i", 20_000, total)), "seq_categories": lists(ids("c", 200, total)),
        "seq_event_types": lists(pa.array(["click"] * total)), "seq_domains": lists(pa.array(["feed"] * total)),
        "seq_event_time_ms": lists(pa.array(np.zeros(total, dtype=np.int64))),
        "seq_length": pa.array(lengths.astype(np.int32)), "seq_truncated": pa.array(np.zeros(rows, dtype=np.int32)),
        "label_click": pa.array(click.astype(np.int32)),
        "label_conversion": pa.array((click & (rng.random(rows) < 0.3)).astype(np.int32)),
        "click_latency_ms": pa.nulls(rows, pa.int64()), "conversion_latency_ms": pa.nulls(rows, pa.int64()),
        "label_window_closed": pa.array(np.ones(rows, dtype=bool)),
        "f_user_ctr_7d": pa.array(rng.beta(2, 8, rows)), "f_item_ctr_7d": pa.array(rng.beta(2, 8, rows)),
        "f_seq_length": pa.array(lengths.astype(np.float64)),
    }
    return pa.Table.from_arrays([columns[f.name].cast(f.type) for f in SCHEMA], schema=SCHEMA)


def _lake(rows: int, max_len: int) -> str:
    from gemline.gate import append_quality_rows

    lake = tempfile.mkdtemp(prefix="gemline-bench-continuous-")
    # Row groups as the build writes them (gemline.lake.ROW_GROUP_ROWS): what bounds a streaming read.
    write_deltalake(f"{lake}/examples", synthetic_examples(rows, max_len), partition_by=["event_date"],
                    writer_properties=WriterProperties(max_row_group_size=ROW_GROUP_ROWS))
    append_quality_rows(lake, [{"table": "examples", "table_version": 0, "run_id": "bench", "run_ts_ms": 1,
                                "expectation": "bench", "severity": "critical", "success": True, "observed": "",
                                "report_path": ""}])
    return lake


def reader_rows_per_s(lake: str, batch: int) -> tuple[float, int]:
    """(rows/s, rows) of read -> encode -> batches over the whole version."""
    from gemline.increments import Cursor, read_from, table_id
    from trainer.data import encode_examples, fit_normalizer, make_batch

    cursor = Cursor(table_id(lake, "examples") or "", 0)
    normalizer = None
    start, rows = time.perf_counter(), 0
    for _, part, _ in read_from(lake, "examples", cursor, batch_rows=batch * 64):
        if part is None:
            continue
        table = pa.Table.from_batches([part])
        normalizer = normalizer or fit_normalizer(table)
        data = encode_examples(table, 100_003, normalizer)
        for i in range(0, len(data), batch):
            make_batch(data, np.arange(i, min(i + batch, len(data))))
        rows += len(data)
    return rows / (time.perf_counter() - start), rows


def gem_rows_per_s(lake: str, batch: int, steps: int) -> float:
    """GEM's training rows/s over ``steps`` batches of the version's first rows (2 warm-up steps first)."""
    from gemline.increments import Cursor, read_from, table_id
    from trainer.config import TrainerConfig
    from trainer.data import encode_examples, fit_normalizer, make_batch
    from trainer.models import build_model
    from trainer.train import train_step

    cursor = Cursor(table_id(lake, "examples") or "", 0)
    part = next(b for _, b, _ in read_from(lake, "examples", cursor, batch_rows=batch * (steps + 2)) if b is not None)
    table = pa.Table.from_batches([part])
    normalizer = fit_normalizer(table)
    data = encode_examples(table, 100_003, normalizer)
    torch.manual_seed(0)
    config = TrainerConfig()
    model = build_model(config, len(normalizer.names), tuple(DOMAINS))
    optimizers = {"dense": torch.optim.Adam(model.dense_parameters(), lr=1e-3),
                  "embeddings": torch.optim.Adagrad(model.embedding_parameters(), lr=1e-2)}
    batches = [make_batch(data, np.arange(i * batch, (i + 1) * batch)) for i in range((len(data)) // batch)]
    for b in batches[:2]:
        train_step(model, optimizers, b)
    start = time.perf_counter()
    for b in batches[2: 2 + steps]:
        train_step(model, optimizers, b)
    return steps * batch / (time.perf_counter() - start)


def once_fixed_cost_s() -> float:
    """Wall seconds of ``run_once`` on a lake holding one 64-row version."""
    from gemline.config import load_config
    from trainer.continuous import run_once

    lake = _lake(64, 8)
    start = time.perf_counter()
    config = load_config(overrides={"trainer.batch_size": "64"})
    run_once(Lake(lake), config.trainer)
    return time.perf_counter() - start


def _child(lake: str) -> None:
    import threading

    import psutil

    from gemline.config import load_config
    from trainer.continuous import run_once

    # Sampled, not ru_maxrss: Linux carries ru_maxrss over fork and exec, so the child would report the
    # parent's peak (the parent held the whole generated table).
    peak = [0]
    process = psutil.Process()

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.1)

    threading.Thread(target=sample, daemon=True).start()
    result = run_once(Lake(lake), load_config(overrides={"trainer.model": "lr"}).trainer)
    print(f"CHILD rows={result.rows_trained_total} peak_rss_mib={peak[0] / 2**20:.0f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000, help="rows of the version the reader is timed on")
    parser.add_argument("--steps", type=int, default=20, help="GEM steps timed")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--max-len", type=int, default=64, help="history lengths uniform in [0, L]")
    parser.add_argument("--big-rows", type=int, default=1_000_000, help="rows of the version whose RSS is measured (0: skip)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child)
        return
    torch.set_num_threads(1)
    lake = _lake(args.rows, args.max_len)
    reader, rows = reader_rows_per_s(lake, args.batch)
    gem = gem_rows_per_s(lake, args.batch, args.steps)
    print(f"reader (read + encode + batch): {reader:,.0f} rows/s over {rows:,} rows")
    print(f"GEM training: {gem:,.0f} rows/s ({args.steps} steps of {args.batch})")
    print(f"train --once fixed cost (one 64-row version): {once_fixed_cost_s():.2f} s")
    if args.big_rows:
        big = _lake(args.big_rows, args.max_len)
        out = subprocess.run([sys.executable, "-m", "benchmarks.continuous", "--child", big], capture_output=True,
                             text=True, cwd=Path(__file__).resolve().parent.parent, check=True)
        line = next(x for x in out.stdout.splitlines() if x.startswith("CHILD"))
        print(f"consuming one {args.big_rows:,}-row version (model lr): {line.removeprefix('CHILD ')}")
    print(f"ratio reader/GEM: {reader / gem:.1f}x (goal >= 5)")


if __name__ == "__main__":
    main()
