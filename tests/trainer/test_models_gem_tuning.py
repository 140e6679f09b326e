"""GEM's training switches of issue 18's quality goal: the whole history's mean rows (``pooled_history``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from sequences.schema import SPARSE_FEATURES
from trainer.config import GemConfig, TrainerConfig
from trainer.data import encode_examples, fit_normalizer, make_batch
from trainer.models import build_model
from trainer.models.gem import segment_mean

SMALL = TrainerConfig(embedding_dim=8, num_embeddings=1000, hidden_dims=(16, 8), tower_hidden=4,
                      gem=GemConfig(preset="gem_small", max_sequence_len=2, fm_outputs=4, lcb_outputs=4, fm_rank=4,
                                    target_match=False, deep_weight_decay=0.0))
"""The switches of this file without the target-match counts (tests/trainer/test_target_match.py has those) and
without the deep weight decay (its own test sets it), so a zero gradient leaves a parameter where it is."""


@pytest.fixture(scope="module")
def encoded():
    from tests.trainer.conftest import synthetic_examples

    table = synthetic_examples(["2026-01-01"], 40, 5)
    return table, encode_examples(table, SMALL.num_embeddings, fit_normalizer(table))


def test_segment_mean_hand_case():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    # Rows of 2, 0 and 1 values: the mean of the first two, zeros for the empty row, the third as it is.
    out = segment_mean(values, torch.tensor([0, 2, 2, 3]))
    assert out.tolist() == [[2.0, 3.0], [0.0, 0.0], [5.0, 6.0]]
    assert segment_mean(values[:0], torch.tensor([0, 0])).tolist() == [[0.0, 0.0]]


@pytest.mark.parametrize("pooled", [False, True])
def test_pooled_history_reads_events_older_than_the_sequence_window(pooled, encoded):
    """With max_sequence_len 2 the attention sees each row's 2 newest events; the whole history's mean rows reach
    the oldest ones too: the table row of an event older than the window gets a gradient only with the switch on."""
    table, data = encoded
    lengths = np.array(table["seq_length"].to_pylist())
    row = int(np.argmax(lengths))
    assert lengths[row] > 2
    torch.manual_seed(0)
    model = build_model(replace(SMALL, gem=replace(SMALL.gem, pooled_history=pooled)), 3, ("feed", "reels"))
    batch = make_batch(data, np.array([row, int(np.argmin(lengths))]))
    assert batch.sequence["seq_item_ids"].lengths().tolist()[1] == 0  # an empty history beside it
    logits = model(batch.sparse, batch.sequence, batch.dense, torch.tensor([0, 1]))
    assert logits.shape == (2, 2) and torch.isfinite(logits).all()
    logits.sum().backward()
    items = batch.sequence["seq_item_ids"].values()
    newest, older = set(items[-2:].tolist()), set(items[:-2].tolist())
    only_old = sorted(older - newest - set(batch.sparse["item_id"].values().tolist()))
    assert only_old, "the row needs an old event whose item is not also among the newest two or the candidate"
    grad = model.sparse_arch.sequence.embeddings["t_item"].weight.grad
    grad = grad.to_dense() if grad.is_sparse else grad
    assert bool((grad[only_old].abs().sum(dim=1) > 0).all()) is pooled
    inputs = model.dense_arch.interformer.interaction_arch[0].num_inputs
    # The sparse features, the 3 history keys' means with the switch, 2 dense tokens, the 2 summary tokens.
    assert inputs == len(SPARSE_FEATURES) + 3 * pooled + 2 + 2


def test_gem_learning_rates_replace_the_trainers_for_gem_only():
    from trainer.loop import local_engine

    tc = TrainerConfig(learning_rate=3e-3, embedding_learning_rate=None,
                       gem=GemConfig(learning_rate=1e-3, embedding_learning_rate=1e-2))
    assert (tc.dense_learning_rate, tc.table_learning_rate) == (1e-3, 1e-2)
    dlrm = replace(tc, model="dlrm")
    assert (dlrm.dense_learning_rate, dlrm.table_learning_rate) == (3e-3, 3e-3)
    unset = TrainerConfig(learning_rate=2e-3, embedding_learning_rate=5e-3, gem=GemConfig(learning_rate=None))
    assert (unset.dense_learning_rate, unset.table_learning_rate) == (2e-3, 5e-3)
    # GEM's dense part defaults to a third of the trainer's default rate (README "Comparing models").
    assert (TrainerConfig().dense_learning_rate, TrainerConfig().table_learning_rate) == (1e-3, 3e-3)
    torch.manual_seed(0)
    engine = local_engine(replace(SMALL, gem=replace(SMALL.gem, learning_rate=1e-3, embedding_learning_rate=1e-2)),
                          3, ("feed",), None)
    assert engine.optimizers["dense"].param_groups[0]["lr"] == 1e-3
    assert engine.optimizers["embeddings"].param_groups[0]["lr"] == 1e-2
    with pytest.raises(ValueError, match=r"trainer.gem.learning_rate must be > 0 or none"):
        GemConfig(learning_rate=0.0)


def test_gem_table_optimizer_replaces_the_trainers_for_gem_only():
    from gemline.config import load_config
    from trainer.loop import local_engine
    from trainer.sparse_optim import RowWiseAdagrad

    tc = load_config(overrides={"trainer.gem.embedding_optimizer": "adagrad"}).trainer
    assert tc.embedding_optimizer == "rowwise_adagrad" and tc.table_optimizer == "adagrad"
    assert replace(tc, model="dlrm").table_optimizer == "rowwise_adagrad"
    unset = load_config(overrides={"trainer.embedding_optimizer": "adagrad", "trainer.gem.embedding_optimizer": "none"})
    assert unset.trainer.table_optimizer == "adagrad"
    torch.manual_seed(0)
    gem = local_engine(replace(SMALL, gem=replace(SMALL.gem, embedding_optimizer="adagrad")), 3, ("feed",), None)
    assert type(gem.optimizers["embeddings"]) is torch.optim.Adagrad
    dlrm = local_engine(replace(SMALL, model="dlrm", gem=replace(SMALL.gem, embedding_optimizer="adagrad")), 3, ("feed",), None)
    assert type(dlrm.optimizers["embeddings"]) is RowWiseAdagrad
    with pytest.raises(ValueError, match=r"trainer.gem.embedding_optimizer must be one of"):
        GemConfig(embedding_optimizer="sgd")  # type: ignore[arg-type]


def test_the_tuning_switches_are_ablations_of_compare():
    from gemline.errors import BadConfigError
    from trainer.compare import ablated_config

    # The default GEM has its own dense rate: the ablation puts it back on trainer.learning_rate.
    assert ablated_config(TrainerConfig(), "gem_learning_rate").dense_learning_rate == TrainerConfig().learning_rate
    pooled = TrainerConfig(gem=GemConfig(pooled_history=True))
    assert ablated_config(pooled, "pooled_history").gem.resolved() == TrainerConfig().gem.resolved()
    with pytest.raises(BadConfigError, match="ablation 'pooled_history'.*changes nothing"):
        ablated_config(TrainerConfig(), "pooled_history")


def test_compare_max_versions_screens_the_first_versions_only(tmp_path):
    """``compare --max-versions N``: every model consumes the first N versions and is judged on the N - 1 after the
    first (here Delta versions 0-2 hold the three days: version 1 is judged, version 2 is never read)."""
    from gemline.lake import Lake
    from tests.trainer.conftest import three_day_compare_config
    from trainer.compare import run_compare

    config = three_day_compare_config(tmp_path / "lake", batch_size=32)
    with pytest.raises(ValueError, match="max_versions must be >= 2"):
        run_compare(Lake.for_config(config), config.trainer, models=("lr",), max_versions=1)
    result = run_compare(Lake.for_config(config), config.trainer, models=("lr",), run_id="screen", resamples=10,
                         max_versions=2)
    assert result.versions == [1]
    assert [r["rows"] for r in result.rows if r["task"] == "click"] == [40]


@pytest.mark.parametrize("preset", ["gem_small", "gem_cpu"])
def test_wide_part_adds_a_linear_term_on_the_dense_features(preset, encoded):
    """Wide & Deep: with ``wide`` the logits are the deep part's plus W·dense + b per task; W and b start at zero, so
    the untrained model scores as the same deep part without it."""
    _, data = encoded
    gem = replace(SMALL.gem, preset=preset, max_sequence_len=4, recency_branches=(2, 0) if preset == "gem_cpu" else None,
                  attention_len=2)
    rows = np.arange(6)
    batch = make_batch(data, rows)
    domains = torch.tensor([0, 1, 0, 1, 0, 1])
    torch.manual_seed(0)
    deep = build_model(replace(SMALL, gem=replace(gem, wide=False)), data.dense.shape[1], ("feed", "reels")).eval()
    torch.manual_seed(0)
    wide = build_model(replace(SMALL, gem=replace(gem, wide=True)), data.dense.shape[1], ("feed", "reels")).eval()
    with torch.no_grad():
        before = wide(batch.sparse, batch.sequence, batch.dense, domains)
        assert torch.equal(before, deep(batch.sparse, batch.sequence, batch.dense, domains))
        weight = torch.tensor([[0.5, -1.0, 2.0], [0.0, 0.25, -0.5]])
        wide.dense_arch.wide.weight.copy_(weight)
        wide.dense_arch.wide.bias.copy_(torch.tensor([0.1, -0.2]))
        after = wide(batch.sparse, batch.sequence, batch.dense, domains)
    dense = batch.dense.double().numpy()
    expected = dense @ weight.double().numpy().T + np.array([0.1, -0.2])
    np.testing.assert_allclose((after - before).double().numpy(), expected, rtol=1e-5, atol=1e-5)
    assert "wide.weight" in {n.split("dense_arch.")[-1] for n, _ in wide.named_parameters()}
    # The wide part draws nothing from the RNG: every other parameter is the deep model's, value for value.
    deep_state = deep.state_dict()
    assert all(torch.equal(v, deep_state[k]) for k, v in wide.state_dict().items() if ".wide." not in k)
    assert any(p is wide.dense_arch.wide.weight for p in wide.dense_parameters())


def test_wide_part_trains_at_its_own_rate():
    from gemline.errors import BadConfigError
    from trainer.loop import local_engine

    torch.manual_seed(0)
    engine = local_engine(replace(SMALL, learning_rate=3e-3, gem=replace(SMALL.gem, learning_rate=1e-3, wide=True)),
                          3, ("feed",), None)
    deep, wide = engine.optimizers["dense"].param_groups
    assert (deep["lr"], wide["lr"]) == (1e-3, 3e-3)  # the wide part at the LR baseline's rate by default
    linear = engine.model.dense_arch.wide
    assert [p.shape for p in wide["params"]] == [(2, 3), (2,)]
    assert wide["params"][0] is linear.weight and not any(p is linear.weight for p in deep["params"])
    assert GemConfig().wide  # on by default (README "GEM's wide part")
    own = local_engine(replace(SMALL, gem=replace(SMALL.gem, wide=True, wide_learning_rate=5e-4)), 3, ("feed",), None)
    assert own.optimizers["dense"].param_groups[1]["lr"] == 5e-4
    # Without the wide part (and for DLRM) one group, as before.
    deep_only = replace(SMALL, gem=replace(SMALL.gem, wide=False))
    assert len(local_engine(deep_only, 3, ("feed",), None).optimizers["dense"].param_groups) == 1
    assert len(local_engine(replace(SMALL, model="dlrm"), 3, ("feed",), None).optimizers["dense"].param_groups) == 1
    with pytest.raises(BadConfigError, match="trainer.gem.wide_learning_rate must be > 0"):
        GemConfig(wide_learning_rate=0.0)


@pytest.mark.parametrize("preset", ["gem_small", "gem_cpu"])
def test_full_wide_part_is_lrs_linear_model(preset, encoded):
    """``wide = "full"``: the logits are the deep part's plus LR's linear model, a weight per sparse id and per
    mean-pooled history key, the dense term and a domain bias. At zero it is the deep model exactly (same parameters
    under the same seed); with every row of each id table set to one known pair the added logit is, per row, the sum
    of the sparse features' pairs, each non-empty history key's pair (a mean of equal rows; a sum would scale it
    by the length), the domain's bias and W·dense + b."""
    table, data = encoded
    gem = replace(SMALL.gem, preset=preset, max_sequence_len=4, recency_branches=(2, 0) if preset == "gem_cpu" else None,
                  attention_len=2)
    batch = make_batch(data, np.array([0, 1, 2, 3, 4, int(np.argmin(table["seq_length"].to_pylist()))]))
    domains = torch.tensor([0, 1, 2, 1, 0, 2])  # 2: unknown (K = 2 known domains)
    torch.manual_seed(0)
    deep = build_model(replace(SMALL, gem=replace(gem, wide=False)), data.dense.shape[1], ("feed", "reels")).eval()
    torch.manual_seed(0)
    full = build_model(replace(SMALL, gem=replace(gem, wide="full")), data.dense.shape[1], ("feed", "reels")).eval()
    deep_state, full_state = deep.state_dict(), full.state_dict()
    assert all(torch.equal(v, full_state[k]) for k, v in deep_state.items())
    tables = full.sparse_arch.wide.embedding_bags
    assert sorted(tables) == sorted([f"t_{name}" for name in SPARSE_FEATURES] + ["t_seq_item_ids", "t_seq_categories",
                                                                                   "t_seq_event_types"])
    assert all(t.weight.shape == (SMALL.num_embeddings, 2) for t in tables.values())
    assert max(float(t.weight.detach().abs().max()) for t in tables.values()) <= 0.01  # LR's near-zero start
    assert full.dense_arch.wide_bias.weight.shape == (3, 2) and not full.dense_arch.wide_bias.weight.any()
    found = full.sparse_arch(batch.sparse, batch.sequence)
    assert found.wide is not None and found.wide.shape == (6, 2) and found.wide.dtype == torch.float32
    pairs = {name: (0.1 * (i + 1), -0.05 * (i + 1)) for i, name in enumerate(sorted(tables))}
    weight = torch.tensor([[0.5, -1.0, 2.0], [0.0, 0.25, -0.5]])
    bias = torch.tensor([[0.3, 0.0], [-0.4, 0.1], [0.0, 0.7]])
    with torch.no_grad():
        for t in tables.values():
            t.weight.zero_()
        zero = full(batch.sparse, batch.sequence, batch.dense, domains)
        assert torch.equal(zero, deep(batch.sparse, batch.sequence, batch.dense, domains))
        for name, t in tables.items():
            t.weight.copy_(torch.tensor(pairs[name]).expand_as(t.weight))
        full.dense_arch.wide.weight.copy_(weight)
        full.dense_arch.wide_bias.weight.copy_(bias)
        after = full(batch.sparse, batch.sequence, batch.dense, domains)
    ids = sum(np.array(pairs[f"t_{name}"]) for name in SPARSE_FEATURES)
    nonempty = (batch.sequence["seq_item_ids"].lengths() > 0).numpy()
    assert nonempty.any() and not nonempty.all(), "the hand case needs an empty and a non-empty history"
    history = sum(np.array(pairs[t]) for t in ("t_seq_item_ids", "t_seq_categories", "t_seq_event_types"))
    expected = (ids + nonempty[:, None] * history + bias.numpy()[domains.numpy()]
                + batch.dense.double().numpy() @ weight.double().numpy().T)
    np.testing.assert_allclose((after - zero).double().numpy(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match='wide = "full".*pass wide_ids'):
        full.dense_arch(found.pooled, found.values, found.offsets, found.target, batch.dense, domains,
                        found.same_values, found.same_offsets, found.history_means)


def test_full_wide_part_trains_at_lrs_rates(encoded):
    """The id tables go to the table optimiser (LR's rule and rate under the defaults), the dense term and the
    domain bias to Adam at the wide rate (LR's ``trainer.learning_rate``), the deep part at GEM's own; one step
    moves the rows of the batch's ids and no other row."""
    from trainer.loop import local_engine

    torch.manual_seed(0)
    tc = replace(SMALL, learning_rate=3e-3, gem=replace(SMALL.gem, learning_rate=1e-3, wide="full"))
    engine = local_engine(tc, 3, ("feed",), None)
    deep, wide = engine.optimizers["dense"].param_groups
    arch = engine.model.dense_arch
    assert (deep["lr"], wide["lr"]) == (1e-3, 3e-3)
    assert [id(p) for p in wide["params"]] == [id(arch.wide.weight), id(arch.wide.bias), id(arch.wide_bias.weight)]
    tables = {id(p) for p in engine.model.sparse_arch.wide.parameters()}
    table_params = [p for g in engine.optimizers["embeddings"].param_groups for p in g["params"]]
    assert tables <= {id(p) for p in table_params}
    lr = local_engine(replace(tc, model="lr"), 3, ("feed",), None).optimizers["embeddings"]
    assert type(lr) is type(engine.optimizers["embeddings"])
    assert lr.param_groups[0]["lr"] == engine.optimizers["embeddings"].param_groups[0]["lr"] == 3e-3
    _, data = encoded
    item = engine.model.sparse_arch.wide.embedding_bags["t_item_id"].weight
    before, bias = item.detach().clone(), arch.wide_bias.weight.detach().clone()
    rows = np.arange(8)
    engine.train_step(data, rows)
    seen = torch.unique(make_batch(data, rows).sparse["item_id"].values())
    moved = (item.detach() != before).any(dim=1)
    assert bool(moved[seen].all()) and int(moved.sum()) == len(seen)
    assert not torch.equal(arch.wide_bias.weight.detach(), bias)


@pytest.mark.parametrize(("value", "expected"), [("full", "full"), ("dense", "dense"), ("true", "dense"), ("false", None)])
def test_wide_setting_parses(value, expected):
    from gemline.config import load_config

    assert load_config(overrides={"trainer.gem.wide": value}).trainer.gem.wide_mode == expected
    assert GemConfig().wide_mode == "dense"  # the default: the dense term alone (README "GEM's wide part")


def test_wide_setting_errors():
    from gemline.config import load_config
    from gemline.errors import BadConfigError
    from trainer.distributed import build_shardable_model

    with pytest.raises(BadConfigError, match="trainer.gem.wide: expected 'dense' or 'full' or bool, got 'fully'"):
        load_config(overrides={"trainer.gem.wide": "fully"})
    with pytest.raises(BadConfigError, match=r"trainer.gem.wide must be one of \('dense', 'full'\), true or false, got 'ful'"):
        GemConfig(wide="ful")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match='--nproc > 1 does not shard trainer.gem.wide = "full"'):
        build_shardable_model(replace(SMALL, gem=replace(SMALL.gem, wide="full")), 3, ("feed",))
    assert build_shardable_model(replace(SMALL, gem=replace(SMALL.gem, wide="dense")), 3, ("feed",)) is not None


