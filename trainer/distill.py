"""Continuous distillation: per-domain students (:mod:`trainer.students`) learn each new ``examples`` version
from its labels and from the teacher's logged predictions (:mod:`trainer.teacher_log`), point in time.

``run_distill_once`` (``gemline distill --once``) resumes from its newest checkpoint
``LAKE/_distill/_checkpoints/step-<cursor>`` and, for each examples version after its cursor that the teacher
has passed (below the cursor of its newest checkpoint: trained, skipped, or without rows), in order:

1. joins the version's rows with the predictions the teacher's current run logged (:func:`join_teacher`; an
   older run's predictions came from another model): a prediction is used only if its examples version is allowed by the gate now (never one of a quarantined version), both
   probabilities are finite and in [0, 1], and the teacher had trained only on events before the example's
   (``teacher_data_ms < event_time_ms``: a newer teacher would leak the future); an example without a usable
   prediction is trained on its labels alone. Every case is counted;
2. **progressive evaluation**: each existing student predicts its domain's rows before training on them
   (NE, AUC, calibration per task, on all rows and on the rows with a teacher prediction, where the teacher
   is scored too);
3. the representation students adopt the teacher's logged user and item rows they have not set yet;
4. **training**, one pass in a seeded order: per batch the Student Adapter steps first, then the student;
5. a **checkpoint** holding every student, adapter and optimiser (the tables and their moments at the rows
   met only: :func:`save_students`), the cursor (the next version), the input normalizer and the history of
   metrics, so a crash anywhere resumes at the last finished version: each example reaches each student's final
   parameters exactly once. A ``--follow`` process keeps the students it saved last (:class:`Memory`). A quarantined version is skipped, and distilled
   (not evaluated) once released and consumed by the teacher.

The report (:func:`write_report`) pools the history per domain and variant: NE, AUC, calibration, the
transfer ratio (LoopFM, arXiv 2605.29280: the student's NE gain over student-alone divided by the teacher's NE
gain over the same baseline, on the rows with a teacher prediction) and the teacher's staleness against the
adapter's gain, to ``LAKE/_runs/<run_id>/distill.json`` and ``distill.html``.
"""

from __future__ import annotations

import base64
import html
import io
import json
import logging
import math
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import nn

from gemline.errors import BadConfigError, InputSchemaError, MissingInputError
from gemline.gate import gate_decisions
from gemline.increments import Cursor, LogTip, latest_version, read_from, table_id
from gemline.lake import Lake, is_remote, lake_fs
from gemline.locks import holding
from gemline.plots import png_bytes, subplots
from gemline.polling import REPORT_CPU_SHARE, ReportThrottle, poll
from gemline.tables import Table
from sequences.schema import SPARSE_FEATURES
from trainer import continuous
from trainer.checkpoint import (
    CHECKPOINTS_DIR,
    TrainState,
    latest_checkpoint,
    load_checkpoint,
    read_state,
    safe_load,
    save_checkpoint,
)
from trainer.config import TrainerConfig
from trainer.data import DenseNormalizer, EncodedExamples, PointerReader, encode_for, fit_normalizer, make_batch
from trainer.delayed import is_correction, to_torch
from trainer.loop import domain_ids
from trainer.metrics import TASKS, auc
from trainer.models import build_model
from trainer.students import (
    SERVED,
    DistillConfig,
    Student,
    StudentAdapter,
    TeacherInputs,
    VariantName,
    adapter_step,
    predict,
    student_loss,
    student_optimizers,
)
from trainer.teacher_log import read_predictions
from trainer.train import prior_rates

log = logging.getLogger(__name__)

EXAMPLES = Table.EXAMPLES
DISTILL_DIR = "_distill"
TEACHER = "teacher"
"""The ``variant`` of the teacher's own rows in the history and the report."""
_EPS = 1e-7


def distill_root(lake: Lake) -> str:
    """``LAKE/_distill``: the students' checkpoint root."""
    return f"{lake.root.rstrip('/')}/{DISTILL_DIR}"


@dataclass(frozen=True)
class Joined:
    """The teacher's usable prediction for each of N examples (:func:`join_teacher`).

    Attributes:
        inputs: :class:`trainer.students.TeacherInputs` of the N rows.
        data_ms: (N,) int64 newest event the predicting teacher had trained on (ms since epoch UTC); -1 where none.
        counts: ``{"with_teacher", "label_only"}`` examples, and the prediction rows dropped:
            ``{"dropped_quarantined", "dropped_nonfinite", "dropped_future"}``.
    """

    inputs: TeacherInputs
    data_ms: np.ndarray
    counts: dict[str, int]


def _vectors(column: pa.ChunkedArray | pa.Array, rows: int, width: int, name: str) -> np.ndarray:
    """(rows, width) float32 of a list<float32> column; zeros for nulls.

    Raises:
        InputSchemaError: a vector of another width.
    """
    out = np.zeros((rows, width), dtype=np.float32)
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    valid = array.is_valid().to_numpy(zero_copy_only=False)
    if not valid.any():
        return out
    # Arrow's offsets, not a Python list per row (to_pylist was 6.6 % of a distill process's CPU, 2026-12-03).
    vectors = array.filter(pa.array(valid))
    lengths = pc.list_value_length(vectors).to_numpy(zero_copy_only=False)
    if (lengths != width).any():
        raise InputSchemaError(f"teacher_predictions.{name} has vectors of width {lengths[lengths != width][0]}, the "
                               f"students expect {width} (trainer.embedding_dim / trainer.hidden_dims of the teacher)")
    out[valid] = pc.list_flatten(vectors).to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, width)
    return out


