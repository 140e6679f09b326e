"""When a pending impression is published, with which labels, and which correction rows follow it.

Three label modes (``build.label_mode``), per impression at event time t in domain D with attribution windows
W_click, W_conversion (``BuildConfig.window_ms``), the longest W = max of them, and waiting window
d = ``BuildConfig.publish_delay(D)`` (at most W):

========  ==========================================  ============================================
mode      first row, published at t + d               then, one correction row per label k
========  ==========================================  ============================================
wait      d = W: the final labels                     none
fnw       labels seen in [t, t + d]                   a label k first seen at t + L, d < L <= W_k:
                                                      a positive row for k, at t + L
defer     labels seen in [t, t + d]                   as fnw; and a label k still negative when its
                                                      window closes: a negative row for k, at t + W_k
========  ==========================================  ============================================

fnw is the fake-negative-weighted stream of Ktena et al. (RecSys 2019, "Addressing delayed feedback for
continuous training with neural networks in CTR prediction", section 3), with a waiting window; defer is
DEFER (Gu et al., KDD 2021, arXiv 2104.14121, section 3.2: "duplicate the delayed positives and the real
negatives"). The trainer's importance weights (:mod:`trainer.delayed`) undo the duplication, so no label
counts twice. With d >= W (a waiting window at least the longest attribution window) neither mode has
corrections, and both publish exactly what wait publishes.

Each publication happens at a *point* (ms since epoch UTC): t + d, t + L or t + W_k. A build publishes the
points in (old close point, close point] (``close_ms``: the watermark, or later at the end of a bounded
replay); an impression first seen in this build also gets the points at or before the old close point,
so the rows never depend on how events were cut into builds. The point of a late positive is its label's
event time: a label that reaches the build after the close point passed it finds its impression already
decided, and is counted in ``orphan_labels`` as expired rather than dropped silently
(:func:`orphan_labels`). An impression stays pending until t + W has passed the close point.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sequences.config import BuildConfig

TASKS: tuple[str, ...] = ("click", "conversion")
"""The labels, in the order of the trainer's heads."""

NO_LABEL = -1
"""Latency value of "no label event in the window" (latencies are ms >= 0)."""

ORPHAN_LABELS_SCHEMA = pa.schema(
    [
        pa.field("event_id", pa.string(), nullable=False),
        pa.field("user_id", pa.string(), nullable=False),
        pa.field("item_id", pa.string(), nullable=False),
        pa.field("domain", pa.string(), nullable=False),
        pa.field("event_type", pa.string(), nullable=False),  # "click" or "conversion"
        pa.field("event_time_ms", pa.int64(), nullable=False),
        pa.field("created_ts_ms", pa.int64(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),  # "no_impression" or "expired"
        pa.field("close_ms", pa.int64(), nullable=False),  # the build's close point when it was found
    ]
)
"""A click or conversion no published example will carry (:func:`orphan_labels`)."""


def _per_domain(domains: list[str] | tuple[list[str], np.ndarray], value) -> np.ndarray:
    """``value(domain)`` of each row, (n,) int64, looked up once per distinct domain: ``domains`` a list of n names
    (the reference), or ``(names, codes)`` with row i's domain ``names[codes[i]]`` (the fast path: no per-row
    Python)."""
    if isinstance(domains, tuple):
        names, codes = domains
        return np.array([value(d) for d in names], dtype=np.int64)[codes]
    cache = {d: value(d) for d in set(domains)}
    return np.array([cache[d] for d in domains], dtype=np.int64)


def _domain_codes(domains: pa.Array | pa.ChunkedArray) -> tuple[list[str], np.ndarray]:
    """``(names, codes)``: the distinct domains and each row's index into them, (n,) int64 (Arrow's dictionary
    encoding).

    Raises:
        ValueError: a null domain.
    """
    if domains.null_count:
        raise ValueError(f"a pending row needs a domain, got {domains.null_count} null(s)")
    array = domains.combine_chunks() if isinstance(domains, pa.ChunkedArray) else domains
    encoded = pc.dictionary_encode(array)
    return encoded.dictionary.to_pylist(), encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)


