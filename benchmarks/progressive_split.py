"""What a barely trained model scores on the last examples commit: the progressive protocol's worst case.

``python -m benchmarks.progressive_split --lake L [--model lr] [--seeds 0] [--steps 0,13,26,52] [--zero none|ids|dense]``

Trains ``--model`` with the trainer's own functions (``fit_normalizer``, ``encode_for``, ``local_engine``,
``epoch_order``; the config's defaults) on the rows the next-to-last ``examples`` commit added and scores
the rows the last commit added, after each step count in ``--steps`` (0: untrained), click and conversion
AUC. Rows are told apart by ``published_watermark_ms`` (one value per commit in a ``wait`` build);
corrections are left out. ``--zero ids`` maps every sparse and history id to row 0, ``--zero dense``
sets every dense feature to 0 (in training and scoring), to see which inputs a ranking comes from.

Why: with ``wait`` labels and a 7-day window, the Taobao sample (9 days) publishes 92% of its rows in the
last commit, judged by a model of 13 steps on the first 1.2 days' rows (README, "Comparing models on the
progressive protocol"). The demo now builds that sample with 1-day windows (README, "The Taobao split
repaired"). Prints one line per (seed, steps).
"""

from __future__ import annotations

import argparse

import pyarrow as pa
import pyarrow.compute as pc
import torch

from gemline.config import load_config
from gemline.lake import Lake, read_table
from trainer.data import encode_for, fit_normalizer, num_batches, pointer_history
from trainer.loop import local_engine
from trainer.metrics import auc
from trainer.train import epoch_order, prior_rates


def last_two_commits(table: pa.Table) -> tuple[pa.Table, pa.Table]:
    """(rows of the next-to-last commit, rows of the last), first rows only, ordered by (event_time_ms, example_id).

    Raises:
        ValueError: fewer than two distinct ``published_watermark_ms`` values.
    """
    first = table.filter(pc.is_null(table["corrects_example_id"]))
    first = first.sort_by([("event_time_ms", "ascending"), ("example_id", "ascending")])
    marks = sorted(set(first["published_watermark_ms"].to_pylist()))
    if len(marks) < 2:
        raise ValueError(f"need rows of >= 2 examples commits (published_watermark_ms values), got {marks}")
    return (first.filter(pc.equal(first["published_watermark_ms"], marks[-2])),
            first.filter(pc.equal(first["published_watermark_ms"], marks[-1])))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lake", required=True)
    parser.add_argument("--model", default="lr")
    parser.add_argument("--seeds", default="0", help="comma-separated torch seeds of the model's init")
    parser.add_argument("--steps", default="0,13,26,52", help="comma-separated step counts to score after")
    parser.add_argument("--zero", choices=("none", "ids", "dense"), default="none")
    args = parser.parse_args(argv)
    tc = load_config(overrides={"trainer.model": args.model}).trainer
    lake = Lake(args.lake)
    table = read_table(lake, "examples")
    if table is None:
        raise SystemExit(f"no examples table under {args.lake}")
    pointers = pointer_history(lake, table)  # None for a lake whose rows hold their history lists
    train_rows, eval_rows = last_two_commits(table)
    normalizer = fit_normalizer(train_rows)
    train, scored = encode_for(train_rows, tc, normalizer, pointers), encode_for(eval_rows, tc, normalizer, pointers)
    for data in (train, scored):
        if args.zero == "ids":
            data.sparse_ids[:] = 0
            for values in data.seq_values.values():
                values[:] = 0
        elif args.zero == "dense":
            data.dense[:] = 0
    checkpoints = sorted(int(s) for s in args.steps.split(","))
    per_epoch = num_batches(train, tc.batch_size)
    for seed in (int(s) for s in args.seeds.split(",")):
        torch.manual_seed(seed)
        engine = local_engine(tc, len(normalizer.names), tuple(sorted(set(train.domains))),
                              prior_rates(train.labels, train.final))
        step = 0
        for target in checkpoints:
            while step < target:
                epoch, index = divmod(step, per_epoch)
                order = epoch_order(len(train), tc.seed, 0, epoch)
                engine.train_step(train, order[index * tc.batch_size:(index + 1) * tc.batch_size])
                step += 1
            probs = engine.predict(scored, tc.batch_size)
            cells = [f"{auc(scored.labels[:, k], probs[:, k]):.4f}" for k in (0, 1)]
            print(f"{args.model} seed {seed} zero {args.zero}: {step} steps on {len(train)} rows -> "
                  f"{len(scored)} rows: click AUC {cells[0]}, conversion AUC {cells[1]}", flush=True)


if __name__ == "__main__":
    main()
