"""torchrun entry point: one rank of a sharded training run (see trainer.distributed for the wrapping).

    python -m torch.distributed.run --standalone --nproc_per_node N -m trainer.launch \\
        [--config FILE] [--lake DIR] [--set KEY=VALUE ...] [--version V] [--result-json PATH]

Every rank reads the same examples split and walks the same global batch order
(trainer.train.epoch_order); each trains on its slice of every global batch. Rank 0 evaluates the
gathered predictions, writes the checkpoint (full parameters gathered from the shards, no
optimiser state) and the TrainResult as JSON. torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT; this entry point is the only place that reads them (through ``env://``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from gemline.config import GemlineConfig, load_config, parse_set_flags
from trainer.checkpoint import TrainState, save_checkpoint
from trainer.config import TrainerConfig
from trainer.data import encode_examples, fit_normalizer, latest_examples_version, load_split, make_batch, num_batches
from trainer.distributed import ShardableRanker, ShardedRanker, distributed_train_step, full_state_dict, shard_ranker, split_rows
from trainer.metrics import evaluate
from trainer.model import TwoTaskRanker
from trainer.train import TrainResult, _json_safe, _loss_curve_png, check_gate, epoch_order

log = logging.getLogger(__name__)


def _predict(sharded: ShardedRanker, data, batch_size: int, rank: int, world: int) -> np.ndarray | None:
    """(N, 2) float64 probabilities on rank 0 (None elsewhere); collective over every rank.

    A rank whose slice of the last global batch is empty looks up row 0 and drops the output:
    every rank must run the same number of forwards (the embedding all-to-alls are collective).
    """
    sharded.model.eval()
    mine: list[tuple[np.ndarray, np.ndarray]] = []
    with torch.no_grad():
        for start in range(0, len(data), batch_size):
            rows = np.array_split(np.arange(start, min(start + batch_size, len(data))), world)[rank]
            batch = make_batch(data, rows if len(rows) else np.zeros(1, dtype=np.int64))
            probs = torch.sigmoid(sharded.model(batch.sparse, batch.sequence, batch.dense)).double().numpy()
            if len(rows):
                mine.append((rows, probs))
    sharded.model.train()
    gathered: list = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank != 0:
        return None
    out = np.zeros((len(data), 2))
    for part in gathered:
        for rows, probs in part:
            out[rows] = probs
    return out


def check_distributable(tc: TrainerConfig, nproc: int) -> None:
    """Raise ValueError (what to change) unless this trainer config can run sharded on ``nproc`` processes."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if tc.model != "ranker":
        raise ValueError(
            f"--nproc > 1 shards the TwoTaskRanker only; got trainer.model={tc.model!r}. "
            "Pass --set trainer.model=ranker, or train GEM/DLRM/LR in one process"
        )
    if tc.init_from != "scratch":
        raise ValueError("trainer.init_from='latest' is not supported with --nproc > 1; train from scratch or use one process")
    if tc.batch_size < nproc:
        raise ValueError(f"trainer.batch_size {tc.batch_size} must be >= the number of processes {nproc}")


