"""Typed configuration of the trainer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, ClassVar, Literal, get_args

from gemline.errors import BadConfigError

ShardingTypeName = Literal["table_wise", "column_wise", "data_parallel", "row_wise", "table_row_wise"]
"""TorchRec ``ShardingType`` values (torchrec.distributed.types) the planner may be allowed."""

ModelName = Literal["gem", "dlrm", "lr", "ranker"]
"""``trainer.model``: the architectures of trainer/models (and the small TwoTaskRanker)."""

PrecisionName = Literal["fp32", "bf16"]
"""``trainer.precision``: float32 throughout, or bf16 autocast of the forward (trainer.loop.autocast)."""

KernelBackendName = Literal["reference", "triton"]
"""``trainer.gem.kernel_backend``: the jagged kernels of kernels/ (kernels.types.Backend)."""

CPU_SHARDING_TYPES: tuple[ShardingTypeName, ...] = ("table_wise", "column_wise")
"""What runs on CPU/gloo with torchrec 1.8: its planner proposes no row-wise option there, and
data_parallel tables fail in the EmbeddingCollection forward (split_with_sizes mismatch)."""

GPU_ONLY_SHARDING_TYPES: tuple[ShardingTypeName, ...] = ("row_wise", "table_row_wise")
"""Sharding types that need CUDA devices."""

EmbeddingOptimizerName = Literal["rowwise_adagrad", "adagrad"]
"""``trainer.embedding_optimizer``: the rule that updates the id tables (trainer.sparse_optim)."""


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """How a torchrun-launched run shards the model (see trainer.distributed for the wrap order)."""

    device: Literal["cpu", "cuda"] = "cpu"
    """Where every rank computes; the process-group backend follows (cpu: gloo, cuda: nccl)."""
    mesh_shape: tuple[int, ...] | None = None
    """(replicate, shard) sizes of the 2-D mesh the dense modules are fully_shard-ed on (HSDP); product must equal the world size; None: (1, world_size), plain FSDP."""
    sharding_types: tuple[ShardingTypeName, ...] | None = None
    """Embedding sharding types the planner may choose from; None: all the device supports (CPU: table_wise, column_wise)."""
    sharding_group_size: int | None = None
    """Ranks one copy of the embedding tables is sharded over; None: the whole world (DistributedModelParallel); smaller: DMPCollection, 2-D sparse parallel (cuda only)."""
    sync_interval_steps: int = 1
    """With DMPCollection: average the table replicas (weights and optimiser state, ``DMPCollection.sync()``) every this
    many optimiser steps. 1 by default, as TorchRec's docs call it "after each train step": each replica group
    updates its copy from its own rows only, so between syncs the copies drift apart; a larger interval trades that
    drift for fewer all-reduces of every table shard."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise BadConfigError(f"trainer.distributed.device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.mesh_shape is not None and (len(self.mesh_shape) != 2 or any(n < 1 for n in self.mesh_shape)):
            raise BadConfigError(
                f"trainer.distributed.mesh_shape must be two sizes >= 1 (replicate, shard), got {self.mesh_shape}"
            )
        if self.sharding_types is not None:
            known = CPU_SHARDING_TYPES + GPU_ONLY_SHARDING_TYPES
            if "data_parallel" in self.sharding_types:
                raise BadConfigError(
                    "trainer.distributed.sharding_types: data_parallel is not supported (torchrec 1.8's data-parallel "
                    f"EmbeddingCollection fails in forward here, and DDP is off); use a subset of {known}"
                )
            unknown = [t for t in self.sharding_types if t not in known]
            if not self.sharding_types or unknown:
                raise BadConfigError(f"trainer.distributed.sharding_types must be a non-empty subset of {known}, got {self.sharding_types}")
            gpu_only = [t for t in self.sharding_types if t in GPU_ONLY_SHARDING_TYPES]
            if gpu_only and self.device == "cpu":
                raise BadConfigError(
                    f"trainer.distributed.sharding_types {gpu_only} need device='cuda'; on cpu use {CPU_SHARDING_TYPES}"
                )
        if self.sync_interval_steps < 1:
            raise BadConfigError(f"trainer.distributed.sync_interval_steps must be >= 1, got {self.sync_interval_steps}")
        if self.sharding_group_size is not None:
            if self.sharding_group_size < 1:
                raise BadConfigError(f"trainer.distributed.sharding_group_size must be >= 1 or none, got {self.sharding_group_size}")
            if self.device == "cpu":
                raise BadConfigError(
                    "trainer.distributed.sharding_group_size needs device='cuda' (TorchRec's DMPCollection asserts CUDA); "
                    "leave it none on cpu"
                )

    @property
    def backend(self) -> Literal["gloo", "nccl"]:
        """torch.distributed backend for ``device``."""
        return "gloo" if self.device == "cpu" else "nccl"


GemPresetName = Literal["gem_small", "gem_cpu", "gem"]
"""``trainer.gem.preset``: the shape every unset ``trainer.gem.*`` key takes (:data:`GEM_PRESETS`)."""

WideName = Literal["dense", "full"]
"""``trainer.gem.wide``'s modes besides true (= "dense") and false: see :attr:`GemConfig.wide`."""

