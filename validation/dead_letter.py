"""Dead-letter volume of one ingest batch: dead-letter rows as a fraction of the batch's records.

An ingest batch is one Delta commit of ``events`` (and the ``dead_letter`` commit of the same app
transaction) covering the Kafka offset ranges in its commit metadata. Each Kafka record of those
ranges lands in exactly one of the two tables, so

    rate = dead / (events + dead)     (records of the batch's offset ranges)

Two checks report it: ``dead_letter_rate:warning`` (severity warning, fails above
``ValidationConfig.dead_letter_warning_rate``) and ``dead_letter_rate:critical`` (fails above
``dead_letter_critical_rate``, quarantining that events version).

The critical check judges a batch only when the quarantine can protect something and the rate means
something: a batch with no good events (poison records only) has nothing to quarantine, and a batch of
fewer than ``dead_letter_min_records`` records (a streaming micro-batch: 1 bad record of 3 is a rate of
0.33) says little about the source. Either way the dead letters are kept with their reasons, the warning
still reports the rate, and the events version goes on to the build, so a few poison messages never
block the stream (issue 16).
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


def dead_letter_checks(num_events: int, num_dead: int, *, warning_rate: float, critical_rate: float,
                       min_records: int = 0) -> list[CheckResult]:
    """The two dead-letter rate checks of a batch of ``num_events`` good and ``num_dead`` dead-letter records.

    An empty batch (0 records) has rate 0: the events suite's ``empty`` check carries it. The critical check
    passes, saying why, when the batch has no good events or fewer than ``min_records`` records (module
    docstring); the warning check judges every batch.
    """
    total = num_events + num_dead
    rate = num_dead / total if total else 0.0
    details = {"observed_value": rate, "dead_letter_rows": num_dead, "batch_records": total}
    observed = f"{rate:.4g} ({num_dead} of {total} records)"
    critical_ok, critical_note = rate <= critical_rate, f"{observed}; max {critical_rate:g}"
    if not critical_ok and num_events == 0:
        critical_ok, critical_note = True, f"{critical_note}; not judged: no good events to quarantine"
    elif not critical_ok and total < min_records:
        critical_ok, critical_note = True, f"{critical_note}; not judged: fewer than {min_records} records"
    return [
        CheckResult("dead_letter_rate:warning", "warning", rate <= warning_rate, f"{observed}; max {warning_rate:g}",
                    "dead_letter", {**details, "max_rate": warning_rate}),
        CheckResult("dead_letter_rate:critical", "critical", critical_ok, critical_note, "dead_letter",
                    {**details, "max_rate": critical_rate, "min_records": min_records}),
    ]
