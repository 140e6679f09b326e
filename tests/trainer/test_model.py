"""Jagged attention/mean pooling against a padded dense reference; the model's shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.data import encode_examples, fit_normalizer, make_batch
from trainer.model import TwoTaskRanker, segment_mean_pool, segment_softmax_pool


def padded_reference(values, scores, lengths):
    """Pad to (B, L_max), mask, softmax, weighted sum; empty rows -> 0. Also the padded mean."""
    num_rows, max_len, dim = len(lengths), max([*lengths, 1]), values.shape[1]
    padded = values.new_zeros(num_rows, max_len, dim)
    padded_scores = scores.new_full((num_rows, max_len), float("-inf"))
    start = 0
    for i, n in enumerate(lengths):
        padded[i, :n] = values[start : start + n]
        padded_scores[i, :n] = scores[start : start + n]
        start += n
    mask = torch.arange(max_len)[None, :] < torch.tensor(lengths)[:, None]
    weights = torch.softmax(padded_scores, dim=1).nan_to_num(0.0) * mask
    attention = (weights.unsqueeze(2) * padded).sum(dim=1)
    mean = padded.sum(dim=1) / torch.tensor(lengths).clamp(min=1).unsqueeze(1)
    return attention, mean


@pytest.mark.parametrize(
    "lengths",
    [[3, 0, 2, 5, 0, 1], [0, 0, 0], [4], [0], [1, 1, 1, 1], list(np.random.default_rng(3).integers(0, 9, 40))],
    ids=["mixed", "all-empty", "one-row", "one-empty-row", "singletons", "random-40"],
)
def test_pooling_matches_padded_reference(lengths):
    torch.manual_seed(0)
    lengths = [int(n) for n in lengths]
    total = sum(lengths)
    # float32: the jagged kernels' dtype (they take float32/bf16/fp16 and compute in float32).
    values = (torch.randn(total, 8, dtype=torch.float32) * 3).requires_grad_()
    scores = (torch.randn(total, dtype=torch.float32) * 10).requires_grad_()  # large logits test stability
    offsets = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int64)

    got_att, got_mean = segment_softmax_pool(values, scores, offsets), segment_mean_pool(values, offsets)
    ref_att, ref_mean = padded_reference(values, scores, lengths)
    torch.testing.assert_close(got_att, ref_att)
    torch.testing.assert_close(got_mean, ref_mean)
    assert got_att.shape == (len(lengths), 8)
    for i, n in enumerate(lengths):
        if n == 0:
            assert torch.all(got_att[i] == 0) and torch.all(got_mean[i] == 0)

    upstream = torch.randn(len(lengths), 8, dtype=torch.float32)
    grads = torch.autograd.grad(((got_att + got_mean) * upstream).sum(), [values, scores])
    ref_grads = torch.autograd.grad(((ref_att + ref_mean) * upstream).sum(), [values, scores])
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_model_shapes_and_empty_histories(make_examples):
    table = make_examples(["2026-01-01"], 20, 1)
    data = encode_examples(table, 50, fit_normalizer(table))
    torch.manual_seed(0)
    model = TwoTaskRanker(num_embeddings=50, embedding_dim=4, num_dense=3, hidden_dims=(8,))
    batch = make_batch(data, np.arange(20))
    logits = model(batch.sparse, batch.sequence, batch.dense)
    assert logits.shape == (20, 2) and logits.dtype == torch.float32 and torch.all(torch.isfinite(logits))
    empty_rows = np.flatnonzero(data.seq_offsets[1:] == data.seq_offsets[:-1])
    assert len(empty_rows) > 0
    only_empty = make_batch(data, empty_rows)
    assert torch.all(torch.isfinite(model(only_empty.sparse, only_empty.sequence, only_empty.dense)))
    # Every parameter is in exactly one optimiser group.
    emb, dense = model.embedding_parameters(), model.dense_parameters()
    assert len(emb) == 12 and len(emb) + len(dense) == len(list(model.parameters()))
    with pytest.raises(ValueError, match=r"dense must be \(B, 3\), got \(20, 2\)"):
        model(batch.sparse, batch.sequence, batch.dense[:, :2])
