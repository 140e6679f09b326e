"""benchmarks.kernels run tiny on CPU (Triton in the interpreter, as CI runs
``python -m benchmarks.gpu --device cpu --tiny``): the parity report, the attention rows,
the memory-bound table with the fixed fbgemm segment sum, and the reference-memory guard."""

import pytest
import torch

import benchmarks.kernels as bench
from kernels.reference.pooling import segment_sum


def test_parity_report_tiny_fp32():
    report = bench.parity_report("cpu", torch.float32, tiny=True, echo=None)
    assert report["ok"], report
    ops = report["ops"]
    # Every op, both attention kernels at a head dim past one tile, with and without a window.
    for name in ("to_padded", "to_jagged", "segment_sum", "segment_mean", "softmax",
                 "causal_h2_d8", "causal_h1_d160_w7", "target_h1_d160"):
        assert ops[name]["forward"]["max_abs_err"] < 1e-5 and ops[name]["backward"]["max_abs_err"] < 1e-5, name
        assert ops[name]["forward"]["ref_max"] > 0.1, f"{name}: the compared output is ~0, a vacuous check"


def test_attention_benchmark_tiny_bf16():
    rows = bench.attention_benchmark("cpu", 3, 16, 0.5, torch.bfloat16, 1, heads=1, head_dim=8, echo=None)
    assert [r["pass"] for r in rows] == ["fwd", "fwd+bwd"]
    tokens = int(bench.draw_lengths(3, 16, 0.5, 0).sum())
    for r in rows:
        assert r["tokens"] == tokens > 0
        assert r["triton_ms"] > 0 and r["sdpa_ms"] > 0
        assert r["speedup"] == pytest.approx(r["sdpa_ms"] / r["triton_ms"])
        assert r["ref_rows"] == 3 and r["ref_rows_skipped_longer"] == 0
        assert r["triton_fwd"]["ok"] and r["triton_bwd"]["ok"] and r["sdpa_fwd"]["ok"], r


def test_memory_bound_rows_match_the_reference_including_fbgemm():
    pytest.importorskip("fbgemm_gpu")
    lines: list[str] = []
    rows = bench.memory_bound_benchmark(bench.parse_args(["--tiny"]), echo=lines.append)
    assert all("ms" in r for r in rows), [r for r in rows if "mismatch" in r]
    assert {(r["op"], r["impl"]) for r in rows} >= {("segment_sum", "fbgemm"), ("softmax", "fbgemm"), ("to_padded", "fbgemm")}
    assert len(lines) == len(rows)


def test_fbgemm_segment_sum_per_feature():
    pytest.importorskip("fbgemm_gpu")
    values = torch.arange(12.0).view(6, 2)  # rows [0:2], [], [2:6]
    offsets = torch.tensor([0, 2, 2, 6])
    got = bench.fbgemm_segment_sum(torch.ops.fbgemm, values, offsets)
    torch.testing.assert_close(got, torch.tensor([[2.0, 4.0], [0.0, 0.0], [28.0, 32.0]]))
    torch.testing.assert_close(got, segment_sum(values, offsets))


def test_reference_rows_skip_what_would_not_fit():
    assert bench.reference_attention_bytes(2, 10, 3, 4) == 4 * (5 * 2 * 3 * 100 + 8 * 2 * 10 * 3 * 4)
    lengths = [5, 0, 100, 3]
    budget = bench.reference_attention_bytes(3, 5, 1, 1)  # rows of 5 fit, the 100-token row does not
    rows, skipped = bench._reference_rows(lengths, 1, 1, budget)
    assert rows == [0, 3, 1] and skipped == 1
    everything, none = bench._reference_rows(lengths, 1, 1, 1 << 40)
    assert everything == [2, 0, 3, 1] and none == 0


@pytest.mark.parametrize(("device", "message"), [("gpu", "--device must be cpu, cuda or cuda:N"),
                                                 ("cpu:0", "--device must be cpu, cuda or cuda:N")])
def test_a_bad_device_is_a_usage_error(capsys, device, message):
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--device", device])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_cuda_without_cuda_is_a_usage_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cuda"])
    assert "torch sees no CUDA device here" in capsys.readouterr().err


def test_cpu_attention_benchmark_checks_parity_then_times_both():
    rows = bench.cpu_attention_benchmark(5, 12, 0.3, 1, window=3, echo=None)
    assert [r["pass"] for r in rows] == ["fwd", "fwd+bwd"]
    for r in rows:
        assert r["parity"]["ok"] and r["parity"]["ref_max"] > 0.1, r
        assert r["reference_ms"] > 0 and r["sdpa_ms"] > 0
        assert r["speedup"] == pytest.approx(r["reference_ms"] / r["sdpa_ms"])
