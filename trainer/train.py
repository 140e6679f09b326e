"""One-shot training: gate check, temporal split, train, evaluate on the last day, checkpoint.

Optimisers: Adagrad on the embedding tables (rows are touched sparsely, Adagrad's per-row step
size suits that; Duchi et al. 2011), Adam on the rest. :func:`train_holdout` is the run of one
process (:func:`run_training`) and of each rank of a sharded run (``gemline train --nproc N``,
trainer.launch); both go through the one loop of trainer.loop, the differences behind its Engine.

Restarts: with ``trainer.init_from = "latest"`` a run continues from the newest checkpoint. If
that checkpoint is an unfinished run on the same examples version and epoch count (written every
``trainer.checkpoint_every_steps``), it continues at the next batch and ends with the same
parameters as an uninterrupted run; otherwise it warm-starts and trains every epoch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from gemline.errors import GemlineError, MissingInputError
from gemline.gate import gate_decision, require_version
from gemline.lake import Lake, open_table
from gemline.plots import png_bytes, subplots
from gemline.tables import Table
from trainer.checkpoint import TrainState, latest_checkpoint, read_state
from trainer.config import TrainerConfig
from trainer.data import (
    DenseNormalizer,
    encode_for,
    fit_normalizer,
    latest_examples_version,
    load_split,
    num_batches,
    with_history_ids,
)
from trainer.id_mapping import MAPPING_FILE, start_mapping, stats_rows, with_rows
from trainer.labels import masked_rate
from trainer.loop import EngineFactory, GlobalBatch, Progress, local_engine, predict, train_loop, train_step
from trainer.metrics import evaluate, nan_to_none

__all__ = ["QuarantinedError", "TrainResult", "check_gate", "epoch_order", "predict", "prior_rates", "run_training",
           "train_holdout", "train_step", "training_domains"]
"""``predict`` and ``train_step`` live in trainer.loop; they are named here too, where callers have found them."""

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
        id_stats: per id namespace, the collision counts of the mapping trained with (trainer.id_mapping.stats_rows).
    """

    examples_version: int
    train_examples: int
    eval_examples: int
    eval_date: str
    metrics: dict
    checkpoint_path: str
    steps: int
    loss_curve: list[float]
    id_stats: list[dict] = field(default_factory=list)


def _loss_curve_png(loss_curve: list[float]) -> bytes:
    fig, ax = subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(loss_curve) + 1), loss_curve, linewidth=1)
    ax.set_xlabel("step of this run")
    ax.set_ylabel("BCE click + conversion")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    return png_bytes(fig, dpi=100)


def check_gate(lake: Lake | str, examples_version: int, *, storage_options: dict[str, str] | None = None) -> None:
    """Raise QuarantinedError unless the gate allows ``examples@examples_version`` (``lake``: a Lake,
    or a root with its ``storage_options``); MissingInputError when that version or the whole table does not exist."""
    decision = gate_decision(lake, Table.EXAMPLES, examples_version, storage_options=storage_options)
    if not decision.allowed:
        if not decision.validated:  # a version past the newest, or no table at all, is named as such
            if open_table(lake, Table.EXAMPLES, storage_options=storage_options) is None:
                raise MissingInputError(f"no examples table under {str(lake)!r}; run `gemline build` first")
            require_version(lake, Table.EXAMPLES, examples_version, storage_options=storage_options)
        log.error("refusing to train: %s", decision.reason)
        raise QuarantinedError(decision.reason)
    log.info("gate: %s", decision.reason)


def run_training(tc: TrainerConfig, lake: Lake, *, examples_version: int | None = None, progress: bool = True) -> TrainResult:
    """Train ``tc.model`` in this process on ``lake``'s ``examples@examples_version`` (latest when None) and
    evaluate it on its last day (:func:`train_holdout`).

    Raises:
        QuarantinedError: the quality gate does not allow that version.
        FileNotFoundError: no examples table.
        ValueError: fewer than 2 event dates, or a table that breaks the examples contract.
    """
    version = latest_examples_version(lake) if examples_version is None else examples_version
    check_gate(lake, version)
    previous_threads = torch.get_num_threads()
    if tc.torch_threads is not None:
        torch.set_num_threads(tc.torch_threads)
    try:
        result = train_holdout(tc, lake, version, local_engine, progress=progress)
        assert result is not None, "one process is rank 0"
        return result
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


