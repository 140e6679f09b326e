"""torchrun entry point: one rank of a sharded training run (see trainer.distributed for the wrapping).

    python -m torch.distributed.run --standalone --nproc_per_node N -m trainer.launch \\
        [--config FILE] [--lake DIR] [--set KEY=VALUE ...] [--version V] [--result-json PATH]

or, on each of M nodes (torchrun_command builds this argv):

    python -m torch.distributed.run --nnodes M --node_rank R --rdzv_backend c10d \\
        --rdzv_endpoint HOST:PORT --rdzv_id JOB --nproc_per_node N -m trainer.launch ...

Every rank reads the same examples split and walks the same global batch order
(trainer.train.epoch_order); each trains on its slice of every global batch. Rank 0 evaluates the
gathered predictions, writes the checkpoint (full parameters gathered from the shards, no
optimiser state) and the TrainResult as JSON. torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT; this entry point is the only place that reads them (through ``env://``).

The config reaches the ranks as ``--set`` flags, except the lake's storage options: they can hold
secrets (``AWS_SECRET_ACCESS_KEY``) and every user of the machine reads argv (``ps``), so the
launcher writes them to a private TOML file (mode 0600, in a 0700 temporary directory) passed as
``--config FILE`` (:func:`write_private_config`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from gemline.config import GemlineConfig, load_config, parse_set_flags
from gemline.lake import Lake
from gemline.process import run_and_exit
from trainer.checkpoint import TrainState, latest_checkpoint, read_state, save_checkpoint
from trainer.config import TrainerConfig
from trainer.data import encode_examples, fit_normalizer, latest_examples_version, load_split, make_batch, num_batches
from trainer.distributed import (
    SHARDABLE_MODELS,
    ShardedRanker,
    build_shardable_model,
    distributed_train_step,
    full_state_dict,
    shard_model,
    split_rows,
)
from trainer.metrics import evaluate, nan_to_none
from trainer.models import build_model
from trainer.sharded_checkpoint import load_sharded, save_sharded, sharded_checkpoint_dir
from trainer.train import (
    TrainResult,
    _loss_curve_png,
    _Position,
    _resume_position,
    _run_record,
    check_gate,
    epoch_order,
    training_domains,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

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
            probs = torch.sigmoid(sharded.forward(batch)).double().numpy()
            if len(rows):
                mine.append((rows, probs))
    sharded.model.train()
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if gathered is None:  # not rank 0
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
    if tc.model not in SHARDABLE_MODELS:
        raise ValueError(
            f"--nproc > 1 shards trainer.model in {SHARDABLE_MODELS}; got {tc.model!r}. "
            "Pick one of those, or train it in one process (--nproc 1)"
        )
    if tc.batch_size < nproc:
        raise ValueError(f"trainer.batch_size {tc.batch_size} must be >= the number of processes {nproc}")


def run_distributed_training(config: GemlineConfig, *, examples_version: int | None = None, progress: bool = True) -> TrainResult | None:
    """Train on ``examples@examples_version`` with every rank of the initialised process group.

    Returns the TrainResult on rank 0 and None on the other ranks.

    Raises:
        QuarantinedError: the quality gate does not allow that version.
        ValueError: ``trainer.model`` outside SHARDABLE_MODELS (gem, dlrm, ranker), a batch_size smaller than
            the world size, or ``trainer.init_from = "latest"`` with a latest checkpoint this run cannot
            resume from (:func:`check_resumable`).
    """
    tc = config.trainer
    lake = Lake.for_config(config)
    rank, world = dist.get_rank(), dist.get_world_size()
    check_distributable(tc, world)
    version = latest_examples_version(lake) if examples_version is None else examples_version
    check_gate(lake, version)
    if tc.torch_threads is not None:
        torch.set_num_threads(tc.torch_threads)
    split = load_split(lake, version)
    normalizer = fit_normalizer(split.train)

    torch.manual_seed(tc.seed)
    domains = training_domains(split.train, None)
    sharded = shard_model(build_shardable_model(tc, len(normalizer.names), domains), tc, world)
    step = examples_seen = 0
    start = _Position(0, 0)
    resume_from = latest_checkpoint(lake) if tc.init_from == "latest" else None
    if resume_from is not None:
        state = read_state(resume_from)
        check_resumable(state, resume_from, world, tc.model, normalizer.names)
        load_sharded(sharded, state.extra["sharded"])
        step, examples_seen = state.step, state.examples_seen
        start = _resume_position(state, version, tc.epochs)
        log.info("resumed %d-process run from %s at step %d (epoch %d, batch %d)", world, resume_from, step, start.epoch, start.batch)
    train = encode_examples(split.train, tc.num_embeddings, normalizer)
    evaluation = encode_examples(split.eval, tc.num_embeddings, normalizer)

    def checkpoint(position: _Position, finished: bool, extra: dict | None = None, files: dict | None = None) -> str | None:
        """Collective: DCP shards of every rank, then rank 0's full-parameter checkpoint naming them (path on rank 0)."""
        shards = None if lake.is_remote else sharded_checkpoint_dir(lake.root, step)
        if shards is not None:
            save_sharded(sharded, shards)
        full = full_state_dict(sharded)
        path = None
        if rank == 0:
            # The unsharded twin (build_model's; for "ranker" the TwoTaskRanker) has the same state_dict keys.
            model = build_model(tc, len(normalizer.names), domains)
            assert full is not None, "full_state_dict returns the parameters on rank 0"
            model.load_state_dict(full)
            meta = {
                "normalizer": normalizer.to_dict(), "domains": list(domains), "model": tc.model, "world_size": world,
                "sharded": None if shards is None else str(shards), "run": _run_record(position, tc.epochs, finished), **(extra or {}),
            }
            state = TrainState(step=step, examples_seen=examples_seen, examples_version=version, extra=meta)
            path = str(save_checkpoint(lake, state, model, {}, extra_files=files))
        dist.barrier()
        return path

    loss_curve: list[float] = []
    per_epoch = num_batches(train, tc.batch_size)
    total = tc.epochs * per_epoch
    with tqdm(total=total, initial=start.epoch * per_epoch + start.batch, desc=f"train x{world}", unit="step",
              disable=not (progress and rank == 0)) as bar:
        for epoch in range(start.epoch, tc.epochs):
            order = epoch_order(len(train), tc.seed, version, epoch)
            for index in range(start.batch if epoch == start.epoch else 0, per_epoch):
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
                if tc.checkpoint_every_steps is not None and step % tc.checkpoint_every_steps == 0:
                    checkpoint(_Position(epoch, index + 1), finished=False)

    probs = _predict(sharded, evaluation, tc.batch_size, rank, world)
    metrics = evaluate(evaluation.labels, probs, evaluation.domains) if probs is not None else {}  # rank 0
    path = checkpoint(
        _Position(tc.epochs, 0), finished=True,
        extra={"eval_date": split.eval_date, "metrics": nan_to_none(metrics)}, files={"loss_curve.png": _loss_curve_png(loss_curve)},
    )
    if rank != 0:
        return None
    return TrainResult(
        examples_version=version, train_examples=len(train), eval_examples=len(evaluation), eval_date=split.eval_date,
        metrics=metrics, checkpoint_path=str(path), steps=step, loss_curve=loss_curve,
    )


