"""InterFormer-style interleaving of the interaction arch and the sequence arch.

Zeng et al. 2024, "InterFormer: Towards Effective Heterogeneous Interaction Learning for Click-Through
Rate Prediction", arXiv 2411.09852, §3: per layer, information flows both ways.

Shape letters: B batch, n_l interaction embeddings into layer l, D width, T_l tokens of layer l.

    layer l:  X_l (B, n_l, D) ── flatten ─ Linear ─> condition (B, D) ─────────┐  (non-sequence -> sequence)
              tokens_{l-1} ─ pyramid keep-newest ─ SequenceLayer(condition) ─> tokens_l ─ summary S_l (B, 2, D)
              [X_l ; S_l] (B, n_l + 2, D) ─ WukongLayer ─> X_{l+1}                   (sequence -> non-sequence)

The interaction arch is Wukong (trainer/models/wukong.py), the sequence arch the pyramid encoder
(trainer/models/sequence.py).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from kernels.types import Backend, Jagged
from trainer.models.sequence import PyramidSequenceEncoder, SequenceStream, SequenceSummary
from trainer.models.wukong import WukongLayer


class InterFormer(nn.Module):
    """Interleaved Wukong + pyramid sequence layers.

    Args:
        num_inputs: n_0 interaction embeddings at the input.
        dim: D.
        num_layers: layers of each arch.
        heads: attention heads of the sequence arch.
        pyramid_ratio: r of the pyramid.
        num_fm_outputs, num_lcb_outputs, fm_rank, mlp_hidden: Wukong knobs (n_F, n_L, k, MLP width).
        backend: jagged kernel backend.
        pffn_rank: the sequence layers' personalized FFN rank (0: gate); mlp_layers: the FMB MLP's depth.
    """

    def __init__(
        self, *, num_inputs: int, dim: int, num_layers: int, heads: int, pyramid_ratio: float,
        num_fm_outputs: int, num_lcb_outputs: int, fm_rank: int, mlp_hidden: int, backend: Backend = "reference",
        pffn_rank: int = 0, mlp_layers: int = 1,
    ) -> None:
        super().__init__()
        self.sequence_arch = PyramidSequenceEncoder(dim=dim, heads=heads, num_layers=num_layers, ratio=pyramid_ratio, backend=backend,
                                                    pffn_rank=pffn_rank)
        widths = [num_inputs] + [num_fm_outputs + num_lcb_outputs] * num_layers
        self.interaction_arch = nn.ModuleList(
            WukongLayer(
                num_inputs=widths[i] + SequenceSummary.num_tokens, dim=dim, num_fm_outputs=num_fm_outputs,
                num_lcb_outputs=num_lcb_outputs, rank=fm_rank, mlp_hidden=mlp_hidden, mlp_layers=mlp_layers,
            )
            for i in range(num_layers)
        )
        self.conditions = nn.ModuleList(nn.Linear(widths[i] * dim, dim) for i in range(num_layers))
        self.num_outputs = widths[-1]

    def forward(self, interaction: torch.Tensor, tokens: Jagged, target: torch.Tensor) -> tuple[torch.Tensor, Jagged, torch.Tensor]:
        """Run every layer.

        Args:
            interaction: (B, n_0, D) float32 non-sequence embeddings.
            tokens: values (T, D) float32 history tokens, offsets (B+1,) int64.
            target: (B, D) float32 candidate embedding (query of the summaries).

        Returns:
            (interaction out (B, n_F + n_L, D), tokens of the last layer (T_last, D), last summary (B, 2, D)).
        """
        full_lengths = tokens.lengths
        summary = None
        for layer, (wukong, condition) in enumerate(zip(self.interaction_arch, self.conditions)):
            cond = condition(interaction.flatten(1))
            tokens, summary = self.sequence_arch.step(layer, tokens, full_lengths, cond, target)
            interaction = wukong(torch.cat([interaction, summary], dim=1))
        assert summary is not None
        return interaction, tokens, summary


class BranchedInterFormer(nn.Module):
    """InterFormer over one or more :class:`SequenceStream` (the history, the same-domain history), as published.

    Per layer l (arXiv 2411.09852, §3): the Interaction Arch's input X_l (B, n_l, D) gives the condition of every
    stream's personalized FFN (non-sequence -> sequence); each stream runs its branches and returns its Cross Arch
    summary; the summaries of all streams join X_l in the Wukong layer (sequence -> non-sequence).

    Args:
        num_inputs: n_0.
        dim: D.
        streams: the sequence streams, in the order their tokens are given to :meth:`forward`.
        num_layers: layers (every stream has as many).
        num_fm_outputs, num_lcb_outputs, fm_rank, mlp_hidden, mlp_layers: Wukong knobs (mlp_layers: the FMB MLP's depth).
    """

    def __init__(self, *, num_inputs: int, dim: int, streams: list[SequenceStream], num_layers: int, num_fm_outputs: int,
                 num_lcb_outputs: int, fm_rank: int, mlp_hidden: int, mlp_layers: int) -> None:
        super().__init__()
        self.streams = nn.ModuleList(streams)
        self.num_summary_tokens = sum(s.num_tokens for s in streams)
        widths = [num_inputs] + [num_fm_outputs + num_lcb_outputs] * num_layers
        self.interaction_arch = nn.ModuleList(
            WukongLayer(num_inputs=widths[i] + self.num_summary_tokens, dim=dim, num_fm_outputs=num_fm_outputs,
                        num_lcb_outputs=num_lcb_outputs, rank=fm_rank, mlp_hidden=mlp_hidden, mlp_layers=mlp_layers)
            for i in range(num_layers)
        )
        self.conditions = nn.ModuleList(nn.Linear(widths[i] * dim, dim) for i in range(num_layers))
        self.num_outputs = widths[-1]

    def forward(self, interaction: torch.Tensor, tokens: list[Jagged], target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """interaction (B, n_0, D), one Jagged (T_s, D) per stream, target (B, D) ->
        (interaction out (B, n_F + n_L, D), last layer's summaries (B, num_summary_tokens, D)).

        Raises:
            ValueError: not one token set per stream.
        """
        if len(tokens) != len(self.streams):
            raise ValueError(f"BranchedInterFormer has {len(self.streams)} streams, got {len(tokens)} token sets")
        states = [cast(SequenceStream, s).start(x) for s, x in zip(self.streams, tokens, strict=True)]
        summary = interaction.new_zeros((interaction.shape[0], 0, interaction.shape[2]))
        for layer, (wukong, condition) in enumerate(zip(self.interaction_arch, self.conditions, strict=True)):
            cond = condition(interaction.flatten(1))
            parts = []
            for i, stream in enumerate(self.streams):
                states[i], part = cast(SequenceStream, stream).step(layer, states[i], cond, target)
                parts.append(part)
            summary = torch.cat(parts, dim=1)
            interaction = wukong(torch.cat([interaction, summary], dim=1))
        return interaction, summary
