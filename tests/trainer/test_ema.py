"""The evaluation's parameter average (trainer/ema.py, ``trainer.gem.ema_decay``): its maths on a hand case, predictions
on the average while training steps the raw parameters, and checkpoints that carry it exactly."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from gemline.errors import BadConfigError
from trainer.checkpoint import TrainState
from trainer.config import GemConfig, TrainerConfig
from trainer.data import encode_examples, fit_normalizer
from trainer.ema import ParameterAverage, averaged_parameters
from trainer.loop import local_engine

SMALL = TrainerConfig(embedding_dim=8, num_embeddings=1000, hidden_dims=(16, 8), tower_hidden=4, batch_size=8,
                      gem=GemConfig(preset="gem_small", max_sequence_len=2, fm_outputs=4, lcb_outputs=4, fm_rank=4,
                                    ema_decay=0.5))
DOMAINS = ("feed", "reels")


@pytest.fixture(scope="module")
def data():
    from tests.trainer.conftest import synthetic_examples

    table = synthetic_examples(["2026-01-01"], 40, 5)
    return encode_examples(table, SMALL.num_embeddings, fit_normalizer(table))


def engine_of(tc: TrainerConfig, seed: int = 0):
    torch.manual_seed(seed)
    return local_engine(tc, 3, DOMAINS, None)


def test_average_hand_case():
    weight = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    average = ParameterAverage([weight], decay=0.75)
    with averaged_parameters(torch.nn.Module()):  # a model without an average: nothing happens
        pass
    average.update()  # the first update copies
    assert average.avg_0.tolist() == [1.0, 2.0] and int(average.updates) == 1
    with torch.no_grad():
        weight.copy_(torch.tensor([12.0, -9.0]))
    average.update()  # n = 1: d = min(0.75, 2 / 11) -> [1, 2] + 9/11 * ([12, -9] - [1, 2]) = [10, -7]
    torch.testing.assert_close(average.avg_0, torch.tensor([10.0, -7.0]), rtol=0, atol=1e-6)
    with torch.no_grad():
        average.avg_0.copy_(torch.tensor([2.0, 1.0]))
        weight.copy_(torch.tensor([6.0, 5.0]))
    average.update()  # n = 2: d = min(0.75, 3 / 12) = 0.25 -> 0.25 * [2, 1] + 0.75 * [6, 5]
    assert average.avg_0.tolist() == [5.0, 4.0] and int(average.updates) == 3
    average.updates.fill_(30)  # n = 30: d = min(0.75, 31 / 40) = 0.75 -> 0.75 * [5, 4] + 0.25 * [1, 0]
    with torch.no_grad():
        weight.copy_(torch.tensor([1.0, 0.0]))
    average.update()
    assert average.avg_0.tolist() == [4.0, 3.0]
    average.swap()
    assert weight.tolist() == [4.0, 3.0] and average.avg_0.tolist() == [1.0, 0.0]
    average.swap()
    assert weight.tolist() == [1.0, 0.0] and average.avg_0.tolist() == [4.0, 3.0]


@pytest.mark.parametrize("decay", [-0.1, 1.0, 1.5])
def test_bad_decay_refused(decay):
    with pytest.raises(ValueError, match=r"ema_decay must be in \[0, 1\) or none"):
        GemConfig(ema_decay=decay)
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\)"):
        ParameterAverage([torch.nn.Parameter(torch.zeros(1))], decay)


def test_sharded_run_refused():
    from trainer.launch import check_distributable

    with pytest.raises(ValueError, match="one process only"):
        check_distributable(replace(SMALL, model="gem"), 2)
    check_distributable(replace(SMALL, model="gem"), 1)


def test_training_steps_raw_parameters_and_predict_uses_the_average(data):
    engine = engine_of(SMALL)
    model = engine.model
    average = model.param_average
    assert average is not None
    dense = model.dense_parameters()
    table = model.embedding_parameters()[0]
    assert len(average.averages()) == len(dense)
    before = engine.predict(data, 16)  # no update yet: the raw parameters
    after_steps = []
    for start in (0, 8, 16):
        assert engine.train_step(data, np.arange(start, start + 8)) is not None
        after_steps.append([p.detach().clone() for p in dense])
    assert int(average.updates) == 3
    # decay 0.5 warmed up: d_1 = 2/11, d_2 = 3/12 -> avg = lerp(lerp(p1, p2, 9/11), p3, 3/4), step by step
    for i, avg in enumerate(average.averages()):
        p1, p2, p3 = (step[i] for step in after_steps)
        assert torch.equal(avg, torch.lerp(torch.lerp(p1, p2, 1 - 2 / 11), p3, 0.75)), i
    raw = {name: t.clone() for name, t in model.state_dict().items()}
    averaged = engine.predict(data, 16)
    # predict left the raw parameters (and the averages) as they were, bit for bit
    for name, t in model.state_dict().items():
        assert torch.equal(t, raw[name]), name
    # the reference: the same model with the averages loaded as its parameters and no average
    plain = engine_of(replace(SMALL, gem=replace(SMALL.gem, ema_decay=None)), seed=1)
    state = {name: t for name, t in raw.items() if not name.startswith("param_average.")}
    plain.model.load_state_dict(state)
    with torch.no_grad():
        for p, avg in zip(plain.model.dense_parameters(), average.averages(), strict=True):
            p.copy_(avg)
    np.testing.assert_array_equal(averaged, plain.predict(data, 16))
    # and not the raw parameters' predictions (the average differs from the last step's parameters)
    plain.model.load_state_dict(state)
    assert np.abs(plain.predict(data, 16) - averaged).max() > 1e-6
    assert np.abs(before - averaged).max() > 1e-6
    # the tables are not averaged: no average has a table's shape
    assert all(avg.shape != table.shape for avg in average.averages())


def test_checkpoint_resumes_the_average_exactly(tmp_path, data):
    engine = engine_of(SMALL)
    for start in (0, 8):
        engine.train_step(data, np.arange(start, start + 8))
    state = TrainState(step=2, examples_seen=16, examples_version=0)
    path = engine.save(tmp_path, state)
    saved = {name: t.clone() for name, t in engine.model.state_dict().items() if name.startswith("param_average.")}
    assert saved["param_average.updates"].item() == 2
    torch.manual_seed(7)
    engine.train_step(data, np.arange(16, 24))
    expected = engine.predict(data, 16)

    resumed = engine_of(SMALL, seed=3)  # other starting parameters: the load must replace them all
    resumed.load(path, state)
    for name, t in resumed.model.state_dict().items():
        if name.startswith("param_average."):
            assert torch.equal(t, saved[name]), name
    torch.manual_seed(7)
    resumed.train_step(data, np.arange(16, 24))
    for name, t in resumed.model.state_dict().items():
        assert torch.equal(t, engine.model.state_dict()[name]), name
    np.testing.assert_array_equal(resumed.predict(data, 16), expected)


@pytest.mark.parametrize(("saved_decay", "resumed_decay", "hint"), [
    (None, 0.5, "written with trainer.gem.ema_decay=none, this run has 0.5: it resumes with --set "
                "trainer.gem.ema_decay=none"),
    (0.5, None, "written with trainer.gem.ema_decay=0.5, this run has none: it resumes with --set "
                "trainer.gem.ema_decay=0.5"),
])
def test_checkpoint_of_the_other_setting_refused_in_one_line(tmp_path, data, saved_decay, resumed_decay, hint):
    state = TrainState(step=1, examples_seen=8, examples_version=0)
    engine = engine_of(replace(SMALL, gem=replace(SMALL.gem, ema_decay=saved_decay)))
    engine.train_step(data, np.arange(8))
    path = engine.save(tmp_path, state)
    other = engine_of(replace(SMALL, gem=replace(SMALL.gem, ema_decay=resumed_decay)))
    with pytest.raises(BadConfigError) as err:
        other.load(path, state)
    assert hint in str(err.value)
    assert "\n" not in str(err.value)


def test_a_checkpoint_from_before_the_decay_was_recorded_keeps_the_old_hint(tmp_path, data):
    state = TrainState(step=1, examples_seen=8, examples_version=0)
    engine = engine_of(replace(SMALL, gem=replace(SMALL.gem, ema_decay=0.5)))
    engine.train_step(data, np.arange(8))
    path = Path(engine.save(tmp_path, state))
    payload = torch.load(path / "state.pt", weights_only=True)
    assert payload.pop("param_average_decays") == {"param_average": 0.5}
    torch.save(payload, path / "state.pt")  # as written before issue 20
    other = engine_of(replace(SMALL, gem=replace(SMALL.gem, ema_decay=None)))
    with pytest.raises(BadConfigError, match=r"resumes with --set trainer.gem.ema_decay=<its decay>\)"):
        other.load(path, state)
