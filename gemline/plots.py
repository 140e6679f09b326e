"""Report plots as PNGs (inline or files), drawn outside pyplot (the validation, training, compare and distill
reports share them).

pyplot keeps every figure it made until it is closed, so a plot that raises half-way (a broken batch) would
leak its figure in a long-running ``--follow`` process; a bare :class:`matplotlib.figure.Figure` is freed with
its last reference and needs no backend. matplotlib is imported on first use, so importing a report module stays
cheap. Source: matplotlib's "Embedding in a web application server" (Figure without pyplot).
"""

from __future__ import annotations

import base64
import io
from typing import Any


def subplots(nrows: int = 1, ncols: int = 1, *, figsize: tuple[float, float] = (6, 3), **kwargs: Any) -> tuple[Any, Any]:
    """A ``(Figure, axes)`` pair outside pyplot; ``figsize`` in inches, ``kwargs`` go to ``Figure.subplots``."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    return fig, fig.subplots(nrows, ncols, **kwargs)


def png_bytes(fig: Any, dpi: int = 80) -> bytes:
    """``fig`` as PNG bytes cropped to its drawn area (``dpi`` dots per inch), for a ``.png`` file."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


def png_base64(fig: Any, dpi: int = 80) -> str:
    """``fig`` as a base64-encoded PNG (ASCII), cropped to its drawn area, for an ``<img src="data:...">``."""
    return base64.b64encode(png_bytes(fig, dpi)).decode("ascii")
