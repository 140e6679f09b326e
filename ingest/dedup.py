"""Batch-level event-time rules of the ingest job: duplicate deliveries and late events.

Both are pure functions of the parsed batch and of state read from the lake (the event ids already
committed, the per-partition watermarks in the last ``events`` commit), so a rerun of a crashed
batch decides exactly as the crashed run did.

Shape letters: N events rows in the batch, C committed (event_id, event_time_ms) pairs looked up.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from ingest.schema import LATE_EVENTS_SCHEMA

_MS_PER_DAY = 86_400_000
_EPOCH = dt.date(1970, 1, 1)


def dates_between(min_ms: int, max_ms: int) -> list[str]:
    """Every UTC date ``YYYY-MM-DD`` from the day of ``min_ms`` to that of ``max_ms`` (ms since epoch), inclusive.

    Raises:
        ValueError: ``min_ms > max_ms``.
    """
    if min_ms > max_ms:
        raise ValueError(f"dates_between: expected min_ms <= max_ms, got {min_ms} > {max_ms}")
    first, last = min_ms // _MS_PER_DAY, max_ms // _MS_PER_DAY
    return [(_EPOCH + dt.timedelta(days=d)).isoformat() for d in range(first, last + 1)]


def committed_ids(dataset: pads.Dataset | None, events: pa.Table, window_ms: int) -> pa.Table:
    """(event_id, event_time_ms) rows of the committed ``events`` that could be copies of ``events``' rows.

    A filtered read: only the ``event_date`` partitions within ``window_ms`` of the batch's event
    times, only the batch's event ids.

    Args:
        dataset: the events table as a pyarrow dataset (``DeltaTable.to_pyarrow_dataset()``), None if no table yet.
        events: N rows with ``event_id`` and ``event_time_ms`` (ms since epoch UTC).
        window_ms: the dedup window, ms.

    Returns:
        C rows, columns ``event_id`` (string) and ``event_time_ms`` (int64).
    """
    schema = pa.schema([("event_id", pa.string()), ("event_time_ms", pa.int64())])
    if dataset is None or events.num_rows == 0:
        return schema.empty_table()
    times = events["event_time_ms"]
    dates = dates_between(pc.min(times).as_py() - window_ms, pc.max(times).as_py() + window_ms)
    ids = pc.unique(events["event_id"])
    filt = pc.field("event_date").isin(dates) & pc.field("event_id").isin(ids)
    return dataset.to_table(columns=["event_id", "event_time_ms"], filter=filt).cast(schema)


def drop_duplicates(events: pa.Table, committed: pa.Table, window_ms: int) -> tuple[pa.Table, int]:
    """Drop second deliveries: a row whose event_id has an earlier copy within ``window_ms`` of event time.

    An earlier copy is a committed row (``committed``) or a kept row before it in ``events``' order
    (Kafka order: the caller sorts by partition, offset). Copies farther apart than the window are
    kept: ids are unique only within the window.

    Args:
        events: N rows of the events table schema, in Kafka order.
        committed: C rows (event_id, event_time_ms) already in the lake (:func:`committed_ids`).
        window_ms: the dedup window, ms (``IngestConfig.dedup_window_ms``).

    Returns:
        (the kept rows in their order, the number dropped).
    """
    if events.num_rows == 0:
        return events, 0
    ids = events["event_id"].combine_chunks()
    all_ids = pa.concat_arrays([ids, committed["event_id"].combine_chunks().cast(pa.string())])
    counts = pc.value_counts(all_ids)
    repeated = pc.filter(counts.field("values"), pc.greater(counts.field("counts"), 1))
    if len(repeated) == 0:
        return events, 0
    # Only ids seen twice need the ordered walk below; they are rare, so Python is fine here.
    kept_times: dict[str, list[int]] = {}
    for eid, ms in zip(committed["event_id"].to_pylist(), committed["event_time_ms"].to_pylist()):
        kept_times.setdefault(eid, []).append(ms)
    suspect = np.flatnonzero(pc.is_in(ids, value_set=repeated).to_numpy(zero_copy_only=False))
    times = events["event_time_ms"].to_numpy()
    keep = np.ones(events.num_rows, dtype=bool)
    for i, eid in zip(suspect, ids.take(pa.array(suspect)).to_pylist()):
        earlier = kept_times.setdefault(eid, [])
        if any(abs(int(times[i]) - t) <= window_ms for t in earlier):
            keep[i] = False
        else:
            earlier.append(int(times[i]))
    dropped = int((~keep).sum())
    # Copying every column costs ~0.3 us per row: only when something is dropped.
    return (events.filter(pa.array(keep)) if dropped else events), dropped


PAYLOAD_FIELDS: tuple[str, ...] = ("event_id", "event_time_us", "user_id", "item_id", "domain", "event_type",
                                   "category", "position", "ad_format", "age", "gender", "location")
"""What two deliveries of an event must agree on to be copies of one event (the Event fields, time in us)."""


def committed_payloads(dataset: pads.Dataset | None, ids: pa.Array, times_ms: pa.Array, window_ms: int) -> pa.Table:
    """The :data:`PAYLOAD_FIELDS` (and ``event_time_ms``) of committed events with an id in ``ids`` (a filtered
    read like :func:`committed_ids`; ``times_ms`` bound the ``event_date`` partitions read, ms since epoch UTC)."""
    columns = ["event_time_ms", *PAYLOAD_FIELDS]
    if dataset is None or len(ids) == 0:
        return pa.table({c: pa.array([], pa.int64() if c.endswith(("_ms", "_us")) else pa.string()) for c in columns})
    dates = dates_between(pc.min(times_ms).as_py() - window_ms, pc.max(times_ms).as_py() + window_ms)
    filt = pc.field("event_date").isin(dates) & pc.field("event_id").isin(ids)
    return dataset.to_table(columns=columns, filter=filt)


def split_conflicts(batch: pa.Table, kept: pa.Table, committed: pa.Table, window_ms: int) -> tuple[pa.Table, int]:
    """Of the rows :func:`drop_duplicates` dropped, those whose payload matches no copy they were dropped for.

    A dropped row was a second delivery of an ``event_id`` within ``window_ms`` of a kept copy
    (committed, or kept in this batch). If its :data:`PAYLOAD_FIELDS` equal those of one such copy it
    is a true duplicate (only counted); otherwise two different events share an id and the later one
    would be lost silently: it goes to ``dead_letter`` as ``duplicate_conflict``.

    Args:
        batch: the N events rows before dedup, in Kafka order.
        kept: the rows ``drop_duplicates`` kept (a subset of ``batch``, same order).
        committed: :func:`committed_payloads` of the batch's ids.
        window_ms: the dedup window, ms.

    Returns:
        (the conflicting dropped rows, of the events table schema; the number of identical duplicates).
    """
    if batch.num_rows == kept.num_rows:
        return batch.slice(0, 0), 0
    def coords(t: pa.Table) -> np.ndarray:
        return (t["kafka_partition"].to_numpy().astype(np.int64) << 40) | t["kafka_offset"].to_numpy().astype(np.int64)

    was_dropped = ~np.isin(coords(batch), coords(kept))
    dropped_ids = pc.unique(batch["event_id"].filter(pa.array(was_dropped)))
    # Only rows sharing an id with a dropped row matter: few, so Python is fine from here.
    same_id = pc.is_in(batch["event_id"], value_set=dropped_ids).to_numpy(zero_copy_only=False)
    involved = np.flatnonzero(same_id)
    rows = batch.take(pa.array(involved)).to_pylist()
    dropped = [j for j, i in enumerate(involved) if was_dropped[i]]
    dropped_set = set(dropped)
    copies: dict[str, list[tuple[int, tuple]]] = {}
    for r in committed.to_pylist() + [r for j, r in enumerate(rows) if j not in dropped_set]:
        copies.setdefault(r["event_id"], []).append((r["event_time_ms"], tuple(r[f] for f in PAYLOAD_FIELDS)))
    conflict = []
    for i in dropped:
        r = rows[i]
        payload = tuple(r[f] for f in PAYLOAD_FIELDS)
        near = [p for t, p in copies.get(r["event_id"], []) if abs(t - r["event_time_ms"]) <= window_ms]
        if payload not in near:
            conflict.append(i)
    table = batch.take(pa.array(involved[conflict], pa.int64())) if conflict else batch.slice(0, 0)
    return table, len(dropped) - len(conflict)


def offset_runs(partitions: np.ndarray, offsets: np.ndarray) -> dict[str, list[list[int]]]:
    """Kafka coordinates as JSON runs: ``{"<partition>": [[start, end), ...]}``, each run a half-open range of
    consecutive offsets, in order; a coordinate given twice counts once. A same-seed restart's duplicates are
    long runs of consecutive offsets, so this stays small where the count is large.

    Args:
        partitions: (N,) ints.
        offsets: (N,) ints, same order.
    """
    if len(offsets) == 0:
        return {}
    parts, offs = np.asarray(partitions, dtype=np.int64), np.asarray(offsets, dtype=np.int64)
    order = np.lexsort((offs, parts))
    parts, offs = parts[order], offs[order]
    keep = np.ones(len(offs), dtype=bool)
    keep[1:] = (parts[1:] != parts[:-1]) | (offs[1:] != offs[:-1])
    parts, offs = parts[keep], offs[keep]
    starts = np.flatnonzero(np.r_[True, (parts[1:] != parts[:-1]) | (offs[1:] != offs[:-1] + 1)])
    ends = np.r_[starts[1:], len(offs)]
    out: dict[str, list[list[int]]] = {}
    for a, b in zip(starts.tolist(), ends.tolist()):
        out.setdefault(str(int(parts[a])), []).append([int(offs[a]), int(offs[b - 1]) + 1])
    return out


def dropped_offsets(batch: pa.Table, kept: pa.Table, conflicts: pa.Table) -> dict[str, list[list[int]]]:
    """The Kafka coordinates of the rows :func:`drop_duplicates` dropped as identical duplicates: the rows of
    ``batch`` neither in ``kept`` nor in ``conflicts`` (:func:`split_conflicts`: those go to ``dead_letter``),
    as :func:`offset_runs` (recorded in the ingest commit, ``duplicates_dropped_offsets``, for ``ingest.audit``).

    Args:
        batch: the events rows before dedup; kept, conflicts: subsets of it (the same partitions and offsets).
    """
    def coords(t: pa.Table) -> np.ndarray:
        return (t["kafka_partition"].to_numpy().astype(np.int64) << 40) | t["kafka_offset"].to_numpy().astype(np.int64)

    if batch.num_rows == kept.num_rows:
        return {}
    gone = coords(batch)
    gone = gone[~np.isin(gone, np.concatenate([coords(kept), coords(conflicts)]))]
    return offset_runs(gone >> 40, gone & ((1 << 40) - 1))


def conflict_dead_letter(conflicts: pa.Table, schema: pa.Schema) -> pa.Table:
    """``dead_letter`` rows (reason ``duplicate_conflict``) for the rows of :func:`split_conflicts`.

    The message's bytes are not kept past parsing, so ``raw`` holds the parsed event re-encoded as
    JSON (its Event fields) and ``kafka_key`` is null.
    """
    out = []
    for r in conflicts.to_pylist():
        event = {f: r[f] for f in ("event_id", "event_time_ms", "user_id", "item_id", "domain", "event_type",
                                   "category", "position", "ad_format", "age", "gender", "location",
                                   "schema_version")}
        out.append({"reason": "duplicate_conflict",
                    "detail": f"event_id {r['event_id']!r} was already ingested within the dedup window with "
                              "another payload; this delivery is not the same event",
                    "raw": json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode(),
                    "kafka_topic": r["kafka_topic"], "kafka_partition": r["kafka_partition"],
                    "kafka_offset": r["kafka_offset"], "created_ts_ms": r["created_ts_ms"], "kafka_key": None,
                    "kafka_generation": r.get("kafka_generation")})
    return pa.Table.from_pylist(out, schema=schema)


def split_late(
    events: pa.Table, watermarks_ms: Mapping[int, int], allowed_lateness_ms: int, *, now_ms: int
) -> tuple[pa.Table, pa.Table, dict[int, int]]:
    """Split events into on-time rows and late rows, and advance the per-partition watermarks.

    A row is late when its Kafka partition has a watermark W (the max event time committed for that
    partition by earlier batches) and ``event_time_ms < W - allowed_lateness_ms``. Within one batch
    the watermark does not move: the batch is judged against what was committed before it.

    The watermark never runs ahead of the ingest clock: an on-time event may lie up to
    ``IngestConfig.max_future_skew_ms`` after ``now_ms`` (a producer's clock running fast), and
    were it to become W, the partition's next batches of events at the true time would be judged
    against a future W and could go to ``late_events``. So an event time counts towards the new
    W only up to ``now_ms``. Watermarks never move back either: a W already above ``now_ms``
    (committed before this rule, or by a host whose clock ran ahead) is kept until the clock
    passes it, so with one clock, W <= now_ms of the batch that last moved it.

    Args:
        events: N rows of the events table schema.
        watermarks_ms: partition -> W, ms since epoch UTC (absent: no watermark yet, nothing is late).
        allowed_lateness_ms: tolerated lag behind W, ms.
        now_ms: the batch's ingest clock, ms since epoch UTC (``run_ingest``'s ``now_ms``, reused
            by a recovery run, so the new watermarks are the same).

    Returns:
        (on-time rows, late rows of ``LATE_EVENTS_SCHEMA`` with ``watermark_ms`` and ``lateness_ms =
        W - event_time_ms``, the new watermarks: max(W, min(max on-time event time, now_ms)) per
        partition; a partition without W gets min(max on-time event time, now_ms)).
    """
    parts = events["kafka_partition"].to_numpy().astype(np.int64)
    times = events["event_time_ms"].to_numpy()
    known = np.array(sorted(watermarks_ms), dtype=np.int64)
    known_marks = np.array([watermarks_ms[int(p)] for p in known], dtype=np.int64)
    slot = np.minimum(np.searchsorted(known, parts), max(len(known) - 1, 0))
    has_mark = (known[slot] == parts) if len(known) else np.zeros(len(parts), dtype=bool)
    marks = np.where(has_mark, known_marks[slot] if len(known) else 0, np.iinfo(np.int64).min)
    late = has_mark & (times < np.where(has_mark, marks - allowed_lateness_ms, 0))
    any_late = bool(late.any())
    on_time = events.filter(pa.array(~late)) if any_late else events  # no copy in the usual case
    late_rows = events.filter(pa.array(late)) if any_late else events.slice(0, 0)
    late_rows = late_rows.append_column(LATE_EVENTS_SCHEMA.field("watermark_ms"), pa.array(marks[late], pa.int64()))
    late_rows = late_rows.append_column(LATE_EVENTS_SCHEMA.field("lateness_ms"),
                                        pa.array(marks[late] - times[late], pa.int64()))
    new_marks = {int(p): int(w) for p, w in watermarks_ms.items()}
    on_parts, on_times = parts[~late], times[~late]
    if len(on_parts):
        order = np.argsort(on_parts, kind="stable")
        uniq, starts = np.unique(on_parts[order], return_index=True)
        for p, batch_max in zip(uniq, np.maximum.reduceat(on_times[order], starts)):
            capped = min(int(batch_max), int(now_ms))
            new_marks[int(p)] = max(new_marks.get(int(p), capped), capped)
    return on_time, late_rows.cast(LATE_EVENTS_SCHEMA), new_marks
