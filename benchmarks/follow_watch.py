"""What a follower's look for new input costs, and what waking on it saves (issue 20, freshness).

    python -m benchmarks.follow_watch [--commits 1000] [--checks 1000] [--simulate-minutes 30]
    python -m benchmarks.follow_watch --hops LAKE    # the hops of a finished `benchmarks.freshness --lake LAKE` run

1. Cost: a ``quality`` table with ``--commits`` commits (a long log: the 10-minute freshness run makes ~500), then
   CPU-seconds (``time.process_time``, this process) of ``--checks`` idle looks of each kind:
   :class:`gemline.increments.LogTip` (one stat of the next log entry), :class:`gemline.gate.GateWatch` (the same
   plus nothing: no new commit) and, as the baseline in the same process, :func:`gemline.increments.latest_version`
   (opening the table, which replays its log from the last checkpoint). Printed per 1,000 looks and as the share
   of one core at one look a second (``watch_s = 1``).
2. Saving: a deterministic simulation of the four hops an events version takes to the trainer (validate events
   -> build -> validate examples -> train) under the loops of :mod:`gemline.polling`: a pass every
   ``interval_s`` after the last (``watch_s`` None, the loop before) against a look every ``watch_s`` with
   ``interval_s`` as the longest wait. Ingest commits an events version every ``--commit-s``; each stage's pass
   takes a fixed time (``--pass-s validate,build,train``; from the ``gemline run`` stage logs of a freshness run)
   and handles everything that arrived before it started; validation is one follower for both tables (a pass
   validates the newest events version and every new examples version). Printed: p50/p99 of each hop's wait
   (input committed -> the pass that takes it starts) and of events commit -> trained. No CPU contention is
   modelled: on a loaded machine passes take longer, which the loop does not change.
3. ``--hops LAKE``: the same four hops measured on the lake of a ``gemline run`` (e.g. ``benchmarks.freshness``),
   from the Delta commit times (``commitInfo.timestamp``, ms): events@v committed -> the first ``quality`` commit
   judging events@v' >= v (validate events) -> the first ``examples`` commit built from events@v'' >= v (build:
   the ``events_version`` of its commit metadata) -> the ``quality`` commit judging that examples version
   (validate examples) -> its ``freshness`` row (train: written after the version's last step). Each hop is a
   wait plus a pass; p50 and p99 per hop.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gemline.gate import GateWatch, append_quality_rows
from gemline.increments import LogTip, latest_version
from gemline.lake import Lake, read_table
from gemline.tables import Table
from gemline.waits import commits


def _quality_rows(version: int) -> list[dict]:
    return [{"table": "events", "table_version": version, "run_id": f"r{version}", "run_ts_ms": version,
             "expectation": "row_count", "severity": "critical", "success": True, "observed": "", "report_path": ""}]


def cpu_per_1000(look: Callable[[], object], checks: int) -> float:
    """CPU-seconds of this process per 1,000 calls of ``look`` (``checks`` calls measured)."""
    look()  # the first look opens the table: not what a follower pays per look
    began = time.process_time()
    for _ in range(checks):
        look()
    return (time.process_time() - began) * 1000 / checks


def measure_cost(lake: str, commits: int, checks: int) -> dict[str, float]:
    """CPU-s per 1,000 idle looks of each kind on a ``quality`` table of ``commits`` commits."""
    for version in range(commits):
        append_quality_rows(lake, _quality_rows(version), app_id=f"bench:{version}")
    assert latest_version(lake, Table.QUALITY) == commits - 1
    tip, watch = LogTip(lake, Table.QUALITY), GateWatch(lake, Table.EXAMPLES)
    return {"LogTip.advance": cpu_per_1000(tip.advance, checks),
            "GateWatch": cpu_per_1000(watch, checks),
            # the baseline: far slower, so fewer calls
            "latest_version (baseline)": cpu_per_1000(lambda: latest_version(lake, Table.QUALITY),
                                                      max(1, checks // 20))}


@dataclass
class _Queue:
    """A follower's input of one kind: (commit time, the events commit times it carries), in commit order."""

    name: str
    items: list[tuple[float, tuple[float, ...]]] = field(default_factory=list)
    taken: int = 0

    def take(self, now: float) -> list[tuple[float, tuple[float, ...]]]:
        """The items committed by ``now`` and not taken yet (now taken)."""
        first = self.taken
        while self.taken < len(self.items) and self.items[self.taken][0] <= now:
            self.taken += 1
        return self.items[first:self.taken]


