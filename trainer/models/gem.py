"""The GEM-style ranking model: TorchRec embeddings -> InterFormer(Wukong, sequence streams) -> task and domain towers.

Architecture after Meta's GEM (engineering blog "Generative Ads Model", Nov 2025; summary in
/work/shared/GEM.md): non-sequence interactions by Wukong (arXiv 2403.02545 §3), long sequences by
parallel branches over recency windows (GEM's pyramid-parallel structure), sequence x non-sequence by
InterFormer (arXiv 2411.09852 §3), shared backbone with task- and domain-specific towers.

Shape letters: B batch, S sparse features, D embedding dim, F dense features, T history tokens,
K known domains, n_d dense tokens.

    sparse KJT ── EmbeddingBagCollection ─> (B, S, D) ─────────────┐
    dense (B, F) ─ MLP ─> (B, n_d, D) ─────────────────────────────┤ X_0 (B, S + n_d, D)
    sequence KJT + candidate ids ─ EmbeddingCollection (one call) ─┬─ history: sum of keys + time bucket (T, D) + recency ─ newest max_len
                                                                   ├─ same-domain history, the same way (T', D)
                                                                   └─ target: candidate item + category rows (B, D)
      ─> BranchedInterFormer(X_0, [history, same-domain], target): per layer, each stream's branches (newest 16 / 64 /
         all) summarized by the Cross Arch (target attention, PMA, CLS, K newest; gated) and fed to a Wukong layer
      ─> flatten [X_L ; summaries] ─ MLP ─ per task: MLP ─ DomainTowers ─> (B, 2)

The ``gem_small`` preset (trainer.config.GEM_PRESETS) is the model before issue 18: 32 newest events, one
stream through a pyramid of causal attention layers (:class:`trainer.models.interformer.InterFormer`), summary
[target attention, newest token], one tower with two outputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor

from kernels.segments import token_rows
from kernels.types import Jagged
from sequences.schema import SPARSE_FEATURES
from trainer.config import GemConfig, TrainerConfig
from trainer.data import SAME_DOMAIN_KEYS, SEQUENCE_KEYS, TIME_BUCKETS_KEY
from trainer.ema import ParameterAverage
from trainer.id_mapping import FIRST_ID_ROW
from trainer.models.interformer import BranchedInterFormer, InterFormer
from trainer.models.sequence import SequenceStream, SequenceSummary, keep_newest
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
    sequence_tables,
    sparse_bags,
)

CANDIDATE_KEYS = {SEQUENCE_KEYS[0]: "item_id", SEQUENCE_KEYS[1]: "category"}
"""History key -> the sparse feature whose id is the candidate's entry in that key's table."""


class Lookups(NamedTuple):
    """What :class:`SparseArch` looks up for one batch."""

    pooled: torch.Tensor
    """(B, S, D) one row per sparse feature."""
    values: torch.Tensor
    """(T, D) history tokens: the sum over SEQUENCE_KEYS (and the time bucket) of each event's rows."""
    offsets: torch.Tensor
    """(B+1,) int64 offsets of ``values``."""
    target: torch.Tensor
    """(B, D) the candidate's item + category rows of the history tables."""
    same_values: torch.Tensor | None
    """(T', D) same-domain history tokens; None without the same-domain stream."""
    same_offsets: torch.Tensor | None
    """(B+1,) int64 offsets of ``same_values``."""
    history_means: torch.Tensor | None = None
    """(B, Q, D) each history key's rows averaged over the whole stored history (zeros for an empty one); None
    without ``pooled_history``."""
    wide: torch.Tensor | None = None
    """(B, 2) float32 the wide part's id weights (click, conversion), summed over the sparse features and the
    mean-pooled history keys; None without ``wide_ids``."""
    matches: torch.Tensor | None = None
    """(B, NUM_MATCH_FEATURES) float32 :func:`target_matches` over the whole stored history; None without
    ``target_match``."""