@pytest.mark.parametrize("wide", ["dense", "full"])
def test_deep_gate_at_zero_is_the_wide_part(wide, encoded):
    """``deep_gate``: logits = gate * deep + wide, the gate (2,) from zero. Untrained, the logits are the wide part's
    alone: W·dense + b with b at the base rates' log-odds (the towers' output bias left at 0); with the gate at 1 they
    are the ungated model's (same seed, the gate draws nothing), and at (0.5, 2) each task's deep logit is scaled."""
    _, data = encoded
    batch = make_batch(data, np.arange(6))
    domains = torch.tensor([0, 1, 2, 1, 0, 2])
    gem = replace(SMALL.gem, wide=wide)
    torch.manual_seed(0)
    plain = build_model(replace(SMALL, gem=gem), data.dense.shape[1], ("feed", "reels")).eval()
    torch.manual_seed(0)
    gated = build_model(replace(SMALL, gem=replace(gem, deep_gate=True)), data.dense.shape[1], ("feed", "reels")).eval()
    rates = torch.tensor([0.2, 0.05], dtype=torch.float64)
    gated.init_output_bias(rates)
    arch = gated.dense_arch
    assert arch.deep_gate is not None and arch.deep_gate.tolist() == [0.0, 0.0]
    weight = torch.tensor([[0.5, -1.0, 2.0], [0.0, 0.25, -0.5]])
    with torch.no_grad():
        arch.wide.weight.copy_(weight)
        zero = gated(batch.sparse, batch.sequence, batch.dense, domains)
    expected = batch.dense.double().numpy() @ weight.double().numpy().T + np.log([0.2 / 0.8, 0.05 / 0.95])
    if wide == "full":  # LR's id weights (near-zero start) are part of the wide part: add what they give
        ids = gated.sparse_arch(batch.sparse, batch.sequence).wide
        assert ids is not None and bool(ids.abs().sum() > 0)
        expected = expected + ids.detach().double().numpy()
    np.testing.assert_allclose(zero.double().numpy(), expected, rtol=1e-5, atol=1e-6)
    assert not arch.towers.shared[-1].bias.any()  # the intercept sits outside the gate
    with torch.no_grad():
        plain.load_state_dict({k: v for k, v in gated.state_dict().items() if k != "dense_arch.deep_gate"})
        arch.deep_gate.fill_(1.0)
        assert torch.equal(gated(batch.sparse, batch.sequence, batch.dense, domains),
                           plain(batch.sparse, batch.sequence, batch.dense, domains))
        arch.deep_gate.copy_(torch.tensor([0.5, 2.0]))
        scaled = gated(batch.sparse, batch.sequence, batch.dense, domains)
        deep = plain(batch.sparse, batch.sequence, batch.dense, domains) - zero
    np.testing.assert_allclose((scaled - zero).numpy(), (deep * torch.tensor([0.5, 2.0])).numpy(), rtol=1e-5, atol=1e-6)


