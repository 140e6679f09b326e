"""trainer.sparse_optim: row-wise Adagrad on sparse gradients (hand-checked, and equal to TorchRec's dense reference),
the one-process optimiser split (no table in Adam), checkpoints of its state, and the DMPCollection sync schedule."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingCollection

from gemline.errors import BadConfigError
from trainer.checkpoint import TrainState, load_checkpoint, save_checkpoint
from trainer.config import DistributedConfig, EmbeddingOptimizerName, TrainerConfig
from trainer.data import encode_examples, fit_normalizer, make_batch
from trainer.loop import local_engine, train_step
from trainer.sparse_optim import RowSparseAdam, RowWiseAdagrad, embedding_optimizer, fused_optimizer

from .conftest import synthetic_examples

DOMAINS = ("feed", "marketplace", "reels")


def _lookup_step(table: torch.nn.Embedding, optimizer: torch.optim.Optimizer, ids: list[int], coeffs: list[list[float]]) -> None:
    """One step on loss = sum(table(ids) * coeffs): row r's gradient is the sum of the coeffs of its lookups."""
    optimizer.zero_grad()
    (table(torch.tensor(ids)) * torch.tensor(coeffs)).sum().backward()
    optimizer.step()


def test_rowwise_adagrad_hand_checked_on_a_sparse_gradient():
    table = torch.nn.Embedding(4, 2, sparse=True)
    with torch.no_grad():
        table.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]))
    opt = RowWiseAdagrad(table.parameters(), lr=0.1, eps=1e-10)
    # Row 1 looked up twice: its gradient is [3, 4] + [1, 0] = [4, 4]; row 3's [1, 1].
    _lookup_step(table, opt, [1, 3, 1], [[3.0, 4.0], [1.0, 1.0], [1.0, 0.0]])
    assert table.weight.grad.is_sparse
    # acc_1 = mean(16, 16) = 16: row 1 -= 0.1 * [4, 4] / 4; acc_3 = 1: row 3 -= 0.1 * [1, 1] / 1; rows 0, 2 untouched.
    torch.testing.assert_close(opt.state[table.weight]["sum"], torch.tensor([0.0, 16.0, 0.0, 1.0]))
    torch.testing.assert_close(table.weight.detach(), torch.tensor([[1.0, 2.0], [2.9, 3.9], [5.0, 6.0], [6.9, 7.9]]))
    # Second step, row 1's gradient [0, 3]: acc_1 = 16 + 9 / 2 = 20.5; row 1 -= 0.1 * [0, 3] / sqrt(20.5).
    _lookup_step(table, opt, [1], [[0.0, 3.0]])
    assert opt.state[table.weight]["sum"][1].item() == pytest.approx(20.5)
    assert table.weight[1].tolist() == pytest.approx([2.9, 3.9 - 0.3 / math.sqrt(20.5)], abs=1e-6)
    assert table.weight[3].tolist() == pytest.approx([6.9, 7.9], abs=1e-6)


def test_rowwise_adagrad_on_sparse_gradients_equals_torchrec_rowwise_adagrad_on_dense_ones():
    """torchrec.optim.RowWiseAdagrad (dense gradients only) is the reference: 4 steps, repeated ids, eps 1e-8."""
    from torchrec.optim import RowWiseAdagrad as Reference

    torch.manual_seed(0)
    sparse, dense = torch.nn.Embedding(50, 6, sparse=True), torch.nn.Embedding(50, 6)
    dense.load_state_dict(sparse.state_dict())
    initial = sparse.weight.detach().clone()
    ours, ref = RowWiseAdagrad(sparse.parameters(), lr=0.05, eps=1e-8), Reference(dense.parameters(), lr=0.05, eps=1e-8)
    rng = np.random.default_rng(1)
    for _ in range(4):
        ids = rng.integers(0, 20, 30).tolist()  # rows 20..49 never looked up
        coeffs = rng.standard_normal((30, 6)).tolist()
        _lookup_step(sparse, ours, ids, coeffs)
        _lookup_step(dense, ref, ids, coeffs)
    torch.testing.assert_close(sparse.weight, dense.weight, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours.state[sparse.weight]["sum"], ref.state[dense.weight]["sum"].flatten(), rtol=1e-6, atol=0)
    assert torch.equal(sparse.weight[20:], initial[20:]) and (sparse.weight[:20] != initial[:20]).all(dim=1).any()


