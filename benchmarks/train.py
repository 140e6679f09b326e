"""Training throughput on CPU: GEM against DLRM with the same embedding size, in one run.

``python -m benchmarks.train [--batch B] [--steps N] [--warmup W] [--max-len L] [--dim D] [--threads T]
[--embedding-optimizers rowwise_adagrad,adagrad] [--models gem,dlrm]``

Batches are synthetic but shaped like the examples table: S sparse ids per example, three aligned
history keys with lengths uniform in [0, L], F dense features, three domains. Each model runs W
warm-up steps, then N timed steps of forward + backward + optimiser (the trainer's own,
trainer.loop.local_optimizers: Adam dense, ``trainer.embedding_optimizer`` on the tables' sparse
gradients). Reported per model and embedding optimiser: median step time (ms) and training
examples/s; the last line is the GEM / DLRM throughput ratio (of the first optimiser).

:func:`train_throughput` is the device benchmark's training run (``benchmarks.gpu``): N steps of a GEM preset (or
DLRM) on a device, at a precision, optionally compiled, through the trainer's own path (batches prepared one ahead,
trainer.loop); it returns examples/s and peak memory.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchrec import KeyedJaggedTensor
from tqdm import tqdm

from sequences.schema import SPARSE_FEATURES
from trainer.config import GemConfig, PrecisionName, TrainerConfig
from trainer.data import SAME_DOMAIN_KEYS, SEQUENCE_EXTRA_KEYS, SEQUENCE_KEYS, Batch
from trainer.loop import local_engine, local_optimizers, prepare_batch
from trainer.models import build_model
from trainer.prefetch import Prefetcher
from trainer.train import train_step

DOMAINS = ("feed", "reels", "marketplace")


def synthetic_batch(batch: int, max_len: int, num_dense: int, num_embeddings: int, rng: np.random.Generator, *,
                    extras: bool = False) -> Batch:
    """A :class:`trainer.data.Batch` of random ids, lengths uniform in [0, max_len], random 0/1 labels; with
    ``extras`` also the SEQUENCE_EXTRA_KEYS (time buckets in [0, 27], a same-domain history of half the length)."""
    lengths = rng.integers(0, max_len + 1, batch)
    total = int(lengths.sum())
    sparse = KeyedJaggedTensor(
        keys=list(SPARSE_FEATURES),
        values=torch.from_numpy(rng.integers(1, num_embeddings, len(SPARSE_FEATURES) * batch)),
        lengths=torch.ones(len(SPARSE_FEATURES) * batch, dtype=torch.int64),
    )
    keys, values, all_lengths = list(SEQUENCE_KEYS), [rng.integers(1, num_embeddings, len(SEQUENCE_KEYS) * total)], [
        np.tile(lengths, len(SEQUENCE_KEYS))]
    if extras:
        same = lengths // 2
        keys += SEQUENCE_EXTRA_KEYS
        values += [rng.integers(0, 28, total), rng.integers(1, num_embeddings, (len(SAME_DOMAIN_KEYS) - 1) * int(same.sum())),
                   rng.integers(0, 28, int(same.sum()))]
        all_lengths += [lengths, np.tile(same, len(SAME_DOMAIN_KEYS))]
    sequence = KeyedJaggedTensor(keys=keys, values=torch.from_numpy(np.concatenate(values)),
                                 lengths=torch.from_numpy(np.concatenate(all_lengths)))
    return Batch(
        sparse=sparse,
        sequence=sequence,
        dense=torch.from_numpy(rng.standard_normal((batch, num_dense)).astype(np.float32)),
        labels=torch.from_numpy((rng.random((batch, 2)) < 0.3).astype(np.float32)),
        domains=[DOMAINS[i % len(DOMAINS)] for i in range(batch)],
    )


def examples_per_second(config: TrainerConfig, batches: list[Batch], warmup: int, num_dense: int) -> tuple[float, float]:
    """(median step ms, examples/s) of ``config.model`` over ``batches`` after ``warmup`` steps."""
    torch.manual_seed(config.seed)
    model = build_model(config, num_dense, DOMAINS)
    optimizers = local_optimizers(config, model)
    times = []
    for i, batch in enumerate(tqdm(batches, desc=config.model, unit="step")):
        start = time.perf_counter()
        train_step(model, optimizers, batch)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return median * 1e3, len(batches[0].domains) / median


def peak_memory_bytes(device: torch.device) -> tuple[int | None, str]:
    """(bytes, what they are): ``torch.cuda.max_memory_allocated`` on CUDA (tensors, since the last reset); on the
    CPU the process's resident high-water mark (VmHWM of /proc/self/status: everything since the process started,
    Python and libraries included), None where there is no /proc."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_memory_allocated"
    status = Path("/proc/self/status")
    if not status.exists():
        return None, "vm_hwm"
    for line in status.read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024, "vm_hwm"  # the kernel reports kB
    return None, "vm_hwm"