def check_resumable(state: TrainState, path: Path, world: int, model: str, dense_names: Sequence[str]) -> None:
    """Raise ValueError (what to do) unless a ``world``-process run of ``model`` can resume from the checkpoint at ``path``.

    It must be a sharded run's checkpoint with its DCP shards (a local lake), of the same model,
    world size and dense features; resharding onto another world size is not done here.
    """
    extra = state.extra
    if not extra.get("sharded"):
        raise ValueError(
            f"the latest checkpoint {path} holds no sharded state (written by a one-process run, an object-store "
            "lake, or before sharded checkpoints); a sharded run resumes only from one; use trainer.init_from=scratch"
        )
    if extra.get("world_size") != world or extra.get("model") != model:
        raise ValueError(
            f"the latest checkpoint {path} is a {extra.get('world_size')}-process {extra.get('model')!r} run; this is a "
            f"{world}-process {model!r} run: resume with the same --nproc and trainer.model, or use trainer.init_from=scratch"
        )
    saved = extra.get("normalizer", {}).get("names")
    if saved is not None and list(saved) != list(dense_names):
        raise ValueError(f"checkpoint {path} was trained on dense features {saved}, this table has {dense_names}; use trainer.init_from=scratch")


def config_overrides(config: DataclassInstance, prefix: str = "") -> list[str]:
    """The leaves of a config dataclass that differ from their defaults, as ``KEY=VALUE`` strings.

    load_config of these strings rebuilds ``config`` (only non-defaults travel, so a default such
    as an empty tuple never needs a spelling), except ``GemlineConfig.lake_storage_options``,
    which is left out: it can hold secrets and these strings end up on a command line;
    :func:`write_private_config` carries it.

    Raises:
        TypeError: another table-valued (dict) field, which has no ``KEY=VALUE`` spelling here.
    """
    out: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(config, GemlineConfig) and f.name == "lake_storage_options":
            continue
        if isinstance(value, dict):
            raise TypeError(f"config_overrides: {prefix}{f.name} is a table; it cannot travel as --set flags")
        key = f"{prefix}{f.name}"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if value == default:
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out += config_overrides(value, f"{key}.")
        elif value is None:
            out.append(f"{key}=none")
        elif isinstance(value, tuple):
            out.append(f"{key}={','.join(str(v) for v in value)}")
        else:
            out.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out