def test_deep_gate_trains_with_the_wide_part(encoded):
    """The gate is in the wide part's Adam group; one step from zero moves the gate and the wide part, not yet the
    deep part's parameters (their gradient is the gate times theirs: zero)."""
    from trainer.loop import local_engine

    torch.manual_seed(0)
    tc = replace(SMALL, learning_rate=3e-3, gem=replace(SMALL.gem, learning_rate=1e-3, deep_gate=True))
    engine = local_engine(tc, 3, ("feed",), torch.tensor([0.3, 0.1], dtype=torch.float64))
    arch = engine.model.dense_arch
    deep, wide = engine.optimizers["dense"].param_groups
    assert (deep["lr"], wide["lr"]) == (1e-3, 3e-3)
    assert sorted(id(p) for p in wide["params"]) == sorted([id(arch.wide.weight), id(arch.wide.bias), id(arch.deep_gate)])
    backbone = [p.detach().clone() for p in arch.backbone.parameters()]
    _, data = encoded
    engine.train_step(data, np.arange(8))
    assert bool((arch.deep_gate.detach().abs() > 0).all())
    assert all(torch.equal(p.detach(), b) for p, b in zip(arch.backbone.parameters(), backbone, strict=True))
    engine.train_step(data, np.arange(8, 16))  # the gate is open now: the deep part moves
    assert not all(torch.equal(p.detach(), b) for p, b in zip(arch.backbone.parameters(), backbone, strict=True))


