"""Pyramid sequence encoder: jagged truncation by hand and by invariant, and the whole encoder
against a padded dense reference on random jagged inputs with empty rows."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.types import Jagged
from trainer.models.sequence import PyramidSequenceEncoder, keep_newest, newest_token, pyramid_lengths


def jagged(lengths: list[int], dim: int = 1, seed: int = 0, dtype=torch.float64) -> Jagged:
    values = torch.randn(sum(lengths), dim, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return Jagged.from_lengths(values, lengths)


def test_keep_newest_hand_case():
    x = Jagged.from_lengths(torch.arange(7.0).view(7, 1), [4, 0, 3])  # rows [0 1 2 3] [] [4 5 6]
    out = keep_newest(x, pyramid_lengths(x.lengths, 0.5, 1))  # ceil([2, 0, 1.5]) = [2, 0, 2]
    assert out.offsets.tolist() == [0, 2, 2, 4]
    assert out.values.view(-1).tolist() == [2.0, 3.0, 5.0, 6.0]
    assert newest_token(x).view(-1).tolist() == [3.0, 0.0, 6.0]


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=0, max_size=8),
    ratio=st.sampled_from([1.0, 0.5, 0.3, 0.75]),
    layer=st.integers(0, 4),
)
def test_pyramid_keeps_exactly_the_newest_tokens(lengths, ratio, layer):
    x = Jagged.from_lengths(torch.arange(float(sum(lengths))).view(-1, 1), lengths)
    out = keep_newest(x, pyramid_lengths(x.lengths, ratio, layer))
    expected_rows = []
    start = 0
    for n in lengths:
        keep = math.ceil(n * ratio**layer)
        expected_rows.append(list(range(start + n - keep, start + n)))
        start += n
    assert out.lengths.tolist() == [len(r) for r in expected_rows]
    assert out.values.view(-1).tolist() == [float(v) for r in expected_rows for v in r]


@pytest.mark.parametrize(
    ("ratio", "layer", "message"), [(0.0, 1, r"ratio must be in \(0, 1\], got 0.0"), (1.5, 1, r"got 1.5"), (0.5, -1, "layer must be >= 0")]
)
def test_pyramid_rejects_bad_arguments(ratio, layer, message):
    with pytest.raises(ValueError, match=message):
        pyramid_lengths(torch.tensor([3]), ratio, layer)


def test_keep_newest_rejects_bad_keep():
    x = jagged([2, 1])
    with pytest.raises(ValueError, match=r"keep must be \(B=2,\), got \(3,\)"):
        keep_newest(x, torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="keep must be >= 0"):
        keep_newest(x, torch.tensor([1, -1]))


def padded_encoder_reference(encoder: PyramidSequenceEncoder, x: Jagged, condition, target) -> list[torch.Tensor]:
    """The encoder recomputed on padded (B, L_max, D) tensors with masks, row truncation by Python slicing."""
    rows = [x.values[int(a) : int(b)] for a, b in zip(x.offsets[:-1], x.offsets[1:])]
    full = [len(r) for r in rows]
    out = []
    for layer, (block, summary) in enumerate(zip(encoder.layers, encoder.summaries)):
        rows = [r[len(r) - math.ceil(n * encoder.ratio**layer) :] if n else r for r, n in zip(rows, full)]
        lengths = torch.tensor([len(r) for r in rows])
        batch, max_len, dim = len(rows), max([1, *lengths.tolist()]), x.values.shape[1]
        padded = x.values.new_zeros(batch, max_len, dim)
        for i, r in enumerate(rows):
            padded[i, : len(r)] = r
        valid = torch.arange(max_len)[None, :] < lengths[:, None]  # (B, L)
        heads, head_dim = block.heads, dim // block.heads
        q, k, v = block.qkv(block.attn_norm(padded)).view(batch, max_len, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
        causal = torch.ones(max_len, max_len, dtype=torch.bool).tril()
        allowed = causal[None, None] & valid[:, None, None, :]
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
        attended = (probs @ v).transpose(1, 2).reshape(batch, max_len, dim)
        h = padded + block.attn_out(attended)
        gate = torch.sigmoid(block.condition(condition))[:, None, :]
        h = h + block.ffn(block.ffn_norm(h) * gate)
        rows = [h[i, : int(n)] for i, n in enumerate(lengths)]
        # Summary: target attention over valid tokens, and the newest token.
        sq = summary.query(target).view(batch, heads, 1, head_dim)
        sk = summary.key(h).view(batch, max_len, heads, head_dim).transpose(1, 2)
        sv = h.view(batch, max_len, heads, head_dim).transpose(1, 2)
        sscores = (sq @ sk.transpose(-1, -2)) / math.sqrt(head_dim)
        sprobs = torch.softmax(sscores.masked_fill(~valid[:, None, None, :], float("-inf")), dim=-1).nan_to_num(0.0)
        pooled = (sprobs @ sv).reshape(batch, dim)
        newest = torch.stack([h[i, int(n) - 1] if n else h.new_zeros(dim) for i, n in enumerate(lengths)])
        out.append(torch.stack([pooled, newest], dim=1))
    return out


@pytest.mark.parametrize(
    "lengths",
    [[5, 0, 3, 9, 0, 1], [0, 0, 0], [7], [1, 2, 0, 4, 6, 0, 3, 8, 2, 5]],
    ids=["mixed", "all-empty", "one-row", "ten-rows"],
)
def test_encoder_matches_padded_reference(lengths):
    torch.manual_seed(1)
    dim = 8
    # float32: the jagged kernels take float32/bf16/fp16 only.
    encoder = PyramidSequenceEncoder(dim=dim, heads=2, num_layers=3, ratio=0.5)
    x = jagged(lengths, dim, seed=2, dtype=torch.float32)
    x = x.with_values(x.values.requires_grad_())
    condition = torch.randn(len(lengths), dim, requires_grad=True)
    target = torch.randn(len(lengths), dim, requires_grad=True)

    got = encoder(x, condition, target)
    ref = padded_encoder_reference(encoder, x, condition, target)
    assert [g.shape for g in got] == [(len(lengths), 2, dim)] * 3
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)
    weights = [torch.randn_like(g) for g in got]
    inputs = [x.values, condition, target]
    got_grads = torch.autograd.grad(sum((g * w).sum() for g, w in zip(got, weights)), inputs, allow_unused=True)
    ref_grads = torch.autograd.grad(sum((r * w).sum() for r, w in zip(ref, weights)), inputs, allow_unused=True)
    for g, r in zip(got_grads, ref_grads):
        if r is None:
            assert g is None or torch.all(g == 0)
        else:
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)
