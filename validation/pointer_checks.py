"""The examples suite's sequence checks on pointer-layout rows: exact, on pointers + ``history``, without
materializing the lists (``build.examples_layout = "pointer"``, :mod:`sequences.materialize`).

Per row and per sequence (cross-domain, same-domain) :func:`sequences.materialize.sequence_summary`
gives, from one sorted join with ``history`` and one ``searchsorted`` per row, the length the
point-in-time rule rebuilds, its truncation count, the newest element's event time and an upper
bound of its elements' append times. The checks keep the fat suite's names and meaning
(:mod:`validation.suites`), so a pointer lake and a fat lake built from the same events get the
same verdicts:

- ``seq_length_matches_lists``: the stored ``seq_length``, ``seq_truncated``,
  ``seq_same_domain_length`` and ``seq_same_domain_truncated`` equal the rebuilt ones (a row that
  disagrees with history is a bad pointer: readers refuse it);
- ``leakage``: a row claims more visible events (length + truncation count) than there are strictly
  before its time and appended at or before it, or a rebuilt element is at/after the row's time or
  appended after it;
- ``seq_time_ascending``: the rebuilt elements are oldest first.

An impression missing from ``history`` fails the critical check ``pointers_materialize`` (and every
check above, with the same message), as a failed rebuild did before.

Cost: O(H log H + N log H) for N rows and H history rows of their users, against
O(N * max_seq_len) list elements for materializing (per-domain lengths need no lists at all: the
``seq_length_p99:<domain>`` check reads ``seq_length``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from sequences.config import BuildConfig
from sequences.materialize import HistoryCut, SequenceSummary, sequence_summary
from validation.suites import CheckResult, _ids, _rows_result

Summaries = dict[str, SequenceSummary]
"""``{"seq_": cross-domain, "seq_same_domain_": same-domain}`` summaries of one batch."""

_PREFIXES = (("seq_", False), ("seq_same_domain_", True))


def summarize_pointers(rows: pa.Table, history: pa.Table, build: BuildConfig, cut: HistoryCut | None = None) -> Summaries:
    """Both sequences' :class:`~sequences.materialize.SequenceSummary` of ``rows``.

    Args:
        rows: pointer-layout ``examples`` rows (no list columns).
        history: the ``history`` rows of at least these rows' users.
        build: ``max_seq_len`` and ``same_domain_seq_len`` the rows are checked against.
        cut: for a compacted ``history`` (:class:`sequences.history_tail.HistoryTail`), what it left out.

    Raises:
        ValueError: an impression is not in ``history``.
    """
    lengths = {"seq_": build.max_seq_len, "seq_same_domain_": build.same_domain_seq_len}
    return {prefix: sequence_summary(rows, history, lengths[prefix], same_domain=same, cut=cut)
            for prefix, same in _PREFIXES}


def _stored(rows: pa.Table, column: str) -> np.ndarray:
    return rows.column(column).to_numpy(zero_copy_only=False).astype(np.int64)


def check_pointer_lengths(rows: pa.Table, summaries: Summaries) -> dict[str, Any]:
    """Rows whose stored length or truncation count (either sequence) differs from the rebuilt one."""
    wrong = np.zeros(rows.num_rows, dtype=bool)
    for prefix, summary in summaries.items():
        wrong |= _stored(rows, f"{prefix}length") != summary.lengths
        wrong |= _stored(rows, f"{prefix}truncated") != summary.truncated
    return _rows_result(pa.array(np.flatnonzero(wrong)), _ids(rows), rows.num_rows)


def check_pointer_leakage(rows: pa.Table, summaries: Summaries) -> dict[str, Any]:
    """Rows that claim or rebuild an element at/after their time (ms) or appended after them: the stored
    length + truncation count exceeds the events the point-in-time rule finds visible, or the newest
    rebuilt element is not strictly before the row. Details add ``leaked_elements``: events claimed
    beyond the visible ones plus rows whose rebuilt newest element leaks."""
    times, created = _stored(rows, "event_time_ms"), _stored(rows, "created_ts_ms")
    leaked = np.zeros(rows.num_rows, dtype=bool)
    elements = 0
    for prefix, summary in summaries.items():
        # length + truncated is the number of events the row says were visible to it; more than the
        # point-in-time rule finds means some were at/after its time or appended after it.
        stored = _stored(rows, f"{prefix}length") + _stored(rows, f"{prefix}truncated")
        claimed = np.maximum(stored - summary.lengths - summary.truncated, 0)
        future = (summary.lengths > 0) & ((summary.newest_ms >= times) | (summary.newest_created_ms > created))
        leaked |= (claimed > 0) | future
        elements += int(claimed.sum()) + int(future.sum())
    result = _rows_result(pa.array(np.flatnonzero(leaked)), _ids(rows), rows.num_rows)
    return {**result, "leaked_elements": elements}


def check_pointer_order(rows: pa.Table, summaries: Summaries) -> dict[str, Any]:
    """Rows whose rebuilt elements (either sequence) are not time-ascending."""
    bad = np.zeros(rows.num_rows, dtype=bool)
    for summary in summaries.values():
        bad |= summary.unordered
    return _rows_result(pa.array(np.flatnonzero(bad)), _ids(rows), rows.num_rows)


def pointer_sequence_checks(rows: pa.Table, history: pa.Table, build: BuildConfig, cut: HistoryCut | None = None
                            ) -> tuple[dict[str, Callable[[pa.Table], dict[str, Any]]], list[CheckResult]]:
    """(``sequence_checks`` for :func:`validation.suites.validate_examples`, extra results) of one batch.

    The summaries are computed once for the batch ``rows`` (every check of the suite reads every
    row). The extra results hold ``pointers_materialize``: passed, or failed with the error when an
    impression is missing from ``history`` (the three checks then fail with it too).
    """
    return summary_checks(rows, lambda: summarize_pointers(rows, history, build, cut))


def summary_checks(rows: pa.Table, summarize: Callable[[], Summaries]
                   ) -> tuple[dict[str, Callable[[pa.Table], dict[str, Any]]], list[CheckResult]]:
    """:func:`pointer_sequence_checks` of ``rows`` with their summaries from ``summarize`` (a ValueError it raises,
    an impression missing from ``history``, fails ``pointers_materialize`` and the three checks)."""
    try:
        summaries = summarize()
    except ValueError as exc:
        message = str(exc)
        failed = CheckResult("pointers_materialize", "critical", False, f"error: {message}", "custom",
                             {"exception_message": message})

        def refuse(_: pa.Table) -> dict[str, Any]:
            raise ValueError(message)

        return dict.fromkeys(("seq_length_matches_lists", "leakage", "seq_time_ascending"), refuse), [failed]
    return checks_from_summaries(rows, summaries)


def checks_from_summaries(rows: pa.Table, summaries: Summaries
                          ) -> tuple[dict[str, Callable[[pa.Table], dict[str, Any]]], list[CheckResult]]:
    """:func:`pointer_sequence_checks` of ``rows`` from their summaries computed beforehand (every impression was
    found in history: ``pointers_materialize`` passed)."""
    checks: dict[str, Callable[[pa.Table], dict[str, Any]]] = {
        "seq_length_matches_lists": functools.partial(check_pointer_lengths, summaries=summaries),
        "leakage": functools.partial(check_pointer_leakage, summaries=summaries),
        "seq_time_ascending": functools.partial(check_pointer_order, summaries=summaries)}
    passed = CheckResult("pointers_materialize", "critical", True, "every impression found in history", "custom",
                         {"element_count": rows.num_rows})
    return checks, [passed]


def split_summaries(summaries: Summaries, sizes: list[int]) -> list[Summaries]:
    """``summaries`` of consecutive batches of ``sizes`` rows, cut apart (each row's summary depends on its own
    pointer and its user's history only, so a batch's part equals what its rows alone would give)."""
    bounds = np.cumsum([0, *sizes])
    return [{prefix: SequenceSummary(*(getattr(s, f.name)[lo:hi] for f in dataclasses.fields(SequenceSummary)))
             for prefix, s in summaries.items()} for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
