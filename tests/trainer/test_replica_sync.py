"""The DMPCollection replica sync schedule of trainer.sharded_engine.ShardedEngine, and check_resumable's optimiser check.

DMPCollection asserts CUDA, so no real collection is built here: a stand-in records when ``sync()`` is called, and
the sharded step (trainer.distributed.distributed_train_step) is replaced by a script of losses (None: a step
skipped on every rank). What these tests cover is which steps sync; that ``sync()`` averages the replicas is
TorchRec's (not run here).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import trainer.sharded_engine as sharded_engine
from gemline.errors import BadConfigError
from trainer.checkpoint import TrainState
from trainer.config import DistributedConfig, TrainerConfig
from trainer.distributed import ShardedRanker
from trainer.sharded_engine import ShardedEngine, check_resumable


class _Collection:
    """Stands in for a DMPCollection: records the engine's step count at each ``sync()``."""

    def __init__(self) -> None:
        self.engine: ShardedEngine | None = None
        self.synced_at_steps: list[int] = []

    def sync(self) -> None:
        assert self.engine is not None
        self.synced_at_steps.append(self.engine.steps)


def _engine(monkeypatch, losses: list[float | None], interval: int, wrapper: str = "dmp_collection") -> tuple[ShardedEngine, _Collection]:
    script = list(losses)
    monkeypatch.setattr(sharded_engine, "make_batch", lambda data, rows: None)
    monkeypatch.setattr(sharded_engine, "validate_batch", lambda batch, num_dense: None)  # no batch to check or move
    monkeypatch.setattr(sharded_engine, "to_device", lambda batch, device: batch)
    monkeypatch.setattr(sharded_engine, "distributed_train_step", lambda *args, **kwargs: script.pop(0))
    collection = _Collection()
    sharded = ShardedRanker(model=collection, dense_optimizer=None, mesh=None, num_dense=1, sparse_wrapper=wrapper)  # type: ignore[arg-type]
    tc = TrainerConfig(distributed=DistributedConfig(sync_interval_steps=interval))
    engine = ShardedEngine(sharded, tc, num_dense=1, domains=(), rank=0, world_size=2)
    collection.engine = engine
    return engine, collection


def _train(engine: ShardedEngine, n: int) -> list[float | None]:
    return [engine.train_step(None, np.arange(4)) for _ in range(n)]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("losses", "interval", "synced"),
    [
        ([0.5, 0.4, 0.3], 1, [1, 2, 3]),  # the default: after every step
        ([0.5, None, 0.4, 0.3, None, 0.2, 0.1, 0.1, 0.1], 3, [3, 6]),  # skipped steps are not counted
        ([0.5, 0.4], 3, []),
    ],
)
def test_collection_syncs_after_every_kth_step_taken(monkeypatch, losses, interval, synced):
    engine, collection = _engine(monkeypatch, losses, interval)
    assert _train(engine, len(losses)) == losses
    assert collection.synced_at_steps == synced
    assert engine.steps == sum(loss is not None for loss in losses)


def test_plain_dmp_never_syncs(monkeypatch):
    engine, collection = _engine(monkeypatch, [0.5, 0.4, 0.3], 1, wrapper="dmp")
    _train(engine, 3)
    assert collection.synced_at_steps == [] and engine.sync_replicas() is False


def test_save_syncs_drifted_replicas_first_and_resume_keeps_the_schedule(monkeypatch, tmp_path: Path):
    engine, collection = _engine(monkeypatch, [0.5] * 7, 3)
    _train(engine, 4)  # synced after step 3; step 4 drifted
    saved: list[list[int]] = []
    monkeypatch.setattr(sharded_engine, "save_sharded", lambda sharded, path: saved.append(list(collection.synced_at_steps)))
    monkeypatch.setattr(sharded_engine, "full_state_dict", lambda sharded: None)
    monkeypatch.setattr(sharded_engine.dist, "barrier", lambda: None)
    engine.rank = 1  # rank 0 would also write the full-parameter checkpoint; the sync is every rank's
    engine.save(tmp_path, TrainState(step=4, examples_seen=16, examples_version=0))
    assert saved == [[3, 4]], "the replicas were averaged before their shards were written"
    engine.save(tmp_path, TrainState(step=4, examples_seen=16, examples_version=0))
    assert collection.synced_at_steps == [3, 4], "no second sync when nothing moved since"
    # A run resumed at step 4 syncs at 6, as the straight run would have.
    resumed, again = _engine(monkeypatch, [0.5] * 3, 3)
    monkeypatch.setattr(sharded_engine, "load_sharded", lambda sharded, path: None)
    extra = {"sharded": "dcp", "world_size": 2, "model": "gem", "embedding_optimizer": "rowwise_adagrad"}
    resumed.load(tmp_path, TrainState(step=4, examples_seen=16, examples_version=0, extra=extra))
    _train(resumed, 3)
    assert again.synced_at_steps == [6]


@pytest.mark.parametrize(
    ("saved", "running", "refused"),
    [
        ("adagrad", "rowwise_adagrad", True),
        ("rowwise_adagrad", "adagrad", True),
        (None, "rowwise_adagrad", True),  # written before the choice existed: Adagrad's state
        (None, "adagrad", False),
        ("rowwise_adagrad", "rowwise_adagrad", False),
    ],
)
def test_check_resumable_refuses_another_embedding_optimizer(saved, running, refused):
    extra = {"sharded": "dcp", "world_size": 2, "model": "gem"} | ({} if saved is None else {"embedding_optimizer": saved})
    state = TrainState(step=3, examples_seen=9, examples_version=0, extra=extra)
    if refused:
        with pytest.raises(BadConfigError, match=f"trainer.embedding_optimizer='{saved or 'adagrad'}'.*uses '{running}'"):
            check_resumable(state, Path("ckpt"), 2, "gem", embedding_optimizer=running)
    else:
        check_resumable(state, Path("ckpt"), 2, "gem", embedding_optimizer=running)


def test_sharded_engine_load_refuses_a_checkpoint_of_the_other_optimizer_before_reading_shards(monkeypatch, tmp_path: Path):
    engine, _ = _engine(monkeypatch, [], 1)
    read: list[str] = []
    monkeypatch.setattr(sharded_engine, "load_sharded", lambda sharded, path: read.append(path))
    extra = {"sharded": "dcp", "world_size": 2, "model": "gem", "embedding_optimizer": "adagrad"}
    with pytest.raises(BadConfigError, match="trainer.embedding_optimizer='adagrad'"):
        engine.load(tmp_path, TrainState(step=4, examples_seen=16, examples_version=0, extra=extra))
    assert read == [] and engine.steps == 0