def train_throughput(device: str, preset: str, steps: int, batch_size: int, precision: PrecisionName = "fp32",
                     compile: bool = False, *, max_len: int = 256, warmup: int = 3, num_dense: int = 8,
                     embedding_dim: int = 64, num_embeddings: int = 100_003, seed: int = 0) -> dict[str, Any]:
    """Train ``steps`` steps (after ``warmup`` more, untimed: compilation, allocator warm-up) of ``preset`` on
    ``device`` with synthetic batches, through the trainer's path: :func:`trainer.loop.local_engine` (its model on
    the device, Adam + Adagrad, ``compile``, ``precision``) and batches prepared one ahead on a background thread
    (:func:`trainer.loop.prepare_batch`: checked, pinned on CUDA, copied ``non_blocking``).

    Args:
        device: ``cpu``, ``cuda`` or ``cuda:N`` (``trainer.device``).
        preset: a GEM preset (gem_small, gem_cpu, gem; trainer.config.GEM_PRESETS) or ``dlrm``.
        steps, batch_size: timed steps of ``batch_size`` examples.
        max_len: histories uniform in [0, max_len] tokens (the build stores 256 by default).

    Returns:
        ``examples_per_s`` (timed examples / ``timed_s``, the wall seconds of the timed steps, the device synchronised
        by each step's loss read),
        ``step_ms_median``, ``peak_memory_bytes`` and ``memory_kind`` (:func:`peak_memory_bytes`), ``final_loss``,
        and the arguments.

    Raises:
        gemline.errors.BadConfigError: a bad device (no CUDA here), preset or precision.
    """
    model = "dlrm" if preset == "dlrm" else "gem"
    tc = TrainerConfig(model=model, gem=GemConfig(preset="gem_small" if model == "dlrm" else preset),  # type: ignore[arg-type]
                       device=device, precision=precision, compile=compile, batch_size=batch_size, seed=seed,
                       embedding_dim=embedding_dim, num_embeddings=num_embeddings)
    torch.manual_seed(seed)
    engine = local_engine(tc, num_dense, DOMAINS, None)
    target = torch.device(device)
    rng = np.random.default_rng(seed)
    extras = tc.reads_sequence_extras
    count = warmup + steps
    host = (synthetic_batch(batch_size, max_len, num_dense, num_embeddings, rng, extras=extras) for _ in range(count))
    times, losses = [], []
    if target.type == "cuda":
        torch.cuda.reset_peak_memory_stats(target)
    with Prefetcher(host, lambda b: prepare_batch(engine.model, b, target)) as ready:
        start = time.perf_counter()
        for i, (_, prepared) in enumerate(ready):
            loss = engine.train_prepared(prepared)  # reads the loss back: the step has finished on the device
            now = time.perf_counter()
            if i >= warmup:
                times.append(now - start)
            losses.append(loss)
            start = now
    memory, kind = peak_memory_bytes(target)
    return {"device": device, "preset": preset, "precision": precision, "compile": compile, "batch_size": batch_size,
            "steps": steps, "max_len": max_len, "timed_s": sum(times), "examples_per_s": batch_size * len(times) / sum(times),
            "step_ms_median": 1e3 * statistics.median(times), "peak_memory_bytes": memory, "memory_kind": kind,
            "final_loss": losses[-1]}


def main(argv: list[str] | None = None) -> None:
    """Parse flags, time GEM and DLRM, print a table and the ratio last."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-len", type=int, default=128, help="longest history (tokens)")
    parser.add_argument("--dim", type=int, default=16, help="embedding dim D of both models")
    parser.add_argument("--dense", type=int, default=8, help="dense features F")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--embedding-optimizers", default="rowwise_adagrad",
                        help="comma-separated trainer.embedding_optimizer values, each timed on the same batches")
    parser.add_argument("--models", default="gem,dlrm", help="comma-separated trainer.model values")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = TrainerConfig(embedding_dim=args.dim, num_embeddings=100_003, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    batches = [synthetic_batch(args.batch, args.max_len, args.dense, base.num_embeddings, rng) for _ in range(args.warmup + args.steps)]
    optimizers, models = args.embedding_optimizers.split(","), args.models.split(",")
    results = {(m, o): examples_per_second(replace(base, model=m, embedding_optimizer=o), batches, args.warmup, args.dense)
               for m in models for o in optimizers}
    print(f"batch={args.batch} max_len={args.max_len} D={args.dim} threads={args.threads} steps={args.steps}")
    for (model, optimizer), (ms, eps) in results.items():
        print(f"{model:5s} {optimizer:16s} {ms:9.1f} ms/step {eps:10.0f} examples/s")
    if {"gem", "dlrm"} <= set(models):
        print(f"GEM/DLRM throughput ratio: {results['gem', optimizers[0]][1] / results['dlrm', optimizers[0]][1]:.3f}")


if __name__ == "__main__":
    main()
