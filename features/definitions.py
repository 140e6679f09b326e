"""Feature definitions as code: windowed counters per (user, domain) and per (item, domain).

In the spirit of Feast's feature views (https://docs.feast.dev, "Feature view"): each
:class:`FeatureView` names its entity keys, its event timestamp (``event_ts_ms``: the newest
event the row reflects) and created timestamp (``created_ts_ms``: when the newest of those events
reached Kafka), a TTL and a typed Arrow schema.

Counters, for window w in :data:`WINDOWS_MS` and a query time t (ms since epoch UTC), count the
entity's events with event time in ``[t - w, t)`` (all-time: ``(-inf, t)``): strictly before t,
so a value "as of t" never sees the event at t (point in time). For each window:

- ``impressions_<w>``, ``clicks_<w>``, ``conversions_<w>``: counts (events);
- ``ctr_<w>``: smoothed CTR ``(clicks + a) / (impressions + a + b)`` with a =
  ``BuildConfig.ctr_prior_clicks`` and b = ``BuildConfig.ctr_prior_non_clicks`` (defaults 1 and 1:
  a Beta(1, 1) prior, i.e. Laplace smoothing, so an entity with no history gets 0.5 and the
  estimate moves toward clicks/impressions as impressions grow). Clicks and impressions are
  counted independently in the window (a click whose impression fell just before the window still
  counts), so on short windows the ratio can exceed 1; that is the signal "clicks outnumber fresh
  impressions", not an error.

Shape letters: n events of one entity, Q query times.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from gemline.tables import Table, spec

HOUR_MS = 3600 * 1000
DAY_MS = 24 * HOUR_MS

WINDOWS_MS: dict[str, int | None] = {"1h": HOUR_MS, "1d": DAY_MS, "7d": 7 * DAY_MS, "all": None}
"""Counter windows, name -> length in ms (None: all time)."""

COUNTED_TYPES: dict[str, str] = {"impressions": "impression", "clicks": "click", "conversions": "conversion"}
"""Counter name -> the event_type it counts."""

COUNTER_NAMES: tuple[str, ...] = tuple(
    f"{name}_{window}" for window in WINDOWS_MS for name in (*COUNTED_TYPES, "ctr")
)
"""Every counter column, e.g. ``impressions_1h``, ``ctr_all``."""


def smoothed_ctr(clicks: np.ndarray | float, impressions: np.ndarray | float, a: float, b: float) -> np.ndarray:
    """``(clicks + a) / (impressions + a + b)`` as float64 (Beta(a, b) posterior mean of the CTR).

    Raises:
        ValueError: a < 0, b < 0 or a + b == 0.
    """
    if a < 0 or b < 0 or a + b <= 0:
        raise ValueError(f"CTR prior needs a >= 0, b >= 0 and a + b > 0, got a={a}, b={b}")
    return (np.asarray(clicks, dtype=np.float64) + a) / (np.asarray(impressions, dtype=np.float64) + a + b)


class CounterIndex:
    """Prefix counts of one entity's events, answering windowed counters as of any times.

    Args:
        times_ms: (n,) event times, ascending, ms since epoch UTC.
        event_types: (n,) the events' types, aligned with ``times_ms``.

    Raises:
        ValueError: lengths differ or times are not ascending.
    """

    def __init__(
        self, times_ms: Sequence[int], event_types: Sequence[str], created_ms: Sequence[int] | None = None
    ) -> None:
        if len(times_ms) != len(event_types):
            raise ValueError(f"times_ms has {len(times_ms)} entries but event_types has {len(event_types)}")
        self.times_ms = np.asarray(times_ms, dtype=np.int64)
        if self.times_ms.size and np.any(np.diff(self.times_ms) < 0):
            raise ValueError("times_ms must be ascending; sort the events by (event_time_ms, event_id) first")
        types = np.asarray(event_types, dtype=object)
        self._types = types
        self.created_ms = None if created_ms is None else np.asarray(created_ms, dtype=np.int64)
        if self.created_ms is not None and self.created_ms.shape != self.times_ms.shape:
            raise ValueError(f"created_ms has {self.created_ms.size} entries but times_ms has {self.times_ms.size}")
        # prefix[k][i] = number of events of kind k among the first i events; shape (n + 1,).
        self._prefix = {
            name: np.concatenate([[0], np.cumsum(types == event_type)]).astype(np.int64)
            for name, event_type in COUNTED_TYPES.items()
        }

    def counts(self, name: str, query_ms: np.ndarray, window_ms: int | None) -> np.ndarray:
        """(Q,) int64 counts of ``name`` events with time in [t - window, t) for each query t."""
        prefix = self._prefix[name]
        end = prefix[np.searchsorted(self.times_ms, query_ms, side="left")]
        if window_ms is None:
            return end
        return end - prefix[np.searchsorted(self.times_ms, query_ms - window_ms, side="left")]

    def _masked_counts(self, name: str, t_ms: int, c_ms: int, window_ms: int | None) -> int:
        assert self.created_ms is not None, "called only when the index has created_ms"
        keep = (self.times_ms < t_ms) & (self.created_ms <= c_ms) & (self._types == COUNTED_TYPES[name])
        if window_ms is not None:
            keep &= self.times_ms >= t_ms - window_ms
        return int(keep.sum())

    def as_of(
        self,
        query_ms: Sequence[int] | np.ndarray,
        *,
        a: float,
        b: float,
        query_created_ms: Sequence[int] | np.ndarray | None = None,
        prior_counts: Mapping[str, int] | None = None,
    ) -> dict[str, np.ndarray]:
        """All :data:`COUNTER_NAMES` as of each query time: ``{name: (Q,) float64}``.

        Args:
            query_ms: (Q,) query times, ms since epoch UTC, any order.
            a, b: CTR prior (see the module docstring).
            query_created_ms: (Q,) append times of the queries; when given (and the index has
                ``created_ms``), an event counts only if also appended at or before it (point in
                time against backfills).
            prior_counts: ``{"impressions"|"clicks"|"conversions": n}`` of older events no longer
                held (the build state's evicted counts), added to the all-time counters.
        """
        query = np.asarray(query_ms, dtype=np.int64)
        out: dict[str, np.ndarray] = {}
        slow = np.zeros(query.size, dtype=bool)
        if query_created_ms is not None and self.created_ms is not None and self.times_ms.size:
            q_c = np.asarray(query_created_ms, dtype=np.int64)
            prefix_max = np.concatenate([[np.iinfo(np.int64).min], np.maximum.accumulate(self.created_ms)])
            slow = prefix_max[np.searchsorted(self.times_ms, query, side="left")] > q_c
        for window, window_ms in WINDOWS_MS.items():
            for name in COUNTED_TYPES:
                counts = self.counts(name, query, window_ms)
                for i in np.flatnonzero(slow):
                    counts[i] = self._masked_counts(name, int(query[i]), int(q_c[i]), window_ms)
                if window_ms is None and prior_counts:
                    counts = counts + int(prior_counts.get(name, 0))
                out[f"{name}_{window}"] = counts.astype(np.float64)
            out[f"ctr_{window}"] = smoothed_ctr(out[f"clicks_{window}"], out[f"impressions_{window}"], a, b)
        return out


def counters_as_of(
    times_ms: Sequence[int], event_types: Sequence[str], t_ms: int, *, a: float, b: float
) -> dict[str, float]:
    """Every counter of one entity as of ``t_ms`` (events strictly before it), as Python floats."""
    values = CounterIndex(times_ms, event_types).as_of([t_ms], a=a, b=b)
    return {name: float(v[0]) for name, v in values.items()}


@dataclass(frozen=True, kw_only=True)
class FeatureView:
    """A feature table defined in code (after Feast's FeatureView)."""

    name: Table
    """The table (its path under the lake root)."""
    entity_keys: tuple[str, ...]
    """Columns identifying one row."""
    timestamp_field: str
    """Event time of the newest event the row reflects (ms since epoch UTC)."""
    created_timestamp_field: str
    """When that newest event was appended to Kafka (ms since epoch UTC)."""
    ttl_ms: int | None
    """How long a row stays valid for online lookup after its event time; None: forever."""
    schema: pa.Schema
    """Typed columns of the table."""

    @property
    def partition_by(self) -> tuple[str, ...]:
        """Delta partition columns: those of the table's spec (:mod:`gemline.tables`)."""
        return spec(self.name).partition_by


def _counter_fields() -> list[pa.Field]:
    return [
        pa.field(name, pa.float64() if name.startswith("ctr_") else pa.int64(), nullable=False)
        for name in COUNTER_NAMES
    ]


_TIME_FIELDS = [
    pa.field("as_of_ms", pa.int64(), nullable=False),  # counters include events with time <= as_of_ms
    pa.field("event_ts_ms", pa.int64(), nullable=False),
    pa.field("created_ts_ms", pa.int64(), nullable=False),
    pa.field("event_date", pa.string(), nullable=False),  # YYYY-MM-DD (UTC) of event_ts_ms; partition column
]

USER_FEATURES = FeatureView(
    name=Table.FEATURES_USER,
    entity_keys=("user_id", "domain"),
    timestamp_field="event_ts_ms",
    created_timestamp_field="created_ts_ms",
    ttl_ms=30 * DAY_MS,
    schema=pa.schema(
        [
            pa.field("user_id", pa.string(), nullable=False),
            pa.field("domain", pa.string(), nullable=False),
            *_TIME_FIELDS,
            *_counter_fields(),
            # Static attributes: the latest non-null value among the user's events in any domain.
            pa.field("age", pa.int32()),
            pa.field("gender", pa.string()),
            pa.field("location", pa.string()),
        ]
    ),
)
"""Per (user_id, domain) counters plus the user's static attributes (latest non-null within the TTL)."""

ITEM_FEATURES = FeatureView(
    name=Table.FEATURES_ITEM,
    entity_keys=("item_id", "domain"),
    timestamp_field="event_ts_ms",
    created_timestamp_field="created_ts_ms",
    ttl_ms=30 * DAY_MS,
    schema=pa.schema(
        [
            pa.field("item_id", pa.string(), nullable=False),
            pa.field("domain", pa.string(), nullable=False),
            *_TIME_FIELDS,
            *_counter_fields(),
            pa.field("category", pa.string()),  # latest non-null category of the item
        ]
    ),
)
"""Per (item_id, domain) counters plus the item's latest category."""

USER_CATEGORY_FEATURES = FeatureView(
    name=Table.FEATURES_USER_CATEGORY,
    entity_keys=("user_id", "domain", "category"),
    timestamp_field="event_ts_ms",
    created_timestamp_field="created_ts_ms",
    ttl_ms=30 * DAY_MS,
    schema=pa.schema(
        [
            pa.field("user_id", pa.string(), nullable=False),
            pa.field("domain", pa.string(), nullable=False),
            pa.field("category", pa.string(), nullable=False),
            *_TIME_FIELDS,
            *_counter_fields(),
        ]
    ),
)
"""Per (user_id, domain, category) counters (events without a category are not counted here)."""

FEATURE_VIEWS: tuple[FeatureView, ...] = (USER_FEATURES, ITEM_FEATURES, USER_CATEGORY_FEATURES)
"""Every feature table the build writes."""
