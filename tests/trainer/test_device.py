"""Issue 19 items 1-2 on the CPU: trainer.device and trainer.precision, batches moved whole and prefetched one step
ahead, no tensor of a forward made on an implicit device, bf16 autocast, the dense part traced without graph breaks,
and the device benchmark's training run."""

from __future__ import annotations

import threading
import traceback
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from gemline.errors import BadConfigError
from trainer.config import GemConfig, TrainerConfig
from trainer.data import encode_examples, fit_normalizer, make_batch
from trainer.loop import DeviceBatch, GlobalBatch, Progress, forward, local_engine, prepare_batch, train_loop
from trainer.models import build_model
from trainer.prefetch import Prefetcher

from .conftest import synthetic_examples, with_build_columns

DOMAINS = ("feed", "marketplace", "reels")
TINY = TrainerConfig(embedding_dim=8, num_embeddings=97, hidden_dims=(16, 8), tower_hidden=4, batch_size=16,
                     gem=GemConfig(preset="gem_cpu", fm_outputs=2, lcb_outputs=2, fm_rank=2, max_sequence_len=8))
"""gem_cpu's shape (branches, both streams, Cross Arch, task towers) at toy widths."""

REPO = str(Path(__file__).resolve().parents[2])


@pytest.fixture(scope="module")
def data():
    table = with_build_columns(synthetic_examples(["2026-01-01"], 48, seed=3))
    return encode_examples(table, TINY.num_embeddings, fit_normalizer(table), sequence_extras=True)


# -- trainer.device / trainer.precision ------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "cpu:0", "CUDA", ""])
def test_device_names_other_than_cpu_cuda_and_cuda_n_are_refused(device):
    with pytest.raises(BadConfigError, match=r"trainer.device must be 'cpu', 'cuda' or 'cuda:N'"):
        TrainerConfig(device=device)


