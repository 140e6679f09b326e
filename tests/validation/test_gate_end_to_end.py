"""The gate end to end: a corrupted examples version is quarantined, the trainer refuses it, a release lets it train;
and the HTML report's verdict banner as headless Chromium renders it (a screenshot, not a string match)."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import numpy as np
import pytest

from gemline.config import load_config
from gemline.gate import gate_decision, release
from gemline.lake import Lake, commit_once, read_table
from tests.conftest import quality_sections
from trainer.train import QuarantinedError, run_training
from validation.report import build_report, write_report
from validation.run import validate_table
from validation.suites import CheckResult

from .conftest import NOW_MS, T0_MS

CHROMIUM = "/usr/bin/chromium"


def _config(lake: Path):
    return load_config(overrides={
        "lake": str(lake), "ingest.domains": "facebook,instagram", "build.max_seq_len": "4",
        "validation.min_event_time_ms": str(T0_MS - 1000), "trainer.num_embeddings": "64", "trainer.batch_size": "8",
        "trainer.epochs": "1", "trainer.seed": "0",
    })


def test_leaked_examples_are_quarantined_refused_by_the_trainer_then_released(tmp_path, examples_table, caplog):
    # two days (the trainer evaluates on the last); row 5 sees an event 1 s after its own time
    changes = {i: {"event_date": "2023-11-15"} for i in range(8, 16)}
    changes[5] = {"seq_event_time_ms": [T0_MS + 4000, T0_MS + 6000]}
    table = examples_table(16, changes=changes)
    commit_once(tmp_path, "examples", table, app_id="build", version=0, mode="overwrite", metadata={"events_version": 0})
    config = _config(tmp_path)

    result = validate_table(Lake.for_config(config), "examples", 0, now_ms=NOW_MS, **quality_sections(config))
    assert not result.passed
    assert [f[:2] for f in result.failures if f[1] == "critical"] == [("leakage", "critical")]
    quality = read_table(tmp_path, "quality").to_pylist()
    leak = [r for r in quality if r["expectation"] == "leakage"]
    assert [(r["table_version"], r["success"]) for r in leak] == [(0, False)]

    with caplog.at_level(logging.ERROR, logger="trainer.train"), pytest.raises(QuarantinedError, match="leakage"):
        run_training(config.trainer, Lake.for_config(config), examples_version=0, progress=False)
    assert any("refusing to train" in r.getMessage() and "leakage" in r.getMessage() for r in caplog.records)

    release(tmp_path, "examples", 0, "leak is one test row, accepted", now_ms=NOW_MS + 1)
    decision = gate_decision(tmp_path, "examples", 0)
    assert decision.allowed and "leak is one test row" in decision.reason
    released = [r for r in read_table(tmp_path, "quality").to_pylist() if r["expectation"] == "__release__"]
    assert [(r["table_version"], r["observed"]) for r in released] == [(0, "leak is one test row, accepted")]
    trained = run_training(config.trainer, Lake.for_config(config), examples_version=0, progress=False)
    assert trained.examples_version == 0


# ---------------------------------------------------------------- screenshot

GREEN = np.array([212, 244, 212])  # .PASSED background #d4f4d4
RED = np.array([248, 208, 208])  # .QUARANTINED background #f8d0d0


def _screenshot(html: Path, png: Path, profile: Path) -> np.ndarray:
    """(H, W, 3) uint8 RGB screenshot of ``html`` at 1200x900 in headless Chromium."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make setup-browser` (apt-get install chromium) first")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", f"--screenshot={png}", "--window-size=1200,900", html.resolve().as_uri()]
    subprocess.run([CHROMIUM, *flags], check=True, capture_output=True, timeout=120)
    from PIL import Image

    return np.asarray(Image.open(png).convert("RGB"))


def _fraction(region: np.ndarray, colour: np.ndarray) -> float:
    return float((np.abs(region.astype(int) - colour).max(axis=-1) <= 6).mean())


@pytest.mark.parametrize("failed_severity,verdict", [("warning", "PASSED"), ("critical", "QUARANTINED")])
def test_report_banner_colour_in_headless_chromium(tmp_path, examples_table, failed_severity, verdict):
    results = [CheckResult("empty", "critical", True, "8", "x"), CheckResult("leakage", failed_severity, False, "1", "x")]
    report = build_report(table="examples", table_version=3, num_rows=8, results=results, run_id="r", run_ts_ms=NOW_MS,
                          source={"events_version": 1})
    assert report["verdict"] == verdict
    _, html = write_report(tmp_path / "lake", report, examples_table(8))
    image = _screenshot(html, tmp_path / "shot.png", tmp_path / "profile")
    assert image.shape[:2] == (900, 1200)
    banner = image[:150, :500]  # the verdict banner sits top left, above everything else
    expected, other = (GREEN, RED) if verdict == "PASSED" else (RED, GREEN)
    assert _fraction(banner, expected) > 0.15
    assert _fraction(banner, other) == 0.0
    assert _fraction(image[300:], expected) < 0.01  # only the banner carries the colour
