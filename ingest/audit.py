"""``gemline audit``: prove that every Kafka offset the lake read is accounted for exactly once.

Per (topic, generation, partition) (the generation: :mod:`ingest.schema`, ``kafka_generation``), over the whole
``events`` log:

    read        = the offsets in the ``offset_ranges`` of every ingest batch (``ingest:<topic>`` commits of
                  ``events``); retention gaps lie outside them and are listed apart, never as lost
    accounted   = events rows + dead_letter rows + late_events rows + duplicates dropped
                  (``duplicates_dropped_offsets`` of the batch) - records a backfill moved
                  (``readmitted_offsets`` of the ``backfill:late_events`` commits)

Both sides are multisets of offsets. For each offset, ``net = accounted - read``: below 0 it is lost (by that
many), above 0 doubled. Summed, ``read = events + dead_letter + late + duplicates - backfilled + lost - doubled``.
A record a backfill re-admitted sits in ``late_events`` and ``events``: one record moved, counted once.

Batches committed before an ingest recorded which offsets it dropped (``duplicates_dropped`` is then a count
only) are reconciled *by count*: the offsets of such batches that nothing else accounts for are taken as its
dropped duplicates, up to the recorded count per generation. The same for backfills without
``readmitted_offsets``: records in both ``late_events`` and ``events`` up to their ``rows_readmitted``. Rows
without a generation (written before ``kafka_generation``) are reconciled against the batches without one.

Reads only the key columns of the three tables, in record batches, and keeps each group's offsets as numpy
arrays (about 8 bytes per row, plus the expanded read ranges of the group being reconciled).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow.compute as pc

from gemline.errors import GemlineError, MissingInputError
from gemline.lake import Lake, open_table
from gemline.tables import Table

INGEST_PREFIX = "ingest:"
BACKFILL_APP_ID = "backfill:late_events"  # ingest.backfill.BACKFILL_APP_ID (not imported: that pulls in the job)
LEGACY = -1
"""The generation key of rows and batches from before ``kafka_generation`` (shown as ``-``, JSON null)."""
MAX_RANGES = 20
"""Offset ranges listed per failure kind; the rest are counted."""

_KEYS = ("kafka_topic", "kafka_partition", "kafka_offset")
_ROW_TABLES = (Table.EVENTS, Table.DEAD_LETTER, Table.LATE_EVENTS)


class IngestUnsettledError(GemlineError, RuntimeError):
    """An ingest batch is committed to ``dead_letter`` or ``late_events`` but not yet to ``events`` (a crashed
    ingest): its offsets are not recorded as read yet. Run ``gemline ingest`` to finish it, then audit (exit 2)."""


Group = tuple[str, int, int]
"""(topic, generation or :data:`LEGACY`, partition)."""


@dataclass
class _Batch:
    topic: str
    txn_version: int
    generation: int
    ranges: dict[int, list[tuple[int, int]]]
    dropped: dict[int, list[tuple[int, int]]] | None
    """Dropped duplicate offsets per partition; None: the batch recorded only their count."""
    dropped_count: int
    topic_id: str | None
    gaps: list[dict[str, Any]]


@dataclass
class _Backfill:
    moved: list[tuple[Group, list[tuple[int, int]]]] | None
    """Re-admitted offsets per group; None: the commit recorded only their count."""
    count: int


@dataclass
class _Row:
    """One line of the audit: a (topic, generation, partition) group."""

    topic: str
    generation: int
    partition: int
    read: int = 0
    events: int = 0
    dead_letter: int = 0
    late: int = 0
    duplicates: int = 0
    backfilled: int = 0
    lost: int = 0
    doubled: int = 0
    lost_at: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """The lost offsets, sorted, one entry per missing copy."""
    doubled_at: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """The doubled offsets, sorted, one entry per extra copy."""
    maybe_dropped: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    """Per ``lost_at``: in a batch that recorded only its duplicates' count."""
    maybe_moved: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    """Per ``doubled_at``: in both events and late_events, while some backfill recorded only its count."""
    by_count: bool = False


