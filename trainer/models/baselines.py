"""Baselines trained on the same batches as GEM: logistic regression and DLRM.

Shape letters: B batch, S sparse features, Q = len(SEQUENCE_KEYS) history keys, D embedding dim,
F dense features, K known domains.

- Logistic regression: one weight per hashed id per task (an EmbeddingBagCollection of width 2,
  the history keys mean-pooled as a bag of ids), a linear term on the dense features (from zero),
  a bias per domain and task. Logit = sum of those terms (McMahan et al. 2013, "Ad Click Prediction: a View
  from the Trenches", §3, without FTRL).
- DLRM (Naumov et al. 2019, "Deep Learning Recommendation Model for Personalization and
  Recommendation Systems", arXiv 1906.00091, §2-3): bottom MLP on dense features to width D,
  pooled embeddings of the sparse ids and of the history (mean pooled), dot interaction (all
  pairwise dot products, upper triangle) concatenated with the bottom output, top MLP, then the
  same per-domain towers as GEM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn
from torchrec import KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

from sequences.schema import SPARSE_FEATURES
from trainer.data import SEQUENCE_KEYS
from trainer.models.towers import (
    DomainTowers,
    RankingModel,
    TableRows,
    TableWidths,
    base_logits,
    linear_id_tables,
    merge_sequence_kjt,
    mlp,
    pad_width,
    sparse_bags,
)


class LogisticRegression(RankingModel):
    """Two logistic regressions (click, conversion) on hashed ids, dense features and the domain.

    Args:
        num_embeddings: rows of the id tables (one count, or per feature).
        num_dense: F.
        domains: K known domain names (unknown domains get no domain bias).
    """

    def __init__(self, *, num_embeddings: TableRows, num_dense: int, domains: Sequence[str]) -> None:
        super().__init__()
        self.num_dense, self.domains = num_dense, tuple(domains)
        self.sparse_arch = linear_id_tables(num_embeddings)
        domain_bias = nn.Embedding(len(self.domains) + 1, 2)
        self.dense_arch = nn.ModuleDict({"linear": nn.Linear(num_dense, 2), "domain_bias": domain_bias})
        nn.init.zeros_(domain_bias.weight)
        # Dense weights start at zero, as a fitted-from-scratch logistic regression does (nothing
        # breaks symmetry in a linear model). nn.Linear's default U(+-1/sqrt(F)) made the untrained
        # model rank rows by a random mix of informative counters: on the Taobao sample, where the
        # model scoring 92% of the rows has trained 13 steps, that ranking set click AUC (0.37 at
        # seed 0, 0.51-0.58 at seeds 1-3; 0.62 from zero); README "Comparing models".
        linear = cast(nn.Linear, self.dense_arch["linear"])
        nn.init.zeros_(linear.weight)
        nn.init.zeros_(linear.bias)

    def init_output_bias(self, base_rates: torch.Tensor) -> None:
        """Every domain's intercept (click, conversion) starts at the log-odds of ``base_rates`` (2,).

        Why: the intercept is one weight moved by Adam at ~lr per step; from 0 (p = 0.5) to a 1% base
        rate (logit -4.6) takes ~1,500 steps at lr 3e-3, more than one epoch of the Taobao sample
        (131 steps), so the model would stay miscalibrated (NE ~5) and rank by its bias noise. A
        fitted logistic regression's intercept sits at about the base rate's log-odds anyway.

        Raises:
            ValueError: a rate outside (0, 1) or not of shape (2,).
        """
        logits = base_logits(base_rates)
        weight = cast(nn.Embedding, self.dense_arch["domain_bias"]).weight
        with torch.no_grad():
            weight.copy_(logits.expand_as(weight))

    def forward(self, sparse: KeyedJaggedTensor, sequence: KeyedJaggedTensor, dense: torch.Tensor, domain_ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, 2) float32 (click, conversion); inputs as :class:`trainer.models.gem.GemModel`.

        Raises:
            ValueError: dense or domain_ids has the wrong shape.
        """
        self.check_inputs(dense, domain_ids)
        pooled = self.sparse_arch(merge_sequence_kjt(sparse, sequence)).values()
        weights = pooled.view(dense.shape[0], len(SPARSE_FEATURES) + len(SEQUENCE_KEYS), 2).sum(dim=1)
        return weights + self.dense_arch["linear"](dense) + self.dense_arch["domain_bias"](domain_ids)


