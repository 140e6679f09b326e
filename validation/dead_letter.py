"""Dead-letter volume of one ingest batch: dead-letter rows as a fraction of the batch's records.

An ingest batch is one Delta commit of ``events`` (and the ``dead_letter`` commit of the same app
transaction) covering the Kafka offset ranges in its commit metadata. Each Kafka record of those
ranges lands in exactly one of the two tables, so

    rate = dead / (events + dead)     (records of the batch's offset ranges)

Two checks report it: ``dead_letter_rate:warning`` (severity warning, fails above
``ValidationConfig.dead_letter_warning_rate``) and ``dead_letter_rate:critical`` (fails above
``dead_letter_critical_rate``, quarantining that events version).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from validation.suites import CheckResult


def range_bounds(rng: Any) -> tuple[int, int, int]:
    """(partition, start, end) of an offset range stored as a dict (``OffsetRange.to_dict``) or a list."""
    if isinstance(rng, dict):
        return int(rng["partition"]), int(rng["start"]), int(rng["end"])
    if isinstance(rng, (list, tuple)) and len(rng) == 3:
        return int(rng[0]), int(rng[1]), int(rng[2])
    raise ValueError(f"offset range: expected {{partition, start, end}} or [partition, start, end], got {rng!r}")


def in_ranges(table: pa.Table, offset_ranges: Sequence[Any]) -> pa.Table:
    """Rows of ``table`` (with ``kafka_partition``, ``kafka_offset``) inside any [start, end) range."""
    if table.num_rows == 0 or not offset_ranges:
        return table.slice(0, 0)
    mask = pa.array([False] * table.num_rows, pa.bool_())
    for rng in offset_ranges:
        partition, start, end = range_bounds(rng)
        hit = pc.and_(
            pc.equal(table.column("kafka_partition"), partition),
            pc.and_(pc.greater_equal(table.column("kafka_offset"), start), pc.less(table.column("kafka_offset"), end)),
        )
        mask = pc.or_(mask, pc.fill_null(hit, False).combine_chunks())
    return table.filter(mask)


def dead_letter_checks(num_events: int, num_dead: int, *, warning_rate: float, critical_rate: float) -> list[CheckResult]:
    """The two dead-letter rate checks of a batch of ``num_events`` good and ``num_dead`` dead-letter records.

    An empty batch (0 records) has rate 0: the events suite's ``empty`` check carries it.
    """
    total = num_events + num_dead
    rate = num_dead / total if total else 0.0
    details = {"observed_value": rate, "dead_letter_rows": num_dead, "batch_records": total}
    observed = f"{rate:.4g} ({num_dead} of {total} records)"
    return [
        CheckResult("dead_letter_rate:warning", "warning", rate <= warning_rate, f"{observed}; max {warning_rate:g}",
                    "dead_letter", {**details, "max_rate": warning_rate}),
        CheckResult("dead_letter_rate:critical", "critical", rate <= critical_rate,
                    f"{observed}; max {critical_rate:g}", "dead_letter", {**details, "max_rate": critical_rate}),
    ]