def test_rowwise_adagrad_rejects_bad_arguments_and_another_optimisers_state():
    table = torch.nn.Embedding(5, 3)
    with pytest.raises(ValueError, match="lr > 0 and eps > 0"):
        RowWiseAdagrad(table.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="2-D tables"):
        RowWiseAdagrad([torch.nn.Parameter(torch.zeros(3))])
    opt = RowWiseAdagrad(table.parameters())
    with pytest.raises(ValueError, match=r"accumulator of shape \(5, 3\).*row-wise Adagrad one of \(5,\)"):
        opt.load_state_dict(torch.optim.Adagrad(table.parameters()).state_dict())
    saved = RowWiseAdagrad(table.parameters(), lr=0.5).state_dict()
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == 0.5


def _table_parameters(model: torch.nn.Module) -> set[int]:
    return {id(p) for m in model.modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection)) for p in m.parameters()}


@pytest.mark.parametrize("model", ["gem", "dlrm", "lr", "ranker"])
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adagrad"])
def test_local_optimizers_put_every_table_in_the_embedding_optimizer_and_none_in_adam(model, optimizer):
    tc = TrainerConfig(model=model, num_embeddings=50, embedding_dim=4, hidden_dims=(8,), learning_rate=0.01,
                       embedding_learning_rate=0.2, embedding_optimizer=optimizer, embedding_eps=1e-7)
    engine = local_engine(tc, 3, DOMAINS, None)
    adam, tables = engine.optimizers["dense"], engine.optimizers["embeddings"]
    in_adam = {id(p) for g in adam.param_groups for p in g["params"]}
    in_tables = {id(p) for g in tables.param_groups for p in g["params"]}
    assert in_tables == _table_parameters(engine.model) and in_tables
    assert not in_adam & in_tables and in_adam | in_tables == {id(p) for p in engine.model.parameters()}
    # GEM's dense part has its own rate (trainer.gem.learning_rate, default 1e-3); the others take trainer.learning_rate.
    assert isinstance(adam, torch.optim.Adam) and adam.param_groups[0]["lr"] == (1e-3 if model == "gem" else 0.01)
    assert type(tables) is (RowWiseAdagrad if optimizer == "rowwise_adagrad" else torch.optim.Adagrad)
    assert (tables.param_groups[0]["lr"], tables.param_groups[0]["eps"]) == (0.2, 1e-7)
    # Every table yields sparse gradients: no step materializes a whole table's gradient.
    tables_modules = [m for m in engine.model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
                      and id(m.weight) in in_tables]
    assert tables_modules and all(m.sparse for m in tables_modules)


def test_fused_optimizer_maps_to_fbgemm_kernels():
    from torchrec.distributed.utils import optimizer_type_to_emb_opt_type
    from torchrec.optim import RowWiseAdagrad as TorchRecRowWiseAdagrad

    tc = TrainerConfig(learning_rate=0.01, embedding_eps=1e-8)
    cls, kwargs = fused_optimizer(tc)
    assert cls is TorchRecRowWiseAdagrad and kwargs == {"lr": 0.01, "eps": 1e-8}
    assert optimizer_type_to_emb_opt_type(cls).name == "EXACT_ROWWISE_ADAGRAD"
    cls, kwargs = fused_optimizer(TrainerConfig(embedding_optimizer="adagrad", embedding_learning_rate=0.3))
    assert cls is torch.optim.Adagrad and kwargs == {"lr": 0.3, "eps": 1e-10}
    assert optimizer_type_to_emb_opt_type(cls).name == "EXACT_ADAGRAD"
    assert type(embedding_optimizer(TrainerConfig(), torch.nn.Embedding(3, 2).parameters())) is RowWiseAdagrad


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"embedding_optimizer": "sgd"}, "trainer.embedding_optimizer must be one of"),
        ({"embedding_eps": 0.0}, "trainer.embedding_eps must be > 0"),
    ],
)
def test_config_rejects_bad_embedding_optimizer_settings(overrides, message):
    with pytest.raises(BadConfigError, match=message):
        TrainerConfig(**overrides)
    with pytest.raises(BadConfigError, match="sync_interval_steps must be >= 1"):
        DistributedConfig(sync_interval_steps=0)