def test_deep_gate_setting_errors(tmp_path):
    from gemline.errors import BadConfigError
    from trainer.checkpoint import TrainState, load_checkpoint, save_checkpoint

    with pytest.raises(BadConfigError, match="trainer.gem.deep_gate needs trainer.gem.wide"):
        GemConfig(wide=False, deep_gate=True)
    assert GemConfig().deep_gate is False
    torch.manual_seed(0)
    ungated = build_model(SMALL, 3, ("feed",))
    gated = build_model(replace(SMALL, gem=replace(SMALL.gem, deep_gate=True)), 3, ("feed",))
    path = save_checkpoint(tmp_path / "a", TrainState(step=1, examples_seen=0, examples_version=0), ungated, {})
    with pytest.raises(BadConfigError, match=r"lacks \(dense_arch\.deep_gate\).*--set trainer\.gem\.deep_gate=false\)"):
        load_checkpoint(path, gated, {})
    path = save_checkpoint(tmp_path / "b", TrainState(step=1, examples_seen=0, examples_version=0), gated, {})
    with pytest.raises(BadConfigError, match=r"--set trainer\.gem\.deep_gate=true\)"):
        load_checkpoint(path, ungated, {})


def test_deep_weight_decay_reaches_the_deep_group_of_gem_only():
    from trainer.loop import local_engine

    with pytest.raises(ValueError, match="deep_weight_decay must be >= 0"):
        GemConfig(deep_weight_decay=-1e-3)
    tc = replace(SMALL, gem=replace(SMALL.gem, deep_weight_decay=1e-2))
    torch.manual_seed(0)
    deep, wide = local_engine(tc, 3, ("feed",), None).optimizers["dense"].param_groups
    assert (deep["weight_decay"], wide["weight_decay"]) == (1e-2, 0)  # the wide part is not decayed
    assert replace(tc, model="dlrm").dense_weight_decay == 0.0 and TrainerConfig(model="lr").dense_weight_decay == 0.0
    assert TrainerConfig().dense_weight_decay == 0.01  # GEM's default