def join_teacher(examples: pa.Table, predictions: pa.Table, allowed: Callable[[int], bool], *, dim: int,
                 hidden: int) -> Joined:
    """Each example's usable teacher prediction (module docstring, step 1); among several, the one of the newest
    teacher (highest ``teacher_data_ms``, then ``teacher_step``).

    Args:
        examples: N rows with ``example_id`` and ``event_time_ms`` (ms since epoch UTC).
        predictions: ``teacher_predictions`` rows (trainer.teacher_log schema); rows of other examples are ignored.
        allowed: whether the gate allows an examples version now.
        dim, hidden: widths D of the user / candidate vectors and H of the representation.

    Raises:
        InputSchemaError: a logged vector of another width.
    """
    n = examples.num_rows
    index = {e: i for i, e in enumerate(examples["example_id"].to_pylist())}
    event_ms = examples["event_time_ms"].to_numpy(zero_copy_only=False).astype(np.int64)
    rows = np.asarray([index.get(e, -1) for e in predictions["example_id"].to_pylist()], dtype=np.int64)
    mine = rows >= 0
    predictions, rows = predictions.filter(pa.array(mine)), rows[mine]
    versions = predictions["examples_version"].to_numpy(zero_copy_only=False)
    data_ms = predictions["teacher_data_ms"].to_numpy(zero_copy_only=False).astype(np.int64)
    steps = predictions["teacher_step"].to_numpy(zero_copy_only=False).astype(np.int64)
    probs = np.stack([predictions[c].to_numpy(zero_copy_only=False).astype(np.float64)
                      for c in ("p_click", "p_conversion")], axis=1) if len(rows) else np.zeros((0, 2))
    quarantined = ~np.asarray([allowed(int(v)) for v in versions], dtype=bool)
    nonfinite = ~quarantined & ~np.all(np.isfinite(probs) & (probs >= 0) & (probs <= 1), axis=1)
    future = ~quarantined & ~nonfinite & (data_ms >= event_ms[rows])
    usable = ~(quarantined | nonfinite | future)

    chosen = np.full(n, -1, dtype=np.int64)  # prediction row of each example
    for j in np.lexsort((steps, data_ms, rows))[::-1]:  # newest teacher first within each example
        if usable[j] and chosen[rows[j]] < 0:
            chosen[rows[j]] = j
    has = chosen >= 0
    picked = predictions.take(pa.array(chosen[has]))
    teacher_probs = np.zeros((n, 2), dtype=np.float32)
    teacher_probs[has] = probs[chosen[has]]
    vectors = np.zeros((n, 2 * dim + hidden), dtype=np.float32)
    vectors[has] = np.concatenate([_vectors(picked["user_vector"], int(has.sum()), dim, "user_vector"),
                                   _vectors(picked["candidate_vector"], int(has.sum()), dim, "candidate_vector"),
                                   _vectors(picked["representation"], int(has.sum()), hidden, "representation")],
                                  axis=1)
    teacher_ms = np.full(n, -1, dtype=np.int64)
    teacher_ms[has] = data_ms[chosen[has]]
    counts = {"with_teacher": int(has.sum()), "label_only": int(n - has.sum()),
              "dropped_quarantined": int(quarantined.sum()), "dropped_nonfinite": int(nonfinite.sum()),
              "dropped_future": int(future.sum())}
    inputs = TeacherInputs(torch.from_numpy(teacher_probs), torch.from_numpy(has), torch.from_numpy(vectors))
    return Joined(inputs, teacher_ms, counts)


def _take(inputs: TeacherInputs, rows: np.ndarray) -> TeacherInputs:
    index = torch.from_numpy(rows)
    return TeacherInputs(inputs.probs[index], inputs.has[index], inputs.vectors[index])


def _scores(labels: np.ndarray, probs: np.ndarray) -> dict[str, Any]:
    """Poolable sums of one task on (N,) arrays: rows, positives, log-loss sum, prediction sum, and the AUC."""
    p = np.clip(probs, _EPS, 1 - _EPS)
    logloss = -(labels * np.log(p) + (1 - labels) * np.log(1 - p))
    return {"rows": int(labels.size), "positives": float(labels.sum()), "logloss_sum": float(logloss.sum()),
            "pred_sum": float(probs.sum()), "auc": None if labels.size == 0 else _none(auc(labels, probs))}


def _none(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def pooled(scores: list[dict[str, Any]]) -> dict[str, Any]:
    """NE and calibration of the rows behind several :func:`_scores` (NE: mean log loss over the entropy of the
    pooled base rate, He et al. 2014; calibration: predictions / positives); AUC: row-weighted mean of the parts'."""
    rows = sum(s["rows"] for s in scores)
    positives = sum(s["positives"] for s in scores)
    if rows == 0:
        return {"rows": 0, "ne": None, "auc": None, "calibration": None}
    rate = positives / rows
    entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate)) if 0 < rate < 1 else 0.0
    ne = sum(s["logloss_sum"] for s in scores) / rows / entropy if entropy > 0 else None
    aucs = [(s["auc"], s["rows"]) for s in scores if s["auc"] is not None]
    return {"rows": rows, "ne": ne, "calibration": sum(s["pred_sum"] for s in scores) / positives if positives else None,
            "auc": sum(a * r for a, r in aucs) / sum(r for _, r in aucs) if aucs else None}


@dataclass
class DistillResult:
    """What one :func:`run_distill_once` call did."""

    run_id: str
    cursor: int
    """The next examples version to distill."""
    versions: list[dict[str, Any]] = field(default_factory=list)
    """Per version this call passed: ``{"version", "quality", "rows", "counts", "inference", "distilled_ms"}``
    (``distilled_ms``: when it was done, ms since epoch UTC; kept in the checkpoint for :mod:`gemline.waits`)."""
    waiting_for: int | None = None
    """The first version the teacher has not consumed yet (None: caught up with the examples table)."""
    report: dict[str, Any] | None = None
    report_path: str | None = None
    """``LAKE/_runs/<run_id>/distill.html``; None while the run has distilled nothing (no report is written)."""
    report_cpu_s: float = 0.0
    """CPU-seconds the report took to draw (0 when this call drew none)."""