def _engine_and_data(optimizer: EmbeddingOptimizerName):
    table = synthetic_examples(["2026-01-01"], 48, seed=4)
    data = encode_examples(table, 97, fit_normalizer(table))
    tc = TrainerConfig(model="dlrm", num_embeddings=97, embedding_dim=4, hidden_dims=(8,), embedding_optimizer=optimizer)
    torch.manual_seed(0)
    return local_engine(tc, data.dense.shape[1], DOMAINS, None), data


BATCHES = [np.arange(0, 16), np.arange(16, 32), np.arange(32, 48)]


def test_rowwise_state_saves_and_resumes_exactly(tmp_path: Path):
    straight, data = _engine_and_data("rowwise_adagrad")
    for rows in BATCHES:
        train_step(straight.model, straight.optimizers, make_batch(data, rows))
    first, _ = _engine_and_data("rowwise_adagrad")
    for rows in BATCHES[:2]:
        train_step(first.model, first.optimizers, make_batch(data, rows))
    path = first.save(tmp_path, TrainState(step=2, examples_seen=32, examples_version=0))
    resumed, _ = _engine_and_data("rowwise_adagrad")
    resumed.load(path, TrainState(step=2, examples_seen=32, examples_version=0))
    acc = resumed.optimizers["embeddings"].state
    assert any(bool((s["sum"] > 0).any()) for s in acc.values()), "the accumulators came back"
    train_step(resumed.model, resumed.optimizers, make_batch(data, BATCHES[2]))
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    # Control: the same parameters with fresh accumulators step elsewhere, so the test sees a lost state.
    control, _ = _engine_and_data("rowwise_adagrad")
    control.model.load_state_dict(first.model.state_dict())
    train_step(control.model, control.optimizers, make_batch(data, BATCHES[2]))
    assert not all(torch.equal(a, b) for a, b in zip(straight.model.state_dict().values(), control.model.state_dict().values()))


@pytest.mark.parametrize(("saved", "resumed"), [("adagrad", "rowwise_adagrad"), ("rowwise_adagrad", "adagrad")])
def test_resume_under_the_other_embedding_optimizer_is_refused(tmp_path: Path, saved, resumed):
    engine, data = _engine_and_data(saved)
    train_step(engine.model, engine.optimizers, make_batch(data, BATCHES[0]))
    path = engine.save(tmp_path, TrainState(step=1, examples_seen=16, examples_version=0))
    other, _ = _engine_and_data(resumed)
    with pytest.raises(BadConfigError, match=rf"'embeddings': saved by .*this run builds .*resume with "
                                             rf"--set trainer.embedding_optimizer={saved}, or .* --from-scratch"):
        other.load(path, TrainState(step=1, examples_seen=16, examples_version=0))


def test_a_checkpoint_from_before_the_choice_is_refused_by_rowwise_adagrad(tmp_path: Path):
    """Checkpoints written before issue 19 name no optimiser classes; their tables' state is Adagrad's (rows, D)."""
    engine, data = _engine_and_data("adagrad")
    train_step(engine.model, engine.optimizers, make_batch(data, BATCHES[0]))
    path = Path(save_checkpoint(tmp_path, TrainState(step=1, examples_seen=16, examples_version=0), engine.model, engine.optimizers))
    payload = torch.load(path / "state.pt", weights_only=True)
    del payload["optimizer_types"]
    torch.save(payload, path / "state.pt")
    rowwise, _ = _engine_and_data("rowwise_adagrad")
    with pytest.raises(ValueError, match="written by another trainer.embedding_optimizer"):
        load_checkpoint(path, rowwise.model, rowwise.optimizers)


