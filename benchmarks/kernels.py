"""Benchmark the jagged kernels: Triton parity, jagged attention vs padded SDPA, memory-bound ops.

``python -m benchmarks.kernels [--device cuda] [--dtype bf16] [--batch B] [--max-len L ...] [--sparsity S] [--tiny]``

Three parts, each printing its rows as they finish (flushed, so a long run shows progress):

1. :func:`parity_report`: every Triton op, forward and backward, against its PyTorch
   reference twin computed in float32 on the same (dtype-rounded) inputs; max abs error
   per op and pass, judged against ``atol + rtol * max|reference|``.
2. :func:`attention_benchmark`: jagged Triton causal attention against PyTorch's fastest
   padded path, ``scaled_dot_product_attention(..., is_causal=True)`` on (B, H, L_max, Dh)
   inputs (FlashAttention in bf16 on CUDA), forward and forward+backward, median ms and
   the speed-up. Before timing, both outputs (and the Triton gradients) are compared with
   the reference twin on a subset of rows whose float32 reference fits in memory (its
   bytes are estimated first; rows that would not fit are skipped and counted).
   On CPU, :func:`cpu_attention_benchmark` instead times the dispatcher's "sdpa" twin (the fast
   path the CPU trainer runs) against the reference, forward and forward+backward, same process.
3. The memory-bound ops (to_padded, segment_sum, softmax): padded PyTorch, the jagged
   reference, fbgemm (``torch.ops.fbgemm`` after ``import fbgemm_gpu``) and Triton on
   CUDA, each output compared with the reference before it is timed.

Row lengths are drawn uniformly from [0, 2 * (1 - S) * L] clipped to L, so S is the
expected fraction of padding a padded layout carries. Timings call the Triton twins
directly (``kernels.triton.*``), not the dispatchers, so the dispatchers' argument checks
(device syncs) are not timed; padded inputs are built before timing (the conversion is
not charged to SDPA). On CPU, Triton runs in its interpreter (:func:`enable_interpreter`,
called by ``main`` for ``--device cpu``): parity is meaningful there, timings are not.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from kernels.padding import jagged_to_padded
from kernels.reference import causal_attention as ref_causal
from kernels.types import Backend, Jagged

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2)}
"""(atol, rtol) per input dtype; rtol scales max|reference| of the tensor compared. bf16:
inputs and the probabilities fed to the tensor cores carry 8-bit mantissas (2^-8 ~ 4e-3
relative per rounding), and a gradient sums many such terms."""
REF_BUDGET_CPU = 2 << 30
"""Bytes the float32 reference may use on CPU (on CUDA: half the free memory)."""

Echo = Callable[[str], None]


def _print(line: str) -> None:
    print(line, flush=True)


def enable_interpreter() -> None:
    """Run Triton kernels through its CPU interpreter from now on (sets TRITON_INTERPRET=1).

    Triton reads the flag when a kernel is defined, so this must run before the first
    import of a ``kernels.triton`` kernel module; raises RuntimeError if one is already
    imported with compiled (non-interpreted) kernels.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    loaded = sorted(m for m in sys.modules if m.startswith("kernels.triton.") and m != "kernels.triton._util")
    if loaded:
        raise RuntimeError(f"enable_interpreter() must run before {loaded} are imported")
    os.environ["TRITON_INTERPRET"] = "1"


