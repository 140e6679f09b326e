"""Shared pieces of every model: the TorchRec embedding arch, domain ids and per-domain towers.

Shape letters: B batch, S = len(SPARSE_FEATURES) sparse features, D embedding dim, T = sum L_i
history tokens, K number of known domains, H tower input width.

Multi-domain heads follow GEM's "shared learning with domain-specific optimization" (Meta
engineering blog, Nov 2025; /work/shared/GEM.md): a shared tower sees every example and a
domain's own tower adds a residual for that domain only; a domain not seen in training
(``domain_id == K``) gets the shared tower alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

from sequences.schema import SPARSE_FEATURES

INIT_RANGE = 0.05
"""Uniform init bound of embedding rows; TorchRec's default (1/sqrt(rows)) is ~0.003 at 1e5 rows."""

SEQUENCE_TABLES = {"seq_item_ids": "t_item", "seq_categories": "t_category", "seq_event_types": "t_event_type"}
"""Sequence key -> table name; the candidate's item and category are looked up in the same tables."""

TIME_TABLE = "t_time_delta"
"""Table of the time-delta buckets (trainer.data.time_buckets) of both histories, ``time_buckets`` rows."""


TableRows: TypeAlias = int | Mapping[str, int]
"""Rows of the id tables: one count for every table, or feature name -> rows (trainer.id_mapping.table_rows)."""


TableWidths: TypeAlias = int | Mapping[str, int]
"""Widths of the id tables: one width for every table, or feature name -> width (trainer.id_mapping.table_widths)."""


def rows_of(num_embeddings: TableRows, feature: str) -> int:
    """Rows of ``feature``'s table; raises KeyError for a feature a mapping does not size."""
    return num_embeddings if isinstance(num_embeddings, int) else num_embeddings[feature]