class SparseArch(nn.Module):
    """The TorchRec tables of a model: ``bags`` (pooled, one id per sparse feature) and ``sequence`` (unpooled).

    The candidate's item and category are looked up in the history tables too, in the same
    EmbeddingCollection call as the history, so the target-attention query and the history
    tokens live in one embedding space (DIN, Zhou et al. 2018, §4.3: the candidate ad and the
    behaviours share the goods / category embeddings). With separate tables the model must
    learn to align two random spaces before "this item is in the history" can show in an
    attention score, which ~75k examples of rarely repeated items do not teach. The same-domain
    history shares those tables, and the time-delta buckets of both histories share one table.

    One call also keeps the model shardable: TorchRec's fused optimiser steps once per lookup
    backward, so a second lookup of the same table would update a row twice where the
    one-process trainer updates it once (see trainer.distributed). Pooled outputs are read by
    key, since a sharded EmbeddingBagCollection orders them by shard.

    The pooled tables may be narrower than D (``widths``, trainer.id_mapping's cardinality rule): they are
    zero-padded to D (:func:`trainer.models.towers.pad_width`) before they are stacked. The history tables stay D
    wide: TorchRec's EmbeddingCollection takes one width for all its tables.

    ``history_len``: look up only each row's newest ``history_len`` events of every history key (the dense arch
    reads no more: :meth:`GemDenseArch._tokens`). The build stores up to ``build.max_seq_len`` (256) events and
    gem_small reads 32: looking all of them up cost ~6x the lookups, a sparse gradient row per event (zero for the
    events dropped) and the table optimiser's sort of them (about a third of a train step on the freshness lake).
    Outputs, and every table's update, are those of the whole lookup (tests/trainer/test_models_gem.py): the
    dropped events' gradient rows are exact zeros, which the row-wise Adagrad step adds nowhere. Ignored (None)
    with ``pooled_history``, which averages the whole history.

    Args:
        num_embeddings: rows of every id table; dim: D.
        time_buckets: rows of the time-delta table (0: none); same_domain: read the same-domain history.
        widths: width of each pooled id table (at most D); None: D.
        pooled_history: also return each history key's mean row over the whole history (``history_means``).
        wide_ids: also the wide part's id weights (``wide``): LR's 2-wide tables, one per sparse feature and history key.
        history_len: newest events of each history row looked up; None: all (the reference twin).
        wide_rng: the CPU RNG state (torch.get_rng_state) the wide tables are drawn from; None: the current one
            (:func:`wide_id_tables`).
        target_match: also return :func:`target_matches` of the whole history (``matches``); no parameters.
    """

    def __init__(self, *, num_embeddings: TableRows, dim: int, time_buckets: int = 0, same_domain: bool = False,
                 widths: TableWidths | None = None, pooled_history: bool = False, wide_ids: bool = False,
                 history_len: int | None = None,
                 wide_rng: torch.Tensor | None = None, target_match: bool = False) -> None:
        super().__init__()
        self.dim, self.time_buckets, self.same_domain, self.pooled_history = dim, time_buckets, same_domain, pooled_history
        self.target_match = target_match
        self.history_len = None if pooled_history else history_len
        self.keys = [*SEQUENCE_KEYS, *([TIME_BUCKETS_KEY] if time_buckets else [])]
        self.bags = sparse_bags(num_embeddings, dim if widths is None else widths)
        # TorchRec's EmbeddingCollection needs one width for all its tables: the history tables stay D wide.
        self.sequence = sequence_tables(num_embeddings, dim, time_buckets=time_buckets, time_keys=[TIME_BUCKETS_KEY])
        self.wide = wide_id_tables(num_embeddings, wide_rng) if wide_ids else None

    def forward(self, sparse: KeyedJaggedTensor, sequence: KeyedJaggedTensor) -> Lookups:
        """The batch's :class:`Lookups`; the keys of SEQUENCE_EXTRA_KEYS a batch lacks read as unknown time buckets
        and empty same-domain histories."""
        kt = self.bags(sparse)
        pooled = torch.stack([pad_width(kt[name], self.dim) for name in SPARSE_FEATURES], dim=1)
        matches = target_matches(sparse, sequence) if self.target_match else None  # the whole history, before the cut
        history = sequence if self.history_len is None else newest_ids(sequence, self.history_len)
        batch, main = history.stride(), history[SEQUENCE_KEYS[0]]
        found = self.sequence(with_candidate(sparse, history, self.keys, self.time_buckets, same_domain=self.same_domain))
        jagged = {key: found[key].values() for key in self.keys}
        total = int(main.offsets()[-1])
        values = _total([jagged[key][:total] for key in self.keys])
        target = _total([jagged[key][total: total + batch] for key in CANDIDATE_KEYS])
        means = (torch.stack([segment_mean(jagged[key][:total], main.offsets()) for key in SEQUENCE_KEYS], dim=1)
                 if self.pooled_history else None)
        wide = None if self.wide is None else self.wide(merge_sequence_kjt(sparse, sequence)).values().view(batch, -1, 2).sum(1)
        if not self.same_domain:
            return Lookups(pooled, values, main.offsets(), target, None, None, means, wide, matches)
        # Rows 2B..3B-1 of every key: the same-domain history, after each key's candidate rows.
        first = found[SEQUENCE_KEYS[0]].offsets()
        same_offsets = first[2 * batch:] - first[2 * batch]
        start = {key: total + (batch if key in CANDIDATE_KEYS else 0) for key in self.keys}
        same_values = _total([jagged[key][start[key]:] for key in self.keys])
        return Lookups(pooled, values, main.offsets(), target, same_values, same_offsets, means, wide, matches)


