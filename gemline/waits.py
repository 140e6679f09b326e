"""How long each stage's inputs waited for it: a stage's backlog measured in time, one value per input, read
from what the stages committed.

A stage that keeps up gives every input a bounded wait; one that falls behind (its inputs arrive faster than it
finishes them) gives each input a longer wait than the one before. With a steady arrival rate the two views are
the same (Little's law: backlog = arrival rate x wait), but a count of versions waiting, sampled every 30 s
against a version every ~10 s, reads a version in flight as backlog and drifts between 0 and 1 for minutes on a
stage that keeps up; each input's own wait has no such aliasing.

==========  ==========================================================  =============================================
stage       input, and when it arrived                                  done when
==========  ==========================================================  =============================================
ingest      an ``events`` commit's newest message (its Kafka record     that ``events`` commit
            timestamp: the producer's clock)
build       an ``events`` commit by ingest                              the first ``examples`` commit by the build
                                                                        whose ``events_version`` reaches it
validate    an ``events`` commit by ingest, an ``examples`` commit by   the first validation run of that table at or
            the build                                                   after that version (``quality.run_ts_ms``)
train       an ``examples`` commit that added rows                      its rows' median ``published->trained``
                                                                        (the ``freshness`` table)
distill     an examples version the teacher trained (its ``freshness``  the students' checkpoint records it
            row's ``wall_time_ms``)                                     (``distilled_ms``, trainer.distill)
==========  ==========================================================  =============================================

Times are Delta commit timestamps and the stages' wall clocks, ms since epoch UTC, on one machine here; across
machines the waits carry the clocks' skew. An input not done by ``until_ms`` counts with the wait it has had so
far (a lower bound, ``done=False``), so a stage that stopped shows as one whose wait grows. Ingest has no
committed record of the messages still in Kafka; when the caller says some are (``ingest_pending``), one more
input stands for them: arrived at the newest ``events`` commit, waiting since.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow.compute as pc
from scipy import stats  # type: ignore[import-untyped]  # pinned in requirements.lock

from gemline.gate import RELEASE
from gemline.increments import read_increment
from gemline.lake import Lake, open_table, read_table
from gemline.progress import distill_meta
from gemline.tables import Table


@dataclass(frozen=True)
class Commit:
    """One Delta commit: its version, its commit timestamp (ms since epoch UTC) and its ``gemline`` metadata
    (``{}`` when it has none: a compaction, or a writer of another program)."""

    version: int
    timestamp_ms: int
    meta: Mapping[str, Any]


@dataclass(frozen=True)
class Wait:
    """One input's wait for a stage (module docstring)."""

    arrived_ms: int
    """When the input became the stage's to do, ms since epoch UTC."""
    wait_s: float
    """Seconds from ``arrived_ms`` until the stage finished it, or until ``until_ms`` when it had not."""
    done: bool


def _wait(arrived_ms: int, done_ms: int | None, until_ms: int) -> Wait:
    """The wait of an input finished at ``done_ms`` (None: not yet), as seen at ``until_ms``."""
    if done_ms is None or done_ms > until_ms:
        return Wait(arrived_ms, (until_ms - arrived_ms) / 1000.0, False)
    return Wait(arrived_ms, (done_ms - arrived_ms) / 1000.0, True)


def _first_at_or_after(done: Sequence[tuple[int, int]], version: int) -> int | None:
    """The earliest time among ``(version, time_ms)`` pairs whose version is at least ``version``."""
    times = [t for v, t in done if v >= version]
    return min(times) if times else None


def ingest_waits(events: Sequence[Commit], ingest_app_id: str, until_ms: int, *, pending: bool) -> list[Wait]:
    """Ingest's waits: per ``events`` commit by ``ingest_app_id``, its commit time minus the Kafka timestamp of
    the newest message it holds (``topic_identity.last``); with ``pending``, one more input not done, arrived at
    the newest such commit. Commits after ``until_ms`` are left out."""
    mine = [c for c in events if c.meta.get("app_id") == ingest_app_id and c.timestamp_ms <= until_ms]
    out = []
    for c in mine:
        last = (c.meta.get("topic_identity") or {}).get("last") or {}
        stamps = [int(p["timestamp_ms"]) for p in last.values() if p.get("timestamp_ms") is not None]
        if stamps:
            out.append(_wait(max(stamps), c.timestamp_ms, until_ms))
    if pending and mine:
        out.append(_wait(mine[-1].timestamp_ms, None, until_ms))
    return out