class _Students:
    """Every domain's students, adapters and optimisers, as one module and one optimiser dict (checkpoints).

    ``touched[domain]``: (S, distill.num_embeddings) bool, the table rows any student of the domain may have
    changed since its init (every id it trained on; the rows it adopted are among them). Every other row still
    holds its seeded init and no optimiser state, so a checkpoint saves only the touched rows (:func:`save_students`).
    """

    def __init__(self, dc: DistillConfig, tc: TrainerConfig, num_dense: int) -> None:
        self.dc, self.tc, self.num_dense = dc, tc, num_dense
        self.domains: list[str] = []
        self.modules = nn.ModuleDict()
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.touched: dict[str, torch.Tensor] = {}

    @property
    def teacher_dims(self) -> tuple[int, int]:
        """(D, H) of the teacher's vectors: trainer.embedding_dim and trainer.hidden_dims[-1]."""
        return self.tc.embedding_dim, self.tc.hidden_dims[-1]

    def add(self, domain: str, base_rates: torch.Tensor | None = None) -> None:
        """Fresh students (and adapters) of ``domain``, seeded by (distill.seed, domain number); their output
        intercepts at ``base_rates`` (2,) (:meth:`Student.init_output_bias`; None: left at 0, as before a
        checkpoint is loaded)."""
        d = len(self.domains)
        self.domains.append(domain)
        self.touched[domain] = torch.zeros(len(SPARSE_FEATURES), self.dc.num_embeddings, dtype=torch.bool)
        torch.manual_seed(self.dc.seed * 1009 + d)
        dim, hidden = self.teacher_dims
        for variant in self.dc.variants:
            student = Student(variant=variant, num_embeddings=self.dc.num_embeddings, dim=dim, num_dense=self.num_dense,
                              teacher_width=2 * dim + hidden, hidden_dims=self.dc.hidden_dims)
            if base_rates is not None:
                student.init_output_bias(base_rates)
            self.modules[f"d{d}_{variant}"] = student
            self.optimizers[f"d{d}_{variant}"], self.optimizers[f"d{d}_{variant}_tables"] = student_optimizers(
                student, self.dc.learning_rate)
            if variant in ("adapter", "representation"):
                adapter = StudentAdapter(self.dc.adapter_hidden)
                self.modules[f"d{d}_{variant}_adapter"] = adapter
                self.optimizers[f"d{d}_{variant}_adapter"] = torch.optim.Adam(adapter.parameters(),
                                                                              lr=self.dc.adapter_learning_rate)

    def student(self, domain: str, variant: str) -> Student:
        """The student of (domain, variant)."""
        module = self.modules[f"d{self.domains.index(domain)}_{variant}"]
        assert isinstance(module, Student)
        return module

    def adapter(self, domain: str, variant: str) -> tuple[StudentAdapter, torch.optim.Optimizer] | None:
        """The Student Adapter of (domain, variant) and its optimiser; None for the variants without one."""
        key = f"d{self.domains.index(domain)}_{variant}_adapter"
        if key not in self.modules:
            return None
        module = self.modules[key]
        assert isinstance(module, StudentAdapter)
        return module, self.optimizers[key]


STUDENTS_FILE = "students.pt"
"""The students' file of a compact checkpoint (``extra["format"] == CHECKPOINT_FORMAT``), beside state.pt."""
CHECKPOINT_FORMAT = 2
"""Compact: the students' tables and SparseAdam moments hold their touched rows only. Format 1 (no ``format`` in
``extra``, before 2026-12-02) held every row: 326 MB for 3 domains x 4 variants, 9 tables of 16,384 x 16 floats,
each with two SparseAdam moments of the same size, rows never met included."""


def _table_slots(students: _Students) -> list[tuple[str, str, int, str]]:
    """(domain, student key, table number j, state-dict name of its weight) of every student table."""
    return [(domain, f"d{d}_{variant}", j, f"d{d}_{variant}.tables.{j}.weight")
            for d, domain in enumerate(students.domains) for variant in students.dc.variants
            for j in range(len(SPARSE_FEATURES))]


def save_students(students: _Students) -> bytes:
    """The students, adapters and optimisers as a compact payload (torch.save bytes): every tensor as the state
    dicts hold it, except each table weight and its SparseAdam ``exp_avg`` / ``exp_avg_sq`` (num_embeddings, D),
    of which only the rows ``students.touched`` marks are kept, with their row numbers."""
    model = students.modules.state_dict()
    optimizers = {key: opt.state_dict() for key, opt in students.optimizers.items()}
    rows = {domain: [torch.nonzero(mask).flatten() for mask in students.touched[domain]] for domain in students.domains}
    for domain, key, j, name in _table_slots(students):
        index = rows[domain][j]
        model[name] = model[name][index]
        states = optimizers[f"{key}_tables"]["state"]
        if j in states:  # a copy: the state dict's entries are the optimiser's own dicts
            states[j] = {**states[j], "exp_avg": states[j]["exp_avg"][index],
                         "exp_avg_sq": states[j]["exp_avg_sq"][index]}
    buffer = io.BytesIO()
    torch.save({"model": model, "optimizers": optimizers, "rows": rows}, buffer)
    return buffer.getvalue()


def load_students(students: _Students, payload: bytes, *, name: str = STUDENTS_FILE) -> None:
    """Restore :func:`save_students`'s payload into ``students``, built by :meth:`_Students.add` for the same
    domains in the same order (their seeded init supplies every row the payload lacks, with zero moments).

    Raises:
        gemline.errors.CheckpointError: the payload does not load safely (:func:`trainer.checkpoint.safe_load`).
        RuntimeError: the payload does not fit the students (torch's message).
    """
    saved = safe_load(payload, name=name)
    model = students.modules.state_dict()
    rows: dict[str, list[torch.Tensor]] = saved["rows"]
    for domain, key, j, name in _table_slots(students):
        index = rows[domain][j]
        full = model[name].clone()
        full[index] = saved["model"][name]
        saved["model"][name] = full
        states = saved["optimizers"][f"{key}_tables"]["state"]
        if j in states:
            for moment in ("exp_avg", "exp_avg_sq"):
                dense = torch.zeros_like(full)
                dense[index] = states[j][moment]
                states[j][moment] = dense
        students.touched[domain][j, index] = True
    students.modules.load_state_dict(saved["model"])
    for key, opt in students.optimizers.items():
        opt.load_state_dict(saved["optimizers"][key])