NUM_MATCH_FEATURES = 3
"""Columns of :func:`target_matches`."""


def target_matches(sparse: KeyedJaggedTensor, sequence: KeyedJaggedTensor) -> torch.Tensor:
    """(B, 3) float32 how the candidate recurs in each row's history: log1p(events of its item), log1p(events of
    its category), and that category count over the history's length (0 for an empty history).

    Ids are compared as the rows they map to (``trainer.id_mapping``: a candidate and its history share a
    namespace, so one id gives one row); rows below ``FIRST_ID_ROW`` (2: the null id, and a managed mapping's OOV
    row, which holds many ids) never match. Under hashing, two ids sharing a row match (the collision rate of the
    run report), and ids hashed to row 1 never do (one row of ``trainer.num_embeddings``). The counts are
    exact for a jagged history of any length, an empty row included; no parameters, no gradient.

    Args:
        sparse: keys include ``item_id`` and ``category``, one id per example (B rows).
        sequence: keys include ``seq_item_ids`` and ``seq_categories``, oldest first (stride B).
    """
    batch = sequence.stride()
    main = sequence[SEQUENCE_KEYS[0]]
    # The history keys share their lengths (trainer.data checks them against seq_length): one row index serves both.
    rows = token_rows(main.offsets(), main.values().shape[0])
    counts = []
    for key, feature in CANDIDATE_KEYS.items():
        ids = sequence[key].values()
        hit = (ids == sparse[feature].values()[rows]) & (ids >= FIRST_ID_ROW)
        counts.append(torch.zeros(batch, dtype=torch.float32, device=ids.device).index_add_(0, rows, hit.float()))
    item, category = counts
    length = main.lengths().clamp(min=1).float()
    return torch.stack([torch.log1p(item), torch.log1p(category), category / length], dim=1)


def newest_ids(sequence: KeyedJaggedTensor, count: int) -> KeyedJaggedTensor:
    """``sequence`` with each row of every key cut to its newest ``count`` ids (its tail: histories are stored
    oldest first); keys, stride and the order of the ids kept are ``sequence``'s. Values (sum min(L, count),) int64.

    Raises:
        ValueError: ``count`` < 0.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    lengths = sequence.lengths()
    kept = keep_newest(Jagged(sequence.values(), sequence.offsets()), torch.full_like(lengths, count), validate=False)
    return KeyedJaggedTensor(keys=sequence.keys(), values=kept.values, lengths=kept.lengths, stride=sequence.stride())


def wide_id_tables(num_embeddings: TableRows, rng_state: torch.Tensor | None = None) -> EmbeddingBagCollection:
    """The id tables of GEM's full wide part: LR's (:func:`trainer.models.towers.linear_id_tables`).

    Drawn from a fork of the RNG, at ``rng_state`` (a ``torch.get_rng_state()``) when given, else at the current
    state: every other parameter, and the data order, stay those of the same seed without them. GEM passes the state
    its construction started from under ``wide_loss = "own"``, where the LR baseline draws its tables too, so the
    wide part starts as the LR of the same seed, weight for weight. Their own tables, not rows of the deep part's: an
    id's linear weight moves by its own gradient, as LR's.
    """
    with torch.random.fork_rng(devices=[]):
        if rng_state is not None:
            torch.set_rng_state(rng_state)
        return linear_id_tables(num_embeddings)


def segment_mean(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(B, D) mean of each row's values: values (T, D), offsets (B+1,) int64; an empty row gives zeros.

    What DLRM's mean-pooled history bags compute (TorchRec ``PoolingType.MEAN``), on the rows GEM's history tables
    already looked up.
    """
    batch = offsets.shape[0] - 1
    rows = token_rows(offsets, values.shape[0])
    sums = values.new_zeros((batch, values.shape[1])).index_add(0, rows, values)
    lengths = (offsets[1:] - offsets[:-1]).clamp(min=1).to(values.dtype)
    return sums / lengths.unsqueeze(1)


