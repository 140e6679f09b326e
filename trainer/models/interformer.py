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

import torch
from torch import nn

from kernels.types import Backend, Jagged
from trainer.models.sequence import PyramidSequenceEncoder, SequenceSummary
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
    """

    def __init__(
        self, *, num_inputs: int, dim: int, num_layers: int, heads: int, pyramid_ratio: float,
        num_fm_outputs: int, num_lcb_outputs: int, fm_rank: int, mlp_hidden: int, backend: Backend = "reference",
    ) -> None:
        super().__init__()
        self.sequence_arch = PyramidSequenceEncoder(dim=dim, heads=heads, num_layers=num_layers, ratio=pyramid_ratio, backend=backend)
        widths = [num_inputs] + [num_fm_outputs + num_lcb_outputs] * num_layers
        self.interaction_arch = nn.ModuleList(
            WukongLayer(
                num_inputs=widths[i] + SequenceSummary.num_tokens, dim=dim, num_fm_outputs=num_fm_outputs,
                num_lcb_outputs=num_lcb_outputs, rank=fm_rank, mlp_hidden=mlp_hidden,
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
