"""Resumable state of a sharded run, saved and loaded with torch.distributed.checkpoint (DCP).

Each rank writes its own shards (SPMD, PyTorch docs "Distributed Checkpoint"); DCP loads in place
into the tensors of a freshly sharded model, so a run resumed on the same world size and sharding
plan continues bit for bit (tests/trainer/test_distributed.py). What is saved, one DCP folder:

    model          DistributedModelParallel.state_dict(): ShardedTensor tables, DTensor dense params
    sparse_optim   TorchRec's fused optimiser state (ShardedTensor: row-wise Adagrad's (rows,) ``momentum1``, or
                   Adagrad's (rows, D) sums; trainer.embedding_optimizer, which meta.json names)
    dense_optim    Adam state of the fully_shard-ed modules, as FQN-keyed DTensors
                   (torch.distributed.checkpoint.state_dict.get_optimizer_state_dict, flattened)

The folder lives at ``ROOT/_checkpoints/sharded/step-N/`` (ROOT: the lake, or ``LAKE/_continuous`` for the
continuous trainer); the run's ordinary ``step-N/`` checkpoint (full parameters written by rank 0,
trainer.sharded_engine.ShardedEngine.save) names it in its meta.json, which is
written last, so a sharded folder without a complete ``step-N/`` beside it is never resumed from.
Step numbering, position in the epoch and the normalizer travel in that meta.json.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from trainer.checkpoint import checkpoints_root
from trainer.distributed import ShardedRanker

SHARDED_DIR = "sharded"
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def sharded_checkpoint_dir(lake: str | Path, step: int) -> Path:
    """``LAKE/_checkpoints/sharded/step-N`` (a local lake only)."""
    return checkpoints_root(lake) / SHARDED_DIR / f"step-{step}"


def _app_state(sharded: ShardedRanker) -> tuple[dict, nn.Module]:
    # The Adam state is keyed by FQNs relative to a container of the dense modules only: the
    # optimiser holds no table parameter, and the helper wants every parameter it holds in the model.
    dense = nn.ModuleDict({name: getattr(sharded.ranker, name) for name in sharded.dense_modules})
    state = {
        "model": sharded.model.state_dict(),
        "sparse_optim": sharded.sparse_optimizer.state_dict(),
        "dense_optim": get_optimizer_state_dict(dense, sharded.dense_optimizer, options=_FLAT),
    }
    return state, dense


def save_sharded(sharded: ShardedRanker, path: str | Path) -> None:
    """Write model and both optimisers' shards of every rank to the DCP folder ``path``.

    Collective: every rank calls it with the same ``path`` (a file system all ranks see).
    """
    state, _ = _app_state(sharded)
    dcp.save(state, checkpoint_id=str(path))


def load_sharded(sharded: ShardedRanker, path: str | Path) -> None:
    """Load the DCP folder ``path`` into ``sharded`` in place (model, fused sparse and dense optimiser state).

    Collective. ``sharded`` must be built like the run that saved it (same model config, world
    size and sharding types), e.g. by trainer.launch from the same config.

    Raises:
        FileNotFoundError: ``path`` holds no DCP checkpoint.
        torch.distributed.checkpoint.CheckpointException: the saved state does not fit this model
            (another model or sharding; DCP's message names the key).
    """
    if not (Path(path) / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a sharded (DCP) checkpoint: no .metadata file")
    state, dense = _app_state(sharded)
    dcp.load(state, checkpoint_id=str(path))
    sharded.model.load_state_dict(state["model"])
    sharded.sparse_optimizer.load_state_dict(state["sparse_optim"])
    set_optimizer_state_dict(dense, sharded.dense_optimizer, state["dense_optim"], options=_FLAT)
