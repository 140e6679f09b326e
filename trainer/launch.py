"""torchrun entry point: one rank of a sharded training run (see trainer.distributed for the wrapping).

    python -m torch.distributed.run --standalone --nproc_per_node N -m trainer.launch \\
        [--config FILE] [--lake DIR] [--set trainer.KEY=VALUE ...] [--version V] [--result-json PATH]
        [--once [--from-scratch] [--keep-checkpoints K] [--max-versions M]]

or, on each of M nodes (torchrun_command builds this argv):

    python -m torch.distributed.run --nnodes M --node_rank R --rdzv_backend c10d \\
        --rdzv_endpoint HOST:PORT --rdzv_id JOB --nproc_per_node N -m trainer.launch ...

Every rank runs trainer.train.train_holdout (``--once``: trainer.continuous.consume) through
trainer.sharded_engine: the same examples, the same global batch order, each rank training its slice
of every global batch. Rank 0 evaluates the gathered predictions, writes the checkpoint's meta.json
(full parameters gathered from the shards beside every rank's DCP shards) and the result as JSON. torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT (read through ``env://``) and LOCAL_RANK, which this entry point alone reads: with
``trainer.distributed.device = "cuda"`` rank r of a node computes on ``cuda:LOCAL_RANK`` (``torch.cuda.set_device``
before the process group starts, so NCCL and every ``cuda`` tensor of the rank use it: trainer.distributed.rank_device).

A rank needs the trainer section and the lake, nothing else of the application's config: the lake's root
reaches it as ``--lake``, the trainer section as ``--set trainer.KEY=VALUE`` flags (its non-defaults,
:func:`gemline.configtree.config_overrides`), rebuilt by :func:`gemline.configtree.build`. The lake's
storage options can hold secrets (``AWS_SECRET_ACCESS_KEY``) and every user of the machine reads argv
(``ps``), so the launcher writes them to a private TOML file (mode 0600, in a 0700 temporary directory)
passed as ``--config FILE`` (:func:`write_private_config`). The file and the flags are a subset of the
``gemline`` config file's spelling, so ``gemline.config.load_config`` reads them too.
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

import torch
import torch.distributed as dist

from gemline.configtree import build, load_tree, parse_set_flags
from gemline.configtree import config_overrides as config_overrides  # re-exported: the ranks' flag spelling
from gemline.errors import BadConfigError, GemlineError
from gemline.lake import Lake
from gemline.process import die_with_parent, run_and_exit
from trainer.config import TrainerConfig, check_device
from trainer.data import latest_examples_version
from trainer.distributed import SHARDABLE_MODELS
from trainer.sharded_engine import sharded_engine
from trainer.train import TrainResult, check_gate, train_holdout

if TYPE_CHECKING:
    from trainer.continuous import ContinuousResult

log = logging.getLogger(__name__)


def check_distributable(tc: TrainerConfig, nproc: int) -> None:
    """Raise ValueError (what to change) unless this trainer config can run sharded on ``nproc`` processes."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if tc.model not in SHARDABLE_MODELS:
        raise ValueError(
            f"--nproc > 1 shards trainer.model in {SHARDABLE_MODELS}; got {tc.model!r}. "
            "Pick one of those, or train it in one process (--nproc 1)"
        )
    if nproc > 1 and tc.model == "gem" and tc.gem.ema_decay is not None:
        raise ValueError("trainer.gem.ema_decay (the evaluation's parameter average) runs in one process only: "
                         "use --nproc 1 or --set trainer.gem.ema_decay=none")
    if tc.batch_size < nproc:
        raise ValueError(f"trainer.batch_size {tc.batch_size} must be >= the number of processes {nproc}")


def check_local_devices(tc: TrainerConfig, nproc: int) -> None:
    """Raise BadConfigError (a ValueError) unless this node can give each of its ``nproc`` ranks a device: with
    ``trainer.distributed.device = "cuda"``, one CUDA device per rank (``cuda:LOCAL_RANK``;
    :func:`trainer.config.check_device`). Checked before torchrun starts, so a CPU-only machine gets one line instead
    of every rank's NCCL traceback."""
    check_device(tc.distributed.device, key="trainer.distributed.device", processes=nproc)


