"""A small two-task ranking model over sparse ids, a jagged behaviour sequence and dense features.

Shape letters: B batch, S sparse features, D embedding dim, F dense features, L_i history
length of example i, T = sum L_i.

    sparse KJT ──EmbeddingBagCollection (pooled)──> (B, S*D) ─┐
    sequence KJT ─EmbeddingCollection (unpooled)─> (T, D) ──┐ │
    candidate item+category ─────────> query (B, D) ─ target-aware attention pool (B, D)
                                                   mean pool (B, D) ──────────────────┤
    dense (B, F) ─────────────────────────────────────────────────────────────────────┤
                                                          MLP ─> logits (B, 2) (click, conversion)

The attention is DIN's idea (Zhou et al. 2018, "Deep Interest Network for Click-Through Rate
Prediction", §4.3) with a bilinear score instead of DIN's MLP score and a softmax within each
row. :func:`segment_softmax_pool` and :func:`segment_mean_pool` are compositions of the jagged
kernels (``kernels.softmax``, ``kernels.pooling``, reference backend).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

from kernels.pooling import segment_mean, segment_sum
from kernels.segments import token_rows
from kernels.softmax import jagged_softmax
from kernels.types import Jagged
from sequences.schema import SPARSE_FEATURES
from trainer.data import SEQUENCE_KEYS
from trainer.models.towers import TableRows, rows_of

_INIT_RANGE = 0.05
"""Uniform init bound of embedding rows; TorchRec's default (1/sqrt(rows)) is ~0.003 at 1e5 rows."""

_SEQ_TABLES = {"seq_item_ids": "t_item", "seq_categories": "t_category", "seq_event_types": "t_event_type"}


def segment_mean_pool(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Mean of each jagged row: values (T, D), offsets (B+1,) int64 -> (B, D); empty rows give 0. ``offsets`` are
    trusted (checked where the batch was built, trainer.data.validate_batch): nothing here syncs with the device."""
    return segment_mean(Jagged(values, offsets), validate=False)


def segment_softmax_pool(values: torch.Tensor, scores: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Softmax-weighted sum of each jagged row, without padding.

    Args:
        values: (T, D) float.
        scores: (T,) float, one logit per element.
        offsets: (B+1,) int64, row i is ``values[offsets[i]:offsets[i+1]]``.

    Returns:
        (B, D): ``sum_t softmax(scores of row i)_t * values_t``; an empty row gives zeros. ``offsets`` are trusted
        (checked where the batch was built, trainer.data.validate_batch).
    """
    rows = Jagged(values, offsets)
    weights = jagged_softmax(rows.with_values(scores), validate=False).values
    return segment_sum(rows.with_values(weights.unsqueeze(1) * values), validate=False)


class TwoTaskRanker(nn.Module):
    """Click and conversion logits for a batch (see the module docstring for the data flow).

    Args:
        num_embeddings: rows of the id tables (one count, or per feature).
        embedding_dim: D.
        num_dense: F.
        hidden_dims: widths of the shared MLP.
        domains: domain names, kept for the common model interface (trainer/models); this model
            has one shared head and ignores the domain.
    """

    def __init__(
        self, *, num_embeddings: TableRows, embedding_dim: int, num_dense: int, hidden_dims: tuple[int, ...], domains: Sequence[str] = ()
    ) -> None:
        super().__init__()
        self.domains = tuple(domains)
        init = {"weight_init_min": -_INIT_RANGE, "weight_init_max": _INIT_RANGE}
        self.sparse_arch = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=f"t_{name}", embedding_dim=embedding_dim, num_embeddings=rows_of(num_embeddings, name), feature_names=[name], **init
                )
                for name in SPARSE_FEATURES
            ]
        )
        self.sequence_arch = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name=table, embedding_dim=embedding_dim, num_embeddings=rows_of(num_embeddings, key), feature_names=[key], **init
                )
                for key, table in _SEQ_TABLES.items()
            ]
        )
        self.attention = nn.Linear(embedding_dim, embedding_dim, bias=False)
        layers: list[nn.Module] = []
        width = len(SPARSE_FEATURES) * embedding_dim + 2 * embedding_dim + num_dense
        for hidden in hidden_dims:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        self.mlp = nn.Sequential(*layers)
        self.heads = nn.Linear(width, 2)
        self.embedding_dim = embedding_dim
        self.num_dense = num_dense

    def embedding_parameters(self) -> list[nn.Parameter]:
        """Parameters of the id tables (optimised with Adagrad)."""
        return [*self.sparse_arch.parameters(), *self.sequence_arch.parameters()]

    def dense_parameters(self) -> list[nn.Parameter]:
        """Every other parameter (optimised with Adam)."""
        ids = {id(p) for p in self.embedding_parameters()}
        return [p for p in self.parameters() if id(p) not in ids]

    def sequence_summary(self, sequence: KeyedJaggedTensor, candidate: torch.Tensor) -> torch.Tensor:
        """Attention pool and mean pool of the history.

        Args:
            sequence: keys SEQUENCE_KEYS, the same lengths (B,) for every key.
            candidate: (B, D) query embedding of the candidate.

        Returns:
            (B, 2D): [attention pool, mean pool].
        """
        jagged = self.sequence_arch(sequence)
        values = sum(jagged[key].values() for key in SEQUENCE_KEYS)
        offsets = jagged[SEQUENCE_KEYS[0]].offsets()
        seg = token_rows(offsets, values.shape[0])
        scores = (self.attention(values) * candidate[seg]).sum(dim=1) / math.sqrt(self.embedding_dim)
        return torch.cat([segment_softmax_pool(values, scores, offsets), segment_mean_pool(values, offsets)], dim=1)

    def forward(
        self, sparse: KeyedJaggedTensor, sequence: KeyedJaggedTensor, dense: torch.Tensor, domain_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits (B, 2) float32, columns (click, conversion).

        Args:
            sparse: keys SPARSE_FEATURES, one id per example per key.
            sequence: keys SEQUENCE_KEYS, jagged histories.
            dense: (B, F) float32.
            domain_ids: (B,) int64, accepted for the common interface and ignored (one shared head).

        Raises:
            ValueError: ``dense`` has the wrong width.
        """
        if dense.dim() != 2 or dense.shape[1] != self.num_dense:
            raise ValueError(f"dense must be (B, {self.num_dense}), got {tuple(dense.shape)}")
        pooled = self.sparse_arch(sparse)
        sparse_emb = pooled.values()
        # The candidate shares the history's id space (trainer.data.HASH_NAMESPACE), so its query is
        # looked up in the sequence tables: attention compares like with like.
        item_rows = sparse["item_id"].values()
        category_rows = sparse["category"].values()
        tables = self.sequence_arch.embeddings
        candidate = tables["t_item"](item_rows) + tables["t_category"](category_rows)
        summary = self.sequence_summary(sequence, candidate)
        return self.heads(self.mlp(torch.cat([sparse_emb, summary, dense], dim=1)))
