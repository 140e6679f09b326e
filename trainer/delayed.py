"""Importance weights for examples published before their labels were final (``build.label_mode``).

The build (:mod:`sequences.publish`) publishes an impression after a short waiting window with the labels
seen by then, and later a correction row per label: a late positive (fnw and defer), or in defer a real
negative when the window closes. Trained as they come, these rows overweight negatives: a delayed positive
is seen once as a negative and once as a positive. The loss is therefore weighted per (row, label) by
w(x, y) = p(y | x) / q(y | x), the true over the observed label distribution (importance sampling), with
the true p(y=1 | x) taken from the model itself (its prediction, gradient stopped) as Ktena et al. do.

For one label of one impression with true positive rate p and delayed-positive rate p_dp = p * delta (delta:
the share of positives that arrive after the waiting window), the expected rows are

==========  ====================================  =============================================
mode        positive rows  /  negative rows         weights (positive, negative)
==========  ====================================  =============================================
fnw         p  /  1 - p + p_dp                      1 + p_dp,  (1 - p)(1 + p_dp) / (1 - p + p_dp)
defer       p  /  2(1 - p) + p_dp                   C,  (1 - p) C / (2(1 - p) + p_dp),  C = 2 - p + p_dp
==========  ====================================  =============================================

(the observed distribution q(y | x) is rows(y) / C with C = all rows per impression; each weight is
p(y | x) / q(y | x)). fnw with delta = 1 (no waiting window) is Ktena et al., RecSys 2019, section 3.2
(weights 1 + p and (1 - p)(1 + p)); DEFER (Gu et al., KDD 2021, arXiv 2104.14121, section 3.2) duplicates
the delayed positives and the real negatives, which gives the defer row; had it duplicated every impression
(C = 2), the weights would be its paper's p / (p - p_dp / 2) and (1 - p) / (1 - p + p_dp / 2). In both
modes the weighted positive share sum(w y) / sum(w) over an impression's expected rows is p: what the
trainer sees matches the true distribution, and no label counts twice. A row whose label was final when
published (wait, or a waiting window at least that label's window) has weight 1.

delta is estimated per (domain, label) from the rows read together (the trainer's read batch): late-positive
corrections over all positives of open rows, with one pseudo-count each (Laplace), so it is a function of
the data alone and a resumed run computes the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.nn.functional as F

TASK_NAMES: tuple[str, ...] = ("click", "conversion")
"""The label columns' tasks, in the order of the heads."""

SCHEMES: dict[str, int] = {"wait": 0, "fnw": 1, "defer": 2}
"""``label_mode`` -> the integer code of :class:`DelayedLabels`.scheme."""

_P_MIN = 1e-6


@dataclass(frozen=True)
class DelayedLabels:
    """Per-row weighting inputs of N examples.

    Attributes:
        scheme: (N,) int8, :data:`SCHEMES` of the row's ``label_mode``.
        mask: (N, 2) bool, the labels the row carries (a correction carries one).
        biased: (N, 2) bool, labels of the delayed stream (open when published, or a correction): weighted.
        share: (N, 2) float32, delta of the row's (domain, label).
    """

    scheme: np.ndarray
    mask: np.ndarray
    biased: np.ndarray
    share: np.ndarray

    def take(self, rows: np.ndarray) -> DelayedLabels:
        """The rows ``rows`` (B,) int64."""
        return DelayedLabels(self.scheme[rows], self.mask[rows], self.biased[rows], self.share[rows])