def _mark_changed_rows(students: _Students, init: dict[str, torch.Tensor]) -> None:
    """After loading a format-1 checkpoint into students whose table weights were ``init``: mark touched every
    row that differs from its init or has SparseAdam moments (every other row is restored by init alone)."""
    for domain, key, j, name in _table_slots(students):
        weight = students.modules.state_dict()[name]
        changed = (weight != init[name]).any(dim=1)
        module = students.modules[key]
        assert isinstance(module, Student)
        state = students.optimizers[f"{key}_tables"].state.get(module.table(j).weight)
        if state:
            changed |= (state["exp_avg"] != 0).any(dim=1) | (state["exp_avg_sq"] != 0).any(dim=1)
        students.touched[domain][j] |= changed


def _teacher_position(lake: Lake) -> tuple[str | None, int, set[int]]:
    """(run id, cursor version, versions skipped as quarantined and not consumed since) of the teacher's newest
    continuous checkpoint: it has passed every examples version below the cursor (trained, skipped, or without
    rows); (None, 0, set()) before its first checkpoint."""
    root = continuous.current_root(lake.root, lake.storage_options)
    path = latest_checkpoint(root, storage_options=lake.storage_options)
    if path is None:
        return None, 0, set()
    cont = read_state(path).extra["continuous"]
    return str(cont["run_id"]), int(cont["cursor"]["version"]), {int(v) for v in cont["skipped"]}


def _read_version(lake: Lake, tid: str, version: int) -> pa.Table:
    """Every row ``version`` added (in log order)."""
    batches = [b for _, b, _ in read_from(lake.root, EXAMPLES, Cursor(tid, version), until_version=version,
                                          storage_options=lake.storage_options) if b is not None]
    return pa.Table.from_batches(batches) if batches else pa.table({})


