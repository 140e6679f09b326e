"""What one scrape of ``gemline.metrics`` costs: a full read (cache off) of a lake with N ingest commits.

    python -m benchmarks.metrics [--commits 500] [--quality-rows 200000] [--repeat 5]

The lake holds N one-row ``events`` commits of the ingest writer (each with ``end_offsets`` metadata), 20
``examples`` commits and a ``quality`` table of Q rows (20 expectations per validated version, one version in
20 failing a critical one: a day of ``validate --follow`` on a version every few seconds is ~300,000 rows); lag comes from a stub (no broker), so the time is the lake's part: opening each table,
its file statistics, the newest ingest commit's metadata, the ``quality`` and ``freshness`` reads. Prints the
first collect (which decides the whole quality table) and the min and median milliseconds of the next ones
(quality unchanged, as between two validation runs) against the collector's 5 s cache.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import pyarrow as pa

from gemline.gate import append_quality_rows
from gemline.lake import Lake, commit_once
from gemline.metrics import LagSource, PipelineCollector


def _quality_rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        version, expectation = divmod(i, 20)
        rows.append({"table": "events", "table_version": version, "run_id": f"run-{version}", "run_ts_ms": version,
                     "expectation": f"e{expectation}", "severity": "critical" if expectation < 5 else "warning",
                     "success": not (version % 20 == 0 and expectation == 0), "observed": "", "report_path": ""})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commits", type=int, default=500, help="ingest commits to events (default 500)")
    parser.add_argument("--quality-rows", type=int, default=200_000, help="rows of the quality table (default 200,000)")
    parser.add_argument("--repeat", type=int, default=5, help="collects timed (default 5)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        lake = Lake(f"{root}/lake")
        for v in range(args.commits):
            commit_once(lake, "events", pa.table({"x": [v]}), app_id="ingest:t", version=v,
                        metadata={"end_offsets": {str(p): v for p in range(4)}})
        for v in range(20):
            commit_once(lake, "examples", pa.table({"x": [v]}), app_id="build", version=v)
        append_quality_rows(lake, _quality_rows(args.quality_rows))
        lag = LagSource("t", "ingest:t", lambda: {p: (0, args.commits + 10) for p in range(4)})
        collector = PipelineCollector(lake, lag=lag, cache_s=0.0)
        start = time.perf_counter()
        list(collector.collect())
        first = time.perf_counter() - start
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            list(collector.collect())
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(f"{args.commits} events commits, {args.quality_rows} quality rows: first collect {first * 1000:.0f} ms "
          f"(the quality table decided); then, quality unchanged, min {min(times) * 1000:.0f} ms, median "
          f"{median * 1000:.0f} ms, {median / 5.0:.2%} of the 5 s cache interval")


if __name__ == "__main__":
    main()
