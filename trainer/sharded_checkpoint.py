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

Loading runs no code from the folder. DCP's own reader unpickles ``.metadata`` and its planner reads byte items with
``torch.load(weights_only=False)``; here :class:`SafeReader` unpickles ``.metadata`` allowing only DCP's metadata
classes, ``torch.Size``, dtypes and paths (:data:`METADATA_GLOBALS`), and :class:`SafeLoadPlanner` reads byte items
with ``weights_only=True`` (trainer.checkpoint.safe_load). The folder itself is derived from the checkpoint's own
path (:func:`shards_of`), never taken from its meta.json.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from gemline.errors import CheckpointError
from trainer.checkpoint import checkpoints_root, safe_load
from trainer.distributed import ShardedRanker

SHARDED_DIR = "sharded"
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def sharded_checkpoint_dir(lake: str | Path, step: int) -> Path:
    """``LAKE/_checkpoints/sharded/step-N`` (a local lake only)."""
    return checkpoints_root(lake) / SHARDED_DIR / f"step-{step}"


def shards_of(checkpoint: str | Path) -> Path:
    """The DCP folder of the sharded run's checkpoint ``ROOT/_checkpoints/step-N``: ``ROOT/_checkpoints/sharded/step-N``
    (:func:`sharded_checkpoint_dir`), from the checkpoint's own path, so a meta.json cannot point the load elsewhere."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent / SHARDED_DIR / checkpoint.name


METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "ChunkStorageMetadata",
        "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
})
"""(module, name) of every global a DCP ``.metadata`` file of this project's checkpoints holds (dataclasses and enums
of plain fields; torch dtypes are allowed besides, by type), as pickled by torch.distributed.checkpoint.filesystem."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing any global outside :data:`METADATA_GLOBALS` and torch's dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a DCP .metadata file")


def read_metadata(path: str | Path) -> Metadata:
    """The DCP :class:`~torch.distributed.checkpoint.metadata.Metadata` of the folder ``path``, read by
    :class:`_MetadataUnpickler`.

    Raises:
        gemline.errors.CheckpointError: ``.metadata`` is missing, corrupt, or holds a global that is not allowed.
    """
    file = Path(path) / ".metadata"
    try:
        metadata = _MetadataUnpickler(io.BytesIO(file.read_bytes())).load()
    except Exception as exc:  # noqa: BLE001 - a corrupt or hostile file is one line
        raise CheckpointError(f"sharded checkpoint file {file} cannot be loaded safely ({type(exc).__name__}: {exc}); "
                              "move its checkpoint folder away to resume from an older one, or start a new run with "
                              "--from-scratch") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"sharded checkpoint file {file} holds a {type(metadata).__name__}, not DCP metadata: "
                              "move its checkpoint folder away, or start a new run with --from-scratch")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """DCP's file-system reader with :func:`read_metadata` in place of its ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """See :meth:`torch.distributed.checkpoint.FileSystemReader.read_metadata` (one metadata file, no ranks)."""
        metadata = read_metadata(str(self.path))
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id  # as the parent: ties the reads of one load together
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading byte items (the optimisers' non-tensor state) with
    ``torch.load(weights_only=True)`` (:func:`trainer.checkpoint.safe_load`) instead of ``weights_only=False``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """See :meth:`torch.distributed.checkpoint.DefaultLoadPlanner.load_bytes` (the same placement)."""
        loaded = safe_load(value.read(), name=f"DCP item {read_item.dest_index.fqn}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


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
            (another model or sharding; DCP's message names the key), or an item does not load safely.
        gemline.errors.CheckpointError: ``.metadata`` does not load safely (:func:`read_metadata`).
    """
    if not (Path(path) / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a sharded (DCP) checkpoint: no .metadata file")
    state, dense = _app_state(sharded)
    dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())
    sharded.model.load_state_dict(state["model"])
    sharded.sparse_optimizer.load_state_dict(state["sparse_optim"])
    set_optimizer_state_dict(dense, sharded.dense_optimizer, state["dense_optim"], options=_FLAT)
