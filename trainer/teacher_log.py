"""Logged teacher predictions: what the continuously trained model (the teacher) predicted for each example
before it trained on it, for the per-domain students of :mod:`trainer.distill`.

The continuous trainer (:mod:`trainer.continuous`) evaluates each new ``examples`` version before training on
it; with ``trainer.log_teacher_predictions`` on, the same predictions, and the teacher's vectors of each row,
go to the Delta table ``teacher_predictions``, one row per (example_id, run_id, teacher_step). The commit is
an app transaction ``(teacher:<run_id>, evaluation number)``, the number the trainer's ``training_metrics``
commit uses: an evaluation written before a crash that came before the checkpoint is recomputed by the restart
from the same parameters and its commit is skipped, so every row is there exactly once.

Vectors (list<float32>), read with forward hooks, so no model of trainer/models needs a method for it:

- ``user_vector`` (D,): the teacher's pooled ``user_id`` embedding (its TorchRec EmbeddingBagCollection);
- ``candidate_vector`` (D,): the teacher's pooled ``item_id`` embedding;
- ``representation`` (H,): the input of the teacher's per-domain towers (``dense_arch.towers``), its joint
  representation of user, context, history and candidate (H = trainer.hidden_dims[-1]); empty for a model
  without towers (lr, ranker).

Source: ExFM (arXiv 2502.17494, §3): the foundation model's predictions are logged once per example and
joined into each vertical model's training data.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import nn
from torchrec import EmbeddingBagCollection

from gemline.lake import Lake, open_table
from gemline.tables import Table, commit

log = logging.getLogger(__name__)

TEACHER_TABLE = Table.TEACHER_PREDICTIONS

TEACHER_PREDICTIONS_SCHEMA = pa.schema([
    pa.field("example_id", pa.string(), nullable=False),
    pa.field("run_id", pa.string(), nullable=False),  # the teacher's continuous run
    pa.field("teacher_step", pa.int64(), nullable=False),  # optimiser steps of the predicting parameters
    pa.field("teacher_checkpoint_ms", pa.int64(), nullable=False),  # wall time (ms since epoch UTC) its checkpoint was saved
    pa.field("teacher_data_ms", pa.int64(), nullable=False),  # newest event_time_ms (ms since epoch UTC) it had trained on
    pa.field("examples_version", pa.int64(), nullable=False),
    pa.field("domain", pa.string()),
    pa.field("p_click", pa.float64()),
    pa.field("p_conversion", pa.float64()),
    pa.field("user_vector", pa.list_(pa.float32())),
    pa.field("candidate_vector", pa.list_(pa.float32())),
    pa.field("representation", pa.list_(pa.float32())),
])
"""Arrow schema of the ``teacher_predictions`` Delta table (one row per example_id, run_id and teacher_step)."""

NO_DATA_MS = -1
"""``teacher_data_ms`` of a teacher that has trained on nothing."""


@dataclass
class VectorCapture:
    """Collects the teacher's vectors of every row it predicts while :meth:`recording`.

    Rows come in the order of the model's forward calls, which :func:`trainer.loop.predict` makes in row order.
    """

    user: list[np.ndarray] = field(default_factory=list)
    candidate: list[np.ndarray] = field(default_factory=list)
    representation: list[np.ndarray] = field(default_factory=list)

    @contextmanager
    def recording(self, model: nn.Module) -> Iterator[VectorCapture]:
        """Hook ``model``'s first EmbeddingBagCollection (the user_id and item_id rows) and its
        ``dense_arch.towers`` input for the duration of the block; removes the hooks after."""
        handles = []
        bags = next((m for m in model.modules() if isinstance(m, EmbeddingBagCollection)), None)
        if bags is not None:
            def on_bags(_module: nn.Module, _inputs: Any, output: Any) -> None:
                self.user.append(output["user_id"].detach().float().cpu().numpy())
                self.candidate.append(output["item_id"].detach().float().cpu().numpy())
            handles.append(bags.register_forward_hook(on_bags))
        towers = getattr(getattr(model, "dense_arch", None), "towers", None)
        if isinstance(towers, nn.Module):
            def on_towers(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
                self.representation.append(inputs[0].detach().float().cpu().numpy())
            # Run eagerly under trainer.compile: traced, the hook's copy to numpy broke the compiled graph's guards.
            handles.append(towers.register_forward_pre_hook(torch.compiler.disable(on_towers)))
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def vectors(self, rows: int) -> dict[str, list[np.ndarray | None]]:
        """``{"user_vector", "candidate_vector", "representation"}``: (rows,) lists of (D,) / (H,) float32 arrays
        (None where the model has no such vector).

        Raises:
            RuntimeError: a hooked module saw another number of rows than ``rows`` was predicted.
        """
        out: dict[str, list[np.ndarray | None]] = {}
        for name, parts in (("user_vector", self.user), ("candidate_vector", self.candidate),
                            ("representation", self.representation)):
            if not parts:
                out[name] = [None] * rows
                continue
            stacked = np.concatenate(parts).astype(np.float32)
            if len(stacked) != rows:
                raise RuntimeError(f"teacher vectors: {name} has {len(stacked)} rows, {rows} were predicted")
            out[name] = list(stacked)
        return out


def prediction_rows(*, example_ids: np.ndarray, domains: np.ndarray, probs: np.ndarray, run_id: str, step: int,
                    checkpoint_ms: int, data_ms: int, version: int,
                    vectors: dict[str, list[np.ndarray | None]]) -> pa.Table:
    """The ``teacher_predictions`` rows of one evaluation.

    Args:
        example_ids, domains: (N,) object; probs: (N, 2) float64 (click, conversion).
        checkpoint_ms, data_ms: ms since epoch UTC, see :data:`TEACHER_PREDICTIONS_SCHEMA`.
        vectors: :meth:`VectorCapture.vectors` of the N rows.
    """
    def column(values: list[np.ndarray | None]) -> pa.Array:
        present = [v for v in values if v is not None]
        if present and len(present) == len(values) and len({len(v) for v in present}) == 1:
            # every row a vector of one width: no Python list per row (those cost ~0.03 CPU-s per 1k rows and
            # vector, most of what logging a version's predictions cost)
            flat = np.concatenate(present).astype(np.float32, copy=False)
            offsets = np.arange(len(present) + 1, dtype=np.int32) * len(present[0])
            return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat), type=pa.list_(pa.float32()))
        return pa.array([None if v is None else v.tolist() for v in values], pa.list_(pa.float32()))

    n = len(example_ids)
    return pa.table({
        "example_id": pa.array([str(e) for e in example_ids], pa.string()),
        "run_id": pa.array([run_id] * n, pa.string()),
        "teacher_step": pa.array(np.full(n, step, dtype=np.int64)),
        "teacher_checkpoint_ms": pa.array(np.full(n, checkpoint_ms, dtype=np.int64)),
        "teacher_data_ms": pa.array(np.full(n, data_ms, dtype=np.int64)),
        "examples_version": pa.array(np.full(n, version, dtype=np.int64)),
        "domain": pa.array([None if d is None else str(d) for d in domains], pa.string()),
        "p_click": pa.array(np.asarray(probs[:, 0], dtype=np.float64)),
        "p_conversion": pa.array(np.asarray(probs[:, 1], dtype=np.float64)),
        "user_vector": column(vectors["user_vector"]),
        "candidate_vector": column(vectors["candidate_vector"]),
        "representation": column(vectors["representation"]),
    }, schema=TEACHER_PREDICTIONS_SCHEMA)


def append_predictions(lake: Lake, run_id: str, sequence: int, rows: pa.Table) -> bool:
    """Append one evaluation's rows once: app transaction (``teacher:<run_id>``, ``sequence``); False when that
    evaluation (or a later one) was already committed, before a crash."""
    return commit(lake.root, TEACHER_TABLE, rows, app_id=f"teacher:{run_id}", version=sequence,
                  version_rule="increasing", storage_options=lake.storage_options)


def read_predictions(lake: Lake, version: int) -> pa.Table:
    """Every logged prediction for rows of ``examples@version`` (any teacher run or step); an empty table of the
    schema when none (or no table)."""
    dt = open_table(lake, TEACHER_TABLE)
    if dt is None:
        return TEACHER_PREDICTIONS_SCHEMA.empty_table()
    dataset = dt.to_pyarrow_dataset()
    table = dataset.to_table(filter=pc.field("examples_version") == version)
    return table.select(TEACHER_PREDICTIONS_SCHEMA.names).cast(TEACHER_PREDICTIONS_SCHEMA)