OWN = replace(SMALL, gem=replace(SMALL.gem, wide="full", wide_loss="own"))
"""GEM whose wide part (LR's linear model) trains on its own loss, the deep part on the residual."""


def _lr_and_own_gem(tc, num_dense, domains, rates):
    """LR and the "own" GEM, each built as a run builds it (the seed, then the engine)."""
    from trainer.loop import local_engine

    torch.manual_seed(tc.seed)
    lr = local_engine(replace(tc, model="lr"), num_dense, domains, rates)
    torch.manual_seed(tc.seed)
    return lr, local_engine(tc, num_dense, domains, rates)


def _wide_state(gem) -> dict[str, torch.Tensor]:
    """GEM's wide part under LR's parameter names (trainer.models.baselines.LogisticRegression)."""
    arch = gem.dense_arch
    state = {f"sparse_arch.{k}": v for k, v in gem.sparse_arch.wide.state_dict().items()}
    return state | {"dense_arch.linear.weight": arch.wide.weight, "dense_arch.linear.bias": arch.wide.bias,
                    "dense_arch.domain_bias.weight": arch.wide_bias.weight}


def test_own_wide_loss_trains_the_wide_part_as_lr(encoded):
    """``wide_loss = "own"``: built under the same seed, GEM's wide part is the LR baseline weight for weight, and
    after 4 steps on the same batches it still is, bit for bit, although the deep part trains beside it (its
    gradient does not reach the wide part); the deep part moves. With the deep part's output held at 0 (the towers'
    last layers zeroed) GEM's predictions are LR's, bit for bit."""
    table, data = encoded
    rates = torch.tensor([0.3, 0.1], dtype=torch.float64)
    lr, gem = _lr_and_own_gem(OWN, data.dense.shape[1], ("feed", "reels"), rates)
    assert set(_wide_state(gem.model)) == set(lr.model.state_dict())
    start = {k: v.clone() for k, v in lr.model.state_dict().items()}
    assert all(torch.equal(v, start[k]) for k, v in _wide_state(gem.model).items())
    # Intercepts: LR's domain bias at the base rates' log-odds in every row, the towers' output bias at 0.
    assert torch.allclose(gem.model.dense_arch.wide_bias.weight, torch.logit(rates).float().expand(3, 2))
    assert not gem.model.dense_arch.towers.shared[-1].bias.any()
    backbone = [p.detach().clone() for p in gem.model.dense_arch.backbone.parameters()]
    for step in range(4):
        rows = np.arange(8 * step, 8 * step + 8)
        lr.train_step(data, rows)
        gem.train_step(data, rows)
    trained = lr.model.state_dict()
    assert not all(torch.equal(v, start[k]) for k, v in trained.items())  # LR did move
    assert all(torch.equal(v, trained[k]) for k, v in _wide_state(gem.model).items())
    assert not all(torch.equal(p.detach(), b) for p, b in zip(gem.model.dense_arch.backbone.parameters(), backbone, strict=True))
    # Deep output held at 0: GEM predicts as LR (its logits are LR's plus 0).
    from trainer.loop import predict

    towers = gem.model.dense_arch.towers
    with torch.no_grad():
        for p in (towers.shared[-1].weight, towers.shared[-1].bias, towers.w2, towers.b2):
            p.zero_()
    np.testing.assert_array_equal(predict(gem.model, data, 16), predict(lr.model, data, 16))


