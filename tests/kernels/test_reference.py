"""Reference ops against obvious per-row loops and hand-checked numbers."""

import math

import torch

from kernels.causal_attention import causal_attention
from kernels.padding import jagged_to_padded, padded_to_jagged
from kernels.pooling import segment_mean, segment_sum
from kernels.softmax import jagged_softmax
from kernels.target_attention import target_attention
from kernels.types import Jagged

X = Jagged.from_lengths(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]), [2, 0, 1, 1])


def rows(x: Jagged) -> list[torch.Tensor]:
    return list(torch.split(x.values, x.lengths.tolist()))


def test_padding_hand_checked():
    padded = jagged_to_padded(X, pad_value=-1.0)
    expected = torch.tensor(
        [[[1.0, 2.0], [3.0, 4.0]], [[-1, -1], [-1, -1]], [[5.0, 6.0], [-1, -1]], [[7.0, 8.0], [-1, -1]]]
    )
    torch.testing.assert_close(padded, expected)
    torch.testing.assert_close(padded_to_jagged(padded, X.offsets).values, X.values)
    assert jagged_to_padded(X, max_len=1)[:, 0, 0].tolist() == [1.0, 0.0, 5.0, 7.0]


def test_pooling_hand_checked():
    torch.testing.assert_close(segment_sum(X), torch.tensor([[4.0, 6.0], [0, 0], [5.0, 6.0], [7.0, 8.0]]))
    torch.testing.assert_close(segment_mean(X), torch.tensor([[2.0, 3.0], [0, 0], [5.0, 6.0], [7.0, 8.0]]))


def test_softmax_hand_checked():
    scores = Jagged.from_lengths(torch.tensor([0.0, math.log(3.0), 5.0]), [2, 0, 1])
    torch.testing.assert_close(jagged_softmax(scores).values, torch.tensor([0.25, 0.75, 1.0]))


def loop_causal(q, k, v, lengths, window, scale):
    outs = []
    for qr, kr, vr in zip(*(torch.split(t, lengths) for t in (q, k, v))):
        for i in range(qr.shape[0]):
            lo = 0 if window is None else max(0, i - window + 1)
            s = torch.einsum("hd,jhd->hj", qr[i], kr[lo : i + 1]) * scale
            outs.append(torch.einsum("hj,jhd->hd", torch.softmax(s, -1), vr[lo : i + 1]))
    return torch.stack(outs) if outs else q.new_zeros(q.shape)


def test_causal_attention_matches_loop():
    gen = torch.Generator().manual_seed(0)
    lengths = [4, 0, 1, 6]
    q, k, v = (torch.randn(11, 2, 3, generator=gen) for _ in range(3))
    for window in (None, 1, 2, 10):
        got = causal_attention(*(Jagged.from_lengths(t, lengths) for t in (q, k, v)), window=window).values
        torch.testing.assert_close(got, loop_causal(q, k, v, lengths, window, 1 / math.sqrt(3)))


def test_causal_window1_is_identity_on_values():
    # With one key (itself), every softmax weight is 1: out == v.
    v = torch.randn(5, 1, 2, generator=torch.Generator().manual_seed(1))
    j = Jagged.from_lengths(v, [2, 3])
    torch.testing.assert_close(causal_attention(j, j, j, window=1).values, v)


def test_target_attention_matches_loop_and_empty_row_is_zero():
    gen = torch.Generator().manual_seed(2)
    lengths = [3, 0, 1]
    k, v = (torch.randn(4, 2, 3, generator=gen) for _ in range(2))
    q = torch.randn(3, 2, 3, generator=gen)
    got = target_attention(q, Jagged.from_lengths(k, lengths), Jagged.from_lengths(v, lengths))
    for b, (kr, vr) in enumerate(zip(torch.split(k, lengths), torch.split(v, lengths))):
        if kr.shape[0] == 0:
            assert got[b].abs().sum() == 0
            continue
        s = torch.einsum("hd,jhd->hj", q[b], kr) / math.sqrt(3)
        torch.testing.assert_close(got[b], torch.einsum("hj,jhd->hd", torch.softmax(s, -1), vr))