def _runs(pairs: Iterable[Iterable[int]]) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in pairs]


def _expand(runs: list[tuple[int, int]]) -> np.ndarray:
    """Every offset of half-open ``runs`` (with repeats where runs overlap), int64."""
    if not runs:
        return np.zeros(0, np.int64)
    starts = np.array([a for a, _ in runs], np.int64)
    lengths = np.array([max(b - a, 0) for a, b in runs], np.int64)
    total = int(lengths.sum())
    return np.repeat(starts - np.r_[0, np.cumsum(lengths)[:-1]], lengths) + np.arange(total, dtype=np.int64)


def ranges_of(offsets: np.ndarray) -> list[tuple[int, int]]:
    """Sorted distinct ``offsets`` as half-open runs of consecutive offsets."""
    if len(offsets) == 0:
        return []
    u = np.unique(offsets)
    cut = np.flatnonzero(np.diff(u) != 1) + 1
    starts, ends = np.r_[0, cut], np.r_[cut, len(u)]
    return [(int(u[a]), int(u[b - 1]) + 1) for a, b in zip(starts, ends)]


def _log(lake: Lake, table: Table) -> tuple[list[tuple[int, dict[str, Any]]], int | None]:
    """(Delta version, gemline metadata) of ``table``'s commits that carry it, oldest first, and the oldest version
    the log still holds (None: no table), from one read of the history."""
    dt = open_table(lake.root, table, storage_options=lake.delta_options)
    entries = [] if dt is None else [e for e in dt.history() if "version" in e]
    out = [(int(e["version"]), json.loads(e["gemline"])) for e in entries if e.get("gemline")]
    return sorted(out, key=lambda e: e[0]), min((int(e["version"]) for e in entries), default=None)


def _history(lake: Lake, table: Table) -> list[tuple[int, dict[str, Any]]]:
    """(Delta version, gemline metadata) of ``table``'s commits, oldest first; [] without the table."""
    return _log(lake, table)[0]


def _commits(lake: Lake) -> tuple[list[_Batch], list[_Backfill], int | None]:
    """The ingest batches and backfills of the ``events`` log, and the oldest version the log still holds."""
    batches: list[_Batch] = []
    backfills: list[_Backfill] = []
    history, oldest = _log(lake, Table.EVENTS)
    for _, meta in history:
        app = str(meta.get("app_id", ""))
        if app.startswith(INGEST_PREFIX) and "offset_ranges" in meta:
            ranges: dict[int, list[tuple[int, int]]] = {}
            for r in meta["offset_ranges"]:
                if int(r["end"]) > int(r["start"]):
                    ranges.setdefault(int(r["partition"]), []).append((int(r["start"]), int(r["end"])))
            recorded = meta.get("duplicates_dropped_offsets")
            dropped = None if recorded is None else {int(p): _runs(v) for p, v in recorded.items()}
            identity = meta.get("topic_identity") or {}
            generation = meta.get("generation")
            batches.append(_Batch(app[len(INGEST_PREFIX):], int(meta.get("txn_version", -1)),
                                  LEGACY if generation is None else int(generation), ranges, dropped,
                                  int(meta.get("duplicates_dropped", 0)), identity.get("topic_id"),
                                  list(meta.get("gaps", []))))
        elif app == BACKFILL_APP_ID:
            entries = meta.get("readmitted_offsets")
            moved = None if entries is None else [
                ((str(e["topic"]), LEGACY if e["generation"] is None else int(e["generation"]), int(e["partition"])),
                 _runs(e["runs"])) for e in entries]
            backfills.append(_Backfill(moved, int(meta.get("rows_readmitted", 0))))
    return batches, backfills, oldest


