"""The label-mode benchmark's table cells (benchmarks/label_modes.py), on a hand case."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.label_modes import metric_cells


def test_cells_are_auc_ne_and_calibration_of_both_tasks_on_the_chosen_impressions():
    run = {"labels": {"a": np.array([1, 0]), "b": np.array([0, 1]), "c": np.array([0, 0]), "x": np.array([1, 1])},
           "predictions": {"a": np.array([0.8, 0.2]), "b": np.array([0.4, 0.6]), "c": np.array([0.2, 0.1]),
                           "x": np.array([0.0, 0.0])},
           "domains": {"a": "d", "b": "d", "c": "d", "x": "d"}}
    cells = [float(c) for c in metric_cells(run, ["a", "b", "c"])]  # "x" is left out
    click_auc, click_ne, click_cal, conv_auc, conv_ne, conv_cal = cells
    assert click_auc == 1.0 and conv_auc == 1.0, "the positive ranks above both negatives in each task"
    assert click_cal == pytest.approx((0.8 + 0.4 + 0.2) / 3 / (1 / 3), abs=5e-5)  # 1.4: overpredicts
    assert conv_cal == pytest.approx((0.2 + 0.6 + 0.1) / 3 / (1 / 3), abs=5e-5)  # 0.9
    ce = -(np.log(0.8) + np.log(0.6) + np.log(0.8)) / 3
    base = -(np.log(1 / 3) / 3 + 2 / 3 * np.log(2 / 3))
    assert click_ne == pytest.approx(ce / base, abs=5e-5)
    assert conv_ne < 1 and click_ne < 1
