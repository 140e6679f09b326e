"""The one prepared GPU check: kernel parity, the attention benchmark and a GEM training run, one JSON summary.

``python -m benchmarks.gpu [--device cuda] [--out gpu.json] [--sections parity,kernels,train]``
``python -m benchmarks.gpu --device cpu --tiny``   (the same code on CPU with tiny shapes: what CI runs)

Sections, in order (each prints its rows as they finish):

1. ``parity``: every Triton kernel against its float32 PyTorch reference twin, forward and backward, in float32
   and bfloat16 (:func:`benchmarks.kernels.parity_report`). On CPU the kernels run in Triton's interpreter.
2. ``kernels``: jagged causal attention (Triton) against padded ``scaled_dot_product_attention(is_causal=True)``
   in bfloat16, forward and forward+backward, at B=256, L_max in {1024, 4096}, sparsity 0.9 (issue 19's grid;
   :func:`benchmarks.kernels.attention_benchmark`, which compares outputs with the reference before timing).
3. ``train``: 200 steps of the ``gem`` preset (the published shape) in bf16 autocast through the trainer's own
   engine and prefetcher (:func:`benchmarks.train.train_throughput`): examples/s and peak memory (bytes).
   ``--device cpu --sections train --train-steps 5`` gives this machine's CPU figure at the same model size, the
   denominator of issue 19's "20x" goal.

A section that raises is recorded with its error and the others still run; the exit status is 1 when a section
failed or a parity check exceeded its tolerance, else 0. On one H200 the whole check is meant to take under
8 minutes; ``--budget-s`` makes the run say so when it took longer.

Why one script: a lent GPU machine comes for a few minutes, so what it must run is prepared and tested here
(``--device cpu --tiny`` in CI) and the numbers come back in one file.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

SECTIONS = ("parity", "kernels", "train")


class NoDeviceError(RuntimeError):
    """The device asked for is not on this machine."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU, CI): the same code in seconds")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--out", default="gpu.json", help="where the JSON summary goes (default gpu.json)")
    p.add_argument("--train-steps", type=int, default=None, help="timed training steps (default 200; tiny 3)")
    p.add_argument("--train-batch", type=int, default=None, help="examples per training step (default 1024; tiny 16)")
    p.add_argument("--preset", default=None, help="GEM preset trained (default gem; tiny gem_small)")
    p.add_argument("--precision", default=None, choices=("fp32", "bf16"), help="training precision (default bf16)")
    p.add_argument("--compile", action="store_true", help="torch.compile the dense part (trainer.compile) in the train section")
    p.add_argument("--budget-s", type=float, default=480.0, help="wall seconds the whole check should fit in")
    args = p.parse_args(argv)
    unknown = sorted(set(args.sections.split(",")) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; choose from {SECTIONS}")
    return args


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    """Shapes of each section: the issue's on a GPU, tiny ones for the interpreter."""
    if args.tiny:
        attention = [{"batch": 4, "max_len": 16, "heads": 2, "head_dim": 16}, {"batch": 4, "max_len": 32, "heads": 2, "head_dim": 16}]
        train = {"steps": 3, "batch_size": 16, "preset": "gem_small", "max_len": 16, "precision": "fp32"}
        repeats = 1
    else:
        attention = [{"batch": 256, "max_len": 1024, "heads": 4, "head_dim": 128},
                     {"batch": 256, "max_len": 4096, "heads": 4, "head_dim": 128}]
        train = {"steps": 200, "batch_size": 1024, "preset": "gem", "max_len": 1024, "precision": "bf16"}
        repeats = 10
    for key, value in (("steps", args.train_steps), ("batch_size", args.train_batch), ("preset", args.preset),
                       ("precision", args.precision)):
        if value is not None:
            train[key] = value
    return {"attention": attention, "sparsity": 0.9, "repeats": repeats, "train": train}


def _section(summary: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    print(f"== {name}", flush=True)
    started = time.perf_counter()
    try:
        summary["sections"][name] = {"ok": True, "result": fn()}
    except Exception as exc:  # one broken section must not cost the others' numbers on a borrowed machine
        traceback.print_exc()
        summary["sections"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    summary["sections"][name]["seconds"] = round(time.perf_counter() - started, 2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the chosen sections on ``args.device`` and return the summary (also written to ``args.out``).

    Raises:
        NoDeviceError: ``--device cuda`` on a machine without CUDA (said before anything runs).
    """
    from benchmarks import kernels as kbench

    if not args.device.startswith("cuda"):
        kbench.enable_interpreter()  # before any Triton kernel module is imported
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise NoDeviceError(f"--device {args.device}: this machine has no CUDA device; use --device cpu --tiny")
    plan = _plan(args)
    chosen = args.sections.split(",")
    summary: dict[str, Any] = {
        "device": args.device, "tiny": args.tiny, "plan": plan, "sections": {},
        "host": {"python": platform.python_version(), "torch": torch.__version__,
                 "gpu": torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else None},
    }
    started = time.perf_counter()
    if "parity" in chosen:
        _section(summary, "parity", lambda: {
            name: kbench.parity_report(args.device, dtype, tiny=args.tiny)
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))})
    if "kernels" in chosen:
        _section(summary, "kernels", lambda: [
            row for shape in plan["attention"]
            for row in kbench.attention_benchmark(args.device, shape["batch"], shape["max_len"], plan["sparsity"],
                                                  torch.bfloat16, plan["repeats"], heads=shape["heads"],
                                                  head_dim=shape["head_dim"])])
    if "train" in chosen:
        from benchmarks.train import train_throughput

        t = plan["train"]
        _section(summary, "train", lambda: train_throughput(args.device, t["preset"], t["steps"], t["batch_size"],
                                                            t["precision"], args.compile, max_len=t["max_len"]))
    summary["seconds"] = round(time.perf_counter() - started, 2)
    summary["within_budget"] = summary["seconds"] <= args.budget_s
    summary["ok"] = all(s["ok"] for s in summary["sections"].values()) and _parity_ok(summary)
    Path(args.out).write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    return summary


def _parity_ok(summary: dict[str, Any]) -> bool:
    parity = summary["sections"].get("parity")
    return parity is None or not parity["ok"] or all(r["ok"] for r in parity["result"].values())


def headline(summary: dict[str, Any]) -> list[str]:
    """The lines a reader wants from the summary: parity verdicts, attention speed-ups, training rate."""
    lines = []
    parity = summary["sections"].get("parity", {})
    if parity.get("ok"):
        lines.append("parity " + ", ".join(f"{k}: {'ok' if r['ok'] else 'FAILED'}" for k, r in parity["result"].items()))
    for row in summary["sections"].get("kernels", {}).get("result", None) or []:
        lines.append(f"attention {row.get('pass')} L_max={row.get('max_len')}: jagged {row.get('triton_ms'):.3g} ms, "
                     f"padded SDPA {row.get('sdpa_ms'):.3g} ms, speed-up {row.get('speedup'):.2f}x")
    train = summary["sections"].get("train", {})
    if train.get("ok"):
        r = train["result"]
        lines.append(f"train {r.get('preset')} {r.get('precision')}: {r['examples_per_s']:.0f} examples/s, "
                     f"peak memory {r['peak_memory_bytes'] / 2**20:.0f} MiB ({r.get('memory_kind')})")
    for name, section in summary["sections"].items():
        if not section["ok"]:
            lines.append(f"{name} FAILED: {section['error']}")
    lines.append(f"{'ok' if summary['ok'] else 'FAILED'} in {summary['seconds']:.0f} s"
                 f"{'' if summary['within_budget'] else ' (over the budget)'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 1 a section or a parity check failed, 2 no such device)."""
    args = parse_args(argv)
    try:
        summary = run(args)
    except NoDeviceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in headline(summary):
        print(line, flush=True)
    print(f"summary: {args.out}", flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
