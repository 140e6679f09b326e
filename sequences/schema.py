"""Schemas of the tables the build writes: ``sequences`` and ``examples``.

The ``examples`` table is the contract with validation and the trainer:

- identity and time: ``example_id`` (the impression's event_id), ``event_time_ms`` (ms since
  epoch UTC), ``event_date`` (YYYY-MM-DD UTC; partition column);
- sparse (categorical) features, strings, hashed by the trainer: :data:`SPARSE_FEATURES`;
- dense features: every column named ``f_*`` (float64, finite or null), computed from events with
  event time strictly before ``event_time_ms`` (point in time);
- the behaviour sequence: the list columns :data:`SEQUENCE_FEATURES` plus ``seq_event_time_ms``,
  aligned element by element, time-ascending (oldest first), only events strictly before the
  example, truncated to the newest ``build.max_seq_len``; ``seq_length`` and ``seq_truncated``
  (number of older events cut);
- labels: ``label_click`` and ``label_conversion`` (int32 0/1) from later events of the same user
  and item within the attribution windows; ``click_latency_ms`` / ``conversion_latency_ms``
  (null when unlabelled); ``label_window_closed`` (bool: the conversion window ended before the
  snapshot's watermark, i.e. the labels are final);
- added by the incremental build (:data:`BUILD_EXTRA_SCHEMA`): the same-domain sequence ``seq_same_domain_*`` (only events of
  the example's domain, truncated separately to ``build.same_domain_seq_len``), the time deltas
  ``seq_time_delta_ms`` / ``seq_same_domain_time_delta_ms`` (example time - element time, ms, > 0),
  ``created_ts_ms`` (Kafka append time of the impression; every sequence element and feature
  input was appended at or before it) and ``published_watermark_ms`` (labels were published once
  windows closed up to this time; minus ``event_time_ms`` it is the label latency of the row);
- early publication (``build.label_mode``, :mod:`sequences.publish`): ``label_mode`` (the build's mode for a
  row with an open label or a correction, which the trainer weights; "wait" for a row whose labels were
  final when published), ``click_open`` /
  ``conversion_open`` (the label was published before its window closed, so a correction may follow),
  and for a correction row ``corrects_example_id`` (the example_id of the impression's first row;
  a correction's own example_id is ``<that id>#<task>``) and ``correction_task`` (the one label the
  row carries: a late positive, or in defer mode a real negative).
"""

from __future__ import annotations

import pyarrow as pa

SPARSE_FEATURES: tuple[str, ...] = (
    "user_id",
    "item_id",
    "domain",
    "category",
    "position",
    "ad_format",
    "age",
    "gender",
    "location",
)
"""Categorical example columns, all stored as nullable strings."""

SEQUENCE_FEATURES: tuple[str, ...] = ("seq_item_ids", "seq_categories", "seq_event_types", "seq_domains")
"""Aligned list<string> sequence columns (a missing category is the empty string)."""

SAME_DOMAIN_SEQUENCE_FEATURES: tuple[str, ...] = (
    "seq_same_domain_item_ids", "seq_same_domain_categories", "seq_same_domain_event_types",
)
"""Aligned list<string> columns of the sequence restricted to the example's domain (own truncation)."""

LABELS: tuple[str, ...] = ("label_click", "label_conversion")

_list_str = pa.list_(pa.string())

EXAMPLES_BASE_SCHEMA = pa.schema(
    [
        pa.field("example_id", pa.string(), nullable=False),
        pa.field("event_time_ms", pa.int64(), nullable=False),
        pa.field("event_date", pa.string(), nullable=False),
        *[pa.field(name, pa.string(), nullable=name not in ("user_id", "item_id", "domain")) for name in SPARSE_FEATURES],
        *[pa.field(name, _list_str, nullable=False) for name in SEQUENCE_FEATURES],
        pa.field("seq_event_time_ms", pa.list_(pa.int64()), nullable=False),
        pa.field("seq_length", pa.int32(), nullable=False),
        pa.field("seq_truncated", pa.int32(), nullable=False),
        pa.field("label_click", pa.int32(), nullable=False),
        pa.field("label_conversion", pa.int32(), nullable=False),
        pa.field("click_latency_ms", pa.int64()),
        pa.field("conversion_latency_ms", pa.int64()),
        pa.field("label_window_closed", pa.bool_(), nullable=False),
    ]
)
"""Columns every ``examples`` table has; the build appends its ``f_*`` float64 dense features."""