class DLRMDenseArch(nn.Module):
    """Bottom MLP, dot interaction, top MLP, domain towers of :class:`DLRM`."""

    pair_rows: torch.Tensor
    pair_cols: torch.Tensor

    def __init__(self, *, dim: int, num_dense: int, num_sparse: int, num_domains: int, hidden_dims: Sequence[int], tower_hidden: int) -> None:
        super().__init__()
        self.dim, self.num_dense = dim, num_dense
        self.bottom = mlp([max(num_dense, 1), 4 * dim, dim])
        num_vectors = num_sparse + 1
        rows, cols = torch.triu_indices(num_vectors, num_vectors, offset=1)
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)
        self.top = mlp([dim + rows.numel(), *hidden_dims])
        self.towers = DomainTowers(hidden_dims[-1], tower_hidden, num_domains)

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor, domain_ids: torch.Tensor) -> torch.Tensor:
        """pooled (B, S+Q, D), dense (B, F), domain_ids (B,) -> logits (B, 2)."""
        if self.num_dense == 0:
            dense = dense.new_zeros((dense.shape[0], 1))
        bottom = self.bottom(dense)
        vectors = torch.cat([bottom.unsqueeze(1), pooled], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pair_rows, self.pair_cols]
        return self.towers(self.top(torch.cat([bottom, dots], dim=1)), domain_ids, validate=False)


class DLRM(RankingModel):
    """DLRM with dot interaction over the sparse ids and the mean-pooled history (Naumov et al. 2019).

    Args:
        num_embeddings: rows of the id tables (one count, or per feature).
        embedding_dim: D.
        embedding_widths: widths of the id tables (one, or per feature; at most D, narrower ones zero-padded to D
            before the dot interaction, :func:`trainer.models.towers.pad_width`); None: D.
        num_dense: F.
        domains: K known domain names.
        hidden_dims: top MLP widths.
        tower_hidden: width of each domain tower.
    """

    def __init__(
        self, *, num_embeddings: TableRows, embedding_dim: int, num_dense: int, domains: Sequence[str],
        hidden_dims: Sequence[int] = (64, 32), tower_hidden: int = 16, embedding_widths: TableWidths | None = None,
    ) -> None:
        super().__init__()
        self.num_dense, self.domains, self.dim = num_dense, tuple(domains), embedding_dim
        self.sparse_arch = sparse_bags(num_embeddings, embedding_dim if embedding_widths is None else embedding_widths,
                                       sequence_pooling=PoolingType.MEAN)
        self.dense_arch = DLRMDenseArch(
            dim=embedding_dim, num_dense=num_dense, num_sparse=len(SPARSE_FEATURES) + len(SEQUENCE_KEYS),
            num_domains=len(self.domains), hidden_dims=hidden_dims, tower_hidden=tower_hidden,
        )

    def forward(self, sparse: KeyedJaggedTensor, sequence: KeyedJaggedTensor, dense: torch.Tensor, domain_ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, 2) float32 (click, conversion); inputs as :class:`trainer.models.gem.GemModel`.

        Raises:
            ValueError: dense or domain_ids has the wrong shape.
        """
        self.check_inputs(dense, domain_ids)
        kt = self.sparse_arch(merge_sequence_kjt(sparse, sequence))
        # By key: a sharded EmbeddingBagCollection orders its output by shard, not by feature.
        pooled = torch.stack([pad_width(kt[key], self.dim) for key in (*SPARSE_FEATURES, *SEQUENCE_KEYS)], dim=1)
        return self.dense_arch(pooled, dense, domain_ids)

    def init_output_bias(self, base_rates: torch.Tensor) -> None:
        """The towers' output bias starts at the log-odds of ``base_rates`` (2,) (:func:`base_logits`, which raises)."""
        self.dense_arch.towers.init_output_bias(base_logits(base_rates))
