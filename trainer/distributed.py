"""Sharding a model over ranks: TorchRec DMP for the embedding tables, FSDP2 HSDP for the dense part.

Shardable models (``SHARDABLE_MODELS``): GEM and DLRM (trainer/models; their ``dense_arch`` is
the dense part) and the ShardableRanker below (its attention, MLP and heads). Each looks every
table up once per forward, which the fused sparse optimiser needs (see ShardableRanker).

Wrap order (the one place it is written down):

    1. build the model on CPU on every rank with the same seed (same initial weights everywhere)
    2. register the sparse optimiser in backward (TorchRec ``apply_optimizer_in_backward``: row-wise
       Adagrad or Adagrad, ``trainer.embedding_optimizer``, fused into the embedding kernels)
    3. plan and shard the embedding collections with ``DistributedModelParallel``
       (``EmbeddingShardingPlanner`` over ``Topology(world_size, compute_device)``, allowed types
       from ``ParameterConstraints(sharding_types=...)``), ``init_data_parallel=False`` so DMP does
       not wrap the dense part in DDP
    4. ``fully_shard`` each dense sub-module (GEM/DLRM: dense_arch; ranker: attention, MLP, heads) on a 2-D ``DeviceMesh`` with
       dims ("replicate", "shard"): HSDP, all-reduce across replicas, reduce-scatter within a
       shard group. Not the root: it holds the sharded embedding modules, which DMP owns
    5. optionally ``torch.compile`` the dense sub-modules (``trainer.compile``)
    6. Adam on the dense DTensor parameters; the sparse step already happens inside backward

Sources: TorchRec docs (DistributedModelParallel, EmbeddingShardingPlanner, ShardingType,
apply_optimizer_in_backward); PyTorch FSDP2 docs (torch.distributed.fsdp.fully_shard, HSDP with a
2-D mesh from ``init_device_mesh(..., mesh_dim_names=("replicate", "shard"))``).

Gradient scale. Each rank holds a slice of the global batch of B examples. The local loss is the
*sum* of per-example losses over the slice divided by B, so summing gradients over ranks gives the
gradient of the global mean loss: TorchRec's sharded embedding backward is set to sum
(``torchrec.distributed.comm_ops.set_gradient_division(False)``; its default divides by the world size,
DDP's mean, which left the tables' gradients and optimiser state world_size and world_size**2 times
too small: invisible in the weights only because Adagrad's step is scale-free but for eps), and the
dense FSDP reduction is set to sum (``set_gradient_divide_factor(1.0)``) instead of its default mean.
The run then follows a one-process run on the same global batches up to float reduction order
(tests/trainer/test_distributed.py, which compares the row-wise accumulators too).

CPU/gloo (torchrec 1.8): table-wise and column-wise sharding work; the planner offers no row-wise
option and ``DMPCollection`` asserts CUDA. Data-parallel tables are rejected by the config: their
EmbeddingCollection forward fails here, and their gradients would need the DDP wrapper this
wrapping turns off. Row-wise / table-row-wise and DMPCollection are selected by config and only
valid with ``device="cuda"``; that path is built but untested here (no GPU).

Shape letters: B global batch, b local slice, S sparse features, D embedding dim, F dense features.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchrec import KeyedJaggedTensor

from kernels.segments import token_rows
from sequences.schema import SPARSE_FEATURES
from trainer.config import (
    CPU_SHARDING_TYPES,
    GPU_ONLY_SHARDING_TYPES,
    DistributedConfig,
    ShardingTypeName,
    TrainerConfig,
)
from trainer.data import SEQUENCE_KEYS, Batch, validate_batch
from trainer.id_mapping import table_rows
from trainer.labels import loss_terms
from trainer.model import TwoTaskRanker, segment_mean_pool, segment_softmax_pool
from trainer.models.gem import dense_param_groups
from trainer.sparse_optim import fused_optimizer

if TYPE_CHECKING:
    from torchrec import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from trainer.models import Ranker

DENSE_MODULES = ("attention", "mlp", "heads")
"""Sub-modules of the ranker wrapped by fully_shard (and compiled with trainer.compile)."""

SparseWrapper = Literal["dmp", "dmp_collection"]


class ShardableRanker(TwoTaskRanker):
    """TwoTaskRanker whose candidate query is looked up in the same EmbeddingCollection call as the history.

    TwoTaskRanker reads ``sequence_arch.embeddings[table]`` directly; a sharded
    EmbeddingCollection has no such per-table modules. Here the candidate's item and category ids
    ride along with the history in one KeyedJaggedTensor of stride 2B (rows 0..B-1 the histories,
    rows B..2B-1 the candidate: one id for the item and category keys, none for event types).
    One call matters: TorchRec's fused optimiser steps once per lookup backward, so two calls
    would update a row twice where the one-process trainer updates it once with the summed
    gradient. Same parameters, same initialisation under the same seed, same maths; pooled
    outputs are read by key, since a sharded EmbeddingBagCollection orders them by shard.
    """

    def summary_and_candidate(self, sparse: KeyedJaggedTensor, sequence: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 2D) [attention pool, mean pool] of the history and (B, D) candidate query, float32.

        Args:
            sparse: keys SPARSE_FEATURES, one id per example per key (stride B).
            sequence: keys SEQUENCE_KEYS, the same lengths (B,) for every key.
        """
        batch = sequence.stride()
        candidate_ids = {SEQUENCE_KEYS[0]: sparse["item_id"].values(), SEQUENCE_KEYS[1]: sparse["category"].values()}
        values, lengths = [], []
        for key in SEQUENCE_KEYS:
            history = sequence[key]
            ids = candidate_ids.get(key, history.values()[:0])
            values += [history.values(), ids]
            lengths += [history.lengths(), torch.full((batch,), 1 if key in candidate_ids else 0, dtype=torch.int64,
                                                      device=history.lengths().device)]
        merged = KeyedJaggedTensor.from_lengths_sync(keys=list(SEQUENCE_KEYS), values=torch.cat(values), lengths=torch.cat(lengths))
        jagged = self.sequence_arch(merged)
        offsets = sequence[SEQUENCE_KEYS[0]].offsets()
        total = int(offsets[-1])
        history_rows = sum(jagged[key].values()[:total] for key in SEQUENCE_KEYS)
        candidate = sum(jagged[key].values()[total:] for key in candidate_ids)
        seg = token_rows(offsets, total)
        scores = (self.attention(history_rows) * candidate[seg]).sum(dim=1) / math.sqrt(self.embedding_dim)
        summary = torch.cat([segment_softmax_pool(history_rows, scores, offsets), segment_mean_pool(history_rows, offsets)], dim=1)
        return summary, candidate

    def forward(
        self, sparse: KeyedJaggedTensor, sequence: KeyedJaggedTensor, dense: torch.Tensor, domain_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits (B, 2) float32 (click, conversion); arguments as TwoTaskRanker.forward (domain_ids ignored).

        Raises:
            ValueError: ``dense`` has the wrong width.
        """
        if dense.dim() != 2 or dense.shape[1] != self.num_dense:
            raise ValueError(f"dense must be (B, {self.num_dense}), got {tuple(dense.shape)}")
        kt = self.sparse_arch(sparse)
        pooled = torch.cat([kt[name] for name in SPARSE_FEATURES], dim=1)
        summary, _ = self.summary_and_candidate(sparse, sequence)
        return self.heads(self.mlp(torch.cat([pooled, summary, dense], dim=1)))


def rank_device(config: DistributedConfig) -> torch.device:
    """This rank's device: the CPU, or the current CUDA device (``cuda:LOCAL_RANK``: trainer.launch sets it)."""
    return torch.device("cuda", torch.cuda.current_device()) if config.device == "cuda" else torch.device("cpu")


def resolve_mesh_shape(world_size: int, mesh_shape: tuple[int, ...] | None) -> tuple[int, int]:
    """(replicate, shard) sizes; None gives (1, world_size).

    Raises:
        ValueError: the product of ``mesh_shape`` is not ``world_size``.
    """
    shape = (1, world_size) if mesh_shape is None else tuple(mesh_shape)
    if len(shape) != 2 or shape[0] * shape[1] != world_size:
        raise ValueError(
            f"trainer.distributed.mesh_shape {shape} must multiply to the world size {world_size}; "
            f"e.g. ({world_size}, 1) for pure replication or (1, {world_size}) for pure sharding"
        )
    return shape[0], shape[1]


def allowed_sharding_types(config: DistributedConfig) -> tuple[ShardingTypeName, ...]:
    """Sharding types the planner may choose: the configured ones, or all the device supports."""
    if config.sharding_types is not None:
        return config.sharding_types
    return CPU_SHARDING_TYPES if config.device == "cpu" else CPU_SHARDING_TYPES + GPU_ONLY_SHARDING_TYPES


def choose_sparse_wrapper(config: DistributedConfig, world_size: int) -> SparseWrapper:
    """``"dmp"`` when the tables are sharded over the whole world, ``"dmp_collection"`` when over groups.

    Raises:
        ValueError: ``sharding_group_size`` does not divide ``world_size``, or asks for groups on CPU.
    """
    group = config.sharding_group_size
    if group is None or group == world_size:
        return "dmp"
    if world_size % group != 0 or group > world_size:
        raise ValueError(
            f"trainer.distributed.sharding_group_size {group} must divide the world size {world_size}"
        )
    if config.device != "cuda":
        raise ValueError("DMPCollection (sharding_group_size < world size) needs device='cuda'")
    return "dmp_collection"


def split_rows(global_rows: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """This rank's contiguous slice of a global batch's row indices (sizes differ by at most one).

    Raises:
        ValueError: the global batch has fewer rows than ranks (a rank would get an empty slice).
    """
    if len(global_rows) < world_size:
        raise ValueError(
            f"a global batch of {len(global_rows)} rows cannot give each of {world_size} ranks a row; "
            "use a batch_size that is a multiple of the number of processes"
        )
    return np.array_split(global_rows, world_size)[rank]


SHARDABLE_MODELS = ("gem", "dlrm", "ranker")
"""``trainer.model`` values a multi-process run can shard. Logistic regression is left out: its
dense part is a handful of weights in a ModuleDict whose forward never runs (FSDP2 gathers on a
module's forward), and it trains in seconds in one process."""


def build_shardable_model(tc: TrainerConfig, num_dense: int, domains: tuple[str, ...]) -> Ranker:
    """The ``tc.model`` architecture in a form DMP can shard: ShardableRanker for "ranker", else build_model's.

    GEM and DLRM need no variant: each looks every table up once per forward (GEM appends the
    candidate to the history lookup, trainer.models.gem.SparseArch) and reads pooled outputs by key.

    Raises:
        ValueError: a model outside :data:`SHARDABLE_MODELS`, or GEM with ``trainer.gem.wide = "full"``.
    """
    from trainer.models import build_model

    if tc.model not in SHARDABLE_MODELS:
        raise ValueError(
            f"--nproc > 1 shards trainer.model in {SHARDABLE_MODELS}; got {tc.model!r}. Train it in one process"
        )
    if tc.model == "gem" and tc.gem.wide_mode == "full":
        # Its 2-wide id tables are a second EmbeddingBagCollection named as GEM's own (t_item_id, ...), which no
        # sharding plan here has been checked against.
        raise ValueError('--nproc > 1 does not shard trainer.gem.wide = "full" (LR\'s id tables as GEM\'s wide part); '
                         'train it in one process or set trainer.gem.wide = "dense"')
    if tc.model == "ranker":
        return ShardableRanker(
            num_embeddings=table_rows(tc), embedding_dim=tc.embedding_dim, num_dense=num_dense,
            hidden_dims=tc.hidden_dims, domains=domains,
        )
    return build_model(tc, num_dense, domains)


def dense_module_names(model: nn.Module) -> tuple[str, ...]:
    """Top-level sub-modules of ``model`` that fully_shard wraps (and trainer.compile compiles).

    ShardableRanker: :data:`DENSE_MODULES`; GEM and DLRM: their ``dense_arch``.

    Raises:
        TypeError: ``model`` is neither (e.g. logistic regression, see :data:`SHARDABLE_MODELS`).
    """
    if isinstance(model, TwoTaskRanker):
        return DENSE_MODULES
    dense = getattr(model, "dense_arch", None)
    if isinstance(dense, nn.Module) and type(dense).forward is not nn.Module.forward:
        return ("dense_arch",)
    raise TypeError(
        f"{type(model).__name__} has no dense module with a forward to fully_shard; shardable models are {SHARDABLE_MODELS}"
    )


def _embedding_modules(model: nn.Module) -> list[EmbeddingBagCollection | EmbeddingCollection]:
    from torchrec import EmbeddingBagCollection, EmbeddingCollection

    return [m for m in model.modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))]


