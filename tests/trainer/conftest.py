"""Synthetic ``examples`` tables whose labels depend on the features, so a model can learn them."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from gemline.gate import append_quality_rows
from gemline.lake import table_uri
from sequences.schema import EXAMPLES_BASE_SCHEMA

DENSE = ("f_user_ctr_7d", "f_item_ctr_7d", "f_seq_length")
EXAMPLES_SCHEMA = pa.schema([*EXAMPLES_BASE_SCHEMA, *[pa.field(n, pa.float64()) for n in DENSE]])
CATEGORIES = [f"c{i}" for i in range(8)]
DOMAINS = ["feed", "reels", "marketplace"]


def with_build_columns(table: pa.Table) -> pa.Table:
    """``table`` plus the incremental build's time deltas and same-domain history (sequences.schema.BUILD_EXTRA_SCHEMA):
    the same-domain history is the events at even positions; deltas 0.5 s, 2 s, 8 s, ... from the newest event back."""
    lengths = table["seq_length"].to_pylist()
    deltas = [[int(1000 * 4.0 ** (n - 1 - j)) // 2 for j in range(n)] for n in lengths]
    cols = {"seq_time_delta_ms": pa.array(deltas, pa.list_(pa.int64()))}
    for key, source in (("seq_same_domain_item_ids", "seq_item_ids"), ("seq_same_domain_categories", "seq_categories"),
                        ("seq_same_domain_event_types", "seq_event_types")):
        cols[key] = pa.array([v[::2] for v in table[source].to_pylist()], pa.list_(pa.string()))
    cols["seq_same_domain_time_delta_ms"] = pa.array([d[::2] for d in deltas], pa.list_(pa.int64()))
    for name, column in cols.items():
        table = table.append_column(name, column)
    return table


def synthetic_examples(dates: list[str], rows_per_date: int, seed: int) -> pa.Table:
    """Examples where click odds rise with f_user_ctr_7d and with the candidate's category appearing in the history."""
    rng = np.random.default_rng(seed)
    rows = []
    for d, date in enumerate(dates):
        for i in range(rows_per_date):
            length = int(rng.integers(0, 6))
            seq_cats = [CATEGORIES[int(c)] for c in rng.integers(0, len(CATEGORIES), length)]
            category = CATEGORIES[int(rng.integers(0, len(CATEGORIES)))]
            user_ctr = float(rng.beta(2, 8))
            logit = -1.0 + 15.0 * (user_ctr - 0.2) + 2.5 * (category in seq_cats)
            click = int(rng.random() < 1 / (1 + np.exp(-logit)))
            conversion = int(click and rng.random() < 0.3 + 0.4 * (category in seq_cats))
            rows.append(
                {
                    "example_id": f"{date}-{i}",
                    "event_time_ms": 1_700_000_000_000 + d * 86_400_000 + i,
                    "event_date": date,
                    "user_id": f"u{int(rng.integers(0, 50))}",
                    "item_id": f"i{int(rng.integers(0, 40))}",
                    "domain": DOMAINS[i % len(DOMAINS)],
                    "category": category,
                    "position": str(int(rng.integers(0, 5))),
                    "ad_format": None if i % 7 == 0 else "video",
                    "age": None,
                    "gender": "f" if i % 2 else "m",
                    "location": "us",
                    "seq_item_ids": [f"i{int(x)}" for x in rng.integers(0, 40, length)],
                    "seq_categories": seq_cats,
                    "seq_event_types": ["click"] * length,
                    "seq_domains": ["feed"] * length,
                    "seq_event_time_ms": list(range(length)),
                    "seq_length": length,
                    "seq_truncated": 0,
                    "label_click": click,
                    "label_conversion": conversion,
                    "click_latency_ms": None,
                    "conversion_latency_ms": None,
                    "label_window_closed": True,
                    "f_user_ctr_7d": user_ctr if i % 11 else None,
                    "f_item_ctr_7d": float(rng.beta(2, 8)),
                    "f_seq_length": float(length),
                }
            )
    return pa.Table.from_pylist(rows, schema=EXAMPLES_SCHEMA)


def write_examples(lake, table: pa.Table) -> int:
    """Append ``table`` to LAKE/examples and return the new Delta version."""
    write_deltalake(table_uri(lake, "examples"), table, mode="append", partition_by=["event_date"])
    return DeltaTable(table_uri(lake, "examples")).version()


def mark_quality(lake, version: int, *, passed: bool, run_ts_ms: int = 1_000) -> None:
    """One critical quality row for examples@version, passing or failing."""
    append_quality_rows(
        lake,
        [
            {
                "table": "examples",
                "table_version": version,
                "run_id": f"run-{version}-{run_ts_ms}",
                "run_ts_ms": run_ts_ms,
                "expectation": "expect_column_values_to_not_be_null",
                "severity": "critical",
                "success": passed,
                "observed": "0 nulls" if passed else "12 nulls",
                "report_path": "",
            }
        ],
    )


def three_day_compare_config(lake, batch_size: int):
    """Three passing examples versions (one day each: 60, 40 and 40 rows) in ``lake`` and a config on it for
    a tiny ``run_compare`` (100 table rows, the three synthetic domains)."""
    from gemline.config import load_config

    for day, rows in {1: 60, 2: 40, 3: 40}.items():
        mark_quality(lake, write_examples(lake, synthetic_examples([f"2026-01-{day:02d}"], rows, seed=day)), passed=True)
    return load_config(overrides={"lake": str(lake), "trainer.num_embeddings": "100",
                                  "trainer.batch_size": str(batch_size),
                                  "ingest.domains": '["feed", "reels", "marketplace"]'})


@pytest.fixture
def make_lake(tmp_path):
    """Factory: a lake with a synthetic examples version, optionally marked passing/failing by the gate."""

    def make(dates=("2026-01-01", "2026-01-02", "2026-01-03"), rows_per_date=300, seed=7, passed: bool | None = True):
        lake = tmp_path / "lake"
        version = write_examples(lake, synthetic_examples(list(dates), rows_per_date, seed))
        if passed is not None:
            mark_quality(lake, version, passed=passed)
        return str(lake), version

    return make


@pytest.fixture
def make_examples():
    """Factory: ``make_examples(dates, rows_per_date, seed) -> pa.Table`` (see synthetic_examples)."""
    return synthetic_examples
