"""wait vs fnw vs defer on real label delays: the Taobao UserBehavior sample (pv = impression, cart = click,
buy = conversion, minutes to days after the view), replayed in increments through the whole pipeline.

``python -m benchmarks.label_modes [--path CSV] [--increments 6] [--publish-delay-ms 900000] [--modes wait,fnw,defer]``

For each mode, on a fresh lake: ``gemline demo``'s path (embedded broker, Beam ingest, validation, the
incremental build with ``build.label_mode`` = the mode, and ``train --once`` after each increment: progressive
validation, each new examples version evaluated before it is trained on). Every progressive prediction is
kept with its example id. Afterwards each impression's *final* labels are read from the same lake (its first
row's labels, set to 1 by a late-positive correction; the last build closes every window), so every mode is
judged on the truth, not on the fake negatives it trained on. The table compares the modes on the
impressions all of them evaluated (the same rows), click and conversion AUC and NE, and the event-time
freshness of publication: ``published_watermark_ms - event_time_ms`` of first rows, p50 and p95 in hours
(how old an impression is, in event time, when the trainer can first see it). Printed last: the table.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
from rich.console import Console

from gemline.config import load_config
from gemline.demo import run_demo
from gemline.lake import read_table
from trainer.metrics import TASKS, evaluate

TAOBAO = "../shared/data/taobao_userbehavior/UserBehavior_sample.csv"


def final_labels(lake: str) -> dict[str, np.ndarray]:
    """``{example_id: (2,) int labels}`` of every impression: its first row's labels, with a late-positive
    correction's label set (:mod:`sequences.publish`)."""
    table = read_table(lake, "examples", columns=["example_id", "label_click", "label_conversion",
                                                  "corrects_example_id", "correction_task"])
    first = table.filter(pc.is_null(table.column("corrects_example_id")))
    out = {i: np.array([c, v]) for i, c, v in zip(first.column("example_id").to_pylist(),
                                                  first.column("label_click").to_pylist(),
                                                  first.column("label_conversion").to_pylist(), strict=True)}
    corrections = table.filter(pc.is_valid(table.column("corrects_example_id"))).to_pylist()
    for row in corrections:
        task = row["correction_task"]
        if row[f"label_{task}"]:
            out[row["corrects_example_id"]][TASKS.index(task)] = 1
    return out


def freshness_hours(lake: str) -> tuple[float, float]:
    """p50, p95 of ``published_watermark_ms - event_time_ms`` over first rows, hours."""
    table = read_table(lake, "examples", columns=["event_time_ms", "published_watermark_ms", "corrects_example_id"])
    first = table.filter(pc.is_null(table.column("corrects_example_id")))
    age = (first.column("published_watermark_ms").to_numpy() - first.column("event_time_ms").to_numpy()) / 3.6e6
    return float(np.percentile(age, 50)), float(np.percentile(age, 95))


def run_mode(mode: str, path: str, increments: int, delay_ms: int, root: Path, model: str) -> dict:
    """One mode's run: ``{"predictions": {example_id: (2,) probs}, "labels": final labels, "domains", "fresh"}``."""
    lake = str(root / mode)
    config = load_config(overrides={"lake": lake, "build.label_mode": mode, "build.publish_delay_ms": str(delay_ms),
                                    "trainer.model": model})
    predictions: dict[str, np.ndarray] = {}
    domains: dict[str, str] = {}

    def keep(p) -> None:
        for i, probs, domain in zip(p.example_ids, p.probs, p.domains, strict=True):
            predictions[i] = probs
            domains[i] = domain

    run_demo(config, dataset="taobao", path=path, increments=increments, console=Console(quiet=True),
             on_predictions=keep)
    return {"predictions": predictions, "labels": final_labels(lake), "domains": domains,
            "fresh": freshness_hours(lake)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default=TAOBAO, help="the UserBehavior CSV (default: the shared sample)")
    parser.add_argument("--increments", type=int, default=6)
    parser.add_argument("--publish-delay-ms", type=int, default=900_000, help="fnw/defer waiting window (15 min)")
    parser.add_argument("--modes", default="wait,fnw,defer")
    parser.add_argument("--model", default="gem")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    runs = {}
    with tempfile.TemporaryDirectory(prefix="gemline-label-modes-") as tmp:
        for mode in modes:
            print(f"{mode}: running {args.increments} increments ...", flush=True)
            runs[mode] = run_mode(mode, args.path, args.increments, args.publish_delay_ms, Path(tmp), args.model)
            print(f"{mode}: {len(runs[mode]['predictions'])} impressions evaluated", flush=True)
    common = sorted(set.intersection(*(set(r["predictions"]) for r in runs.values())))
    print(f"\nimpressions evaluated in every mode: {len(common)}; waiting window {args.publish_delay_ms} ms, "
          f"model {args.model}, {args.increments} increments")
    print("| mode | click AUC | click NE | click calibration | conversion AUC | conversion NE | conversion calibration "
          "| published after (h, p50 / p95) |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, run in runs.items():
        p50, p95 = run["fresh"]
        print(f"| {mode} | {' | '.join(metric_cells(run, common))} | {p50:.2f} / {p95:.2f} |")


def metric_cells(run: dict, ids: list[str]) -> list[str]:
    """AUC, NE and calibration (mean prediction / label rate; above 1: overpredicts) of click then conversion,
    over the impressions ``ids`` of one mode's ``run`` (:func:`run_mode`), judged on their final labels."""
    labels = np.stack([run["labels"][i] for i in ids]).astype(np.float64)
    probs = np.stack([run["predictions"][i] for i in ids]).astype(np.float64)
    doms = np.array([run["domains"][i] for i in ids], dtype=object)
    metrics = evaluate(labels, probs, doms)
    return [f"{metrics[t]['overall'][m]:.4f}" for t in TASKS for m in ("auc", "ne", "calibration")]


if __name__ == "__main__":
    main()
