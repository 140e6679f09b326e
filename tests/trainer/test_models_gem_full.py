"""GEM at full strength (issue 18 items 1 and 4): time buckets, the same-domain stream, recency branches, the
Cross Arch, the personalized FFN, Wukong's deeper FMB MLP, task towers and the presets; jagged edge cases."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from kernels.types import Jagged
from trainer.config import GEM_PRESETS, GemConfig, TrainerConfig
from trainer.data import (
    SEQUENCE_EXTRA_KEYS,
    SEQUENCE_KEYS,
    encode_examples,
    fit_normalizer,
    make_batch,
    time_buckets,
)
from trainer.models import build_model
from trainer.models.gem import with_candidate
from trainer.models.sequence import (
    CrossSummary,
    SequenceLayer,
    SequenceStream,
    append_tokens,
    newest_tokens,
    split_tail,
)
from trainer.models.wukong import WukongLayer

SMALL = TrainerConfig(embedding_dim=8, num_embeddings=1000, hidden_dims=(16, 8), tower_hidden=4,
                      gem=GemConfig(preset="gem_cpu", recency_branches=(2, 3, 0), max_sequence_len=4, attention_len=3))


@pytest.fixture(scope="module")
def encoded():
    from tests.trainer.conftest import synthetic_examples, with_build_columns

    table = with_build_columns(synthetic_examples(["2026-01-01"], 40, 5))
    return table, encode_examples(table, SMALL.num_embeddings, fit_normalizer(table), sequence_extras=True)


def test_time_buckets_hand_values():
    # 0 ms, 999 ms -> 1; 1 s -> 2; 3 s -> 3 (log2(4) = 2); 1 h -> 1 + floor(log2(3601)) = 12; negative / NaN -> 0.
    assert time_buckets(np.array([0, 999, 1000, 3000, 3_600_000, -5, np.nan])).tolist() == [1, 1, 2, 3, 12, 0, 0]


def test_extras_ride_in_the_sequence_kjt(encoded):
    table, data = encoded
    rows = np.array([3, 0, 7])
    batch = make_batch(data, rows)
    assert batch.sequence.keys() == [*SEQUENCE_KEYS, *SEQUENCE_EXTRA_KEYS]
    lengths = np.array(table["seq_length"].to_pylist())[rows]
    same = (lengths + 1) // 2  # the events at even positions
    assert batch.sequence["seq_time_buckets"].lengths().tolist() == lengths.tolist()
    assert batch.sequence["seq_same_domain_item_ids"].lengths().tolist() == same.tolist()
    first = table["seq_time_delta_ms"].to_pylist()[3]
    assert batch.sequence["seq_time_buckets"].values()[: lengths[0]].tolist() == time_buckets(np.array(first)).tolist()
    # The same-domain ids hash like the history's: the same string lands on the same row.
    assert batch.sequence["seq_same_domain_item_ids"].values()[: same[0]].tolist() == batch.sequence["seq_item_ids"].values()[: lengths[0]][::2].tolist()
    # Without the flag (or for another model) the batch is what it was.
    plain = encode_examples(table, SMALL.num_embeddings, fit_normalizer(table))
    assert make_batch(plain, rows).sequence.keys() == list(SEQUENCE_KEYS)
    cpu = GemConfig(preset="gem_cpu")
    assert TrainerConfig(gem=cpu).reads_sequence_extras and not TrainerConfig(model="dlrm", gem=cpu).reads_sequence_extras
    assert not TrainerConfig().reads_sequence_extras  # gem_small, the default


def test_with_candidate_fills_missing_extras():
    """Hand-checked layout with the same-domain rows after the candidate's (stride 3B); a batch without the build's
    columns gets time bucket 0 for every event and empty same-domain rows."""
    from torchrec import KeyedJaggedTensor

    from sequences.schema import SPARSE_FEATURES

    sparse = KeyedJaggedTensor.from_lengths_sync(keys=list(SPARSE_FEATURES), values=torch.arange(2 * len(SPARSE_FEATURES)),
                                                 lengths=torch.ones(2 * len(SPARSE_FEATURES), dtype=torch.int64))
    sequence = KeyedJaggedTensor.from_lengths_sync(keys=list(SEQUENCE_KEYS), values=torch.tensor([5, 6, 1, 2, 9, 9]),
                                                   lengths=torch.tensor([2, 0] * 3))
    keys = [*SEQUENCE_KEYS, "seq_time_buckets"]
    merged = with_candidate(sparse, sequence, keys, 8, same_domain=True)
    assert merged.keys() == keys and merged.stride() == 6
    assert merged["seq_time_buckets"].values().tolist() == [0, 0] and merged["seq_time_buckets"].lengths().tolist() == [2, 0, 0, 0, 0, 0]
    assert merged["seq_item_ids"].lengths().tolist() == [2, 0, 1, 1, 0, 0]
    # With the extras: item 7's same-domain history [5] rides after the candidates; buckets clipped to the table.
    extra = KeyedJaggedTensor.from_lengths_sync(
        keys=[*SEQUENCE_KEYS, *SEQUENCE_EXTRA_KEYS],
        values=torch.tensor([5, 6, 1, 2, 9, 9, 3, 40, 5, 1, 9, 30]),
        lengths=torch.tensor([2, 0] * 4 + [1, 0] * 4),
    )
    merged = with_candidate(sparse, extra, keys, 8, same_domain=True)
    item_id = sparse["item_id"].values().tolist()
    assert merged["seq_item_ids"].values().tolist() == [5, 6, *item_id, 5]
    assert merged["seq_item_ids"].lengths().tolist() == [2, 0, 1, 1, 1, 0]
    assert merged["seq_time_buckets"].values().tolist() == [3, 7, 7]


def test_jagged_helpers_edge_cases():
    x = Jagged.from_lengths(torch.arange(7.0).unsqueeze(1), [3, 0, 4])
    # Newest first, zeros past a row's length, the empty row all zeros.
    assert newest_tokens(x, 2).squeeze(2).tolist() == [[2.0, 1.0], [0.0, 0.0], [6.0, 5.0]]
    cls = torch.tensor([[10.0], [11.0]])
    y = append_tokens(x, cls)
    assert y.lengths.tolist() == [5, 2, 6]
    assert y.values.squeeze(1).tolist() == [0, 1, 2, 10, 11, 10, 11, 3, 4, 5, 6, 10, 11]
    body, tail = split_tail(y, 2)
    assert torch.equal(body.values, x.values) and torch.equal(body.offsets, x.offsets)
    assert tail.squeeze(2).tolist() == [[10.0, 11.0]] * 3
    with pytest.raises(ValueError, match="every row needs >= 2 tokens"):
        split_tail(x, 2)


def test_stream_shapes_with_empty_rows_and_the_longest_row():
    torch.manual_seed(0)
    stream = SequenceStream(dim=4, heads=2, num_layers=2, windows=(2, 0), max_len=5, attention_len=2, cross=True,
                            cls=1, pma=2, recent=3, pffn_rank=2)
    assert stream.attends == (True, False) and stream.windows == (2, 5)
    assert stream.num_tokens == (1 + 2 + 1) + (1 + 2) + 3  # attending branch has a CLS token, the pooled one not
    x = Jagged.from_lengths(torch.randn(7, 4), [0, 5, 2, 0])
    branches = stream.start(x)
    assert branches[0].lengths.tolist() == [1, 3, 3, 1] and branches[1].lengths.tolist() == [0, 5, 2, 0]
    condition, target = torch.randn(4, 4), torch.randn(4, 4)
    for layer in range(2):
        branches, summary = stream.step(layer, branches, condition, target)
        assert summary.shape == (4, stream.num_tokens, 4) and torch.isfinite(summary).all()
    # An empty row summarizes to zeros where it has nothing: its recent tokens and its attention pools.
    assert summary[0, -3:].abs().sum() == 0
    # The oldest event of row 1 (outside the 2-event branch) still moves the summary through the pooled branch.
    values = x.values.clone().requires_grad_(True)
    _, out = stream.step(0, stream.start(x.with_values(values)), condition, target)
    (grad,) = torch.autograd.grad(out.sum(), values)
    assert grad[0].abs().sum() > 0  # token 0 is the oldest of row 1


def test_personalized_ffn_is_a_per_example_projection():
    torch.manual_seed(0)
    layer = SequenceLayer(dim=4, heads=2, pffn_rank=2)
    with torch.no_grad():
        layer.condition_out.weight.normal_()
    x = Jagged.from_lengths(torch.randn(2, 4).repeat(2, 1), [2, 2])  # two rows with the same tokens
    out = layer(x, torch.stack([torch.zeros(4), torch.ones(4)]))
    assert not torch.allclose(out.values[:2], out.values[2:])  # different conditions, different projections
    same = layer(x, torch.ones(2, 4))
    torch.testing.assert_close(same.values[:2], same.values[2:])


def test_cross_summary_gates_every_token():
    torch.manual_seed(0)
    cross = CrossSummary(dim=4, heads=2, pma=2, cls=1)
    x = Jagged.from_lengths(torch.randn(3, 4), [3, 0])
    out = cross(x, torch.randn(2, 4), torch.randn(2, 1, 4))
    assert out.shape == (2, 4, 4)
    with torch.no_grad():
        cross.gate.bias.fill_(-1e4)  # gates closed: every summary token is 0
    assert cross(x, torch.randn(2, 4), torch.randn(2, 1, 4)).abs().max() == 0
    with pytest.raises(ValueError, match="expects 1 CLS outputs"):
        cross(x, torch.randn(2, 4), None)


def test_wukong_fmb_mlp_depth():
    layer = WukongLayer(num_inputs=3, dim=4, num_fm_outputs=2, num_lcb_outputs=1, rank=2, mlp_hidden=5, mlp_layers=3)
    linears = [m for m in layer.fm_mlp.modules() if isinstance(m, torch.nn.Linear)]
    assert [tuple(m.weight.shape) for m in linears] == [(5, 6), (5, 5), (5, 5), (8, 5)]
    assert layer(torch.randn(2, 3, 4)).shape == (2, 3, 4)


SWITCHES = {
    "time_delta_buckets": 0, "same_domain_stream": False, "interformer_cross": False, "personalized_ffn_rank": 0,
    "fmb_mlp_layers": 1, "task_towers": False,
}


@pytest.mark.parametrize("switch", [None, *SWITCHES, "recency_branches"])
def test_full_model_forward_backward_with_each_switch_off(switch, encoded):
    """gem_cpu with one change turned off at a time (the ablations): logits (B, 2), finite, gradients reach
    the tables; the batch has an empty history and the longest one (cut to max_sequence_len)."""
    table, data = encoded
    lengths = np.array(table["seq_length"].to_pylist())
    rows = np.array([int(np.argmin(lengths)), int(np.argmax(lengths)), 1, 2])
    assert lengths[rows[0]] == 0 and lengths[rows[1]] > SMALL.gem.max_sequence_len
    gem = SMALL.gem
    if switch == "recency_branches":
        gem = replace(gem, recency_branches=(), same_domain_stream=False)
    elif switch is not None:
        gem = replace(gem, **{switch: SWITCHES[switch]})
    torch.manual_seed(0)
    model = build_model(replace(SMALL, gem=gem), 3, ("feed", "reels"))
    batch = make_batch(data, rows)
    logits = model(batch.sparse, batch.sequence, batch.dense, torch.tensor([0, 1, 2, 0]))
    assert logits.shape == (4, 2) and torch.isfinite(logits).all()
    logits.sum().backward()
    assert model.sparse_arch.sequence.embeddings["t_item"].weight.grad.abs().sum() > 0


def test_presets_resolve_and_explicit_keys_win():
    small = GemConfig(preset="gem_small").resolved()
    assert (small.max_sequence_len, small.recency_branches, small.personalized_ffn_rank) == (32, (), 0)
    assert GemConfig().preset == "gem_small"
    cpu = GemConfig(preset="gem_cpu").resolved()
    assert cpu.max_sequence_len == 256 and cpu.recency_branches == (16, 64, 0)
    assert GemConfig(preset="gem", max_sequence_len=100).resolved().max_sequence_len == 100
    assert GemConfig().layers is None  # unset keys stay unset: config_overrides sends only what was set
    assert set(GEM_PRESETS["gem"]) == set(GEM_PRESETS["gem_small"]) == set(GEM_PRESETS["gem_cpu"])
    with pytest.raises(ValueError, match="trainer.gem.preset must be one of"):
        GemConfig(preset="huge")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="same_domain_stream needs trainer.gem.recency_branches"):
        GemConfig(preset="gem_cpu", recency_branches=())
    with pytest.raises(ValueError, match="recency_branches must be distinct lengths"):
        GemConfig(recency_branches=(4, 4))
    # The gem_small preset builds exactly the model before issue 18 (its fingerprint: test_models_gem).
    model = build_model(TrainerConfig(gem=GemConfig(preset="gem_small")), 3, ("feed",))
    assert model.dense_arch.recency.weight.shape == (32, 16)


def test_each_issue_18_switch_is_an_ablation_of_compare():
    """``compare --ablate NAME`` turns one change of gem_cpu off (recency_branches needs one stream: the pyramid)."""
    from trainer.compare import ABLATIONS, ablated_config

    gem_cpu = TrainerConfig(gem=GemConfig(preset="gem_cpu"))
    full = gem_cpu.gem.resolved()
    expected = {"time_delta_buckets": {"time_delta_buckets": 0}, "same_domain_stream": {"same_domain_stream": False},
                "recency_branches": {"recency_branches": (), "same_domain_stream": False},
                "interformer_cross": {"interformer_cross": False}, "personalized_ffn": {"personalized_ffn_rank": 0},
                "fmb_mlp_layers": {"fmb_mlp_layers": 1}, "task_towers": {"task_towers": False}}
    for name, changed in expected.items():
        ablated = ablated_config(gem_cpu, name).gem.resolved()
        assert ablated == replace(full, **changed), name
    assert not ablated_config(TrainerConfig(), "final_labels").final_labels and "final_labels" in ABLATIONS
