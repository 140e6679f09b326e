"""GEM, DLRM and LR through build_model: shapes, both-direction InterFormer flow, per-domain
routing, and learning the synthetic examples (tests/trainer/conftest.py) to eval AUC > 0.6."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels.types import Jagged
from trainer.config import GemConfig, TrainerConfig
from trainer.data import encode_examples, fit_normalizer, iter_batches, make_batch
from trainer.metrics import auc
from trainer.models import build_model, encode_domains
from trainer.models.interformer import InterFormer
from trainer.models.towers import DomainTowers
from trainer.train import predict, train_step

SMALL = TrainerConfig(
    embedding_dim=8, num_embeddings=1000, batch_size=64, epochs=3, learning_rate=0.01, hidden_dims=(32, 16),
    tower_hidden=8, gem=GemConfig(preset="gem_cpu", fm_outputs=4, lcb_outputs=4, fm_rank=4, max_sequence_len=8),
)
MODELS = ("gem", "dlrm", "lr", "ranker")
LEARNING_RATE = {"lr": 0.05}
"""Logistic regression needs larger steps to fit in the test's 30 steps (at 0.01 its click AUC is 0.48; at 0.05, 0.77)."""


@pytest.fixture(scope="module")
def splits():
    from tests.trainer.conftest import synthetic_examples

    train_table = synthetic_examples(["2026-01-01", "2026-01-02"], 300, 7)
    eval_table = synthetic_examples(["2026-01-03"], 300, 8)
    normalizer = fit_normalizer(train_table)
    return encode_examples(train_table, SMALL.num_embeddings, normalizer), encode_examples(eval_table, SMALL.num_embeddings, normalizer)


@pytest.mark.parametrize("name", MODELS)
def test_shapes_dtypes_and_parameter_split(name, splits):
    train, _ = splits
    torch.manual_seed(0)
    model = build_model(replace(SMALL, model=name), 3, ("feed", "reels"))
    batch = make_batch(train, np.arange(40))
    ids = encode_domains(model.domains, batch.domains)
    assert ids.tolist()[:3] == [0, 1, 2]  # feed, reels, marketplace (unknown -> K = 2)
    logits = model(batch.sparse, batch.sequence, batch.dense, ids)
    assert logits.shape == (40, 2) and logits.dtype == torch.float32 and bool(torch.isfinite(logits).all())
    empty = np.flatnonzero(train.seq_offsets[1:] == train.seq_offsets[:-1])[:5]
    only_empty = make_batch(train, empty)
    assert bool(torch.isfinite(model(only_empty.sparse, only_empty.sequence, only_empty.dense, encode_domains(model.domains, only_empty.domains))).all())
    emb, dense = model.embedding_parameters(), model.dense_parameters()
    assert emb and dense and len(emb) + len(dense) == len(list(model.parameters()))
    if name != "ranker":
        assert {id(p) for p in model.sparse_arch.parameters()} == {id(p) for p in emb}
        assert {id(p) for p in model.dense_arch.parameters()} == {id(p) for p in dense}
        with pytest.raises(ValueError, match=r"domain_ids must be \(40,\) int64"):
            model(batch.sparse, batch.sequence, batch.dense, ids.to(torch.int32))
    with pytest.raises(ValueError, match=r"dense must be \(B, 3\), got \(40, 2\)"):
        model(batch.sparse, batch.sequence, batch.dense[:, :2], ids)


def test_build_model_rejects_bad_config():
    with pytest.raises(ValueError, match="trainer.model must be one of"):
        TrainerConfig(model="gbdt")
    with pytest.raises(ValueError, match="divisible by trainer.gem.heads=3"):
        TrainerConfig(embedding_dim=16, gem=GemConfig(heads=3))
    with pytest.raises(ValueError, match=r"trainer.gem.pyramid_ratio must be in \(0, 1\]"):
        GemConfig(pyramid_ratio=0.0)


FINGERPRINT = Path(__file__).parent / "data" / "gem_param_fingerprint.json"
FINGERPRINT_TRAINER = TrainerConfig(
    embedding_dim=12, num_embeddings=101, hidden_dims=(20, 10), tower_hidden=7,
    gem=GemConfig(preset="gem_small", layers=3, heads=3, pyramid_ratio=0.6, max_sequence_len=10, dense_tokens=3, fm_outputs=5, lcb_outputs=6,
                  fm_rank=4, wide=False, target_match=False),
)
"""Every [trainer.gem] knob of the gem_small preset (the model before issue 18) off its default (and distinct), so a
knob wired to the wrong argument changes a shape."""