def simulate(*, minutes: float, commit_s: float, pass_s: tuple[float, float, float], interval_s: float,
             watch_s: float | None) -> dict[str, list[float]]:
    """Each hop's waits (seconds from an input's commit to the start of the pass that takes it) and the
    events commit -> trained latencies (to the end of the training pass), for the loop given by ``interval_s``
    and ``watch_s`` (None: a pass every ``interval_s`` after the last, the loop before; module docstring).

    The followers: validate (inputs: events versions, examples versions), build (verdicts on events), train
    (verdicts on examples). A pass takes every input committed by its start, lasts its stage's ``pass_s`` (0 s
    when it finds nothing) and commits its outputs at its end: validation one verdict on the newest events
    version (covering every events version it took) and one per examples version, the build one examples
    version, the trainer nothing. With watching, a follower looks at once after a pass, then every ``watch_s``.
    """
    validate_s, build_s, train_s = pass_s
    end = minutes * 60
    events = _Queue("events", [(float(t), (float(t),)) for t in np.arange(commit_s, end, commit_s)])
    examples, events_verdicts, examples_verdicts = _Queue("examples"), _Queue("build"), _Queue("train")
    inputs = {"validate": (events, examples), "build": (events_verdicts,), "train": (examples_verdicts,)}
    waits: dict[str, list[float]] = {"validate events": [], "build": [], "validate examples": [], "train": [],
                                     "events -> trained": []}
    last_end = dict.fromkeys(inputs, 0.0)
    # (time of the follower's next look or pass, tie-break, follower); each follower has one entry.
    heap: list[tuple[float, int, str]] = [(0.0, i, name) for i, name in enumerate(inputs)]
    order = len(heap)
    while heap:
        now, _, name = heapq.heappop(heap)
        if now > end:
            continue
        due = now >= last_end[name] + interval_s
        if watch_s is not None or due:
            taken = [q.take(now) for q in inputs[name]]
        else:
            taken = [[] for _ in inputs[name]]
        if any(taken) or due:
            finish = now + ({"validate": validate_s, "build": build_s, "train": train_s}[name] if any(taken) else 0.0)
            carried = [tuple(e for _, events_ts in items for e in events_ts) for items in taken]
            if name == "validate":
                waits["validate events"] += [now - t for t, _ in taken[0]]
                waits["validate examples"] += [now - t for t, _ in taken[1]]
                if carried[0]:
                    events_verdicts.items.append((finish, carried[0]))
                examples_verdicts.items += [(finish, events_ts) for _, events_ts in taken[1]]
            elif name == "build":
                waits["build"] += [now - t for t, _ in taken[0]]
                if carried[0]:
                    examples.items.append((finish, carried[0]))
            else:
                waits["train"] += [now - t for t, _ in taken[0]]
                waits["events -> trained"] += [finish - e for e in carried[0]]
            last_end[name] = now = finish
            following = now if watch_s is not None else now + interval_s
        else:
            following = min(now + watch_s, last_end[name] + interval_s) if watch_s is not None else \
                last_end[name] + interval_s
        heapq.heappush(heap, (following, order, name))
        order += 1
    return waits


def _commits(lake: str, table: str) -> dict[int, tuple[int, dict]]:
    """``{version: (commit time ms, gemline commit metadata)}`` of a table's log."""
    return {c.version: (c.timestamp_ms, dict(c.meta)) for c in commits(Lake(lake), table)}


