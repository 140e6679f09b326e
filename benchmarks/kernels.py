"""Benchmark the jagged kernels against padded PyTorch and fbgemm jagged ops.

``python -m benchmarks.kernels [--batch B] [--max-len L] [--sparsity S] ...``

Row lengths are drawn uniformly from [0, 2 * (1 - S) * L] clipped to L, so S is the
expected fraction of padding a padded layout would carry. For each op every
implementation runs in this process: the padded PyTorch baseline (masked ops,
``scaled_dot_product_attention`` with a boolean mask), the jagged reference, fbgemm
(``torch.ops.fbgemm.*`` after ``import fbgemm_gpu``) where it has the op, and the
Triton twin only on CUDA. Reported: median wall time over --repeats (ms), achieved
bandwidth (GB/s of the jagged input + output bytes) or FLOP/s (useful, unpadded
attention FLOPs), and finally the speed ratio of each implementation to the padded
baseline. The GPU grid of interest is B=256, L in 1024..8192, S in 0.5..0.95, bf16/fp32.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from kernels.causal_attention import causal_attention
from kernels.padding import jagged_to_padded
from kernels.pooling import segment_sum
from kernels.softmax import jagged_softmax
from kernels.target_attention import target_attention
from kernels.types import Jagged


@dataclass(frozen=True)
class Result:
    """One timed implementation of one op."""

    op: str
    impl: str
    median_ms: float
    rate: float
    """GB/s for memory-bound ops, GFLOP/s for attention."""
    unit: str


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall time of fn() in ms after one warm-up call."""
    fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def draw_lengths(batch: int, max_len: int, sparsity: float, seed: int) -> torch.Tensor:
    """(B,) int64 lengths with expected mean (1 - sparsity) * max_len."""
    gen = torch.Generator().manual_seed(seed)
    top = max(1, round(2 * (1 - sparsity) * max_len))
    return torch.randint(0, top + 1, (batch,), generator=gen).clamp(max=max_len)


def _fbgemm():
    try:
        import fbgemm_gpu  # noqa: F401  registers torch.ops.fbgemm
    except ImportError as exc:  # the benchmark still runs, but says so
        print(f"fbgemm_gpu unavailable ({exc}); skipping fbgemm rows")
        return None
    return torch.ops.fbgemm


def bench_all(args: argparse.Namespace) -> list[Result]:
    """Time every op/implementation pair for the flags in args."""
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    lengths = draw_lengths(args.batch, args.max_len, args.sparsity, args.seed)
    tokens = int(lengths.sum())
    gen = torch.Generator().manual_seed(args.seed)
    rnd = lambda *shape: torch.randn(shape, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    x = Jagged.from_lengths(rnd(tokens, args.dim), lengths.to(device))
    heads, head_dim, L = args.heads, args.head_dim, args.max_len
    qkv = [Jagged.from_lengths(rnd(tokens, heads, head_dim), lengths.to(device)) for _ in range(3)]
    query = rnd(args.batch, heads, head_dim)
    mask = torch.arange(L, device=device)[None, :] < lengths.to(device)[:, None]  # (B, L) valid slots
    padded = jagged_to_padded(x, max_len=L)
    pq, pk, pv = (jagged_to_padded(t, max_len=L).transpose(1, 2) for t in qkv)  # (B, H, L, Dh)
    causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    elem = x.values.element_size()
    backends = ["reference"] + (["triton"] if device.type == "cuda" else [])
    fb = _fbgemm()

    jag_bytes = tokens * args.dim * elem
    pad_bytes = args.batch * L * args.dim * elem
    attn_flops = 4 * heads * head_dim * float((lengths * (lengths + 1) // 2).sum())
    target_flops = 4 * heads * head_dim * tokens
    cases: list[tuple[str, str, Callable[[], object], float, str]] = [
        ("to_padded", "padded copy", lambda: padded.clone(), 2 * pad_bytes, "GB/s"),
        ("segment_sum", "padded", lambda: (padded * mask[..., None]).sum(1), pad_bytes, "GB/s"),
        ("softmax", "padded", lambda: torch.softmax(padded.masked_fill(~mask[..., None], -math.inf), 1), 2 * pad_bytes, "GB/s"),
        ("causal_attn", "padded sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(pq, pk, pv, attn_mask=causal), attn_flops, "GFLOP/s"),
        ("target_attn", "padded sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(query[:, :, None], pk, pv, attn_mask=mask[:, None, None]), target_flops, "GFLOP/s"),
    ]
    for be in backends:
        cases += [
            ("to_padded", be, lambda be=be: jagged_to_padded(x, max_len=L, backend=be), jag_bytes + pad_bytes, "GB/s"),
            ("segment_sum", be, lambda be=be: segment_sum(x, backend=be), jag_bytes, "GB/s"),
            ("softmax", be, lambda be=be: jagged_softmax(x, backend=be), 2 * jag_bytes, "GB/s"),
            ("causal_attn", be, lambda be=be: causal_attention(*qkv, backend=be), attn_flops, "GFLOP/s"),
            ("target_attn", be, lambda be=be: target_attention(query, qkv[1], qkv[2], backend=be), target_flops, "GFLOP/s"),
        ]
    if fb is not None:
        off = x.offsets
        cases += [
            ("to_padded", "fbgemm", lambda: fb.jagged_to_padded_dense(x.values, [off], [L], 0.0), jag_bytes + pad_bytes, "GB/s"),
            ("segment_sum", "fbgemm", lambda: fb.segment_sum_csr(args.dim, off * args.dim, x.values.flatten()), jag_bytes, "GB/s"),
            ("softmax", "fbgemm", lambda: fb.jagged_softmax(x.values, off, L)[0], 2 * jag_bytes, "GB/s"),
        ]
    results = []
    for op, impl, fn, work, unit in tqdm(cases, desc="benchmarks", unit="case"):
        with torch.no_grad():
            ms = time_ms(fn, args.repeats, device)
        results.append(Result(op, impl, ms, work / (ms * 1e-3) / 1e9, unit))
    return results


def report(results: list[Result], args: argparse.Namespace) -> None:
    """Print the timing table, then each implementation's speed-up over the padded baseline."""
    print(f"B={args.batch} L_max={args.max_len} sparsity={args.sparsity} dtype={args.dtype} device={args.device}")
    print(f"{'op':<12} {'impl':<12} {'median ms':>10} {'rate':>12}")
    for r in results:
        print(f"{r.op:<12} {r.impl:<12} {r.median_ms:>10.3f} {r.rate:>8.2f} {r.unit}")
    base = {r.op: r.median_ms for r in results if r.impl.startswith("padded")}
    print("\nspeed-up vs padded baseline (>1 is faster):")
    for r in results:
        if not r.impl.startswith("padded"):
            print(f"{r.op:<12} {r.impl:<12} {base[r.op] / r.median_ms:>8.2f}x")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """CLI flags; defaults are small enough for a CPU."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--sparsity", type=float, default=0.7, help="expected padding fraction, in [0, 1)")
    p.add_argument("--dim", type=int, default=64, help="D for padding/pooling/softmax inputs")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", default="cpu", help="cpu (reference only) or cuda (adds Triton)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0.0 <= args.sparsity < 1.0:
        p.error(f"--sparsity must be in [0, 1), got {args.sparsity}")
    if min(args.batch, args.max_len, args.dim, args.heads, args.head_dim, args.repeats) < 1:
        p.error("--batch, --max-len, --dim, --heads, --head-dim and --repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    """Entry point for ``python -m benchmarks.kernels``."""
    args = parse_args(argv)
    report(bench_all(args), args)


if __name__ == "__main__":
    main()
