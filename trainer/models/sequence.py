"""Pyramid sequence encoder over jagged histories (no padding in the data path).

Shape letters: B batch, L_i history length of row i, T = sum L_i tokens, D model width, H heads,
Dh = D / H head dim, l layer index (0-based), r pyramid ratio in (0, 1].

Layer l sees only the newest ``ceil(L_i * r**l)`` tokens of row i, so deeper layers spend their
compute on recent behaviour while layer 0 keeps the whole history: GEM's "pyramid-parallel"
sequence structure (Meta engineering blog, Nov 2025; /work/shared/GEM.md). Histories are stored
oldest first (sequences/schema.py), so the newest tokens are each row's tail and the truncation
is offsets arithmetic::

    L = [4, 0, 3], r = 0.5, layer 1 keeps ceil(L/2) = [2, 0, 2]
    values  [a b c d | e f g]   ->   [c d | f g]      offsets [0,4,4,7] -> [0,2,2,4]

Each layer (InterFormer's Sequence Arch, Zeng et al. 2024, arXiv 2411.09852, §3.3): causal
self-attention within each row (kernels.causal_attention), then a personalized FFN whose input is
gated by the non-sequence summary of the same example, each with a pre-LayerNorm and a residual.
The per-layer summary (InterFormer's Cross Arch, §3.4) is the target attention of the candidate
over the row (kernels.target_attention, DIN, Zhou et al. 2018, §4.3) and the newest token.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.causal_attention import causal_attention
from kernels.segments import token_rows
from kernels.target_attention import target_attention
from kernels.types import Backend, Jagged


def pyramid_lengths(lengths: torch.Tensor, ratio: float, layer: int) -> torch.Tensor:
    """(B,) int64 tokens layer ``layer`` keeps: ``ceil(L_i * ratio**layer)``, computed in float64.

    Raises:
        ValueError: ratio outside (0, 1] or layer < 0.
    """
    if not 0 < ratio <= 1:
        raise ValueError(f"pyramid ratio must be in (0, 1], got {ratio}")
    if layer < 0:
        raise ValueError(f"layer must be >= 0, got {layer}")
    return torch.ceil(lengths.to(torch.float64) * ratio**layer).to(torch.int64)


def keep_newest(x: Jagged, keep: torch.Tensor) -> Jagged:
    """The newest ``keep[i]`` tokens of each row of ``x`` (its tail), as a new Jagged.

    Args:
        x: values (T, *F), offsets (B+1,) int64.
        keep: (B,) int64; values above a row's length keep the whole row.

    Returns:
        Jagged with values (T', *F), T' = sum min(keep_i, L_i); gradients flow to the kept tokens.

    Raises:
        ValueError: keep is not (B,) or has a negative entry.
    """
    if keep.shape != (x.batch_size,):
        raise ValueError(f"keep must be (B={x.batch_size},), got {tuple(keep.shape)}")
    if keep.numel() and int(keep.min()) < 0:
        raise ValueError(f"keep must be >= 0, got {keep.tolist()[:10]}")
    kept = torch.minimum(keep.to(torch.int64), x.lengths)
    new_offsets = torch.zeros_like(x.offsets)
    torch.cumsum(kept, dim=0, out=new_offsets[1:])
    num_kept = int(new_offsets[-1])
    rows = token_rows(new_offsets, num_kept)
    # Token j of the new row i is old token (end_i - kept_i) + j.
    start = x.offsets[1:] - kept
    index = start[rows] + torch.arange(num_kept, device=x.offsets.device) - new_offsets[:-1][rows]
    return Jagged(values=x.values.index_select(0, index), offsets=new_offsets)


def newest_token(x: Jagged) -> torch.Tensor:
    """(B, *F) last token of each row of ``x``; zeros for an empty row."""
    lengths = x.lengths
    out = x.values.new_zeros((x.batch_size, *x.values.shape[1:]))
    nonempty = torch.nonzero(lengths > 0).squeeze(1)
    return out.index_copy(0, nonempty, x.values.index_select(0, x.offsets[1:][nonempty] - 1))


class SequenceLayer(nn.Module):
    """Causal self-attention + personalized FFN over jagged tokens (InterFormer §3.3).

    Args:
        dim: D.
        heads: H (must divide D).
        backend: jagged kernel backend ("reference" on CPU).
    """

    def __init__(self, *, dim: int, heads: int, backend: Backend = "reference") -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"model width {dim} must be divisible by heads={heads}")
        self.dim, self.heads, self.backend = dim, heads, backend
        self.attn_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.attn_out = nn.Linear(dim, dim)
        self.ffn_norm = nn.LayerNorm(dim)
        self.condition = nn.Linear(dim, dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))

    def forward(self, x: Jagged, condition: torch.Tensor) -> Jagged:
        """x.values (T, D), condition (B, D) float32 -> Jagged (T, D) with x's offsets.

        Raises:
            ValueError: condition is not (B, D).
        """
        if condition.shape != (x.batch_size, self.dim):
            raise ValueError(f"condition must be (B={x.batch_size}, D={self.dim}), got {tuple(condition.shape)}")
        num_tokens, head_dim = x.num_tokens, self.dim // self.heads
        q, k, v = self.qkv(self.attn_norm(x.values)).view(num_tokens, 3, self.heads, head_dim).unbind(1)
        attended = causal_attention(x.with_values(q), x.with_values(k), x.with_values(v), backend=self.backend)
        h = x.values + self.attn_out(attended.values.reshape(num_tokens, self.dim))
        # Personalized FFN: the non-sequence summary of each example scales the FFN's input features.
        gate = torch.sigmoid(self.condition(condition))[token_rows(x.offsets, num_tokens)]
        return x.with_values(h + self.ffn(self.ffn_norm(h) * gate))


class SequenceSummary(nn.Module):
    """Cross Arch summary of one layer's tokens (InterFormer §3.4): (B, 2, D) = [target attention, newest token].

    Args:
        dim: D.
        heads: H of the target attention.
        backend: jagged kernel backend.
    """

    num_tokens = 2

    def __init__(self, *, dim: int, heads: int, backend: Backend = "reference") -> None:
        super().__init__()
        self.dim, self.heads, self.backend = dim, heads, backend
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)

    def forward(self, x: Jagged, target: torch.Tensor) -> torch.Tensor:
        """x.values (T, D), target (B, D) candidate embedding -> (B, 2, D) float32; empty rows give zeros."""
        head_dim = self.dim // self.heads
        query = self.query(target).view(-1, self.heads, head_dim)
        keys = x.with_values(self.key(x.values).view(-1, self.heads, head_dim))
        values = x.with_values(x.values.view(-1, self.heads, head_dim))
        pooled = target_attention(query, keys, values, backend=self.backend).reshape(-1, self.dim)
        return torch.stack([pooled, newest_token(x)], dim=1)


class PyramidSequenceEncoder(nn.Module):
    """Stack of :class:`SequenceLayer` with pyramid truncation and a summary after every layer.

    Args:
        dim: D.
        heads: H.
        num_layers: number of layers.
        ratio: r; layer l keeps the newest ceil(L_i * r**l) tokens of row i.
        backend: jagged kernel backend.
    """

    def __init__(self, *, dim: int, heads: int, num_layers: int, ratio: float, backend: Backend = "reference") -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        pyramid_lengths(torch.zeros(0, dtype=torch.int64), ratio, 0)  # validates ratio
        self.ratio = ratio
        self.layers = nn.ModuleList(SequenceLayer(dim=dim, heads=heads, backend=backend) for _ in range(num_layers))
        self.summaries = nn.ModuleList(SequenceSummary(dim=dim, heads=heads, backend=backend) for _ in range(num_layers))

    def step(self, layer: int, x: Jagged, full_lengths: torch.Tensor, condition: torch.Tensor, target: torch.Tensor) -> tuple[Jagged, torch.Tensor]:
        """Run layer ``layer`` on the pyramid's share of ``x``.

        Args:
            layer: l.
            x: tokens out of layer l-1 (or the embeddings for l = 0), values (T, D).
            full_lengths: (B,) int64 original history lengths L_i.
            condition: (B, D) non-sequence summary for the personalized FFN.
            target: (B, D) candidate embedding for the summary.

        Returns:
            (tokens out of layer l, values (T_l, D); summary (B, 2, D)).
        """
        x = keep_newest(x, pyramid_lengths(full_lengths, self.ratio, layer))
        x = self.layers[layer](x, condition)
        return x, self.summaries[layer](x, target)

    def forward(self, x: Jagged, condition: torch.Tensor, target: torch.Tensor) -> list[torch.Tensor]:
        """All layers with one fixed condition: x.values (T, D) -> per-layer summaries, each (B, 2, D)."""
        full_lengths = x.lengths
        out = []
        for layer in range(len(self.layers)):
            x, summary = self.step(layer, x, full_lengths, condition, target)
            out.append(summary)
        return out
