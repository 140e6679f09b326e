"""Final labels only (issue 18 item 3): open labels leave the loss and the metrics, per task."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from trainer.config import TrainerConfig
from trainer.labels import final_labels, loss_terms, masked_rate
from trainer.metrics import auc, evaluate, normalized_entropy

DAY = 86_400_000


def _table(times, closed, modes=None):
    cols = {"event_time_ms": pa.array(times, pa.int64()), "label_window_closed": pa.array(closed, pa.bool_())}
    if modes is not None:
        cols["label_mode"] = pa.array(modes, pa.string())
    return pa.table(cols)


def test_final_labels_hand_case():
    # Newest impression at 10 d: a 1-day click window closed for rows at <= 9 d; the conversion window for none
    # of the open rows. The fnw row is weighted by trainer.delayed, so both its labels count here.
    table = _table([0, 8 * DAY, 9 * DAY + 1, 10 * DAY, 5 * DAY], [True, False, False, False, False],
                   ["wait", "wait", "wait", "wait", "fnw"])
    final = final_labels(table, DAY)
    assert final.tolist() == [[True, True], [True, False], [False, False], [False, False], [True, True]]
    # Without a click window, clicks follow label_window_closed as conversions do.
    assert final_labels(table, None)[:4].tolist() == [[True, True], [False, False], [False, False], [False, False]]
    # A table without label_window_closed (an older writer) has every label final.
    assert final_labels(pa.table({"event_time_ms": [1, 2]}), DAY).all()
    with pytest.raises(ValueError, match="click_window_ms must be >= 0"):
        final_labels(table, -1)


def test_open_conversion_leaves_the_loss_and_the_metrics():
    """Row 2's conversion is open: the loss is the hand BCE of the other labels, and NE/AUC are those of rows 0, 1, 3."""
    logits = torch.tensor([[0.0, 1.0], [1.0, -1.0], [-2.0, 2.0], [0.5, -0.5]], requires_grad=True)
    labels = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    final = torch.tensor([[True, True], [True, True], [True, False], [True, True]])
    terms = loss_terms(logits, labels, None, final, (1.0, 2.0))

    def bce(x, y):
        p = 1 / (1 + math.exp(-x))
        return -(y * math.log(p) + (1 - y) * math.log(1 - p))

    expected_click = sum(bce(x, y) for x, y in [(0.0, 1), (1.0, 0), (-2.0, 1), (0.5, 0)]) / 4
    expected_conv = 2.0 * sum(bce(x, y) for x, y in [(1.0, 1), (-1.0, 0), (-0.5, 1)]) / 4
    loss = terms.mean(dim=0).sum()
    assert loss.item() == pytest.approx(expected_click + expected_conv, rel=1e-6)
    loss.backward()
    assert logits.grad[2, 1] == 0 and logits.grad[2, 0] != 0  # the open label moves nothing

    probs = torch.sigmoid(logits.detach()).double().numpy()
    y = labels.numpy()
    metrics = evaluate(y, probs, ["a"] * 4, final.numpy())
    conv = metrics["conversion"]["overall"]
    keep = [0, 1, 3]
    assert conv["num_examples"] == 3
    assert conv["auc"] == pytest.approx(auc(y[keep, 1], probs[keep, 1]))
    assert conv["ne"] == pytest.approx(normalized_entropy(y[keep, 1], probs[keep, 1]))
    # Hand check of that AUC: positives 0.731, 0.378 against the negative 0.269 -> both above: 1.0.
    assert conv["auc"] == 1.0
    # Had the open label counted as the negative it was published as, the AUC would be 2/4 (0.881 outranks both).
    assert auc(y[:, 1], probs[:, 1]) == 0.5
    assert metrics["click"]["overall"]["num_examples"] == 4
    assert metrics["conversion"]["by_domain"]["a"]["num_examples"] == 3


def test_all_masked_zero_weight_task_gives_no_nan():
    logits = torch.tensor([[0.3, float("inf")], [-0.2, float("-inf")]], requires_grad=True)
    labels = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # infinite BCE on the conversion head
    final = torch.tensor([[True, False], [True, False]])
    for weights in ((1.0, 0.0), (1.0, 1.0)):
        loss = loss_terms(logits, labels, None, final, weights).mean(dim=0).sum()
        assert torch.isfinite(loss)
        (grad,) = torch.autograd.grad(loss, logits)
        assert torch.isfinite(grad).all() and grad[:, 1].abs().sum() == 0
    # Weight 0 with every label final still removes the (infinite) task.
    loss = loss_terms(logits, labels, None, None, (1.0, 0.0)).mean(dim=0).sum()
    assert torch.isfinite(loss)
    # All masked everywhere: the loss is 0, not 0/0.
    assert loss_terms(logits, labels, None, torch.zeros(2, 2, dtype=torch.bool), (1.0, 1.0)).sum().item() == 0.0


def test_masked_rate_and_config():
    labels = np.array([[1, 1], [0, 0], [1, 1]], dtype=np.float32)
    final = np.array([[True, False], [True, False], [False, False]])
    rates = masked_rate(labels, final)
    assert rates[0] == 0.5 and math.isnan(rates[1])
    assert masked_rate(labels, None).tolist() == pytest.approx([2 / 3, 2 / 3])
    with pytest.raises(ValueError, match="trainer.task_weights must be two weights >= 0"):
        TrainerConfig(task_weights=(1.0, -1.0))


def test_the_click_window_is_at_least_the_builds():
    from gemline.config import GemlineConfig
    from gemline.errors import BadConfigError
    from sequences.config import BuildConfig

    assert GemlineConfig().trainer.click_window_ms == BuildConfig().click_window_ms == DAY
    with pytest.raises(BadConfigError, match=r"trainer.click_window_ms=86400000 is shorter .* \(172800001 ms\)"):
        GemlineConfig(build=BuildConfig(window_overrides=("feed:click:172800001",)))
    # Longer only masks more; a shorter per-domain override is covered by the default.
    GemlineConfig(trainer=TrainerConfig(click_window_ms=3 * DAY), build=BuildConfig(window_overrides=("feed:click:3600000",)))