def _check_triton_device(device: torch.device) -> None:
    from kernels.triton._util import interpreting

    if device.type != "cuda" and not interpreting():
        raise RuntimeError(f"Triton on {device} needs the interpreter: call enable_interpreter() before importing kernels")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall time of fn() in ms over ``repeats`` calls after one warm-up call
    (which also runs any Triton autotuning)."""
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


def _err(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    atol, rtol = TOLERANCE[dtype]
    err = float((got.detach().float() - ref.detach().float()).abs().max()) if ref.numel() else 0.0
    scale = float(ref.detach().float().abs().max()) if ref.numel() else 0.0
    ok = math.isfinite(err) and err <= atol + rtol * scale
    return {"max_abs_err": err, "ref_max": scale, "ok": ok}


def _worst(errs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "max_abs_err": max((e["max_abs_err"] for e in errs), default=0.0),
        "ref_max": max((e["ref_max"] for e in errs), default=0.0),
        "ok": all(e["ok"] for e in errs),
    }


def _twin_errors(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], dtype: torch.dtype, seed: int) -> dict:
    """Run fn(backend, *leaves) on the float32 reference and on Triton in ``dtype``, with one
    shared upstream gradient; forward and backward (worst input gradient) errors."""
    outs: dict[str, list[torch.Tensor]] = {}
    for backend, cast in (("reference", torch.float32), ("triton", dtype)):
        leaves = [t.to(cast).detach().requires_grad_(True) for t in inputs]
        out = fn(backend, *leaves)
        gen = torch.Generator().manual_seed(seed)
        upstream = torch.randn(out.shape, generator=gen).to(device=out.device, dtype=dtype)
        grads = torch.autograd.grad(out, leaves, upstream.to(out.dtype), allow_unused=False)
        outs[backend] = [out.detach(), *grads]
    ref, tri = outs["reference"], outs["triton"]
    return {"forward": _err(tri[0], ref[0], dtype), "backward": _worst([_err(t, r, dtype) for t, r in zip(tri[1:], ref[1:])])}


def _parity_cases(tiny: bool, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    if tiny:
        lengths = [0, 3, 17, 1, 0, 9]
        wide_lengths = [2, 0, 5]
        return dict(lengths=lengths, feature=(3, 5), softmax_heads=2, attention=[(2, 8, lengths), (1, 160, wide_lengths)])
    lengths = torch.randint(0, 513, (64,), generator=gen).mul(torch.rand(64, generator=gen) > 0.2).tolist()
    lengths[7] = 1024  # one long row, so the longest row crosses many tiles
    short = lengths[:16]
    attention = [(4, 64, lengths), (4, 128, lengths), (2, 160, short), (2, 256, short)]
    return dict(lengths=lengths, feature=(4, 96), softmax_heads=8, attention=attention)


def parity_report(
    device: str | torch.device, dtype: torch.dtype, *, tiny: bool, seed: int = 0, echo: Echo | None = _print
) -> dict[str, Any]:
    """Max abs error of every Triton op against its float32 reference, forward and backward.

    tiny: a handful of rows (the interpreter on CPU finishes in seconds); otherwise 64
    rows up to 1024 tokens and head dims 64/128/160/256 (meant for CUDA). Returns
    ``{"device", "dtype", "tiny", "atol", "rtol", "seconds", "ok", "ops": {name: {"forward":
    {"max_abs_err", "ref_max", "ok"}, "backward": {...}}}}``; errors are in the op's
    output units. Each op's line is echoed as it finishes. Raises RuntimeError on a CPU
    device without the Triton interpreter.
    """
    from kernels.causal_attention import causal_attention
    from kernels.padding import padded_to_jagged
    from kernels.pooling import segment_mean, segment_sum
    from kernels.softmax import jagged_softmax
    from kernels.target_attention import target_attention

    device = torch.device(device)
    _check_triton_device(device)
    started = time.perf_counter()
    case = _parity_cases(tiny, seed)
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)

    lengths = torch.tensor(case["lengths"], device=device)
    offsets = Jagged.from_lengths(torch.empty(int(lengths.sum()), 0, device=device), lengths).offsets
    x = rnd(int(lengths.sum()), *case["feature"])
    max_len = max(case["lengths"])
    padded = jagged_to_padded(Jagged(x, offsets), max_len=max_len + 2)
    scores = rnd(x.shape[0], case["softmax_heads"])
    checks: list[tuple[str, Callable[..., torch.Tensor], list[torch.Tensor]]] = [
        ("to_padded", lambda b, v: jagged_to_padded(Jagged(v, offsets), pad_value=-1.0, backend=b), [x]),
        ("to_jagged", lambda b, p: padded_to_jagged(p, offsets, backend=b).values, [padded]),
        ("segment_sum", lambda b, v: segment_sum(Jagged(v, offsets), backend=b), [x]),
        ("segment_mean", lambda b, v: segment_mean(Jagged(v, offsets), backend=b), [x]),
        ("softmax", lambda b, s: jagged_softmax(Jagged(s, offsets), backend=b).values, [scores]),
    ]
    for n, (heads, head_dim, rows) in enumerate(case["attention"]):
        lens = torch.tensor(rows, device=device)
        off = Jagged.from_lengths(torch.empty(int(lens.sum()), 0, device=device), lens).offsets
        q, k, v = (rnd(int(lens.sum()), heads, head_dim) for _ in range(3))
        query = rnd(len(rows), heads, head_dim)
        tag = f"h{heads}_d{head_dim}"
        # Tiny runs check the wide head dims windowed only (the interpreter is slow there).
        for window in (7,) if tiny and n else (None, 7):

            def causal(b, q, k, v, off=off, window=window):
                j = lambda t: Jagged(t, off)  # noqa: E731
                return causal_attention(j(q), j(k), j(v), window=window, backend=b).values

            checks.append((f"causal_{tag}" + ("" if window is None else f"_w{window}"), causal, [q, k, v]))
        checks.append((f"target_{tag}", lambda b, qq, kk, vv, off=off: target_attention(qq, Jagged(kk, off), Jagged(vv, off), backend=b), [query, k, v]))
    atol, rtol = TOLERANCE[dtype]
    report: dict[str, Any] = {"device": str(device), "dtype": str(dtype), "tiny": tiny, "atol": atol, "rtol": rtol, "ops": {}}
    for i, (name, fn, inputs) in enumerate(checks):
        res = _twin_errors(fn, inputs, dtype, seed + i)
        report["ops"][name] = res
        if echo is not None:
            f, b = res["forward"], res["backward"]
            verdict = "ok" if f["ok"] and b["ok"] else "FAIL"
            echo(f"parity {name:<22} fwd {f['max_abs_err']:.2e} (ref max {f['ref_max']:.2g})  "
                 f"bwd {b['max_abs_err']:.2e} (ref max {b['ref_max']:.2g})  {verdict}")
    report["ok"] = all(r["forward"]["ok"] and r["backward"]["ok"] for r in report["ops"].values())
    report["seconds"] = time.perf_counter() - started
    return report


def reference_attention_bytes(rows: int, max_len: int, heads: int, head_dim: int) -> int:
    """Bytes the float32 reference causal attention needs, forward and backward, for ``rows``
    rows padded to ``max_len``: about five (rows, H, L, L) score-sized tensors (scores,
    masked scores, probabilities and their gradients) and eight padded (rows, L, H, Dh)
    copies (q, k, v, out and their gradients)."""
    return 4 * (5 * rows * heads * max_len * max_len + 8 * rows * max_len * heads * head_dim)


def _reference_rows(lengths: list[int], heads: int, head_dim: int, budget: int, most: int = 8) -> tuple[list[int], int]:
    """Rows to check against the reference: the longest row whose reference fits in ``budget``
    bytes, then the next longest while the set still fits (at most ``most``), plus one empty
    row if any. Returns (row indices, number of rows longer than the longest checked)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    chosen: list[int] = []
    for i in order:
        if lengths[i] == 0 or len(chosen) == most:
            continue
        top = lengths[chosen[0]] if chosen else lengths[i]
        if reference_attention_bytes(len(chosen) + 1, top, heads, head_dim) <= budget:
            chosen.append(i)
    chosen += [i for i in order if lengths[i] == 0][:1]
    longest = max((lengths[i] for i in chosen), default=0)
    return chosen, sum(1 for n in lengths if n > longest)