def _check_settled(lake: Lake, batches: list[_Batch]) -> None:
    """Raise :class:`IngestUnsettledError` when a table other than ``events`` holds a later batch of an app."""
    done: dict[str, int] = {}
    for b in batches:
        done[b.topic] = max(done.get(b.topic, -1), b.txn_version)
    for table in (Table.DEAD_LETTER, Table.LATE_EVENTS):
        for _, meta in _history(lake, table)[-50:]:  # a half-committed batch is among the newest commits
            app = str(meta.get("app_id", ""))
            topic = app[len(INGEST_PREFIX):]
            if app.startswith(INGEST_PREFIX) and int(meta.get("txn_version", -1)) > done.get(topic, -1):
                raise IngestUnsettledError(
                    f"ingest batch {meta.get('txn_version')} of {app!r} is in {table} but not yet in {Table.EVENTS} "
                    "(an ingest crashed mid-commit): run `gemline ingest` to finish it, then audit")


def _read_keys(lake: Lake, table: Table) -> dict[Group, np.ndarray]:
    """The offsets of ``table``'s rows per (topic, generation, partition): key columns only, batch by batch."""
    dt = open_table(lake.root, table, storage_options=lake.delta_options)
    if dt is None:
        return {}
    dataset = dt.to_pyarrow_dataset()
    has_generation = "kafka_generation" in dataset.schema.names
    columns = [*_KEYS, "kafka_generation"] if has_generation else list(_KEYS)
    parts: dict[Group, list[np.ndarray]] = {}
    for batch in dataset.to_batches(columns=columns):
        if batch.num_rows == 0:
            continue
        topics = pc.dictionary_encode(batch.column("kafka_topic"))
        names = topics.dictionary.to_pylist()
        topic_idx = topics.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        gen = (pc.fill_null(batch.column("kafka_generation"), LEGACY).to_numpy(zero_copy_only=False).astype(np.int64)
               if has_generation else np.full(batch.num_rows, LEGACY, np.int64))
        part = batch.column("kafka_partition").to_numpy(zero_copy_only=False).astype(np.int64)
        offsets = batch.column("kafka_offset").to_numpy(zero_copy_only=False).astype(np.int64)
        key = (topic_idx << 48) | ((gen + 1) << 24) | part
        uniq, inverse = np.unique(key, return_inverse=True)
        order = np.argsort(inverse, kind="stable")
        bounds = np.r_[0, np.cumsum(np.bincount(inverse, minlength=len(uniq)))]
        for i, k in enumerate(uniq.tolist()):
            group = (str(names[k >> 48]), ((k >> 24) & 0xFFFFFF) - 1, k & 0xFFFFFF)
            parts.setdefault(group, []).append(offsets[order[bounds[i]:bounds[i + 1]]])
    return {g: np.concatenate(v) for g, v in parts.items()}