def test_row_gradients_add_each_rows_lookups_in_order_and_zero_rows_change_nothing():
    """row_gradients against a Python loop over the lookups (to the bit), against coalesce (to float re-association),
    and with exact-zero lookups slipped in anywhere (what a model's unread events give): the same sums, to the bit."""
    from trainer.sparse_optim import row_gradients

    rng = np.random.default_rng(3)
    ids = torch.from_numpy(rng.integers(0, 7, 5000))
    values = torch.from_numpy(rng.standard_normal((5000, 4)).astype(np.float32))
    rows, sums = row_gradients(torch.sparse_coo_tensor(ids[None], values, (10, 4)))
    expected = torch.zeros(10, 4)
    for i, row in enumerate(ids.tolist()):
        expected[row] += values[i]
    assert rows.tolist() == sorted(set(ids.tolist()))
    assert torch.equal(sums, expected[rows])
    coalesced = torch.sparse_coo_tensor(ids[None], values, (10, 4)).coalesce()
    torch.testing.assert_close(sums, coalesced.values(), rtol=1e-4, atol=1e-4)  # sums of ~700 terms
    # 3000 zero lookups, of rows seen and of a row never seen (9), interleaved at random places.
    zero_ids = torch.from_numpy(rng.integers(0, 10, 3000))
    position = torch.from_numpy(np.sort(rng.choice(8000, 5000, replace=False)))  # where the real lookups go
    slots = torch.ones(8000, dtype=torch.bool)
    slots[position] = False
    all_ids, all_values = torch.empty(8000, dtype=torch.int64), torch.empty(8000, 4)
    all_ids[position], all_values[position] = ids, values
    all_ids[slots], all_values[slots] = zero_ids, 0.0
    with_zeros, zero_sums = row_gradients(torch.sparse_coo_tensor(all_ids[None], all_values, (10, 4)))
    assert torch.equal(zero_sums[torch.isin(with_zeros, rows)], sums)
    assert not zero_sums[~torch.isin(with_zeros, rows)].any()


@pytest.mark.parametrize("maximize", [False, True])
def test_row_sparse_adam_steps_as_torch_sparse_adam_bit_for_bit(maximize):
    """Two tables under RowSparseAdam and under torch.optim.SparseAdam, 25 steps of lookups with repeated ids, a
    step where one table gets no gradient and one where its gradient has no rows: every weight and moment equal
    bit for bit, the same step counts, and each optimiser resumes from the other's state_dict."""
    g = torch.Generator().manual_seed(11)
    mine = torch.nn.ModuleList(torch.nn.Embedding(50, 4, sparse=True) for _ in range(2))
    theirs = torch.nn.ModuleList(torch.nn.Embedding(50, 4, sparse=True) for _ in range(2))
    theirs.load_state_dict(mine.state_dict())
    fast = RowSparseAdam(mine.parameters(), lr=0.05, betas=(0.8, 0.95), eps=1e-6, maximize=maximize)
    slow = torch.optim.SparseAdam(theirs.parameters(), lr=0.05, betas=(0.8, 0.95), eps=1e-6, maximize=maximize)
    for step in range(25):
        ids = torch.randint(0, 50, (2, 30), generator=g)  # repeats within a step: a row's lookups are summed
        weights = torch.randn(30, 4, generator=g)
        for tables, opt in ((mine, fast), (theirs, slow)):
            opt.zero_grad()
            used = [0] if step == 7 else [0, 1]  # step 7: table 1 has no gradient at all
            loss = sum((tables[t](ids[t]) * weights).sum() for t in used)
            if step == 12:  # table 1's gradient has no rows
                loss = loss + tables[1](torch.zeros(0, dtype=torch.int64)).sum()
            loss.backward()
            opt.step()
        for a, b in zip(mine.parameters(), theirs.parameters(), strict=True):
            assert torch.equal(a, b), step
    for a, b in zip(mine.parameters(), theirs.parameters(), strict=True):
        assert fast.state[a]["step"] == slow.state[b]["step"] == (25 if a is mine[0].weight else 24)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(fast.state[a][key], slow.state[b][key]) and fast.state[a][key].abs().sum() > 0
    swapped = torch.optim.SparseAdam(mine.parameters(), lr=0.05)
    swapped.load_state_dict(fast.state_dict())
    again = RowSparseAdam(theirs.parameters(), lr=0.05)
    again.load_state_dict(slow.state_dict())
    assert swapped.state_dict()["param_groups"] == again.state_dict()["param_groups"]
    with pytest.raises(RuntimeError, match="dense gradients"):
        dense = torch.nn.Parameter(torch.zeros(3))
        dense.grad = torch.ones(3)
        RowSparseAdam([dense], lr=0.1).step()
