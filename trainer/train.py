"""One training run: gate check, temporal split, train, evaluate on the last day, checkpoint.

Optimisers: Adagrad on the embedding tables (rows are touched sparsely, Adagrad's per-row step
size suits that; Duchi et al. 2011), Adam on the rest. This module trains in one process; the
sharded multi-process run (`gemline train --nproc N`, TorchRec DMP then FSDP2 HSDP, wrap order
in trainer.distributed) is trainer.launch.run_distributed_training.

Restarts: with ``trainer.init_from = "latest"`` a run continues from the newest checkpoint. If
that checkpoint is an unfinished run on the same examples version and epoch count (written every
``trainer.checkpoint_every_steps``), it continues at the next batch and ends with the same
parameters as an uninterrupted run; otherwise it warm-starts and trains every epoch.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.nn import functional as F
from tqdm import tqdm

from gemline.config import GemlineConfig
from gemline.errors import GemlineError
from gemline.gate import gate_decision
from gemline.lake import Lake
from gemline.tables import Table
from trainer.checkpoint import TrainState, latest_checkpoint, load_checkpoint, load_weights, read_state, save_checkpoint
from trainer.data import (
    Batch,
    DenseNormalizer,
    EncodedExamples,
    encode_examples,
    fit_normalizer,
    iter_batches,
    latest_examples_version,
    load_split,
    make_batch,
    num_batches,
    validate_batch,
)
from trainer.metrics import evaluate, nan_to_none
from trainer.models import build_model, encode_domains
from trainer.models.towers import RankingModel

if TYPE_CHECKING:
    from trainer.models import Ranker

log = logging.getLogger(__name__)


class QuarantinedError(GemlineError, RuntimeError):
    """The requested ``examples`` version failed its quality gate; the trainer refuses it (exit 3)."""

    exit_code = 3


@dataclass(frozen=True)
class TrainResult:
    """What one run trained on, how it did, and where its checkpoint is.

    Attributes:
        examples_version: Delta version of ``examples`` trained on.
        train_examples: rows in the train split (every date but the last).
        eval_examples: rows in the eval split.
        eval_date: the eval day (YYYY-MM-DD UTC).
        metrics: ``{task: {"overall": m, "by_domain": {domain: m}}}``, task in (click, conversion),
            m with auc, ne, calibration, num_examples, base_rate (see trainer.metrics.evaluate).
        checkpoint_path: directory of the checkpoint saved at the end.
        steps: global optimiser step count at the end (includes resumed steps).
        loss_curve: loss of each step of this run (sum of the two BCE terms), skipped steps omitted.
    """

    examples_version: int
    train_examples: int
    eval_examples: int
    eval_date: str
    metrics: dict
    checkpoint_path: str
    steps: int
    loss_curve: list[float]


def _loss_curve_png(loss_curve: list[float]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5))
    ax = fig.add_subplot()
    ax.plot(range(1, len(loss_curve) + 1), loss_curve, linewidth=1)
    ax.set_xlabel("step of this run")
    ax.set_ylabel("BCE click + conversion")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return buf.getvalue()


def check_gate(lake: Lake | str, examples_version: int, *, storage_options: dict[str, str] | None = None) -> None:
    """Raise QuarantinedError unless the gate allows ``examples@examples_version`` (``lake``: a Lake,
    or a root with its ``storage_options``)."""
    decision = gate_decision(lake, Table.EXAMPLES, examples_version, storage_options=storage_options)
    if not decision.allowed:
        log.error("refusing to train: %s", decision.reason)
        raise QuarantinedError(decision.reason)
    log.info("gate: %s", decision.reason)


def domain_ids(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """(B,) int64 ids of ``batch.domains`` in the model's domain vocabulary (unknown -> K)."""
    return encode_domains(getattr(getattr(model, "module", model), "domains", ()), batch.domains)


