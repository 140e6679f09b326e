"""The logistic regression baseline starts from zero dense weights, so its first steps follow the labels.

Why it matters: on the Taobao sample the model that scores most rows has trained a few steps; from
nn.Linear's random init its ranking was that init's (click AUC 0.37 at seed 0), not the data's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.trainer.conftest import synthetic_examples
from trainer.config import TrainerConfig
from trainer.data import encode_examples, fit_normalizer, make_batch
from trainer.loop import domain_ids, local_engine
from trainer.models import build_model

SMALL = TrainerConfig(embedding_dim=8, num_embeddings=1000, batch_size=600, learning_rate=0.01, model="lr")


@pytest.fixture(scope="module")
def data():
    table = synthetic_examples(["2026-01-01", "2026-01-02"], 300, 7)
    normalizer = fit_normalizer(table)
    return encode_examples(table, SMALL.num_embeddings, normalizer), normalizer.names


def test_untrained_logistic_regression_ignores_the_dense_features(data):
    encoded, names = data
    torch.manual_seed(0)
    model = build_model(SMALL, len(names), ("feed", "reels", "marketplace"))
    batch = make_batch(encoded, np.arange(64))
    shifted = torch.randn_like(batch.dense) * 5
    with torch.no_grad():
        a = model(batch.sparse, batch.sequence, batch.dense, domain_ids(model, batch))
        b = model(batch.sparse, batch.sequence, shifted, domain_ids(model, batch))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(5))
def test_first_step_moves_the_click_weight_of_a_predictive_feature_up(data, seed):
    # Click odds rise with f_user_ctr_7d in the synthetic rows (tests/trainer/conftest.py). Adam's
    # first step moves each weight by ~lr in the gradient's direction, so from zero the weight is
    # +lr; from U(+-1/sqrt(3)) = U(+-0.58) its sign was the init's at most seeds.
    encoded, names = data
    torch.manual_seed(seed)
    engine = local_engine(SMALL, len(names), ("feed", "reels", "marketplace"), None)
    engine.train_step(encoded, np.arange(len(encoded)))
    weight = engine.model.dense_arch["linear"].weight.detach()  # (2 tasks, F)
    ctr = names.index("f_user_ctr_7d")
    assert float(weight[0, ctr]) == pytest.approx(SMALL.learning_rate, rel=1e-3)