@dataclass(frozen=True)
class Deadlines:
    """Per-row ms after the impression, from its domain: ``delay`` (the first publication,
    ``BuildConfig.publish_delay``), ``window[task]`` (attribution windows) and ``longest`` (the longest window:
    the row leaves the pending state). Each (n,) int64."""

    delay: np.ndarray
    window: dict[str, np.ndarray]
    longest: np.ndarray


def deadlines(domains: Iterable[str] | pa.Array | pa.ChunkedArray, config: BuildConfig) -> Deadlines:
    """The :class:`Deadlines` of n rows in ``domains`` (each domain looked up once): names, or an Arrow string
    column (dictionary-encoded rather than turned into n Python strings: the pending state's rows, every pass).

    Raises:
        ValueError: a null in an Arrow ``domains``.
    """
    names: list[str] | tuple[list[str], np.ndarray] = (
        _domain_codes(domains) if isinstance(domains, (pa.Array, pa.ChunkedArray)) else list(domains))
    return Deadlines(
        delay=_per_domain(names, config.publish_delay),
        window={task: _per_domain(names, lambda d, task=task: config.window_ms(d, task)) for task in TASKS},
        longest=_per_domain(names, config.close_delay_ms),
    )


def _due(points: np.ndarray, is_new: np.ndarray, old_close_ms: int | None, close_ms: int) -> np.ndarray:
    """Points published by this build: in (old_close_ms, close_ms], or <= close_ms for new impressions."""
    due = points <= close_ms
    if old_close_ms is not None:
        due &= is_new | (points > old_close_ms)
    return due


@dataclass(frozen=True)
class PublicationPlan:
    """What one build publishes from the pending impressions (n rows).

    Attributes:
        deadlines: the rows' :class:`Deadlines`.
        first: (n,) bool, rows whose first publication is due now.
        keep: (n,) bool, rows still pending after this build (t + W beyond the close point).
        correction_rows: (c,) int64 indices of the rows corrected now.
        correction_task: (c,) the task of each correction ("click" or "conversion").
        correction_label: (c,) int32 its label (1: a late positive, 0: a real negative).
    """

    deadlines: Deadlines
    first: np.ndarray
    keep: np.ndarray
    correction_rows: np.ndarray
    correction_task: list[str]
    correction_label: np.ndarray


def needs_labels(t_ms: np.ndarray, due_in: Deadlines, is_new: np.ndarray, config: BuildConfig,
                 old_close_ms: int | None, close_ms: int) -> np.ndarray:
    """(n,) bool: rows with a first publication or a window closing due now (their labels must be joined).

    A late positive is due only where a label event arrived in this build, which the caller adds (rows
    sharing (user, item, domain) with a new click or conversion)."""
    need = _due(t_ms + due_in.delay, is_new, old_close_ms, close_ms)
    if config.label_mode == "defer":
        for task in TASKS:
            need |= _due(t_ms + due_in.window[task], is_new, old_close_ms, close_ms)
    return need


