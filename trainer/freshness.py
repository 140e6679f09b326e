"""Freshness, measured: how old each trained example was when it was published and when it was trained.

For every row the continuous trainer trains on, three hops (seconds):

    impression->published   commit time of the examples version holding the row - ``event_time_ms``
    published->trained      end of the training step that consumed the row - that commit time
    impression->trained     end of that step - ``event_time_ms``

Their p50/p95/p99 over a version's trained rows go to the Delta table ``freshness``, one row per
(run_id, examples_version, hop), written once when the version's training is done, before its checkpoint
(:func:`append_freshness`: an app transaction per version, as ``training_metrics``), so a trainer that crashed
between the two trains the version again and its second commit is skipped.

Rows that correct an earlier example (``corrects_example_id`` not null; a table without that column has no
corrections) are left out of the two impression hops: their impression is old by design (a late label),
so they would measure the label delay, not the pipeline. They count in published->trained. Rows of a skipped
step (non-finite loss) were never trained and count nowhere.

The commit time is Delta's ``timestamp`` of the version's commit (``DeltaTable.history()``, ms since epoch UTC,
the writer's clock); the step end is this process's wall clock (:func:`wall_ms`). On one machine both are one
clock; across machines their skew adds to the published->trained hop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from gemline.lake import Lake, open_table
from gemline.tables import Table, commit

log = logging.getLogger(__name__)

FRESHNESS_TABLE = Table.FRESHNESS
HOPS: tuple[str, ...] = ("impression->published", "published->trained", "impression->trained")
"""The hops, in the order of the pipeline (the last one spans the other two)."""
QUANTILES = (0.5, 0.95, 0.99)

FRESHNESS_SCHEMA = pa.schema([
    pa.field("run_id", pa.string(), nullable=False),
    pa.field("examples_version", pa.int64(), nullable=False),
    pa.field("hop", pa.string(), nullable=False),  # one of HOPS
    pa.field("rows", pa.int64(), nullable=False),  # rows the quantiles are over
    pa.field("p50_s", pa.float64(), nullable=False),  # seconds
    pa.field("p95_s", pa.float64(), nullable=False),
    pa.field("p99_s", pa.float64(), nullable=False),
    pa.field("step_first", pa.int64(), nullable=False),  # the first and last optimiser step (1-based, the
    pa.field("step_last", pa.int64(), nullable=False),  # run's count) that trained these rows
    pa.field("published_ms", pa.int64(), nullable=False),  # commit time of the examples version, ms since epoch UTC
    pa.field("wall_time_ms", pa.int64(), nullable=False),  # when the row was computed, ms since epoch UTC
])
"""Arrow schema of the ``freshness`` Delta table (one row per run, examples version and hop)."""


def wall_ms() -> int:
    """Now, ms since epoch UTC (the trainer's clock for step ends; tests replace it)."""
    return time.time_ns() // 1_000_000


@dataclass
class VersionClock:
    """The rows one examples version trained, step by step: each row's impression time, whether it is a
    correction, and the end time and number of the step that consumed it."""

    event_ms: list[np.ndarray] = field(default_factory=list)
    corrected: list[np.ndarray] = field(default_factory=list)
    trained_ms: list[np.ndarray] = field(default_factory=list)
    steps: list[np.ndarray] = field(default_factory=list)

    def add_step(self, event_ms: np.ndarray, corrected: np.ndarray, step: int, trained_ms: int) -> None:
        """Record one step: its rows' (B,) int64 ``event_time_ms`` and (B,) bool correction flags, the step's
        number and its end (ms since epoch UTC)."""
        self.event_ms.append(np.asarray(event_ms, dtype=np.int64))
        self.corrected.append(np.asarray(corrected, dtype=bool))
        self.trained_ms.append(np.full(len(event_ms), trained_ms, dtype=np.int64))
        self.steps.append(np.full(len(event_ms), step, dtype=np.int64))

    def rows(self, run_id: str, version: int, published_ms: int, now_ms: int) -> list[dict[str, Any]]:
        """The version's ``freshness`` rows (:func:`freshness_rows`); [] when no step trained it."""
        if not self.event_ms:
            return []
        return freshness_rows(run_id, version, published_ms, np.concatenate(self.event_ms),
                              np.concatenate(self.trained_ms), np.concatenate(self.corrected),
                              np.concatenate(self.steps), now_ms)


def freshness_rows(run_id: str, version: int, published_ms: int, event_ms: np.ndarray, trained_ms: np.ndarray,
                   corrected: np.ndarray, steps: np.ndarray, now_ms: int) -> list[dict[str, Any]]:
    """One ``freshness`` row per hop of ``HOPS`` that has rows: p50/p95/p99 (numpy's default linear
    interpolation, seconds) of the hop over the version's trained rows, corrections left out of the impression
    hops (module docstring).

    Args:
        published_ms: commit time of examples@version, ms since epoch UTC.
        event_ms, trained_ms, corrected, steps: (N,) per trained row: impression time (int64 ms), end of its
            step (int64 ms), correction flag (bool), step number (int64).
        now_ms: the rows' ``wall_time_ms``.

    Raises:
        ValueError: the per-row arrays differ in length.
    """
    n = len(event_ms)
    if not (len(trained_ms) == len(corrected) == len(steps) == n):
        raise ValueError(f"freshness_rows: per-row arrays of lengths {len(event_ms)}, {len(trained_ms)}, "
                         f"{len(corrected)}, {len(steps)}; expected one length")
    fresh = ~np.asarray(corrected, dtype=bool)
    hops = {
        "impression->published": (published_ms - event_ms[fresh], steps[fresh]),
        "published->trained": (trained_ms - published_ms, steps),
        "impression->trained": (trained_ms[fresh] - event_ms[fresh], steps[fresh]),
    }
    out = []
    for hop in HOPS:
        delays_ms, hop_steps = hops[hop]
        if len(delays_ms) == 0:
            continue
        p50, p95, p99 = np.quantile(delays_ms.astype(np.float64) / 1000.0, QUANTILES)
        out.append({"run_id": run_id, "examples_version": version, "hop": hop, "rows": len(delays_ms),
                    "p50_s": float(p50), "p95_s": float(p95), "p99_s": float(p99),
                    "step_first": int(hop_steps.min()), "step_last": int(hop_steps.max()),
                    "published_ms": int(published_ms), "wall_time_ms": int(now_ms)})
    return out


def commit_times(lake: Lake, table: Table = Table.EXAMPLES) -> dict[int, int]:
    """``{version: commit timestamp}`` (ms since epoch UTC) of every commit still in ``table``'s log ({} without
    the table). Versions whose commit files the log retention removed are absent."""
    dt = open_table(lake, table)
    if dt is None:
        return {}
    return {int(e["version"]): int(e["timestamp"]) for e in dt.history() if "version" in e and "timestamp" in e}


def append_freshness(lake: Lake, run_id: str, sequence: int, rows: list[dict[str, Any]]) -> bool:
    """Append one version's ``freshness`` rows once: app transaction (``train:<run_id>``, ``sequence``), the
    run's count of versions measured. Returns False when that sequence was already committed (a version
    trained again after a crash that came before its checkpoint).

    Raises:
        gemline.lake.CommitConflictError: another writer committed the same sequence meanwhile.
    """
    return commit(lake.root, FRESHNESS_TABLE, pa.Table.from_pylist(rows, schema=FRESHNESS_SCHEMA),
                  app_id=f"train:{run_id}", version=sequence, version_rule="increasing",
                  storage_options=lake.storage_options)