def test_own_wide_loss_gradients(encoded):
    """One backward of the "own" losses: the wide part's gradient is that of LR's loss on the wide logits alone, the
    deep part's that of the loss of the summed logits (the prediction) with the wide part fixed; the reported loss is
    the prediction's."""
    from trainer.labels import loss_terms
    from trainer.loop import prepare_batch, train_step, training_logits

    _, data = encoded
    torch.manual_seed(0)
    gem = build_model(OWN, data.dense.shape[1], ("feed", "reels"))
    gem.init_output_bias(torch.tensor([0.3, 0.1], dtype=torch.float64))
    prepared = prepare_batch(gem, make_batch(data, np.arange(12)))
    rows = prepared.batch
    pred, wide = training_logits(gem, prepared)
    with torch.no_grad():
        assert torch.equal(pred, gem(rows.sparse, rows.sequence, rows.dense, prepared.domain_ids))

    def loss_of(logits):
        return loss_terms(logits, rows.labels, rows.delayed, rows.final, (1.0, 1.0)).mean(dim=0).sum()

    def grads(loss, params):
        return torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)

    wide_params = [gem.dense_arch.wide.weight, gem.dense_arch.wide_bias.weight]
    deep_params = list(gem.dense_arch.backbone.parameters())
    _, wide_again = training_logits(gem, prepared)
    alone = grads(loss_of(wide_again), wide_params)
    both = loss_of(pred) + loss_of(wide)
    assert all(torch.equal(a, b) for a, b in zip(grads(both, wide_params), alone, strict=True))
    # The deep part's gradient: the prediction's loss with the wide logits a constant.
    pred_again, _ = training_logits(gem, prepared)
    deep_alone = grads(loss_of(pred_again), deep_params)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(grads(both, deep_params), deep_alone, strict=True))
    assert any(bool(g.abs().sum() > 0) for g in deep_alone)
    # The prediction's loss reaches no wide parameter: the residual's gradient stops at the detached wide logits.
    assert grads(loss_of(pred_again), wide_params) == (None, None)
    reported = train_step(gem, {}, prepared)
    assert reported == pytest.approx(float(loss_of(pred).detach()), rel=1e-6)


