"""The one training loop of every trainer entry point, and the interface it trains through.

Three callers share :func:`train_loop`: the one-shot run (trainer.train.train_holdout: epochs over the
train days), its sharded twin under torchrun (trainer.launch, same function) and the continuous trainer
(trainer.continuous: each new examples version). What differs between one process and N ranks sits
behind :class:`Engine`, as torchtitan keeps its ``Trainer`` loop apart from the parallelisms and the
``CheckpointManager``:

    ============  =======================================  ==========================================
    Engine        LocalEngine (this module)                ShardedEngine (trainer.sharded_engine)
    ============  =======================================  ==========================================
    model         build_model, Adam + Adagrad              DMP tables + FSDP2 HSDP dense part
    train_step    the whole global batch                   this rank's slice of it (split_rows)
    predict       every row                                a slice per rank, gathered on rank 0
    save          step-N/ (state.pt: model, optimisers)    DCP shards + rank 0's step-N/ (full
                                                           parameters) naming them
    load          load_checkpoint (a sharded run's:        check_resumable + DCP load
                  parameters only, fresh optimisers)
    ============  =======================================  ==========================================

Every checkpoint has one format (trainer.checkpoint): ``step-N/meta.json`` (written last: step,
examples seen, the caller's position and its extra) and ``state.pt`` with the full parameters, so a
sharded run's checkpoint warm-starts a one-process run; the optimiser state lives in ``state.pt`` (one
process) or in the DCP folder beside it, ``_checkpoints/sharded/step-N`` (sharded runs; ``extra["sharded"]`` marks one).

Devices: the model lives on ``trainer.device``; each step's batch is built from its rows, checked, pinned (CUDA) and
copied to the device one step ahead on a background thread (:func:`prepare_batch`, trainer.prefetch), so the forward
gets tensors already there and checks nothing that would sync with the device. ``trainer.precision = "bf16"``
runs the forward under bf16 autocast (:func:`autocast`).

Shape letters: B global batch, N rows of an encoded read batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import torch
from tqdm import tqdm

from gemline.lake import StorageOptions
from trainer.checkpoint import TrainState, load_checkpoint, load_weights, save_checkpoint
from trainer.config import PrecisionName, TrainerConfig
from trainer.data import Batch, EncodedExamples, iter_batches, make_batch, validate_batch
from trainer.ema import averaged_parameters, parameter_average
from trainer.labels import loss_terms
from trainer.models import build_model, encode_domains
from trainer.models.gem import dense_param_groups
from trainer.models.towers import RankingModel
from trainer.prefetch import Prefetcher
from trainer.sparse_optim import embedding_optimizer

if TYPE_CHECKING:
    from trainer.models import Ranker

log = logging.getLogger(__name__)


def domain_ids(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """(B,) int64 ids of ``batch.domains`` in the model's domain vocabulary (unknown -> K)."""
    return encode_domains(getattr(getattr(model, "module", model), "domains", ()), batch.domains)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s parameters (CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


class DeviceBatch(NamedTuple):
    """A checked batch on the model's device, ready for a forward (:func:`prepare_batch`)."""

    batch: Batch
    """Every tensor on the device."""
    domain_ids: torch.Tensor
    """(B,) int64 on the device, in [0, K] (:func:`domain_ids`)."""


def prepare_batch(model: Ranker, batch: Batch, device: torch.device | str | None = None) -> DeviceBatch:
    """Check ``batch`` (a host batch, :func:`trainer.data.validate_batch`), encode its domains, and start its copy
    to ``device`` (None: the model's): page-locked first on CUDA, so the copy is asynchronous
    (``non_blocking``; the caching host allocator keeps the pinned memory until the copy is done).

    The checks run here, on the host, once per batch, so the forward checks nothing that reads a device value.
    Safe on a background thread: of ``model`` it reads ``num_dense``, ``domains`` and (``device`` None) where its
    parameters are, never their values.

    Raises:
        ValueError: the batch breaks the :class:`trainer.data.Batch` layout.
    """
    validate_batch(batch, model.num_dense)
    ids = domain_ids(model, batch)
    target = model_device(model) if device is None else torch.device(device)
    if target.type == "cuda":
        ids = ids.pin_memory()
    return DeviceBatch(to_device(batch, target), ids.to(target, non_blocking=True))


def to_device(batch: Batch, device: torch.device) -> Batch:
    """``batch`` on ``device``: pinned first when it is a CUDA device, then copied with ``non_blocking``."""
    if device.type == "cuda":
        batch = batch.pin_memory()
    return batch.to(device, non_blocking=True)


def autocast(device: torch.device, precision: PrecisionName) -> AbstractContextManager:
    """bf16 autocast on ``device``'s type for ``precision = "bf16"`` (a no-op for fp32).

    Under it the dense part's matmuls (linear layers, attention, the Wukong products) run in bfloat16; the embedding
    lookups are not autocast ops, so the tables and their rows stay float32; parameters and optimiser state stay
    float32 (autocast casts copies), and the loss is computed on float32 logits (:func:`forward`). bf16 has float32's
    exponent range, so unlike fp16 no loss scaling is needed (PyTorch AMP docs, "torch.autocast").
    """
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def forward(model: torch.nn.Module, prepared: DeviceBatch, precision: PrecisionName = "fp32") -> torch.Tensor:
    """(B, 2) float32 logits of ``prepared`` (its batch on ``model``'s device) at ``precision``."""
    batch = prepared.batch
    with autocast(model_device(model), precision):
        logits = model(batch.sparse, batch.sequence, batch.dense, prepared.domain_ids)
    return logits.float()


def training_logits(model: torch.nn.Module, prepared: DeviceBatch, precision: PrecisionName = "fp32") -> tuple[torch.Tensor, ...]:
    """The (B, 2) float32 logits whose losses a training step sums, the prediction's first: the model's
    ``training_logits`` (trainer.models.towers.RankingModel; two for GEM's wide part on its own loss), or the
    forward's alone for a model without one."""
    own = getattr(model, "training_logits", None)
    if own is None:
        return (forward(model, prepared, precision),)
    batch = prepared.batch
    with autocast(model_device(model), precision):
        parts = own(batch.sparse, batch.sequence, batch.dense, prepared.domain_ids)
    return tuple(p.float() for p in parts)


def train_step(model: Ranker, optimizers: Mapping[str, torch.optim.Optimizer], batch: Batch | DeviceBatch,
               task_weights: Sequence[float] = (1.0, 1.0), *, precision: PrecisionName = "fp32") -> float | None:
    """One optimiser step on BCE-with-logits of both heads (weighted by ``task_weights``, summed, final
    labels only: :func:`trainer.labels.loss_terms`), summed over the model's :func:`training_logits` (one set but for
    GEM's wide part on its own loss), then the update of the model's parameter average if it has one (trainer.ema);
    returns the prediction's loss (that of the first logits).

    ``batch``: a host :class:`trainer.data.Batch` (checked and moved to the model's device here) or a
    :class:`DeviceBatch` from :func:`prepare_batch` (the trainer's path: prepared one step ahead).
    ``precision``: the forward's (:func:`autocast`). Returns None, leaving parameters and optimiser state
    untouched, when the loss is NaN or inf (one host sync per step: the loss is read back).

    Raises:
        ValueError: the batch breaks the :class:`trainer.data.Batch` layout.
    """
    prepared = batch if isinstance(batch, DeviceBatch) else prepare_batch(model, batch)
    rows = prepared.batch
    # Importance-weighted for rows published before their labels were final (trainer.delayed).
    losses = [loss_terms(logits, rows.labels, rows.delayed, rows.final, task_weights).mean(dim=0).sum()
              for logits in training_logits(model, prepared, precision)]
    loss = losses[0] if len(losses) == 1 else torch.stack(losses).sum()
    for opt in optimizers.values():
        opt.zero_grad()
    if not torch.isfinite(loss):
        return None
    loss.backward()
    for opt in optimizers.values():
        opt.step()
    average = parameter_average(model)
    if average is not None:
        average.update()
    return float(losses[0].item())


def predict(model: Ranker, data: EncodedExamples, batch_size: int, *,
            precision: PrecisionName = "fp32") -> np.ndarray:
    """(N, 2) float64 probabilities (click, conversion) of every row of ``data``, in order; batches are prepared
    one ahead on the model's device (:func:`prepare_batch`), each batch's probabilities copied back once.

    A model with a parameter average (trainer.gem.ema_decay, trainer.ema) predicts with the averaged parameters.
    The forward runs in eval mode under ``torch.inference_mode`` (no autograd graph or version counters: 5% less
    CPU than ``no_grad`` on the freshness lake's progressive evaluation). ``batch_size`` is kept by the caller:
    larger batches were slower on this CPU (gem_small, rows of 512 / 1024 / 2048 / 4096: 3.53 / 3.57 / 4.67 /
    5.27 CPU-s over the same five versions), the activations falling out of cache.
    """
    model.eval()
    out = []
    device = model_device(model)
    with averaged_parameters(model), torch.inference_mode(), Prefetcher(iter_batches(data, batch_size), lambda b: prepare_batch(model, b, device)) as ready:
        for _, prepared in ready:
            out.append(torch.sigmoid(forward(model, prepared, precision)).to("cpu", torch.float64).numpy())
    model.train()
    return np.concatenate(out) if out else np.zeros((0, 2))


class Engine(Protocol):
    """What the loop needs of a model and its optimisers, in one process or on one rank of N.

    Every method is collective on a sharded engine: each rank calls it the same number of times.
    """

    rank: int
    """This process's global rank (0 in one process); only rank 0 writes tables, reports and results."""
    world_size: int
    """Processes training together (1 in one process)."""

    def prepare(self, data: EncodedExamples, rows: np.ndarray) -> Any:
        """What :meth:`train_prepared` needs of the global batch ``rows`` (B,) int64 of ``data``: this process's
        batch built, checked and on its way to the device. Called on the prefetch thread (trainer.prefetch), one
        step ahead: it must not touch parameters or run collectives."""
        ...

    def train_prepared(self, prepared: Any) -> float | None:
        """One optimiser step on a global batch :meth:`prepare` made; the mean loss over the global batch (the
        same on every rank), or None when the step was skipped (non-finite loss, or a global batch too small to
        give every rank a row)."""
        ...

    def train_step(self, data: EncodedExamples, rows: np.ndarray) -> float | None:
        """:meth:`train_prepared` of :meth:`prepare` ``(data, rows)``, in one call."""
        ...

    def predict(self, data: EncodedExamples, batch_size: int) -> np.ndarray | None:
        """(N, 2) float64 probabilities of every row of ``data`` on rank 0; None on the other ranks."""
        ...

    def save(self, root: str | Path, state: TrainState, *, files: Mapping[str, bytes] | None = None,
             storage_options: StorageOptions | None = None) -> str | None:
        """Write checkpoint ``step-<state.step>`` under ``root/_checkpoints``; its path on rank 0, None elsewhere."""
        ...

    def load(self, path: str | Path, state: TrainState) -> None:
        """Restore the checkpoint at ``path`` (whose meta.json reads ``state``) into this engine in place."""
        ...


@dataclass
class LocalEngine:
    """:class:`Engine` of a one-process run: the model and its optimisers (``"dense"`` Adam, ``"embeddings"``: :func:`local_optimizers`)."""

    model: Ranker
    optimizers: dict[str, torch.optim.Optimizer]
    rank: int = 0
    world_size: int = 1
    task_weights: tuple[float, float] = (1.0, 1.0)
    precision: PrecisionName = "fp32"
    """The forward's arithmetic (:func:`autocast`); the model's device is where its parameters are."""

    def prepare(self, data: EncodedExamples, rows: np.ndarray) -> DeviceBatch:
        """See :meth:`Engine.prepare`: :func:`prepare_batch` of the whole batch."""
        return prepare_batch(self.model, make_batch(data, rows))

    def train_prepared(self, prepared: DeviceBatch) -> float | None:
        """See :meth:`Engine.train_prepared` (the module-level :func:`train_step`)."""
        return train_step(self.model, self.optimizers, prepared, self.task_weights, precision=self.precision)

    def train_step(self, data: EncodedExamples, rows: np.ndarray) -> float | None:
        """See :meth:`Engine.train_step`."""
        return self.train_prepared(self.prepare(data, rows))

    def predict(self, data: EncodedExamples, batch_size: int) -> np.ndarray:
        """See :meth:`Engine.predict`."""
        return predict(self.model, data, batch_size, precision=self.precision)

    def save(self, root: str | Path, state: TrainState, *, files: Mapping[str, bytes] | None = None,
             storage_options: StorageOptions | None = None) -> str:
        """See :meth:`Engine.save`: ``state.pt`` holds model, optimisers and RNG states."""
        return str(save_checkpoint(root, state, self.model, self.optimizers, extra_files=files, storage_options=storage_options))

    def load(self, path: str | Path, state: TrainState) -> None:
        """See :meth:`Engine.load`. A sharded run's checkpoint (``extra["world_size"]``) holds full parameters
        but no optimiser state here: the parameters are loaded and the optimisers start fresh (a warm start)."""
        if "world_size" in state.extra:
            load_weights(path, self.model)
            log.info("warm start from the parameters of a %d-process run; optimisers start fresh", state.extra["world_size"])
        else:
            load_checkpoint(path, self.model, self.optimizers)


EngineFactory = Callable[[TrainerConfig, int, tuple[str, ...], "torch.Tensor | None"], Engine]
"""``factory(tc, num_dense, domains, base_rates)``: a fresh engine after ``torch.manual_seed(tc.seed)``;
``base_rates`` (2,) float64 start the output intercepts (``init_output_bias``), None leaves them."""


def sparse_table_gradients(model: torch.nn.Module, params: Iterable[torch.nn.Parameter]) -> int:
    """Make every ``nn.Embedding`` / ``nn.EmbeddingBag`` of ``model`` whose weight is in ``params`` (the tables
    Adagrad optimises) produce sparse gradients (``sparse=True``); return how many.

    Why: a dense gradient is the size of the whole table, so each step zeroed, filled and Adagrad-updated
    every row (19.2M parameters of the default GEM), whatever the batch touched; with sparse gradients
    ``torch.optim.Adagrad`` updates only the rows the batch looked up (its sparse path), and rows with a zero
    gradient are left as the dense update leaves them. Measured on 20k examples of the freshness benchmark's
    lake, GEM, one thread: 0.40 -> 0.23-0.28 CPU-s per 1,000 examples, the same losses to 6 decimals.
    Adam (the dense part) takes no sparse gradients, so only ``params``' tables are switched.
    """
    # Adagrad's sparse path builds COO tensors of indices it made itself: opting out of the invariant checks
    # explicitly keeps them off (as they were) and silences torch's "implicitly disabled" warning per process.
    torch.sparse.check_sparse_tensor_invariants.disable()
    ids = {id(p) for p in params}
    switched = 0
    for module in model.modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and id(module.weight) in ids:
            module.sparse = True
            switched += 1
    return switched


def local_optimizers(tc: TrainerConfig, model: Ranker) -> dict[str, torch.optim.Optimizer]:
    """``{"dense": Adam, "embeddings": trainer.embedding_optimizer}`` of a one-process ``model``, its tables switched
    to sparse gradients (:func:`sparse_table_gradients`).

    Adam (as DLRM-v3 trains the dense part) gets ``dense_parameters()``, which leave out every table parameter, in
    :func:`trainer.models.gem.dense_param_groups` (GEM's wide part at its own rate).
    """
    tables = model.embedding_parameters()
    sparse_table_gradients(model, tables)
    dense = {id(p) for p in model.dense_parameters()}
    return {
        "dense": torch.optim.Adam(dense_param_groups(tc, ((n, p) for n, p in model.named_parameters() if id(p) in dense))),
        "embeddings": embedding_optimizer(tc, tables),
    }


def local_engine(tc: TrainerConfig, num_dense: int, domains: tuple[str, ...], base_rates: torch.Tensor | None) -> LocalEngine:
    """:data:`EngineFactory` of one process: ``build_model`` on ``tc.device`` (built on the CPU under the seed, then
    moved, so every device starts from the same parameters), its dense part compiled with ``tc.compile``
    (:func:`trainer.distributed.compile_dense`), :func:`local_optimizers`; forwards at ``tc.precision``."""
    model = build_model(tc, num_dense, domains)
    if base_rates is not None and isinstance(model, RankingModel):  # the "ranker" has no intercepts to set
        model.init_output_bias(base_rates)
    model.to(tc.device)
    if tc.compile:
        from trainer.distributed import compile_dense

        if model_dense_modules(model):
            compile_dense(model)
        else:
            log.info("trainer.compile: %s has no dense module to compile; it runs eagerly", tc.model)
    return LocalEngine(model, local_optimizers(tc, model), task_weights=tc.task_weights, precision=tc.precision)


def model_dense_modules(model: torch.nn.Module) -> tuple[str, ...]:
    """:func:`trainer.distributed.dense_module_names` of ``model``, or () for one without a dense module (LR)."""
    from trainer.distributed import dense_module_names

    try:
        return dense_module_names(model)
    except TypeError:
        return ()


@dataclass
class Progress:
    """Counters a run keeps across the loop's calls and its checkpoints."""

    step: int = 0
    """Optimiser steps taken (skipped steps not counted)."""
    examples_seen: int = 0
    """Rows those steps trained on."""
    losses: list[float] = field(default_factory=list)
    """Loss of each step of this process's run (not of resumed steps)."""


class GlobalBatch(NamedTuple):
    """One step's work: rows ``rows`` (B,) int64 of ``data``; ``after`` is the caller's position once it is
    trained (what a checkpoint taken right after it must resume from); ``context``: anything else the caller's
    ``on_step`` needs of this batch (the loop draws the next batch before this one's ``on_step``)."""

    data: EncodedExamples
    rows: np.ndarray
    after: Any
    context: Any = None


def train_loop(engine: Engine, progress: Progress, batches: Iterable[GlobalBatch], *,
               checkpoint_every_steps: int | None = None, checkpoint: Callable[[Any], object] | None = None,
               bar: tqdm | None = None, on_step: Callable[[GlobalBatch, int], object] | None = None,
               prefetch: int = 1) -> None:
    """Train ``engine`` on each global batch in turn, counting into ``progress``.

    Batches are drawn from ``batches`` and prepared (:meth:`Engine.prepare`) ``prefetch`` steps ahead on a
    background thread (:class:`trainer.prefetch.Prefetcher`; 0: inline), in order, each once; an error of
    either is raised here at that batch's place, and the thread is stopped before this returns or raises.
    So ``batches`` is advanced up to ``prefetch`` batches before the step that trains them: its side
    effects must not be read as "trained" (the callers' checkpoints carry their position in ``after``).

    A skipped step (:meth:`Engine.train_prepared` returned None) moves no counter and calls nothing.
    ``on_step(batch, step)`` is called after each step taken (the continuous trainer times each row's step
    from it: trainer.freshness; what it needs travels in ``batch.context``). Every
    ``checkpoint_every_steps`` steps ``checkpoint(batch.after)`` is called (collective on a sharded engine:
    every rank reaches the same steps, since the loss that decides a skip is reduced over ranks).
    """
    with Prefetcher(batches, lambda b: engine.prepare(b.data, b.rows), depth=prefetch) as ready:
        for batch, prepared in ready:
            if bar is not None:
                bar.update(1)
            loss = engine.train_prepared(prepared)
            if loss is None:
                log.warning("step after %d skipped at %s (non-finite loss or a batch of %d rows < %d ranks)",
                            progress.step, batch.after, len(batch.rows), engine.world_size)
                continue
            progress.step += 1
            progress.examples_seen += len(batch.rows)
            progress.losses.append(loss)
            if on_step is not None:
                on_step(batch, progress.step)
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4f}")
            if checkpoint is not None and checkpoint_every_steps is not None and progress.step % checkpoint_every_steps == 0:
                checkpoint(batch.after)
