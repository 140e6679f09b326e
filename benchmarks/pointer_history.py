"""CPU of the pointer-layout readers per examples version: the whole history of a batch's users against the
compacted history tail (sequences.history_tail), on a kept lake (``benchmarks.freshness --lake DIR``).

``python -m benchmarks.pointer_history --lake DIR [--from-version V]``

Replays the lake's ``examples`` versions in order, as ``validate --follow`` and ``train --follow`` meet them:
version v's added rows are read with the ``history`` version its build wrote (same ``build`` number in the
commits' metadata), then rebuilt both ways in this one process, back to back, on the same rows:

* ``old``: ``sequences.materialize.read_history`` (every row of the batch's users) then the work each reader
  does with it: the validation summaries (``validation.pointer_checks.summarize_pointers``) and the
  trainer's two sequence indexes (``sequences.materialize.sequence_index``, cross- and same-domain), every
  key's candidates through the join (``HEAVY_KEY_ROWS`` set above any key's rows);
* ``sorted``: the trainer's two indexes from ``sequences.sorted_history.SortedHistory`` (the history held
  sorted, read by increments), checked equal to the others, against the tail's two indexes alone;
* ``new``: ``HistoryTail.history_for`` (the rows the history gained since the last version, the compacted
  tail of the batch's users) then the same work with its ``cut`` and the default ``HEAVY_KEY_ROWS``.

Both give equal summaries and indexes (checked on every version: the benchmark stops on a difference).
Prints per version the CPU-s (``time.process_time``) of each path's read and work, then the totals as
CPU-s per 1,000 ``history`` events (one per event the build saw) and the ratio new/old, over all versions
and over the second half (the cost of the old read grows with the run).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from gemline.increments import rows_added
from gemline.lake import commit_metadata, open_table
from gemline.tables import Table
from sequences import materialize
from sequences.config import BuildConfig
from sequences.history_tail import HistoryTail
from sequences.materialize import HistoryCut, read_history, sequence_index
from sequences.sorted_history import SortedHistory
from validation.pointer_checks import summarize_pointers


def build_versions(lake: str, table: str) -> dict[int, int]:
    """{Delta version: ``build`` number} of ``table``'s commits that carry the build's metadata."""
    dt = open_table(lake, table)
    assert dt is not None, f"no {table} table under {lake}"
    out = {}
    for entry in dt.history():
        raw = entry.get("gemline")
        if raw is not None and "build" in json.loads(raw) and "version" in entry:
            out[int(entry["version"])] = int(json.loads(raw)["build"])
    return out


def _work(rows: pa.Table, history: pa.Table, cut: HistoryCut | None, cfg: BuildConfig) -> list[np.ndarray]:
    """The arrays validation and the trainer compute from ``history`` for ``rows`` (flattened, for comparing)."""
    summaries = summarize_pointers(rows, history, cfg, cut)
    out = [a for s in summaries.values() for a in (s.lengths, s.truncated, s.newest_ms, s.newest_created_ms, s.unordered)]
    for max_len, same in ((cfg.max_seq_len, False), (cfg.same_domain_seq_len, True)):
        index = sequence_index(rows, history, max_len, same_domain=same, cut=cut)
        out += [index.offsets, index.truncated, index.events.column("event_id").to_numpy(zero_copy_only=False)[index.index]]
    return out


def summaries_s(rows: pa.Table, history: pa.Table, cut: HistoryCut | None, cfg: BuildConfig) -> float:
    """CPU-s of the validation summaries alone (subtracted from the tail's work to leave the trainer's indexes)."""
    t0 = time.process_time()
    summarize_pointers(rows, history, cfg, cut)
    return time.process_time() - t0


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
    heavy = materialize.HEAVY_KEY_ROWS
    held = SortedHistory(lake)
    sorted_s: list[float] = []
    tail_index: list[float] = []
    costs: list[tuple[int, int, float, float, float, float]] = []  # version, history rows, old read/work, new read/work
    for version, build in sorted(build_versions(lake, Table.EXAMPLES).items()):
        rows = rows_added(lake, Table.EXAMPLES, version)
        if version < args.from_version or rows is None or rows.num_rows == 0 or build not in history_of:
            continue
        hv = history_of[build]
        t0 = time.process_time()
        history = read_history(lake, rows.column("user_id"), version=hv)
        t1 = time.process_time()
        materialize.HEAVY_KEY_ROWS = 2**62
        want = _work(rows, history, None, cfg)
        materialize.HEAVY_KEY_ROWS = heavy
        t2 = time.process_time()
        tail_rows, cut = tail.history_for(rows, version=hv)
        t3 = time.process_time()
        got = _work(rows, tail_rows, cut, cfg)
        t4 = time.process_time()
        for a, b in zip(want, got, strict=True):
            assert np.array_equal(a, b), f"examples@{version}: the tail's rebuild differs from the whole history's"
        t5 = time.process_time()
        fast = []
        for max_len, same in ((cfg.max_seq_len, False), (cfg.same_domain_seq_len, True)):
            index = held.sequence_index(rows, max_len, same_domain=same, version=hv)
            fast += [index.offsets, index.truncated,
                     index.events.column("event_id").to_numpy(zero_copy_only=False)[index.index]]
        t6 = time.process_time()
        for a, b in zip(want[10:], fast, strict=True):
            assert np.array_equal(a, b), f"examples@{version}: the sorted history's index differs from the whole history's"
        sorted_s.append(t6 - t5)
        tail_index.append(t4 - t3 - summaries_s(rows, tail_rows, cut, cfg))
        events = open_table(lake, Table.HISTORY, hv).to_pyarrow_dataset().count_rows()  # type: ignore[union-attr]
        costs.append((version, events, t1 - t0, t2 - t1, t3 - t2, t4 - t3))
        print(f"examples@{version} ({rows.num_rows} rows, history@{hv} {events} rows): old read {t1 - t0:.3f} "
              f"work {t2 - t1:.3f} s; new read {t3 - t2:.3f} work {t4 - t3:.3f} s; tail {tail.rows.height} rows, "
              f"horizon {tail.cut.horizon}, whole reads {tail.full_reads}; trainer's two indexes: tail "
              f"{tail_index[-1]:.3f} s, sorted history {sorted_s[-1]:.3f} s ({held.reference_rows} rows to the "
              "reference so far)", flush=True)
    if not costs:
        return
    print(f"the trainer's two indexes over all versions: tail (after its read) {sum(tail_index):.3f} CPU-s, sorted "
          f"history (its reads included) {sum(sorted_s):.3f}; sorted/tail {sum(sorted_s) / sum(tail_index):.3f}")
    half = len(costs) // 2
    for title, first in (("all versions", 0), ("second half", half)):
        part = costs[first:]
        # The events of a part: those its versions' builds added, from the history of the version before it.
        events = part[-1][1] - (costs[first - 1][1] if first else 0)
        old = sum(c[2] + c[3] for c in part)
        new = sum(c[4] + c[5] for c in part)
        print(f"{title} ({len(part)} versions, {events} history events): CPU-s per 1k events old "
              f"{1000 * old / events:.4f} (read {1000 * sum(c[2] for c in part) / events:.4f}), new "
              f"{1000 * new / events:.4f} (read {1000 * sum(c[4] for c in part) / events:.4f}); new/old {new / old:.3f}")


if __name__ == "__main__":
    main()
