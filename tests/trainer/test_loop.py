"""trainer.loop.train_loop: counts only the steps taken, checkpoints every k steps at the position after the
batch, and trains a LocalEngine exactly as trainer.loop.train_step does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.config import TrainerConfig
from trainer.data import encode_examples, fit_normalizer, make_batch
from trainer.loop import GlobalBatch, Progress, local_engine, train_loop, train_step

from .conftest import synthetic_examples


class _Scripted:
    """An Engine whose losses are given (None: a skipped step); records the rows it was asked to train."""

    rank, world_size = 0, 1

    def __init__(self, losses: list[float | None]) -> None:
        self.losses, self.seen = list(losses), []

    def train_step(self, data, rows):
        self.seen.append(list(rows))
        return self.losses.pop(0)


@pytest.mark.parametrize(
    ("losses", "every", "steps", "checkpoints"),
    [
        ([0.5, None, 0.4, 0.3, 0.2], 2, 4, ["b2", "b4"]),  # the skipped b1 moves no counter
        ([None, None], 1, 0, []),
        ([], 3, 0, []),
        ([0.1, 0.2, 0.3], None, 3, []),
    ],
)
def test_train_loop_counts_taken_steps_and_checkpoints_every_k(losses, every, steps, checkpoints):
    engine = _Scripted(losses)
    batches = [GlobalBatch(None, np.arange(3 * i, 3 * i + 3), f"b{i}") for i in range(len(losses))]
    progress, saved = Progress(step=10, examples_seen=30), []
    train_loop(engine, progress, batches, checkpoint_every_steps=every, checkpoint=saved.append)
    taken = [x for x in losses if x is not None]
    assert (progress.step, progress.examples_seen, progress.losses) == (10 + steps, 30 + 3 * steps, taken)
    assert engine.seen == [list(range(3 * i, 3 * i + 3)) for i in range(len(losses))]
    # 10 resumed steps: checkpoints fall on global steps 12 and 14 (every 2), i.e. after b2 and b4.
    assert saved == checkpoints


def test_local_engine_steps_as_train_step():
    table = synthetic_examples(["2026-01-01"], 40, seed=1)
    data = encode_examples(table, 50, fit_normalizer(table))
    tc = TrainerConfig(model="dlrm", num_embeddings=50, embedding_dim=4, hidden_dims=(8,), batch_size=16)
    torch.manual_seed(0)
    engine = local_engine(tc, data.dense.shape[1], ("feed", "marketplace", "reels"), None)
    torch.manual_seed(0)
    twin = local_engine(tc, data.dense.shape[1], ("feed", "marketplace", "reels"), None)
    rows = [np.arange(0, 16), np.arange(16, 32), np.arange(32, 40)]
    progress = Progress()
    train_loop(engine, progress, [GlobalBatch(data, r, i) for i, r in enumerate(rows)])
    expected = [train_step(twin.model, twin.optimizers, make_batch(data, r)) for r in rows]
    assert progress.losses == expected and (progress.step, progress.examples_seen) == (3, 40)
    assert all(torch.equal(a, b) for a, b in zip(engine.model.state_dict().values(), twin.model.state_dict().values()))