def train_step(model: Ranker, optimizers: dict[str, torch.optim.Optimizer], batch: Batch) -> float | None:
    """One optimiser step on BCE-with-logits of both heads (summed); returns the loss.

    Returns None, leaving parameters and optimiser state untouched, when the loss is NaN or inf.

    Raises:
        ValueError: the batch breaks the :class:`trainer.data.Batch` layout.
    """
    validate_batch(batch, model.num_dense)
    logits = model(batch.sparse, batch.sequence, batch.dense, domain_ids(model, batch))
    loss = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="none").mean(dim=0).sum()
    for opt in optimizers.values():
        opt.zero_grad()
    if not torch.isfinite(loss):
        return None
    loss.backward()
    for opt in optimizers.values():
        opt.step()
    return float(loss.item())


def predict(model: torch.nn.Module, data: EncodedExamples, batch_size: int) -> np.ndarray:
    """(N, 2) float64 probabilities (click, conversion) of every row of ``data``, in order."""
    model.eval()
    out = []
    with torch.no_grad():
        for batch in iter_batches(data, batch_size):
            out.append(torch.sigmoid(model(batch.sparse, batch.sequence, batch.dense, domain_ids(model, batch))).double().numpy())
    model.train()
    return np.concatenate(out) if out else np.zeros((0, 2))


def run_training(config: GemlineConfig, *, examples_version: int | None = None, progress: bool = True) -> TrainResult:
    """Train on ``examples@examples_version`` (latest when None) and evaluate on its last day.

    Raises:
        QuarantinedError: the quality gate does not allow that version.
        FileNotFoundError: no examples table.
        ValueError: fewer than 2 event dates, or a table that breaks the examples contract.
    """
    tc, lake = config.trainer, Lake.for_config(config)
    version = latest_examples_version(lake) if examples_version is None else examples_version
    check_gate(lake, version)
    previous_threads = torch.get_num_threads()
    if tc.torch_threads is not None:
        torch.set_num_threads(tc.torch_threads)
    try:
        return _train(config, version, progress)
    finally:
        torch.set_num_threads(previous_threads)


def epoch_order(num_rows: int, seed: int, examples_version: int, epoch: int) -> np.ndarray:
    """(num_rows,) int64 permutation of an epoch, a pure function of its arguments.

    Deriving it from (seed, version, epoch) instead of one running generator lets a run resumed
    mid-epoch rebuild the exact order it was following.
    """
    return np.random.default_rng([seed, examples_version, epoch]).permutation(num_rows)


@dataclass(frozen=True)
class _Position:
    """Where a run is: the next batch to train is batch ``batch`` of epoch ``epoch``."""

    epoch: int
    batch: int


def _run_record(position: _Position, epochs: int, finished: bool) -> dict:
    return {"epoch": position.epoch, "batch": position.batch, "epochs": epochs, "finished": finished}


def _resume_position(state: TrainState, version: int, epochs: int) -> _Position:
    """Continue an unfinished run of the same version and epoch count; otherwise start at epoch 0."""
    run = state.extra.get("run")
    if run and not run["finished"] and state.examples_version == version and run["epochs"] == epochs:
        return _Position(run["epoch"], run["batch"])
    return _Position(0, 0)