def test_deep_shrinkage_scales_the_deep_logits(encoded):
    """``deep_shrinkage`` nu: the logits are wide + nu * deep, in training (the residual's loss) and prediction."""
    _, data = encoded
    batch = make_batch(data, np.arange(6))
    domains = torch.tensor([0, 1, 0, 1, 0, 1])
    torch.manual_seed(0)
    plain = build_model(OWN, data.dense.shape[1], ("feed", "reels")).eval()
    torch.manual_seed(0)
    shrunk = build_model(replace(OWN, gem=replace(OWN.gem, deep_shrinkage=0.25)), data.dense.shape[1],
                         ("feed", "reels")).eval()
    with torch.no_grad():
        found = plain.sparse_arch(batch.sparse, batch.sequence)
        deep, wide = plain.dense_arch(found.pooled, found.values, found.offsets, found.target, batch.dense, domains,
                                      wide_ids=found.wide, parts=True)
        assert bool(deep.abs().sum() > 0)
        np.testing.assert_allclose(shrunk(batch.sparse, batch.sequence, batch.dense, domains).numpy(),
                                   (wide + 0.25 * deep).numpy(), rtol=1e-6, atol=1e-6)
        first, second = shrunk.training_logits(batch.sparse, batch.sequence, batch.dense, domains)
        np.testing.assert_allclose(first.numpy(), (wide + 0.25 * deep).numpy(), rtol=1e-6, atol=1e-6)
        assert torch.equal(second, wide)


