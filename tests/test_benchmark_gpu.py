"""``python -m benchmarks.gpu --device cpu --tiny``: the prepared GPU check runs its own code on CPU (what CI runs)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "gpu.json"
    # A fresh process: the Triton interpreter must be chosen before any kernel module is imported.
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--tiny", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    return proc, out


def test_the_tiny_check_passes_and_writes_every_section(tiny_run):
    proc, out = tiny_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["ok"] and summary["device"] == "cpu" and summary["tiny"]
    assert set(summary["sections"]) == {"parity", "kernels", "train"}
    parity = summary["sections"]["parity"]["result"]
    assert set(parity) == {"fp32", "bf16"}
    for report in parity.values():
        assert report["ok"] and report["ops"], report
        for op, passes in report["ops"].items():
            for name, check in passes.items():
                assert check["ok"] and check["max_abs_err"] <= report["atol"] + report["rtol"] * check["ref_max"], (op, name)
    rows = summary["sections"]["kernels"]["result"]
    assert [(r["max_len"], r["pass"]) for r in rows] == [(16, "fwd"), (16, "fwd+bwd"), (32, "fwd"), (32, "fwd+bwd")]
    assert all(r["triton_ms"] > 0 and r["sdpa_ms"] > 0 and r["triton_fwd"]["ok"] for r in rows)
    train = summary["sections"]["train"]["result"]
    assert train["steps"] == 3 and train["examples_per_s"] > 0 and math.isfinite(train["final_loss"])
    assert train["peak_memory_bytes"] > 0
    assert proc.stdout.strip().splitlines()[-1] == f"summary: {out}"


def test_a_cuda_request_without_cuda_is_refused_before_anything_runs(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--device", "cuda", "--out", str(tmp_path / "x.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --device cuda: this machine has no CUDA device")
    assert not (tmp_path / "x.json").exists()