def run_distributed_training(lake: Lake, tc: TrainerConfig, *, examples_version: int | None = None,
                             progress: bool = True) -> TrainResult | None:
    """Train ``tc``'s model on ``lake``'s ``examples@examples_version`` with every rank of the initialised process group:
    :func:`trainer.train.train_holdout` through :func:`trainer.sharded_engine.sharded_engine`.

    Returns the TrainResult on rank 0 and None on the other ranks.

    Raises:
        QuarantinedError: the quality gate does not allow that version.
        ValueError: ``trainer.model`` outside SHARDABLE_MODELS (gem, dlrm, ranker), a batch_size smaller than
            the world size, or ``trainer.init_from = "latest"`` with a latest checkpoint this run cannot
            resume from (:func:`trainer.sharded_engine.check_resumable`).
    """
    check_distributable(tc, dist.get_world_size())
    version = latest_examples_version(lake) if examples_version is None else examples_version
    check_gate(lake, version)
    if tc.torch_threads is not None:
        torch.set_num_threads(tc.torch_threads)
    return train_holdout(tc, lake, version, sharded_engine, progress=progress)


def write_private_config(lake: Lake, path: Path) -> Path:
    """Write ``lake``'s root and storage options as TOML (``lake = ROOT`` and a ``[lake_storage_options]``
    table) to a new file ``path`` readable by this user only (mode 0600), for ``trainer.launch --config``
    (and any ``gemline --config``: it is that file's spelling); return ``path``.

    Only the lake is written: the trainer section travels as ``--set`` flags
    (:func:`gemline.configtree.config_overrides`). Put the file in a private directory
    (``tempfile.TemporaryDirectory`` is 0700) and delete it when the run ends.

    Raises:
        FileExistsError: ``path`` exists (the file is created, never reused, so no other user can
            have opened it first).
    """
    # A JSON string is a TOML basic string (the same escapes), so any root, key or value round-trips.
    lines = [f"lake = {json.dumps(lake.root)}", "[lake_storage_options]"]
    lines += [f"{json.dumps(key)} = {json.dumps(value)}" for key, value in (lake.storage_options or {}).items()]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        os.fchmod(fd, 0o600)  # exactly 0600 whatever the umask
        fh.write("\n".join(lines) + "\n")
    return path