def pad_width(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` (..., W) zero-padded on the right to (..., dim): a table narrower than the models' width D read as
    D wide, the fixed projection [I; 0] of mixed-dimension embeddings (Ginart et al. 2021, arXiv 1909.11810, §3),
    so dot products and sums with other D-wide rows are those of the W-dim rows. Raises ValueError when W > dim."""
    width = x.shape[-1]
    if width > dim:
        raise ValueError(f"a table {width} wide is wider than the models' width {dim}")
    return x if width == dim else nn.functional.pad(x, (0, dim - width))


def _init() -> dict:
    return {"weight_init_min": -INIT_RANGE, "weight_init_max": INIT_RANGE}


def sparse_bags(num_embeddings: TableRows, dim: TableWidths, *, sequence_pooling: PoolingType | None = None) -> EmbeddingBagCollection:
    """One pooled table per sparse feature (S tables of (rows of the feature, width of the feature)).

    With ``sequence_pooling`` set, also one pooled table per sequence key (DLRM's and LR's view of
    the history as a bag of ids).
    """
    tables = [
        EmbeddingBagConfig(name=f"t_{name}", embedding_dim=rows_of(dim, name), num_embeddings=rows_of(num_embeddings, name),
                           feature_names=[name], **_init())
        for name in SPARSE_FEATURES
    ]
    if sequence_pooling is not None:
        tables += [
            EmbeddingBagConfig(
                name=f"t_{key}", embedding_dim=rows_of(dim, key), num_embeddings=rows_of(num_embeddings, key), feature_names=[key],
                pooling=sequence_pooling, **_init()
            )
            for key in SEQUENCE_TABLES
        ]
    return EmbeddingBagCollection(tables=tables)


def linear_id_tables(num_embeddings: TableRows) -> EmbeddingBagCollection:
    """A logistic regression's id weights: :func:`sparse_bags` 2 wide (click, conversion), the history keys
    mean-pooled, every weight uniform in +-INIT_RANGE / 10 (near zero, as a fitted-from-scratch LR starts; McMahan
    et al. 2013, "Ad Click Prediction: a View from the Trenches", §3). Output (B, (S + Q) * 2) float32."""
    tables = sparse_bags(num_embeddings, 2, sequence_pooling=PoolingType.MEAN)
    with torch.no_grad():
        for p in tables.parameters():
            p.mul_(0.1)
    return tables


def sequence_tables(num_embeddings: TableRows, dim: int, *, time_buckets: int = 0, time_keys: Sequence[str] = ()) -> EmbeddingCollection:
    """Unpooled tables of the history keys: each gives jagged (T, dim) token embeddings; with ``time_buckets`` > 0
    also a table of that many rows for the ``time_keys`` (time-delta bucket ids). One ``dim`` for all: TorchRec's
    EmbeddingCollection requires it."""
    tables = [EmbeddingConfig(name=table, embedding_dim=dim, num_embeddings=rows_of(num_embeddings, key), feature_names=[key], **_init())
              for key, table in SEQUENCE_TABLES.items()]
    if time_buckets > 0:
        tables.append(EmbeddingConfig(name=TIME_TABLE, embedding_dim=dim, num_embeddings=time_buckets,
                                      feature_names=list(time_keys), **_init()))
    return EmbeddingCollection(tables=tables)


def merge_sequence_kjt(sparse: KeyedJaggedTensor, sequence: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """One KJT with the sparse keys followed by the sequence keys, for a single pooled EBC.

    Raises:
        ValueError: the two KJTs disagree on the batch size.
    """
    num_rows = sparse.stride()
    if sequence.stride() != num_rows:
        raise ValueError(f"sparse has B={num_rows} rows but sequence has B={sequence.stride()}; pass one batch's KJTs")
    # Only the history keys, which come first: extra keys (time buckets, same-domain history) are GEM's alone.
    keys = sequence.keys()[: len(SEQUENCE_TABLES)]
    lengths = sequence.lengths()[: len(keys) * num_rows]
    return KeyedJaggedTensor(
        keys=[*sparse.keys(), *keys],
        values=torch.cat([sparse.values(), sequence.values()[: int(lengths.sum())]]),
        lengths=torch.cat([sparse.lengths(), lengths]),
        stride=num_rows,
    )


def encode_domains(vocabulary: Sequence[str], domains: Sequence[str]) -> torch.Tensor:
    """(B,) int64 index of each domain name in ``vocabulary``; a name not in it maps to K = len(vocabulary)."""
    index = {name: i for i, name in enumerate(vocabulary)}
    return torch.tensor([index.get(d, len(vocabulary)) for d in domains], dtype=torch.int64)


def mlp(widths: Sequence[int], *, last_activation: bool = True) -> nn.Sequential:
    """Linear layers ``widths[0] -> widths[1] -> ...`` with ReLU between (and after the last when asked)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if last_activation or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def base_logits(base_rates: torch.Tensor) -> torch.Tensor:
    """(2,) float32 log-odds of ``base_rates`` (click, conversion).

    Why models start their output bias there: from a zero bias (p = 0.5) Adam walks a logit at about
    lr per step, so a 5% base rate (logit -2.9) takes ~1,000 steps at lr 3e-3, longer than the first
    increments of a continuous run; until then the loss gradient is dominated by calibration, not
    ranking ("init the final layer bias", Karpathy 2019, "A Recipe for Training Neural Networks").

    Raises:
        ValueError: a rate outside (0, 1) or not of shape (2,).
    """
    rates = torch.as_tensor(base_rates, dtype=torch.float64)
    if rates.shape != (2,) or not bool(((rates > 0) & (rates < 1)).all()):
        raise ValueError(f"base_rates must be (2,) rates in (0, 1) (click, conversion), got {rates.tolist()}")
    return torch.logit(rates).to(torch.float32)


class DomainTowers(nn.Module):
    """Per-domain click and conversion heads over a shared representation.

    ``logits = shared(x) + tower[domain](x)`` where ``tower[K]`` (unknown domain) is zero. Each
    tower is Linear(H, hidden) -> ReLU -> Linear(hidden, 2); all K domain towers run on every row
    (K is small) and each row keeps its own domain's output.

    Args:
        in_dim: H.
        hidden: tower width.
        num_domains: K known domains.
        outputs: logits per row (2: click and conversion; 1: one task's tower, see GEM's task towers).
    """

    def __init__(self, in_dim: int, hidden: int, num_domains: int, outputs: int = 2) -> None:
        super().__init__()
        self.num_domains = num_domains
        self.shared = mlp([in_dim, hidden, outputs], last_activation=False)
        bound1 = 1 / in_dim**0.5
        self.w1 = nn.Parameter(torch.empty(num_domains, in_dim, hidden).uniform_(-bound1, bound1))
        self.b1 = nn.Parameter(torch.zeros(num_domains, hidden))
        # Zero output weights: every domain starts as the shared tower and learns its residual.
        self.w2 = nn.Parameter(torch.zeros(num_domains, hidden, outputs))
        self.b2 = nn.Parameter(torch.zeros(num_domains, outputs))

    def forward(self, x: torch.Tensor, domain_ids: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
        """x (B, H) float32, domain_ids (B,) int64 in [0, K] -> logits (B, outputs) float32.

        ``validate``: check the ids' range (a host sync); the models pass False, their ids come from
        :func:`encode_domains`, in range by construction.

        Raises:
            ValueError: a domain id outside [0, K].
        """
        if domain_ids.shape != (x.shape[0],):
            raise ValueError(f"domain_ids must be ({x.shape[0]},), got {tuple(domain_ids.shape)}")
        if validate and domain_ids.numel() and (int(domain_ids.min()) < 0 or int(domain_ids.max()) > self.num_domains):
            raise ValueError(f"domain_ids must be in [0, {self.num_domains}] ({self.num_domains} = unknown), got {domain_ids.tolist()[:10]}")
        out = self.shared(x)
        if self.num_domains == 0:
            return out
        # Every row runs the towers, even when none is of a known domain (its residual is masked to 0): asking
        # whether any row is known would be a host sync in every forward, and a graph break under torch.compile.
        known = domain_ids < self.num_domains
        # K is small (a handful of domains): running every tower on every row is one matmul, cheaper
        # on CPU than gathering a (B, H, hidden) weight per row for a batched matmul.
        batch, k = x.shape[0], self.num_domains
        hidden = torch.relu(torch.einsum("bh,khd->bkd", x, self.w1) + self.b1)  # (B, K, hidden)
        all_towers = torch.einsum("bkd,kdo->bko", hidden, self.w2) + self.b2  # (B, K, outputs)
        ids = domain_ids.clamp(max=k - 1)
        residual = all_towers[torch.arange(batch, device=x.device), ids]
        return out + residual * known.unsqueeze(1).to(residual.dtype)

    def init_output_bias(self, logits: torch.Tensor) -> None:
        """Start the shared tower's output bias at ``logits`` (outputs,) float (the base rates' log-odds).

        The domain residuals start at zero (zero ``w2``, ``b2``), so every domain starts predicting the base
        rate. Raises ValueError when ``logits`` is not of shape (outputs,).
        """
        last = self.shared[-1]
        assert isinstance(last, nn.Linear)
        if logits.shape != last.bias.shape:
            raise ValueError(f"logits must be {tuple(last.bias.shape)}, got {tuple(logits.shape)}")
        with torch.no_grad():
            last.bias.copy_(logits.to(last.bias.dtype))


class RankingModel(nn.Module):
    """Base of every model: the split into ``sparse_arch`` (TorchRec tables) and ``dense_arch``.

    Subclasses set ``self.sparse_arch`` (a module whose submodules are the
    EmbeddingBagCollection / EmbeddingCollection, sharded by DMP) and ``self.dense_arch`` (all
    other parameters, wrapped by fully_shard), plus ``num_dense`` and ``domains``.
    """

    num_dense: int
    domains: tuple[str, ...]
    sparse_arch: nn.Module

    def embedding_parameters(self) -> list[nn.Parameter]:
        """Parameters of the id tables (optimised with Adagrad)."""
        return list(self.sparse_arch.parameters())

    def dense_parameters(self) -> list[nn.Parameter]:
        """Every other parameter (optimised with Adam)."""
        ids = {id(p) for p in self.embedding_parameters()}
        return [p for p in self.parameters() if id(p) not in ids]

    def training_logits(self, sparse: KeyedJaggedTensor, sequence: KeyedJaggedTensor, dense: torch.Tensor,
                        domain_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The (B, 2) float32 logits whose losses a training step sums (trainer.loop.train_step), the prediction's
        first: here the forward's alone (GEM's wide part on its own loss gives two, GemModel.training_logits)."""
        return (self(sparse, sequence, dense, domain_ids),)

    def init_output_bias(self, base_rates: torch.Tensor) -> None:
        """Start the output intercepts at the training base rates, where a model has one to set; a no-op here.

        Args:
            base_rates: (2,) float, click and conversion rates of the training split, in (0, 1).
        """

    def check_inputs(self, dense: torch.Tensor, domain_ids: torch.Tensor) -> None:
        """Raise ValueError unless dense is (B, F) and domain_ids is (B,) int64."""
        if dense.dim() != 2 or dense.shape[1] != self.num_dense:
            raise ValueError(f"dense must be (B, {self.num_dense}), got {tuple(dense.shape)}")
        if domain_ids.dtype != torch.int64 or domain_ids.shape != (dense.shape[0],):
            raise ValueError(
                f"domain_ids must be ({dense.shape[0]},) int64 (see trainer.models.encode_domains), "
                f"got {tuple(domain_ids.shape)} {domain_ids.dtype}"
            )