def build_waits(events: Sequence[Commit], examples: Sequence[Commit], ingest_app_id: str, build_app_id: str,
                until_ms: int) -> list[Wait]:
    """The build's waits: per ``events`` commit by ingest, until the first ``examples`` commit by the build that
    read that events version or a later one."""
    built = [(int(c.meta["events_version"]), c.timestamp_ms) for c in examples
             if c.meta.get("app_id") == build_app_id and c.meta.get("events_version") is not None]
    return [_wait(c.timestamp_ms, _first_at_or_after(built, c.version), until_ms)
            for c in events if c.meta.get("app_id") == ingest_app_id and c.timestamp_ms <= until_ms]


def validate_waits(inputs: Mapping[str, Sequence[Commit]], runs: Mapping[str, Sequence[tuple[int, int]]],
                   until_ms: int) -> list[Wait]:
    """Validation's waits: per commit of ``inputs`` (table -> the commits validation must judge), until the first
    run of ``runs`` (table -> ``(table_version, run_ts_ms)``) at or after its version: events validation judges
    every version up to the newest in one run."""
    out = [_wait(c.timestamp_ms, _first_at_or_after(runs.get(table, ()), c.version), until_ms)
           for table, commits in inputs.items() for c in commits if c.timestamp_ms <= until_ms]
    return sorted(out, key=lambda w: w.arrived_ms)


def train_waits(published: Sequence[Commit], trained: Mapping[int, tuple[float, int]], until_ms: int) -> list[Wait]:
    """The trainer's waits: per ``examples`` commit that added rows, its rows' median published->trained
    (``trained``: version -> (p50 in s, when the trainer wrote it, ms)); a version not trained by ``until_ms``
    waits since its commit."""
    out = []
    for c in published:
        if c.timestamp_ms > until_ms:
            continue
        p50_s, wrote_ms = trained.get(c.version, (math.nan, None))
        if wrote_ms is None or wrote_ms > until_ms:
            out.append(_wait(c.timestamp_ms, None, until_ms))
        else:
            out.append(Wait(c.timestamp_ms, p50_s, True))
    return out


def distill_waits(teacher_ms: Mapping[int, int], distilled_ms: Mapping[int, int | None], until_ms: int) -> list[Wait]:
    """The students' waits: per examples version the teacher trained (version -> when, ms), until the students
    recorded it (version -> when, ms; None: recorded by a checkpoint older than ``distilled_ms``, left out)."""
    return [_wait(t, distilled_ms.get(v), until_ms) for v, t in sorted(teacher_ms.items(), key=lambda vt: vt[1])
            if t <= until_ms and not (v in distilled_ms and distilled_ms[v] is None)]


def commits(lake: Lake, table: str) -> list[Commit]:
    """Every commit of ``table`` in version order (empty when the table does not exist): one log file read per
    commit, for a run's analysis afterwards, not for a poll."""
    dt = open_table(lake, table)
    if dt is None:
        return []
    out = [Commit(int(e["version"]), int(e["timestamp"]), json.loads(e["gemline"]) if e.get("gemline") else {})
           for e in dt.history()]
    return sorted(out, key=lambda c: c.version)


def _quality_runs(lake: Lake) -> dict[str, list[tuple[int, int]]]:
    """table -> (table_version, run_ts_ms) of every validation run (a release is not one)."""
    rows = read_table(lake, Table.QUALITY, columns=["table", "table_version", "run_ts_ms", "expectation"])
    out: dict[str, list[tuple[int, int]]] = {}
    if rows is None:
        return out
    rows = rows.filter(pc.not_equal(rows["expectation"], RELEASE))
    for r in rows.select(["table", "table_version", "run_ts_ms"]).to_pylist():
        out.setdefault(r["table"], []).append((int(r["table_version"]), int(r["run_ts_ms"])))
    return out


def _trained(lake: Lake) -> dict[int, tuple[float, int]]:
    """examples version -> (median published->trained in s, when written, ms) from the ``freshness`` table: the
    first run that trained each version."""
    from trainer.freshness import HOPS  # the hop names: trainer.freshness is a leaf module (no torch import)

    rows = read_table(lake, Table.FRESHNESS, columns=["examples_version", "hop", "p50_s", "wall_time_ms"])
    out: dict[int, tuple[float, int]] = {}
    if rows is None:
        return out
    for r in rows.filter(pc.equal(rows["hop"], HOPS[1])).to_pylist():
        v, seen = int(r["examples_version"]), out.get(int(r["examples_version"]))
        if seen is None or r["wall_time_ms"] < seen[1]:
            out[v] = (float(r["p50_s"]), int(r["wall_time_ms"]))
    return out