def test_cuda_is_refused_where_torch_sees_no_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0"):
        with pytest.raises(BadConfigError, match=rf"trainer.device='{device}' but torch sees no CUDA device"):
            TrainerConfig(device=device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert TrainerConfig(device="cuda:1").device == "cuda:1"
    with pytest.raises(BadConfigError, match=r"'cuda:2' but this machine has 2 CUDA device"):
        TrainerConfig(device="cuda:2")


def test_precision_is_fp32_or_bf16():
    assert TrainerConfig().precision == "fp32" and TrainerConfig(precision="bf16").precision == "bf16"
    with pytest.raises(BadConfigError, match="trainer.precision must be one of"):
        TrainerConfig(precision="fp16")  # type: ignore[arg-type]


# -- batches: moved whole, checked on the host ----------------------------------------------------------------


def _tensors(batch) -> list[torch.Tensor]:
    out = [batch.sparse.values(), batch.sparse.lengths(), batch.sequence.values(), batch.sequence.lengths(),
           batch.dense, batch.labels]
    out += [] if batch.final is None else [batch.final]
    out += [] if batch.delayed is None else [batch.delayed.scheme, batch.delayed.mask, batch.delayed.biased, batch.delayed.share]
    return out


def test_batch_to_moves_every_tensor_and_keeps_the_keys_lengths_on_the_host(data):
    from trainer.delayed import DelayedBatch

    batch = make_batch(data, np.arange(10))
    batch = replace(batch, final=torch.ones(10, 2, dtype=torch.bool),
                    delayed=DelayedBatch(torch.zeros(10, dtype=torch.int64), torch.ones(10, 2, dtype=torch.bool),
                                         torch.zeros(10, 2, dtype=torch.bool), torch.ones(10, 2)))
    moved = batch.to("meta")  # a device without data: anything left behind would still be on the CPU
    assert len(_tensors(moved)) == 11 and all(t.device.type == "meta" for t in _tensors(moved))
    assert moved.domains == batch.domains and moved.sequence.keys() == batch.sequence.keys()
    # The per-key lengths were read on the host before the move: reading a key needs no device value.
    assert moved.sequence.length_per_key() == batch.sequence.length_per_key()
    assert moved.sequence.stride() == 10
    back = batch.to("cpu")
    assert all(torch.equal(a, b) for a, b in zip(_tensors(back), _tensors(batch), strict=True))


def test_prepare_batch_checks_on_the_host_before_the_copy(data):
    model = build_model(replace(TINY, model="dlrm"), data.dense.shape[1], DOMAINS)
    batch = make_batch(data, np.arange(6))
    prepared = prepare_batch(model, batch)
    assert prepared.domain_ids.tolist() == [DOMAINS.index(d) for d in batch.domains]
    bad = replace(batch, dense=batch.dense[:, :1])
    with pytest.raises(ValueError, match=r"dense must be \(6, 3\) float32"):
        prepare_batch(model, bad, "meta")
    negative = make_batch(data, np.arange(6))
    negative.sequence.lengths()[0] = -1
    with pytest.raises(ValueError, match="sequence lengths must be >= 0"):
        prepare_batch(model, negative)


# -- the prefetcher ----------------------------------------------------------------------------------------------


def test_prefetcher_keeps_order_runs_one_ahead_and_prepares_on_another_thread():
    drawn: list[int] = []
    threads: set[str] = set()

    def items():
        for i in range(6):
            drawn.append(i)
            yield i

    def prepare(i):
        threads.add(threading.current_thread().name)
        return i * i

    seen = []
    with Prefetcher(items(), prepare, depth=1) as ready:
        for item, prepared in ready:
            seen.append((item, prepared))
            # While the consumer holds item i the producer may have drawn i + 1, never i + 2.
            assert max(drawn) <= item + 1
    assert seen == [(i, i * i) for i in range(6)] and drawn == list(range(6))
    assert threads == {"batch-prefetch"}
    inline = list(Prefetcher(range(6), lambda i: i * i, depth=0))
    assert inline == seen


@pytest.mark.parametrize("where", ["items", "prepare"])
def test_prefetcher_reraises_an_error_at_its_place(where):
    def items():
        yield from range(3)
        if where == "items":
            raise KeyError("read failed")
        yield 3

    def prepare(i):
        if where == "prepare" and i == 3:
            raise KeyError("read failed")
        return i

    got = []
    with pytest.raises(KeyError, match="read failed") as caught:
        for item, _ in Prefetcher(items(), prepare):
            got.append(item)
    assert got == [0, 1, 2]
    frames = [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert ("items" if where == "items" else "prepare") in frames  # the producer's traceback travels with it


def test_prefetcher_stops_its_thread_and_closes_the_items_when_the_consumer_stops():
    closed = threading.Event()

    def items():
        try:
            yield from range(1000)
        finally:
            closed.set()

    prefetcher = Prefetcher(items(), lambda i: i, depth=2)
    with pytest.raises(RuntimeError, match="step failed"), prefetcher as ready:
        for item, _ in ready:
            if item == 4:
                raise RuntimeError("step failed")
    assert closed.is_set() and prefetcher._thread is not None and not prefetcher._thread.is_alive()
    with pytest.raises(ValueError, match="depth must be >= 0"):
        Prefetcher([], lambda i: i, depth=-1)


def test_train_loop_trains_the_same_with_and_without_prefetching(data):
    tc = replace(TINY, model="dlrm")
    results = []
    for depth in (0, 1):
        torch.manual_seed(0)
        engine = local_engine(tc, data.dense.shape[1], DOMAINS, None)
        progress = Progress()
        train_loop(engine, progress, [GlobalBatch(data, np.arange(i, i + 16), i) for i in (0, 16, 32)], prefetch=depth)
        results.append((progress.losses, engine.model.state_dict()))
    (losses0, state0), (losses1, state1) = results
    assert losses0 == losses1 and len(losses0) == 3
    assert all(torch.equal(state0[k], state1[k]) for k in state0)


# -- tensors made in a forward ------------------------------------------------------------------------------------

_FACTORIES = {torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.tensor, torch.as_tensor,
              torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye, torch.triu_indices, torch.zeros_like}


class _ImplicitDevice(TorchFunctionMode):
    """Records factory calls made directly by this repository's code (trainer/, kernels/) that name no device: on
    CUDA they would make a CPU tensor inside a forward (``*_like`` and ``Tensor.new_*`` follow their input and are
    fine; TorchRec's own calls are TorchRec's)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and func is not torch.zeros_like and "device" not in kwargs:
            caller = traceback.extract_stack(limit=2)[0]  # the frame that called the factory
            ours = caller.filename.startswith(REPO) and not any(
                part in caller.filename for part in ("/tests/", "/site-packages/"))  # a venv may sit inside the repo
            if ours:
                self.calls.append(f"{func.__name__} at {Path(caller.filename).name}:{caller.lineno}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("name", ["gem", "gem_small", "dlrm", "lr", "ranker"])
def test_no_tensor_of_a_forward_and_its_loss_is_made_on_an_implicit_device(name, data):
    tc = replace(TINY, model="gem" if name.startswith("gem") else name,
                 gem=replace(TINY.gem, preset="gem_small") if name == "gem_small" else TINY.gem)
    torch.manual_seed(0)
    engine = local_engine(tc, data.dense.shape[1], DOMAINS, None)
    prepared = engine.prepare(data, np.arange(16))  # the host side: built, checked, then moved
    with _ImplicitDevice() as mode:
        loss = engine.train_prepared(prepared)
    assert loss is not None and np.isfinite(loss)
    assert mode.calls == []


# -- bf16 autocast -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gem", "dlrm"])
def test_a_bf16_step_runs_the_dense_part_in_bf16_and_its_loss_is_close_to_fp32s(name, data):
    tc = replace(TINY, model=name)
    engines = {}
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        engines[precision] = local_engine(replace(tc, precision=precision), data.dense.shape[1], DOMAINS, None)
    out_dtypes = set()
    linears = [m for m in engines["bf16"].model.dense_arch.modules() if isinstance(m, torch.nn.Linear)]
    hooks = [m.register_forward_hook(lambda _m, _i, out: out_dtypes.add(out.dtype)) for m in linears]
    batch = make_batch(data, np.arange(32))
    losses = {p: engine.train_step(data, np.arange(32)) for p, engine in engines.items()}
    for hook in hooks:
        hook.remove()
    assert out_dtypes == {torch.bfloat16}
    # bf16 keeps 8 mantissa bits (relative error ~4e-3 per product): the losses agree to about that.
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)
    model = engines["bf16"].model
    assert all(p.dtype == torch.float32 for p in model.parameters())
    tables = model.embedding_parameters()
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in tables)
    assert forward(model, prepare_batch(model, batch), "bf16").dtype == torch.float32
    # The dense gradients point the same way (the first Adam and Adagrad steps are about lr * sign(g), so the
    # parameters after one step would differ wherever a tiny gradient changed sign: compare gradients).
    grads = {p: torch.cat([q.grad.flatten() for q in e.model.dense_parameters() if q.grad is not None])
             for p, e in engines.items()}
    assert torch.nn.functional.cosine_similarity(grads["bf16"], grads["fp32"], dim=0) > 0.99


# -- torch.compile: no graph breaks in the dense part ------------------------------------------------------------


def _dense_inputs(model, data, rows) -> tuple:
    """The arguments ``model.dense_arch`` gets for ``rows`` (the lookups run eagerly, as when compiled)."""
    from sequences.schema import SPARSE_FEATURES
    from trainer.data import SEQUENCE_KEYS
    from trainer.models.towers import merge_sequence_kjt, pad_width

    prepared: DeviceBatch = prepare_batch(model, make_batch(data, rows))
    batch, ids = prepared.batch, prepared.domain_ids
    if hasattr(model.sparse_arch, "keys"):  # GEM
        found = model.sparse_arch(batch.sparse, batch.sequence)
        return (found.pooled, found.values, found.offsets, found.target, batch.dense, ids, found.same_values,
                found.same_offsets, found.history_means, found.wide, found.matches)
    kt = model.sparse_arch(merge_sequence_kjt(batch.sparse, batch.sequence))
    pooled = torch.stack([pad_width(kt[k], model.dim) for k in (*SPARSE_FEATURES, *SEQUENCE_KEYS)], dim=1)
    return pooled, batch.dense, ids


@pytest.mark.parametrize("name", ["gem", "gem_small", "dlrm"])
def test_the_dense_part_traces_as_one_graph(name, data):
    import torch._dynamo

    from trainer.distributed import capture_data_dependent_sizes

    # One layer has every op of the stack; a 4-token branch self-attends (with CLS tokens), the whole one is pooled.
    gem = replace(TINY.gem, layers=1, recency_branches=(4, 0), attention_len=4)
    tc = replace(TINY, model="gem" if name.startswith("gem") else name,
                 gem=replace(gem, preset="gem_small", recency_branches=(), attention_len=None) if name == "gem_small" else gem)
    torch.manual_seed(0)
    model = build_model(tc, data.dense.shape[1], DOMAINS)
    # Rows with empty histories and rows longer than the 8-token window, so every branch has data-dependent sizes.
    lengths = np.diff(data.seq_offsets)
    rows = np.concatenate([np.flatnonzero(lengths == 0)[:2], np.flatnonzero(lengths >= 4)[:4]])
    assert len(rows) == 6
    capture_data_dependent_sizes()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model.dense_arch)(*_dense_inputs(model, data, rows))
    reasons = [reason.reason.splitlines()[0] for reason in explained.break_reasons]
    assert (explained.graph_count, explained.graph_break_count, reasons) == (1, 0, [])


def test_one_process_compile_compiles_the_dense_part_and_trains_as_eager(data, monkeypatch):
    # aot_eager: dynamo's graph and AOTAutograd's backward, without inductor's code generation (minutes on this
    # CPU; tests/trainer/test_distributed.py compiles the ranker with inductor).
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_module(self, backend="aot_eager"))
    tc = replace(TINY, model="dlrm")
    torch.manual_seed(0)
    eager = local_engine(tc, data.dense.shape[1], DOMAINS, None)
    torch.manual_seed(0)
    compiled = local_engine(replace(tc, compile=True), data.dense.shape[1], DOMAINS, None)
    assert compiled.model.dense_arch._compiled_call_impl is not None and eager.model.dense_arch._compiled_call_impl is None
    for rows in (np.arange(0, 16), np.arange(16, 27)):  # a second batch size: the graph is reused dynamically
        assert compiled.train_step(data, rows) == pytest.approx(eager.train_step(data, rows), rel=1e-5)
    for key, value in compiled.model.state_dict().items():
        torch.testing.assert_close(value, eager.model.state_dict()[key], rtol=1e-4, atol=1e-5, msg=key)


def test_teacher_vectors_are_captured_from_a_compiled_dense_part_as_from_eager(data, monkeypatch):
    """trainer.teacher_log hooks the towers inside the compiled dense part; traced, its copy to numpy failed dynamo's
    guards on the first prediction (2026-12-04). aot_eager as above; the hook runs eagerly either way."""
    from trainer.teacher_log import VectorCapture

    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_module(self, backend="aot_eager"))
    captured = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        engine = local_engine(replace(TINY, model="dlrm", compile=compiled), data.dense.shape[1], DOMAINS, None)
        capture = VectorCapture()
        with capture.recording(engine.model):
            probs = engine.predict(data, 16)
        captured[compiled] = (probs, capture.vectors(len(data)))
    (eager_probs, eager), (compiled_probs, got) = captured[False], captured[True]
    np.testing.assert_allclose(compiled_probs, eager_probs, rtol=1e-5, atol=1e-6)
    assert set(got) == {"user_vector", "candidate_vector", "representation"}
    assert all(v is not None for v in got["representation"])  # the towers' input, read inside the compiled part
    for key in got:
        assert len(got[key]) == len(data) and [v is None for v in got[key]] == [v is None for v in eager[key]]
        present = [i for i, v in enumerate(eager[key]) if v is not None]
        if present:
            np.testing.assert_allclose(np.stack([got[key][i] for i in present]),
                                       np.stack([eager[key][i] for i in present]), rtol=1e-5, atol=1e-6)


# -- the device benchmark's training run --------------------------------------------------------------------------


def test_train_throughput_reports_examples_per_second_and_peak_memory():
    from benchmarks.train import train_throughput

    out = train_throughput("cpu", "gem_cpu", steps=2, batch_size=8, warmup=1, max_len=12, embedding_dim=8,
                           num_embeddings=101)
    assert (out["steps"], out["batch_size"], out["memory_kind"]) == (2, 8, "vm_hwm")
    assert out["examples_per_s"] > 0 and np.isfinite(out["final_loss"])
    assert out["examples_per_s"] == pytest.approx(2 * 8 / out["timed_s"])
    assert 0 < out["step_ms_median"] / 1e3 <= out["timed_s"]
    assert out["peak_memory_bytes"] > 50 * 2**20  # torch alone keeps more resident than that


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_step_matches_the_cpu_step(data):
    tc = replace(TINY, model="gem")
    losses, states = {}, {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        engine = local_engine(replace(tc, device=device), data.dense.shape[1], DOMAINS, None)
        assert all(p.device.type == device for p in engine.model.parameters())
        losses[device] = engine.train_step(data, np.arange(32))
        states[device] = {k: v.cpu() for k, v in engine.model.state_dict().items()}
    assert losses["cuda"] == pytest.approx(losses["cpu"], rel=1e-4)
    for key, value in states["cuda"].items():
        torch.testing.assert_close(value, states["cpu"][key], rtol=1e-3, atol=1e-4, msg=key)


def test_the_launcher_checks_its_cuda_devices_with_check_device(monkeypatch):
    """One CUDA test, one message: ``trainer.launch.check_local_devices`` is ``check_device`` for its key."""
    from trainer.config import DistributedConfig
    from trainer.launch import check_local_devices

    tc = TrainerConfig(distributed=DistributedConfig(device="cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BadConfigError) as error:
        check_local_devices(tc, 2)
    assert str(error.value) == (f"trainer.distributed.device='cuda' but torch sees no CUDA device here "
                                f"(torch {torch.__version__}); use trainer.distributed.device=cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_local_devices(tc, 1)
    with pytest.raises(BadConfigError) as error:
        check_local_devices(tc, 2)
    assert str(error.value) == ("trainer.distributed.device='cuda' puts each of the 2 processes on its own CUDA device, "
                                "but this machine has 1 CUDA device(s); use --nproc 1 or trainer.distributed.device=cpu")
    check_local_devices(TrainerConfig(), 8)  # cpu: nothing to count
