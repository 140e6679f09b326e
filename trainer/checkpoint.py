"""Trainer checkpoints under ``LAKE/_checkpoints/step-N/``, complete or absent.

A checkpoint is written into a hidden temporary directory next to its final place and renamed
when every file is on disk (a rename within one filesystem is atomic), so a crash mid-save leaves
only a ``.tmp-*`` directory that :func:`latest_checkpoint` ignores; the idea follows torchtitan's
checkpointer, which also counts a step only once its files are complete.

    step-N/state.pt      model, optimisers (and their classes), RNG states, parameter-average decays (torch.save)
    step-N/meta.json     step, examples_seen, examples_version, extra (written last)
    step-N/*             extra files given by the caller (e.g. loss_curve.png)

Nothing read back runs code. A lake may be shared by several people and machines, so a ``state.pt`` is untrusted
input: it is read with ``torch.load(weights_only=True)`` (PyTorch's restricted unpickler: tensors, plain
containers, numbers and strings only; torch docs "torch.load", "weights_only"), and everything the trainer saves
is of those kinds -- the numpy RNG states as lists (:func:`_plain`). Checkpoints written before that held numpy
arrays: the three numpy names those need are allowed by name (:data:`LEGACY_NUMPY_GLOBALS`), nothing else. A file
that does not load is one :class:`gemline.errors.CheckpointError` naming it.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import torch
from torch import nn

from gemline.errors import BadConfigError, CheckpointError
from gemline.lake import Lake, StorageOptions, as_lake, is_remote, lake_fs

CHECKPOINTS_DIR = "_checkpoints"
STEP_DIR = re.compile(r"^step-(\d+)$")
"""A checkpoint folder's name; any other name under ``_checkpoints`` is not one."""


@dataclass(frozen=True, kw_only=True)
class TrainState:
    """Progress of a training run.

    Attributes:
        step: optimiser steps taken (the checkpoint directory is ``step-<step>``).
        examples_seen: training examples consumed by those steps.
        examples_version: Delta version of ``examples`` the run trained on.
        extra: JSON-serialisable values the trainer keeps (e.g. dense normalization statistics).
    """

    step: int
    examples_seen: int
    examples_version: int
    extra: dict[str, Any] = field(default_factory=dict)


def checkpoints_root(lake: Lake | str | Path) -> Path:
    """``LAKE/_checkpoints`` of a local lake."""
    return Path(as_lake(lake).root) / CHECKPOINTS_DIR


_NDARRAY = "__ndarray__"


def _plain(value: Any) -> Any:
    """``value`` with every numpy array replaced by ``{"__ndarray__": list, "dtype": str}`` (in dicts, lists and
    tuples): what ``torch.load(weights_only=True)`` reads back without allowing any numpy name."""
    if isinstance(value, np.ndarray):
        return {_NDARRAY: value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(item) for item in value)
    return value


def _numpy(value: Any) -> Any:
    """The inverse of :func:`_plain`."""
    if isinstance(value, dict):
        if _NDARRAY in value:
            return np.asarray(value[_NDARRAY], dtype=value["dtype"])
        return {key: _numpy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_numpy(item) for item in value)
    return value


def _rng_state(numpy_rng: np.random.Generator | None) -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy_global": _plain(np.random.get_state(legacy=False)),
        "numpy_generator": None if numpy_rng is None else _plain(numpy_rng.bit_generator.state),
    }


LEGACY_NUMPY_GLOBALS: list[Any] = [np._core.multiarray._reconstruct, np.ndarray, np.dtype,  # type: ignore[attr-defined]
                                   np.dtypes.UInt32DType]
"""The numpy names a ``state.pt`` written before the RNG states were saved as lists needs (its MT19937 key, a uint32
array): allowed by name for ``torch.load(weights_only=True)`` (torch.serialization.safe_globals), so those
checkpoints still resume. An array's dtype and bytes are data; its elements are unpickled by the same restricted
unpickler."""

STATE_KEYS = ("model", "optimizers", "rng")
"""What every ``state.pt`` this module writes holds (besides optional keys)."""