def test_wide_loss_setting_errors():
    from gemline.config import load_config
    from gemline.errors import BadConfigError
    from trainer.compare import ablated_config

    assert GemConfig().wide_loss == "joint" and GemConfig().deep_shrinkage == 1.0  # off by default
    assert load_config(overrides={"trainer.gem.wide": "full", "trainer.gem.wide_loss": "own"}).trainer.gem.wide_loss == "own"
    with pytest.raises(BadConfigError, match=r'wide_loss = "own" trains LR inside GEM: it needs trainer.gem.wide=full'):
        GemConfig(wide_loss="own")
    with pytest.raises(BadConfigError, match="no deep gate"):
        GemConfig(wide="full", wide_loss="own", deep_gate=True)
    with pytest.raises(BadConfigError, match=r"wide_loss must be one of \('joint', 'own'\)"):
        GemConfig(wide_loss="mine")  # type: ignore[arg-type]
    for bad in (0.0, 1.5):
        with pytest.raises(BadConfigError, match=r"deep_shrinkage must be in \(0, 1\]"):
            GemConfig(deep_shrinkage=bad)
    # compare --ablate wide_loss: the same GEM trained jointly; --ablate wide drops the wide part and its loss.
    assert ablated_config(OWN, "wide_loss").gem.wide_loss == "joint"
    assert ablated_config(OWN, "wide").gem.wide_mode is None
    with pytest.raises(BadConfigError, match="ablation 'wide_loss'.*changes nothing"):
        ablated_config(TrainerConfig(), "wide_loss")
