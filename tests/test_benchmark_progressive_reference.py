"""benchmarks.progressive_reference's logistic regression: Newton's method reaches the penalized optimum."""

import numpy as np

from benchmarks.progressive_reference import fit_logistic


def test_fit_logistic_recovers_the_generating_weights():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20_000, 2))
    true = np.array([-2.0, 1.5, -0.5])  # intercept, then the two weights
    y = (rng.random(20_000) < 1 / (1 + np.exp(-(true[0] + x @ true[1:])))).astype(np.float64)
    w = fit_logistic(x, y, l2=0.0)
    np.testing.assert_allclose(w, true, atol=0.08)


def test_fit_logistic_hand_case_and_penalty():
    # One feature that is 0 for two rows (labels 0, 1) and 1 for two rows (both 1): without a penalty the
    # intercept is the log-odds at x = 0, log(1/1) = 0, and the weight grows without bound (separable at x = 1).
    x = np.array([[0.0], [0.0], [1.0], [1.0]])
    y = np.array([0.0, 1.0, 1.0, 1.0])
    w = fit_logistic(x, y, l2=1.0)
    # The penalized optimum: gradient zero, penalty on the weight only.
    p = 1 / (1 + np.exp(-(w[0] + x[:, 0] * w[1])))
    np.testing.assert_allclose([np.sum(p - y), np.sum((p - y) * x[:, 0]) + 1.0 * w[1]], [0.0, 0.0], atol=1e-9)
    assert 0 < w[1] < 5  # finite: the penalty bounds it
