"""Final labels only: which (row, task) labels the loss and the metrics may use, and the task-weighted loss.

A label published before its attribution window closed can still turn from 0 to 1, so trained or
evaluated as published it is a false negative more often than a real one (the Taobao sample's last week
of conversions). A label is *final* when

- the row belongs to the fnw/defer stream (``label_mode`` not "wait"): :mod:`trainer.delayed` weights and
  masks those rows, which accounts for the open labels, so they count here;
- otherwise (a "wait" row, or a table without ``label_mode``): for the conversion task (the longest window)
  ``label_window_closed``; for the click task ``label_window_closed`` or ``event_time_ms + click_window_ms``
  at or before the newest ``event_time_ms`` of the table (a lower bound of the build's watermark, so the
  test errs towards masking). Without a click window (``None``) clicks follow ``label_window_closed`` too.

Only a label's window decides, never its value: keeping the positives of open rows would bias the base
rate upwards. Shape letters: N rows, B batch rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from trainer.delayed import DelayedBatch, bce_terms


def final_labels(table: pa.Table, click_window_ms: int | None) -> np.ndarray:
    """(N, 2) bool, columns (click, conversion): the labels of ``table`` that are final (module docstring).

    Args:
        table: examples rows with ``event_time_ms`` and ``label_window_closed`` (a table without the latter,
            e.g. an older writer's, has every label final).
        click_window_ms: the build's click attribution window (ms), or None to judge clicks by
            ``label_window_closed`` alone.

    Raises:
        ValueError: a negative ``click_window_ms``.
    """
    n = table.num_rows
    if click_window_ms is not None and click_window_ms < 0:
        raise ValueError(f"click_window_ms must be >= 0 or None, got {click_window_ms}")
    if "label_window_closed" not in table.schema.names or n == 0:
        return np.ones((n, 2), dtype=bool)
    closed = table.column("label_window_closed").to_numpy(zero_copy_only=False).astype(bool)
    final = np.stack([closed, closed], axis=1)
    if click_window_ms is not None:
        t = table.column("event_time_ms").to_numpy(zero_copy_only=False).astype(np.int64)
        final[:, 0] |= t + click_window_ms <= int(t.max())
    if "label_mode" in table.schema.names:
        streamed = pc.not_equal(table.column("label_mode"), "wait").to_numpy(zero_copy_only=False).astype(bool)
        final[streamed] = True
    return final


def loss_terms(logits: torch.Tensor, labels: torch.Tensor, delayed: DelayedBatch | None, final: torch.Tensor | None,
               task_weights: Sequence[float]) -> torch.Tensor:
    """(B, 2) loss terms: :func:`trainer.delayed.bce_terms` times each task's weight, 0 where a label is not final.

    The caller averages over the (global) batch, so a batch whose labels are all open gives loss 0 with
    zero gradients; a term is zeroed with ``torch.where``, not multiplied, so a non-finite term of a
    masked label (or of a task of weight 0) cannot leak a NaN into the loss.

    Args:
        logits, labels: (B, 2) float.
        delayed: the rows' late-label weighting inputs, or None.
        final: (B, 2) bool from :func:`final_labels`, or None (every label final).
        task_weights: (click, conversion) loss weights, >= 0.
    """
    terms = bce_terms(logits, labels, delayed)
    weights = torch.as_tensor(tuple(task_weights), dtype=terms.dtype, device=terms.device)
    keep = weights > 0 if final is None else final & (weights > 0)
    return torch.where(keep.expand_as(terms), terms * weights, torch.zeros_like(terms))


def masked_rate(labels: np.ndarray, final: np.ndarray | None) -> np.ndarray:
    """(2,) float64 positive rate of each task over its final labels; ``labels`` (N, 2), ``final`` (N, 2) bool or
    None; NaN for a task without a final label."""
    labels = np.asarray(labels, dtype=np.float64)
    if final is None:
        final = np.ones(labels.shape, dtype=bool)
    counts = final.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, (labels * final).sum(axis=0) / np.maximum(counts, 1), np.nan)


__all__ = ["final_labels", "loss_terms", "masked_rate"]