def _train(config: GemlineConfig, version: int, progress: bool) -> TrainResult:
    """run_training after the gate allowed ``version``."""
    tc, lake = config.trainer, Lake.for_config(config)
    split = load_split(lake, version)

    torch.manual_seed(tc.seed)
    resume_from = latest_checkpoint(lake) if tc.init_from == "latest" else None
    normalizer = fit_normalizer(split.train)
    domains = training_domains(split.train, resume_from)
    model = build_model(tc, len(normalizer.names), domains)
    optimizers = {
        "dense": torch.optim.Adam(model.dense_parameters(), lr=tc.learning_rate),
        "embeddings": torch.optim.Adagrad(model.embedding_parameters(), lr=tc.embedding_learning_rate or tc.learning_rate),
    }
    step, examples_seen, start = 0, 0, _Position(0, 0)
    if resume_from is not None and "world_size" in read_state(resume_from).extra:
        # A sharded run saves full parameters only (trainer.launch): warm start with fresh optimisers.
        state = load_weights(resume_from, model)
        log.info("warm start from the parameters of a %d-process run; optimisers start fresh", state.extra["world_size"])
    elif resume_from is not None:
        state = load_checkpoint(resume_from, model, optimizers)
    if resume_from is not None:
        step, examples_seen = state.step, state.examples_seen
        start = _resume_position(state, version, tc.epochs)
        # Keep the statistics the resumed weights were trained with, so inputs mean the same thing.
        saved = DenseNormalizer.from_dict(state.extra["normalizer"])
        if saved.names != normalizer.names:
            raise ValueError(
                f"checkpoint {resume_from} was trained on dense features {saved.names}, this table has "
                f"{normalizer.names}; use trainer.init_from=scratch"
            )
        normalizer = saved
        log.info("resumed from %s at step %d (epoch %d, batch %d)", resume_from, step, start.epoch, start.batch)

    train = encode_examples(split.train, tc.num_embeddings, normalizer)
    evaluation = encode_examples(split.eval, tc.num_embeddings, normalizer)
    if resume_from is None and isinstance(model, RankingModel):  # the "ranker" has no init_output_bias
        model.init_output_bias(prior_rates(train.labels))
    log.info(
        "examples@%d: train %d rows on %s, eval %d rows on %s",
        version, len(train), ",".join(split.train_dates), len(evaluation), split.eval_date,
    )

    def checkpoint(position: _Position, finished: bool, extra: dict | None = None, files: dict | None = None) -> str:
        state = TrainState(
            step=step,
            examples_seen=examples_seen,
            examples_version=version,
            extra={"normalizer": normalizer.to_dict(), "domains": list(domains), "model": tc.model, "run": _run_record(position, tc.epochs, finished), **(extra or {})},
        )
        return str(save_checkpoint(lake, state, model, optimizers, extra_files=files))

    loss_curve: list[float] = []
    per_epoch = num_batches(train, tc.batch_size)
    with tqdm(total=tc.epochs * per_epoch, initial=start.epoch * per_epoch + start.batch, desc="train", unit="step", disable=not progress) as bar:
        for epoch in range(start.epoch, tc.epochs):
            order = epoch_order(len(train), tc.seed, version, epoch)
            first = start.batch if epoch == start.epoch else 0
            for index in range(first, per_epoch):
                batch = make_batch(train, order[index * tc.batch_size : (index + 1) * tc.batch_size])
                bar.update(1)
                loss = train_step(model, optimizers, batch)
                if loss is None:
                    log.warning("epoch %d batch %d: non-finite loss, step skipped", epoch, index)
                    continue
                step += 1
                examples_seen += batch.batch_size
                loss_curve.append(loss)
                bar.set_postfix(loss=f"{loss:.4f}")
                if tc.checkpoint_every_steps is not None and step % tc.checkpoint_every_steps == 0:
                    checkpoint(_Position(epoch, index + 1), finished=False)

    probs = predict(model, evaluation, tc.batch_size)
    metrics = evaluate(evaluation.labels, probs, evaluation.domains)
    overall = {task: metrics[task]["overall"] for task in metrics}
    log.info("eval %s: %s", split.eval_date, overall)
    path = checkpoint(
        _Position(tc.epochs, 0),
        finished=True,
        extra={"eval_date": split.eval_date, "metrics": nan_to_none(metrics)},
        files={"loss_curve.png": _loss_curve_png(loss_curve)},
    )
    return TrainResult(
        examples_version=version,
        train_examples=len(train),
        eval_examples=len(evaluation),
        eval_date=split.eval_date,
        metrics=metrics,
        checkpoint_path=path,
        steps=step,
        loss_curve=loss_curve,
    )


def prior_rates(labels: np.ndarray) -> torch.Tensor:
    """(2,) float64 label rates (click, conversion) of ``labels`` (N, 2), clipped into [1e-4, 1 - 1e-4]
    so an all-0 or all-1 column gives a finite log-odds."""
    rates = labels.mean(axis=0) if len(labels) else np.full(2, 0.5)
    return torch.from_numpy(np.clip(rates.astype(np.float64), 1e-4, 1 - 1e-4))


def training_domains(train, resume_from) -> tuple[str, ...]:
    """Sorted domain names of the train split, or the resumed checkpoint's (its towers fix the ids)."""
    if resume_from is not None:
        saved = read_state(resume_from).extra.get("domains")
        if saved is not None:
            return tuple(saved)
    return tuple(sorted(set(train["domain"].to_pylist()) - {None}))