WideLossName = Literal["joint", "own"]
"""``trainer.gem.wide_loss``: what GEM's wide part is trained on, see :attr:`GemConfig.wide_loss`."""

GEM_PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    # The model before issue 18: 32 newest events, a pyramid, sigmoid-gated FFN, [target attention, newest] summary.
    "gem_small": MappingProxyType({
        "layers": 2, "heads": 2, "pyramid_ratio": 0.5, "max_sequence_len": 32, "dense_tokens": 2, "fm_outputs": 8,
        "lcb_outputs": 8, "fm_rank": 8, "time_delta_buckets": 0, "same_domain_stream": False, "recency_branches": (),
        "attention_len": 32, "interformer_cross": False, "cls_tokens": 0, "pma_tokens": 0, "recent_tokens": 0,
        "personalized_ffn_rank": 0, "fmb_mlp_layers": 1, "task_towers": False, "pooled_history": False,
    }),
    # The published shape at a CPU's budget: the whole stored history (256) in branches of the newest 16 events
    # (self-attention), the newest 64 and all of it (pooled only: self-attending the 64 doubled the step time), the
    # same-domain stream, InterFormer's Cross Arch. A B=512 train step: 1.2 s vs gem_small's 0.6 s (README).
    "gem_cpu": MappingProxyType({
        "layers": 2, "heads": 2, "pyramid_ratio": 1.0, "max_sequence_len": 256, "dense_tokens": 2, "fm_outputs": 8,
        "lcb_outputs": 8, "fm_rank": 8, "time_delta_buckets": 32, "same_domain_stream": True,
        "recency_branches": (16, 64, 0), "attention_len": 16, "interformer_cross": True, "cls_tokens": 2,
        "pma_tokens": 2, "recent_tokens": 4, "personalized_ffn_rank": 4, "fmb_mlp_layers": 2, "task_towers": True,
        "pooled_history": False,
    }),
    # GPU-sized: thousands of events, every branch self-attends (Triton jagged kernels), deeper and wider.
    "gem": MappingProxyType({
        "layers": 4, "heads": 2, "pyramid_ratio": 1.0, "max_sequence_len": 4096, "dense_tokens": 4, "fm_outputs": 16,
        "lcb_outputs": 16, "fm_rank": 16, "time_delta_buckets": 32, "same_domain_stream": True,
        "recency_branches": (64, 512, 0), "attention_len": 4096, "interformer_cross": True, "cls_tokens": 4,
        "pma_tokens": 4, "recent_tokens": 8, "personalized_ffn_rank": 16, "fmb_mlp_layers": 3, "task_towers": True,
        "pooled_history": False,
    }),
})
"""The values of the ``trainer.gem.*`` keys a preset sets (a key set in the TOML or by --set wins)."""

_PRESET: Any = None
"""Default of a preset-controlled key: unset, :meth:`GemConfig.resolved` takes the preset's value."""


