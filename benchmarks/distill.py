"""CPU inference throughput: the per-domain students (trainer.students) against the teacher (GEM, DLRM).

``python -m benchmarks.distill [--batch B] [--batches N] [--max-len L] [--threads T]``

Batches are synthetic, shaped like the examples table (benchmarks.train.synthetic_batch). Each model predicts N
batches under ``torch.no_grad`` after 3 warm-up batches; reported: examples/s (median over batches) and the
ratio to GEM. A student reads the sparse ids and dense features (and, the representation variant, the teacher's
vectors, zeros here: their lookup is a join, not model time).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from benchmarks.train import DOMAINS, synthetic_batch
from sequences.schema import SPARSE_FEATURES
from trainer.config import TrainerConfig
from trainer.data import Batch
from trainer.loop import domain_ids
from trainer.models import build_model
from trainer.students import VARIANTS, DistillConfig, Student, TeacherInputs


def _throughput(run: Callable[[Batch], object], batches: list[Batch]) -> float:
    """Median examples/s of ``run`` over ``batches`` (after 3 warm-up calls)."""
    with torch.no_grad():
        for batch in batches[:3]:
            run(batch)
        rates = []
        for batch in batches[3:]:
            start = time.perf_counter()
            run(batch)
            rates.append(batch.batch_size / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    """Print one line per model: examples/s and the ratio to GEM."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--max-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tc, dc = TrainerConfig(), DistillConfig()
    rng = np.random.default_rng(0)
    num_dense = 8
    batches = [synthetic_batch(args.batch, args.max_len, num_dense, tc.num_embeddings, rng) for _ in range(args.batches + 3)]
    rates = {}
    for model_name in ("gem", "dlrm"):
        torch.manual_seed(0)
        model = build_model(TrainerConfig(model=model_name), num_dense, DOMAINS).eval()

        def teacher(b: Batch, m: torch.nn.Module = model) -> object:
            return m(b.sparse, b.sequence, b.dense, domain_ids(m, b))

        rates[f"teacher {model_name}"] = _throughput(teacher, batches)
    dim, hidden = tc.embedding_dim, tc.hidden_dims[-1]
    for variant in VARIANTS:
        torch.manual_seed(0)
        student = Student(variant=variant, num_embeddings=dc.num_embeddings, dim=dim, num_dense=num_dense,
                          teacher_width=2 * dim + hidden, hidden_dims=dc.hidden_dims).eval()

        def run(b: Batch, s: Student = student) -> object:
            ids = b.sparse.values().view(len(SPARSE_FEATURES), -1).T % dc.num_embeddings
            teacher = TeacherInputs(torch.zeros(b.batch_size, 2), torch.zeros(b.batch_size, dtype=torch.bool),
                                    torch.zeros(b.batch_size, 2 * dim + hidden))
            return s(ids, b.dense, teacher)

        rates[f"student {variant}"] = _throughput(run, batches)
    for name, rate in rates.items():
        print(f"{name:24s} {rate:12,.0f} examples/s   x{rate / rates['teacher gem']:.1f} of GEM")


if __name__ == "__main__":
    main()