def _sparse_roots(model: nn.Module) -> set[str]:
    """Names of the top-level children holding TorchRec tables (their state DMP shards)."""
    tables = {id(m) for m in _embedding_modules(model)}
    return {name for name, child in model.named_children() if any(id(m) in tables for m in child.modules())}


@dataclass
class ShardedRanker:
    """A sharded model (ranker, GEM or DLRM) and its optimisers on one rank.

    Attributes:
        model: the DistributedModelParallel (or DMPCollection) wrapping the model.
        dense_optimizer: Adam over the dense DTensor parameters.
        mesh: the 2-D ("replicate", "shard") device mesh of the dense part.
        num_dense: F.
        dense_modules: names of the fully_shard-ed top-level sub-modules.
        sparse_wrapper: "dmp", or "dmp_collection" (``model`` is a DMPCollection, whose table replicas need ``sync()``).
    """

    model: DistributedModelParallel
    dense_optimizer: torch.optim.Optimizer
    mesh: DeviceMesh
    num_dense: int
    dense_modules: tuple[str, ...] = DENSE_MODULES
    sparse_wrapper: SparseWrapper = "dmp"

    @property
    def ranker(self) -> nn.Module:
        """The wrapped model (its embedding collections replaced by sharded ones)."""
        return self.model.module

    @property
    def sparse_optimizer(self) -> torch.optim.Optimizer:
        """TorchRec's keyed optimiser of the fused embedding tables (stepped inside backward)."""
        return self.model.fused_optimizer

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits (b, 2) float32 of this rank's slice; domain ids from the model's vocabulary (unknown -> K)."""
        from trainer.models.towers import encode_domains

        ids = encode_domains(getattr(self.ranker, "domains", ()), batch.domains).to(batch.dense.device)
        return self.model(batch.sparse, batch.sequence, batch.dense, ids)


ShardedModel = ShardedRanker
"""The same type under the name that says what it holds since GEM and DLRM shard too."""


def _table_names(model: nn.Module) -> list[str]:
    names = []
    for m in _embedding_modules(model):
        configs = m.embedding_bag_configs() if hasattr(m, "embedding_bag_configs") else m.embedding_configs()
        names += [c.name for c in configs]
    return names


def shard_ranker(model: Ranker, tc: TrainerConfig, world_size: int) -> ShardedRanker:
    """Apply the wrap order of the module docstring to ``model`` (needs an initialised process group).

    ``model``: a ShardableRanker, GemModel or DLRM (see :func:`build_shardable_model`).

    Raises:
        ValueError: a bad mesh shape or sharding group for this world size.
        TypeError: a model without a dense module to shard (:func:`dense_module_names`).
    """
    from torchrec.distributed.comm_ops import set_gradient_division
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    dc = tc.distributed
    device = rank_device(dc)
    dense_modules = dense_module_names(model)
    replicate, shard = resolve_mesh_shape(world_size, dc.mesh_shape)
    wrapper = choose_sparse_wrapper(dc, world_size)
    # Process-wide in TorchRec: the all-to-all backward sums the ranks' table gradients (module docstring).
    set_gradient_division(False)
    # The one-process trainer's rule (trainer.sparse_optim), fused into fbgemm's backward.
    optimizer_class, optimizer_kwargs = fused_optimizer(tc)
    apply_optimizer_in_backward(optimizer_class, model.embedding_parameters(), optimizer_kwargs)
    constraints = {name: ParameterConstraints(sharding_types=list(allowed_sharding_types(dc))) for name in _table_names(model)}
    roots = _sparse_roots(model)
    initial_tables = {k: v.detach().clone() for k, v in model.state_dict().items() if k.split(".")[0] in roots}
    group_size = world_size if wrapper == "dmp" else dc.sharding_group_size
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=group_size, compute_device=dc.device), constraints=constraints, debug=False
    )
    plan = planner.collective_plan(model, None, dist.GroupMember.WORLD)
    if wrapper == "dmp":
        dmp = DistributedModelParallel(
            model, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD), device=device, plan=plan, init_data_parallel=False
        )
    else:  # pragma: no cover - CUDA only (see module docstring)
        from torchrec.distributed.model_parallel import DMPCollection

        dmp = DMPCollection(
            module=model, device=device, plan=plan, world_size=world_size, sharding_group_size=group_size,
            global_pg=dist.GroupMember.WORLD, init_data_parallel=False,
        )
    copy_into_shards(dmp, initial_tables)
    mesh = init_device_mesh(dc.device, (replicate, shard), mesh_dim_names=("replicate", "shard"))
    inner = dmp.module
    for name in dense_modules:
        fully_shard(getattr(inner, name), mesh=mesh)
        getattr(inner, name).set_gradient_divide_factor(1.0)
        # gloo has no PREMUL_SUM; plain sums are what a factor of 1 means anyway.
        getattr(inner, name).set_force_sum_reduction_for_comms(True)
    if tc.compile:
        compile_dense(inner)
    dense_params = [(name, p) for name, p in dmp.named_parameters() if name.split(".")[0] in dense_modules]
    return ShardedRanker(
        model=dmp,
        dense_optimizer=torch.optim.Adam(dense_param_groups(tc, dense_params)),
        mesh=mesh,
        num_dense=model.num_dense,
        dense_modules=dense_modules,
        sparse_wrapper=wrapper,
    )


shard_model = shard_ranker
"""The same function under the name that says what it takes since GEM and DLRM shard too."""


def copy_into_shards(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy full tables (``full[key]`` (rows, D)) into this rank's shards of ``model.state_dict()``.

    The sharded kernels allocate and initialise their own weights; copying the seeded CPU
    initialisation in keeps every world size (and the one-process trainer) starting from the same
    parameters. Shard placement comes from each ShardedTensor's metadata (offsets, sizes).

    Raises:
        ValueError: a key of ``full`` is missing from the model, or shapes disagree.
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    state = {k.removeprefix("_dmp_wrapped_module.").removeprefix("module."): v for k, v in model.state_dict().items()}
    with torch.no_grad():
        for key, table in full.items():
            if key not in state:
                raise ValueError(f"sharded model has no {key!r}; it has {sorted(state)}")
            target = state[key]
            if tuple(target.shape) != tuple(table.shape):
                raise ValueError(f"{key}: sharded shape {tuple(target.shape)} but full table {tuple(table.shape)}")
            if isinstance(target, ShardedTensor):
                for shard in target.local_shards():
                    (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(table[r0 : r0 + nr, c0 : c0 + nc])
            else:
                target.copy_(table)


def compile_dense(model: nn.Module) -> None:
    """``torch.compile`` the dense sub-modules (:func:`dense_module_names`) in place (``nn.Module.compile``); lookups
    stay eager. Sets :func:`capture_data_dependent_sizes` first (process-wide dynamo settings)."""
    capture_data_dependent_sizes()
    for name in dense_module_names(model):
        getattr(model, name).compile()


def capture_data_dependent_sizes() -> None:
    """Let dynamo trace the jagged dense part whole: a size read from data (``int(offsets[-1])``, a row's
    length, the tokens a recency window keeps) becomes a symbolic size in the graph (``capture_scalar_outputs``)
    and so do the outputs of data-dependent ops (``capture_dynamic_output_shape_ops``: a boolean mask's
    ``nonzero``), instead of a graph break at each; the checks that would branch on such values run where a
    batch is built (trainer.loop.prepare_batch). tests/trainer/test_device.py counts the breaks."""
    import torch._dynamo

    torch._dynamo.config.capture_scalar_outputs = True
    torch._dynamo.config.capture_dynamic_output_shape_ops = True


def distributed_train_step(sharded: ShardedRanker, local: Batch, global_batch_size: int, *, weight: float = 1.0,
                           task_weights: Sequence[float] = (1.0, 1.0)) -> float | None:
    """One step on this rank's slice of a global batch; returns the global mean loss (same on every rank).

    The loss is the sum over both heads of BCE-with-logits, averaged over the global batch, as
    trainer.loop.train_step computes it in one process. Every rank must call this the same
    number of times (the embedding all-to-alls are collective). Returns None on every rank,
    with no parameter changed, when the global loss is NaN or inf.

    Args:
        weight: factor on this rank's loss; 0.0 for a rank whose slice is empty, which still has to take
            part in the collectives: it passes a stand-in row whose loss and gradients count zero.

    Raises:
        ValueError: the local slice breaks the Batch layout.
    """
    validate_batch(local, sharded.num_dense)
    logits = sharded.forward(local)
    loss = weight * loss_terms(logits, local.labels, local.delayed, local.final, task_weights).sum() / global_batch_size
    total = loss.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    sharded.dense_optimizer.zero_grad()
    if not torch.isfinite(total):
        # The sparse step runs inside backward, so skipping means not calling backward at all.
        return None
    loss.backward()
    sharded.dense_optimizer.step()
    return float(total.item())


def full_state_dict(sharded: ShardedRanker) -> dict[str, torch.Tensor] | None:
    """Unsharded parameters on rank 0 (None on other ranks), keyed as the unsharded model's state_dict().

    Collective: every rank must call it. Dense DTensors are gathered with ``full_tensor()``;
    sharded tables with ``ShardedTensor.gather``.
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    rank = dist.get_rank()
    out: dict[str, torch.Tensor] = {}
    for key, value in sharded.model.state_dict().items():
        key = key.removeprefix("_dmp_wrapped_module.").removeprefix("module.")
        if isinstance(value, ShardedTensor):
            full = torch.empty(value.size(), dtype=value.dtype) if rank == 0 else None
            value.gather(dst=0, out=full)
            value = full
        elif hasattr(value, "full_tensor"):
            value = value.full_tensor()
        if rank == 0:
            out[key] = value.detach().clone()
    return out if rank == 0 else None