def _total(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The element-wise sum of one or more tensors of one shape."""
    out = parts[0]
    for part in parts[1:]:
        out = out + part
    return out


SAME_DOMAIN_OF = dict(zip((*SEQUENCE_KEYS, TIME_BUCKETS_KEY), SAME_DOMAIN_KEYS, strict=True))
"""History key -> its same-domain twin (looked up as more rows of the history key: same table, one lookup)."""

TIME_KEYS = (TIME_BUCKETS_KEY, SAME_DOMAIN_KEYS[3])
"""The time-bucket keys (of the history and of the same-domain history)."""


def with_candidate(sparse: KeyedJaggedTensor, sequence: KeyedJaggedTensor, keys: Sequence[str] = SEQUENCE_KEYS,
                   time_buckets: int = 0, *, same_domain: bool = False) -> KeyedJaggedTensor:
    """The history KJT with the candidate appended as B more rows per key (stride 2B), and with ``same_domain`` the
    same-domain history as B more after them (stride 3B).

    Rows 0..B-1 of each key are the histories, rows B..2B-1 the candidate: one id (its item or
    category, :data:`CANDIDATE_KEYS`) for the keys that have one, no id for the others, so in
    every key's jagged output the first sum(L_i) values are the history and the rest the candidate.

        seq_item_ids  lengths [L_0 .. L_B-1 | 1 .. 1]   values [history ids | item_id of each row]
        seq_event_types       [L_0 .. L_B-1 | 0 .. 0]          [history ids]

    ``keys`` may add the time-bucket key: absent from ``sequence`` it gets bucket 0 (unknown) for every event;
    buckets are clipped to ``time_buckets - 1``. A same-domain key absent from ``sequence`` gives empty rows.
    Riding in the history key's rows, the same-domain ids are looked up in the same table by the same call (one
    fused-optimiser update per row, as for the candidate; a second feature on the table was updated twice when
    sharded).

    Raises:
        ValueError: the two KJTs disagree on the batch size.
    """
    batch = sequence.stride()
    if sparse.stride() != batch:
        raise ValueError(f"sparse has B={sparse.stride()} rows but sequence has B={batch}; pass one batch's KJTs")
    present = set(sequence.keys())
    main = sequence[SEQUENCE_KEYS[0]]
    none = torch.zeros(batch, dtype=torch.int64, device=main.lengths().device)

    def rows(key: str) -> tuple[torch.Tensor, torch.Tensor]:
        if key in present:
            values, lengths = sequence[key].values(), sequence[key].lengths()
        elif key == TIME_BUCKETS_KEY:  # the unknown bucket for every event
            values, lengths = torch.zeros_like(main.values()), main.lengths()
        elif key == SAME_DOMAIN_KEYS[3] and SAME_DOMAIN_KEYS[0] in present:
            same = sequence[SAME_DOMAIN_KEYS[0]]
            values, lengths = torch.zeros_like(same.values()), same.lengths()
        else:
            values, lengths = main.values()[:0], none
        return (values.clamp(max=time_buckets - 1) if key in TIME_KEYS else values), lengths

    values, lengths = [], []
    for key in keys:
        feature = CANDIDATE_KEYS.get(key)
        history_values, history_lengths = rows(key)
        values += [history_values, sparse[feature].values() if feature else history_values[:0]]
        lengths += [history_lengths, torch.ones_like(none) if feature else none]
        if same_domain:
            same_values, same_lengths = rows(SAME_DOMAIN_OF[key])
            values.append(same_values)
            lengths.append(same_lengths)
    return KeyedJaggedTensor.from_lengths_sync(keys=list(keys), values=torch.cat(values), lengths=torch.cat(lengths))


class GemDenseArch(nn.Module):
    """Everything of :class:`GemModel` but the tables (wrapped by FSDP2 in distributed training).

    Two sequence archs: with ``config.recency_branches`` the published shape (:class:`BranchedInterFormer` over
    :class:`SequenceStream` branches, the history and optionally the same-domain history); without, gem_small's
    pyramid (:class:`InterFormer`). Args: as :class:`GemModel` (``config`` resolved, ``dim`` is its
    ``embedding_dim``, ``num_domains`` K = len(domains)).
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
        self.pooled_history = config.pooled_history
        num_inputs = (len(SPARSE_FEATURES) + config.dense_tokens + (len(SEQUENCE_KEYS) if config.pooled_history else 0)
                      + config.target_match)
        self.interformer: InterFormer | BranchedInterFormer
        if config.recency_branches:
            streams = [
                SequenceStream(dim=dim, heads=config.heads, num_layers=config.layers, windows=config.recency_branches,
                               max_len=config.max_sequence_len, attention_len=config.attention_len,
                               cross=config.interformer_cross, cls=config.cls_tokens, pma=config.pma_tokens,
                               recent=config.recent_tokens, pffn_rank=config.personalized_ffn_rank,
                               backend=config.kernel_backend)
                for _ in range(1 + config.same_domain_stream)
            ]
            self.interformer = BranchedInterFormer(
                num_inputs=num_inputs, dim=dim, streams=streams, num_layers=config.layers,
                num_fm_outputs=config.fm_outputs, num_lcb_outputs=config.lcb_outputs, fm_rank=config.fm_rank,
                mlp_hidden=hidden_dims[0], mlp_layers=config.fmb_mlp_layers,
            )
            summary_tokens = self.interformer.num_summary_tokens
        else:
            self.interformer = InterFormer(
                num_inputs=num_inputs, dim=dim, num_layers=config.layers,
                heads=config.heads, pyramid_ratio=config.pyramid_ratio, num_fm_outputs=config.fm_outputs,
                num_lcb_outputs=config.lcb_outputs, fm_rank=config.fm_rank, mlp_hidden=hidden_dims[0],
                backend=config.kernel_backend, pffn_rank=config.personalized_ffn_rank, mlp_layers=config.fmb_mlp_layers,
            )
            summary_tokens = SequenceSummary.num_tokens
        width = (self.interformer.num_outputs + summary_tokens) * dim
        self.backbone = mlp([width, *hidden_dims])
        self.towers: nn.Module
        if config.task_towers:
            # A tower per task on the shared backbone: conversion and click stop competing for one tower's units.
            self.task_layers = nn.ModuleList(mlp([hidden_dims[-1], hidden_dims[-1]]) for _ in range(2))
            self.towers = nn.ModuleList(DomainTowers(hidden_dims[-1], tower_hidden, num_domains, outputs=1) for _ in range(2))
        else:
            self.towers = DomainTowers(hidden_dims[-1], tower_hidden, num_domains)
        self.num_dense = num_dense
        # The wide part (Wide & Deep §3): a logistic regression on the dense features beside the deep stack, from zero
        # as LR's (trainer.models.baselines), so the untrained model is the deep part alone. skip_init: no draw from
        # the RNG, so every other parameter and the data order are those of the same seed without it.
        self.wide = nn.utils.skip_init(nn.Linear, max(num_dense, 1), 2) if config.wide_mode else None
        if self.wide is not None:
            nn.init.zeros_(self.wide.weight)
            nn.init.zeros_(self.wide.bias)
        # "full" adds LR's domain bias, from zero: the towers' output bias already starts at the base rates' log-odds.
        self.wide_bias = nn.utils.skip_init(nn.Embedding, num_domains + 1, 2) if config.wide_mode == "full" else None
        if self.wide_bias is not None:
            nn.init.zeros_(self.wide_bias.weight)
        # The deep gate (trainer.gem.deep_gate; ReZero / SkipInit, sources in GemConfig.deep_gate): one scalar per task
        # times the deep logits, from 0, so the untrained model is its wide part and the deep part's parameters get a
        # gradient only once the gate's own gradient (the deep logit's covariance with the residual) has opened it.
        self.deep_gate = nn.Parameter(torch.zeros(2)) if config.deep_gate else None
        self.deep_shrinkage = config.deep_shrinkage
        # Target-match counts (trainer.gem.target_match): one Wukong token, and a linear term of the wide part from
        # zero (trained with it), made last so every other parameter draws what it draws without them.
        self.match_embed = mlp([NUM_MATCH_FEATURES, 4 * dim, dim]) if config.target_match else None
        joint_wide = config.target_match and config.wide_mode is not None and config.wide_loss == "joint"
        self.match_wide = nn.utils.skip_init(nn.Linear, NUM_MATCH_FEATURES, 2, bias=False) if joint_wide else None
        if self.match_wide is not None:
            nn.init.zeros_(self.match_wide.weight)

    def _tokens(self, values: torch.Tensor, offsets: torch.Tensor) -> Jagged:
        """The newest max_sequence_len tokens of each row, plus the embedding of their recency (0: the newest)."""
        batch = offsets.shape[0] - 1
        keep = torch.full((batch,), self.max_sequence_len, dtype=torch.int64, device=offsets.device)
        tokens = keep_newest(Jagged(values, offsets), keep, validate=False)
        rows = token_rows(tokens.offsets, tokens.num_tokens)
        recency = tokens.offsets[1:][rows] - 1 - torch.arange(tokens.num_tokens, device=rows.device)
        return tokens.with_values(tokens.values + self.recency(recency))

    def forward(
        self, pooled: torch.Tensor, seq_values: torch.Tensor, seq_offsets: torch.Tensor, target: torch.Tensor,
        dense: torch.Tensor, domain_ids: torch.Tensor, same_values: torch.Tensor | None = None,
        same_offsets: torch.Tensor | None = None, history_means: torch.Tensor | None = None,
        wide_ids: torch.Tensor | None = None, matches: torch.Tensor | None = None, *, parts: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """pooled (B, S, D), seq_values (T, D), seq_offsets (B+1,), target (B, D), dense (B, F), domain_ids (B,),
        same-domain same_values (T', D) and same_offsets (B+1,) (with the same-domain stream), history_means
        (B, Q, D) (with ``pooled_history``), wide_ids (B, 2) the summed id weights (with ``wide = "full"``,
        :attr:`Lookups.wide`), matches (B, NUM_MATCH_FEATURES) (with ``target_match``, :attr:`Lookups.matches`)
        -> logits (B, 2): the deep part's (times the gate and ``deep_shrinkage``) plus the wide part's (with the
        target-match term). ``parts``: the pair (deep, wide) of (B, 2) float32 instead of their sum (the wide part needs
        ``wide``), for ``wide_loss = "own"``'s two losses (:meth:`GemModel.training_logits`).

        Raises:
            ValueError: the same-domain stream, ``pooled_history``, ``target_match`` or the full wide part is on and
                its input is missing.
        """
        batch = pooled.shape[0]
        if self.num_dense == 0:
            dense = dense.new_zeros((batch, 1))
        dense_tok = self.dense_embed(dense).view(batch, self.dense_tokens, self.dim)
        inputs = [pooled, dense_tok]
        if self.pooled_history:
            if history_means is None:
                raise ValueError("this GEM reads the whole history's mean rows (pooled_history): pass history_means")
            inputs.insert(1, history_means)
        if self.match_embed is not None:
            if matches is None:
                raise ValueError("this GEM reads the candidate's target-match counts (target_match): pass matches")
            inputs.append(self.match_embed(matches).unsqueeze(1))
        interaction_in = torch.cat(inputs, dim=1)
        tokens = self._tokens(seq_values, seq_offsets)
        if isinstance(self.interformer, BranchedInterFormer):
            streams = [tokens]
            if len(self.interformer.streams) > 1:
                if same_values is None or same_offsets is None:
                    raise ValueError("this GEM reads the same-domain history: pass same_values and same_offsets")
                streams.append(self._tokens(same_values, same_offsets))
            interaction, summary = self.interformer(interaction_in, streams, target)
        else:
            interaction, _, summary = self.interformer(interaction_in, tokens, target)
        hidden = self.backbone(torch.cat([interaction, summary], dim=1).flatten(1))
        if isinstance(self.towers, nn.ModuleList):
            logits = torch.cat([tower(layer(hidden), domain_ids, validate=False)
                                for layer, tower in zip(self.task_layers, self.towers, strict=True)], dim=1)
        else:
            logits = self.towers(hidden, domain_ids, validate=False)
        if self.deep_gate is not None:
            logits = logits * self.deep_gate
        if self.deep_shrinkage != 1:
            logits = logits * self.deep_shrinkage
        if parts:
            return logits, self._wide(dense, domain_ids, wide_ids)
        if self.wide is None:
            return logits
        wide = self._wide(dense, domain_ids, wide_ids)
        return logits + (wide if self.match_wide is None or matches is None else wide + self.match_wide(matches))

    def _wide(self, dense: torch.Tensor, domain_ids: torch.Tensor, wide_ids: torch.Tensor | None) -> torch.Tensor:
        """(B, 2) the wide part's logits: the dense term, plus with "full" the domain bias and the id weights (summed
        in LR's order, trainer.models.baselines.LogisticRegression.forward, so "own"'s wide part is LR's to the bit).

        Raises:
            ValueError: the model has no wide part, or its part is "full" and ``wide_ids`` is None.
        """
        if self.wide is None:
            raise ValueError("this GEM has no wide part (trainer.gem.wide = false)")
        if self.wide_bias is None:
            return self.wide(dense)
        if wide_ids is None:
            raise ValueError("this GEM's wide part is LR's (trainer.gem.wide = \"full\"): pass wide_ids")
        return wide_ids + self.wide(dense) + self.wide_bias(domain_ids)


def dense_param_groups(tc: TrainerConfig, named: Iterable[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
    """Adam parameter groups of a model's dense parameters ``named`` (name, parameter): GEM's wide part
    (``dense_arch.wide`` and ``dense_arch.wide_bias``, :class:`GemDenseArch`) and its deep gate (``dense_arch.deep_gate``)
    at ``tc.wide_learning_rate``, the rest at
    ``tc.dense_learning_rate`` with ``tc.dense_weight_decay``; one group when there is no wide part (every model but GEM with ``trainer.gem.wide``).
    The full wide part's id tables are tables (``sparse_arch.wide``): the table optimiser's, not Adam's."""
    deep: list[nn.Parameter] = []
    wide: list[nn.Parameter] = []
    for name, param in named:
        parts = name.split(".")
        (wide if parts[0] == "dense_arch" and parts[1:2] in (["wide"], ["wide_bias"], ["deep_gate"], ["match_wide"])
         else deep).append(param)
    groups: list[dict[str, Any]] = [{"params": deep, "lr": tc.dense_learning_rate, "weight_decay": tc.dense_weight_decay}]
    return groups + ([{"params": wide, "lr": tc.wide_learning_rate}] if wide else [])


class GemModel(RankingModel):
    """Click and conversion logits of the GEM-style model (data flow in the module docstring).

    The architecture comes from ``config`` (``[trainer.gem]``, its preset filling unset keys); the arguments
    after it are the sizes GEM shares with the other models of trainer/models (``trainer.*``) and those of the
    data.

    Args:
        config: preset, layers, heads, sequence length and branches, streams, Cross Arch, Wukong widths, kernels.
        num_embeddings: rows of the id tables (one count, or per feature).
        embedding_widths: widths of the id tables (one, or per feature; at most D, narrower ones zero-padded to D);
            None: D.
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
        hidden_dims: Sequence[int], tower_hidden: int, embedding_widths: TableWidths | None = None,
    ) -> None:
        super().__init__()
        config = config.resolved()
        self.num_dense, self.domains, self.wide_loss = num_dense, tuple(domains), config.wide_loss
        # "own": the wide tables drawn where LR's are, from the state the model's construction starts at.
        start = torch.get_rng_state() if config.wide_loss == "own" else None
        self.sparse_arch = SparseArch(num_embeddings=num_embeddings, dim=embedding_dim, time_buckets=config.time_delta_buckets,
                                      same_domain=config.same_domain_stream, widths=embedding_widths,
                                      pooled_history=config.pooled_history, wide_ids=config.wide_mode == "full",
                                      history_len=config.max_sequence_len,
                                      wide_rng=start, target_match=config.target_match)
        self.dense_arch = GemDenseArch(
            config, dim=embedding_dim, num_dense=num_dense, num_domains=len(self.domains), hidden_dims=hidden_dims,
            tower_hidden=tower_hidden,
        )
        # Evaluation's EMA of the dense parameters (trainer.gem.ema_decay), registered last: no RNG draw, so every
        # parameter and the data order are those of the same seed without it.
        self.param_average = None if config.ema_decay is None else ParameterAverage(self.dense_parameters(), config.ema_decay)

    def forward(self, sparse: KeyedJaggedTensor, sequence: KeyedJaggedTensor, dense: torch.Tensor, domain_ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, 2) float32, columns (click, conversion).

        Args:
            sparse: keys SPARSE_FEATURES, one id per example per key.
            sequence: keys SEQUENCE_KEYS (then optionally SEQUENCE_EXTRA_KEYS), jagged histories, oldest first.
            dense: (B, F) float32.
            domain_ids: (B,) int64 in [0, K], see :func:`trainer.models.encode_domains`.

        Raises:
            ValueError: dense or domain_ids has the wrong shape.
        """
        self.check_inputs(dense, domain_ids)
        found = self.sparse_arch(sparse, sequence)
        return self.dense_arch(found.pooled, found.values, found.offsets, found.target, dense, domain_ids,
                               found.same_values, found.same_offsets, found.history_means, found.wide, found.matches)

    def training_logits(self, sparse: KeyedJaggedTensor, sequence: KeyedJaggedTensor, dense: torch.Tensor,
                        domain_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The (B, 2) float32 logits whose losses a training step sums, the prediction's first (inputs as
        :meth:`forward`). ``wide_loss = "joint"``: the forward's alone. ``"own"``: (wide.detach() + deep, wide), so
        the wide part's gradient is its own loss's alone, LR's (Friedman 2001, §3's stagewise fit; GemConfig.wide_loss),
        and the deep part's is that of the summed prediction with the wide part held fixed.

        Raises:
            ValueError: as :meth:`forward`.
        """
        if self.wide_loss == "joint":
            return (self(sparse, sequence, dense, domain_ids),)
        self.check_inputs(dense, domain_ids)
        found = self.sparse_arch(sparse, sequence)
        deep, wide = self.dense_arch(found.pooled, found.values, found.offsets, found.target, dense, domain_ids,
                                     found.same_values, found.same_offsets, found.history_means, found.wide, found.matches,
                                     parts=True)
        return wide.detach() + deep, wide

    def init_output_bias(self, base_rates: torch.Tensor) -> None:
        """Every output (one tower's two, or each task tower's one) starts at the log-odds of ``base_rates`` (2,)
        (:func:`trainer.models.towers.base_logits`, which raises ValueError on a bad rate). With the deep gate the
        wide part's bias starts there instead, outside the gate, and the towers' output bias at zero (a deep logit
        centred on 0 as the gate opens): the untrained model is a logistic regression at the base rates, as LR's
        intercepts start. With ``wide_loss = "own"`` the wide part's domain bias starts there, every row (LR's start),
        and the towers' output bias at zero: the deep part is a residual on top of that LR."""
        logits = base_logits(base_rates)
        arch = self.dense_arch
        if self.wide_loss == "own":
            assert arch.wide_bias is not None  # GemConfig refuses "own" without wide = "full"
            with torch.no_grad():
                arch.wide_bias.weight.copy_(logits.expand_as(arch.wide_bias.weight))
            logits = torch.zeros_like(logits)
        elif arch.deep_gate is not None:
            assert arch.wide is not None  # GemConfig refuses deep_gate without the wide part
            with torch.no_grad():
                arch.wide.bias.copy_(logits)
            logits = torch.zeros_like(logits)
        towers = arch.towers
        pairs = zip(towers, logits.split(1), strict=True) if isinstance(towers, nn.ModuleList) else [(towers, logits)]
        for tower, tower_logits in pairs:
            assert isinstance(tower, DomainTowers)
            tower.init_output_bias(tower_logits)