def safe_load(source: str | Path | bytes, *, name: str | Path | None = None) -> Any:
    """``torch.load(source, weights_only=True)`` onto the CPU, with :data:`LEGACY_NUMPY_GLOBALS` allowed: a file (or
    the bytes of one, named ``name`` in messages) read from a lake, which anyone who can write there may have
    replaced. An object whose unpickling would call anything but torch's tensor rebuilders and those names (a
    ``__reduce__`` payload, any class) is refused before it runs.

    Raises:
        gemline.errors.CheckpointError: the file is missing, truncated, not a torch file, or holds what the restricted
            unpickler refuses; the message names the file and ``--from-scratch``.
    """
    label = name if name is not None else source if not isinstance(source, bytes) else "checkpoint payload"
    try:
        with torch.serialization.safe_globals(LEGACY_NUMPY_GLOBALS):
            return torch.load(io.BytesIO(source) if isinstance(source, bytes) else source, weights_only=True,
                              map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - whatever a corrupt or hostile file raises becomes one line
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"checkpoint file {label} cannot be loaded safely ({type(exc).__name__}: {reason[:200]}); it is corrupt "
            "or was written by something other than gemline: move its checkpoint folder away to resume from an "
            "older one, or start a new run with --from-scratch") from exc


def _load_state(path: Path) -> dict[str, Any]:
    """``path/state.pt`` through :func:`safe_load`, checked to hold :data:`STATE_KEYS`.

    Raises:
        gemline.errors.CheckpointError: as :func:`safe_load`, or the payload is not a dict with those keys.
    """
    payload = safe_load(path / "state.pt")
    if not isinstance(payload, dict) or not all(key in payload for key in STATE_KEYS):
        have = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(f"checkpoint file {path / 'state.pt'} is not a gemline checkpoint (holds {have}, "
                              f"expected {', '.join(STATE_KEYS)}): move its folder away, or start a new run with "
                              "--from-scratch")
    return payload