def _sub_batch(values: list[torch.Tensor], offsets: torch.Tensor, rows: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    host = offsets.tolist()
    index = torch.cat([torch.arange(host[i], host[i + 1]) for i in rows] + [torch.zeros(0, dtype=torch.int64)])
    index = index.to(offsets.device)
    lengths = torch.tensor([host[i + 1] - host[i] for i in rows], device=offsets.device)
    sub_off = Jagged.from_lengths(torch.empty(int(lengths.sum()), 0, device=offsets.device), lengths).offsets
    return [t[index] for t in values], sub_off


def _padded(t: torch.Tensor, offsets: torch.Tensor, max_len: int) -> torch.Tensor:
    """values (T, H, Dh) -> (B, H, L, Dh) contiguous, the layout SDPA's fast kernels want."""
    return jagged_to_padded(Jagged(t, offsets), max_len=max_len).transpose(1, 2).contiguous()


def _sdpa_jagged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_len: int) -> torch.Tensor:
    from kernels.padding import padded_to_jagged

    pq, pk, pv = (_padded(t, offsets, max_len) for t in (q, k, v))
    out = F.scaled_dot_product_attention(pq, pk, pv, is_causal=True)
    return padded_to_jagged(out.transpose(1, 2), offsets).values


def _attention_parity(
    qkv: list[torch.Tensor], offsets: torch.Tensor, lengths: list[int], dtype: torch.dtype, budget: int
) -> dict[str, Any]:
    """Triton (forward and gradients) and padded SDPA (forward) against the float32 reference
    on the rows whose reference fits in ``budget`` bytes."""
    from kernels.triton.causal_attention import causal_attention as tri_causal

    heads, head_dim = qkv[0].shape[1:]
    rows, skipped = _reference_rows(lengths, heads, head_dim, budget)
    sub, off = _sub_batch(qkv, offsets, rows)
    sub_len = max((lengths[i] for i in rows), default=0)
    scale = 1.0 / math.sqrt(head_dim)
    upstream = torch.randn(sub[0].shape, generator=torch.Generator().manual_seed(1)).to(sub[0])
    q, k, v = (t.float().requires_grad_(True) for t in sub)
    ref = ref_causal.causal_attention(q, k, v, off, sub_len, None, scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), upstream.float())
    q, k, v = (t.detach().requires_grad_(True) for t in sub)
    tri = tri_causal(q, k, v, off, sub_len, None, scale)
    tri_grads = torch.autograd.grad(tri, (q, k, v), upstream)
    with torch.no_grad():
        sdpa = _sdpa_jagged(sub[0], sub[1], sub[2], off, sub_len)
    return {
        "ref_rows": len(rows),
        "ref_rows_skipped_longer": skipped,
        "ref_longest_row": sub_len,
        "triton_fwd": _err(tri, ref, dtype),
        "triton_bwd": _worst([_err(g, r, dtype) for g, r in zip(tri_grads, ref_grads)]),
        "sdpa_fwd": _err(sdpa, ref, dtype),
    }