BUILD_EXTRA_SCHEMA = pa.schema(
    [
        *[pa.field(name, _list_str, nullable=False) for name in SAME_DOMAIN_SEQUENCE_FEATURES],
        pa.field("seq_same_domain_event_time_ms", pa.list_(pa.int64()), nullable=False),
        pa.field("seq_same_domain_length", pa.int32(), nullable=False),
        pa.field("seq_same_domain_truncated", pa.int32(), nullable=False),
        pa.field("seq_time_delta_ms", pa.list_(pa.int64()), nullable=False),  # event_time_ms - seq time, > 0
        pa.field("seq_same_domain_time_delta_ms", pa.list_(pa.int64()), nullable=False),
        pa.field("created_ts_ms", pa.int64(), nullable=False),  # Kafka append time of the impression
        pa.field("published_watermark_ms", pa.int64(), nullable=False),  # windows closed up to here at publication
        # Early publication (sequences.publish): how the row was published and what may follow it.
        pa.field("label_mode", pa.string(), nullable=False),  # "fnw"/"defer": part of that stream; "wait": final labels
        pa.field("click_open", pa.bool_(), nullable=False),  # published before the click window closed
        pa.field("conversion_open", pa.bool_(), nullable=False),
        pa.field("corrects_example_id", pa.string()),  # a correction row: the example it corrects
        pa.field("correction_task", pa.string()),  # its one label ("click" or "conversion"); the other is unused
    ]
)
"""Columns the incremental build adds after the base ones (per-domain sequence, time deltas,
append time, publication); optional for other writers of ``examples``-like tables."""

SEQUENCES_SCHEMA = pa.schema(
    [
        pa.field("user_id", pa.string(), nullable=False),
        *[pa.field(name, _list_str, nullable=False) for name in SEQUENCE_FEATURES],
        pa.field("seq_event_time_ms", pa.list_(pa.int64()), nullable=False),
        pa.field("seq_length", pa.int32(), nullable=False),
        pa.field("seq_truncated", pa.int32(), nullable=False),
        pa.field("as_of_ms", pa.int64(), nullable=False),
        # The build's state: ids to deduplicate redelivered events, append times for point in time.
        pa.field("seq_event_ids", _list_str, nullable=False),
        pa.field("seq_created_ts_ms", pa.list_(pa.int64()), nullable=False),
    ]
)
"""One row per user: the newest ``max_seq_len`` events (time-ascending) as of ``as_of_ms``."""

SEQUENCES_BY_DOMAIN_SCHEMA = pa.schema(
    [pa.field("domain", pa.string(), nullable=False), *SEQUENCES_SCHEMA]
)
"""One row per (user, domain): the newest ``max_same_domain_seq_len`` events of that domain."""


HISTORY_BUCKETS = 16
"""Partitions of the ``history`` table: a user's rows all live in bucket
:func:`sequences.materialize.history_bucket` (crc32 of the user_id mod this), so the reader of one
batch's users opens at most that many partitions. Changing it needs a rewrite of the table."""

HISTORY_SCHEMA = pa.schema(
    [
        pa.field("user_bucket", pa.int32(), nullable=False),  # partition column
        pa.field("user_id", pa.string(), nullable=False),
        pa.field("event_id", pa.string(), nullable=False),
        pa.field("event_time_ms", pa.int64(), nullable=False),
        pa.field("created_ts_ms", pa.int64(), nullable=False),  # Kafka append time of the event
        pa.field("item_id", pa.string(), nullable=False),
        pa.field("category", pa.string()),  # null: no category ('' in the sequence lists)
        pa.field("event_type", pa.string(), nullable=False),
        pa.field("domain", pa.string(), nullable=False),
        pa.field("build", pa.int64(), nullable=False),  # the build that appended it (its append version)
    ]
)
"""One row per (user, event), appended once, by the build that first saw the event: every user's
history stored once, which pointer-layout examples index into (:mod:`sequences.materialize`)."""

LIST_COLUMNS: tuple[str, ...] = (
    *SEQUENCE_FEATURES, "seq_event_time_ms", *SAME_DOMAIN_SEQUENCE_FEATURES, "seq_same_domain_event_time_ms",
    "seq_time_delta_ms", "seq_same_domain_time_delta_ms",
)
"""The list columns of a fat ``examples`` row; a pointer-layout row (``build.examples_layout =
"pointer"``) has every other column and is materialized from the ``history`` table."""


def pointer_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` without its :data:`LIST_COLUMNS` (the pointer layout of an examples-like schema)."""
    return pa.schema([f for f in schema if f.name not in LIST_COLUMNS])


def dense_feature_names(schema: pa.Schema) -> list[str]:
    """The ``f_*`` dense feature columns of an examples schema, in schema order."""
    return [name for name in schema.names if name.startswith("f_")]