def plan_publication(
    t_ms: np.ndarray,
    due_in: Deadlines,
    latency: Mapping[str, np.ndarray],
    is_new: np.ndarray,
    config: BuildConfig,
    old_close_ms: int | None,
    close_ms: int,
) -> PublicationPlan:
    """The rows and corrections due in one build (rules: the module docstring).

    Args:
        t_ms: (n,) int64 impression event times (ms since epoch UTC).
        due_in: the rows' :class:`Deadlines` (:func:`deadlines`).
        latency: ``{"click": (n,), "conversion": (n,)}`` int64 ms from the impression to its first label
            event within the window, :data:`NO_LABEL` when none; read only for rows that have a point due
            (:func:`needs_labels`, plus rows with a new label event).
        is_new: (n,) bool, impressions first seen in this build.
        old_close_ms / close_ms: close points before / after this build (None: nothing published yet).

    Raises:
        ValueError: arrays of different lengths.
    """
    n = len(t_ms)
    if len(due_in.delay) != n or len(is_new) != n or any(len(v) != n for v in latency.values()):
        raise ValueError(f"plan_publication: {n} times, {len(due_in.delay)} deadlines, {len(is_new)} is_new and "
                         f"latencies { {k: len(v) for k, v in latency.items()} } must have one length")
    delay = due_in.delay
    rows: list[np.ndarray] = []
    tasks: list[str] = []
    labels: list[np.ndarray] = []

    def correct(task: str, mask: np.ndarray, label: int) -> None:
        found = np.flatnonzero(mask)
        rows.append(found)
        tasks.extend([task] * len(found))
        labels.append(np.full(len(found), label, dtype=np.int32))

    if config.label_mode != "wait":
        for task in TASKS:
            lat = latency[task]
            is_open = delay < due_in.window[task]
            correct(task, is_open & (lat > delay) & _due(t_ms + np.maximum(lat, 0), is_new, old_close_ms, close_ms), 1)
            if config.label_mode == "defer":
                correct(task, is_open & (lat == NO_LABEL)
                        & _due(t_ms + due_in.window[task], is_new, old_close_ms, close_ms), 0)
    return PublicationPlan(
        deadlines=due_in,
        first=_due(t_ms + delay, is_new, old_close_ms, close_ms),
        keep=t_ms + due_in.longest > close_ms,
        correction_rows=np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64),
        correction_task=tasks,
        correction_label=np.concatenate(labels) if labels else np.zeros(0, dtype=np.int32),
    )