def test_gem_config_builds_the_model_of_the_flat_fields():
    """GemModel(GemConfig) equals the model the flat trainer.gem_* fields built: the same parameter
    names and shapes, and under the same seed the same initial values (sums), so checkpoints of
    either load into the other and the parameter-init order is unchanged.

    ``data/gem_param_fingerprint.json`` was recorded from main before the change (its ``recorded_from``).
    """
    golden = json.loads(FINGERPRINT.read_text())["parameters"]
    torch.manual_seed(0)
    model = build_model(FINGERPRINT_TRAINER, 3, ("feed", "reels"))
    state = model.state_dict()
    assert list(state) == list(golden)
    assert {k: list(v.shape) for k, v in state.items()} == {k: shape for k, (shape, _, _) in golden.items()}
    for key, (_, total, abs_total) in golden.items():
        values = state[key].double()
        assert float(values.sum()) == pytest.approx(total, rel=1e-6, abs=1e-6), key
        assert float(values.abs().sum()) == pytest.approx(abs_total, rel=1e-6, abs=1e-6), key
    # Spot checks of what each knob sizes, so a failure above reads as the knob that broke.
    assert state["dense_arch.recency.weight"].shape == (10, 12)  # max_sequence_len x D
    assert state["dense_arch.dense_embed.2.weight"].shape == (3 * 12, 4 * 12)  # (dense_tokens x D, 4 D)
    assert len(model.dense_arch.interformer.sequence_arch.layers) == 3  # layers


def test_interformer_flows_both_ways():
    torch.manual_seed(0)
    block = InterFormer(num_inputs=3, dim=4, num_layers=2, heads=2, pyramid_ratio=0.5, num_fm_outputs=2, num_lcb_outputs=2, fm_rank=2, mlp_hidden=8)
    interaction = torch.randn(3, 3, 4, requires_grad=True)
    tokens = Jagged.from_lengths(torch.randn(6, 4, requires_grad=True), [4, 0, 2])
    target = torch.randn(3, 4)
    out, last_tokens, summary = block(interaction, tokens, target)
    assert out.shape == (3, 4, 4) and summary.shape == (3, 2, 4)
    assert last_tokens.offsets.tolist() == [0, 2, 2, 3]  # layer 1 keeps ceil([4, 0, 2] / 2)
    # Non-sequence -> sequence: the sequence arch's output depends on the interaction input.
    (grad_seq,) = torch.autograd.grad(last_tokens.values.sum(), interaction, retain_graph=True)
    assert grad_seq.abs().sum() > 0
    # Sequence -> non-sequence: the interaction arch's output depends on the history tokens.
    (grad_int,) = torch.autograd.grad(out.sum() * 0 + (out**2).sum(), tokens.values)
    assert grad_int[:4].abs().sum() > 0 and grad_int[4:].abs().sum() > 0


def test_domain_towers_route_by_domain():
    torch.manual_seed(0)
    towers = DomainTowers(4, 3, num_domains=2)
    with torch.no_grad():
        for p in (towers.w2, towers.b2):
            p.normal_()
    x = torch.randn(1, 4).expand(3, 4)  # the same row under domains 0, 1 and unknown (2)
    out = towers(x, torch.tensor([0, 1, 2]))
    shared = towers.shared(x[:1])
    own = [torch.relu(x[:1] @ towers.w1[k] + towers.b1[k]) @ towers.w2[k] + towers.b2[k] for k in range(2)]
    torch.testing.assert_close(out[0:1], shared + own[0])
    torch.testing.assert_close(out[1:2], shared + own[1])
    torch.testing.assert_close(out[2:3], shared)  # unknown domain: shared tower only
    # A domain's loss trains that domain's tower and no other.
    towers(x[:1], torch.tensor([1])).sum().backward()
    assert towers.w2.grad[0].abs().sum() == 0 and towers.w2.grad[1].abs().sum() > 0
    with pytest.raises(ValueError, match=r"domain_ids must be in \[0, 2\]"):
        towers(x, torch.tensor([0, 1, 3]))


@pytest.mark.parametrize("name", MODELS)
def test_model_learns_synthetic_examples(name, splits):
    train, evaluation = splits
    config = replace(SMALL, model=name, learning_rate=LEARNING_RATE.get(name, SMALL.learning_rate))
    torch.manual_seed(0)
    model = build_model(config, 3, ("feed", "marketplace", "reels"))
    optimizers = {
        "dense": torch.optim.Adam(model.dense_parameters(), lr=config.learning_rate),
        "embeddings": torch.optim.Adagrad(model.embedding_parameters(), lr=config.learning_rate),
    }
    rng = np.random.default_rng(0)
    losses = [train_step(model, optimizers, batch) for _ in range(config.epochs) for batch in iter_batches(train, config.batch_size, rng)]
    assert all(loss is not None and np.isfinite(loss) for loss in losses)
    probs = predict(model, evaluation, 128)
    click_auc = auc(evaluation.labels[:, 0], probs[:, 0])
    assert click_auc > 0.6, (name, click_auc)