def write_private_config(config: GemlineConfig, path: Path) -> Path:
    """Write ``config.lake_storage_options`` as a TOML ``[lake_storage_options]`` table to a new
    file ``path`` readable by this user only (mode 0600), for ``trainer.launch --config``; return ``path``.

    Only the options are written: the rest of the config travels as ``--set`` flags
    (:func:`config_overrides`). Put the file in a private directory (``tempfile.TemporaryDirectory``
    is 0700) and delete it when the run ends.

    Raises:
        FileExistsError: ``path`` exists (the file is created, never reused, so no other user can
            have opened it first).
    """
    lines = ["[lake_storage_options]"]
    # A JSON string is a TOML basic string (the same escapes), so any key or value round-trips.
    lines += [f"{json.dumps(key)} = {json.dumps(value)}" for key, value in config.lake_storage_options.items()]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        os.fchmod(fd, 0o600)  # exactly 0600 whatever the umask
        fh.write("\n".join(lines) + "\n")
    return path


def torchrun_command(
    config: GemlineConfig,
    nproc: int,
    *,
    result_json: Path,
    private_config: Path | None = None,
    examples_version: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "gemline",
    local_addr: str | None = None,
) -> list[str]:
    """The ``python -m torch.distributed.run ... -m trainer.launch ...`` argv for one node (launcher).

    One node without ``rdzv_endpoint`` uses ``--standalone`` (a private rendezvous on a free
    port). Otherwise every node gets ``--nnodes N --rdzv_backend c10d --rdzv_endpoint HOST:PORT
    --rdzv_id JOB`` and the world is ``nnodes * nproc`` processes. The first launcher to reach
    HOST:PORT hosts the rendezvous store (HOST must be an address of one of the nodes). With c10d
    torchrun assigns global ranks by sorting the joined nodes, not by ``--node_rank`` (it is passed
    along for the logs only: torch.distributed.run docs, ``--node-rank``), so any node may host
    rank 0 and write ``result_json``.

    Args:
        nproc: processes on this node.
        result_json: file the process holding global rank 0 writes the TrainResult to (on its node).
        private_config: the file :func:`write_private_config` wrote for ``config``, passed to the
            ranks as ``--config``; required when ``config.lake_storage_options`` is not empty (they
            never go on the command line).
        nnodes: launchers (machines) in the job; each must be started with the same nnodes,
            nproc, rdzv_endpoint and rdzv_id.
        node_rank: 0 <= node_rank < nnodes.
        rdzv_endpoint: ``HOST:PORT`` of the c10d rendezvous; required when nnodes > 1.
        rdzv_id: job id shared by the launchers of one run (a second job on the same endpoint
            needs another id).
        local_addr: address other nodes reach this one at (torchrun ``--local_addr``); None lets
            torchrun look up this host's name.

    Raises:
        ValueError: nnodes < 1, node_rank outside [0, nnodes), nnodes > 1 without rdzv_endpoint,
            an endpoint not of the form HOST:PORT, a config :func:`check_distributable` refuses
            for the world size ``nnodes * nproc``, or storage options without ``private_config``.
    """
    if nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank must be in [0, {nnodes}) for --nnodes {nnodes}, got {node_rank}")
    if nnodes > 1 and rdzv_endpoint is None:
        raise ValueError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (an address of one node, the same for every node)")
    if rdzv_endpoint is not None:
        host, _, port = rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--rdzv-endpoint must be HOST:PORT, got {rdzv_endpoint!r}")
    check_distributable(config.trainer, nproc * nnodes)
    if config.lake_storage_options and private_config is None:
        raise ValueError("the lake's storage options never go on a command line: write them with "
                         "write_private_config(config, PATH) and pass private_config=PATH")
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if rdzv_endpoint is None:
        cmd += ["--standalone"]
    else:
        cmd += ["--nnodes", str(nnodes), "--node_rank", str(node_rank), "--rdzv_backend", "c10d",
                "--rdzv_endpoint", rdzv_endpoint, "--rdzv_id", rdzv_id]
        if local_addr is not None:
            cmd += ["--local_addr", local_addr]
    cmd += ["--nproc_per_node", str(nproc), "-m", "trainer.launch"]
    if private_config is not None:
        cmd += ["--config", str(private_config)]
    for pair in config_overrides(config):
        cmd += ["--set", pair]
    if examples_version is not None:
        cmd += ["--version", str(examples_version)]
    return cmd + ["--result-json", str(result_json)]


