"""What one scrape of ``gemline.metrics`` costs: a full read (cache off) of a lake with N ingest commits.

    python -m benchmarks.metrics [--commits 500] [--repeat 5]

The lake holds N one-row ``events`` commits of the ingest writer (each with ``end_offsets`` metadata) and 20
``examples`` commits; lag comes from a stub (no broker), so the time is the lake's part: opening each table,
its file statistics, the newest ingest commit's metadata, the ``quality`` and ``freshness`` reads. Prints the
min and median milliseconds per collect against the collector's 5 s cache: the share of a scraper's interval
spent reading the lake.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import pyarrow as pa

from gemline.lake import Lake, commit_once
from gemline.metrics import LagSource, PipelineCollector


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commits", type=int, default=500, help="ingest commits to events (default 500)")
    parser.add_argument("--repeat", type=int, default=5, help="collects timed (default 5)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        lake = Lake(f"{root}/lake")
        for v in range(args.commits):
            commit_once(lake, "events", pa.table({"x": [v]}), app_id="ingest:t", version=v,
                        metadata={"end_offsets": {str(p): v for p in range(4)}})
        for v in range(20):
            commit_once(lake, "examples", pa.table({"x": [v]}), app_id="build", version=v)
        lag = LagSource("t", "ingest:t", lambda: {p: (0, args.commits + 10) for p in range(4)})
        collector = PipelineCollector(lake, lag=lag, cache_s=0.0)
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            list(collector.collect())
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(f"{args.commits} events commits: collect min {min(times) * 1000:.0f} ms, median {median * 1000:.0f} ms; "
          f"{median / 5.0:.2%} of the 5 s cache interval")


if __name__ == "__main__":
    main()