def _resume_position(state: TrainState, version: int, epochs: int) -> _Position:
    """Continue an unfinished run of the same version and epoch count; otherwise start at epoch 0."""
    run = state.extra.get("run")
    if run and not run["finished"] and state.examples_version == version and run["epochs"] == epochs:
        return _Position(run["epoch"], run["batch"])
    return _Position(0, 0)


def train_holdout(tc: TrainerConfig, lake: Lake, version: int, make_engine: EngineFactory, *,
                  progress: bool = True) -> TrainResult | None:
    """Train ``make_engine``'s model on every day of ``examples@version`` but the last and evaluate it on the last.

    The one-shot run of one process (:func:`run_training`, :func:`trainer.loop.local_engine`) and of every
    rank of a sharded run (trainer.launch, :func:`trainer.sharded_engine.sharded_engine`): every rank walks
    the same global batches (:func:`epoch_order`) through :func:`trainer.loop.train_loop`. With
    ``trainer.init_from = "latest"`` it resumes from the newest checkpoint (an unfinished run of the same
    version and epoch count continues at its next batch). The gate must have allowed ``version``.

    Returns:
        The TrainResult on rank 0, None on the other ranks.

    Raises:
        ValueError: fewer than 2 event dates; a checkpoint trained on other dense features; one the engine
            cannot resume from (trainer.sharded_engine.check_resumable).
    """
    split = load_split(lake, version)
    resume_from = latest_checkpoint(lake) if tc.init_from == "latest" else None
    normalizer = fit_normalizer(split.train)
    resumed = read_state(resume_from) if resume_from is not None else None
    if resumed is not None:
        # Keep the statistics the resumed weights were trained with, so inputs mean the same thing.
        saved = DenseNormalizer.from_dict(resumed.extra["normalizer"])
        if saved.names != normalizer.names:
            raise ValueError(
                f"checkpoint {resume_from} was trained on dense features {saved.names}, this table has "
                f"{normalizer.names}; use trainer.init_from=scratch"
            )
        normalizer = saved
    # A managed mapping admits, and cardinality widths count, history ids too: pointer rows get their lists back.
    counted = with_history_ids(split.train, split.pointers) if tc.ids.sized_by_counts else split.train
    ids = start_mapping(tc, counted, resume_from)
    if resumed is None or _resume_position(resumed, version, tc.epochs) == _Position(0, 0):
        ids.observe(counted)  # not when continuing an unfinished run: its mapping counted this split already
    tc = with_rows(tc, ids)
    for row in stats_rows(ids):
        log.info("ids %(namespace)s (%(mode)s): %(distinct_ids)d distinct, %(rows)d rows, collision share "
                 "%(collision_share).4f, OOV share %(oov_share).4f", row)
    train = encode_for(split.train, tc, normalizer, split.pointers, ids=ids)
    evaluation = encode_for(split.eval, tc, normalizer, split.pointers, ids=ids)
    domains = training_domains(split.train, resume_from)
    torch.manual_seed(tc.seed)
    engine = make_engine(tc, len(normalizer.names), domains, prior_rates(train.labels, train.final) if resumed is None else None)
    counters, start = Progress(), _Position(0, 0)
    if resume_from is not None and resumed is not None:
        engine.load(resume_from, resumed)
        counters.step, counters.examples_seen = resumed.step, resumed.examples_seen
        start = _resume_position(resumed, version, tc.epochs)
        log.info("resumed from %s at step %d (epoch %d, batch %d)", resume_from, counters.step, start.epoch, start.batch)
    log.info(
        "examples@%d: train %d rows on %s, eval %d rows on %s (%d process(es))",
        version, len(train), ",".join(split.train_dates), len(evaluation), split.eval_date, engine.world_size,
    )

    def checkpoint(position: _Position, finished: bool = False, extra: dict | None = None, files: dict | None = None) -> str | None:
        run = {"epoch": position.epoch, "batch": position.batch, "epochs": tc.epochs, "finished": finished}
        state = TrainState(
            step=counters.step, examples_seen=counters.examples_seen, examples_version=version,
            extra={"normalizer": normalizer.to_dict(), "domains": list(domains), "model": tc.model, "run": run, **(extra or {})},
        )
        return engine.save(lake.root, state, files={MAPPING_FILE: ids.to_bytes(), **(files or {})},
                           storage_options=lake.storage_options)

    def batches() -> Iterator[GlobalBatch]:
        for epoch in range(start.epoch, tc.epochs):
            order = epoch_order(len(train), tc.seed, version, epoch)
            for index in range(start.batch if epoch == start.epoch else 0, per_epoch):
                yield GlobalBatch(train, order[index * tc.batch_size : (index + 1) * tc.batch_size], _Position(epoch, index + 1))

    per_epoch = num_batches(train, tc.batch_size)
    shown = progress and engine.rank == 0
    desc = "train" if engine.world_size == 1 else f"train x{engine.world_size}"
    with tqdm(total=tc.epochs * per_epoch, initial=start.epoch * per_epoch + start.batch, desc=desc, unit="step", disable=not shown) as bar:
        train_loop(engine, counters, batches(), checkpoint_every_steps=tc.checkpoint_every_steps, checkpoint=checkpoint, bar=bar)

    probs = engine.predict(evaluation, tc.batch_size)
    # The held-out day is the newest data, so its attribution windows are still open by construction: masking
    # open labels (trainer.labels) would leave nothing to judge. It is judged on every label as logged at the
    # end of the data (what a held-out day measures); the final-label mask applies to the training days.
    if evaluation.final is not None and not evaluation.final.all():
        log.info("held-out day %s: %d of %d labels are within their attribution window at the end of the data; "
                 "judged as logged", split.eval_date, int((~evaluation.final).sum()), evaluation.final.size)
    metrics = evaluate(evaluation.labels, probs, evaluation.domains, None) if probs is not None else {}  # rank 0
    if probs is not None:
        log.info("eval %s: %s", split.eval_date, {task: metrics[task]["overall"] for task in metrics})
    path = checkpoint(
        _Position(tc.epochs, 0), finished=True, extra={"eval_date": split.eval_date, "metrics": nan_to_none(metrics)},
        files={"loss_curve.png": _loss_curve_png(counters.losses)} if engine.rank == 0 else None,
    )
    if engine.rank != 0:
        return None
    return TrainResult(
        examples_version=version, train_examples=len(train), eval_examples=len(evaluation), eval_date=split.eval_date,
        metrics=metrics, checkpoint_path=str(path), steps=counters.step, loss_curve=counters.losses,
        id_stats=stats_rows(ids),
    )


def prior_rates(labels: np.ndarray, final: np.ndarray | None = None) -> torch.Tensor:
    """(2,) float64 label rates (click, conversion) of ``labels`` (N, 2) over the ``final`` (N, 2) bool ones
    (None: all), clipped into [1e-4, 1 - 1e-4] so an all-0 or all-1 column gives a finite log-odds; 0.5 for a
    task without labels."""
    rates = np.nan_to_num(masked_rate(labels, final), nan=0.5) if len(labels) else np.full(2, 0.5)
    return torch.from_numpy(np.clip(rates.astype(np.float64), 1e-4, 1 - 1e-4))


def training_domains(train, resume_from) -> tuple[str, ...]:
    """Sorted domain names of the train split, or the resumed checkpoint's (its towers fix the ids)."""
    if resume_from is not None:
        saved = read_state(resume_from).extra.get("domains")
        if saved is not None:
            return tuple(saved)
    return tuple(sorted(set(train["domain"].to_pylist()) - {None}))