def save_checkpoint(
    lake: Lake | str | Path,
    state: TrainState,
    model: nn.Module,
    optimizers: Mapping[str, torch.optim.Optimizer],
    *,
    numpy_rng: np.random.Generator | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    storage_options: StorageOptions | None = None,
) -> Path | str:
    """Write ``step-<state.step>`` atomically and return its path.

    ``lake`` is a :class:`gemline.lake.Lake` or a root with its ``storage_options``. On an
    object-store lake (``s3://...``) the checkpoint is written to a local temporary directory
    and uploaded through :func:`gemline.lake.lake_fs` with the lake's options, ``meta.json``
    last (a reader counts a step only once its meta.json is there); the return value is its URI.

    An existing complete checkpoint of the same step is replaced (a rerun from scratch on the same
    lake reaches the same step numbers).

    Raises:
        ValueError: ``state.step`` < 0 or an extra file name that is not a plain file name.
    """
    if state.step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {state.step}")
    for name in extra_files or {}:
        if name != Path(name).name or name in ("state.pt", "meta.json"):
            raise ValueError(f"extra file names must be plain names other than state.pt/meta.json, got {name!r}")
    if is_remote(lake):
        return _save_remote(lake, state, model, optimizers, numpy_rng, extra_files, storage_options)
    root = checkpoints_root(lake)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state.step}"
    tmp = root / f".tmp-step-{state.step}-{uuid.uuid4().hex}"
    tmp.mkdir()
    torch.save(
        {
            "model": model.state_dict(),
            "optimizers": {name: opt.state_dict() for name, opt in optimizers.items()},
            "optimizer_types": optimizer_types(optimizers),
            "rng": _rng_state(numpy_rng),
            "param_average_decays": param_average_decays(model),
        },
        tmp / "state.pt",
    )
    for name, payload in (extra_files or {}).items():
        (tmp / name).write_bytes(payload)
    meta = {
        "step": state.step,
        "examples_seen": state.examples_seen,
        "examples_version": state.examples_version,
        "extra": state.extra,
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    if final.exists():
        old = root / f".old-step-{state.step}-{uuid.uuid4().hex}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    return final


def optimizer_types(optimizers: Mapping[str, torch.optim.Optimizer]) -> dict[str, str]:
    """Each optimiser's class as ``module.QualName`` (what a checkpoint records, so a resume under another can refuse)."""
    return {name: f"{type(opt).__module__}.{type(opt).__qualname__}" for name, opt in optimizers.items()}


def latest_checkpoint(lake: Lake | str | Path, *, storage_options: StorageOptions | None = None) -> Path | None:
    """The complete checkpoint with the highest step, or None if there is none.

    On an object-store lake the chosen checkpoint is downloaded to a local temporary directory
    (so :func:`load_checkpoint` reads it like a local one) and that directory is returned.
    """
    if is_remote(lake):
        return _latest_remote(lake, storage_options)
    root = checkpoints_root(lake)
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for entry in root.iterdir():
        match = STEP_DIR.match(entry.name)
        if match and (entry / "meta.json").is_file() and (entry / "state.pt").is_file():
            step = int(match.group(1))
            if best is None or step > best[0]:
                best = (step, entry)
    return None if best is None else best[1]


def read_state(path: str | Path) -> TrainState:
    """The :class:`TrainState` of a checkpoint directory (meta.json only; cheap).

    Raises:
        FileNotFoundError: there is no ``meta.json``.
        gemline.errors.CheckpointError: ``meta.json`` is not JSON, or lacks a field or has one of another type.
    """
    file = Path(path) / "meta.json"
    text = file.read_text()
    try:
        meta = json.loads(text)
        state = TrainState(step=int(meta["step"]), examples_seen=int(meta["examples_seen"]),
                           examples_version=int(meta["examples_version"]), extra=meta["extra"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint file {file} is not a gemline checkpoint's meta.json ({type(exc).__name__}: "
                              f"{exc}): move its folder away, or start a new run with --from-scratch") from exc
    if not isinstance(state.extra, dict):
        raise CheckpointError(f"checkpoint file {file}: 'extra' is a {type(state.extra).__name__}, not an object: "
                              "move its folder away, or start a new run with --from-scratch")
    return state


_OPTIMIZER_SETTINGS = {"trainer.sparse_optim.RowWiseAdagrad": "rowwise_adagrad",
                       "torch.optim.adagrad.Adagrad": "adagrad"}
"""The table optimiser's saved type name -> the ``trainer.embedding_optimizer`` value that builds it."""


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizers: Mapping[str, torch.optim.Optimizer],
    *,
    numpy_rng: np.random.Generator | None = None,
) -> TrainState:
    """Restore model, optimisers and every RNG (torch, python, numpy global, ``numpy_rng``) in place.

    Raises:
        FileNotFoundError: ``path`` is not a complete checkpoint.
        ValueError: the optimiser names differ from the saved ones, or a saved state does not fit its optimiser
            (e.g. :class:`trainer.sparse_optim.RowWiseAdagrad` given per-element Adagrad sums).
        gemline.errors.BadConfigError: (a ValueError) an optimiser of another class than the saved one
            (e.g. another ``trainer.embedding_optimizer``).
        gemline.errors.CheckpointError: (a ValueError) ``state.pt`` or ``meta.json`` does not load safely
            (:func:`safe_load`).
        RuntimeError: the model's parameters do not match the saved state dict (torch's message).
    """
    path = Path(path)
    if not (path / "meta.json").is_file() or not (path / "state.pt").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (needs state.pt and meta.json)")
    payload = _load_state(path)
    if set(payload["optimizers"]) != set(optimizers):
        raise ValueError(
            f"checkpoint has optimisers {sorted(payload['optimizers'])}, got {sorted(optimizers)}; "
            "build the same optimisers as the run that saved it"
        )
    # Checkpoints before issue 19 name no types; RowWiseAdagrad checks the shapes of those itself.
    saved_types, built = payload.get("optimizer_types", {}), optimizer_types(optimizers)
    differ = {name: (saved, built[name]) for name, saved in saved_types.items() if saved != built[name]}
    if differ:
        named = "; ".join(f"{name!r}: saved by {saved}, this run builds {now}" for name, (saved, now) in differ.items())
        hint = next((f"--set trainer.embedding_optimizer={setting}" for cls, setting in _OPTIMIZER_SETTINGS.items()
                     if saved_types.get("embeddings") == cls), "the optimisers that wrote it")
        raise BadConfigError(
            f"checkpoint {path} was written with other optimisers ({named}): resume with {hint}, "
            "or start a new run with --from-scratch"
        )
    _load_model(path, model, payload["model"], payload.get("param_average_decays"))
    for name, opt in optimizers.items():
        opt.load_state_dict(payload["optimizers"][name])
    restore_rng_state(payload["rng"], numpy_rng)
    return read_state(path)


def rng_state() -> dict[str, Any]:
    """The RNG states a checkpoint saves (torch, python, numpy global; no generator): what :func:`restore_rng_state`
    takes, for a process that keeps a checkpoint's model in memory instead of loading it (trainer.continuous)."""
    return _rng_state(None)


def restore_rng_state(rng: dict[str, Any], numpy_rng: np.random.Generator | None = None) -> None:
    """Set every RNG (torch, python, numpy global, and ``numpy_rng`` when both it and a saved state are there) to
    ``rng``, as :func:`save_checkpoint` or :func:`rng_state` recorded them (numpy states as :func:`_plain` lists, or
    as the arrays of checkpoints written before)."""
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(_numpy(rng["numpy_global"]))
    if numpy_rng is not None and rng["numpy_generator"] is not None:
        numpy_rng.bit_generator.state = _numpy(rng["numpy_generator"])


def load_weights(path: str | Path, model: nn.Module) -> TrainState:
    """Restore only the model parameters of the checkpoint at ``path`` (no optimiser or RNG state).

    For checkpoints that hold no optimiser state: those a sharded run writes
    (trainer.launch: full parameters gathered on rank 0, ``optimizers={}``).

    Raises:
        FileNotFoundError: ``path`` is not a complete checkpoint.
        gemline.errors.CheckpointError: ``state.pt`` or ``meta.json`` does not load safely (:func:`safe_load`).
        RuntimeError: the model's parameters do not match the saved state dict (torch's message).
    """
    path = Path(path)
    if not (path / "meta.json").is_file() or not (path / "state.pt").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (needs state.pt and meta.json)")
    payload = _load_state(path)
    _load_model(path, model, payload["model"], payload.get("param_average_decays"))
    return read_state(path)


def param_average_decays(model: nn.Module) -> dict[str, float]:
    """The decay of each parameter average in ``model`` (:class:`trainer.ema.ParameterAverage`, e.g. GEM's
    ``param_average`` of ``trainer.gem.ema_decay``), by module name: a checkpoint records them, because a decay is an
    attribute, not a tensor of the state dict, and a refusal names it (:func:`_load_model`)."""
    from trainer.ema import ParameterAverage

    return {name: float(module.decay) for name, module in model.named_modules() if isinstance(module, ParameterAverage)}


def _decay_setting(decay: float | None) -> str:
    return "none" if decay is None else repr(decay)


def _load_model(path: Path, model: nn.Module, saved: Mapping[str, Any],
                saved_decays: Mapping[str, float] | None = None) -> None:
    """``model.load_state_dict(saved)``, refusing first, in one line, a checkpoint of another model shape
    (:func:`model_mismatch`). ``saved_decays``: the checkpoint's :func:`param_average_decays` (None for one written
    before they were recorded).

    Raises:
        gemline.errors.BadConfigError: parameter names differ (the first few of each side are named).
        RuntimeError: same names, other shapes (torch's message).
    """
    refusal = model_mismatch(path, set(model.state_dict()), set(saved), saved_decays, param_average_decays(model))
    if refusal is not None:
        raise refusal
    model.load_state_dict(saved)


def model_mismatch(path: str | Path, built: set[str], saved: set[str], saved_decays: Mapping[str, float] | None,
                   built_decays: Mapping[str, float]) -> BadConfigError | None:
    """The one-line refusal of a checkpoint at ``path`` whose state-dict names ``saved`` differ from those of this
    run's model, ``built`` (another ``trainer.model`` or GEM switch, e.g. a GEM checkpoint from before its wide part),
    naming the setting that resumes it where the names tell it; None when the names agree.

    ``saved_decays`` / ``built_decays``: :func:`param_average_decays` of the checkpoint (None for one written before
    they were recorded: its ``trainer.gem.ema_decay`` is then ``<its decay>``) and of this run's model.
    """
    missing, extra = sorted(built - saved), sorted(saved - built)
    if not missing and not extra:
        return None

    def few(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "") if names else "none"

    hint = (" (a GEM checkpoint from before its wide part resumes with --set trainer.gem.wide=false)"
            if any(".wide." in name for name in missing) else "")
    gate = {"dense_arch.deep_gate"}
    if gate & set(missing) or gate & set(extra):  # missing: written without the gate; extra: with it
        hint += f" (this GEM checkpoint resumes with --set trainer.gem.deep_gate={str(bool(gate & set(extra))).lower()})"
    match = {name for name in missing + extra if name.startswith("dense_arch.match_")}
    if match:  # missing: written without the target-match counts; extra: with them
        hint += f" (this GEM checkpoint resumes with --set trainer.gem.target_match={str(match <= set(extra)).lower()})"
    ema = {name for name in missing + extra if name.startswith("param_average.")}
    if ema:  # missing: written without the average; extra: with it (the decay itself is not checked)
        ours = _decay_setting(built_decays.get("param_average"))
        if ema <= set(missing):
            hint += (" (this GEM checkpoint was written with trainer.gem.ema_decay=none, this run has "
                     f"{ours}: it resumes with --set trainer.gem.ema_decay=none)")
        elif saved_decays is not None and "param_average" in saved_decays:
            theirs = _decay_setting(saved_decays["param_average"])
            hint += (f" (this GEM checkpoint was written with trainer.gem.ema_decay={theirs}, this run has "
                     f"{ours}: it resumes with --set trainer.gem.ema_decay={theirs})")
        else:  # written before the decays were recorded
            hint += " (this GEM checkpoint resumes with --set trainer.gem.ema_decay=<its decay>)"
    return BadConfigError(
        f"checkpoint {path} holds another model: this run's model has parameters the checkpoint lacks "
        f"({few(missing)}) and the checkpoint has parameters this model lacks ({few(extra)}); resume with the "
        f"settings that wrote it{hint}, or start a new run with --from-scratch"
    )


def _save_remote(lake: Lake | str | Path, state: TrainState, model: nn.Module, optimizers: Mapping[str, torch.optim.Optimizer],
                 numpy_rng: np.random.Generator | None, extra_files: Mapping[str, bytes] | None,
                 storage_options: StorageOptions | None) -> str:
    """Object-store twin of :func:`save_checkpoint`: build it locally, then upload, meta.json last."""
    fs, root = lake_fs(lake, storage_options)
    name = f"step-{state.step}"
    with tempfile.TemporaryDirectory(prefix="gemline-ckpt-") as local:
        built = Path(save_checkpoint(local, state, model, optimizers, numpy_rng=numpy_rng, extra_files=extra_files))
        target = f"{root}/{CHECKPOINTS_DIR}/{name}"
        # A replaced step loses meta.json first, so no reader sees old meta with new state.
        if fs.get_file_info(f"{target}/meta.json").type == pafs.FileType.File:
            fs.delete_file(f"{target}/meta.json")
        files = sorted(p.name for p in built.iterdir() if p.name != "meta.json") + ["meta.json"]
        for file in files:
            pafs.copy_files(str(built / file), f"{target}/{file}", source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=fs)
    return f"{str(lake).rstrip('/')}/{CHECKPOINTS_DIR}/{name}"


def _latest_remote(lake: Lake | str | Path, storage_options: StorageOptions | None) -> Path | None:
    """Download the highest complete ``step-N`` under ``LAKE/_checkpoints`` to a temp dir; None if none."""
    fs, root = lake_fs(lake, storage_options)
    base = f"{root}/{CHECKPOINTS_DIR}"
    infos = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True, recursive=True))
    files: dict[str, set[str]] = {}
    for info in infos:
        if info.is_file:
            step_dir, _, file = info.path[len(base) + 1:].partition("/")
            files.setdefault(step_dir, set()).add(file)
    steps = [(int(m.group(1)), d) for d in files if (m := STEP_DIR.match(d)) and {"meta.json", "state.pt"} <= files[d]]
    if not steps:
        return None
    _, step_dir = max(steps)
    local = Path(tempfile.mkdtemp(prefix="gemline-ckpt-")) / step_dir
    local.mkdir()
    for file in sorted(files[step_dir]):
        pafs.copy_files(f"{base}/{step_dir}/{file}", str(local / file), source_filesystem=fs,
                        destination_filesystem=pafs.LocalFileSystem())
    return local
