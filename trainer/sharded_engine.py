"""The :class:`trainer.loop.Engine` of one rank of a sharded run (TorchRec DMP + FSDP2 HSDP, trainer.distributed).

Every rank sees the same global batches (the same rows in the same order as a one-process run) and
trains on its contiguous slice of each (:func:`trainer.distributed.split_rows`); predictions are made
on slices too and gathered on rank 0. A checkpoint is the DCP folder of every rank's shards (model,
fused embedding optimiser and Adam state; trainer.sharded_checkpoint) plus rank 0's ordinary ``step-N/`` with the
full parameters, whose meta.json (written last) marks the folder beside it (``extra["sharded"]``) and the world
size, so it counts only once both are complete. On an object-store lake only ``step-N/`` is written
(DCP here writes to a file system every rank sees): such a run cannot be resumed sharded.

Shape letters: B global batch, b local slice, N rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gemline.errors import BadConfigError
from gemline.lake import StorageOptions, is_remote
from trainer.checkpoint import TrainState, save_checkpoint
from trainer.config import TrainerConfig
from trainer.data import Batch, EncodedExamples, make_batch, validate_batch
from trainer.distributed import (
    ShardedRanker,
    build_shardable_model,
    distributed_train_step,
    full_state_dict,
    rank_device,
    shard_model,
)
from trainer.loop import to_device
from trainer.models import build_model
from trainer.models.towers import RankingModel
from trainer.sharded_checkpoint import load_sharded, save_sharded, sharded_checkpoint_dir, shards_of


@dataclass
class ShardedEngine:
    """One rank's sharded model and what rebuilds its unsharded twin (for rank 0's full-parameter checkpoint).

    Under DMPCollection (2-D sparse parallelism: each replica group holds its own copy of the tables and updates
    it from its own rows) the copies are averaged with ``DMPCollection.sync()`` after every
    ``trainer.distributed.sync_interval_steps``-th step taken (counted from the run's first step, across resumes),
    and before a checkpoint if they drifted since the last sync, so a checkpoint never keeps one copy and drops
    the others' updates.
    """

    sharded: ShardedRanker
    tc: TrainerConfig
    num_dense: int
    domains: tuple[str, ...]
    rank: int
    world_size: int
    steps: int = 0
    """Optimiser steps taken by the run (a resumed one: since its first), which the sync interval counts."""
    synced_at: int = 0
    """``steps`` at the last replica sync (or at the start or the resume: the copies are equal then)."""

    def prepare(self, data: EncodedExamples, rows: np.ndarray) -> tuple[Batch, int, float]:
        """See :meth:`trainer.loop.Engine.prepare`: (this rank's slice of ``rows`` (B,) as a checked batch on its
        device, B, its loss weight).

        A global batch of fewer rows than ranks (the tail of a read batch) is trained too: a rank whose
        slice is empty passes row ``rows[0]`` with weight 0 (it must take part in the embedding
        all-to-alls), so every row is trained once and the step equals the one-process step.
        """
        mine = np.array_split(rows, self.world_size)[self.rank]
        local = make_batch(data, mine if len(mine) else rows[:1])
        validate_batch(local, self.num_dense)  # on the host, before the copy
        return to_device(local, rank_device(self.tc.distributed)), len(rows), 1.0 if len(mine) else 0.0

    def train_prepared(self, prepared: tuple[Batch, int, float]) -> float | None:
        """See :meth:`trainer.loop.Engine.train_prepared`: this rank's step on its slice; every
        ``trainer.distributed.sync_interval_steps`` steps taken, the table replicas are synced (:meth:`sync_replicas`)."""
        local, global_rows, weight = prepared
        loss = distributed_train_step(self.sharded, local, global_rows, weight=weight, task_weights=self.tc.task_weights)
        if loss is not None:  # the same on every rank (the loss is reduced first), so the sync stays collective
            self.steps += 1
            if self.steps % self.tc.distributed.sync_interval_steps == 0:
                self.sync_replicas()
        return loss

    def train_step(self, data: EncodedExamples, rows: np.ndarray) -> float | None:
        """See :meth:`trainer.loop.Engine.train_step`: this rank trains on its slice of ``rows`` (B,)."""
        return self.train_prepared(self.prepare(data, rows))

    def sync_replicas(self) -> bool:
        """Average the table replicas across replica groups (``DMPCollection.sync()``, weights and optimiser state;
        collective); False, doing nothing, under plain DMP (one copy of each table) or when already in sync."""
        if self.sharded.sparse_wrapper != "dmp_collection" or self.synced_at == self.steps:
            return False
        self.sharded.model.sync()
        self.synced_at = self.steps
        return True

    def predict(self, data: EncodedExamples, batch_size: int) -> np.ndarray | None:
        """(N, 2) float64 probabilities on rank 0 (None elsewhere); collective over every rank.

        A rank whose slice of the last batch is empty looks up row 0 and drops the output: every rank
        must run the same number of forwards (the embedding all-to-alls are collective).
        """
        self.sharded.model.eval()
        mine: list[tuple[np.ndarray, np.ndarray]] = []
        with torch.no_grad():
            for start in range(0, len(data), batch_size):
                rows = np.array_split(np.arange(start, min(start + batch_size, len(data))), self.world_size)[self.rank]
                batch = make_batch(data, rows if len(rows) else np.zeros(1, dtype=np.int64))
                batch = to_device(batch, rank_device(self.tc.distributed))
                probs = torch.sigmoid(self.sharded.forward(batch)).to("cpu", torch.float64).numpy()
                if len(rows):
                    mine.append((rows, probs))
        self.sharded.model.train()
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if gathered is None:  # not rank 0
            return None
        out = np.zeros((len(data), 2))
        for part in gathered:
            for rows, probs in part:
                out[rows] = probs
        return out

    def save(self, root: str | Path, state: TrainState, *, files: Mapping[str, bytes] | None = None,
             storage_options: StorageOptions | None = None) -> str | None:
        """See :meth:`trainer.loop.Engine.save` (collective): DCP shards of every rank under
        ``root/_checkpoints/sharded/step-N`` (local roots), then rank 0's ``step-N/`` with the full
        parameters, ``extra["world_size"]`` and ``extra["sharded"]`` (the DCP folder, None on an object store)."""
        shards = None if is_remote(root) else sharded_checkpoint_dir(root, state.step)
        self.sync_replicas()
        if shards is not None:
            save_sharded(self.sharded, shards)
        full = full_state_dict(self.sharded)
        path = None
        if self.rank == 0:
            # The unsharded twin (build_model's; for "ranker" the TwoTaskRanker) has the same state_dict keys.
            model = build_model(self.tc, self.num_dense, self.domains)
            assert full is not None, "full_state_dict returns the parameters on rank 0"
            model.load_state_dict(full)
            extra = {**state.extra, "world_size": self.world_size, "sharded": None if shards is None else str(shards),
                     "embedding_optimizer": self.tc.table_optimizer}
            meta = TrainState(step=state.step, examples_seen=state.examples_seen, examples_version=state.examples_version, extra=extra)
            path = str(save_checkpoint(root, meta, model, {}, extra_files=files, storage_options=storage_options))
        dist.barrier()
        return path

    def load(self, path: str | Path, state: TrainState) -> None:
        """See :meth:`trainer.loop.Engine.load` (collective).

        Raises:
            gemline.errors.BadConfigError: the checkpoint is not a sharded run's of this model and world size (:func:`check_resumable`).
        """
        check_resumable(state, Path(path), self.world_size, self.tc.model, embedding_optimizer=self.tc.table_optimizer)
        load_sharded(self.sharded, shards_of(path))
        self.steps = self.synced_at = state.step


def sharded_engine(tc: TrainerConfig, num_dense: int, domains: tuple[str, ...], base_rates: torch.Tensor | None) -> ShardedEngine:
    """:data:`trainer.loop.EngineFactory` of a rank of the initialised process group: the wrap order of
    trainer.distributed applied to ``build_shardable_model`` (the output intercepts set before sharding)."""
    model = build_shardable_model(tc, num_dense, domains)
    if base_rates is not None and isinstance(model, RankingModel):  # the "ranker" has no intercepts to set
        model.init_output_bias(base_rates)
    world = dist.get_world_size()
    return ShardedEngine(shard_model(model, tc, world), tc, num_dense, domains, dist.get_rank(), world)


def check_resumable(state: TrainState, path: Path, world: int, model: str, dense_names: Sequence[str] | None = None,
                    *, embedding_optimizer: str | None = None) -> None:
    """Raise BadConfigError (a ValueError: what to do) unless a ``world``-process run of ``model`` can resume from the checkpoint at ``path``.

    It must be a sharded run's checkpoint with its DCP shards (a local lake), of the same model,
    world size and (when given) dense features and ``trainer.embedding_optimizer`` (a checkpoint that names
    none predates the choice: its tables trained under "adagrad"); resharding onto another world size is not
    done here.
    """
    extra = state.extra
    fresh = "start a new run (trainer.init_from=scratch; train --once/--follow: --from-scratch)"
    if not extra.get("sharded"):
        raise BadConfigError(
            f"the latest checkpoint {path} holds no sharded state (written by a one-process run, an object-store "
            f"lake, or before sharded checkpoints); a sharded run resumes only from one; {fresh}"
        )
    if extra.get("world_size") != world or extra.get("model") != model:
        raise BadConfigError(
            f"the latest checkpoint {path} is a {extra.get('world_size')}-process {extra.get('model')!r} run; this is a "
            f"{world}-process {model!r} run: resume with the same --nproc and trainer.model, or {fresh}"
        )
    saved_optimizer = extra.get("embedding_optimizer", "adagrad")
    if embedding_optimizer is not None and saved_optimizer != embedding_optimizer:
        raise BadConfigError(
            f"the latest checkpoint {path} holds the state of trainer.embedding_optimizer={saved_optimizer!r}; this run "
            f"uses {embedding_optimizer!r}: resume with --set trainer.embedding_optimizer={saved_optimizer}, or {fresh}"
        )
    saved = extra.get("normalizer", {}).get("names")
    if dense_names is not None and saved is not None and list(saved) != list(dense_names):
        raise BadConfigError(f"checkpoint {path} was trained on dense features {saved}, this table has {dense_names}; {fresh}")