def _distilled(lake: Lake) -> dict[int, int | None]:
    """examples version -> when the students recorded it (ms; None when their checkpoint did not say), from their
    newest checkpoint."""
    meta = distill_meta(lake)
    versions: Iterable[dict[str, Any]] = [] if meta is None else meta.get("extra", {}).get("versions", [])
    return {int(v["version"]): None if v.get("distilled_ms") is None else int(v["distilled_ms"]) for v in versions}


def stage_waits(lake: Lake, *, ingest_app_id: str, until_ms: int, ingest_pending: bool = True,
                distill: bool = True) -> dict[str, list[Wait]]:
    """Each stage's waits (module docstring) for the inputs that arrived by ``until_ms``, keyed by stage:
    ``ingest``, ``validate``, ``build``, ``train`` and, with ``distill``, ``distill``. Reads the whole ``events``
    and ``examples`` logs: for a run's analysis afterwards, not for a poll."""
    from sequences.pipeline import APP_ID as BUILD_APP_ID  # the build's writer id

    events, examples = commits(lake, Table.EVENTS), commits(lake, Table.EXAMPLES)
    built = [c for c in examples if c.meta.get("app_id") == BUILD_APP_ID]
    ingested = [c for c in events if c.meta.get("app_id") == ingest_app_id]
    published = [c for c in built
                 if (read_increment(lake.root, Table.EXAMPLES, c.version,
                                    storage_options=lake.storage_options).num_records or 0) > 0]
    trained = _trained(lake)
    out = {"ingest": ingest_waits(events, ingest_app_id, until_ms, pending=ingest_pending),
           "validate": validate_waits({Table.EVENTS: ingested, Table.EXAMPLES: built}, _quality_runs(lake), until_ms),
           "build": build_waits(events, examples, ingest_app_id, BUILD_APP_ID, until_ms),
           "train": train_waits(published, trained, until_ms)}
    if distill:
        out["distill"] = distill_waits({v: ms for v, (_, ms) in trained.items()}, _distilled(lake), until_ms)
    return out


@dataclass(frozen=True)
class Trend:
    """How a stage's waits moved over a window (:func:`wait_trend`)."""

    inputs: int
    median_s: float
    max_s: float
    rise_s: float
    """The least-squares line's rise over the window, s (slope x window length)."""
    p: float
    """One-sided p-value of a slope > 0 (t-test of the slope; nan for an exact line)."""
    growing: bool
    stalled: bool = False
    """An input not done yet has waited at least ``rise_s`` longer than any done one in the window: a stage
    that stopped gives its newest inputs the shortest waits, which a line alone reads as falling."""


def wait_trend(waits: Sequence[Wait], since_ms: int, until_ms: int, *, rise_s: float = 10.0,
               alpha: float = 0.05) -> Trend | None:
    """The trend of the waits of the inputs that arrived in ``[since_ms, until_ms]``: growing when the
    least-squares line of wait against arrival time rises by at least ``rise_s`` over the window and its slope
    is > 0 with one-sided p < ``alpha`` (``scipy.stats.linregress``). Both are needed: the significance test
    alone flags rises of a second (a stage's cadence moves its waits by more), the rise alone flags noise.
    Growing too when the stage has stalled (:attr:`Trend.stalled`). None with fewer than 3 inputs.

    Raises:
        ValueError: ``until_ms`` is not after ``since_ms``.
    """
    if until_ms <= since_ms:
        raise ValueError(f"wait_trend: the window [{since_ms}, {until_ms}] ms is empty")
    mine = [w for w in waits if since_ms <= w.arrived_ms <= until_ms]
    if len(mine) < 3:
        return None
    x = [w.arrived_ms / 1000.0 for w in mine]
    y = [w.wait_s for w in mine]
    ordered = sorted(y)
    median = (ordered[(len(y) - 1) // 2] + ordered[len(y) // 2]) / 2
    longest_done = max((w.wait_s for w in mine if w.done), default=0.0)
    stalled = any(not w.done and w.wait_s >= longest_done + rise_s for w in mine)
    if len(set(x)) == 1 or len(set(y)) == 1:
        return Trend(len(mine), median, max(y), 0.0, math.nan, stalled, stalled)
    fit = stats.linregress(x, y)
    rise = float(fit.slope) * (until_ms - since_ms) / 1000.0
    p = float(fit.pvalue) / 2 if fit.slope > 0 else 1.0 - float(fit.pvalue) / 2
    significant = fit.slope > 0 and (math.isnan(fit.pvalue) or p < alpha)  # nan: an exact line
    return Trend(len(mine), median, max(y), rise, p, bool(significant and rise >= rise_s) or stalled, stalled)