@dataclass(frozen=True, kw_only=True)
class GemConfig:
    """The GEM model's architecture (trainer/models/gem.py), ``[trainer.gem]`` in the TOML.

    Every key but ``preset`` and ``kernel_backend`` defaults to the preset's value (:data:`GEM_PRESETS`); the
    model reads :meth:`resolved`. The boolean and integer switches (``time_delta_buckets``,
    ``same_domain_stream``, ``recency_branches``, ``interformer_cross``, ``personalized_ffn_rank``,
    ``fmb_mlp_layers``, ``task_towers``) each turn one change of issue 18 off at its gem_small value, for
    ablations. The sizes it shares with the other models (``trainer.embedding_dim``, ``num_embeddings``,
    ``hidden_dims``, ``tower_hidden``) stay in :class:`TrainerConfig`; ``embedding_dim`` must be divisible by
    ``heads``, which TrainerConfig checks.
    """

    preset: GemPresetName = "gem_small"
    """gem_small (the model before issue 18, the default), gem_cpu (the published shape at a CPU's budget) or gem
    (GPU-sized). gem_small stays the default because gem_cpu ranked worse on the progressive protocol where it was
    measured (MovieLens, README), and costs twice the step time."""
    layers: int = _PRESET
    """Interleaved InterFormer layers (each one Wukong layer and one sequence layer)."""
    heads: int = _PRESET
    """Attention heads of the sequence arch; must divide trainer.embedding_dim."""
    pyramid_ratio: float = _PRESET
    """Pyramid ratio r in (0, 1]: sequence layer l keeps the newest ceil(L_i * r**l) tokens (without recency branches)."""
    max_sequence_len: int = _PRESET
    """Newest history events the model reads (the build stores ``build.max_seq_len``, 256 by default)."""
    dense_tokens: int = _PRESET
    """Embeddings of width trainer.embedding_dim that the dense features become (Wukong inputs)."""
    fm_outputs: int = _PRESET
    """n_F: embeddings out of each Wukong FM block."""
    lcb_outputs: int = _PRESET
    """n_L: embeddings out of each Wukong linear compression block (0: none)."""
    fm_rank: int = _PRESET
    """k: rank of Wukong's optimized FM, X·(Xᵀ·Y)."""
    time_delta_buckets: int = _PRESET
    """Rows of the embedding of ``seq_time_delta_ms`` in log2-second buckets added to each event's token (0: none)."""
    same_domain_stream: bool = _PRESET
    """Read ``seq_same_domain_*`` as a second sequence stream (its own branches and summaries)."""
    recency_branches: tuple[int, ...] = _PRESET
    """Parallel branches over the newest N events of the history (0: all ``max_sequence_len``), each summarized
    every layer, summaries combined; empty: the pyramid of ``pyramid_ratio`` (gem_small)."""
    attention_len: int = _PRESET
    """Branches over at most this many events self-attend; longer ones are pooled only (cost O(L) not O(L²))."""
    interformer_cross: bool = _PRESET
    """InterFormer's Cross Arch (§3.4): CLS, PMA and the newest tokens, gated; False: [target attention, newest]."""
    cls_tokens: int = _PRESET
    """CLS tokens appended to every self-attending branch (its learned summary), with interformer_cross."""
    pma_tokens: int = _PRESET
    """Pooling-by-multihead-attention seeds per branch (Lee et al. 2019, Set Transformer §3.2), with interformer_cross."""
    recent_tokens: int = _PRESET
    """K newest events taken into the summary as they are, with interformer_cross."""
    personalized_ffn_rank: int = _PRESET
    """Rank r of InterFormer's personalized FFN, a per-example (D, r)(r, D) projection from the non-sequence
    summary (§3.3); 0: the sigmoid gate of gem_small."""
    fmb_mlp_layers: int = _PRESET
    """Hidden layers of the MLP in each Wukong FM block (§3.2); 1: gem_small's."""
    task_towers: bool = _PRESET
    """A tower per task (click, conversion) on the shared backbone; False: one tower with two outputs."""
    pooled_history: bool = _PRESET
    """Add the mean of each history key's rows over the whole stored history (item, category, event type: 3 tokens)
    to the Wukong inputs, DLRM's bag-of-ids view of the history beside the attention over the newest events."""
    target_match: bool = True
    """Target-match counts of the candidate in the whole stored history (trainer.models.gem.target_matches: how often
    its item and its category occur there, and the category's share), computed from the ids inside the model: one
    more Wukong input token (an MLP of the counts) and, with the wide part under ``wide_loss = "joint"``, their own
    linear term beside it, from zero (under ``"own"`` the wide part stays LR's, so the counts feed the token only). Wide & Deep's cross-product transformation of the candidate with the user's
    history (Cheng et al. 2016, arXiv 1606.07792, §3.1); SIM's hard search by the candidate's category (Pi et al.
    2020, arXiv 2006.05639, §4.1). On by default, with ``deep_weight_decay`` 0.01: together, and only together, they
    put GEM above LR at every seed on the Taobao sample (progressive click AUC +0.0036, target_match's own part
    +0.0044 [+0.0023, +0.0065]) and keep it above LR on MovieLens (+0.0039); README "Target-match counts". A GEM
    checkpoint written under the other setting is refused with the ``--set`` that resumes it."""
    wide: WideName | bool = True
    """The wide part added to the logits (Wide & Deep, Cheng et al. 2016, arXiv 1606.07792, section 3: a generalized
    linear model trained jointly with the deep part), per task, from zero. ``"dense"`` (or true): a linear term on the
    dense features. On by default: at three seeds it raised GEM's progressive click AUC on the Taobao sample from
    0.565 to 0.630 (LR's 0.634) and left MovieLens's level (0.7482 -> 0.7483; click NE 0.884 -> 0.870) (README "GEM's
    wide part"). ``"full"``: the whole LR baseline (trainer.models.baselines.LogisticRegression) as the wide part: the
    dense term, a bias per domain (from zero) and a weight per id of the sparse features and of the mean-pooled
    history, 2-wide tables at LR's near-zero start trained by GEM's table optimiser (LR's unless
    ``embedding_optimizer`` / ``embedding_learning_rate`` below are set); one-process training only; not the default:
    at three seeds on Taobao GEM - LR click AUC went -0.0043 -> -0.0037, worse at seed 0, MovieLens level (README
    "Tried, not adopted: LR's whole linear model as the wide part"). False: the deep part alone. A GEM checkpoint written under one setting does not resume under another."""
    deep_gate: bool = False
    """Scale the deep part's logits by a learned gate per task (click, conversion) that starts at zero, so the
    untrained model is its wide part alone (with ``wide = "full"``: the LR baseline) and the deep part enters as the
    gate's gradient lets it in: ReZero (Bachlechner et al., arXiv 2003.04887, section 1, eq. 1: x + alpha F(x), alpha
    learned from 0) and SkipInit (De & Smith, NeurIPS 2020, arXiv 2002.10444: a learned scalar at the end of the
    residual branch, from 0), here on the deep branch of Wide & Deep. The intercepts (the base rates' log-odds) then start on the wide part's bias, outside the
    gate; the gate trains with the wide part, at ``wide_learning_rate``. Needs ``wide``. Off by default: at three
    seeds on the Taobao sample it moved GEM's progressive click AUC by -0.0014 [-0.0094, +0.0060] (-0.0082 at seed 1)
    and left GEM below LR (README "GEM against LR on Taobao"). A GEM checkpoint written with one setting does not
    resume under the other."""
    ema_decay: float | None = None
    """Per-step decay in [0, 1) of an exponential moving average of GEM's dense (non-table) parameters that progressive
    evaluation and every prediction use, while training steps the raw ones (trainer/ema.py); the id tables stay raw.
    Polyak-Ruppert averaging in its exponential form (Polyak & Juditsky 1992, SIAM J. Control Optim. 30(4)), the update
    of ``torch.optim.swa_utils.get_ema_multi_avg_fn`` (PyTorch docs, "Weight averaging (SWA and EMA)"); horizon about
    1 / (1 - decay) steps once warmed up (the decay after n updates is min(decay, (1 + n) / (10 + n)), as TensorFlow's
    ``ExponentialMovingAverage`` with ``num_updates``). None: off, the default: at 0.9 and 0.97 GEM's three-seed Taobao
    click AUC was 0.6296 (0.6286 without) and below LR's at every seed (README "An EMA of GEM's dense part"). One process only; a GEM checkpoint written with one setting does not resume
    under the other (on/off)."""
    deep_weight_decay: float = 0.01
    """L2 coefficient on GEM's deep (non-wide, non-table) parameters, Adam's ``weight_decay`` of that parameter group
    (PyTorch docs, ``torch.optim.Adam``: added to the gradient, the coupled form; Krogh & Hertz, NIPS 1991, "A simple
    weight decay can improve generalization"); 0: none. The wide part and the tables are not decayed. 0.01 (the
    default since the target-match counts) alone brought GEM within -0.0007 of LR on Taobao (three seeds), with
    ``target_match`` above it at every seed; it costs MovieLens about 0.0035 click AUC (README "An EMA of GEM's
    dense part, and weight decay on the deep part", "Target-match counts")."""
    wide_loss: WideLossName = "joint"
    """What the wide part is trained on. ``"joint"`` (the default): the loss of the summed logits, wide + deep, as
    Wide & Deep trains both parts (§3.3). ``"own"`` (needs ``wide = "full"``, not with ``deep_gate``): stagewise
    additive modelling (Friedman 2001, "Greedy function approximation: a gradient boosting machine", Annals of
    Statistics 29(5), §3's stagewise strategy: each new term is fitted to the loss of the earlier terms' fixed sum plus
    itself): the wide part is
    trained on its own logistic loss exactly as the standalone LR baseline (same draws of its id tables, intercepts at
    the base rates, LR's optimisers and rates under the defaults; the deep part's gradient never reaches it), and the
    deep part on the loss of ``wide.detach() + deep_shrinkage * deep``, a residual learner on top of that LR (the towers'
    output bias from 0). Predictions are wide + deep_shrinkage * deep. A step's reported loss is the prediction's; a step
    is skipped when either loss is not finite. One process only (as ``wide = "full"``). Off by default: at three seeds
    on the Taobao sample GEM's click AUC rose over joint "full" (+0.0021, every seed) but stayed below LR's at every
    seed (-0.0017; README "LR inside GEM on its own loss")."""
    deep_shrinkage: float = 1.0
    """Factor in (0, 1] on the deep logits before the wide part is added (in training and prediction): boosting's
    shrinkage, its learning rate nu (Friedman 2001, §5 "Regularization": F_m = F_{m-1} + nu * rho_m * h_m); 1: none.
    0.3 with ``wide_loss = "own"`` was worse than 1 on Taobao (README "LR inside GEM on its own loss")."""
    wide_learning_rate: float | None = None
    """Adam rate of the wide part; None: ``trainer.learning_rate``, the rate the LR baseline's linear term trains at
    (Wide & Deep gives each part its own optimiser, §3.3: FTRL for the wide, AdaGrad for the deep)."""
    kernel_backend: KernelBackendName = "reference"
    """Jagged kernels of the sequence arch: the PyTorch reference (CPU) or Triton (GPU)."""
    learning_rate: float | None = 1e-3
    """Adam rate of GEM's dense part in place of ``trainer.learning_rate``; None: that one. 1e-3, a third of the
    trainer's 3e-3: at 3e-3 GEM's deeper stack trained less well and less repeatably on MovieLens (progressive click
    AUC over versions 2-3, seeds 0 and 1: 0.7321 and 0.7255 at 3e-3, 0.7347 and 0.7340 at 1e-3; at 1e-2 it
    collapsed to constant scores), while DLRM lost at 1e-3 (0.7376 -> 0.7353); README "Comparing models"."""
    embedding_learning_rate: float | None = None
    """Adagrad rate of GEM's tables in place of ``trainer.embedding_learning_rate``; None: that one."""
    embedding_optimizer: EmbeddingOptimizerName | None = None
    """GEM's table optimiser in place of ``trainer.embedding_optimizer`` (``adagrad``: one accumulator per element;
    ``rowwise_adagrad``: one per row); None: that one. At three seeds on MovieLens per-element Adagrad gave GEM
    conversion AUC +0.0019 and click AUC +0.0002 over row-wise (README "GEM's dense learning rate", "Under row-wise
    Adagrad"); None by default, so GEM keeps the trainer's row-wise rule (state D times smaller, fbgemm's kernel)."""

    def __post_init__(self) -> None:
        """Raises BadConfigError (a ValueError) naming the ``trainer.gem.*`` key of a bad value."""
        if self.preset not in GEM_PRESETS:
            raise BadConfigError(f"trainer.gem.preset must be one of {tuple(GEM_PRESETS)}, got {self.preset!r}")
        v = self._values()
        for name in ("layers", "heads", "max_sequence_len", "dense_tokens", "fm_outputs", "fm_rank", "attention_len",
                     "fmb_mlp_layers"):
            if v[name] < 1:
                raise BadConfigError(f"trainer.gem.{name} must be >= 1, got {v[name]}")
        for name in ("lcb_outputs", "time_delta_buckets", "cls_tokens", "pma_tokens", "recent_tokens",
                     "personalized_ffn_rank"):
            if v[name] < 0:
                raise BadConfigError(f"trainer.gem.{name} must be >= 0, got {v[name]}")
        if not 0 < v["pyramid_ratio"] <= 1:
            raise BadConfigError(f"trainer.gem.pyramid_ratio must be in (0, 1], got {v['pyramid_ratio']}")
        if any(n < 0 for n in v["recency_branches"]) or len(set(v["recency_branches"])) != len(v["recency_branches"]):
            raise BadConfigError(f"trainer.gem.recency_branches must be distinct lengths >= 0 (0: all), got {v['recency_branches']}")
        if v["same_domain_stream"] and not v["recency_branches"]:
            raise BadConfigError("trainer.gem.same_domain_stream needs trainer.gem.recency_branches (the pyramid reads one stream)")
        if not isinstance(self.wide, bool) and self.wide not in get_args(WideName):
            raise BadConfigError(f"trainer.gem.wide must be one of {get_args(WideName)}, true or false, got {self.wide!r}")
        if self.deep_gate and self.wide is False:
            raise BadConfigError("trainer.gem.deep_gate needs trainer.gem.wide (the gated model starts as its wide "
                                 "part); set trainer.gem.wide=dense or full, or deep_gate=false")
        if self.wide_loss not in get_args(WideLossName):
            raise BadConfigError(f"trainer.gem.wide_loss must be one of {get_args(WideLossName)}, got {self.wide_loss!r}")
        if self.wide_loss == "own" and (self.wide != "full" or self.deep_gate):
            raise BadConfigError('trainer.gem.wide_loss = "own" trains LR inside GEM: it needs trainer.gem.wide=full and '
                                 "no deep gate (trainer.gem.deep_gate=false); or set trainer.gem.wide_loss=joint")
        if not 0 < self.deep_shrinkage <= 1:
            raise BadConfigError(f"trainer.gem.deep_shrinkage must be in (0, 1], got {self.deep_shrinkage}")
        if not self.deep_weight_decay >= 0:
            raise BadConfigError(f"trainer.gem.deep_weight_decay must be >= 0, got {self.deep_weight_decay}")
        if self.ema_decay is not None and not 0 <= self.ema_decay < 1:
            raise BadConfigError(f"trainer.gem.ema_decay must be in [0, 1) or none, got {self.ema_decay}")
        for name in ("learning_rate", "embedding_learning_rate", "wide_learning_rate"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise BadConfigError(f"trainer.gem.{name} must be > 0 or none, got {getattr(self, name)}")
        if self.embedding_optimizer is not None and self.embedding_optimizer not in get_args(EmbeddingOptimizerName):
            raise BadConfigError(f"trainer.gem.embedding_optimizer must be one of {get_args(EmbeddingOptimizerName)} "
                                 f"or none, got {self.embedding_optimizer!r}")
        if self.kernel_backend not in get_args(KernelBackendName):
            raise BadConfigError(f"trainer.gem.kernel_backend must be one of {get_args(KernelBackendName)}, "
                                 f"got {self.kernel_backend!r}")

    def _values(self) -> dict[str, Any]:
        preset = GEM_PRESETS[self.preset]
        return {name: preset[name] if getattr(self, name) is None else getattr(self, name) for name in preset}

    @property
    def wide_mode(self) -> WideName | None:
        """:attr:`wide` as one name: "dense" (also for true), "full", or None (false: no wide part)."""
        if self.wide is False:
            return None
        return "dense" if self.wide is True else self.wide

    def resolved(self) -> GemConfig:
        """This config with every unset key at its preset's value (what the model is built from)."""
        values = self._values()
        values["recency_branches"] = tuple(int(n) for n in values["recency_branches"])
        return replace(self, **values)


IdMappingName = Literal["hash", "managed"]
"""``trainer.ids.mapping``: ids hashed into shared rows, or each frequent id its own row (trainer.id_mapping)."""

WidthRuleName = Literal["fixed", "cardinality"]
"""``trainer.ids.widths``: every table trainer.embedding_dim wide, or each namespace's width from its cardinality."""


@dataclass(frozen=True, kw_only=True)
class IdsConfig:
    """How string ids become embedding rows (trainer/id_mapping.py has the rules), ``[trainer.ids]``."""

    mapping: IdMappingName = "hash"
    """hash: blake2b modulo trainer.num_embeddings, collisions silent; managed: Monolith-style vocabulary with an occurrence filter."""
    min_count: int = 2
    """Managed: times an id must be seen in training before it gets its own row (Monolith's occurrence threshold)."""
    headroom: float = 2.0
    """Managed: rows per namespace = headroom x its ids seen min_count times in the first training data (+2 reserved rows)."""
    min_rows: int = 64
    """Managed: fewest rows of a namespace's tables."""
    table_rows: tuple[str, ...] | None = None
    """Managed: ``namespace=rows`` entries (``item=200000,category=8000``) pinning those namespaces' rows; None: the rule above."""
    widths: WidthRuleName = "fixed"
    """fixed: every id table is trainer.embedding_dim wide; cardinality: a namespace of U distinct ids (seen min_count
    times in managed mode) gets ``clip(round(width_factor * U ** 0.25), min_width, trainer.embedding_dim)``
    (trainer.id_mapping.cardinality_width)."""
    width_factor: float = 6.0
    """Cardinality widths: the factor of U ** 0.25 (6: Wang et al. 2017, Deep & Cross Network, §4.2)."""
    min_width: int = 2
    """Cardinality widths: the narrowest table."""
    table_widths: tuple[str, ...] | None = None
    """``namespace=width`` entries pinning those namespaces' widths (the trainer pins every one from its run's mapping)."""

    def __post_init__(self) -> None:
        """Raises BadConfigError naming the ``trainer.ids.*`` key of a bad value."""
        if self.mapping not in get_args(IdMappingName):
            raise BadConfigError(f"trainer.ids.mapping must be one of {get_args(IdMappingName)}, got {self.mapping!r}")
        if self.min_count < 1 or self.min_rows < 3:
            raise BadConfigError(f"trainer.ids.min_count must be >= 1 and min_rows >= 3, got {self.min_count}, {self.min_rows}")
        if not self.headroom >= 1:
            raise BadConfigError(f"trainer.ids.headroom must be >= 1, got {self.headroom}")
        if self.widths not in get_args(WidthRuleName):
            raise BadConfigError(f"trainer.ids.widths must be one of {get_args(WidthRuleName)}, got {self.widths!r}")
        if not self.width_factor > 0 or self.min_width < 1:
            raise BadConfigError(f"trainer.ids.width_factor must be > 0 and min_width >= 1, got {self.width_factor}, {self.min_width}")
        self.pinned_rows()
        self.pinned_widths()

    @property
    def sized_by_counts(self) -> bool:
        """Whether a run's tables are sized from its ids' counts (managed rows or cardinality widths), so the data it
        starts with is counted, history ids included (trainer.id_mapping)."""
        return self.mapping == "managed" or self.widths == "cardinality"

    def pinned_rows(self) -> dict[str, int]:
        """``table_rows`` as namespace -> rows; raises BadConfigError on an entry that is not ``name=rows`` (rows >= 3)."""
        return _pinned(self.table_rows, "table_rows", "rows", 3)

    def pinned_widths(self) -> dict[str, int]:
        """``table_widths`` as namespace -> width; raises BadConfigError on an entry that is not ``name=width`` (>= 1)."""
        return _pinned(self.table_widths, "table_widths", "width", 1)


def _pinned(entries: tuple[str, ...] | None, key: str, what: str, minimum: int) -> dict[str, int]:
    """``name=N`` entries of ``trainer.ids.<key>`` as name -> N; BadConfigError unless N >= ``minimum``."""
    out = {}
    for entry in entries or ():
        name, _, value = entry.partition("=")
        if not name or not value.isdigit() or int(value) < minimum:
            raise BadConfigError(f"trainer.ids.{key} entries must be namespace={what} with {what} >= {minimum}, got {entry!r}")
        out[name] = int(value)
    return out


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Model size and optimisation of the CPU trainer."""

    embedding_dim: int = 16
    """Width D of every embedding table."""
    num_embeddings: int = 100_003
    """Rows per hashed id table (ids are hashed modulo this)."""
    batch_size: int = 512
    """Examples per step."""
    epochs: int = 1
    """Passes over the training days; one by default: ID-embedding CTR models overfit from the start of the second epoch (Zhang et al., CIKM 2022, arXiv 2209.06053), measured here on Taobao (README, Training)."""
    learning_rate: float = 3e-3
    """Adam learning rate of the dense part (and Adagrad of the embeddings)."""
    seed: int = 0
    """Seed of parameter init and data order."""
    embedding_learning_rate: float | None = None
    """Learning rate of the embedding tables' optimiser; None uses ``learning_rate``."""
    embedding_optimizer: EmbeddingOptimizerName = "rowwise_adagrad"
    """The id tables' optimiser (trainer.sparse_optim): rowwise_adagrad (one accumulator per row, fbgemm's
    EXACT_ROWWISE_ADAGRAD, the default: what TorchRec/fbgemm production runs use, and its state is embedding_dim
    times smaller) or adagrad (one accumulator per element, the trainer's rule before issue 19). A checkpoint
    resumes only under the optimiser that wrote it."""
    embedding_eps: float = 1e-10
    """eps of the embedding optimiser's denominator sqrt(accumulator) + eps: 1e-10 as torch.optim.Adagrad's and
    torchrec.optim.RowWiseAdagrad's defaults (fbgemm's kernels take it from here)."""
    hidden_dims: tuple[int, ...] = (64, 32)
    """Widths of the shared MLP layers under the click and conversion heads."""
    init_from: Literal["scratch", "latest"] = "scratch"
    """Start from fresh parameters, or from the lake's latest checkpoint (model, optimisers, step, RNG; an unfinished run on the same version continues where it stopped)."""
    checkpoint_every_steps: int | None = None
    """Also checkpoint every this many steps, so a crashed run resumed with init_from=latest loses at most that many; None: only at the end."""
    torch_threads: int | None = 1
    """Torch intra-op threads during run_training (restored after); None keeps torch's default of one per core.

    One by default: this model's ops are tiny, and on a shared CPU torch's parallel scatter and
    repeat_interleave paths were measured 4x slower end to end with 2 threads than with 1."""
    compile: bool = False
    """torch.compile the dense modules (GEM and DLRM: ``dense_arch``; the ranker: attention, MLP, heads) in one process
    and sharded; the embedding lookups stay eager. Off by default: on CPU the first steps pay the compilation."""
    device: str = "cpu"
    """Where a one-process run computes: ``cpu``, ``cuda`` (the current CUDA device) or ``cuda:N``; the model, every
    batch and every tensor of a forward live there. A torchrun rank uses ``cuda:LOCAL_RANK`` when
    ``trainer.distributed.device`` is cuda (trainer.launch), whatever this says."""
    precision: PrecisionName = "fp32"
    """Dense-part arithmetic: fp32, or bf16 autocast (matmuls and attention in bfloat16, parameters, embedding
    tables, optimiser state and the loss in float32)."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Sharding of a multi-process run (`gemline train --nproc N`); unused by a single process."""

    model: ModelName = "gem"
    """Architecture (trainer/models): GEM (InterFormer over Wukong + pyramid sequence), DLRM, logistic regression, or the small TwoTaskRanker."""
    tower_hidden: int = 16
    """Width of each per-domain tower (gem, dlrm)."""
    gem: GemConfig = field(default_factory=GemConfig)
    """The GEM model's architecture (``[trainer.gem]``); used when ``model`` is "gem"."""
    ids: IdsConfig = field(default_factory=IdsConfig)
    """Id -> embedding row mapping (``[trainer.ids]``); in managed mode it also sizes each table."""
    log_teacher_predictions: bool | None = None
    """Write each progressive evaluation's predictions and vectors to ``teacher_predictions`` (trainer.teacher_log), the students' supervision (trainer.distill); None: on for gem, off for the other models. One process only (--nproc 1)."""

    @property
    def logs_teacher_predictions(self) -> bool:
        """``log_teacher_predictions`` with its default resolved (on for gem)."""
        return self.model == "gem" if self.log_teacher_predictions is None else self.log_teacher_predictions
    final_labels: bool = True
    """Train and evaluate on a label only once its attribution window has closed (trainer.labels); False: every
    label as published (open conversions count as negatives)."""
    click_window_ms: int | None = 86_400_000
    """The click attribution window (ms) that decides whether a click label is final: at least the build's longest
    (``build.click_window_ms`` and its overrides; the application checks); None: ``label_window_closed`` alone."""
    task_weights: tuple[float, float] = (1.0, 1.0)
    """Loss weight of the click and the conversion task (>= 0; 0 trains that head not at all)."""

    @property
    def dense_learning_rate(self) -> float:
        """The Adam rate of ``model``'s dense part: ``gem.learning_rate`` for GEM when set, else ``learning_rate``."""
        own = self.gem.learning_rate if self.model == "gem" else None
        return self.learning_rate if own is None else own

    @property
    def dense_weight_decay(self) -> float:
        """Adam's weight decay of ``model``'s dense (deep) parameters: ``gem.deep_weight_decay`` for GEM, else 0."""
        return self.gem.deep_weight_decay if self.model == "gem" else 0.0

    @property
    def wide_learning_rate(self) -> float:
        """The Adam rate of GEM's wide part (``gem.wide_learning_rate``, else ``learning_rate``)."""
        own = self.gem.wide_learning_rate
        return self.learning_rate if own is None else own

    @property
    def table_learning_rate(self) -> float:
        """The Adagrad rate of ``model``'s tables: ``gem.embedding_learning_rate`` for GEM when set, else
        ``embedding_learning_rate``, else ``learning_rate``."""
        own = self.gem.embedding_learning_rate if self.model == "gem" else None
        return own or self.embedding_learning_rate or self.learning_rate

    @property
    def table_optimizer(self) -> EmbeddingOptimizerName:
        """The rule of ``model``'s tables: ``gem.embedding_optimizer`` for GEM when set, else ``embedding_optimizer``."""
        own = self.gem.embedding_optimizer if self.model == "gem" else None
        return self.embedding_optimizer if own is None else own

    @property
    def reads_sequence_extras(self) -> bool:
        """Whether the model reads the time deltas or the same-domain sequence (trainer.data.SEQUENCE_EXTRA_KEYS)."""
        gem = self.gem.resolved()
        return self.model == "gem" and (gem.time_delta_buckets > 0 or gem.same_domain_stream)

    MOVED_KEYS: ClassVar[Mapping[str, str]] = MappingProxyType({
        "gem_layers": "gem.layers", "gem_heads": "gem.heads", "gem_pyramid_ratio": "gem.pyramid_ratio",
        "gem_max_sequence_len": "gem.max_sequence_len", "gem_dense_tokens": "gem.dense_tokens",
        "gem_fm_outputs": "gem.fm_outputs", "gem_lcb_outputs": "gem.lcb_outputs", "gem_fm_rank": "gem.fm_rank",
        "kernel_backend": "gem.kernel_backend",
    })
    """Keys of this section that moved into a subsection (old name -> new name, relative to ``trainer.``):
    the config loader names the new key when a file or ``--set`` still uses an old one."""

    def __post_init__(self) -> None:
        for name in ("embedding_dim", "num_embeddings", "batch_size", "epochs"):
            if getattr(self, name) < 1:
                raise BadConfigError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        if self.learning_rate <= 0:
            raise BadConfigError(f"trainer.learning_rate must be > 0, got {self.learning_rate}")
        if self.num_embeddings < 2:
            raise BadConfigError(f"trainer.num_embeddings must be >= 2 (row 0 is reserved for null ids), got {self.num_embeddings}")
        if self.embedding_learning_rate is not None and self.embedding_learning_rate <= 0:
            raise BadConfigError(f"trainer.embedding_learning_rate must be > 0 or none, got {self.embedding_learning_rate}")
        if self.embedding_optimizer not in get_args(EmbeddingOptimizerName):
            raise BadConfigError(f"trainer.embedding_optimizer must be one of {get_args(EmbeddingOptimizerName)}, "
                                 f"got {self.embedding_optimizer!r}")
        if not self.embedding_eps > 0:
            raise BadConfigError(f"trainer.embedding_eps must be > 0, got {self.embedding_eps}")
        if not self.hidden_dims or any(width < 1 for width in self.hidden_dims):
            raise BadConfigError(f"trainer.hidden_dims must be a non-empty tuple of widths >= 1, got {self.hidden_dims}")
        if self.checkpoint_every_steps is not None and self.checkpoint_every_steps < 1:
            raise BadConfigError(f"trainer.checkpoint_every_steps must be >= 1 or none, got {self.checkpoint_every_steps}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise BadConfigError(f"trainer.torch_threads must be >= 1 or none, got {self.torch_threads}")
        if len(self.task_weights) != 2 or any(not w >= 0 for w in self.task_weights):
            raise BadConfigError(f"trainer.task_weights must be two weights >= 0 (click, conversion), got {self.task_weights}")
        if self.click_window_ms is not None and self.click_window_ms < 0:
            raise BadConfigError(f"trainer.click_window_ms must be >= 0 or none, got {self.click_window_ms}")
        if self.tower_hidden < 1:
            raise BadConfigError(f"trainer.tower_hidden must be >= 1, got {self.tower_hidden}")
        # Checked for every model, not only gem: a config that names another model stays valid when
        # ``compare`` (or a later --set trainer.model=gem) trains GEM with it.
        wide = {ns: w for ns, w in self.ids.pinned_widths().items() if w > self.embedding_dim}
        if wide:
            raise BadConfigError(f"trainer.ids.table_widths {wide} exceed trainer.embedding_dim={self.embedding_dim}")
        heads = self.gem.resolved().heads
        if self.embedding_dim % heads:
            raise BadConfigError(f"trainer.embedding_dim={self.embedding_dim} must be divisible by trainer.gem.heads={heads}")
        if self.model not in ("gem", "dlrm", "lr", "ranker"):
            raise BadConfigError(f"trainer.model must be one of gem, dlrm, lr, ranker; got {self.model!r}")
        if self.init_from not in ("scratch", "latest"):
            raise BadConfigError(f"trainer.init_from must be 'scratch' or 'latest', got {self.init_from!r}")
        if self.precision not in get_args(PrecisionName):
            raise BadConfigError(f"trainer.precision must be one of {get_args(PrecisionName)}, got {self.precision!r}")
        check_device(self.device)


def check_device(device: str, *, key: str = "trainer.device", processes: int = 1) -> None:
    """Raise BadConfigError unless ``device`` is ``cpu``, ``cuda`` or ``cuda:N`` (N >= 0) and, for cuda, this machine
    has the CUDA devices it needs: N + 1 for ``cuda:N``, ``processes`` for ``cuda`` (each local process on its own
    device, ``cuda:LOCAL_RANK``, as ``trainer.distributed.device`` does). ``key`` names the setting in the message.
    torch is imported only for a cuda name (the config stays cheap to load)."""
    kind, colon, index = device.partition(":")
    if kind == "cpu" and not colon:
        return
    if kind != "cuda" or (colon and not index.isdigit()):
        raise BadConfigError(f"{key} must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    import torch

    if not torch.cuda.is_available():
        raise BadConfigError(f"{key}={device!r} but torch sees no CUDA device here (torch {torch.__version__}); "
                             f"use {key}=cpu")
    have = torch.cuda.device_count()
    if colon and int(index) >= have:
        raise BadConfigError(f"{key}={device!r} but this machine has {have} CUDA device(s)")
    if not colon and have < processes:
        raise BadConfigError(f"{key}={device!r} puts each of the {processes} processes on its own CUDA device, but this "
                             f"machine has {have} CUDA device(s); use --nproc {have} or {key}=cpu")