def test_candidate_rides_along_with_the_history_lookup():
    """Hand-checked layout: B=2, histories [5, 6] and [] ; candidates item 7 / 8, category 3 / 4."""
    from torchrec import KeyedJaggedTensor

    from sequences.schema import SPARSE_FEATURES
    from trainer.data import SEQUENCE_KEYS
    from trainer.models.gem import with_candidate

    ids = {name: [11, 12] for name in SPARSE_FEATURES} | {"item_id": [7, 8], "category": [3, 4]}
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=list(SPARSE_FEATURES), values=torch.tensor([v for name in SPARSE_FEATURES for v in ids[name]]),
        lengths=torch.ones(2 * len(SPARSE_FEATURES), dtype=torch.int64),
    )
    history = {"seq_item_ids": [5, 6], "seq_categories": [1, 2], "seq_event_types": [9, 9]}
    sequence = KeyedJaggedTensor.from_lengths_sync(
        keys=list(SEQUENCE_KEYS), values=torch.tensor([v for key in SEQUENCE_KEYS for v in history[key]]),
        lengths=torch.tensor([2, 0] * len(SEQUENCE_KEYS)),
    )
    merged = with_candidate(sparse, sequence)
    assert merged.stride() == 4
    assert merged["seq_item_ids"].values().tolist() == [5, 6, 7, 8] and merged["seq_item_ids"].lengths().tolist() == [2, 0, 1, 1]
    assert merged["seq_categories"].values().tolist() == [1, 2, 3, 4]
    assert merged["seq_event_types"].values().tolist() == [9, 9] and merged["seq_event_types"].lengths().tolist() == [2, 0, 0, 0]
    one_row = KeyedJaggedTensor.from_lengths_sync(keys=list(SEQUENCE_KEYS), values=torch.tensor([5, 1, 9]), lengths=torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="sparse has B=2 rows but sequence has B=1"):
        with_candidate(sparse, one_row)


def test_gem_target_and_history_share_the_item_and_category_tables(splits):
    """The target-attention query is the candidate's rows of the same tables the history tokens come from."""
    train, _ = splits
    torch.manual_seed(0)
    model = build_model(replace(SMALL, model="gem"), 3, ("feed", "reels"))
    batch = make_batch(train, np.arange(16))
    pooled, values, offsets, target = model.sparse_arch(batch.sparse, batch.sequence)[:4]
    tables = model.sparse_arch.sequence.embeddings
    expected = tables["t_item"].weight[batch.sparse["item_id"].values()] + tables["t_category"].weight[batch.sparse["category"].values()]
    torch.testing.assert_close(target, expected)
    history = sum(tables[t].weight[batch.sequence[k].values()] for k, t in (("seq_item_ids", "t_item"), ("seq_categories", "t_category"), ("seq_event_types", "t_event_type")))
    # These synthetic examples have no seq_time_delta_ms: every event gets the unknown time bucket, row 0.
    torch.testing.assert_close(values, history + tables["t_time_delta"].weight[0])
    assert torch.equal(offsets, batch.sequence["seq_item_ids"].offsets()) and pooled.shape == (16, len(batch.sparse.keys()), SMALL.embedding_dim)


def test_logistic_regression_intercepts_start_at_the_base_rate_log_odds():
    from trainer.train import prior_rates

    model = build_model(replace(SMALL, model="lr"), 3, ("feed", "reels"))
    labels = np.array([[1, 0], [0, 0], [0, 1], [0, 0]], dtype=np.float32)  # click 1/4, conversion 1/4
    model.init_output_bias(prior_rates(labels))
    expected = torch.full((3, 2), float(np.log(0.25 / 0.75)))  # every domain row, unknown (K) included
    torch.testing.assert_close(model.dense_arch["domain_bias"].weight, expected)
    assert prior_rates(np.zeros((5, 2), dtype=np.float32)).tolist() == [1e-4, 1e-4]  # finite log-odds


@pytest.mark.parametrize(
    "rates", [torch.tensor([0.0, 0.5]), torch.tensor([0.5, 1.0]), torch.tensor([0.1, 0.2, 0.3]), torch.tensor([float("nan"), 0.1])]
)
def test_intercept_init_rejects_bad_rates(rates):
    model = build_model(replace(SMALL, model="lr"), 3, ("feed",))
    with pytest.raises(ValueError, match=r"base_rates must be \(2,\) rates in \(0, 1\)"):
        model.init_output_bias(rates)


