"""The GEM-style ranking model: TorchRec embeddings -> InterFormer(Wukong, pyramid sequence) -> per-domain towers.

Architecture after Meta's GEM (engineering blog "Generative Ads Model", Nov 2025; summary in
/work/shared/GEM.md): non-sequence interactions by Wukong (arXiv 2403.02545 §3), long sequences by
a pyramid of causal attention layers, sequence x non-sequence by InterFormer (arXiv 2411.09852 §3),
shared backbone with domain-specific towers.

Shape letters: B batch, S sparse features, D embedding dim, F dense features, T history tokens,
K known domains, n_d dense tokens.

    sparse KJT ── EmbeddingBagCollection ─> (B, S, D) ─────────────┐
    dense (B, F) ─ MLP ─> (B, n_d, D) ─────────────────────────────┤ X_0 (B, S + n_d, D)
    sequence KJT + candidate ids ─ EmbeddingCollection (one call) ─┬─ history: sum of keys (T, D) + recency ─ newest max_len
                                                                   └─ target: candidate item + category rows (B, D)
                   ─> InterFormer(X_0, tokens, target) ─> flatten [X_L ; S_L] ─ MLP ─ DomainTowers ─> (B, 2)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from kernels.segments import token_rows
from kernels.types import Jagged
from sequences.schema import SPARSE_FEATURES
from trainer.config import GemConfig
from trainer.data import SEQUENCE_KEYS
from trainer.models.interformer import InterFormer
from trainer.models.sequence import SequenceSummary, keep_newest
from trainer.models.towers import DomainTowers, RankingModel, TableRows, mlp, sequence_tables, sparse_bags

CANDIDATE_KEYS = {SEQUENCE_KEYS[0]: "item_id", SEQUENCE_KEYS[1]: "category"}
"""History key -> the sparse feature whose id is the candidate's entry in that key's table."""


class SparseArch(nn.Module):
    """The TorchRec tables of a model: ``bags`` (pooled, one id per sparse feature) and ``sequence`` (unpooled).

    The candidate's item and category are looked up in the history tables too, in the same
    EmbeddingCollection call as the history, so the target-attention query and the history
    tokens live in one embedding space (DIN, Zhou et al. 2018, §4.3: the candidate ad and the
    behaviours share the goods / category embeddings). With separate tables the model must
    learn to align two random spaces before "this item is in the history" can show in an
    attention score, which ~75k examples of rarely repeated items do not teach.

    One call also keeps the model shardable: TorchRec's fused optimiser steps once per lookup
    backward, so a second lookup of the same table would update a row twice where the
    one-process trainer updates it once (see trainer.distributed). Pooled outputs are read by
    key, since a sharded EmbeddingBagCollection orders them by shard.
    """

    def __init__(self, *, num_embeddings: TableRows, dim: int) -> None:
        super().__init__()
        self.bags = sparse_bags(num_embeddings, dim)
        self.sequence = sequence_tables(num_embeddings, dim)

    def forward(self, sparse: KeyedJaggedTensor, sequence: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (pooled (B, S, D), history tokens (T, D) summed over SEQUENCE_KEYS, offsets (B+1,) int64, target (B, D)).

        ``target`` is the candidate's item + category rows of the history tables.
        """
        kt = self.bags(sparse)
        pooled = torch.stack([kt[name] for name in SPARSE_FEATURES], dim=1)
        jagged, total = self.sequence(with_candidate(sparse, sequence)), int(sequence[SEQUENCE_KEYS[0]].offsets()[-1])
        values = sum(jagged[key].values()[:total] for key in SEQUENCE_KEYS)
        target = sum(jagged[key].values()[total:] for key in CANDIDATE_KEYS)
        return pooled, values, sequence[SEQUENCE_KEYS[0]].offsets(), target


