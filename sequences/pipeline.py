"""The batch build: ``events`` -> ``examples``, ``sequences``, ``features/user``, ``features/item``.

    events@v --ReadEvents--+--GroupByUser--+--BuildExamples------> _staging/build/<v>/examples/
                           +--GroupByItem--+--BuildSequences-----> _staging/build/<v>/sequences/
                                           +--BuildFeatureTables-> _staging/build/<v>/features/{user,item}/
    then, on the driver, one idempotent Delta commit per table (app_id "build").

The events are shuffled twice only (by user and by item); every per-entity step reads those
groups. BuildExamples joins item counters to the user's impressions: the item-keyed pass emits
``(user_id, (example_id, f_item_*))``, read by the per-user call as a multimap side input and
looked up by example_id. Keying the join by user (not example_id) means the heavy example rows,
built last, are never shuffled. (A first version with one GroupByKey/CoGroupByKey per transform,
five event shuffles, took ~35% longer on 175K events.)

The snapshot's watermark is the largest event_time_ms of the events version read (ms since
epoch UTC); it decides ``label_window_closed`` and the as-of time of sequences and feature tables.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from apache_beam.options.pipeline_options import PipelineOptions
from tqdm import tqdm

from features.definitions import ITEM_FEATURES, USER_FEATURES
from features.pipeline import BuildFeatureTables, GroupByEntity
from gemline.config import GemlineConfig
from gemline.lake import commit_metadata, commit_once, committed_version, open_table, read_table
from ingest.schema import EVENTS_TABLE_SCHEMA
from sequences.config import BuildConfig
from sequences.examples import EXAMPLES_SCHEMA, assemble_examples, item_features, rows_to_table
from sequences.history import sequence_row
from sequences.schema import SEQUENCES_SCHEMA

APP_ID = "build"

# Columns the build needs; the Kafka bookkeeping columns stay out of the pipeline.
_EVENT_COLUMNS = [f.name for f in EVENTS_TABLE_SCHEMA if not f.name.startswith("kafka_") and f.name != "event_date"]

_ROWS_PER_FILE_BATCH = 5000
_TABLES_PER_FILE_BATCH = 64


def _item_side(keyed: tuple[str, Iterable[Mapping[str, Any]]], config: BuildConfig):
    _, events = keyed
    for user_id, example_id, dense in item_features(events, config):
        yield user_id, (example_id, dense)


def _assemble(
    keyed: tuple[str, Iterable[Mapping[str, Any]]],
    config: BuildConfig,
    watermark_ms: int,
    item_by_user: Mapping[str, Iterable[tuple[str, dict[str, float]]]],
):
    user_id, events = keyed
    table = assemble_examples(events, dict(item_by_user[user_id]), config, watermark_ms)
    return [table] if table.num_rows else []


def _sequence(keyed: tuple[str, Iterable[Mapping[str, Any]]], *, as_of_ms: int, max_seq_len: int) -> dict[str, Any]:
    user_id, events = keyed
    return sequence_row(user_id, events, as_of_ms=as_of_ms, max_seq_len=max_seq_len)


class BuildExamples(beam.PTransform):
    """``{"by_user": ..., "by_item": ...}`` (outputs of :class:`features.pipeline.GroupByEntity`)
    -> ``pyarrow.Table`` s of EXAMPLES_SCHEMA, one per user with impressions.

    The item pass emits ``(user_id, (example_id, f_item_*))``; the user pass reads them as a
    multimap side input keyed by user_id and joins them to its impressions on example_id.

    Tables rather than row dicts because a user's examples share one timeline: their sequence
    columns are gathered from it in one vectorised step (see
    :func:`sequences.examples.assemble_examples`); ``Table.to_pylist()`` gives rows.

    Args:
        config: windows, max_seq_len, CTR prior.
        watermark_ms: max event_time_ms of the snapshot (ms since epoch UTC).
    """

    def __init__(self, config: BuildConfig, *, watermark_ms: int) -> None:
        super().__init__()
        self._config = config
        self._watermark_ms = watermark_ms

    def expand(self, grouped: dict[str, beam.PCollection]) -> beam.PCollection:
        item_dense = grouped["by_item"] | "ItemCounters" >> beam.FlatMap(_item_side, self._config)
        return grouped["by_user"] | "AssembleExamples" >> beam.FlatMap(
            _assemble, self._config, self._watermark_ms, beam.pvalue.AsMultiMap(item_dense)
        )


class BuildSequences(beam.PTransform):
    """``(user_id, events)`` groups (:class:`features.pipeline.GroupByEntity`) -> ``sequences`` rows:
    per user, the newest ``max_seq_len`` events with time <= as_of_ms.

    Args:
        config: max_seq_len.
        as_of_ms: the snapshot watermark (ms since epoch UTC), stored in each row's ``as_of_ms``.
    """

    def __init__(self, config: BuildConfig, *, as_of_ms: int) -> None:
        super().__init__()
        self._config = config
        self._as_of_ms = as_of_ms

    def expand(self, by_user: beam.PCollection) -> beam.PCollection:
        return (
            by_user
            | "SequenceRow"
            >> beam.Map(_sequence, as_of_ms=self._as_of_ms, max_seq_len=self._config.max_seq_len)
        )


def _concat(tables: list[pa.Table], schema: pa.Schema) -> pa.Table:
    return pa.concat_tables(tables).cast(schema)


class _StageParquet(beam.PTransform):
    """Rows (dicts) or Arrow tables -> Parquet files ``<directory>/part-*.parquet`` of exactly ``schema``."""

    def __init__(self, directory: Path, schema: pa.Schema, *, elements: Literal["rows", "tables"]) -> None:
        super().__init__()
        self._directory = directory
        self._schema = schema
        self._elements = elements

    def expand(self, pcoll: beam.PCollection) -> Any:
        to_arrow = rows_to_table if self._elements == "rows" else _concat
        size = _ROWS_PER_FILE_BATCH if self._elements == "rows" else _TABLES_PER_FILE_BATCH
        return (
            pcoll
            | "Batch" >> beam.BatchElements(min_batch_size=size, max_batch_size=size)
            | "ToArrow" >> beam.Map(to_arrow, self._schema)
            | "WriteParquet"
            >> beam.io.WriteToParquetBatched(
                str(self._directory / "part"), schema=self._schema, file_name_suffix=".parquet"
            )
        )


@dataclass(frozen=True)
class BuildResult:
    """What one :func:`run_build` did. Percentiles are of ``seq_length`` over examples (events)."""

    events_version: int
    examples_version: int | None
    num_examples: int
    num_sequences: int
    num_user_features: int
    num_item_features: int
    seq_length_p50: float | None
    seq_length_p99: float | None
    skipped: bool


_OUTPUTS: dict[str, tuple[pa.Schema, list[str] | None]] = {
    "examples": (EXAMPLES_SCHEMA, ["event_date"]),
    "sequences": (SEQUENCES_SCHEMA, None),
    USER_FEATURES.name: (USER_FEATURES.schema, None),
    ITEM_FEATURES.name: (ITEM_FEATURES.schema, None),
}


def _built_from(lake: str, table: str) -> int | None:
    meta = commit_metadata(lake, table, APP_ID)
    return None if meta is None else meta.get("events_version")


def _read_staged(directory: Path, schema: pa.Schema) -> pa.Table:
    files = sorted(str(p) for p in directory.glob("*.parquet"))
    if not files:
        return schema.empty_table()
    return ds.dataset(files, format="parquet").to_table().select(schema.names).cast(schema)


def _result_from_lake(lake: str, events_version: int, *, skipped: bool) -> BuildResult:
    def rows(table: str) -> int:
        dt = open_table(lake, table)
        return 0 if dt is None else dt.to_pyarrow_dataset().count_rows()

    examples = open_table(lake, "examples")
    lengths_np = np.zeros(0) if examples is None else (
        examples.to_pyarrow_dataset().to_table(columns=["seq_length"]).column("seq_length").to_numpy()
    )
    has = lengths_np.size > 0
    return BuildResult(
        events_version=events_version,
        examples_version=None if examples is None else examples.version(),
        num_examples=rows("examples"),
        num_sequences=rows("sequences"),
        num_user_features=rows(USER_FEATURES.name),
        num_item_features=rows(ITEM_FEATURES.name),
        seq_length_p50=float(np.percentile(lengths_np, 50)) if has else None,
        seq_length_p99=float(np.percentile(lengths_np, 99)) if has else None,
        skipped=skipped,
    )


def _check_events(names: list[str]) -> None:
    missing = [name for name in _EVENT_COLUMNS if name not in names]
    if missing:
        raise ValueError(
            f"events table lacks columns {missing}; expected ingest.schema.EVENTS_TABLE_SCHEMA (got {names})"
        )


def _read_event_rows(_: Any, lake: str, version: int):
    """Yield the ``events`` rows at ``version`` as dicts (inside the pipeline, so no data is pickled
    into the pipeline graph: ``beam.Create`` of the rows cost a minute of bz2 compression)."""
    events = read_table(lake, "events", version, columns=_EVENT_COLUMNS)
    with tqdm(total=events.num_rows, desc=f"read events@{version}", unit="event") as progress:
        for batch in events.to_batches(max_chunksize=10_000):
            yield from batch.to_pylist()
            progress.update(batch.num_rows)


def run_build(
    config: GemlineConfig, *, events_version: int | None = None, beam_args: list[str] | None = None
) -> BuildResult:
    """Build examples, sequences and feature tables from ``events`` at ``events_version``.

    Reads ``events`` (latest version when None), runs the Beam pipeline (DirectRunner unless
    ``beam_args`` say otherwise), stages Parquet under ``LAKE/_staging/build/<events_version>/``
    and overwrites each output table in one Delta commit tagged (``"build"``, next version) with
    metadata ``{"events_version": v, "watermark_ms": w}`` (w: the snapshot's newest event time). Restartable: a table already built from this events
    version is not committed again, and when all are, the call returns ``skipped=True`` and
    changes nothing.

    Raises:
        ValueError: there is no ``events`` table (run ingest first), or it lacks columns.
    """
    lake = config.lake
    table = open_table(lake, "events", events_version)
    if table is None:
        raise ValueError(f"no events table under {lake!r}; run the ingest job first")
    version = table.version()
    pending = [name for name in _OUTPUTS if _built_from(lake, name) != version]
    if not pending:
        return _result_from_lake(lake, version, skipped=True)

    _check_events(table.to_pyarrow_dataset().schema.names)
    times = read_table(lake, "events", version, columns=["event_time_ms"]).column("event_time_ms")
    newest_ms = pc.max(times).as_py()
    # An empty snapshot has no event time; the epoch makes every as-of output empty, as it should be.
    watermark_ms = 0 if newest_ms is None else int(newest_ms)
    staging = Path(lake) / "_staging" / APP_ID / str(version)
    # A crashed earlier attempt may have left partial files: start the staging area afresh.
    shutil.rmtree(staging, ignore_errors=True)

    with beam.Pipeline(options=PipelineOptions(beam_args or [])) as pipeline:
        rows = (
            pipeline
            | "Start" >> beam.Create([version])
            | "ReadEvents" >> beam.FlatMap(_read_event_rows, lake, version)
        )
        grouped = {
            "by_user": rows | "GroupByUser" >> GroupByEntity("user_id"),
            "by_item": rows | "GroupByItem" >> GroupByEntity("item_id"),
        }
        outputs = {
            "examples": grouped | "BuildExamples" >> BuildExamples(config.build, watermark_ms=watermark_ms),
            "sequences": grouped["by_user"] | "BuildSequences" >> BuildSequences(config.build, as_of_ms=watermark_ms),
        }
        features = grouped | "BuildFeatureTables" >> BuildFeatureTables(config.build, as_of_ms=watermark_ms)
        outputs[USER_FEATURES.name] = features["user"]
        outputs[ITEM_FEATURES.name] = features["item"]
        for name, pcoll in outputs.items():
            elements = "tables" if name == "examples" else "rows"
            pcoll | f"Stage[{name}]" >> _StageParquet(staging / name, _OUTPUTS[name][0], elements=elements)

    for name in tqdm(pending, desc="commit build tables", unit="table"):
        schema, partition_by = _OUTPUTS[name]
        data = _read_staged(staging / name, schema)
        last = committed_version(lake, name, APP_ID)
        commit_once(
            lake,
            name,
            data,
            app_id=APP_ID,
            version=0 if last is None else last + 1,
            mode="overwrite",
            partition_by=partition_by,
            metadata={"events_version": version, "watermark_ms": watermark_ms},
        )
    shutil.rmtree(staging, ignore_errors=True)
    return _result_from_lake(lake, version, skipped=False)
