"""Ranking models of the trainer and the one factory that builds them from config.

Every model maps ``(sparse KJT, sequence KJT, dense (B, F) float32, domain_ids (B,) int64)`` to
logits (B, 2) float32 (click, conversion), and exposes ``sparse_arch`` (TorchRec tables, for
DistributedModelParallel) and ``dense_arch`` (the rest, for FSDP2), ``embedding_parameters()``,
``dense_parameters()``, ``num_dense`` and ``domains``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from trainer.config import TrainerConfig
from trainer.id_mapping import table_rows, table_widths
from trainer.models.baselines import DLRM, LogisticRegression
from trainer.models.gem import GemModel
from trainer.models.towers import RankingModel, encode_domains

if TYPE_CHECKING:
    from typing import TypeAlias

    from trainer.model import TwoTaskRanker

    Ranker: TypeAlias = RankingModel | TwoTaskRanker
    """A model :func:`build_model` returns (TwoTaskRanker, "ranker", predates RankingModel)."""

__all__ = ["build_model", "encode_domains", "GemModel", "DLRM", "LogisticRegression"]


def build_model(config: TrainerConfig, num_dense: int, domains: Sequence[str]) -> Ranker:
    """The model ``config.model`` names, sized by ``config``.

    Args:
        config: the trainer section (model, embedding_dim, num_embeddings, hidden_dims, tower_hidden; gem for GEM;
            ids.table_rows / table_widths for per-feature tables: LR's tables are 2 wide whatever the widths).
        num_dense: F, dense features per example.
        domains: K domain names of the training data (their order fixes the domain ids).

    Raises:
        ValueError: an unknown ``config.model``.
    """
    common: dict[str, Any] = {"num_embeddings": table_rows(config), "num_dense": num_dense}
    if config.model == "gem":
        return GemModel(config.gem, **common, embedding_dim=config.embedding_dim, domains=domains,
                        hidden_dims=config.hidden_dims, tower_hidden=config.tower_hidden,
                        embedding_widths=table_widths(config))
    if config.model == "dlrm":
        return DLRM(**common, embedding_dim=config.embedding_dim, domains=domains, hidden_dims=config.hidden_dims,
                    tower_hidden=config.tower_hidden, embedding_widths=table_widths(config))
    if config.model == "lr":
        return LogisticRegression(**common, domains=domains)
    if config.model == "ranker":
        from trainer.model import TwoTaskRanker

        return TwoTaskRanker(embedding_dim=config.embedding_dim, hidden_dims=config.hidden_dims, domains=domains, **common)
    raise ValueError(f"unknown trainer.model {config.model!r}; expected gem, dlrm, lr or ranker")