def measured_hops(lake: str) -> dict[str, list[float]]:
    """Seconds of each hop of a finished run's lake (module docstring, 3.)."""
    events = {v: ms for v, (ms, _) in _commits(lake, Table.EVENTS).items()}
    built = sorted((meta["events_version"], ms, v) for v, (ms, meta) in _commits(lake, Table.EXAMPLES).items()
                   if meta.get("events_version") is not None)
    run_ms = {meta["app_id"].split(":", 1)[1]: ms for ms, meta in _commits(lake, Table.QUALITY).values()
              if str(meta.get("app_id", "")).startswith("validate:")}
    quality = read_table(lake, Table.QUALITY, columns=["table", "table_version", "run_id"]).to_pylist()
    judged: dict[tuple[str, int], int] = {}
    for row in quality:
        if row["run_id"] in run_ms:
            key = (row["table"], row["table_version"])
            judged[key] = min(judged.get(key, run_ms[row["run_id"]]), run_ms[row["run_id"]])
    events_verdicts = sorted((v, ms) for (t, v), ms in judged.items() if t == Table.EVENTS)
    freshness = read_table(lake, Table.FRESHNESS)
    trained = {} if freshness is None else {r["examples_version"]: r["wall_time_ms"] for r in freshness.to_pylist()}
    hops: dict[str, list[float]] = {"validate events": [], "build": [], "validate examples": [], "train": []}
    for version, ms in sorted(events.items()):
        # events validation judges every version since the one judged before: the first verdict at or past v
        i = bisect.bisect_left(events_verdicts, (version, -1))
        if i == len(events_verdicts):
            continue
        verdict_ms = events_verdicts[i][1]
        hops["validate events"].append((verdict_ms - ms) / 1000)
        j = bisect.bisect_left(built, (version, -1, -1))
        if j < len(built) and built[j][1] >= verdict_ms:
            hops["build"].append((built[j][1] - verdict_ms) / 1000)
    for _, ms, examples_version in built:
        verdict = judged.get((Table.EXAMPLES, examples_version))
        if verdict is not None:
            hops["validate examples"].append((verdict - ms) / 1000)
            if examples_version in trained:
                hops["train"].append((trained[examples_version] - verdict) / 1000)
    return hops


def _summary(waits: dict[str, list[float]]) -> str:
    return "; ".join(f"{hop} p50={np.percentile(w, 50):.1f} p99={np.percentile(w, 99):.1f} s (n={len(w)})"
                     for hop, w in waits.items() if w)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commits", type=int, default=1000, help="commits of the quality table (default 1000)")
    parser.add_argument("--checks", type=int, default=1000, help="looks measured per kind (default 1000)")
    parser.add_argument("--simulate-minutes", type=float, default=30.0)
    parser.add_argument("--commit-s", type=float, default=5.0, help="seconds between events versions (default 5)")
    parser.add_argument("--pass-s", default="3,8,10", help="seconds of a validate, build, train pass (default 3,8,10)")
    parser.add_argument("--interval-s", type=float, default=10.0)
    parser.add_argument("--watch-s", type=float, default=1.0)
    parser.add_argument("--hops", metavar="LAKE", help="only print the measured hops of a finished run's lake")
    args = parser.parse_args(argv)
    if args.hops:
        print(f"{args.hops}: {_summary(measured_hops(args.hops))}")
        return
    with tempfile.TemporaryDirectory(prefix="gemline-bench-watch-") as folder:
        cost = measure_cost(str(Path(folder) / "lake"), args.commits, args.checks)
    for name, cpu_s in cost.items():
        print(f"{name}: {cpu_s:.4f} CPU-s per 1000 looks on a {args.commits}-commit log "
              f"({cpu_s / 10:.2g}% of a core at one look a second)")
    pass_s = tuple(float(x) for x in args.pass_s.split(","))
    assert len(pass_s) == 3, "--pass-s: validate,build,train"
    runs = {f"a pass every {args.interval_s:g} s": simulate(minutes=args.simulate_minutes, commit_s=args.commit_s,
                                                           pass_s=pass_s, interval_s=args.interval_s, watch_s=None),
            f"a look every {args.watch_s:g} s": simulate(minutes=args.simulate_minutes, commit_s=args.commit_s,
                                                        pass_s=pass_s, interval_s=args.interval_s,
                                                        watch_s=args.watch_s)}
    for name, waits in runs.items():
        print(f"{name}: {_summary(waits)}")


if __name__ == "__main__":
    main()