def _net(read: np.ndarray, plus: list[np.ndarray], minus: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct offsets, accounted - read at each) for the multisets ``read`` and ``plus`` - ``minus``."""
    keys = np.concatenate([read, *plus, minus])
    weights = np.concatenate([np.full(len(read), -1, np.int64), *(np.ones(len(p), np.int64) for p in plus),
                              np.full(len(minus), -1, np.int64)])
    uniq, inverse = np.unique(keys, return_inverse=True)
    return uniq, np.bincount(inverse, weights=weights, minlength=len(uniq)).astype(np.int64)


def _by_count(rows: list[_Row], kind: str, count: int) -> tuple[int, bool]:
    """Take up to ``count`` of the rows' candidates (``kind`` "lost": offsets of count-only batches, as their dropped
    duplicates; "doubled": records in events and late_events, as moved by count-only backfills), in (row, offset)
    order. When there are no more candidates than ``count`` they all are taken out of the rows' lost or doubled
    offsets (exact); otherwise only the counts move, and every candidate stays listed, since which of them the
    count meant is not recorded. Returns (how many were taken, whether that was exact)."""
    exact = sum(int((r.maybe_dropped if kind == "lost" else r.maybe_moved).sum()) for r in rows) <= count
    taken = 0
    for row in rows:
        at, cand = (row.lost_at, row.maybe_dropped) if kind == "lost" else (row.doubled_at, row.maybe_moved)
        picked = np.flatnonzero(cand)[: max(count - taken, 0)]
        if len(picked) == 0:
            continue
        if exact:
            keep = np.ones(len(at), bool)
            keep[picked] = False
            at, cand = at[keep], cand[keep]
        if kind == "lost":
            row.lost_at, row.maybe_dropped, row.duplicates = at, cand, row.duplicates + len(picked)
            row.lost -= len(picked)
        else:
            row.doubled_at, row.maybe_moved, row.backfilled = at, cand, row.backfilled + len(picked)
            row.doubled -= len(picked)
        row.by_count = True
        taken += len(picked)
    return taken, exact


def audit(lake: Lake) -> dict[str, Any]:
    """Reconcile the offsets ``lake`` read with its ``events``, ``dead_letter`` and ``late_events`` rows, the
    duplicates each ingest batch dropped and the records backfills moved (the module docstring's formula).

    Returns:
        ``{"lost", "doubled", "clean", "groups": [{"topic", "generation", "topic_ids", "partition", "read",
        "events", "dead_letter", "late", "duplicates", "backfilled", "lost", "doubled", "by_count"}],
        "lost_offsets", "doubled_offsets": [{"topic", "generation", "partition", "ranges": [[start, end), ...]}]
        (at most :data:`MAX_RANGES` ranges in all; ``*_ranges_left_off``: how many more), "gaps", "notes",
        "unplaced": {"lost", "doubled"}}`` (generation None: rows and batches from before generations).

    Raises:
        MissingInputError: the lake has no ``events`` table.
        IngestUnsettledError: an ingest batch is half committed (run ``gemline ingest`` first).
    """
    if open_table(lake.root, Table.EVENTS, storage_options=lake.delta_options) is None:
        raise MissingInputError(f"no {Table.EVENTS} table in {lake} yet, so nothing to audit: `gemline ingest` writes it")
    batches, backfills, oldest = _commits(lake)
    _check_settled(lake, batches)
    tables = {t: _read_keys(lake, t) for t in _ROW_TABLES}

    read: dict[Group, list[tuple[int, int]]] = {}
    count_only_read: dict[Group, list[tuple[int, int]]] = {}
    dropped: dict[Group, list[tuple[int, int]]] = {}
    count_only: dict[tuple[str, int], int] = {}  # (topic, generation) -> duplicates of batches without offsets
    count_only_batches: dict[tuple[str, int], list[int]] = {}
    topic_ids: dict[tuple[str, int], list[str]] = {}
    gaps: list[dict[str, Any]] = []
    for b in batches:
        ident = (b.topic, b.generation)
        if b.topic_id and b.topic_id not in topic_ids.setdefault(ident, []):
            topic_ids[ident].append(b.topic_id)
        topic_ids.setdefault(ident, [])
        for p, runs in b.ranges.items():
            read.setdefault((b.topic, b.generation, p), []).extend(runs)
            if b.dropped is None:
                count_only_read.setdefault((b.topic, b.generation, p), []).extend(runs)
        if b.dropped is None:
            count_only_batches.setdefault(ident, []).append(b.txn_version)
            count_only[ident] = count_only.get(ident, 0) + b.dropped_count
        else:
            for p, runs in b.dropped.items():
                dropped.setdefault((b.topic, b.generation, p), []).extend(runs)
        gaps += [{"topic": b.topic, "generation": None if b.generation == LEGACY else b.generation,
                  "partition": int(g["partition"]), "start": int(g["start"]), "end": int(g["end"])} for g in b.gaps]
    moved: dict[Group, list[tuple[int, int]]] = {}
    moved_by_count = 0
    for f in backfills:
        if f.moved is None:
            moved_by_count += f.count
        else:
            for group, runs in f.moved:
                moved.setdefault(group, []).extend(runs)

    groups = sorted(set(read) | set(dropped) | set(moved) | {g for rows in tables.values() for g in rows})
    rows: list[_Row] = []
    empty = np.zeros(0, np.int64)
    for g in groups:
        r = _Row(*g)
        ev, dl, lt = (tables[t].get(g, empty) for t in _ROW_TABLES)
        rd, du, mv = _expand(read.get(g, [])), _expand(dropped.get(g, [])), _expand(moved.get(g, []))
        r.read, r.events, r.dead_letter, r.late, r.duplicates, r.backfilled = (len(rd), len(ev), len(dl), len(lt),
                                                                              len(du), len(mv))
        uniq, net = _net(rd, [ev, dl, lt, du], mv)
        r.lost_at, r.doubled_at = np.repeat(uniq, np.maximum(-net, 0)), np.repeat(uniq, np.maximum(net, 0))
        r.lost, r.doubled = len(r.lost_at), len(r.doubled_at)
        # Candidates for the batches and backfills that recorded only a count.
        r.maybe_dropped = np.isin(r.lost_at, _expand(count_only_read.get(g, [])))
        r.maybe_moved = (np.isin(r.doubled_at, ev) & np.isin(r.doubled_at, lt) if moved_by_count
                         else np.zeros(r.doubled, bool))
        rows.append(r)

    notes: list[str] = []
    unplaced = {"lost": 0, "doubled": 0}
    for ident, count in sorted(count_only.items()):
        mine = [r for r in rows if (r.topic, r.generation) == ident]
        taken, exact = _by_count(mine, "lost", count)
        unplaced["doubled"] += count - taken
        versions = count_only_batches[ident]
        notes.append(f"by count: {len(versions)} batch(es) of {INGEST_PREFIX}{ident[0]} generation "
                     f"{_gen_text(ident[1])} ({_span(versions)}) recorded only how many duplicates they dropped "
                     f"({count}); the offsets nothing else accounts for in them were taken as those ({taken})"
                     + (f"; {count - taken} more were counted than are missing (doubled, offsets unknown)"
                        if count > taken else "")
                     + ("" if exact else "; more of their offsets are missing than were counted: the lost offsets "
                                         "listed include the dropped ones, which are not recorded"))
    if moved_by_count:
        taken, exact = _by_count(rows, "doubled", moved_by_count)
        unplaced["lost"] += moved_by_count - taken
        notes.append(f"by count: backfills that recorded only how many records they re-admitted ({moved_by_count}): "
                     f"records in both late_events and events were taken as those ({taken})"
                     + (f"; {moved_by_count - taken} of them are no longer in events (lost, offsets unknown)"
                        if moved_by_count > taken else "")
                     + ("" if exact else "; more records are in both than were counted: the doubled offsets listed "
                                         "include the moved ones, which are not recorded"))
    backfilled = sum(r.backfilled for r in rows)
    if backfilled:
        notes.append(f"backfilled: {backfilled} record(s) a backfill re-admitted from late_events are in late_events "
                     "and events: one record moved, counted once (not doubled)")
    if gaps:
        notes.append(f"gaps: {sum(g['end'] - g['start'] for g in gaps)} offset(s) were deleted by retention before "
                     "ingest read them (not read, so not lost here; listed under gaps)")
    if oldest:
        notes.append(f"the events log before version {oldest} has expired: the offsets its batches read are unknown, "
                     "so their rows show as doubled")

    lost = sum(r.lost for r in rows) + unplaced["lost"]  # r.lost <= len(r.lost_at) where candidates stay listed
    doubled = sum(r.doubled for r in rows) + unplaced["doubled"]
    lost_offsets, lost_left = _offsets(rows, "lost")
    doubled_offsets, doubled_left = _offsets(rows, "doubled")
    return {
        "lost": lost, "doubled": doubled, "clean": lost == 0 and doubled == 0,
        "groups": [{"topic": r.topic, "generation": None if r.generation == LEGACY else r.generation,
                    "topic_ids": topic_ids.get((r.topic, r.generation), []), "partition": r.partition,
                    "read": r.read, "events": r.events, "dead_letter": r.dead_letter, "late": r.late,
                    "duplicates": r.duplicates, "backfilled": r.backfilled, "lost": r.lost, "doubled": r.doubled,
                    "by_count": r.by_count} for r in rows],
        "lost_offsets": lost_offsets, "lost_ranges_left_off": lost_left,
        "doubled_offsets": doubled_offsets, "doubled_ranges_left_off": doubled_left,
        "unplaced": unplaced, "gaps": gaps, "notes": notes,
    }


def _offsets(rows: list[_Row], kind: str) -> tuple[list[dict[str, Any]], int]:
    """The offsets of ``kind`` ("lost", "doubled") as ranges per group, at most :data:`MAX_RANGES` in all."""
    out, listed, left = [], 0, 0
    for r in rows:
        ranges = ranges_of(getattr(r, f"{kind}_at"))
        room = max(MAX_RANGES - listed, 0)
        if ranges and room:
            out.append({"topic": r.topic, "generation": None if r.generation == LEGACY else r.generation,
                        "partition": r.partition, "ranges": [list(x) for x in ranges[:room]]})
        listed += min(len(ranges), room)
        left += max(len(ranges) - room, 0)
    return out, left


def _gen_text(generation: int | None) -> str:
    return "-" if generation is None or generation == LEGACY else str(generation)


def _span(versions: list[int]) -> str:
    versions = sorted(versions)
    return f"batch {versions[0]}" if len(versions) == 1 else f"batches {versions[0]}..{versions[-1]}"


def format_report(result: dict[str, Any]) -> str:
    """``result`` of :func:`audit` as the human table of ``gemline audit``: one line per (topic, generation,
    partition), the notes, the offsets that break the reconciliation, and last ``lost=L doubled=D``."""
    head = ("topic", "gen", "topic_id", "part", "read", "events", "dead_letter", "late", "duplicates", "backfilled",
            "lost", "doubled")
    lines = [head]
    for g in result["groups"]:
        ids = ",".join(g["topic_ids"]) or "-"
        lines.append((g["topic"], _gen_text(g["generation"]), ids, str(g["partition"]), str(g["read"]),
                      str(g["events"]), str(g["dead_letter"]), str(g["late"]),
                      f"{g['duplicates']}{'*' if g['by_count'] else ''}", str(g["backfilled"]), str(g["lost"]),
                      str(g["doubled"])))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
            for row in lines]
    if any(g["by_count"] for g in result["groups"]):
        text.append("* reconciled by count (see the notes)")
    text += [f"note: {n}" for n in result["notes"]]
    for g in result["gaps"]:
        text.append(f"gap: {g['topic']} gen {_gen_text(g['generation'])} [{g['partition']}] {g['start']}..{g['end'] - 1} "
                    f"({g['end'] - g['start']} offsets deleted by retention before they were read)")
    for kind in ("lost", "doubled"):
        for e in result[f"{kind}_offsets"]:
            spans = ", ".join(f"{a}..{b - 1}" if b - a > 1 else str(a) for a, b in e["ranges"])
            text.append(f"{kind}: {e['topic']} gen {_gen_text(e['generation'])} [{e['partition']}] offsets {spans}")
        if result[f"{kind}_ranges_left_off"]:
            text.append(f"{kind}: ... and {result[f'{kind}_ranges_left_off']} more range(s) (the first {MAX_RANGES} "
                        "are listed)")
        if result["unplaced"][kind]:
            text.append(f"{kind}: {result['unplaced'][kind]} by count, offsets unknown (see the notes)")
    text.append(f"lost={result['lost']} doubled={result['doubled']}")
    return "\n".join(text)