def delayed_labels(table: pa.Table) -> DelayedLabels | None:
    """The weighting inputs of an examples table; None when every row is a final one (wait mode, or a table
    without the early-publication columns of :mod:`sequences.schema`), so the loss is plain BCE.

    Raises:
        ValueError: a ``label_mode`` other than wait, fnw or defer, or a ``correction_task`` other than click
            or conversion.
    """
    if "label_mode" not in table.schema.names or table.num_rows == 0:
        return None
    modes = table.column("label_mode").to_pylist()
    unknown = set(modes) - set(SCHEMES)
    if unknown:
        raise ValueError(f"label_mode must be one of {sorted(SCHEMES)}, got {sorted(unknown)}")
    if set(modes) == {"wait"}:
        return None
    n = table.num_rows
    scheme = np.array([SCHEMES[m] for m in modes], dtype=np.int8)
    correction = np.asarray(table.column("correction_task").to_pylist(), dtype=object)
    bad = set(correction[correction != None]) - set(TASK_NAMES)  # noqa: E711 (object array)
    if bad:
        raise ValueError(f"correction_task must be click or conversion, got {sorted(bad)}")
    is_correction = correction != None  # noqa: E711
    mask = np.ones((n, 2), dtype=bool)
    biased = np.zeros((n, 2), dtype=bool)
    share = np.ones((n, 2), dtype=np.float32)
    domains = np.asarray(table.column("domain").to_pylist(), dtype=object)
    for j, task in enumerate(TASK_NAMES):
        mine = correction == task
        mask[:, j] = ~is_correction | mine
        opened = table.column(f"{task}_open").to_numpy(zero_copy_only=False).astype(bool)
        biased[:, j] = (opened | mine) & (scheme > 0) & mask[:, j]
        label = pc.cast(table.column(f"label_{task}"), pa.int8()).to_numpy(zero_copy_only=False).astype(bool)
        for domain in set(domains[biased[:, j]]):
            here = domains == domain
            late = int(np.sum(here & mine & label))
            early = int(np.sum(here & opened & ~is_correction & label))
            share[here, j] = (late + 1) / (late + early + 2)
    return DelayedLabels(scheme, mask, biased, share)


@dataclass(frozen=True)
class DelayedBatch:
    """:class:`DelayedLabels` of B batch rows as tensors: scheme (B,) int64, mask and biased (B, 2) bool,
    share (B, 2) float32."""

    scheme: torch.Tensor
    mask: torch.Tensor
    biased: torch.Tensor
    share: torch.Tensor


def is_correction(table: pa.Table) -> np.ndarray:
    """(N,) bool: rows that correct an earlier example (``corrects_example_id`` set; all False for a table
    without the early-publication columns)."""
    if "corrects_example_id" not in table.schema.names:
        return np.zeros(table.num_rows, dtype=bool)
    return table.column("corrects_example_id").is_valid().to_numpy(zero_copy_only=False)


def first_publications(table: pa.Table) -> pa.Table:
    """The rows of ``table`` that are not corrections: each impression once, as evaluation counts it (a
    correction repeats its impression with one label; its labels are judged when the model meets the next
    impression, not twice)."""
    if "corrects_example_id" not in table.schema.names:
        return table
    return table.filter(pa.array(~is_correction(table)))


def importance_weights(probs: torch.Tensor, labels: torch.Tensor, scheme: torch.Tensor, biased: torch.Tensor,
                       share: torch.Tensor) -> torch.Tensor:
    """w(x, y) of each (row, label) (formulas: the module docstring); 1 where not ``biased``.

    Args:
        probs: (B, 2) float, the model's probabilities (the caller detaches them).
        labels: (B, 2) float 0/1.
        scheme: (B,) int, :data:`SCHEMES` codes.
        biased: (B, 2) bool; share: (B, 2) float delta.

    Returns:
        (B, 2) float weights, > 0.
    """
    p = probs.clamp(_P_MIN, 1 - _P_MIN)
    p_dp = p * share
    defer = (scheme == SCHEMES["defer"]).unsqueeze(1)
    total = torch.where(defer, 2 - p + p_dp, 1 + p_dp)  # C: expected rows per impression and label
    negatives = torch.where(defer, 2 * (1 - p) + p_dp, 1 - p + p_dp)
    weight = torch.where(labels > 0.5, total, (1 - p) * total / negatives)
    return torch.where(biased, weight, torch.ones_like(weight))


def bce_terms(logits: torch.Tensor, labels: torch.Tensor, delayed: DelayedBatch | None) -> torch.Tensor:
    """(B, 2) BCE-with-logits per (row, label), importance-weighted and masked for delayed-label rows.

    Args:
        logits: (B, 2) float; labels: (B, 2) float 0/1.
        delayed: the batch rows' :class:`DelayedBatch`, or None (plain BCE).
    """
    terms = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    if delayed is None:
        return terms
    weight = importance_weights(torch.sigmoid(logits.detach()), labels, delayed.scheme, delayed.biased,
                                delayed.share)
    return terms * weight * delayed.mask.to(terms.dtype)


def to_torch(delayed: DelayedLabels) -> DelayedBatch:
    """The same rows as a :class:`DelayedBatch`."""
    return DelayedBatch(torch.from_numpy(delayed.scheme.astype(np.int64)), torch.from_numpy(delayed.mask),
                         torch.from_numpy(delayed.biased), torch.from_numpy(delayed.share))


__all__ = ["SCHEMES", "DelayedBatch", "DelayedLabels", "bce_terms", "delayed_labels", "first_publications",
           "importance_weights", "is_correction", "to_torch"]
