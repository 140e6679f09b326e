"""gemline.plots: one way to turn a Figure into PNG bytes or base64, for every report."""

from __future__ import annotations

import base64
import io
import math

import pytest
from PIL import Image

from gemline.plots import png_base64, png_bytes, subplots


def _image(png: bytes) -> Image.Image:
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    return Image.open(io.BytesIO(png))


def test_png_bytes_keeps_the_dpi_and_base64_is_the_same_image():
    fig, ax = subplots(figsize=(4, 2))
    ax.plot([0, 1], [1, 0])
    png = png_bytes(fig, dpi=50)
    image = _image(png)
    assert image.info["dpi"] == pytest.approx((50, 50), abs=0.1)
    # bbox_inches="tight" crops to the drawn area, so at most the 4 x 2 inch canvas
    assert 0 < image.size[0] <= 4 * 50 and 0 < image.size[1] <= 2 * 50
    assert base64.b64decode(png_base64(fig, dpi=50)) == png


def test_the_trainer_plots_are_drawn_through_gemline_plots():
    from trainer.compare import TASKS, auc_plot_png, progressive_plot_png
    from trainer.distill import staleness_plot_png
    from trainer.train import _loss_curve_png

    rows = [{"model": m, "task": "click", "domain": "feed", "auc": a} for m, a in (("gem", 0.7), ("dlrm", math.nan))]
    per_version = {"gem": {task: [{"examples_version": 1, "auc": 0.6}, {"examples_version": 2, "auc": None}]
                           for task in TASKS}}
    staleness = [{"domain": "feed", "staleness_ms_p50": 86_400_000.0, "adapter_ne_gain": 0.01}]
    for png in (auc_plot_png(rows), progressive_plot_png(per_version), staleness_plot_png(staleness),
                _loss_curve_png([0.7, 0.6, 0.5])):
        assert png is not None
        assert _image(png).info["dpi"] == pytest.approx((100, 100), abs=0.1)
