"""GEM's target-match counts (``trainer.gem.target_match``): the candidate's item and category counted in the whole
stored history, a hand case and a reference twin on random jagged rows; the model's token and wide term."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from torchrec import KeyedJaggedTensor

from gemline.errors import BadConfigError
from trainer.config import GemConfig, TrainerConfig
from trainer.data import SEQUENCE_KEYS, encode_examples, fit_normalizer, make_batch
from trainer.models import build_model
from trainer.models.gem import target_matches

SMALL = TrainerConfig(embedding_dim=8, num_embeddings=1000, hidden_dims=(16, 8), tower_hidden=4,
                      gem=GemConfig(preset="gem_small", max_sequence_len=2, fm_outputs=4, lcb_outputs=4, fm_rank=4))


def _kjts(items: list[list[int]], categories: list[list[int]], candidate: list[tuple[int, int]]):
    lengths = [len(row) for row in items]
    values = [v for row in items for v in row] + [v for row in categories for v in row] + [2] * sum(lengths)
    sequence = KeyedJaggedTensor.from_lengths_sync(keys=list(SEQUENCE_KEYS), values=torch.tensor(values, dtype=torch.int64),
                                                   lengths=torch.tensor(lengths * 3, dtype=torch.int64))
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=["item_id", "category"], values=torch.tensor([c[0] for c in candidate] + [c[1] for c in candidate]),
        lengths=torch.ones(2 * len(candidate), dtype=torch.int64))
    return sparse, sequence


def test_target_matches_hand_case():
    """Row 0: item 5 twice, category 9 twice of 3 events; row 1: an empty history; row 2: the candidate's item is on
    the OOV row (1), which never matches, its category once of 2."""
    sparse, sequence = _kjts([[5, 7, 5], [], [1, 4]], [[9, 9, 3], [], [1, 8]], [(5, 9), (4, 9), (1, 8)])
    out = target_matches(sparse, sequence)
    assert out.dtype == torch.float32 and out.shape == (3, 3)
    expected = [[math.log1p(2), math.log1p(2), 2 / 3], [0.0, 0.0, 0.0], [0.0, math.log1p(1), 0.5]]
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6)


def test_target_matches_equal_a_loop_on_random_jagged_rows():
    """Reference twin: a Python loop over each row, on random rows with empty ones and one of the longest (256)."""
    rng = np.random.default_rng(0)
    lengths = [0, 256, *rng.integers(0, 12, size=30).tolist(), 0]
    items = [rng.integers(0, 6, size=n).tolist() for n in lengths]
    categories = [rng.integers(0, 4, size=n).tolist() for n in lengths]
    candidate = [(int(rng.integers(0, 6)), int(rng.integers(0, 4))) for _ in lengths]
    out = target_matches(*_kjts(items, categories, candidate)).numpy()
    for i, (row_items, row_categories, (item, category)) in enumerate(zip(items, categories, candidate, strict=True)):
        n_item = sum(v == item for v in row_items) if item >= 2 else 0
        n_category = sum(v == category for v in row_categories) if category >= 2 else 0
        want = [math.log1p(n_item), math.log1p(n_category), n_category / max(len(row_categories), 1)]
        np.testing.assert_allclose(out[i], want, rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def encoded():
    from tests.trainer.conftest import synthetic_examples

    table = synthetic_examples(["2026-01-01"], 40, 5)
    return table, encode_examples(table, SMALL.num_embeddings, fit_normalizer(table))


def test_the_models_wide_term_starts_at_zero_and_is_linear_in_the_counts(encoded):
    """The wide term's weight starts at 0 and trains with the wide part; set by hand, the logits move by exactly
    W·matches. The token reads the counts: changing a row's history changes its deep logits."""
    from trainer.models.gem import dense_param_groups

    _, data = encoded
    tc = replace(SMALL, gem=replace(SMALL.gem, target_match=True))
    torch.manual_seed(0)
    model = build_model(tc, data.dense.shape[1], ("feed", "reels")).eval()
    arch = model.dense_arch
    assert arch.match_wide is not None and torch.equal(arch.match_wide.weight, torch.zeros(2, 3))
    groups = dense_param_groups(tc, model.named_parameters())
    assert any(p is arch.match_wide.weight for p in groups[1]["params"]), "trained with the wide part"
    assert not any(p is arch.match_wide.weight for p in groups[0]["params"])
    batch = make_batch(data, np.arange(8))
    domains = torch.zeros(8, dtype=torch.int64)
    matches = target_matches(batch.sparse, batch.sequence)
    with torch.no_grad():
        before = model(batch.sparse, batch.sequence, batch.dense, domains)
        weight = torch.tensor([[1.0, -0.5, 2.0], [0.25, 0.0, -1.0]])
        arch.match_wide.weight.copy_(weight)
        after = model(batch.sparse, batch.sequence, batch.dense, domains)
    np.testing.assert_allclose((after - before).numpy(), (matches @ weight.T).numpy(), rtol=1e-5, atol=1e-6)
    assert arch.match_embed is not None and arch.match_embed[0].in_features == 3


def test_target_match_settings_and_refusals(tmp_path):
    from trainer.checkpoint import TrainState, load_checkpoint, save_checkpoint
    from trainer.compare import ablated_config

    assert GemConfig().target_match is True and GemConfig().deep_weight_decay == 0.01, "the defaults measured together"
    own = build_model(replace(SMALL, gem=replace(SMALL.gem, wide="full", wide_loss="own", target_match=True)), 3, ("feed",))
    assert own.dense_arch.match_wide is None and own.dense_arch.match_embed is not None, "the wide part stays LR's"
    off = replace(SMALL, gem=replace(SMALL.gem, target_match=False))
    with pytest.raises(BadConfigError, match="changes nothing"):
        ablated_config(off, "target_match")
    on = replace(SMALL, gem=replace(SMALL.gem, target_match=True))
    assert ablated_config(on, "target_match").gem.target_match is False
    torch.manual_seed(0)
    without, with_counts = build_model(off, 3, ("feed",)), build_model(on, 3, ("feed",))
    state = TrainState(step=1, examples_seen=0, examples_version=0)
    path = save_checkpoint(tmp_path / "a", state, without, {})
    with pytest.raises(BadConfigError, match=r"--set trainer\.gem\.target_match=false\)"):
        load_checkpoint(path, with_counts, {})
    path = save_checkpoint(tmp_path / "b", state, with_counts, {})
    with pytest.raises(BadConfigError, match=r"--set trainer\.gem\.target_match=true\)"):
        load_checkpoint(path, without, {})
