"""Counts of ``seq_length`` per value over all examples, so a build reports its p50/p99 without reading them.

``seq_length`` is an int32 in ``[0, build.max_seq_len]``: the examples of a whole run fit in one small
histogram ``{length: count}``. Each build adds the counts of the examples it publishes to those of the last
examples commit and stores the sum in its own examples commit's metadata (key :data:`METADATA_KEY`), so
:func:`percentile` gives, at any examples version, what ``np.percentile`` gives over every ``seq_length`` of
that snapshot (examples are append-only and never rewritten) at a cost of O(distinct lengths) instead of a
read of the whole table.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

METADATA_KEY = "seq_length_counts"
"""Key of the counts in the examples commit's metadata: ``{str(length): count}`` (JSON keys are strings)."""


def count_lengths(lengths: np.ndarray) -> dict[str, int]:
    """``{str(length): count}`` of ``lengths`` ((N,) integers >= 0, events); empty for N = 0.

    Raises:
        ValueError: a negative length.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"seq_length must be >= 0, got {int(lengths.min())}")
    bins = np.bincount(lengths)
    return {str(k): int(c) for k, c in enumerate(bins) if c}


def add_counts(*parts: Mapping[str, int]) -> dict[str, int]:
    """The sum of several ``{str(length): count}`` maps (the counts of disjoint sets of examples)."""
    total: dict[str, int] = {}
    for part in parts:
        for key, count in part.items():
            total[key] = total.get(key, 0) + int(count)
    return total


def percentile(counts: Mapping[str, int], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of the lengths ``counts`` describes, equal to ``np.percentile(a, q)``
    of the array ``a`` holding each length ``count`` times (method "linear", Hyndman & Fan 1996 type 7, the
    numpy default: the sorted ``a`` interpolated at virtual index ``(n - 1) * q / 100``); None when empty.

    The interpolation mirrors numpy's ``_lerp`` (``a + (b - a) * t``, or ``b - (b - a) * (1 - t)`` for
    ``t >= 0.5``) so the float is the same bit for bit (checked against ``np.percentile`` in the tests).
    """
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    keys = sorted((int(k), int(c)) for k, c in counts.items() if int(c) > 0)
    if not keys:
        return None
    values = np.array([k for k, _ in keys], dtype=np.float64)
    ends = np.cumsum([c for _, c in keys])  # sorted index i holds values[searchsorted(ends, i, "right")]
    n = int(ends[-1])
    virtual = (n - 1) * (np.float64(q) / 100)
    if virtual >= n - 1:
        return float(values[-1])
    lo = int(np.floor(virtual))
    a, b = (values[np.searchsorted(ends, i, side="right")] for i in (lo, lo + 1))
    t = virtual - lo
    return float(b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t)