def run_distributed_training(config: GemlineConfig, *, examples_version: int | None = None, progress: bool = True) -> TrainResult | None:
    """Train on ``examples@examples_version`` with every rank of the initialised process group.

    Returns the TrainResult on rank 0 and None on the other ranks.

    Raises:
        QuarantinedError: the quality gate does not allow that version.
        ValueError: ``trainer.model`` other than "ranker", ``trainer.init_from = "latest"``
            (sharded resume is not implemented), or a batch_size smaller than the world size.
    """
    tc = config.trainer
    rank, world = dist.get_rank(), dist.get_world_size()
    check_distributable(tc, world)
    version = latest_examples_version(config.lake) if examples_version is None else examples_version
    check_gate(config.lake, version)
    if tc.torch_threads is not None:
        torch.set_num_threads(tc.torch_threads)
    split = load_split(config.lake, version)
    normalizer = fit_normalizer(split.train)
    train = encode_examples(split.train, tc.num_embeddings, normalizer)
    evaluation = encode_examples(split.eval, tc.num_embeddings, normalizer)

    torch.manual_seed(tc.seed)
    shape = {"num_embeddings": tc.num_embeddings, "embedding_dim": tc.embedding_dim, "num_dense": len(normalizer.names), "hidden_dims": tc.hidden_dims}
    sharded = shard_ranker(ShardableRanker(**shape), tc, world)

    loss_curve: list[float] = []
    step = examples_seen = 0
    per_epoch = num_batches(train, tc.batch_size)
    with tqdm(total=tc.epochs * per_epoch, desc=f"train x{world}", unit="step", disable=not (progress and rank == 0)) as bar:
        for epoch in range(tc.epochs):
            order = epoch_order(len(train), tc.seed, version, epoch)
            for index in range(per_epoch):
                rows = order[index * tc.batch_size : (index + 1) * tc.batch_size]
                bar.update(1)
                if len(rows) < world:
                    log.warning("epoch %d: last batch of %d rows < %d processes, skipped", epoch, len(rows), world)
                    continue
                loss = distributed_train_step(sharded, make_batch(train, split_rows(rows, rank, world)), len(rows))
                if loss is None:
                    log.warning("epoch %d batch %d: non-finite loss, step skipped", epoch, index)
                    continue
                step += 1
                examples_seen += len(rows)
                loss_curve.append(loss)
                bar.set_postfix(loss=f"{loss:.4f}")

    probs = _predict(sharded, evaluation, tc.batch_size, rank, world)
    state = full_state_dict(sharded)
    if rank != 0:
        return None
    metrics = evaluate(evaluation.labels, probs, evaluation.domains)
    model = TwoTaskRanker(**shape)
    model.load_state_dict(state)
    extra = {"normalizer": normalizer.to_dict(), "eval_date": split.eval_date, "metrics": _json_safe(metrics), "world_size": world}
    path = save_checkpoint(
        config.lake, TrainState(step=step, examples_seen=examples_seen, examples_version=version, extra=extra), model, {},
        extra_files={"loss_curve.png": _loss_curve_png(loss_curve)},
    )
    return TrainResult(
        examples_version=version, train_examples=len(train), eval_examples=len(evaluation), eval_date=split.eval_date,
        metrics=metrics, checkpoint_path=str(path), steps=step, loss_curve=loss_curve,
    )


def config_overrides(config: object, prefix: str = "") -> list[str]:
    """The leaves of a config dataclass that differ from their defaults, as ``KEY=VALUE`` strings.

    load_config of these strings rebuilds ``config`` (only non-defaults travel, so a default such
    as an empty tuple never needs a spelling).
    """
    out: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        key = f"{prefix}{f.name}"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if value == default:
            continue
        if dataclasses.is_dataclass(value):
            out += config_overrides(value, f"{key}.")
        elif value is None:
            out.append(f"{key}=none")
        elif isinstance(value, tuple):
            out.append(f"{key}={','.join(str(v) for v in value)}")
        else:
            out.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out


def train_with_torchrun(config: GemlineConfig, nproc: int, *, examples_version: int | None = None) -> TrainResult:
    """Run :func:`run_distributed_training` on ``nproc`` local processes through torchrun; rank 0's result.

    The config travels as ``--set`` flags, so the child processes see exactly this config.

    Raises:
        ValueError: see :func:`check_distributable`.
        RuntimeError: torchrun exited non-zero (the message ends with its output).
    """
    import subprocess
    import tempfile

    check_distributable(config.trainer, nproc)
    with tempfile.TemporaryDirectory() as tmp:
        result_json = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "-m", "trainer.launch"]
        for pair in config_overrides(config):
            cmd += ["--set", pair]
        if examples_version is not None:
            cmd += ["--version", str(examples_version)]
        cmd += ["--result-json", str(result_json)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not result_json.exists():
            raise RuntimeError(f"torchrun with {nproc} processes failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        return TrainResult(**json.loads(result_json.read_text()))


def main(argv: list[str] | None = None) -> int:
    """Parse flags, join the process group (``env://`` from torchrun), train, write the result on rank 0."""
    parser = argparse.ArgumentParser(prog="trainer.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config")
    parser.add_argument("--lake")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--version", type=int, default=None)
    parser.add_argument("--result-json", type=Path, default=None, help="rank 0 writes the TrainResult here")
    args = parser.parse_args(argv)
    overrides = parse_set_flags(args.overrides)
    if args.lake:
        overrides["lake"] = args.lake
    config = load_config(args.config, overrides)
    logging.basicConfig(level=logging.INFO)
    dist.init_process_group(backend=config.trainer.distributed.backend)
    try:
        result = run_distributed_training(config, examples_version=args.version)
        if result is not None:
            text = json.dumps(dataclasses.asdict(result), indent=2, default=str)
            if args.result_json is not None:
                args.result_json.write_text(text)
            print(text)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
