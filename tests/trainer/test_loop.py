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

    def prepare(self, data, rows):
        return list(rows)

    def train_prepared(self, rows):
        self.seen.append(rows)
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


@pytest.mark.parametrize("model", ["gem", "dlrm"])
def test_sparse_table_gradients_update_only_the_rows_looked_up_and_match_dense_adagrad(model):
    from trainer.loop import sparse_table_gradients

    table = synthetic_examples(["2026-01-01"], 48, seed=2)
    data = encode_examples(table, 997, fit_normalizer(table))
    tc = TrainerConfig(model=model, num_embeddings=997, embedding_dim=8, hidden_dims=(8,), batch_size=16)
    domains = ("feed", "marketplace", "reels")
    torch.manual_seed(0)
    sparse = local_engine(tc, data.dense.shape[1], domains, None)
    torch.manual_seed(0)
    dense = local_engine(tc, data.dense.shape[1], domains, None)
    for module in dense.model.modules():  # the same engine with the tables' gradients dense, as before
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            module.sparse = False
    tables = {id(p) for p in sparse.model.embedding_parameters()}
    switched = [m for m in sparse.model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
                and m.sparse]
    assert switched and all(id(m.weight) in tables for m in switched), "only Adagrad's tables turn sparse"
    assert sparse_table_gradients(sparse.model, []) == 0
    before = {k: v.clone() for k, v in sparse.model.state_dict().items()}
    for rows in (np.arange(0, 16), np.arange(16, 32), np.arange(32, 48)):
        got = train_step(sparse.model, sparse.optimizers, make_batch(data, rows))
        want = train_step(dense.model, dense.optimizers, make_batch(data, rows))
        assert got == pytest.approx(want, rel=1e-5)
        for module in switched:
            assert module.weight.grad is None or module.weight.grad.is_sparse
    after, reference = sparse.model.state_dict(), dense.model.state_dict()
    table_names = {name for name, p in sparse.model.named_parameters() if id(p) in tables}
    for name, value in after.items():
        # Adam turns float noise in a gradient that is 0 in exact arithmetic (an attention key bias) into
        # lr-sized steps of either sign, so the dense part agrees to 1e-4 (lr 3e-3); the tables closely.
        tol = dict(rtol=1e-5, atol=1e-6) if name in table_names else dict(rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(value, reference[name], **tol, msg=name)
    untouched = [(name, (after[name] == before[name]).all(dim=1)) for name in after
                 if after[name].dim() == 2 and any(after[name] is m.weight.data or after[name].data_ptr()
                                                   == m.weight.data_ptr() for m in switched)]
    assert untouched and all(rows.any() for _, rows in untouched), "rows no batch looked up keep their values"
    for name, rows in untouched:
        assert torch.equal(after[name][rows], reference[name][rows]), name


def test_predict_runs_in_eval_and_inference_mode_and_matches_a_grad_forward():
    """predict's probabilities equal sigmoid of the model's forward with autograd on (the same rows, one batch),
    it ran under torch.inference_mode in eval mode, and it hands the model back in train mode."""
    from trainer.loop import forward as loop_forward
    from trainer.loop import predict, prepare_batch

    table = synthetic_examples(["2026-01-01"], 40, seed=2)
    data = encode_examples(table, 50, fit_normalizer(table))
    tc = TrainerConfig(model="dlrm", num_embeddings=50, embedding_dim=4, hidden_dims=(8,), batch_size=16)
    torch.manual_seed(0)
    model = local_engine(tc, data.dense.shape[1], ("feed", "marketplace", "reels"), None).model
    seen: list[tuple[bool, bool]] = []
    hook = model.register_forward_pre_hook(lambda m, _: seen.append((torch.is_inference_mode_enabled(), m.training)))
    probs = predict(model, data, 16)
    hook.remove()
    assert seen == [(True, False)] * 3 and model.training  # 40 rows in batches of 16
    model.eval()
    expected = torch.sigmoid(loop_forward(model, prepare_batch(model, make_batch(data, np.arange(40))))).double()
    assert expected.requires_grad  # the reference ran with autograd on
    np.testing.assert_allclose(probs, expected.detach().numpy(), rtol=1e-6, atol=1e-7)
