"""Per-domain vertical models ("students") that learn from the logged teacher predictions, and their losses.

Shape letters: B batch, S = len(SPARSE_FEATURES) sparse ids, D embedding width (the teacher's
``trainer.embedding_dim``), F dense features, T teacher inputs (2D + H + 1, representation variant only).

A student is a compact MLP: one table per sparse feature (ids folded into ``distill.num_embeddings`` rows),
the normalized dense features and, in the representation variant, the teacher's vectors, into a shared MLP,
then two heads (ExFM, arXiv 2502.17494, §3.3, "Auxiliary Head"):

- the **serving head**, trained on the labels; the only one that serves and is evaluated;
- the **auxiliary head**, trained on the teacher's prediction (and on the Student Adapter's); its gradient
  into the shared layers is multiplied by ``distill.aux_gradient_scale`` (:func:`scale_gradient`).

The **Student Adapter** (ExFM §3.4) is a small model per task on the teacher's logit, trained on the freshest
labels; its output, without gradient, is a second distillation target of the auxiliary head. It is updated
before each student step (:func:`train_pair`).

Variants (cumulative, ``distill.variants``):

    alone           labels only
    aux_head        + the teacher's prediction through the auxiliary head
    adapter         + the Student Adapter's corrected prediction as a second target
    representation  + the teacher's vectors as inputs, and the user and item rows of the student's tables
                    initialized from the teacher's logged rows (:meth:`Student.adopt_rows`)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gemline.errors import BadConfigError
from sequences.schema import SPARSE_FEATURES
from trainer.delayed import DelayedBatch
from trainer.labels import loss_terms
from trainer.sparse_optim import RowSparseAdam

VariantName = Literal["alone", "aux_head", "adapter", "representation"]
"""The four students of each domain, each adding one mechanism to the one before."""

VARIANTS: tuple[VariantName, ...] = get_args(VariantName)

SERVED: tuple[VariantName, ...] = ("alone", "aux_head")
"""The default ``distill.variants``: the student served (ExFM's auxiliary head, the largest transfer ratio of the
three mechanisms on the Open Bandit data, README "Knowledge transfer") and the baseline its transfer ratio needs.
Two, not four, so that ``gemline run`` keeps up at 2,000 events/s on 2 cores (README, issue 20)."""

_P_MIN = 1e-6
"""Teacher probabilities are clipped into [_P_MIN, 1 - _P_MIN] before taking logits."""


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """The students of ``gemline distill`` (``[distill]`` in the TOML)."""

    variants: tuple[VariantName, ...] = SERVED
    """Students trained for each domain; "alone" is the baseline of the transfer ratio. All four compare the
    mechanisms (the demo's table in the README); each costs the CPU of one more student per domain."""
    num_embeddings: int = 16_384
    """Rows per student table; the teacher's hashed ids are folded modulo this."""
    hidden_dims: tuple[int, ...] = (32,)
    """Widths of the shared MLP under the two heads."""
    batch_size: int = 256
    """Examples per student step."""
    learning_rate: float = 3e-3
    """Adam learning rate of every student parameter."""
    aux_loss_weight: float = 1.0
    """Weight of the auxiliary head's distillation loss(es)."""
    aux_gradient_scale: float = 0.5
    """Factor on the auxiliary head's gradient into the shared layers (ExFM's gradient scaling)."""
    adapter_hidden: int = 8
    """Width of the Student Adapter's hidden layer."""
    adapter_learning_rate: float = 1e-2
    """Adam learning rate of the Student Adapter."""
    seed: int = 0
    """Seed of the students' init and data order."""
    follow_in_run: bool | None = None
    """``gemline run`` supervises a ``distill --follow`` stage beside ``train --follow``; None: when the teacher
    logs predictions (``trainer.log_teacher_predictions``, on for ``trainer.model=gem``)."""

    def __post_init__(self) -> None:
        """Raises BadConfigError naming the ``distill.*`` key of a bad value."""
        unknown = [v for v in self.variants if v not in VARIANTS]
        if not self.variants or unknown or len(set(self.variants)) != len(self.variants):
            raise BadConfigError(f"distill.variants must be distinct names of {VARIANTS}, got {self.variants}")
        for name in ("num_embeddings", "batch_size", "adapter_hidden"):
            if getattr(self, name) < (2 if name == "num_embeddings" else 1):
                raise BadConfigError(f"distill.{name} is too small: {getattr(self, name)}")
        if not self.hidden_dims or any(w < 1 for w in self.hidden_dims):
            raise BadConfigError(f"distill.hidden_dims must be widths >= 1, got {self.hidden_dims}")
        for name in ("learning_rate", "adapter_learning_rate"):
            if getattr(self, name) <= 0:
                raise BadConfigError(f"distill.{name} must be > 0, got {getattr(self, name)}")
        if self.aux_loss_weight < 0 or self.aux_gradient_scale < 0:
            raise BadConfigError("distill.aux_loss_weight and distill.aux_gradient_scale must be >= 0, got "
                                 f"{self.aux_loss_weight}, {self.aux_gradient_scale}")


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def scale_gradient(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` in the forward pass; the gradient flowing back through it multiplied by ``scale``.

    Source: ExFM's auxiliary head (arXiv 2502.17494, §3.3): identity forward, scaled backward.
    """
    return _ScaleGradient.apply(x, scale)


@dataclass(frozen=True)
class TeacherInputs:
    """What the teacher says about B rows.

    Attributes:
        probs: (B, 2) float32 teacher probabilities (click, conversion); 0 where ``has`` is False.
        has: (B,) bool: a usable teacher prediction (point in time, finite, not quarantined).
        vectors: (B, 2D + H) float32 user vector, candidate vector, representation; zeros where missing.
    """

    probs: torch.Tensor
    has: torch.Tensor
    vectors: torch.Tensor


class Student(nn.Module):
    """One vertical model (module docstring).

    Args:
        variant: which mechanisms it has.
        num_embeddings: rows per table; dim: D; num_dense: F; teacher_width: 2D + H (representation only).
        hidden_dims: shared MLP widths.
    """

    def __init__(self, *, variant: VariantName, num_embeddings: int, dim: int, num_dense: int, teacher_width: int,
                 hidden_dims: Sequence[int]) -> None:
        super().__init__()
        self.variant, self.num_embeddings = variant, num_embeddings
        # Sparse gradients: a step touches the batch's rows only, not every row of S tables (SparseAdam).
        self.tables = nn.ModuleList(nn.Embedding(num_embeddings, dim, sparse=True) for _ in SPARSE_FEATURES)
        for j in range(len(SPARSE_FEATURES)):
            nn.init.uniform_(self.table(j).weight, -0.05, 0.05)
        self.teacher_width = teacher_width + 1 if variant == "representation" else 0
        width = len(SPARSE_FEATURES) * dim + num_dense + self.teacher_width
        self.shared = nn.Sequential(*[m for a, b in zip([width, *hidden_dims[:-1]], hidden_dims)
                                      for m in (nn.Linear(a, b), nn.ReLU())])
        self.serving = nn.Linear(hidden_dims[-1], 2)
        self.aux = nn.Linear(hidden_dims[-1], 2) if variant != "alone" else None
        # Which user and item rows were set from the teacher (representation variant): each once.
        self.register_buffer("adopted", torch.zeros(2, num_embeddings, dtype=torch.bool))

    def init_output_bias(self, base_rates: torch.Tensor) -> None:
        """Start both heads' intercepts (click, conversion) at the log-odds of ``base_rates`` (2,) in (0, 1).

        Why: as the teacher's (trainer.models.baselines.DLRM.init_output_bias): from 0 (p = 0.5) to a 0.5% click
        rate (logit -5.3) takes Adam hundreds of steps at lr 3e-3, and a new domain's student takes a few per
        version (the Open Bandit students' calibration was 40 after six versions).

        Raises:
            ValueError: a rate outside (0, 1) or not of shape (2,).
        """
        rates = torch.as_tensor(base_rates, dtype=torch.float64)
        if rates.shape != (2,) or not bool(((rates > 0) & (rates < 1)).all()):
            raise ValueError(f"base_rates must be (2,) rates in (0, 1) (click, conversion), got {rates.tolist()}")
        with torch.no_grad():
            for head in (self.serving, self.aux):
                if head is not None:
                    head.bias.copy_(torch.logit(rates).to(head.bias.dtype))

    def table_parameters(self) -> list[nn.Parameter]:
        """The tables' weights (sparse gradients: torch.optim.SparseAdam)."""
        return list(self.tables.parameters())

    def dense_parameters(self) -> list[nn.Parameter]:
        """Every other parameter (torch.optim.Adam)."""
        tables = {id(p) for p in self.table_parameters()}
        return [p for p in self.parameters() if id(p) not in tables]

    def table(self, j: int) -> nn.Embedding:
        """The table of ``SPARSE_FEATURES[j]``."""
        return cast(nn.Embedding, self.tables[j])

    def forward(self, ids: torch.Tensor, dense: torch.Tensor, teacher: TeacherInputs | None = None,
                gradient_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids (B, S) int64 rows, dense (B, F) float32 -> (serving logits (B, 2), auxiliary logits (B, 2) or None).

        Raises:
            ValueError: the representation variant without ``teacher``.
        """
        parts = [self.table(j)(ids[:, j]) for j in range(len(SPARSE_FEATURES))] + [dense]
        if self.teacher_width:
            if teacher is None:
                raise ValueError("the representation student needs the teacher's vectors (TeacherInputs)")
            parts += [teacher.vectors, teacher.has.to(dense.dtype).unsqueeze(1)]
        hidden = self.shared(torch.cat(parts, dim=1))
        aux = None if self.aux is None else self.aux(scale_gradient(hidden, gradient_scale))
        return self.serving(hidden), aux

    def adopt_rows(self, ids: torch.Tensor, user_vectors: torch.Tensor, item_vectors: torch.Tensor,
                   has: torch.Tensor) -> int:
        """Parameter sharing: set each user_id / item_id row not set before to the teacher's logged row of it
        (the first row of ``ids`` (B, S) with ``has``); returns the rows set. The vectors are the teacher's
        table rows when it predicted (trainer.teacher_log), so this never reads a teacher newer than the example.

        Raises:
            ValueError: the vectors are not (B, D).
        """
        set_rows, adopted = 0, cast(torch.Tensor, self.adopted)
        with torch.no_grad():
            for k, (feature, vectors) in enumerate((("user_id", user_vectors), ("item_id", item_vectors))):
                table = self.table(SPARSE_FEATURES.index(feature))
                if vectors.shape != (ids.shape[0], table.embedding_dim):
                    raise ValueError(f"{feature} vectors must be ({ids.shape[0]}, {table.embedding_dim}), "
                                     f"got {tuple(vectors.shape)}")
                column = ids[:, SPARSE_FEATURES.index(feature)]
                candidates = torch.nonzero(has & (column > 0)).flatten()
                # Each row's first candidate (np.unique's first index), of the rows not adopted before: what a
                # loop over the candidates in order sets (it was 8 % of a distill process's CPU, 2026-12-03).
                unique, first = np.unique(column[candidates].numpy(), return_index=True)
                fresh = ~adopted[k, torch.from_numpy(unique)].numpy()
                rows = torch.from_numpy(unique[fresh])
                table.weight[rows] = vectors[candidates[torch.from_numpy(first[fresh])]]
                adopted[k, rows] = True
                set_rows += len(rows)
        return set_rows


def student_optimizers(student: Student, learning_rate: float) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """(Adam over the dense parameters, SparseAdam over the tables) of ``student``; SparseAdam's rule by
    :class:`trainer.sparse_optim.RowSparseAdam` (the same results and state, less CPU)."""
    return (torch.optim.Adam(student.dense_parameters(), lr=learning_rate),
            RowSparseAdam(student.table_parameters(), lr=learning_rate))


class StudentAdapter(nn.Module):
    """Maps the teacher's logit to a corrected logit, per task: ``t + mlp(t)`` (starts as the identity).

    Input and output (B, 2) float32 logits (click, conversion). Source: ExFM's Student Adapter (§3.4).
    """

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.ModuleList(nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, 1)) for _ in range(2))
        for net in self.net:
            last = cast(nn.Linear, cast(nn.Sequential, net)[2])
            nn.init.zeros_(last.weight)  # starts as the identity: the teacher's own prediction
            nn.init.zeros_(last.bias)

    def forward(self, teacher_logits: torch.Tensor) -> torch.Tensor:
        """(B, 2) -> (B, 2) corrected logits."""
        return teacher_logits + torch.cat([net(teacher_logits[:, j: j + 1]) for j, net in enumerate(self.net)], dim=1)


def teacher_logits(probs: torch.Tensor) -> torch.Tensor:
    """(B, 2) probabilities -> (B, 2) logits, clipped away from 0 and 1."""
    return torch.logit(probs.clamp(_P_MIN, 1 - _P_MIN))


def adapter_step(adapter: StudentAdapter, optimizer: torch.optim.Optimizer, teacher: TeacherInputs,
                 labels: torch.Tensor, final: torch.Tensor | None = None) -> float | None:
    """One step of the adapter on the rows with a teacher prediction: BCE of adapter(teacher logit) on the
    labels (B, 2) 0/1 that are final (``final`` (B, 2) bool, :func:`trainer.labels.final_labels`; None: all),
    averaged over those labels; None (nothing changed) when no final label has a teacher prediction."""
    use = teacher.has.unsqueeze(1).expand_as(labels)
    if final is not None:
        use = use & final
    if not bool(use.any()):
        return None
    out = adapter(teacher_logits(teacher.probs))
    terms = F.binary_cross_entropy_with_logits(out, labels, reduction="none")
    loss = torch.where(use, terms, torch.zeros_like(terms)).sum() / use.sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.item())


def student_loss(student: Student, ids: torch.Tensor, dense: torch.Tensor, labels: torch.Tensor,
                 teacher: TeacherInputs, dc: DistillConfig, *, adapter: StudentAdapter | None = None,
                 delayed: DelayedBatch | None = None, final: torch.Tensor | None = None) -> torch.Tensor:
    """The student's loss on one batch: the labels' BCE on the serving head (importance-weighted for delayed
    labels, as the teacher's; a label whose window is still open, ``final`` (B, 2) bool False, contributes 0, as
    in the teacher's loss, :func:`trainer.labels.loss_terms`; None: every label final) plus, for the distilling
    variants, ``aux_loss_weight`` x BCE of the auxiliary head on the teacher's probabilities (and on the adapter's
    corrected ones, without gradient), averaged over the B rows, rows without a teacher prediction contributing
    0. The teacher's prediction is no label, so it supervises a row whose label is still open too."""
    serving, aux = student(ids, dense, teacher, dc.aux_gradient_scale)
    loss = loss_terms(serving, labels, delayed, final, (1.0, 1.0)).mean(dim=0).sum()
    if aux is None or not bool(teacher.has.any()):
        return loss
    mask = teacher.has.to(aux.dtype).unsqueeze(1)
    targets = [teacher.probs]
    if adapter is not None:
        with torch.no_grad():
            targets.append(torch.sigmoid(adapter(teacher_logits(teacher.probs))))
    for target in targets:
        terms = F.binary_cross_entropy_with_logits(aux, target, reduction="none") * mask
        loss = loss + dc.aux_loss_weight * terms.mean(dim=0).sum()
    return loss


def predict(student: Student, ids: torch.Tensor, dense: torch.Tensor, teacher: TeacherInputs,
            batch_size: int) -> np.ndarray:
    """(N, 2) float64 serving-head probabilities of N rows, in order."""
    student.eval()
    out = []
    with torch.no_grad():
        for i in range(0, ids.shape[0], batch_size):
            part = TeacherInputs(teacher.probs[i: i + batch_size], teacher.has[i: i + batch_size],
                                 teacher.vectors[i: i + batch_size])
            out.append(torch.sigmoid(student(ids[i: i + batch_size], dense[i: i + batch_size], part)[0]).double())
    student.train()
    return torch.cat(out).numpy() if out else np.zeros((0, 2))