def with_candidate(sparse: KeyedJaggedTensor, sequence: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """The history KJT with the candidate appended as B more rows per key (stride 2B).

    Rows 0..B-1 of each key are the histories, rows B..2B-1 the candidate: one id (its item or
    category, :data:`CANDIDATE_KEYS`) for the keys that have one, no id for the others, so in
    every key's jagged output the first sum(L_i) values are the history and the rest the candidate.

        seq_item_ids  lengths [L_0 .. L_B-1 | 1 .. 1]   values [history ids | item_id of each row]
        seq_event_types       [L_0 .. L_B-1 | 0 .. 0]          [history ids]

    Raises:
        ValueError: the two KJTs disagree on the batch size.
    """
    batch = sequence.stride()
    if sparse.stride() != batch:
        raise ValueError(f"sparse has B={sparse.stride()} rows but sequence has B={batch}; pass one batch's KJTs")
    values, lengths = [], []
    for key in SEQUENCE_KEYS:
        history = sequence[key]
        feature = CANDIDATE_KEYS.get(key)
        values += [history.values(), sparse[feature].values() if feature else history.values()[:0]]
        lengths += [history.lengths(), torch.full((batch,), 1 if feature else 0, dtype=torch.int64)]
    return KeyedJaggedTensor.from_lengths_sync(keys=list(SEQUENCE_KEYS), values=torch.cat(values), lengths=torch.cat(lengths))


class GemDenseArch(nn.Module):
    """Everything of :class:`GemModel` but the tables (wrapped by FSDP2 in distributed training).

    Args: as :class:`GemModel` (``dim`` is its ``embedding_dim``, ``num_domains`` K = len(domains)).
    """

    def __init__(
        self, config: GemConfig, *, dim: int, num_dense: int, num_domains: int, hidden_dims: Sequence[int],
        tower_hidden: int,
    ) -> None:
        super().__init__()
        self.dim, self.dense_tokens, self.max_sequence_len = dim, config.dense_tokens, config.max_sequence_len
        self.dense_embed = mlp([max(num_dense, 1), 4 * dim, config.dense_tokens * dim])
        self.recency = nn.Embedding(config.max_sequence_len, dim)
        nn.init.normal_(self.recency.weight, std=0.02)
        self.interformer = InterFormer(
            num_inputs=len(SPARSE_FEATURES) + config.dense_tokens, dim=dim, num_layers=config.layers,
            heads=config.heads, pyramid_ratio=config.pyramid_ratio, num_fm_outputs=config.fm_outputs,
            num_lcb_outputs=config.lcb_outputs, fm_rank=config.fm_rank, mlp_hidden=hidden_dims[0],
            backend=config.kernel_backend,
        )
        width = (self.interformer.num_outputs + SequenceSummary.num_tokens) * dim
        self.backbone = mlp([width, *hidden_dims])
        self.towers = DomainTowers(hidden_dims[-1], tower_hidden, num_domains)
        self.num_dense = num_dense

    def forward(
        self, pooled: torch.Tensor, seq_values: torch.Tensor, seq_offsets: torch.Tensor, target: torch.Tensor,
        dense: torch.Tensor, domain_ids: torch.Tensor,
    ) -> torch.Tensor:
        """pooled (B, S, D), seq_values (T, D), seq_offsets (B+1,), target (B, D), dense (B, F), domain_ids (B,) -> logits (B, 2)."""
        batch = pooled.shape[0]
        if self.num_dense == 0:
            dense = dense.new_zeros((batch, 1))
        dense_tok = self.dense_embed(dense).view(batch, self.dense_tokens, self.dim)
        tokens = keep_newest(Jagged(seq_values, seq_offsets), torch.full((batch,), self.max_sequence_len, dtype=torch.int64))
        rows = token_rows(tokens.offsets, tokens.num_tokens)
        # Recency: 0 for the newest token of a row, counting back.
        recency = tokens.offsets[1:][rows] - 1 - torch.arange(tokens.num_tokens, device=rows.device)
        tokens = tokens.with_values(tokens.values + self.recency(recency))
        interaction, _, summary = self.interformer(torch.cat([pooled, dense_tok], dim=1), tokens, target)
        hidden = self.backbone(torch.cat([interaction, summary], dim=1).flatten(1))
        return self.towers(hidden, domain_ids)


class GemModel(RankingModel):
    """Click and conversion logits of the GEM-style model (data flow in the module docstring).

    The architecture comes from ``config`` (``[trainer.gem]``); the arguments after it are the
    sizes GEM shares with the other models of trainer/models (``trainer.*``) and those of the data.

    Args:
        config: layers, heads, pyramid ratio, sequence length, dense tokens, Wukong widths, kernels.
        num_embeddings: rows of the id tables (one count, or per feature).
        embedding_dim: D (also the width of every interaction and sequence embedding); a multiple of ``config.heads``.
        num_dense: F, dense features per example (from the data).
        domains: K known domain names (from the data); index i is domain id i, K means unknown.
        hidden_dims: backbone MLP widths (the first is also the Wukong FMB's MLP width).
        tower_hidden: width of each domain tower.

    Raises:
        ValueError: ``embedding_dim`` is not a multiple of ``config.heads`` (the sequence layers check it).
    """

    def __init__(
        self, config: GemConfig, *, num_embeddings: TableRows, embedding_dim: int, num_dense: int, domains: Sequence[str],
        hidden_dims: Sequence[int], tower_hidden: int,
    ) -> None:
        super().__init__()
        self.num_dense, self.domains = num_dense, tuple(domains)
        self.sparse_arch = SparseArch(num_embeddings=num_embeddings, dim=embedding_dim)
        self.dense_arch = GemDenseArch(
            config, dim=embedding_dim, num_dense=num_dense, num_domains=len(self.domains), hidden_dims=hidden_dims,
            tower_hidden=tower_hidden,
        )

    def forward(self, sparse: KeyedJaggedTensor, sequence: KeyedJaggedTensor, dense: torch.Tensor, domain_ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, 2) float32, columns (click, conversion).

        Args:
            sparse: keys SPARSE_FEATURES, one id per example per key.
            sequence: keys SEQUENCE_KEYS, jagged histories, oldest first.
            dense: (B, F) float32.
            domain_ids: (B,) int64 in [0, K], see :func:`trainer.models.encode_domains`.

        Raises:
            ValueError: dense or domain_ids has the wrong shape.
        """
        self.check_inputs(dense, domain_ids)
        pooled, values, offsets, target = self.sparse_arch(sparse, sequence)
        return self.dense_arch(pooled, values, offsets, target, dense, domain_ids)