def published_rows(pending: pa.Table, latency: Mapping[str, np.ndarray], plan: PublicationPlan, config: BuildConfig,
                   *, watermark_ms: int, close_ms: int, schema: pa.Schema, label_columns: Iterable[str]) -> pa.Table:
    """The example rows of a plan: first rows (labels seen within the waiting window), then corrections.

    Args:
        pending: n pending rows (every column of ``schema`` but ``label_columns``).
        latency, plan: as :func:`plan_publication` took and returned them for ``pending``.
        watermark_ms: newest event time. ``label_window_closed`` is t + W <= watermark_ms for a first row with
            no open label, False for one with an open label, True for a correction (its one label is final).
        close_ms: the build's close point (``published_watermark_ms``).
        schema: the examples schema; ``label_columns``: its columns filled here.

    Returns:
        A table of ``schema``: ``plan.first`` rows in pending order, then the corrections in plan order.
    """
    t = pending.column("event_time_ms").to_numpy()
    due_in = plan.deadlines
    first = np.flatnonzero(plan.first)
    corr = plan.correction_rows.astype(np.int64)
    take = np.concatenate([first, corr]).astype(np.int64)
    task = np.asarray(plan.correction_task, dtype=object)
    n_first, n_corr = len(first), len(corr)
    delay = due_in.delay[first]
    cols: dict[str, pa.Array] = {}
    any_open = np.zeros(n_first, dtype=bool)
    for k in TASKS:
        lat_first = latency[k][first]
        hit = (lat_first != NO_LABEL) & (lat_first <= delay)  # seen within the waiting window
        is_k = task == k
        carried = is_k & (plan.correction_label == 1)  # a late positive of this task carries its latency
        label = np.concatenate([hit, np.where(is_k, plan.correction_label, 0)]).astype(np.int32)
        lat = np.concatenate([lat_first, latency[k][corr]])
        valid = np.concatenate([hit, carried])
        cols[f"label_{k}"] = pa.array(label, pa.int32())
        cols[f"{k}_latency_ms"] = pa.array(lat, pa.int64(), mask=~valid)
        opened = (config.label_mode != "wait") & (delay < due_in.window[k][first])
        any_open |= opened
        cols[f"{k}_open"] = pa.array(np.concatenate([opened, np.zeros(n_corr, dtype=bool)]), pa.bool_())
    # A first row with an open label is not final, whatever the watermark; a correction's one label is.
    closed_first = ~any_open & (t[first] + due_in.longest[first] <= watermark_ms)
    cols["label_window_closed"] = pa.array(np.concatenate([closed_first, np.ones(n_corr, dtype=bool)]), pa.bool_())
    cols["published_watermark_ms"] = pa.array(np.full(len(take), close_ms, dtype=np.int64))
    # A row with nothing open and no correction is what wait publishes, and says so.
    early = np.concatenate([any_open, np.ones(n_corr, dtype=bool)])
    cols["label_mode"] = pa.array(np.where(early, config.label_mode, "wait").tolist(), pa.string())
    ids = pending.column("example_id").combine_chunks().cast(pa.string()).take(pa.array(take))
    corrected = ids.slice(n_first)
    cols["corrects_example_id"] = pa.concat_arrays([pa.nulls(n_first, pa.string()), corrected])
    cols["correction_task"] = pa.array([None] * n_first + list(task), pa.string())
    suffix = pa.array(["#" + str(k) for k in task], pa.string())
    example_ids = pa.concat_arrays([ids.slice(0, n_first), pc.binary_join_element_wise(corrected, suffix, "")])
    missing = set(label_columns) - set(cols)
    if missing:
        raise ValueError(f"published_rows cannot fill label columns {sorted(missing)}")
    base = pending.take(pa.array(take))
    arrays = [example_ids if f.name == "example_id" else cols[f.name].cast(f.type) if f.name in cols
              else base.column(f.name) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


def _decided_at(t_ms: int, label_ms: int, delay_ms: int) -> int:
    """The point that decides whether a label at ``label_ms`` reaches the impression at ``t_ms``: its first
    publication when the label falls in the waiting window, else the label's own point (a late positive)."""
    return t_ms + delay_ms if label_ms - t_ms <= delay_ms else label_ms


def orphan_labels(labels: pa.Table, impressions: pa.Table, new_impression_ids: set[str], config: BuildConfig,
                  old_close_ms: int | None, close_ms: int) -> pa.Table:
    """The new clicks and conversions no example will carry, with a reason.

    A label event at time s on (user, item, domain) is attributed to every impression of it at t with
    s - W_k <= t <= s (:mod:`sequences.labels`). It is an orphan when

    - ``no_impression``: the build knows no such impression (never seen, or older than the state), or
    - ``expired``: for each of its impressions, the point that decides it (the first publication t + d when
      s - t <= d, else s itself) was at or before ``old_close_ms``, and none of them is new in this build: the
      label arrived after its impressions' rows were decided (in wait mode d = W, so any label behind the old
      close point whose impressions were all published).

    Args:
        labels: the build's new click/conversion events (columns of :data:`ORPHAN_LABELS_SCHEMA` but
            ``reason`` and ``close_ms``), any users.
        impressions: every impression event the build holds for those users (``event_id``, ``user_id``,
            ``item_id``, ``domain``, ``event_time_ms``).
        new_impression_ids: event_ids of the impressions first seen in this build.
        old_close_ms / close_ms: the close points before / after this build.

    Returns:
        A table of :data:`ORPHAN_LABELS_SCHEMA`, in ``labels`` order.
    """
    by_key: dict[tuple[str, str, str], list[tuple[int, str]]] = {}
    for row in impressions.select(["user_id", "item_id", "domain", "event_time_ms", "event_id"]).to_pylist():
        by_key.setdefault((row["user_id"], row["item_id"], row["domain"]), []).append(
            (row["event_time_ms"], row["event_id"]))
    out = []
    for row in labels.select([f.name for f in ORPHAN_LABELS_SCHEMA if f.name not in ("reason", "close_ms")]).to_pylist():
        s = row["event_time_ms"]
        window = config.window_ms(row["domain"], row["event_type"])
        delay = config.publish_delay(row["domain"])
        matches = [(t, eid) for t, eid in by_key.get((row["user_id"], row["item_id"], row["domain"]), ())
                   if s - window <= t <= s]
        if not matches:
            reason = "no_impression"
        elif old_close_ms is not None and all(
                eid not in new_impression_ids and _decided_at(t, s, delay) <= old_close_ms for t, eid in matches):
            reason = "expired"
        else:
            continue
        out.append({**row, "reason": reason, "close_ms": close_ms})
    return pa.Table.from_pylist(out, schema=ORPHAN_LABELS_SCHEMA)


__all__ = ["NO_LABEL", "ORPHAN_LABELS_SCHEMA", "TASKS", "Deadlines", "PublicationPlan", "deadlines", "needs_labels", "orphan_labels",
           "plan_publication", "published_rows"]