def train_with_torchrun(
    config: GemlineConfig,
    nproc: int,
    *,
    examples_version: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "gemline",
    local_addr: str | None = None,
) -> TrainResult | None:
    """Run :func:`run_distributed_training` through torchrun with ``nproc`` processes on this node.

    One node (the default): a standalone job; returns rank 0's TrainResult. ``nnodes > 1``: this
    is one of ``nnodes`` launchers of a c10d job (see :func:`torchrun_command`); every node runs
    this call with the same arguments but its ``node_rank`` and blocks until the job ends; the node
    that hosted global rank 0 returns the TrainResult, the others None. The config travels as
    ``--set`` flags and the lake's storage options in a private file (:func:`write_private_config`,
    removed when the run ends), so the child processes see exactly this config and no secret is on
    a command line; ``config.lake`` must name the same lake on every node (a shared file system or
    object store) since rank 0 writes the checkpoint there.

    Raises:
        ValueError: see :func:`torchrun_command` and :func:`check_distributable`.
        RuntimeError: torchrun exited non-zero (the message ends with its output), or a one-node
            run wrote no result.
    """
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result_json = Path(tmp) / "result.json"
        private = write_private_config(config, Path(tmp) / "config.toml") if config.lake_storage_options else None
        cmd = torchrun_command(
            config, nproc, result_json=result_json, private_config=private, examples_version=examples_version, nnodes=nnodes,
            node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, local_addr=local_addr,
        )
        proc = subprocess.run(cmd, capture_output=True, text=True)
        where = f"{nproc} processes" if nnodes == 1 else f"{nproc} processes on node {node_rank} of {nnodes}"
        if proc.returncode != 0 or (nnodes == 1 and not result_json.exists()):
            raise RuntimeError(f"torchrun with {where} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        if not result_json.exists():
            return None
        return TrainResult(**json.loads(result_json.read_text()))


def main(argv: list[str] | None = None) -> int:
    """Parse flags, join the process group (``env://`` from torchrun), train, write the result on rank 0."""
    parser = argparse.ArgumentParser(prog="trainer.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="TOML config file (the launcher's private file of storage options)")
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
    run_and_exit(main)  # a rank that read tables must not die at exit after its work (gemline.process)
