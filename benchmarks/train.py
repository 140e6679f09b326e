"""Training throughput on CPU: GEM against DLRM with the same embedding size, in one run.

``python -m benchmarks.train [--batch B] [--steps N] [--warmup W] [--max-len L] [--dim D] [--threads T]
[--embedding-optimizers rowwise_adagrad,adagrad] [--models gem,dlrm]``

Batches are synthetic but shaped like the examples table: S sparse ids per example, three aligned
history keys with lengths uniform in [0, L], F dense features, three domains. Each model runs W
warm-up steps, then N timed steps of forward + backward + optimiser (the trainer's own,
trainer.loop.local_optimizers: Adam dense, ``trainer.embedding_optimizer`` on the tables' sparse
gradients). Reported per model and embedding optimiser: median step time (ms) and training
examples/s; the last line is the GEM / DLRM throughput ratio (of the first optimiser).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import numpy as np
import torch
from torchrec import KeyedJaggedTensor
from tqdm import tqdm

from sequences.schema import SPARSE_FEATURES
from trainer.config import TrainerConfig
from trainer.data import SEQUENCE_KEYS, Batch
from trainer.loop import local_optimizers
from trainer.models import build_model
from trainer.train import train_step

DOMAINS = ("feed", "reels", "marketplace")


def synthetic_batch(batch: int, max_len: int, num_dense: int, num_embeddings: int, rng: np.random.Generator) -> Batch:
    """A :class:`trainer.data.Batch` of random ids, lengths uniform in [0, max_len], random 0/1 labels."""
    lengths = rng.integers(0, max_len + 1, batch)
    total = int(lengths.sum())
    sparse = KeyedJaggedTensor(
        keys=list(SPARSE_FEATURES),
        values=torch.from_numpy(rng.integers(1, num_embeddings, len(SPARSE_FEATURES) * batch)),
        lengths=torch.ones(len(SPARSE_FEATURES) * batch, dtype=torch.int64),
    )
    sequence = KeyedJaggedTensor(
        keys=list(SEQUENCE_KEYS),
        values=torch.from_numpy(rng.integers(1, num_embeddings, len(SEQUENCE_KEYS) * total)),
        lengths=torch.from_numpy(np.tile(lengths, len(SEQUENCE_KEYS))),
    )
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