def torchrun_command(
    lake: Lake,
    tc: TrainerConfig,
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
    rank_args: Sequence[str] = (),
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
        lake: the lake every rank trains from (its root goes on the command line as ``--lake``).
        tc: the trainer section; its non-defaults go on the command line as ``--set trainer.KEY=VALUE``.
        nproc: processes on this node.
        result_json: file the process holding global rank 0 writes the TrainResult to (on its node).
        private_config: the file :func:`write_private_config` wrote for ``lake``, passed to the
            ranks as ``--config``; required when ``lake.storage_options`` is not empty (they
            never go on the command line).
        nnodes: launchers (machines) in the job; each must be started with the same nnodes,
            nproc, rdzv_endpoint and rdzv_id.
        node_rank: 0 <= node_rank < nnodes.
        rdzv_endpoint: ``HOST:PORT`` of the c10d rendezvous; required when nnodes > 1.
        rdzv_id: job id shared by the launchers of one run (a second job on the same endpoint
            needs another id).
        local_addr: address other nodes reach this one at (torchrun ``--local_addr``); None lets
            torchrun look up this host's name.
        rank_args: more flags of :func:`main` (``--once``, ``--from-scratch``, ...).

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
    check_distributable(tc, nproc * nnodes)
    check_local_devices(tc, nproc)
    if lake.storage_options and private_config is None:
        raise ValueError("the lake's storage options never go on a command line: write them with "
                         "write_private_config(lake, PATH) and pass private_config=PATH")
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
    cmd += ["--lake", lake.root]
    for pair in config_overrides(tc, "trainer."):
        cmd += ["--set", pair]
    if examples_version is not None:
        cmd += ["--version", str(examples_version)]
    return cmd + [*rank_args, "--result-json", str(result_json)]


def train_with_torchrun(
    lake: Lake,
    tc: TrainerConfig,
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
    that hosted global rank 0 returns the TrainResult, the others None. ``tc`` travels as ``--set``
    flags and the lake's storage options in a private file (:func:`write_private_config`, removed
    when the run ends), so the child processes see exactly this config and no secret is on a command
    line; ``lake`` must name the same lake on every node (a shared file system or object store) since
    rank 0 writes the checkpoint there.

    Raises:
        ValueError: see :func:`torchrun_command` and :func:`check_distributable`.
        RuntimeError: torchrun exited non-zero (the message ends with its output), or a one-node
            run wrote no result.
    """
    record = _torchrun(lake, tc, nproc, examples_version=examples_version, nnodes=nnodes, node_rank=node_rank,
                       rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, local_addr=local_addr)
    return None if record is None else TrainResult(**record)


def run_once_with_torchrun(lake: Lake, tc: TrainerConfig, nproc: int, *, from_scratch: bool = False, keep_checkpoints: int = 3,
                           max_versions: int | None = None) -> ContinuousResult:
    """:func:`trainer.continuous.consume` on ``nproc`` ranks of a standalone torchrun job (``gemline train --once
    --nproc N``); returns rank 0's result. The caller holds the lake's train lock (trainer.continuous.run_once).

    Raises:
        ValueError: see :func:`check_distributable`.
        RankError: a rank stopped on a GemlineError (a recreated table, another model's run, a checkpoint
            of another world size...); its message.
        RuntimeError: torchrun exited non-zero otherwise (the message ends with its output).
    """
    from gemline.increments import Cursor
    from trainer.continuous import ContinuousResult

    rank_args = ["--once", "--keep-checkpoints", str(keep_checkpoints)]
    rank_args += ["--from-scratch"] if from_scratch else []
    rank_args += [] if max_versions is None else ["--max-versions", str(max_versions)]
    record = _torchrun(lake, tc, nproc, rank_args=rank_args)
    assert record is not None, "a one-node job hosts rank 0"
    cursor = record.pop("cursor")
    return ContinuousResult(**record, cursor=None if cursor is None else Cursor.from_dict(cursor))


class RankError(GemlineError, RuntimeError):
    """A rank of a torchrun job stopped on a GemlineError (its message, seen from the launcher; exit 2)."""


def _error_file(result_json: Path, rank: int) -> Path:
    """Where rank ``rank`` writes the GemlineError it stops on: beside ``result_json``, one file per rank, so
    the first rank to fail has written its reason before torchrun stops the others (one shared file would
    race: torchrun may stop rank 0 before it writes, when another rank fails first)."""
    return result_json.with_name(f"{result_json.name}.error-rank{rank}")


def _torchrun(lake: Lake, tc: TrainerConfig, nproc: int, *, rank_args: Sequence[str] = (), **launch: object) -> dict | None:
    """Run :func:`main` on ``nproc`` local ranks (``launch``: :func:`torchrun_command`'s node arguments); the JSON
    record rank 0 wrote, or None on a node that did not host rank 0."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result_json = Path(tmp) / "result.json"
        private = write_private_config(lake, Path(tmp) / "config.toml") if lake.storage_options else None
        cmd = torchrun_command(lake, tc, nproc, result_json=result_json, private_config=private, rank_args=rank_args,
                               **launch)  # type: ignore[arg-type]
        # die_with_parent: torchrun (and, from main, every rank) dies with this launcher, which holds the lock.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=die_with_parent)
        try:
            _, stderr = proc.communicate()
        except BaseException:
            # Ctrl-C or SIGTERM of the launcher: SIGTERM lets torchrun stop its ranks (subprocess.run would
            # SIGKILL torchrun and leave the ranks running without the lake's lock). The ranks do not
            # finish their step; the next run resumes from the last complete checkpoint, so no row is lost
            # or trained twice.
            proc.terminate()
            proc.wait(timeout=60)
            raise
        nnodes, node_rank = launch.get("nnodes", 1), launch.get("node_rank", 0)
        where = f"{nproc} processes" if nnodes == 1 else f"{nproc} processes on node {node_rank} of {nnodes}"
        record = json.loads(result_json.read_text()) if result_json.exists() else None
        errors = sorted(Path(tmp).glob(f"{result_json.name}.error-rank*"))
        if proc.returncode != 0 and errors:
            error = json.loads(errors[0].read_text())
            raise RankError(f"{error['type']} on rank {error['rank']}: {error['error']}")
        if proc.returncode != 0 or (nnodes == 1 and record is None):
            raise RuntimeError(f"torchrun with {where} failed (exit {proc.returncode}):\n{stderr[-4000:]}")
        return record


RANK_KEYS = ("lake", "lake_storage_options", "trainer")
"""The keys of the config tree a rank reads (:func:`rank_config`)."""


def rank_config(tree: dict[str, Any]) -> tuple[Lake, TrainerConfig]:
    """The lake and the trainer section of a rank's config tree (``--config`` then ``--set`` and ``--lake``,
    :func:`gemline.configtree.load_tree`): ``lake`` (default ``./lake``, as ``gemline``'s),
    ``[lake_storage_options]`` and ``[trainer]``.

    Raises:
        BadConfigError: another key (a rank reads no other section), or a bad trainer key or value.
        TypeError: a storage option that is not a string.
    """
    unknown = sorted(set(tree) - set(RANK_KEYS))
    if unknown:
        raise BadConfigError(f"trainer.launch reads only {list(RANK_KEYS)} of a config, got {unknown}")
    options = tree.get("lake_storage_options") or {}
    if not isinstance(options, dict):
        raise BadConfigError(f"lake_storage_options: expected a table of strings, got {options!r}")
    trainer = tree.get("trainer", {})
    if not isinstance(trainer, dict):
        raise BadConfigError(f"trainer: expected a table, got {trainer!r}")
    return Lake(str(tree.get("lake", "./lake")), options or None), build(TrainerConfig, trainer, "trainer.")


def main(argv: list[str] | None = None) -> int:
    """Parse flags, join the process group (``env://`` from torchrun), train, write the result on rank 0.

    ``--once``: the continuous trainer (trainer.continuous.consume) instead of the one-shot run. A
    GemlineError on a rank is written as ``{"error", "type", "rank"}`` beside ``--result-json``
    (:func:`_error_file`; the launcher re-raises it as one line, :class:`RankError`) before the rank exits
    non-zero.
    """
    die_with_parent()  # torchrun starts ranks in sessions of their own: never outlive it (gemline.process)
    parser = argparse.ArgumentParser(prog="trainer.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="TOML file of the lake (the launcher's private file of storage options)")
    parser.add_argument("--lake")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="trainer.KEY=VALUE")
    parser.add_argument("--version", type=int, default=None)
    parser.add_argument("--once", action="store_true", help="continuous: consume the new examples versions once")
    parser.add_argument("--from-scratch", action="store_true", help="--once: start a new continuous run")
    parser.add_argument("--keep-checkpoints", type=int, default=3, help="--once: complete checkpoints kept")
    parser.add_argument("--max-versions", type=int, default=None, help="--once: versions consumed at most")
    parser.add_argument("--result-json", type=Path, default=None, help="rank 0 writes the result here")
    args = parser.parse_args(argv)
    overrides = parse_set_flags(args.overrides)
    if args.lake:
        overrides["lake"] = args.lake
    lake, tc = rank_config(load_tree(args.config, overrides))
    logging.basicConfig(level=logging.INFO)
    if tc.distributed.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # one GPU per local rank (torchrun sets LOCAL_RANK)
    dist.init_process_group(backend=tc.distributed.backend)
    try:
        result: TrainResult | ContinuousResult | None
        if args.once:
            from trainer.continuous import consume

            check_distributable(tc, dist.get_world_size())
            if tc.torch_threads is not None:
                torch.set_num_threads(tc.torch_threads)
            result = consume(lake, tc, sharded_engine, from_scratch=args.from_scratch,
                             keep_checkpoints=args.keep_checkpoints, max_versions=args.max_versions)
        else:
            result = run_distributed_training(lake, tc, examples_version=args.version)
        if result is not None:
            text = json.dumps(dataclasses.asdict(result), indent=2, default=str)
            if args.result_json is not None:
                args.result_json.write_text(text)
            print(text)
    except GemlineError as exc:
        if args.result_json is not None:
            rank = dist.get_rank()
            error = {"error": str(exc), "type": type(exc).__name__, "rank": rank}
            _error_file(args.result_json, rank).write_text(json.dumps(error))
        raise
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_and_exit(main)  # a rank that read tables must not die at exit after its work (gemline.process)