def attention_benchmark(
    device: str | torch.device,
    batch: int,
    max_len: int,
    sparsity: float,
    dtype: torch.dtype,
    repeats: int,
    *,
    heads: int = 4,
    head_dim: int = 128,
    seed: int = 0,
    echo: Echo | None = _print,
) -> list[dict[str, Any]]:
    """Jagged Triton causal attention vs padded ``scaled_dot_product_attention(is_causal=True)``.

    Inputs: B=batch rows of lengths from :func:`draw_lengths`, q, k, v (T, H, Dh) in
    ``dtype``; SDPA gets the same values padded to (B, H, max_len, Dh). Outputs are first
    compared with the float32 reference (see :func:`_attention_parity`); then each pass is
    timed (median ms over ``repeats`` after a warm-up). Returns one dict per pass ("fwd",
    "fwd+bwd") with triton_ms, sdpa_ms, speedup (sdpa_ms / triton_ms, > 1 means the jagged
    kernel is faster), useful TFLOP/s of each (unpadded causal FLOPs; backward counted as
    2.5x forward, the FlashAttention-2 convention), tokens, and the parity fields. Each row
    is echoed as it finishes.
    """
    from kernels.triton.causal_attention import causal_attention as tri_causal

    device = torch.device(device)
    _check_triton_device(device)
    lengths_t = draw_lengths(batch, max_len, sparsity, seed)
    lengths = lengths_t.tolist()
    tokens = int(lengths_t.sum())
    gen = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(tokens, heads, head_dim, generator=gen).to(device=device, dtype=dtype) for _ in range(3)]
    offsets = Jagged.from_lengths(qkv[0], lengths_t.to(device)).offsets
    budget = int(torch.cuda.mem_get_info(device)[0] // 2) if device.type == "cuda" else REF_BUDGET_CPU
    parity = _attention_parity(qkv, offsets, lengths, dtype, budget)
    longest = max(lengths) if lengths else 0
    scale = 1.0 / math.sqrt(head_dim)
    upstream = torch.randn(tokens, heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    pq, pk, pv = (_padded(t, offsets, max_len).requires_grad_(True) for t in qkv)
    pad_up = _padded(upstream, offsets, max_len)
    q, k, v = (t.detach().requires_grad_(True) for t in qkv)

    def tri_fwd() -> torch.Tensor:
        return tri_causal(q, k, v, offsets, longest, None, scale)

    def sdpa_fwd() -> torch.Tensor:
        return F.scaled_dot_product_attention(pq, pk, pv, is_causal=True)

    passes: list[tuple[str, Callable[[], object], Callable[[], object], float]] = [
        ("fwd", _no_grad(tri_fwd), _no_grad(sdpa_fwd), 1.0),
        ("fwd+bwd", lambda: torch.autograd.grad(tri_fwd(), (q, k, v), upstream),
         lambda: torch.autograd.grad(sdpa_fwd(), (pq, pk, pv), pad_up), 3.5),
    ]
    fwd_flops = 4.0 * heads * head_dim * sum(n * (n + 1) / 2 for n in lengths)
    results = []
    for name, tri, sdpa, flop_factor in passes:
        tri_ms = time_ms(tri, repeats, device)
        sdpa_ms = time_ms(sdpa, repeats, device)
        row = {
            "op": "causal_attention", "pass": name, "device": str(device), "dtype": str(dtype), "batch": batch,
            "max_len": max_len, "sparsity": sparsity, "heads": heads, "head_dim": head_dim, "tokens": tokens,
            "triton_ms": tri_ms, "sdpa_ms": sdpa_ms, "speedup": sdpa_ms / tri_ms,
            "triton_tflops": flop_factor * fwd_flops / (tri_ms * 1e-3) / 1e12,
            "sdpa_tflops_useful": flop_factor * fwd_flops / (sdpa_ms * 1e-3) / 1e12,
            **parity,
        }
        results.append(row)
        if echo is not None:
            verdict = "ok" if parity["triton_fwd"]["ok"] and parity["triton_bwd"]["ok"] and parity["sdpa_fwd"]["ok"] else "PARITY FAIL"
            echo(f"attention B={batch} L_max={max_len} S={sparsity} {row['dtype']} {name:<7} triton {tri_ms:9.3f} ms  "
                 f"sdpa {sdpa_ms:9.3f} ms  speed-up {row['speedup']:6.2f}x  triton {row['triton_tflops']:.3g} TFLOP/s  "
                 f"(parity on {parity['ref_rows']} rows up to {parity['ref_longest_row']}: {verdict})")
    return results


def cpu_attention_benchmark(
    batch: int,
    max_len: int,
    sparsity: float,
    repeats: int,
    *,
    heads: int = 2,
    head_dim: int = 8,
    window: int | None = None,
    seed: int = 0,
    echo: Echo | None = _print,
) -> list[dict[str, Any]]:
    """The "sdpa" causal attention twin against the reference on CPU, through the dispatcher, in float32.

    Defaults are gem_small's shape (trainer.embedding_dim 16 over 2 heads; rows up to max_sequence_len 32
    at B=512 in the trainer). Both outputs and gradients are compared first (float32 atol/rtol 1e-4, see
    :data:`TOLERANCE`). Passes: "fwd" under ``torch.inference_mode`` (progressive evaluation), "fwd+bwd"
    (a training step). Returns one dict per pass with reference_ms, sdpa_ms (median wall ms; run both in
    the same process, a busy machine moves both) and speedup (reference_ms / sdpa_ms, > 1: sdpa faster).
    """
    from kernels.causal_attention import causal_attention

    lengths = draw_lengths(batch, max_len, sparsity, seed)
    gen = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(int(lengths.sum()), heads, head_dim, generator=gen) for _ in range(3)]
    offsets = Jagged.from_lengths(qkv[0], lengths).offsets
    upstream = torch.randn(qkv[0].shape, generator=gen)
    leaves = [t.detach().requires_grad_(True) for t in qkv]

    def fwd(backend: str, inputs: list[torch.Tensor]) -> torch.Tensor:
        j = [Jagged(t, offsets) for t in inputs]
        return causal_attention(*j, window=window, backend=backend).values  # type: ignore[arg-type]

    def train(backend: str) -> tuple[torch.Tensor, ...]:
        out = fwd(backend, leaves)
        return (out, *torch.autograd.grad(out, leaves, upstream))

    def infer(backend: str) -> Callable[[], object]:
        def run() -> object:
            with torch.inference_mode():
                return fwd(backend, qkv)

        return run

    parity = _worst([_err(g, r, torch.float32) for g, r in zip(train("sdpa"), train("reference"))])
    cpu = torch.device("cpu")
    results = []
    for name, ref, fast in (("fwd", infer("reference"), infer("sdpa")),
                            ("fwd+bwd", partial(train, "reference"), partial(train, "sdpa"))):
        ref_ms, sdpa_ms = time_ms(ref, repeats, cpu), time_ms(fast, repeats, cpu)
        row = {"op": "causal_attention_cpu", "pass": name, "batch": batch, "max_len": max_len, "sparsity": sparsity,
               "heads": heads, "head_dim": head_dim, "window": window, "reference_ms": ref_ms, "sdpa_ms": sdpa_ms,
               "speedup": ref_ms / sdpa_ms, "parity": parity}
        results.append(row)
        if echo is not None:
            echo(f"cpu attention B={batch} L_max={max_len} H={heads} Dh={head_dim} window={window} {name:<7} "
                 f"reference {ref_ms:8.3f} ms  sdpa {sdpa_ms:8.3f} ms  speed-up {row['speedup']:5.2f}x  "
                 f"(parity: max abs err {parity['max_abs_err']:.1e}, {'ok' if parity['ok'] else 'FAIL'})")
    return results


def _no_grad(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with torch.no_grad():
            return fn()

    return run


def _fbgemm(echo: Echo) -> Any:
    try:
        import fbgemm_gpu  # noqa: F401  registers torch.ops.fbgemm
    except ImportError as exc:  # the benchmark still runs, but says so
        echo(f"fbgemm_gpu unavailable ({exc}); skipping fbgemm rows")
        return None
    return torch.ops.fbgemm


def fbgemm_segment_sum(fb: Any, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-feature row sums ``(B, D)`` of ``values (T, D)`` with fbgemm's ``segment_sum_csr``.

    That op sums whole segments to one scalar: output i is the sum of
    ``values[csr[i] * batch_size : csr[i + 1] * batch_size]``, and its CPU and CUDA kernels
    read ``csr`` as int32 (an int64 tensor is reinterpreted, giving garbage or NaN, the bug
    this benchmark had). So the features are laid out column-major (D*T) and every
    (feature, row) pair is its own int32 segment, batch_size 1. The transpose is part of
    the timed call. Raises ValueError past int32 indexing.
    """
    tokens, width = values.shape
    if tokens * width >= 2**31:
        raise ValueError(f"segment_sum_csr indexes int32: T*D = {tokens * width} is too large")
    starts = offsets[:-1][None, :] + torch.arange(width, device=offsets.device)[:, None] * tokens
    csr = torch.cat([starts.flatten(), offsets.new_tensor([width * tokens])]).to(torch.int32)
    sums = fb.segment_sum_csr(1, csr, values.t().contiguous().flatten())
    return sums.view(width, -1).t()


def _softmax_values(scores: Jagged, backend: Backend) -> torch.Tensor:
    from kernels.softmax import jagged_softmax

    return jagged_softmax(scores, backend=backend).values


def _memory_cases(args: argparse.Namespace, echo: Echo) -> Iterator[tuple[str, str, Callable[[], torch.Tensor], torch.Tensor | None, float]]:
    """(op, impl, fn, output to compare with the reference or None, bytes moved) per case."""
    from kernels.pooling import segment_sum
    from kernels.softmax import jagged_softmax

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    L = args.max_len[0]
    lengths = draw_lengths(args.batch, L, args.sparsity, args.seed).to(device)
    tokens = int(lengths.sum())
    gen = torch.Generator().manual_seed(args.seed)
    x = Jagged.from_lengths(torch.randn(tokens, args.dim, generator=gen).to(device=device, dtype=dtype), lengths)
    scores = Jagged(x.values[:, 0].contiguous(), x.offsets)
    mask = torch.arange(L, device=device)[None, :] < lengths[:, None]
    padded = jagged_to_padded(x, max_len=L)
    elem = x.values.element_size()
    jag, pad = tokens * args.dim * elem, args.batch * L * args.dim * elem
    score_pad = jagged_to_padded(Jagged(scores.values[:, None], x.offsets), max_len=L)[..., 0]
    refs = {
        "to_padded": padded,
        "segment_sum": segment_sum(x),
        "softmax": jagged_softmax(scores).values,
    }
    yield "to_padded", "padded copy", padded.clone, None, 2 * pad
    yield "segment_sum", "padded", lambda: (padded * mask[..., None]).sum(1), refs["segment_sum"], pad
    yield ("softmax", "padded", lambda: torch.softmax(score_pad.masked_fill(~mask, -math.inf), 1)[mask],
           refs["softmax"], 2 * args.batch * L * elem)
    impls: tuple[Backend, ...] = ("reference", "triton") if device.type == "cuda" else ("reference",)
    for be in impls:
        yield "to_padded", be, partial(jagged_to_padded, x, max_len=L, backend=be), refs["to_padded"], jag + pad
        yield "segment_sum", be, partial(segment_sum, x, backend=be), refs["segment_sum"], jag
        yield "softmax", be, partial(_softmax_values, scores, be), refs["softmax"], 2 * tokens * elem
    fb = _fbgemm(echo)
    if fb is not None:
        off = x.offsets
        yield "to_padded", "fbgemm", lambda: fb.jagged_to_padded_dense(x.values, [off], [L], 0.0), refs["to_padded"], jag + pad
        yield "segment_sum", "fbgemm", lambda: fbgemm_segment_sum(fb, x.values, off), refs["segment_sum"], jag
        yield ("softmax", "fbgemm", lambda: fb.jagged_softmax(scores.values[:, None], off, L)[0][:, 0],
               refs["softmax"], 2 * tokens * elem)


def memory_bound_benchmark(args: argparse.Namespace, echo: Echo = _print) -> list[dict[str, Any]]:
    """Time the memory-bound ops per implementation (median ms, GB/s of the bytes each
    layout moves, speed-up over the padded baseline); an output that differs from the
    reference beyond the dtype's tolerance is reported and not timed."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    results: list[dict[str, Any]] = []
    base: dict[str, float] = {}
    for op, impl, fn, ref, work in _memory_cases(args, echo):
        with torch.no_grad():
            try:
                got = fn()
            except (RuntimeError, NotImplementedError) as exc:
                if impl != "fbgemm":
                    raise
                # e.g. a CPU-only fbgemm build given CUDA tensors: say so, keep going
                echo(f"{op:<12} {impl:<12} unavailable here: {str(exc).splitlines()[0][:120]}")
                continue
            if ref is not None:
                check = _err(got, ref, dtype)
                if not check["ok"]:
                    echo(f"{op:<12} {impl:<12} MISMATCH vs reference: max abs err {check['max_abs_err']:.3g}; not timed")
                    results.append({"op": op, "impl": impl, "mismatch": check})
                    continue
            ms = time_ms(fn, args.repeats, device)
        base.setdefault(op, ms)  # the padded baseline comes first for every op
        row = {"op": op, "impl": impl, "ms": ms, "gb_s": work / (ms * 1e-3) / 1e9, "speedup_vs_padded": base[op] / ms}
        results.append(row)
        echo(f"{op:<12} {impl:<12} {ms:>10.3f} ms {row['gb_s']:>9.2f} GB/s {row['speedup_vs_padded']:>7.2f}x vs padded")
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """CLI flags; defaults are small enough for a CPU."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-len", type=int, nargs="+", default=[256], help="one or more L_max for the attention rows")
    p.add_argument("--sparsity", type=float, default=0.7, help="expected padding fraction, in [0, 1)")
    p.add_argument("--dim", type=int, default=64, help="D for padding/pooling/softmax inputs")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", default="cpu", help="cpu (Triton in the interpreter: parity only) or cuda")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes everywhere (a CI smoke run): overrides --batch, --max-len, --dim, --heads, --head-dim, --repeats")
    args = p.parse_args(argv)
    if not 0.0 <= args.sparsity < 1.0:
        p.error(f"--sparsity must be in [0, 1), got {args.sparsity}")
    if min(args.batch, *args.max_len, args.dim, args.heads, args.head_dim, args.repeats) < 1:
        p.error("--batch, --max-len, --dim, --heads, --head-dim and --repeats must be >= 1")
    kind, colon, index = args.device.partition(":")
    if kind not in ("cpu", "cuda") or (colon and (kind == "cpu" or not index.isdigit())):
        p.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch sees no CUDA device here (torch {torch.__version__}); use --device cpu")
    if args.tiny:
        args.batch, args.max_len, args.dim, args.heads, args.head_dim, args.repeats = 4, [24], 8, 2, 16, 1
    return args


def main(argv: list[str] | None = None) -> None:
    """Entry point for ``python -m benchmarks.kernels``: parity, attention rows, memory-bound ops."""
    args = parse_args(argv)
    if args.device == "cpu":
        enable_interpreter()
    dtype = DTYPES[args.dtype]
    _print(f"B={args.batch} L_max={args.max_len} sparsity={args.sparsity} dtype={args.dtype} device={args.device}")
    if args.device == "cpu":
        _print("Triton runs in its CPU interpreter here: the parity checks count, the timings and speed-ups do not")
    report = parity_report(args.device, dtype, tiny=args.tiny or args.device == "cpu", seed=args.seed)
    _print(f"parity {'ok' if report['ok'] else 'FAILED'} in {report['seconds']:.1f} s")
    if args.device == "cpu":
        for max_len in args.max_len:
            for window in (None, 8):
                cpu_attention_benchmark(args.batch, max_len, args.sparsity, args.repeats, heads=args.heads,
                                        head_dim=args.head_dim, window=window, seed=args.seed)
    if args.device != "cpu" or args.tiny:
        for max_len in args.max_len:
            attention_benchmark(args.device, args.batch, max_len, args.sparsity, dtype, args.repeats,
                                heads=args.heads, head_dim=args.head_dim, seed=args.seed)
    memory_bound_benchmark(args)


if __name__ == "__main__":
    main()
