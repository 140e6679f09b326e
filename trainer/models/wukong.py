"""Wukong interaction layers: stacked factorization machines (Zhang et al. 2024, "Wukong: Towards a
Scaling Law for Large-Scale Recommendation", arXiv 2403.02545, §3).

Shape letters: B batch, n input embeddings of width d, k rank of the optimized FM, n_F and n_L
embeddings out of the FM block and the linear compression block.

One layer::

    X (B, n, d) ─┬─ FMB: X·(Xᵀ·Y) (B, n, k) ─ flatten ─ LayerNorm ─ MLP ─> (B, n_F, d) ─┐
                 ├─ LCB: W·X (B, n_L, d) ──────────────────────────────────────────────┤ concat
                 └─ residual (projected along the embedding axis when n != n_F + n_L) ─ + ─ LayerNorm ─> (B, n_F+n_L, d)

The optimized FM (§3.3) projects first: X·(Xᵀ·Y) with a learned Y (n, k) costs O(n·k·d) instead of
O(n²·d) for the full X·Xᵀ, and equals it when Y is the n×n identity.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.models.towers import mlp


def full_fm(x: torch.Tensor) -> torch.Tensor:
    """All pairwise dot products: x (B, n, d) -> X·Xᵀ (B, n, n)."""
    return torch.bmm(x, x.transpose(1, 2))


def low_rank_fm(x: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """Optimized FM of Wukong §3.3: x (B, n, d), projection Y (n, k) -> X·(Xᵀ·Y) (B, n, k).

    Raises:
        ValueError: Y's first dimension is not n.
    """
    if projection.dim() != 2 or projection.shape[0] != x.shape[1]:
        raise ValueError(f"projection must be (n={x.shape[1]}, k), got {tuple(projection.shape)}")
    return torch.bmm(x, torch.matmul(x.transpose(1, 2), projection))


class WukongLayer(nn.Module):
    """One Wukong layer (FMB ∥ LCB, residual, LayerNorm), §3.2-3.4.

    Args:
        num_inputs: n.
        dim: d.
        num_fm_outputs: n_F.
        num_lcb_outputs: n_L.
        rank: k of the optimized FM.
        mlp_hidden: width of the FMB's MLP.
        mlp_layers: hidden layers of the FMB's MLP (§3.2 has an MLP; 1 is gem_small's single layer).
    """

    def __init__(self, *, num_inputs: int, dim: int, num_fm_outputs: int, num_lcb_outputs: int, rank: int, mlp_hidden: int,
                 mlp_layers: int = 1) -> None:
        super().__init__()
        for name, value in (("num_inputs", num_inputs), ("dim", dim), ("num_fm_outputs", num_fm_outputs), ("rank", rank),
                            ("mlp_hidden", mlp_hidden), ("mlp_layers", mlp_layers)):
            if value < 1:
                raise ValueError(f"WukongLayer {name} must be >= 1, got {value}")
        if num_lcb_outputs < 0:
            raise ValueError(f"WukongLayer num_lcb_outputs must be >= 0, got {num_lcb_outputs}")
        self.num_inputs, self.dim = num_inputs, dim
        self.num_fm_outputs, self.num_lcb_outputs = num_fm_outputs, num_lcb_outputs
        self.projection = nn.Parameter(torch.randn(num_inputs, rank) / num_inputs**0.5)
        self.fm_norm = nn.LayerNorm(num_inputs * rank)
        self.fm_mlp = nn.Sequential(mlp([num_inputs * rank] + [mlp_hidden] * mlp_layers), nn.Linear(mlp_hidden, num_fm_outputs * dim))
        self.lcb = nn.Linear(num_inputs, num_lcb_outputs, bias=False)
        num_outputs = num_fm_outputs + num_lcb_outputs
        self.residual = None if num_outputs == num_inputs else nn.Linear(num_inputs, num_outputs, bias=False)
        self.out_norm = nn.LayerNorm(dim)

    @property
    def num_outputs(self) -> int:
        """n_F + n_L."""
        return self.num_fm_outputs + self.num_lcb_outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, n, d) float32 -> (B, n_F + n_L, d) float32.

        Raises:
            ValueError: x is not (B, n, d).
        """
        if x.dim() != 3 or x.shape[1:] != (self.num_inputs, self.dim):
            raise ValueError(f"WukongLayer input must be (B, {self.num_inputs}, {self.dim}), got {tuple(x.shape)}")
        batch = x.shape[0]
        fm = self.fm_mlp(self.fm_norm(low_rank_fm(x, self.projection).reshape(batch, -1)))
        fm = fm.view(batch, self.num_fm_outputs, self.dim)
        # Linear maps along the embedding axis (n): W (m, n) @ x (B, n, d) -> (B, m, d), as a batched matmul. Neither
        # nn.Linear on x transposed nor a broadcasting matmul: compiled in the GEM stack (torch 2.13, data-dependent
        # sizes), their backward views a transposed gradient as 2-D and fails (tests/trainer/test_device.py).
        lcb = torch.bmm(self.lcb.weight.expand(batch, -1, -1), x)
        residual = x if self.residual is None else torch.bmm(self.residual.weight.expand(batch, -1, -1), x)
        return self.out_norm(torch.cat([fm, lcb], dim=1) + residual)
