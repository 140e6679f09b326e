"""Small hand-made events/examples batches for the validation tests (no other stage needed)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from ingest.schema import EVENTS_TABLE_SCHEMA
from sequences.schema import EXAMPLES_BASE_SCHEMA

T0_MS = 1_700_000_000_000  # 2023-11-14T22:13:20Z
NOW_MS = T0_MS + 10 * 24 * 3600 * 1000
DOMAINS = ("facebook", "instagram")
MAX_SEQ_LEN = 4


def relaxed(schema: pa.Schema) -> pa.Schema:
    """Same names and types, every field nullable, so tests can plant nulls the real writer forbids."""
    return pa.schema([f.with_nullable(True) for f in schema])


def event_row(i: int, **overrides) -> dict:
    row = dict(
        event_id=f"e{i}",
        event_time_ms=T0_MS + i * 1000,
        user_id=f"u{i % 2}",
        item_id=f"i{i % 3}",
        domain=DOMAINS[i % 2],
        event_type="impression",
        category="c",
        position=1,
        ad_format=None,
        age=30,
        gender=None,
        location=None,
        schema_version=1,
        created_ts_ms=T0_MS + i * 1000 + 5,
        event_date="2023-11-14",
        kafka_topic="gemline.events",
        kafka_partition=0,
        kafka_offset=i,
    )
    row.update(overrides)
    return row


def example_row(i: int, **overrides) -> dict:
    """Example i at T0 + i s with a history of (i % 3) events 1..k s before it; clicks alternate."""
    t = T0_MS + i * 1000
    k = i % 3
    row = dict(
        example_id=f"x{i}",
        event_time_ms=t,
        event_date="2023-11-14",
        user_id=f"u{i % 2}",
        item_id=f"i{i % 3}",
        domain=DOMAINS[i % 2],
        category="c",
        position="1",
        ad_format=None,
        age="30",
        gender=None,
        location=None,
        seq_item_ids=[f"i{j}" for j in range(k)],
        seq_categories=["c"] * k,
        seq_event_types=["impression"] * k,
        seq_domains=[DOMAINS[i % 2]] * k,
        seq_event_time_ms=[t - (k - j) * 1000 for j in range(k)],
        seq_length=k,
        seq_truncated=0,
        label_click=(i // 2) % 2,
        label_conversion=0,
        click_latency_ms=None,
        conversion_latency_ms=None,
        label_window_closed=True,
        f_user_clicks=float(i),
    )
    row.update(overrides)
    return row


def _fill_missing(row: dict, schema: pa.Schema) -> dict:
    """Neutral values for schema columns the hand-made row does not set (the examples contract grows:
    empty lists, times equal to the example's, zero counts), so the rows track the current schema."""
    out = dict(row)
    for f in schema:
        if f.name in out:
            continue
        if pa.types.is_list(f.type):
            out[f.name] = []
        elif pa.types.is_integer(f.type):
            out[f.name] = out.get("event_time_ms") if f.name.endswith("_ms") else 0
        elif pa.types.is_boolean(f.type):
            out[f.name] = False
        else:
            out[f.name] = None if f.nullable else ""
    return out


EXAMPLES_SCHEMA = pa.schema(list(EXAMPLES_BASE_SCHEMA) + [pa.field("f_user_clicks", pa.float64())])


@pytest.fixture
def events_table():
    """``events_table(n, {row_index: {field: value}})`` -> pa.Table in the relaxed events schema."""

    def make(n: int = 6, changes: dict[int, dict] | None = None, schema: pa.Schema = EVENTS_TABLE_SCHEMA) -> pa.Table:
        rows = [event_row(i, **(changes or {}).get(i, {})) for i in range(n)]
        return pa.Table.from_pylist(rows, schema=relaxed(schema))

    return make


@pytest.fixture
def examples_table():
    """``examples_table(n, {row_index: {field: value}})`` -> pa.Table in the relaxed examples schema."""

    def make(n: int = 8, changes: dict[int, dict] | None = None, schema: pa.Schema = EXAMPLES_SCHEMA) -> pa.Table:
        rows = [_fill_missing(example_row(i, **(changes or {}).get(i, {})), schema) for i in range(n)]
        return pa.Table.from_pylist(rows, schema=relaxed(schema))

    return make


@pytest.fixture
def bounds() -> dict:
    """Keyword bounds of both suites for these batches."""
    return dict(domains=DOMAINS, min_time_ms=T0_MS - 1000, max_time_ms=NOW_MS)


@pytest.fixture
def example_bounds(bounds) -> dict:
    return dict(bounds, max_seq_len=MAX_SEQ_LEN, min_label_rate=0.1, max_label_rate=0.9)
