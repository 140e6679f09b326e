"""CPU of ``validate --follow``'s pointer-check summaries per examples version: the compacted history tail
(``sequences.history_tail``, then ``validation.pointer_checks.summarize_pointers``) against the running counts
(``sequences.pointer_summaries.PointerSummaries``), on a kept lake (``benchmarks.freshness --lake DIR``).

``python -m benchmarks.pointer_summaries --lake DIR [--from-version V]``

Replays the lake's ``examples`` versions in order, as the follower meets them: version v's added rows are
summarized with the ``history`` version its build wrote, both ways in this one process, back to back, on the
same rows. The summaries are compared on every version (the benchmark stops on a difference): equal lengths,
truncation counts, newest times and order flags, and the same leakage verdict from ``newest_created_ms`` (the
counts give an upper bound of it, see the module). Prints per version the CPU-s (``time.process_time``) of
each path and the rows each sent to a whole-history read, then the totals per 1,000 examples rows and the ratio
new/old, over all versions and over the second half (the tail's cost grows with the run in ``defer`` mode).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from benchmarks.pointer_history import build_versions
from gemline.increments import rows_added
from gemline.lake import commit_metadata
from gemline.tables import Table
from sequences.config import BuildConfig
from sequences.history_tail import HistoryTail
from sequences.pointer_summaries import PointerSummaries
from validation.pointer_checks import summarize_pointers


def main() -> None:
    """Print the per-version CPU-s of both paths and the totals (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lake", required=True)
    parser.add_argument("--from-version", type=int, default=0, help="first examples version replayed")
    args = parser.parse_args()
    lake = str(Path(args.lake))
    meta = commit_metadata(lake, Table.EXAMPLES, "build")
    assert meta is not None and "max_seq_len" in meta, "a pointer-layout lake"
    cfg = BuildConfig(max_seq_len=int(meta["max_seq_len"]), max_same_domain_seq_len=int(meta["same_domain_seq_len"]))
    history_of = {b: v for v, b in build_versions(lake, Table.HISTORY).items()}
    tail = HistoryTail(lake, cfg.max_seq_len, cfg.same_domain_seq_len)
    index = PointerSummaries(lake, cfg.max_seq_len, cfg.same_domain_seq_len)
    costs: list[tuple[int, float, float]] = []  # rows, old, new
    for version, build in sorted(build_versions(lake, Table.EXAMPLES).items()):
        rows = rows_added(lake, Table.EXAMPLES, version)
        if version < args.from_version or rows is None or rows.num_rows == 0 or build not in history_of:
            continue
        hv = history_of[build]
        t0 = time.process_time()
        history, cut = tail.history_for(rows, version=hv)
        want = summarize_pointers(rows, history, cfg, cut)
        t1 = time.process_time()
        cross, same = index.summarize(rows, version=hv)
        t2 = time.process_time()
        created = rows.column("created_ts_ms").to_numpy()
        for prefix, got in (("seq_", cross), ("seq_same_domain_", same)):
            w = want[prefix]
            for field in ("lengths", "truncated", "newest_ms", "unordered"):
                assert np.array_equal(getattr(got, field), getattr(w, field)), f"examples@{version}: {prefix}{field}"
            nonempty = w.lengths > 0
            assert np.array_equal(nonempty & (got.newest_created_ms > created), nonempty & (w.newest_created_ms > created))
        costs.append((rows.num_rows, t1 - t0, t2 - t1))
        print(f"examples@{version} ({rows.num_rows} rows): tail {t1 - t0:.3f} s (whole reads {tail.full_reads}, "
              f"{tail.rows.height} rows held); counts {t2 - t1:.3f} s ({index.reference_rows} rows to the reference so "
              f"far, {index.recent.height} recent events, {index.cached.height} cached)", flush=True)
    if not costs:
        return
    for title, first in (("all versions", 0), ("second half", len(costs) // 2)):
        part = costs[first:]
        n = sum(c[0] for c in part)
        old, new = sum(c[1] for c in part), sum(c[2] for c in part)
        print(f"{title} ({len(part)} versions, {n} rows): CPU-s per 1k rows tail {1000 * old / n:.4f}, counts "
              f"{1000 * new / n:.4f}; counts/tail {new / old:.3f}")


if __name__ == "__main__":
    main()
