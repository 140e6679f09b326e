"""CPU per version of ``validate --follow``: a fresh read of ``quality`` / ``quality_profiles`` per version
against the follower's :class:`validation.session.ValidationSession` (issue 20).

    python -m benchmarks.validate_follow --lake LAKE [--rounds 1]

``LAKE`` is the lake of a finished ``gemline run`` (e.g. ``python -m benchmarks.freshness --minutes 3 --lake
LAKE``); it is only read. Its data tables (``events``, ``examples``, ``history``, ``dead_letter``) are copied
twice into a scratch folder without ``quality`` and ``quality_profiles``, and the validations the run's
follower made (the ``quality`` runs of ``LAKE``, oldest first) are replayed on both copies in this one process,
alternating version by version, each with the run's own clock (``now_ms`` = its ``run_ts_ms``):

- ``fresh``: what the follower did before the session: the versions to do from
  :func:`gemline.gate.gate_decisions` (a whole read of ``quality``), then :func:`validation.run.validate_table`
  reading ``quality`` and ``quality_profiles`` whole;
- ``session``: one :class:`~validation.session.ValidationSession` for the whole replay, as ``validate --follow``
  keeps it: the versions to do from its in-memory ``quality``, and ``validate_table(..., session=...)``.

Both keep one :class:`sequences.history_tail.HistoryTail` (each its own), as the follower does. CPU is
``time.process_time`` (this process, every thread) per version, the first two versions left out (imports, GX's
start-up, the first whole reads). Printed per table and in all: mean CPU-s per version of each, and the ratio
session / fresh; last, whether both copies hold the same ``quality`` rows (but run ids and report paths), the
same profiles and the same verdicts. ``--rounds N`` replays the run's validations N times in a row (each round
validates every version again), as a longer run's growing ``quality`` tables would.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable

from gemline.config import load_config
from gemline.gate import gate_decisions
from gemline.lake import Lake, read_table
from gemline.tables import Table
from sequences.history_tail import HistoryTail

DATA_TABLES = (Table.EVENTS, Table.EXAMPLES, Table.HISTORY, Table.DEAD_LETTER)
SKIPPED = 2
"""Versions left out of the means: the first ones pay for imports, GX's context and the first whole reads."""


def follower_runs(lake: str) -> list[dict]:
    """(table, table_version, run_ts_ms) of every validation run in ``lake``'s ``quality`` table, oldest first."""
    quality = DeltaTable(f"{lake}/{Table.QUALITY}").to_pyarrow_table(columns=["table", "table_version", "run_id",
                                                                                "run_ts_ms", "expectation"])
    runs = quality.filter(pa.compute.not_equal(quality["expectation"], "__release__"))
    grouped = runs.group_by(["table", "table_version", "run_id", "run_ts_ms"]).aggregate([])
    return grouped.sort_by([("run_ts_ms", "ascending"), ("run_id", "ascending")]).to_pylist()


def comparable(lake: str, table: str, drop: tuple[str, ...]) -> list[tuple]:
    """The rows of ``table`` but the columns ``drop``, sorted: what two replays must share."""
    data = read_table(lake, table)
    if data is None:
        return []
    keep = [c for c in data.column_names if c not in drop]
    return sorted(tuple(r.values()) for r in data.select(keep).to_pylist())


def main(argv: list[str] | None = None) -> None:
    from validation.run import validate_table
    from validation.session import ValidationSession

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lake", required=True, help="the lake of a finished `gemline run` (read only)")
    parser.add_argument("--rounds", type=int, default=1, help="replay the run's validations this many times")
    parser.add_argument("--work", help="scratch folder (default: a new temporary one, removed at the end)")
    args = parser.parse_args(argv)
    runs = follower_runs(args.lake) * args.rounds
    work = Path(args.work or tempfile.mkdtemp(prefix="gemline-bench-validate-follow-"))
    copies = {}
    for mode in ("fresh", "session"):
        copies[mode] = work / mode
        shutil.rmtree(copies[mode], ignore_errors=True)
        for table in DATA_TABLES:
            if (Path(args.lake) / table).exists():
                shutil.copytree(Path(args.lake) / table, copies[mode] / table)
    configs = {m: load_config(overrides={"lake": str(p)}) for m, p in copies.items()}
    lakes = {m: Lake.for_config(c) for m, c in configs.items()}
    tails = {m: HistoryTail(lakes[m], c.build.max_seq_len, c.build.same_domain_seq_len) for m, c in configs.items()}
    session = ValidationSession(lakes["session"], tails["session"])
    cpu: dict[str, dict[str, list[float]]] = {m: {} for m in copies}
    verdicts: dict[str, list[bool]] = {m: [] for m in copies}
    for i, run in enumerate(runs):
        table, version = run["table"], run["table_version"]
        for mode in ("fresh", "session") if i % 2 else ("session", "fresh"):  # alternate who goes first
            config, lake = configs[mode], lakes[mode]
            start = time.process_time()
            if mode == "fresh":
                todo = [v for v, d in gate_decisions(lake, table, range(version + 1)).items() if not d.validated]
            else:
                session.refresh()
                done = session.validated(table)
                todo = [v for v in range(version + 1) if v not in done]
            del todo  # the follower's look for the versions to do, measured; the replay follows the run's order
            result = validate_table(lake, table, version, validation=config.validation, ingest=config.ingest,
                                    build=config.build, now_ms=run["run_ts_ms"],
                                    plots=config.validation.follow_report_plots, history_tail=tails[mode],
                                    session=session if mode == "session" else None)
            if i >= SKIPPED:
                cpu[mode].setdefault(table, []).append(time.process_time() - start)
            verdicts[mode].append(result.passed)
    for table in sorted(cpu["fresh"]):
        fresh, mine = cpu["fresh"][table], cpu["session"][table]
        print(f"{table}: {len(fresh)} versions, CPU-s per version fresh {sum(fresh) / len(fresh):.3f}, session "
              f"{sum(mine) / len(mine):.3f}, ratio {sum(mine) / sum(fresh):.3f}")
    fresh = [x for v in cpu["fresh"].values() for x in v]
    mine = [x for v in cpu["session"].values() for x in v]
    same = (verdicts["fresh"] == verdicts["session"]
            and comparable(str(copies["fresh"]), Table.QUALITY, ("run_id", "report_path"))
            == comparable(str(copies["session"]), Table.QUALITY, ("run_id", "report_path"))
            and comparable(str(copies["fresh"]), Table.QUALITY_PROFILES, ("run_id",))
            == comparable(str(copies["session"]), Table.QUALITY_PROFILES, ("run_id",)))
    print(f"same quality rows, profiles and verdicts: {'yes' if same else 'NO'}")
    print(f"all: {len(fresh)} versions, CPU-s per version fresh {sum(fresh) / len(fresh):.3f}, session "
          f"{sum(mine) / len(mine):.3f}, ratio session/fresh {sum(mine) / sum(fresh):.3f}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
