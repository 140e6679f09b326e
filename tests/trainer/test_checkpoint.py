"""Checkpoints are atomic, found by latest_checkpoint, and restore parameters, optimisers, step and RNG."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from trainer.checkpoint import (
    TrainState,
    checkpoints_root,
    latest_checkpoint,
    load_checkpoint,
    read_state,
    save_checkpoint,
)


def make_model_and_optimizers(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 1))
    optimizers = {
        "embeddings": torch.optim.Adagrad(model[0].parameters(), lr=0.1),
        "dense": torch.optim.Adam(model[1].parameters(), lr=0.01),
    }
    return model, optimizers


def train_steps(model, optimizers, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randint(0, 10, (5,))).pow(2).mean()
        for opt in optimizers.values():
            opt.zero_grad()
        loss.backward()
        for opt in optimizers.values():
            opt.step()


def test_save_load_restores_everything(tmp_path):
    model, optimizers = make_model_and_optimizers(seed=1)
    train_steps(model, optimizers, 3)
    rng = np.random.default_rng(5)
    rng.random(4)
    state = TrainState(step=3, examples_seen=15, examples_version=7, extra={"note": "x"})
    path = save_checkpoint(tmp_path, state, model, optimizers, numpy_rng=rng, extra_files={"a.txt": b"hi"})
    assert path == checkpoints_root(tmp_path) / "step-3" and (path / "a.txt").read_bytes() == b"hi"
    saved_params = {k: v.clone() for k, v in model.state_dict().items()}
    # The uninterrupted run: its next RNG draws and its next step.
    expected_draws = (torch.rand(3).tolist(), random.random(), np.random.rand(), rng.random())
    torch.manual_seed(11)
    train_steps(model, optimizers, 1)

    fresh, fresh_opts = make_model_and_optimizers(seed=2)
    fresh_rng = np.random.default_rng(99)
    assert not torch.equal(fresh[1].weight, saved_params["1.weight"])
    restored = load_checkpoint(path, fresh, fresh_opts, numpy_rng=fresh_rng)
    assert restored == state
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, saved_params[name]), name
    assert (torch.rand(3).tolist(), random.random(), np.random.rand(), fresh_rng.random()) == expected_draws
    # Same optimiser state (Adam moments, Adagrad sums) -> the resumed step lands on the same parameters.
    torch.manual_seed(11)
    train_steps(fresh, fresh_opts, 1)
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_latest_checkpoint_ignores_incomplete(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    model, optimizers = make_model_and_optimizers(seed=0)
    for step in (2, 10):
        save_checkpoint(tmp_path, TrainState(step=step, examples_seen=step, examples_version=0), model, optimizers)
    root = checkpoints_root(tmp_path)
    (root / ".tmp-step-50-abc").mkdir()  # a crashed save
    (root / "step-40").mkdir()  # no meta.json: incomplete
    assert latest_checkpoint(tmp_path) == root / "step-10"
    assert read_state(root / "step-10").examples_seen == 10
    # Saving the same step again replaces it atomically and leaves no temporary directory.
    save_checkpoint(tmp_path, TrainState(step=10, examples_seen=99, examples_version=0), model, optimizers)
    assert read_state(root / "step-10").examples_seen == 99
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step-50-abc", "step-10", "step-2", "step-40"]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"step": -1}, ValueError, ">= 0"),
        ({"extra_files": {"../x": b""}}, ValueError, "plain names"),
        ({"extra_files": {"meta.json": b""}}, ValueError, "plain names"),
    ],
)
def test_save_rejects(tmp_path, kwargs, error, message):
    model, optimizers = make_model_and_optimizers(seed=0)
    state = TrainState(step=kwargs.pop("step", 1), examples_seen=0, examples_version=0)
    with pytest.raises(error, match=message):
        save_checkpoint(tmp_path, state, model, optimizers, **kwargs)


def test_load_rejects(tmp_path):
    model, optimizers = make_model_and_optimizers(seed=0)
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "step-1", model, optimizers)
    path = save_checkpoint(tmp_path, TrainState(step=1, examples_seen=0, examples_version=0), model, optimizers)
    with pytest.raises(ValueError, match="optimisers"):
        load_checkpoint(path, model, {"dense": optimizers["dense"]})


class _Deep(torch.nn.Module):
    def __init__(self, wide: bool) -> None:
        super().__init__()
        self.deep = torch.nn.Linear(4, 2)
        self.dense_arch = torch.nn.ModuleDict({"wide": torch.nn.Linear(4, 2)} if wide else {})


def test_load_refuses_another_model_in_one_line(tmp_path):
    """A checkpoint of another model shape is a BadConfigError naming the parameters and the way back, not torch's
    multi-line state-dict message; the model keeps its own parameters."""
    from gemline.errors import BadConfigError

    old = _Deep(wide=False)
    path = save_checkpoint(tmp_path, TrainState(step=1, examples_seen=0, examples_version=0), old, {})
    new = _Deep(wide=True)
    before = {k: v.clone() for k, v in new.state_dict().items()}
    with pytest.raises(BadConfigError, match=r"lacks \(dense_arch\.wide\.bias, dense_arch\.wide\.weight\).*"
                                             r"lacks \(none\).*trainer\.gem\.wide=false") as err:
        load_checkpoint(path, new, {})
    assert "\n" not in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in new.state_dict().items())
    # The other way round: extra saved parameters, no wide hint.
    path = save_checkpoint(tmp_path, TrainState(step=2, examples_seen=0, examples_version=0), new, {})
    with pytest.raises(BadConfigError, match=r"lacks \(none\).*lacks \(dense_arch\.wide\.bias, "
                                             r"dense_arch\.wide\.weight\); resume with the settings that wrote it, "):
        load_checkpoint(path, _Deep(wide=False), {})
    # Same names, the same model: loads.
    load_checkpoint(path, _Deep(wide=True), {})