def _prune(root: str, keep: int = 2) -> None:
    if is_remote(root):
        return
    folder = Path(root) / CHECKPOINTS_DIR
    steps = sorted((int(p.name.split("-")[1]), p) for p in folder.glob("step-*") if (p / "meta.json").is_file())
    for _, path in steps[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def _distill_version(students: _Students, version: int, table: pa.Table, data: EncodedExamples, joined: Joined,
                     history: list[dict[str, Any]], *, evaluate: bool = True) -> None:
    """Steps 2-4 of the module docstring for one version's rows (``data``: ``table`` encoded); without
    ``evaluate`` (a released version, older than what the students trained on) step 2 is left out."""
    dc = students.dc
    ids = torch.from_numpy(data.sparse_ids % dc.num_embeddings)
    dense, labels = torch.from_numpy(data.dense), torch.from_numpy(data.labels)
    first = ~is_correction(table)
    event_ms = table["event_time_ms"].to_numpy(zero_copy_only=False).astype(np.int64)
    dim, _ = students.teacher_dims
    for domain in sorted(set(data.domains.tolist()) - {None}):
        new = domain not in students.domains
        rows = np.flatnonzero(data.domains == domain)
        if new:  # intercepts at the domain's first (final) label rates, as the teacher's
            students.add(domain, prior_rates(data.labels[rows], None if data.final is None else data.final[rows]))
        touched = students.touched[domain]
        for j in range(len(SPARSE_FEATURES)):  # the only rows the steps and the adoption below can change
            touched[j, ids[rows, j]] = True
        teacher = _take(joined.inputs, rows)
        evaluated = rows[first[rows]]
        eval_teacher = _take(joined.inputs, evaluated)
        sub = eval_teacher.has.numpy()
        eval_labels = data.labels[evaluated].astype(np.float64)
        # Judged on final labels only, as the teacher's progressive evaluation (trainer.labels).
        judged = np.ones(eval_labels.shape, dtype=bool) if data.final is None else data.final[evaluated]
        if evaluate and not new and len(evaluated):
            base = {"examples_version": version, "domain": domain}
            probs = eval_teacher.probs.numpy().astype(np.float64)
            lag = event_ms[evaluated][sub] - joined.data_ms[evaluated][sub]
            for j, task in enumerate(TASKS):
                mine = sub & judged[:, j]
                history.append({**base, "variant": TEACHER, "task": task, "all": None,
                                "teacher_rows": _scores(eval_labels[mine, j], probs[mine, j]),
                                "staleness_ms_p50": float(np.median(lag)) if lag.size else None})
        for variant in dc.variants:
            student = students.student(domain, variant)
            if variant == "representation":
                vectors = teacher.vectors
                student.adopt_rows(ids[rows], vectors[:, :dim], vectors[:, dim: 2 * dim], teacher.has)
            if evaluate and not new and len(evaluated):
                probs = predict(student, ids[evaluated], dense[evaluated], eval_teacher, dc.batch_size)
                for j, task in enumerate(TASKS):
                    final, mine = judged[:, j], sub & judged[:, j]
                    history.append({"examples_version": version, "domain": domain, "variant": variant, "task": task,
                                    "all": _scores(eval_labels[final, j], probs[final, j]),
                                    "teacher_rows": _scores(eval_labels[mine, j], probs[mine, j])})
            _train(students, domain, variant, version, rows, ids, dense, labels, teacher, data)


def _train(students: _Students, domain: str, variant: VariantName, version: int, rows: np.ndarray, ids: torch.Tensor,
           dense: torch.Tensor, labels: torch.Tensor, teacher: TeacherInputs, data: EncodedExamples) -> None:
    """One pass of one student over its domain's rows of a version, in an order seeded by (seed, version, domain)."""
    dc = students.dc
    key = f"d{students.domains.index(domain)}_{variant}"
    student, optimizers = students.student(domain, variant), (students.optimizers[key],
                                                              students.optimizers[f"{key}_tables"])
    adapter = students.adapter(domain, variant)
    order = np.random.default_rng([dc.seed, version, students.domains.index(domain)]).permutation(len(rows))
    for i in range(0, len(order), dc.batch_size):
        local = order[i: i + dc.batch_size]
        batch = rows[local]
        part = _take(teacher, local)
        final = None if data.final is None else torch.from_numpy(data.final[batch])
        if adapter is not None:  # the adapter first, on the freshest labels, then the student (ExFM Algorithm 1)
            adapter_step(adapter[0], adapter[1], part, labels[batch], final)
        delayed = None if data.delayed is None else to_torch(data.delayed.take(batch))
        loss = student_loss(student, ids[batch], dense[batch], labels[batch], part, dc,
                            adapter=None if adapter is None else adapter[0], delayed=delayed, final=final)
        for optimizer in optimizers:
            optimizer.zero_grad()
        if not torch.isfinite(loss):
            log.warning("distill: a non-finite loss of %s/%s at examples@%d: step skipped", domain, variant, version)
            continue
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()


@holding("distill")
def run_distill_once(lake: Lake, tc: TrainerConfig, dc: DistillConfig, *, from_scratch: bool = False,
                     max_versions: int | None = None, pointers: PointerReader | None = None,
                     memory: Memory | None = None, report: bool = True) -> DistillResult:
    """Distill every examples version the teacher has consumed since the students' cursor (module docstring).

    Holds ``LAKE/_locks/distill.lock``. ``tc``: the teacher's section (its vectors' widths and hashed id space).
    ``pointers``: the pointer-layout history reader kept across calls (:func:`follow`); None: a new one.
    ``memory``: the students kept across calls (:func:`follow`): the last ones saved are not loaded again.
    ``report``: rewrite the report page after distilling (False: ``report_path`` stays None; the next page drawn
    covers every version, being drawn from the checkpoint's history).

    Returns:
        A :class:`DistillResult`; its report covers the whole history of the students.

    Raises:
        gemline.errors.MissingInputError: no examples table.
        gemline.errors.BadConfigError: the checkpoint was written with other ``distill.variants``.
        gemline.errors.InputSchemaError: logged teacher vectors of other widths than ``tc`` gives.
    """
    previous_threads = torch.get_num_threads()
    if tc.torch_threads is not None:  # as trainer.train: tiny ops run several times slower with more threads
        torch.set_num_threads(tc.torch_threads)
    try:
        return _run_distill(lake, tc, dc, from_scratch=from_scratch, max_versions=max_versions,
                            pointers=PointerReader(lake) if pointers is None else pointers, memory=memory,
                            report=report)
    finally:
        torch.set_num_threads(previous_threads)


def _load(path: str | Path, extra: dict[str, Any], dc: DistillConfig, tc: TrainerConfig, num_dense: int) -> _Students:
    """The students of the checkpoint at ``path`` (``extra``: its meta), either format."""
    students = _Students(dc, tc, num_dense)
    for domain in extra["domains"]:
        students.add(domain)
    if extra.get("format") == CHECKPOINT_FORMAT:
        load_students(students, (Path(path) / STUDENTS_FILE).read_bytes(), name=str(Path(path) / STUDENTS_FILE))
        return students
    init = {name: tensor.clone() for name, tensor in students.modules.state_dict().items() if ".tables." in name}
    load_checkpoint(path, students.modules, students.optimizers)
    _mark_changed_rows(students, init)
    return students


class Memory:
    """The students a ``distill --follow`` process saved last, kept across its polls (:func:`follow`): a poll
    whose newest checkpoint is that one (same root, run and step) uses them instead of loading it; any other
    checkpoint (another process's, a new run) is loaded."""

    def __init__(self) -> None:
        self._saved: tuple[str, str, int] | None = None
        self._students: _Students | None = None

    def holds(self, root: str, run_id: str, step: int) -> bool:
        """Whether the kept students are those of checkpoint ``step`` of ``run_id`` under ``root``."""
        return self._students is not None and self._saved == (root, run_id, step)

    @property
    def students(self) -> _Students:
        """The kept students (after :meth:`holds` said True)."""
        assert self._students is not None
        return self._students

    def keep(self, root: str, run_id: str, step: int, students: _Students) -> None:
        """Remember ``students`` as checkpoint ``step`` of ``run_id`` under ``root`` (just written)."""
        self._saved, self._students = (root, run_id, step), students

    def forget(self) -> None:
        """Keep nothing (the next poll loads its checkpoint)."""
        self._saved, self._students = None, None


def _run_distill(lake: Lake, tc: TrainerConfig, dc: DistillConfig, *, from_scratch: bool,
                 max_versions: int | None, pointers: PointerReader, memory: Memory | None = None,
                 report: bool = True) -> DistillResult:
    """:func:`run_distill_once` without the lock and the thread setting."""
    tid = table_id(lake.root, EXAMPLES, storage_options=lake.storage_options)
    if tid is None:
        raise MissingInputError(f"no examples table in {lake.root}: run `gemline build` first")
    root = distill_root(lake)
    resume = None if from_scratch else latest_checkpoint(root, storage_options=lake.storage_options)
    students: _Students | None = None
    normalizer: DenseNormalizer | None = None
    history: list[dict[str, Any]] = []
    passed: list[dict[str, Any]] = []
    skipped: list[int] = []
    saves = 0
    if resume is not None:
        state = read_state(resume)
        extra = state.extra
        if tuple(extra["variants"]) != dc.variants:
            raise BadConfigError(f"the students in {root} are {extra['variants']}, not distill.variants={list(dc.variants)} "
                                 f"(the default since 2026-12-04 is {list(SERVED)}): resume them with --set "
                                 f"distill.variants={','.join(extra['variants'])}, or start again with --from-scratch")
        run_id, cursor, history, passed = extra["run_id"], int(extra["cursor"]), extra["history"], extra["versions"]
        skipped, saves = [int(v) for v in extra["skipped"]], state.step
    else:
        run_id, cursor = f"distill-{uuid.uuid4().hex[:12]}", 0
    result = DistillResult(run_id, cursor)

    teacher_run, teacher_cursor, teacher_skipped = _teacher_position(lake)
    newest = latest_version(lake.root, EXAMPLES, storage_options=lake.storage_options)
    assert newest is not None
    decisions = gate_decisions(lake.root, EXAMPLES, range(newest + 1), storage_options=lake.storage_options)

    def allowed(version: int) -> bool:
        return version in decisions and decisions[version].allowed

    # A released version, once the teacher has consumed it, first (as the teacher does).
    released = [v for v in skipped if allowed(v) and v < teacher_cursor and v not in teacher_skipped]
    # The students are loaded only when there is a version to distill: a --follow poll that finds none (most of
    # them) cost 0.44 CPU-s loading every student and optimiser it did not use.
    trained = resume is not None and extra["normalizer"] is not None
    if trained and resume is not None and (released or cursor < min(teacher_cursor, newest + 1)):
        normalizer = DenseNormalizer.from_dict(extra["normalizer"])
        if memory is not None and memory.holds(root, run_id, saves):
            students = memory.students  # what this process saved last: loading it would give the same tensors
        else:
            students = _load(resume, extra, dc, tc, len(normalizer.names))
        if memory is not None:
            memory.forget()  # until this call's next checkpoint: a failure part-way leaves them half-trained

    def checkpoint() -> None:
        nonlocal saves
        assert students is not None or not trained, "the students of the checkpoint are loaded before it is replaced"
        saves += 1  # the step of the checkpoint: a released version is distilled without moving the cursor
        extra = {"run_id": run_id, "cursor": cursor, "skipped": skipped, "variants": list(dc.variants),
                 "history": history,
                 "versions": passed, "normalizer": None if normalizer is None else normalizer.to_dict(),
                 "domains": [] if students is None else students.domains}
        if students is not None:
            extra["format"] = CHECKPOINT_FORMAT
        files = {} if students is None else {STUDENTS_FILE: save_students(students)}
        save_checkpoint(root, TrainState(step=saves, examples_seen=0, examples_version=cursor - 1, extra=extra),
                        nn.ModuleDict(), {}, extra_files=files, storage_options=lake.storage_options)
        _prune(root)
        if memory is not None and students is not None:
            memory.keep(root, run_id, saves, students)

    done = 0
    for version in [*released, *range(cursor, newest + 1)]:
        if max_versions is not None and done >= max_versions:
            break
        is_released = version < cursor
        if not is_released and version >= teacher_cursor:
            result.waiting_for = version
            break
        if not allowed(version):  # the teacher passed it: quarantined, or never validated and without rows
            quality = "quarantined" if decisions[version].validated else "not validated"
            if decisions[version].validated and version not in skipped:
                skipped.append(version)
            record: dict[str, Any] = {"version": version, "quality": quality, "rows": 0, "counts": {}}
        else:
            table = _read_version(lake, tid, version)
            if table.num_rows and normalizer is None:
                normalizer = fit_normalizer(table)
                students = _Students(dc, tc, len(normalizer.names))
            if table.num_rows:
                assert normalizer is not None and students is not None
                dim, hidden = students.teacher_dims
                logged = read_predictions(lake, version)  # the current teacher run's: an older run's is another model
                logged = logged.filter(pc.equal(logged["run_id"], teacher_run))
                joined = join_teacher(table, logged, allowed, dim=dim, hidden=hidden)
                measure = sum(1 for r in passed if r["rows"]) % INFERENCE_EVERY == 0
                # The students read no sequence; only the teacher's forward of inference_rates does.
                data = encode_for(table, tc, normalizer, pointers(table) if measure else None, sequences=measure)
                _distill_version(students, version, table, data, joined, history, evaluate=not is_released)
                counts, rates = joined.counts, inference_rates(students, tc, data, joined) if measure else None
            else:
                counts, rates = {}, None
            record = {"version": version, "quality": "released" if is_released else "passed", "rows": table.num_rows,
                      "counts": counts, "inference": rates}
            if is_released:
                skipped.remove(version)
        record["distilled_ms"] = int(time.time() * 1000)  # wall clock: how long a version waited (gemline.waits)
        passed.append(record)
        result.versions.append(record)
        cursor = max(cursor, version + 1)
        done += 1
        checkpoint()
        log.info("distill: examples@%d %s", version, record)
    result.cursor = cursor
    result.report = summarize(history, passed, dc.variants)
    if done and report:
        began = time.process_time()
        result.report_path = write_report(lake, run_id, result.report)
        result.report_cpu_s = time.process_time() - began
    elif not done and resume is not None:  # nothing new: the report on disk is this one already
        result.report_path = f"{lake.root.rstrip('/')}/_runs/{run_id}/distill.html"
    # else a run that has distilled nothing yet (waiting for the teacher) writes no report: a --follow poll every
    # few seconds would leave a folder of empty reports each time.
    return result


INFERENCE_ROWS = 2048
"""Rows of a version each model predicts for :func:`inference_rates` (the version's first rows)."""
INFERENCE_EVERY = 10
""":func:`inference_rates` is measured on the first version with rows a run distills and every 10th after it
(the report shows the newest measurement): measured at every version, it built a teacher model and ran every
model twice per version, a quarter of the CPU of distilling a version of 4.6k rows (2026-12-02)."""


def _examples_per_s(predict_all: Callable[[], object], rows: int) -> float:
    """Examples/s of ``predict_all`` (one pass over ``rows`` rows) after one warm-up pass, wall clock."""
    with torch.no_grad():
        predict_all()
        start = time.perf_counter()
        predict_all()
        return rows / max(time.perf_counter() - start, 1e-9)


def inference_rates(students: _Students, tc: TrainerConfig, data: EncodedExamples,
                    joined: Joined) -> dict[str, Any] | None:
    """CPU inference examples/s of each variant's student and of a teacher of ``tc``'s model, on the same rows.

    Each model predicts up to :data:`INFERENCE_ROWS` of the version's rows in batches of ``distill.batch_size``,
    once to warm up and once timed (wall clock, the process's torch threads). The teacher is a freshly built
    model of the trainer config (:func:`trainer.models.build_model`): its forward cost does not depend on its
    weights, and the distill process holds no teacher checkpoint in memory. A student reads the ids, the dense
    features and the joined teacher inputs (a lookup, not model time); the teacher reads the whole batch, its
    sequences included. A wall-clock figure of one pass: compare the models of one report, not reports.

    Returns:
        ``{"rows", "batch_size", "threads", "teacher_model", "teacher", "students": {variant: examples/s}}``
        (examples/s as float); None when no row has a domain (no student predicts it).
    """
    dc = students.dc
    domains = [d for d in data.domains.tolist() if d is not None]
    if not domains:
        return None
    rows = np.arange(min(INFERENCE_ROWS, len(data.labels)))
    ids = torch.from_numpy(data.sparse_ids[rows] % dc.num_embeddings)
    dense, teacher_inputs = torch.from_numpy(data.dense[rows]), _take(joined.inputs, rows)
    domain = domains[0]
    rates: dict[str, float] = {}
    for variant in dc.variants:
        student = students.student(domain, variant)

        def predict_all(s: Student = student) -> object:
            return predict(s, ids, dense, teacher_inputs, dc.batch_size)

        rates[variant] = _examples_per_s(predict_all, len(rows))
    model = build_model(tc, students.num_dense, students.domains).eval()
    batches = [make_batch(data, rows[i: i + dc.batch_size]) for i in range(0, len(rows), dc.batch_size)]

    def teacher() -> None:
        for batch in batches:
            model(batch.sparse, batch.sequence, batch.dense, domain_ids(model, batch))

    return {"rows": len(rows), "batch_size": dc.batch_size, "threads": torch.get_num_threads(),
            "teacher_model": tc.model, "teacher": _examples_per_s(teacher, len(rows)), "students": rates}


def summarize(history: list[dict[str, Any]], versions: list[dict[str, Any]],
              variants: tuple[str, ...]) -> dict[str, Any]:
    """The report's numbers: ``rows`` (per increment, domain, variant, task: ne, auc, calibration, rows, on all
    rows; the teacher on the rows it predicted), ``summary`` (per domain and variant, pooled over increments, on
    the rows with a teacher prediction, with the transfer ratio; None where the teacher's NE is not below
    student-alone's), ``staleness`` (per increment and domain:
    the teacher's median staleness and the adapter's click NE gain over aux_head) and the join ``counts``."""
    rows = []
    for h in history:
        scores = h["teacher_rows"] if h["variant"] == TEACHER else h["all"]
        rows.append({"examples_version": h["examples_version"], "domain": h["domain"], "variant": h["variant"],
                     "task": h["task"], **pooled([scores])})
    summary = []
    for domain in sorted({h["domain"] for h in history}):
        for task in TASKS:
            by_variant = {v: pooled([h["teacher_rows"] for h in history if h["domain"] == domain and h["task"] == task
                                     and h["variant"] == v]) for v in (*variants, TEACHER)}
            alone, teacher = by_variant.get("alone", {}).get("ne"), by_variant[TEACHER]["ne"]
            for variant, metrics in by_variant.items():
                ratio = None
                # A teacher no better than student-alone has no gain to transfer: the ratio is undefined then.
                if alone is not None and teacher is not None and metrics["ne"] is not None and alone - teacher > 1e-9:
                    ratio = (alone - metrics["ne"]) / (alone - teacher)
                all_rows = pooled([h["all"] for h in history if h["domain"] == domain and h["task"] == task
                                   and h["variant"] == variant and h["all"] is not None])
                summary.append({"domain": domain, "variant": variant, "task": task, **metrics,
                                "transfer_ratio": ratio, "ne_all_rows": all_rows["ne"], "rows_all": all_rows["rows"]})
    staleness = []
    click_ne = {(h["examples_version"], h["domain"], h["variant"]): pooled([h["teacher_rows"]])["ne"]
                for h in history if h["task"] == "click"}
    for h in history:
        if h["variant"] == TEACHER and h["task"] == "click":
            key = (h["examples_version"], h["domain"])
            aux, adapted = click_ne.get((*key, "aux_head")), click_ne.get((*key, "adapter"))
            gain = aux - adapted if aux is not None and adapted is not None else None
            staleness.append({"examples_version": key[0], "domain": key[1], "staleness_ms_p50": h["staleness_ms_p50"],
                              "adapter_ne_gain": gain})
    measured = [v["inference"] for v in versions if v.get("inference")]
    return {"rows": rows, "summary": summary, "staleness": staleness, "versions": versions,
            "inference": measured[-1] if measured else None}


def staleness_plot_png(staleness: list[dict[str, Any]]) -> bytes | None:
    """PNG bytes: the teacher's median staleness at prediction time (days, x) against the adapter's click NE gain
    over aux_head (y; above 0: the adapter helped), one point per (examples version, domain) of the report's
    ``staleness`` rows, one colour per domain; None when no row has both numbers."""
    points = [(s["domain"], s["staleness_ms_p50"] / 86_400_000, s["adapter_ne_gain"]) for s in staleness
              if s["staleness_ms_p50"] is not None and s["adapter_ne_gain"] is not None]
    if not points:
        return None
    fig, ax = subplots(figsize=(6, 3.5))
    for domain in sorted({d for d, _, _ in points}):
        mine = [(x, y) for d, x, y in points if d == domain]
        ax.scatter([x for x, _ in mine], [y for _, y in mine], label=domain)
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set(xlabel="teacher staleness at prediction time, median (days)", ylabel="click NE gain of the adapter",
           title="Student Adapter gain over aux_head against teacher staleness")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return png_bytes(fig, dpi=100)


def _inference_html(rates: dict[str, Any] | None) -> str:
    """The report's inference section: examples/s of each student and of the teacher, and the ratio."""
    if not rates:
        return ""
    lines = [(f"teacher ({html.escape(str(rates['teacher_model']))})", rates["teacher"])]
    lines += [(f"student {html.escape(v)}", r) for v, r in rates["students"].items()]
    body = "".join(f"<tr><td>{name}</td><td>{rate:,.0f}</td><td>x{rate / rates['teacher']:.1f}</td></tr>"
                   for name, rate in lines)
    return (f"<h2>CPU inference, examples/s</h2><p>{rates['rows']} rows of the newest version, batches of "
            f"{rates['batch_size']}, {rates['threads']} torch thread(s), one timed pass after a warm-up.</p>"
            f"<table border=1 cellpadding=3><tr><th>model</th><th>examples/s</th><th>of the teacher</th></tr>{body}</table>")


def write_report(lake: Lake, run_id: str, report: dict[str, Any]) -> str:
    """Write ``LAKE/_runs/<run_id>/distill.json`` (the whole report; its ``rows`` are the per-increment metrics)
    and ``distill.html`` (the summary and staleness tables, the staleness plot of :func:`staleness_plot_png`);
    return the HTML's path."""
    fs, base = lake_fs(lake.root, lake.storage_options)
    folder = f"{base}/_runs/{run_id}"
    fs.create_dir(folder, recursive=True)
    with fs.open_output_stream(f"{folder}/distill.json") as out:
        out.write(json.dumps(report, indent=1, sort_keys=True).encode())

    def cell(v: Any) -> str:
        return "" if v is None else f"{v:.4f}" if isinstance(v, float) else html.escape(str(v))

    def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
        head = "".join(f"<th>{c}</th>" for c in columns)
        body = "".join("<tr>" + "".join(f"<td>{cell(r.get(c))}</td>" for c in columns) + "</tr>" for r in rows)
        return f"<table border=1 cellpadding=3><tr>{head}</tr>{body}</table>"

    png = staleness_plot_png(report["staleness"])
    page = (f"<html><head><meta charset='utf-8'><title>distill {html.escape(run_id)}</title></head><body>"
            f"<h1>Distillation run {html.escape(run_id)}</h1><p>Written {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}. "
            "Progressive evaluation: each student predicts a version's rows before training on them. Pooled over "
            "increments, on the rows with a usable teacher prediction; transfer ratio = (NE alone - NE variant) / "
            "(NE alone - NE teacher).</p><h2>Per domain and variant</h2>"
            + table(report["summary"], ["domain", "task", "variant", "rows", "ne", "auc", "calibration", "transfer_ratio",
                                        "ne_all_rows", "rows_all"])
            + "<h2>Teacher staleness and the adapter's gain (click NE of aux_head minus adapter)</h2>"
            + ("" if png is None else "<img alt='staleness against the adapter gain' "
               f"src='data:image/png;base64,{base64.b64encode(png).decode('ascii')}'><br>")
            + table(report["staleness"], ["examples_version", "domain", "staleness_ms_p50", "adapter_ne_gain"])
            + _inference_html(report.get("inference"))
            + "<h2>Per increment (all rows; the teacher on its rows)</h2>"
            + table(report["rows"], ["examples_version", "domain", "variant", "task", "rows", "ne", "auc", "calibration"])
            + "<h2>Versions and the teacher join</h2>"
            + table([{**v, **v.get("counts", {})} for v in report["versions"]],
                    ["version", "quality", "rows", "with_teacher", "label_only", "dropped_quarantined",
                     "dropped_nonfinite", "dropped_future"])
            + "</body></html>")
    with fs.open_output_stream(f"{folder}/distill.html") as out:
        out.write(page.encode())
    return f"{lake.root.rstrip('/')}/_runs/{run_id}/distill.html"


FOLLOW_REPORT_EVERY_S = 60.0
"""``distill --follow`` redraws its report page after a call that distilled only when the last one is at least this
old (seconds), and its drawing's CPU time at most :data:`gemline.polling.REPORT_CPU_SHARE` of the time since
(:class:`gemline.polling.ReportThrottle`): drawing the staleness plot after every version was ~8 % of following the
freshness benchmark's stream (py-spy, 2026-12-03); as the teacher's run report (trainer.continuous.FOLLOW_REPORT_EVERY_S)."""


def follow(lake: Lake, tc: TrainerConfig, dc: DistillConfig, *, poll_interval_s: float = 30.0,
           from_scratch: bool = False, on_result: Callable[[DistillResult], object] | None = None,
           max_polls: int | None = None, watch_s: float | None = 1.0,
           report_every_s: float = FOLLOW_REPORT_EVERY_S, report_cpu_share: float = REPORT_CPU_SHARE) -> int:
    """:func:`run_distill_once` again as soon as the teacher commits to ``training_metrics`` (it does for every
    examples version it consumes; looked for every ``watch_s`` seconds, :class:`gemline.increments.LogTip`), and
    at least every ``poll_interval_s`` seconds, until interrupted (``gemline distill --follow``); returns the calls
    made. The teacher's checkpoint, which moves its cursor, follows its last commit of a version: a call that
    comes before it waits for the next commit or ``poll_interval_s``. Raises ValueError for ``poll_interval_s < 0``
    or ``watch_s <= 0``. The history of pointer-layout rows is read by increments across the calls
    (:class:`trainer.data.PointerReader`), and the students it saved last are kept in memory (:class:`Memory`).
    The report page is redrawn by a call that distilled when the last drawing is at least ``report_every_s`` seconds
    old (0: after every such call) and its CPU time is at most ``report_cpu_share`` of the time since
    (:class:`gemline.polling.ReportThrottle`; 1.0: ``report_every_s`` alone), the first call always, and at the stop
    (Ctrl-C, SIGTERM) when a later call distilled without drawing it."""
    pointers, memory = PointerReader(lake), Memory()
    teacher = LogTip(lake.root, Table.TRAINING_METRICS, storage_options=lake.storage_options)
    reports = ReportThrottle(report_every_s, report_cpu_share, clock=time.monotonic)

    undrawn: list[tuple[str, dict[str, Any]]] = []  # the newest (run, report) a throttled call did not draw

    def once(first: bool) -> DistillResult:
        due = reports.due()
        result = run_distill_once(lake, tc, dc, from_scratch=from_scratch and first, pointers=pointers,
                                  memory=memory, report=due)
        if result.report_path is not None and due:
            reports.drawn(result.report_cpu_s)
            undrawn.clear()
        elif result.versions and result.report is not None:
            undrawn[:] = [(result.run_id, result.report)]
        return result

    try:
        return poll(once,
                    name="distill", interval_s=poll_interval_s, on_result=on_result, waiting=_waiting,
                    max_polls=max_polls, watch=teacher.advance, watch_s=watch_s)
    finally:  # stopped (Ctrl-C, SIGTERM) or done: the page shows the last call, not the last drawing
        for run_id, report in undrawn:
            try:
                write_report(lake, run_id, report)
            except Exception as exc:  # noqa: BLE001 - a failed drawing must not hide why the loop ended
                log.warning("the distill report was not rewritten at the stop: %s", exc)


def _waiting(result: DistillResult) -> str:
    return "" if result.waiting_for is None else f"the teacher has not consumed examples@{result.waiting_for} yet"
