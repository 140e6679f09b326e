"""CPU of ``distill --follow`` per examples version, this code against an older commit's, on a kept lake
(``benchmarks.freshness --lake DIR``).

``python -m benchmarks.distill_follow --lake DIR [--work DIR] [--baseline-ref REF]``

Copies the lake twice under ``--work`` (the lake itself is only read), drops their ``_distill``, and distills
their examples versions one at a time, as a ``--follow`` process meets them (``run_distill_once`` with
``max_versions=1``, one pointer reader per side kept across calls), alternating the sides version by version in
this one process:

* ``old``: ``trainer/distill.py`` of ``--baseline-ref`` (default ``0d05200``, before the compact checkpoint and
  the kept students), imported from git under another module name; it loads every student and optimiser from
  its checkpoint at each version and saves them whole;
* ``new``: this tree's ``trainer.distill``, with the :class:`trainer.distill.Memory` that ``follow`` keeps.

Prints per version its rows and each side's CPU-s (``time.process_time``) and checkpoint bytes, then the totals
over the versions after the first with rows (the first builds the students: not a follower's steady state) and
the ratio new/old. Both sides must end with equal students, optimiser moments and reports (their inference
rates, wall-clock timings, aside): the exit status is 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch

import trainer.distill as distill
from benchmarks.freshness import label_settings
from gemline.config import load_config
from gemline.lake import Lake
from trainer.checkpoint import latest_checkpoint, read_state
from trainer.data import PointerReader


def baseline_module(ref: str) -> types.ModuleType:
    """``trainer/distill.py`` of git ``ref`` as module ``trainer._distill_baseline`` (the rest of the tree is this
    one's: the baseline must not need what changed elsewhere)."""
    source = subprocess.run(["git", "show", f"{ref}:trainer/distill.py"], check=True, capture_output=True,
                            text=True, cwd=Path(__file__).resolve().parent.parent).stdout
    spec = importlib.util.spec_from_loader("trainer._distill_baseline", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    exec(compile(source, f"{ref}:trainer/distill.py", "exec"), module.__dict__)
    return module


def _bytes(root: str) -> int:
    """Bytes of the newest checkpoint under ``root`` (0 before one)."""
    path = latest_checkpoint(root)
    return 0 if path is None else sum(f.stat().st_size for f in Path(path).iterdir())


def _students(lake: str, config: Any) -> dict[str, torch.Tensor]:
    """Every tensor of the newest distill checkpoint's students and optimisers (either format), whole."""
    path = latest_checkpoint(f"{lake}/_distill")
    assert path is not None
    extra = read_state(path).extra
    students = distill._load(path, extra, config.distill, config.trainer, len(extra["normalizer"]["names"]))
    out = dict(students.modules.state_dict())
    for key, opt in students.optimizers.items():
        for i, state in opt.state_dict()["state"].items():
            out.update({f"{key}.{i}.{name}": torch.as_tensor(value) for name, value in state.items()})
    return out


def _measures(report: dict[str, Any]) -> dict[str, Any]:
    """A report without its inference rates (wall-clock timings, never equal between two runs)."""
    return {**{k: v for k, v in report.items() if k != "inference"},
            "versions": [{k: v for k, v in version.items() if k != "inference"} for version in report["versions"]]}


def main(argv: list[str] | None = None) -> int:
    """Run the comparison (module docstring); exit status 1 when the sides' students or reports differ."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lake", required=True, help="a kept freshness lake (read only)")
    parser.add_argument("--work", default="/tmp/distill_follow_bench", help="where the two copies go (replaced)")
    parser.add_argument("--baseline-ref", default="0d05200")
    args = parser.parse_args(argv)
    old_module = baseline_module(args.baseline_ref)
    sides: dict[str, dict[str, Any]] = {}
    for name, module in (("old", old_module), ("new", distill)):
        lake_dir = f"{args.work}/{name}"
        shutil.rmtree(lake_dir, ignore_errors=True)
        shutil.copytree(args.lake, lake_dir, ignore=shutil.ignore_patterns("_distill", "_run", "_staging"))
        config = load_config(overrides={"lake": lake_dir, **label_settings("defer", 60_000)})
        lake = Lake.for_config(config)
        kwargs = {"memory": distill.Memory()} if module is distill else {}
        sides[name] = {"module": module, "lake": lake, "config": config, "pointers": PointerReader(lake),
                       "kwargs": kwargs, "cpu": [], "dir": lake_dir, "result": None}
    first_rows: int | None = None
    print("version rows  old CPU-s  new CPU-s  old ckpt MB  new ckpt MB", flush=True)
    while True:
        row: dict[str, Any] = {}
        for name, side in sides.items():
            start = time.process_time()
            result = side["module"].run_distill_once(side["lake"], side["config"].trainer, side["config"].distill,
                                                     max_versions=1, pointers=side["pointers"], **side["kwargs"])
            row[name] = (time.process_time() - start, result)
            if result.versions:
                side["result"] = result
        if not row["new"][1].versions:
            break
        version = row["new"][1].versions[0]
        rows = version["rows"]
        if rows and first_rows is None:
            first_rows = version["version"]
        for name in sides:
            if rows and version["version"] != first_rows:
                sides[name]["cpu"].append(row[name][0])
        print(f"{version['version']:7d} {rows:5d} {row['old'][0]:10.2f} {row['new'][0]:10.2f} "
              f"{_bytes(sides['old']['dir'] + '/_distill') / 1e6:12.1f} {_bytes(sides['new']['dir'] + '/_distill') / 1e6:12.1f}",
              flush=True)
    old, new = sides["old"], sides["new"]
    want, got = _students(old["dir"], old["config"]), _students(new["dir"], new["config"])
    same = want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    same_report = _measures(old["result"].report) == _measures(new["result"].report)
    n = len(new["cpu"])
    if n:
        print(f"versions after the first with rows: {n}; CPU-s per version old {sum(old['cpu']) / n:.2f} "
              f"new {sum(new['cpu']) / n:.2f} (new/old {sum(new['cpu']) / sum(old['cpu']):.2f}); "
              f"newest checkpoint old {_bytes(old['dir'] + '/_distill') / 1e6:.1f} MB "
              f"new {_bytes(new['dir'] + '/_distill') / 1e6:.1f} MB")
    print(f"students and moments equal: {same}; reports equal: {same_report}")
    return 0 if same and same_report else 1


if __name__ == "__main__":
    raise SystemExit(main())
