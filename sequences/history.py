"""Point-in-time behaviour sequences: a user's events strictly before a time ``t``.

A :class:`Timeline` holds one entity's events deduplicated by ``event_id`` and sorted once by
(event_time_ms, event_id) as aligned column lists; :meth:`Timeline.history_before` answers each
query with one ``bisect`` (O(log n) plus the copy of at most ``max_seq_len`` elements), so all
impressions of a user with n events cost O(n log n + I * max_seq_len) instead of O(I * n).
:meth:`Timeline.history_bounds` is the vectorised form (one ``numpy.searchsorted`` for all I
query times) that :func:`sequences.examples.assemble_examples` gathers Arrow list columns with.

Events are plain mappings with the :data:`ingest.schema.EVENT_ARROW_SCHEMA` fields (the rows
``pyarrow.Table.to_pylist`` gives); times are ms since epoch UTC.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ingest.schema import EventRow, sorted_unique_events


@dataclass(frozen=True)
class History:
    """A behaviour sequence: aligned lists, time-ascending (oldest first), length L <= max_seq_len.

    ``categories`` holds '' where the event had no category. ``truncated`` is the number of older
    events cut to respect ``max_seq_len``.
    """

    item_ids: list[str]
    categories: list[str]
    event_types: list[str]
    domains: list[str]
    event_times_ms: list[int]
    truncated: int

    @property
    def length(self) -> int:
        """L, the number of events kept."""
        return len(self.event_times_ms)


class Timeline:
    """One entity's events, deduplicated and sorted once, queried as of many times.

    Attributes ``events``, ``times_ms``, ``item_ids``, ``categories`` ('' for None),
    ``event_types`` and ``domains`` are aligned (n,) lists in (event_time_ms, event_id) order.

    Args:
        events: the entity's events in any order (duplicates allowed).

    Raises:
        ValueError / TypeError: as :func:`sorted_unique_events`.
    """

    def __init__(self, events: Iterable[EventRow]) -> None:
        self.events: list[EventRow] = sorted_unique_events(events)
        self.times_ms: list[int] = [e["event_time_ms"] for e in self.events]
        self.item_ids = [e["item_id"] for e in self.events]
        self.categories = [e.get("category") or "" for e in self.events]
        self.event_types = [e["event_type"] for e in self.events]
        self.domains = [e["domain"] for e in self.events]

    def __len__(self) -> int:
        return len(self.events)

    def count_before(self, t_ms: int) -> int:
        """Number of events with event_time_ms strictly < ``t_ms``."""
        return bisect.bisect_left(self.times_ms, t_ms)

    def history_bounds(self, t_ms: np.ndarray, max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised :meth:`history_before`: for Q query times, (start, end) index arrays.

        The history of query i is ``self.events[start[i]:end[i]]``; both are (Q,) int64 and
        ``start[i]`` is also that history's ``truncated`` count.

        Raises:
            ValueError: ``max_seq_len`` < 1.
        """
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        end = np.searchsorted(np.asarray(self.times_ms, dtype=np.int64), np.asarray(t_ms, dtype=np.int64), side="left")
        return np.maximum(0, end - max_seq_len), end

    def history_before(self, t_ms: int, max_seq_len: int) -> History:
        """The newest ``max_seq_len`` events with event_time_ms strictly < ``t_ms`` (point in time).

        An event at exactly ``t_ms`` (the example itself, or anything simultaneous with it) is
        excluded, so a sequence never contains the example or its future.

        Raises:
            ValueError: ``max_seq_len`` < 1.
        """
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        end = self.count_before(t_ms)
        start = max(0, end - max_seq_len)
        return History(
            item_ids=self.item_ids[start:end],
            categories=self.categories[start:end],
            event_types=self.event_types[start:end],
            domains=self.domains[start:end],
            event_times_ms=self.times_ms[start:end],
            truncated=start,
        )


def point_in_time_gather(
    times_ms: np.ndarray, created_ms: np.ndarray, query_ms: np.ndarray, query_created_ms: np.ndarray, max_len: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For Q queries, the newest ``max_len`` events visible to each: event time strictly before the
    query time AND Kafka append time (``created_ts_ms``) at or before the query's.

    The second condition keeps a backfilled old event (old event time, late append) out of an
    example that was served before it was written. Append times have ms resolution, so an event
    appended in the same ms as the impression counts as known.

    Args:
        times_ms: (n,) int64 event times, ascending (ms since epoch UTC).
        created_ms: (n,) int64 append times aligned with ``times_ms``.
        query_ms, query_created_ms: (Q,) int64 example times and append times.
        max_len: N >= 1.

    Returns:
        ``(index, lengths, visible)``: index (T,) int64 positions into the n events, row i's
        history is ``index[offsets[i]:offsets[i+1]]`` (time-ascending, offsets = cumsum of
        lengths); lengths (Q,) int64 L_i <= N; visible (Q,) int64 events visible before cutting,
        so ``visible - lengths`` is the number cut.

    Cost: one ``searchsorted``; queries whose prefix was all appended before them (the usual case
    when the log is in time order) are gathered vectorised, the others with one mask each.
    """
    times = np.asarray(times_ms, dtype=np.int64)
    created = np.asarray(created_ms, dtype=np.int64)
    q_t = np.asarray(query_ms, dtype=np.int64)
    q_c = np.asarray(query_created_ms, dtype=np.int64)
    end = np.searchsorted(times, q_t, side="left")
    prefix_max = np.concatenate([[np.iinfo(np.int64).min], np.maximum.accumulate(created)]) if created.size else (
        np.full(1, np.iinfo(np.int64).min))
    fast = prefix_max[end] <= q_c
    pieces: list[np.ndarray] = []
    lengths = np.zeros(q_t.size, dtype=np.int64)
    visible = np.zeros(q_t.size, dtype=np.int64)
    for i in range(q_t.size):
        if fast[i]:
            idx = np.arange(max(0, end[i] - max_len), end[i], dtype=np.int64)
            visible[i] = end[i]
        else:
            hits = np.flatnonzero(created[: end[i]] <= q_c[i])
            visible[i] = hits.size
            idx = hits[-max_len:].astype(np.int64)
        lengths[i] = idx.size
        pieces.append(idx)
    index = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return index, lengths, visible


def history_before(events: Sequence[EventRow], t_ms: int, max_seq_len: int) -> History:
    """One-off form of :meth:`Timeline.history_before` (builds the timeline each call)."""
    return Timeline(events).history_before(t_ms, max_seq_len)


def sequence_row(user_id: str, events: Iterable[EventRow], *, as_of_ms: int, max_seq_len: int) -> dict[str, Any]:
    """The ``sequences`` row of one user: newest ``max_seq_len`` events with time <= ``as_of_ms``.

    ``as_of_ms`` is inclusive here (it is the snapshot watermark, the newest event time, and
    that event is known), unlike the strictly-before history of an example.

    Returns:
        a dict with the :data:`sequences.schema.SEQUENCES_SCHEMA` fields (empty lists, never
        None, for a user without events before ``as_of_ms``).
    """
    history = Timeline(events).history_before(as_of_ms + 1, max_seq_len)
    return {
        "user_id": user_id,
        "seq_item_ids": history.item_ids,
        "seq_categories": history.categories,
        "seq_event_types": history.event_types,
        "seq_domains": history.domains,
        "seq_event_time_ms": history.event_times_ms,
        "seq_length": history.length,
        "seq_truncated": history.truncated,
        "as_of_ms": as_of_ms,
    }
