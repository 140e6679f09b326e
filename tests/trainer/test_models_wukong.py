"""Wukong: the optimized FM against the full FM and a hand case; layer shapes; bad shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.models.wukong import WukongLayer, full_fm, low_rank_fm


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(0, 4), n=st.integers(1, 7), d=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_low_rank_fm_equals_full_fm_when_k_equals_n(batch, n, d, seed):
    x = torch.randn(batch, n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    torch.testing.assert_close(low_rank_fm(x, torch.eye(n, dtype=torch.float64)), full_fm(x))


def test_low_rank_fm_hand_case():
    # x has n=2 embeddings of d=2: e1=(1,2), e2=(3,4). X·Xᵀ = [[5, 11], [11, 25]].
    x = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
    assert full_fm(x).tolist() == [[[5.0, 11.0], [11.0, 25.0]]]
    # Y = (1, 1)ᵀ sums each row of X·Xᵀ: (16, 36).
    assert low_rank_fm(x, torch.ones(2, 1)).tolist() == [[[16.0], [36.0]]]
    # Y = (1, -1)ᵀ: (5 - 11, 11 - 25).
    assert low_rank_fm(x, torch.tensor([[1.0], [-1.0]])).tolist() == [[[-6.0], [-14.0]]]


def test_layer_shapes_and_residual_projection():
    torch.manual_seed(0)
    layer = WukongLayer(num_inputs=5, dim=4, num_fm_outputs=3, num_lcb_outputs=2, rank=2, mlp_hidden=8)
    assert layer.residual is None  # 3 + 2 == 5: identity residual
    x = torch.randn(6, 5, 4, requires_grad=True)
    out = layer(x)
    assert out.shape == (6, 5, 4) and out.dtype == torch.float32
    # LayerNorm over d: every output embedding has mean 0, variance 1 (weights are at init).
    torch.testing.assert_close(out.mean(dim=2), torch.zeros(6, 5), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.var(dim=2, unbiased=False), torch.ones(6, 5), atol=1e-3, rtol=0)
    out.sum().backward()
    assert layer.projection.grad is not None and torch.any(layer.projection.grad != 0)

    wider = WukongLayer(num_inputs=5, dim=4, num_fm_outputs=4, num_lcb_outputs=3, rank=2, mlp_hidden=8)
    assert wider(x).shape == (6, 7, 4) and wider.residual is not None


@pytest.mark.parametrize(
    ("shape", "message"),
    [((6, 4, 4), r"must be \(B, 5, 4\), got \(6, 4, 4\)"), ((6, 5), r"must be \(B, 5, 4\), got \(6, 5\)"), ((6, 5, 3), r"got \(6, 5, 3\)")],
)
def test_layer_rejects_wrong_shapes(shape, message):
    layer = WukongLayer(num_inputs=5, dim=4, num_fm_outputs=3, num_lcb_outputs=2, rank=2, mlp_hidden=8)
    with pytest.raises(ValueError, match=message):
        layer(torch.zeros(shape))


def test_low_rank_fm_rejects_wrong_projection():
    with pytest.raises(ValueError, match=r"projection must be \(n=3, k\), got \(2, 2\)"):
        low_rank_fm(torch.zeros(1, 3, 4), torch.zeros(2, 2))
