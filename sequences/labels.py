"""Label join: clicks and conversions attributed to a user's earlier impressions.

For an impression of ``item_id`` in ``domain`` at time t (ms since epoch UTC), ``label_click`` is
1 when the same user has a click on the same (item_id, domain) with event time in
``[t, t + click_window_ms]`` (both ends included), likewise ``label_conversion`` with
``conversion_window_ms``. The latency is the time from the impression to the *first* such label
event, None when unlabelled.

Attribution choice: every impression whose window covers a label event is labelled by it (a
"multi-touch, all impressions" rule), not only the last impression before it (last-touch). It is
the simplest rule that is independent of the order the impressions arrive in, and a repeated
impression of the same item shortly before a click is a genuine positive for a per-impression
pCTR target. Last-touch can be layered on later without changing the
table contract.

``label_window_closed`` is ``t + conversion_window_ms <= watermark_ms``, where the watermark is
the largest event time of the snapshot: only then can no later event change the labels.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ingest.schema import IMPRESSION_TYPES

CLICK = "click"
CONVERSION = "conversion"


@dataclass(frozen=True)
class Labels:
    """Labels of one impression; latencies in ms (None when unlabelled)."""

    label_click: int
    label_conversion: int
    click_latency_ms: int | None
    conversion_latency_ms: int | None
    label_window_closed: bool


def _first_in_window(times_ms: list[int], t_ms: int, window_ms: int) -> int | None:
    """Latency of the first time in sorted ``times_ms`` within [t, t + window], else None."""
    i = bisect.bisect_left(times_ms, t_ms)
    if i < len(times_ms) and times_ms[i] <= t_ms + window_ms:
        return times_ms[i] - t_ms
    return None


def label_impressions(
    events: Sequence[Mapping[str, Any]],
    *,
    click_window_ms: int,
    conversion_window_ms: int,
    watermark_ms: int,
) -> dict[str, Labels]:
    """Labels of every impression-like event of one user.

    Args:
        events: one user's events sorted by (event_time_ms, event_id) and deduplicated (see
            :func:`ingest.schema.sorted_unique_events`).
        click_window_ms, conversion_window_ms: attribution windows (ms, > 0).
        watermark_ms: max event_time_ms of the whole snapshot (ms since epoch UTC).

    Returns:
        ``{impression event_id: Labels}`` for each event whose type is in
        :data:`ingest.schema.IMPRESSION_TYPES`.

    Raises:
        ValueError: events of more than one user, unsorted events, or a window <= 0.
    """
    if click_window_ms <= 0 or conversion_window_ms <= 0:
        raise ValueError(
            f"attribution windows must be > 0 ms, got click={click_window_ms}, conversion={conversion_window_ms}"
        )
    label_times: dict[tuple[str, str, str], list[int]] = defaultdict(list)
    users = set()
    previous: tuple[int, str] | None = None
    for event in events:
        users.add(event["user_id"])
        order = (event["event_time_ms"], event["event_id"])
        if previous is not None and order < previous:
            raise ValueError(
                f"events must be sorted by (event_time_ms, event_id); {order} came after {previous}. "
                "Pass them through ingest.schema.sorted_unique_events first"
            )
        previous = order
        if event["event_type"] in (CLICK, CONVERSION):
            # Appended in time order, so each list is already sorted for bisect.
            label_times[(event["event_type"], event["item_id"], event["domain"])].append(event["event_time_ms"])
    if len(users) > 1:
        raise ValueError(f"label_impressions expects one user's events, got users {sorted(users)[:5]}")

    out: dict[str, Labels] = {}
    for event in events:
        if event["event_type"] not in IMPRESSION_TYPES:
            continue
        t_ms = event["event_time_ms"]
        key = (event["item_id"], event["domain"])
        click_latency = _first_in_window(label_times.get((CLICK, *key), []), t_ms, click_window_ms)
        conversion_latency = _first_in_window(label_times.get((CONVERSION, *key), []), t_ms, conversion_window_ms)
        out[event["event_id"]] = Labels(
            label_click=int(click_latency is not None),
            label_conversion=int(conversion_latency is not None),
            click_latency_ms=click_latency,
            conversion_latency_ms=conversion_latency,
            label_window_closed=t_ms + conversion_window_ms <= watermark_ms,
        )
    return out