@pytest.mark.parametrize(("name", "task_towers"), [("gem", True), ("gem", False), ("dlrm", None)])
def test_gem_and_dlrm_start_predicting_the_base_rates(name, task_towers, splits):
    """With the towers' inputs silenced (last backbone layer zero), the logits are the base rates' log-odds."""
    train, _ = splits
    config = replace(SMALL, model=name)
    if task_towers is not None:
        config = replace(config, gem=replace(SMALL.gem, task_towers=task_towers))
    model = build_model(config, 3, ("feed", "reels"))
    model.init_output_bias(torch.tensor([0.2, 0.05]))
    backbone = model.dense_arch.backbone if name == "gem" else model.dense_arch.top
    with torch.no_grad():
        backbone[-2].weight.zero_()  # the last Linear before the ReLU: towers see zeros + ReLU(bias)
        backbone[-2].bias.fill_(-1.0)  # ReLU(-1) = 0
        if name == "gem" and task_towers:
            for layer in model.dense_arch.task_layers:
                layer[0].bias.fill_(-1.0)
        towers = [m for m in model.modules() if isinstance(m, DomainTowers)]
        assert len(towers) == (2 if task_towers else 1)
        for tower in towers:  # a zero input leaves the shared tower's ReLU(b1): silence it too
            tower.shared[0].bias.fill_(-1.0)
    batch = make_batch(train, np.arange(12))
    logits = model(batch.sparse, batch.sequence, batch.dense, encode_domains(model.domains, batch.domains))
    expected = torch.tensor([np.log(0.2 / 0.8), np.log(0.05 / 0.95)], dtype=torch.float32).expand(12, 2)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


def test_a_narrow_table_reads_as_its_rows_zero_padded_to_the_model_width():
    from trainer.models.towers import pad_width

    narrow = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    padded = pad_width(narrow, 4)
    assert padded.tolist() == [[1.0, 2.0, 0.0, 0.0], [3.0, 4.0, 0.0, 0.0]]
    wide = torch.tensor([[0.5, -1.0, 7.0, 9.0]])
    assert (padded @ wide.T).tolist() == (narrow @ wide[:, :2].T).tolist()  # dot products see the narrow rows only
    assert pad_width(wide, 4) is wide
    with pytest.raises(ValueError, match="a table 4 wide is wider than the models' width 3"):
        pad_width(wide, 3)


GEM_DOMAINS = ("feed", "marketplace", "reels")


@pytest.mark.parametrize("preset", ["gem_small", "gem_cpu"])
def test_looking_up_only_the_newest_events_trains_as_the_whole_lookup(preset, splits):
    """SparseArch's ``history_len`` (the fast path) against its reference twin (``None``: every stored event looked
    up): equal logits, losses, parameters and optimiser states, to the bit, over steps of the one-process engine."""
    from trainer.loop import local_optimizers
    from trainer.models.gem import newest_ids

    train, _ = splits
    tc = replace(SMALL, gem=replace(SMALL.gem, preset=preset, max_sequence_len=3))
    batches = [make_batch(train, rows) for rows in np.array_split(np.arange(len(train)), 6)]
    cut = newest_ids(batches[0].sequence, 3)
    assert cut.values().numel() < batches[0].sequence.values().numel()  # some histories are longer than 3
    assert cut["seq_item_ids"].lengths().tolist() == batches[0].sequence["seq_item_ids"].lengths().clamp(max=3).tolist()
    engines = []
    for history_len in (3, None):
        torch.manual_seed(0)
        model = build_model(tc, train.dense.shape[1], GEM_DOMAINS)
        assert model.sparse_arch.history_len == 3
        model.sparse_arch.history_len = history_len
        engines.append((model, local_optimizers(tc, model)))
    for batch in batches:
        ids = encode_domains(GEM_DOMAINS, batch.domains)
        losses = [train_step(model, optimizers, batch) for model, optimizers in engines]
        assert losses[0] == losses[1]
        with torch.no_grad():
            fast, reference = (model(batch.sparse, batch.sequence, batch.dense, ids) for model, _ in engines)
        assert torch.equal(fast, reference)
    (fast_model, fast_opt), (ref_model, ref_opt) = engines
    for (name, a), (_, b) in zip(fast_model.state_dict().items(), ref_model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    for key in ("dense", "embeddings"):
        for a, b in zip(fast_opt[key].state.values(), ref_opt[key].state.values(), strict=True):
            assert all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k])), key
