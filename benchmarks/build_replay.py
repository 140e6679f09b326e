"""CPU seconds of each ``build --follow`` pass, replayed offline on a copy of a lake's events (issue 20).

    python -m benchmarks.build_replay --lake /tmp/fl3 [--extra-versions 2] [--set build.label_mode=defer ...]

``--lake``: a lake a ``gemline run`` or ``benchmarks.freshness`` left (read only: its ``events`` table is copied
into a temporary lake, nothing else is read or written there). The build's passes are the events versions the
lake's ``examples`` commits name (``events_version`` of each gemline build commit, oldest first), then the
``--extra-versions`` newest events versions not yet built, one per pass, so the passes add what the real
passes added. Every pass is :func:`sequences.pipeline.run_build` with ``build.events_gate = "off"`` (the copy
has no verdicts) and one :class:`sequences.state_cache.BuildStateCache`, as ``build --follow`` holds; the
freshness benchmark's label settings are ``--set build.label_mode=defer --set build.publish_delay_ms=60000``.

Printed: per pass, the events version, CPU seconds (user + system of this process: polars' threads and the
writer threads included) and rows published; then the mean of the last ``--late`` passes (the late passes,
whose buffer and pending state are the largest). CPU, not wall time: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from deltalake import DeltaTable


def built_versions(lake: str) -> list[int]:
    """The ``events_version`` of each build commit of ``lake``'s ``examples``, oldest first (ascending, distinct)."""
    versions = set()
    for entry in DeltaTable(str(Path(lake) / "examples")).history():
        meta = entry.get("gemline") or (entry.get("userMetadata") or {}).get("gemline")
        if isinstance(meta, str):
            meta = json.loads(meta)
        if isinstance(meta, dict) and meta.get("app_id") == "build" and meta.get("events_version") is not None:
            versions.add(int(meta["events_version"]))
    return sorted(versions)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lake", required=True, help="the lake whose events and build passes are replayed (read only)")
    parser.add_argument("--extra-versions", type=int, default=2,
                        help="newest events versions not built there, replayed one per pass after the built ones")
    parser.add_argument("--late", type=int, default=6, help="the last passes averaged")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config key (repeatable)")
    args = parser.parse_args(argv)

    from gemline.config import load_config
    from gemline.lake import Lake
    from sequences.pipeline import run_build
    from sequences.state_cache import BuildStateCache

    overrides = {"build.events_gate": "off", **dict(pair.split("=", 1) for pair in args.set)}
    config = load_config(None, overrides).build
    latest = DeltaTable(str(Path(args.lake) / "events")).version()
    passes = built_versions(args.lake)
    passes += list(range((passes[-1] if passes else -1) + 1, latest + 1))[:max(args.extra_versions, 0)]
    cache = BuildStateCache()
    cpu = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="gemline-replay-") as tmp:
        shutil.copytree(Path(args.lake) / "events", Path(tmp) / "events")
        for k, version in enumerate(passes):
            start = time.process_time()
            result = run_build(Lake(tmp), config, events_version=version, state_cache=cache)
            cpu.append(time.process_time() - start)
            print(f"pass {k:3d} events@{version:<5d} {cpu[-1]:7.2f} CPU-s  published {result.num_published}", flush=True)
    late = cpu[-args.late:]
    print(f"{len(cpu)} passes, {sum(cpu):.2f} CPU-s; last {len(late)}: {sum(late) / max(len(late), 1):.2f} CPU-s per "
          f"pass; load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
