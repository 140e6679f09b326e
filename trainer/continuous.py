"""Continuous training: consume each new ``examples`` version once, evaluating on it before training on it.

``run_once`` (``gemline train --once``, a daily scheduled run) resumes from the newest complete continuous
checkpoint, reads only the rows the versions after its cursor added (:mod:`gemline.increments`, bounded
batches, compactions never re-read), and for each version the quality gate allows:

1. **progressive validation** -- the current model predicts the version's rows before it trains on them
   (train on t, evaluate on t+1: the streaming protocol of generative-recommenders' DLRM-v3 loop and of
   MLPerf DLRMv4's temporal evaluation); AUC, NE, calibration and the row count per task and domain go to
   the Delta table ``training_metrics``, once per (run, version) (an app transaction per evaluation);
2. **training** on the rows, in the order of the log, shuffled within each read batch (an fnw/defer version's
   files gathered into one, up to :data:`READ_ROWS` rows) by a seed derived
   from (trainer.seed, version, file index, row offset), so a resumed run replays the same order;
3. its **freshness** -- p50/p95/p99 of impression -> published -> trained over the rows trained, to the Delta
   table ``freshness`` once per (run, version), just before the checkpoint (:mod:`trainer.freshness`);
4. a **checkpoint** ``LAKE/_continuous/_checkpoints/step-N`` holding model, optimisers, RNG states, the
   input normalizer, the cursor and the lineage of every version consumed or skipped.

Versions are consumed up to the newest one the gate allows. Versions in between that were never
validated are covered by that validation (it reads the whole table); a quarantined version is skipped
and recorded, and consumed by a later run once released (``gemline quality release V``). Versions after
the newest allowed one wait for their validation.

With ``nproc > 1`` (``gemline train --once --nproc N``) every rank of a torchrun job runs :func:`consume`: the
same versions, read batches and global batches, each rank training its slice of each (trainer.loop's one
loop, trainer.sharded_engine); rank 0 writes the metrics, the report and the checkpoint's meta.json, whose
DCP shards (model and both optimisers of every rank) sit in ``_checkpoints/sharded/step-N``.

Exactly once: the cursor is saved with the parameters, so after a crash at any point the next run
restarts from the last checkpoint and every row after it is trained again, from the same parameters,
in the same order: each published, gate-allowed example reaches the final model exactly once.

Source: Delta streaming source offsets (Spark ``DeltaSourceOffset``); progressive validation (Blum, Kalai,
Langford, COLT 1999; the DLRM-v3 streaming train/eval loop in meta-recsys/generative-recommenders).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import torch
import torch.distributed as dist

from gemline.errors import BadConfigError, CheckpointError, MissingInputError
from gemline.gate import GateWatch, gate_decisions
from gemline.increments import Cursor, CursorError, latest_version, read_from, table_id
from gemline.lake import Lake, StorageOptions, is_remote, lake_fs, open_table
from gemline.locks import holding
from gemline.polling import REPORT_CPU_SHARE, ReportThrottle, poll
from gemline.tables import Table, commit
from trainer import freshness, teacher_log
from trainer.checkpoint import (
    CHECKPOINTS_DIR,
    STEP_DIR,
    TrainState,
    latest_checkpoint,
    model_mismatch,
    param_average_decays,
    read_state,
    restore_rng_state,
    rng_state,
)
from trainer.config import TrainerConfig
from trainer.data import (
    HASH_NAMESPACE,
    SEQUENCE_KEYS,
    DenseNormalizer,
    EncodedExamples,
    PointerReader,
    dense_names,
    encode_for,
    fit_normalizer,
    pointer_history,
    take_rows,
    with_history_ids,
)
from trainer.delayed import first_publications, is_correction
from trainer.id_mapping import MAPPING_FILE, IdMapping, start_mapping, with_rows
from trainer.labels import final_labels
from trainer.loop import Engine, EngineFactory, GlobalBatch, LocalEngine, Progress, local_engine, train_loop
from trainer.metrics import TASKS, evaluate, nan_to_none
from trainer.run_report import write_run_report
from trainer.sharded_checkpoint import sharded_checkpoint_dir
from trainer.train import prior_rates

log = logging.getLogger(__name__)

EXAMPLES = Table.EXAMPLES
METRICS_TABLE = Table.TRAINING_METRICS
CONTINUOUS_DIR = "_continuous"
"""Continuous runs keep their checkpoints under ``LAKE/_continuous/runs/<run_id>/_checkpoints``, apart from one-shot
runs; ``LAKE/_continuous/CURRENT`` names the run a plain ``--once`` resumes (:func:`current_root`)."""
CURRENT_RUN_FILE = "CURRENT"
RUN_MARKER = "RUN"
"""``runs/<run_id>/RUN``: written when a run starts, before ``CURRENT`` names it, so a run that has not checkpointed
yet is told apart from a name that points nowhere."""
RUN_ID = re.compile(r"^[0-9a-f]{12}$")
"""What a continuous run id is (``uuid4().hex[:12]``): a name read from the lake is used in a path only if it is one."""

TRAINING_METRICS_SCHEMA = pa.schema([
    pa.field("run_id", pa.string(), nullable=False),
    pa.field("step", pa.int64(), nullable=False),  # optimiser steps before the evaluated version was trained on
    pa.field("examples_version", pa.int64(), nullable=False),
    pa.field("domain", pa.string(), nullable=False),  # "all" for the overall row
    pa.field("task", pa.string(), nullable=False),  # click | conversion | ids (domain: the id namespace)
    pa.field("metric", pa.string(), nullable=False),  # auc | ne | calibration | base_rate | num_examples | ID_METRICS
    pa.field("value", pa.float64()),  # null where the metric is undefined (e.g. AUC without positives)
    pa.field("wall_time_ms", pa.int64(), nullable=False),  # ms since epoch UTC
])
"""Arrow schema of the ``training_metrics`` Delta table (one row per run, version, domain, task, metric)."""

_METRICS = ("auc", "ne", "calibration", "base_rate", "num_examples")


def continuous_root(lake: str | Path) -> str:
    """``LAKE/_continuous``: the folder of every continuous run (and the checkpoint root of runs from before
    runs had their own folders)."""
    return f"{str(lake).rstrip('/')}/{CONTINUOUS_DIR}"


def run_root(lake: str | Path, run_id: str) -> str:
    """The pseudo-lake whose ``_checkpoints`` holds the checkpoints of continuous run ``run_id``."""
    return f"{continuous_root(lake)}/runs/{run_id}"


def current_root(lake: str | Path, storage_options: StorageOptions | None = None) -> str:
    """The checkpoint root of the run a plain ``train --once`` resumes: the run ``LAKE/_continuous/CURRENT`` names,
    else :func:`continuous_root` (a lake whose runs predate run folders).

    Why a pointer: a ``--from-scratch`` run starts at step 0, so "the checkpoint with the highest step" across
    runs would resume the older, longer run; each run's own folder and the pointer to the newest make the new
    run the one that goes on.

    A name read from the lake is checked before it is used: CURRENT must hold a run id (:data:`RUN_ID`) of a run
    that was started here (its ``RUN`` marker) or has a complete checkpoint.

    Raises:
        gemline.errors.CheckpointError: CURRENT is not a run id (garbled, a path), or names a run that neither started
            here nor has a checkpoint (deleted, or written by hand); the message says how to go on.
    """
    fs, base = lake_fs(continuous_root(lake), storage_options)
    try:
        with fs.open_input_stream(f"{base}/{CURRENT_RUN_FILE}") as fh:
            raw = fh.read(4096)
    except (FileNotFoundError, OSError):
        return continuous_root(lake)
    where = f"{continuous_root(lake)}/{CURRENT_RUN_FILE}"
    fix = ("write the id of a run under runs/ that has a checkpoint into it, or start a new run with "
           "`gemline train --once --from-scratch`")
    run_id = raw.decode("utf-8", errors="replace").strip()
    if not RUN_ID.match(run_id):
        raise CheckpointError(f"{where} holds {run_id[:40]!r}, not a run id (12 hex digits): {fix}")
    root = run_root(lake, run_id)
    marker = fs.get_file_info(f"{base}/runs/{run_id}/{RUN_MARKER}")
    if marker.type != pafs.FileType.File and latest_checkpoint(root, storage_options=storage_options) is None:
        raise CheckpointError(f"{where} names run {run_id}, which has no checkpoint under {root}: {fix}")
    return root


def _set_current(lake: str | Path, run_id: str, storage_options: StorageOptions | None) -> None:
    """Point ``LAKE/_continuous/CURRENT`` at ``run_id``: a new file renamed over the old on a local lake (a reader
    sees the old run or the new, never half a name); one PUT on an object store (atomic there)."""
    fs, base = lake_fs(continuous_root(lake), storage_options)
    fs.create_dir(f"{base}/runs/{run_id}", recursive=True)
    with fs.open_output_stream(f"{base}/runs/{run_id}/{RUN_MARKER}") as out:
        out.write(json.dumps({"run_id": run_id, "started_ms": int(time.time() * 1000)}).encode())
    if is_remote(lake):
        with fs.open_output_stream(f"{base}/{CURRENT_RUN_FILE}") as out:
            out.write(run_id.encode())
        return
    tmp = Path(base) / f".{CURRENT_RUN_FILE}.{run_id}.tmp"
    tmp.write_text(run_id)
    os.replace(tmp, Path(base) / CURRENT_RUN_FILE)


@dataclass
class ContinuousResult:
    """What one :func:`run_once` call did.

    ``versions`` holds one lineage record per examples version this call consumed or skipped:
    ``{"version", "rows_trained", "quality", "evaluated"}`` (quality: passed, released or quarantined).
    """

    run_id: str
    step: int
    rows_trained_total: int
    cursor: Cursor | None
    versions: list[dict[str, Any]] = field(default_factory=list)
    progressive: list[dict[str, Any]] = field(default_factory=list)
    """Per evaluated version: ``{"examples_version", "rows", "auc", "ne"}`` of the click task, overall."""
    checkpoint_path: str | None = None
    waiting_for: int | None = None
    """The first version this call stopped at because the gate does not allow it (None: caught up)."""
    waiting_reason: str = ""
    """Why it waits, in the gate's words (:class:`gemline.gate.GateDecision`: not validated yet, or quarantined)."""
    waiting_quarantined: bool = False
    """Whether ``waiting_for`` was judged and refused (quarantined), rather than not validated yet."""
    freshness: list[dict[str, Any]] = field(default_factory=list)
    """The ``freshness`` rows this call measured (:mod:`trainer.freshness`), whether or not an earlier, crashed
    call had already committed that version's."""
    report_path: str | None = None
    """``LAKE/_runs/<run_id>/report.html``: the run's curves and lineage (:mod:`trainer.run_report`)."""
    report_cpu_s: float = 0.0
    """CPU-seconds the report took to write (0 when not written)."""
    empty_versions: list[int] = field(default_factory=list)
    """Allowed versions a new run passed over because they hold no rows yet (:data:`sequences.config.NOTHING_PUBLISHED`);
    a later call reads them again, so a run starts on the first version with rows."""


def _metric_rows(run_id: str, step: int, version: int, metrics: dict, now_ms: int) -> list[dict[str, Any]]:
    rows = []
    for task in TASKS:
        scopes = {"all": metrics[task]["overall"], **metrics[task]["by_domain"]}
        for domain, values in scopes.items():
            for name in _METRICS:
                value = nan_to_none(values.get(name))
                value = None if value is None else float(value)
                rows.append({"run_id": run_id, "step": step, "examples_version": version, "domain": domain,
                             "task": task, "metric": name, "value": value, "wall_time_ms": now_ms})
    return rows


def _append_metrics(lake: Lake, run_id: str, sequence: int, rows: list[dict[str, Any]], *, stream: str = "train") -> None:
    """Append one evaluation's rows to ``training_metrics`` once: app transaction (<stream>:<run_id>, sequence)."""
    # A sequence already there was written before a crash that came before the checkpoint: skipped.
    commit(lake.root, METRICS_TABLE, pa.Table.from_pylist(rows, schema=TRAINING_METRICS_SCHEMA), app_id=f"{stream}:{run_id}",
           version=sequence, version_rule="increasing", storage_options=lake.storage_options)


ID_METRICS = ("collision_share", "oov_share", "distinct_ids", "rows", "width")
"""Metrics of the ``task = "ids"`` rows of ``training_metrics`` (trainer.id_mapping.Vocabulary.stats)."""


def _id_metric_rows(run_id: str, step: int, version: int, ids: IdMapping, now_ms: int) -> list[dict[str, Any]]:
    """The id mapping's collision counts after training on ``version``: one row per namespace (``domain``) and
    metric of :data:`ID_METRICS`, task ``"ids"``."""
    return [{"run_id": run_id, "step": step, "examples_version": version, "domain": ns, "task": "ids",
             "metric": name, "value": float(values[name]), "wall_time_ms": now_ms}
            for ns, values in ids.stats().items() for name in ID_METRICS]


@dataclass
class WarmEngine:
    """A long-running trainer's engine as its newest checkpoint holds it (``train --follow``, one process): kept in
    memory across :func:`run_once` calls, so a call that resumes from that very checkpoint skips building the model
    and loading ``state.pt`` (GEM's 19M table parameters allocated, initialised, then overwritten: 3.0 % and 1.1-1.5 %
    of a follow-like replay's CPU on the 3-minute freshness lake, README "Freshness, measured").

    It stands for one checkpoint only: :meth:`take` empties it, and a call puts the engine back (:meth:`keep`) right
    after each checkpoint it writes, so an engine trained past its checkpoint (a call that raised) is never reused.
    The checkpoint is recognised by its path and its ``saved_ms``: a checkpoint another process wrote in between
    (another ``train --once``) is loaded from disk as before, and so is every checkpoint of an object-store lake
    (downloaded to another path). The id mapping is kept as the bytes the checkpoint
    saved and the RNG states as it saved them, so a warm resume restores what loading would, bit for bit.
    """

    engine: Engine | None = None
    path: str | None = None
    saved_ms: int | None = None
    mapping: bytes = b""
    rng: dict[str, Any] = field(default_factory=dict)

    def keep(self, engine: Engine, path: str, saved_ms: int, mapping: bytes) -> None:
        """Hold ``engine``, just saved to checkpoint ``path`` (``saved_ms``, the id mapping ``mapping``)."""
        self.engine, self.path, self.saved_ms, self.mapping, self.rng = engine, path, saved_ms, mapping, rng_state()

    def clear(self) -> None:
        """Hold nothing (the engine is about to change)."""
        self.engine = None

    def take(self, path: str, saved_ms: int) -> tuple[Engine, IdMapping] | None:
        """The engine and id mapping of checkpoint ``path`` saved at ``saved_ms``, the RNG states restored as it saved
        them; None (and nothing restored) when another checkpoint's, or none, is held. Empties the holder."""
        engine, held = self.engine, (self.path, self.saved_ms)
        self.clear()
        if engine is None or held != (path, saved_ms):
            return None
        restore_rng_state(self.rng)
        return engine, IdMapping.from_bytes(self.mapping)


BOOTSTRAP_ROWS = 100_000
"""Rows of a new run's first version that fit the input normalizer, the domains and the output bias."""


READ_ROWS = 131_072
"""Rows of one version read (and shuffled) together at most when its rows were published early (fnw, defer): its
consecutive files are gathered into one read up to this many rows. Why: the build writes a version's rows to one file
per event date, and training shuffles within a read only. Under fnw/defer the older dates' files hold mostly
corrections (real negatives, late positives) and the newest the first publications with their early positives, so
file-sized reads trained those last and the models overpredicted at the next version's evaluation (README "Late
labels", 2026-12-04: LR's click calibration 1.27 -> 1.06 under defer, LR's fnw click AUC 0.578 -> 0.639). A wait
version's files are read one by one as before: all its rows are final, and training the newest date last measured
better there. The same bound as :data:`REUSE_MAX_ROWS`, which keeps that many encoded rows anyway."""


def _published_early(batch: pa.RecordBatch) -> bool:
    """Whether any row of ``batch`` was published before its labels were final (``label_mode`` fnw or defer)."""
    if "label_mode" not in batch.schema.names:
        return False
    return bool(pc.any(pc.not_equal(batch.column("label_mode"), "wait")).as_py())


def _reads(lake: Lake, tc: TrainerConfig, start: Cursor, version: int) -> Iterator[tuple[pa.Table | None, Cursor]]:
    """``(rows, position after them)`` of each read of what ``version`` added from ``start`` on, in log order: a
    file's rows in reads of at most ``trainer.batch_size * 64`` rows, and consecutive early-published ones
    (:func:`_published_early`) gathered into reads of at most :data:`READ_ROWS` rows; rows None for a read that only
    moves the position (:func:`gemline.increments.read_from`)."""
    held: list[pa.RecordBatch] = []
    rows, last = 0, start
    for _, batch, after in read_from(lake.root, EXAMPLES, start, until_version=version,
                                     batch_rows=min(tc.batch_size * 64, READ_ROWS), storage_options=lake.storage_options):
        early = batch is not None and _published_early(batch)
        if held and (batch is None or not early or rows + batch.num_rows > READ_ROWS):
            yield pa.Table.from_batches(held), last
            held, rows = [], 0
        if batch is None:
            yield None, after
            continue
        if not early:
            yield pa.Table.from_batches([batch]), after
            continue
        held.append(batch)
        rows += batch.num_rows
        last = after
    if held:
        yield pa.Table.from_batches(held), last


def _version_batches(lake: Lake, tc: TrainerConfig, start: Cursor, version: int) -> Iterator[pa.RecordBatch]:
    """The read batches (``trainer.batch_size * 64`` rows at most) ``version`` added from ``start`` on."""
    for _, batch, _ in read_from(lake.root, EXAMPLES, start, until_version=version, batch_rows=tc.batch_size * 64,
                                 storage_options=lake.storage_options):
        if batch is not None:
            yield batch


REUSE_MAX_ROWS = 131_072
"""Rows of a version whose reads and encoding its progressive evaluation keeps for its training (0: none; each
pass reads and encodes the version itself). Both passes read the same rows from the same position, and with
hashed ids (``trainer.ids.mapping = "hash"``) an id's row does not depend on what was observed, so one encoding
serves both (:func:`trainer.data.take_rows` gives evaluation its rows): on the 3-minute freshness lake encoding
both passes' rows (their pointer history included) was 13 % of a version's CPU, 5 % after. Larger versions
are read twice, as before, so memory stays bounded (~130k encoded rows, a few hundred MB at 256-event histories)."""


@dataclass(frozen=True)
class _Read:
    """One read of a version, as its training takes it: the rows (None: the read only moved the position), their
    encoding when kept from the progressive evaluation (None: encode them), and the position after them."""

    table: pa.Table | None
    data: EncodedExamples | None
    after: Cursor


def _bootstrap_sample(lake: Lake, tc: TrainerConfig, start: Cursor, version: int) -> pa.Table:
    """The first :data:`BOOTSTRAP_ROWS` (or fewer) rows ``version`` added: what a new run is sized and
    normalized by, read in bounded memory whatever the version holds."""
    batches, rows = [], 0
    for batch in _version_batches(lake, tc, start, version):
        batches.append(batch)
        rows += batch.num_rows
        if rows >= BOOTSTRAP_ROWS:
            break
    return pa.Table.from_batches(batches) if batches else pa.table({})


def _sizing_sample(lake: Lake, upto: int) -> pa.Table:
    """The id columns of ``examples@upto`` (every version a new run may consume when it starts): what its id
    tables are sized by (trainer.id_mapping). A first version alone can be tiny (the Taobao demo's first five
    versions hold 7 rows: tables sized by them would send nearly every later id to the OOV row); only the
    rows' count per id is used, no row is trained or evaluated on here. Pointer-layout rows (build.examples_layout)
    hold no history lists: they are read whole (they are small without them) and their lists rebuilt from the
    history table, so both layouts count the same ids."""
    dt = open_table(lake, EXAMPLES, upto, storage_options=lake.storage_options)
    if dt is None:
        return pa.table({})
    dataset = dt.to_pyarrow_dataset()
    if all(key in dataset.schema.names for key in SEQUENCE_KEYS):
        return dataset.to_table(columns=list(HASH_NAMESPACE))
    table = dataset.to_table()
    table = with_history_ids(table, pointer_history(lake, table, storage_options=lake.storage_options))
    return table.select([c for c in HASH_NAMESPACE if c in table.schema.names])


@dataclass(frozen=True)
class ProgressivePredictions:
    """What the model predicted for one examples version before training on it, in the order of the log.

    ``labels`` (N, 2) 0/1 and ``probs`` (N, 2) float64 probabilities, columns ``trainer.metrics.TASKS``;
    ``domains`` (N,) object; ``example_ids`` (N,) object (empty when not collected). ``trainer.compare`` pairs
    these rows across models for its bootstrap; ``benchmarks.label_modes`` joins them with the final labels.
    Correction rows (:mod:`trainer.delayed`) are not evaluated: each impression once. ``final`` (N, 2) bool marks
    the labels whose window had closed (:mod:`trainer.labels`); only those are judged. None: every label.
    """

    version: int
    labels: np.ndarray
    probs: np.ndarray
    domains: np.ndarray
    example_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=object))
    final: np.ndarray | None = None


PredictionsHook = Callable[[ProgressivePredictions], None]
"""Called with each progressive evaluation's predictions (:func:`run_once`'s ``on_predictions``)."""


def _progressive(engine: Engine, lake: Lake, tc: TrainerConfig, normalizer: DenseNormalizer, mapping: IdMapping,
                 start: Cursor, version: int, pointers: PointerReader, on_predictions: PredictionsHook | None = None,
                 capture: teacher_log.VectorCapture | None = None,
                 kept: list[_Read] | None = None) -> dict | None:
    """:func:`trainer.metrics.evaluate` of ``engine``'s model on every row ``version`` added, predicted batch by
    batch (memory: the (N, 2) labels and probabilities, not the rows); None for a version without rows. Ids are
    looked up in ``mapping`` as trained so far (not counted).
    ``on_predictions`` sees the predictions before they are evaluated (rank 0); ``capture`` collects the
    model's vectors of every row predicted (a :class:`trainer.loop.LocalEngine` only).

    ``kept``: when given and the mapping hashes ids, every read of the version (up to :data:`REUSE_MAX_ROWS` rows)
    is appended to it with all its rows encoded once, for the training that follows; it is emptied again when
    the version is larger, and then training reads the version itself.

    Collective on a sharded engine: each rank predicts its share, rank 0 evaluates; the other ranks return
    ``{}`` for a version with rows, so every rank agrees on whether it was evaluated."""
    labels, probs, domains, ids, final = [], [], [], [], []
    reuse = kept is not None and mapping.mode == "hash" and REUSE_MAX_ROWS > 0
    kept_rows = 0
    for read, after in _reads(lake, tc, start, version):
        if read is not None and reuse and kept_rows + read.num_rows > REUSE_MAX_ROWS:
            reuse = False
            assert kept is not None
            kept.clear()
        if not reuse:
            if read is None:
                continue
            table = first_publications(read)
            if table.num_rows == 0:
                continue
            data = encode_for(table, tc, normalizer, pointers(table), ids=mapping)
        else:
            assert kept is not None
            encoded = None if read is None else encode_for(read, tc, normalizer, pointers(read), ids=mapping)
            kept.append(_Read(read, encoded, after))
            if read is None or encoded is None:
                continue
            kept_rows += read.num_rows
            first = np.flatnonzero(~is_correction(read))
            if len(first) == 0:
                continue
            table = read if len(first) == read.num_rows else read.take(first)
            data = encoded if len(first) == read.num_rows else take_rows(encoded, first)
        labels.append(data.labels)
        final.append(data.final if data.final is not None else np.ones(data.labels.shape, dtype=bool))
        part: np.ndarray | None
        if capture is not None and isinstance(engine, LocalEngine):
            with capture.recording(engine.model):
                part = engine.predict(data, tc.batch_size)
        else:
            part = engine.predict(data, tc.batch_size)
        if part is not None:
            probs.append(part)
        domains.append(np.asarray(data.domains, dtype=object))
        ids.append(np.asarray(table.column("example_id").to_pylist(), dtype=object))
    if not labels:
        return None
    if not probs:  # not rank 0
        return {}
    predictions = ProgressivePredictions(version, np.concatenate(labels), np.concatenate(probs), np.concatenate(domains),
                                         np.concatenate(ids), np.concatenate(final))
    if on_predictions is not None:
        on_predictions(predictions)
    return evaluate(predictions.labels, predictions.probs, predictions.domains, predictions.final)


def _log_teacher(lake: Lake, run_id: str, sequence: int, step: int, saved_ms: int, trained_until_ms: int,
                 predictions: ProgressivePredictions, capture: teacher_log.VectorCapture) -> None:
    """Write one evaluation's ``teacher_predictions`` rows once (app transaction ``sequence``, the number of its
    ``training_metrics`` commit); ``saved_ms`` and ``trained_until_ms`` are those of the predicting checkpoint."""
    rows = teacher_log.prediction_rows(
        example_ids=predictions.example_ids, domains=predictions.domains, probs=predictions.probs, run_id=run_id,
        step=step, checkpoint_ms=saved_ms, data_ms=trained_until_ms, version=predictions.version,
        vectors=capture.vectors(len(predictions.probs)))
    teacher_log.append_predictions(lake, run_id, sequence, rows)


def _measure(lake: Lake, run_id: str, sequence: int, version: int, clock: freshness.VersionClock,
             published_ms: int | None) -> list[dict[str, Any]]:
    """Write examples@version's ``freshness`` rows once (app transaction ``sequence``) and return them; [] when
    the version's commit is no longer in the Delta log (log retention), so it has no publish time."""
    if published_ms is None:
        log.warning("examples@%d: its commit is no longer in the Delta log, so its freshness is not measured", version)
        return []
    rows = clock.rows(run_id, version, published_ms, freshness.wall_ms())
    freshness.append_freshness(lake, run_id, sequence, rows)
    return rows


def _prune(root: str, keep: int) -> None:
    """Keep the ``keep`` newest complete continuous checkpoints and their sharded (DCP) folders (local lakes)."""
    if is_remote(root):
        return
    folder = Path(root) / CHECKPOINTS_DIR
    steps = sorted((int(m.group(1)), p) for p in folder.glob("step-*")
                   if (m := STEP_DIR.match(p.name)) and (p / "meta.json").is_file())
    for step, path in steps[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(sharded_checkpoint_dir(root, step), ignore_errors=True)


@holding("train")
def run_once(lake: Lake, tc: TrainerConfig, *, from_scratch: bool = False, keep_checkpoints: int = 3,
             max_versions: int | None = None, progress: bool = False, nproc: int = 1, root: str | None = None,
             on_predictions: PredictionsHook | None = None, write_report: bool = True,
             pointers: PointerReader | None = None, warm: WarmEngine | None = None) -> ContinuousResult:
    """Consume every new, gate-allowed ``examples`` version of ``lake`` once (module docstring) with the model
    and optimisation of ``tc``, checkpoint, return.

    Holds ``LAKE/_locks/train.lock`` for the run (the ranks of a sharded run under it take no lock).

    Args:
        from_scratch: start a new run (new run id, cursor at version 0) instead of resuming.
        keep_checkpoints: complete continuous checkpoints kept (the newest).
        max_versions: stop after consuming this many versions (tests, bounded daily runs); None: all.
        nproc: processes; > 1 runs :func:`consume` on every rank of a torchrun job (trainer.launch), the
            model sharded (trainer.sharded_engine); the result is rank 0's.
        root: the folder whose ``_checkpoints`` holds this run's checkpoints; None: the lake's continuous
            run (:func:`continuous_root`). ``gemline compare`` gives each model its own. One process only.
        on_predictions: called with each progressive evaluation's :class:`ProgressivePredictions` (before
            its metrics are written); an exception it raises stops the run as a crash would. One process only.
        write_report: rewrite the run report after training (False: ``report_path`` stays None; the next
            report shows everything, being drawn from the checkpoint's lineage and the lake's tables). One
            process only: with ``nproc > 1`` it is always rewritten.
        pointers: the pointer-layout history reader to keep across calls (:func:`follow`); None: a new one.
            One process only (the ranks of a torchrun job read their own).
        warm: the engine kept across calls (:class:`WarmEngine`, :func:`follow`); None: built and loaded each call.
            One process only.

    Returns:
        A :class:`ContinuousResult`.

    Raises:
        gemline.errors.MissingInputError: there is no ``examples`` table (a FileNotFoundError).
        gemline.increments.CursorError: the table was recreated, or rows under the cursor are gone.
        gemline.locks.LakeBusyError: another continuous trainer runs on this lake.
        ValueError: ``keep_checkpoints < 1``; ``root`` or ``on_predictions`` with ``nproc > 1``.
        gemline.errors.InputSchemaError: a dense column the model was trained with is missing or retyped.
        gemline.errors.BadConfigError: with ``nproc > 1``: an object-store lake, a checkpoint of another world
            size or of a one-process run.
        gemline.errors.BadConfigError: the run being resumed trains another ``trainer.model``.
    """
    if keep_checkpoints < 1:
        raise ValueError(f"run_once: expected keep_checkpoints >= 1, got {keep_checkpoints}")
    if nproc > 1 and (root is not None or on_predictions is not None):
        raise ValueError("run_once: root and on_predictions need nproc=1 (the ranks of a torchrun job are other "
                         "processes)")
    if nproc > 1:
        # trainer.launch imports this module on the ranks' side (consume); the launcher is imported here only.
        from trainer.launch import run_once_with_torchrun

        return run_once_with_torchrun(lake, tc, nproc, from_scratch=from_scratch, keep_checkpoints=keep_checkpoints,
                                      max_versions=max_versions)
    # trainer.torch_threads, as one-shot training (trainer.train) and the torchrun ranks use it: torch's default
    # of a thread per core oversubscribes the cores `gemline run` shares with the other stages.
    previous_threads = torch.get_num_threads()
    if tc.torch_threads is not None:
        torch.set_num_threads(tc.torch_threads)
    try:
        result = consume(lake, tc, local_engine, from_scratch=from_scratch, keep_checkpoints=keep_checkpoints,
                         max_versions=max_versions, root=root, on_predictions=on_predictions,
                         write_report=write_report, pointers=pointers, warm=warm)
    finally:
        torch.set_num_threads(previous_threads)
    assert result is not None, "one process is rank 0"
    return result


def _report_current(lake: Lake, run_id: str, saved_ms: int) -> bool:
    """Whether run ``run_id``'s report page exists and is at least as new as its checkpoint saved at ``saved_ms``
    (ms since epoch UTC): one file-info call."""
    fs, base = lake_fs(lake.root, lake.storage_options)
    page = fs.get_file_info(f"{base}/_runs/{run_id}/report.html")
    return page.type == pafs.FileType.File and page.mtime is not None and page.mtime.timestamp() * 1000 >= saved_ms


def refresh_report(lake: Lake) -> str | None:
    """Rewrite the run report (:func:`trainer.run_report.write_run_report`) of the lake's current continuous run
    from its newest checkpoint's lineage when the page is missing or older than that checkpoint (its ``saved_ms``);
    return the page's path when rewritten, None when it was current or there is no checkpoint. What a follower
    calls at a stop: a report drawn at most once a minute must not stay behind the checkpoint once nothing will draw
    it again. (A ``--once`` with nothing new does the same from the checkpoint it resumed, :func:`consume`.)

    Raises:
        gemline.errors.CheckpointError: CURRENT or the checkpoint's meta.json cannot be used (:func:`current_root`).
        OSError: the lake's filesystem refuses the write.
    """
    path = latest_checkpoint(current_root(lake.root, lake.storage_options), storage_options=lake.storage_options)
    if path is None:
        return None
    state = read_state(path)
    cont = state.extra["continuous"]
    run_id = str(cont["run_id"])
    if not RUN_ID.match(run_id) or not cont.get("lineage") or _report_current(lake, run_id, int(cont.get("saved_ms", 0))):
        return None
    return write_run_report(lake, run_id, lineage=cont["lineage"], step=state.step,
                            rows_trained_total=state.examples_seen, checkpoint=str(path))


def model_signature(tc: TrainerConfig, num_dense: int, domains: tuple[str, ...]) -> dict[str, Any]:
    """What a checkpoint of the model ``tc`` builds (for ``num_dense`` dense features and ``domains``) holds:
    ``{"parameters": sorted state-dict names, "param_average_decays": {module: decay}}``.

    Built on PyTorch's meta device (shapes only: no memory, no initialisation; 0.04 s of CPU for gem_small against
    0.4 s for the real model), under a forked RNG, so a run compares a checkpoint's switches with its own before it
    builds or loads anything (an idle poll builds no model) and a checkpoint mid-run draws no random number.
    """
    from trainer.models import build_model

    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = build_model(tc, num_dense, domains)
    return {"parameters": sorted(model.state_dict()), "param_average_decays": param_average_decays(model)}


def _rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the initialised process group (a torchrun rank), else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _plan(lake: Lake, from_scratch: bool, rank: int, world: int, root: str) -> dict[str, Any]:
    """What this run consumes, decided once on rank 0 and broadcast, so every rank walks the same versions
    even when a build or a validation commits meanwhile: ``{"table_id", "resume" (checkpoint path or None),
    "run_id" (a new run's), "newest", "decisions"}``; or ``{"error": exception}`` raised on every rank."""
    plan: dict[str, Any] = {}
    if rank == 0:
        try:
            opts = lake.storage_options
            tid = table_id(lake.root, EXAMPLES, storage_options=opts)
            if tid is None:
                raise MissingInputError(f"no examples table in {lake.root}: run `gemline build` first")
            resume = None if from_scratch else latest_checkpoint(root, storage_options=opts)
            cursor_version = 0
            skipped: list[int] = []
            if resume is not None:
                cont = read_state(resume).extra["continuous"]
                cursor_version, skipped = int(cont["cursor"]["version"]), list(cont["skipped"])
            newest = latest_version(lake.root, EXAMPLES, storage_options=opts)
            assert newest is not None
            decisions = gate_decisions(lake.root, EXAMPLES, sorted(set(range(cursor_version, newest + 1)) | set(skipped)),
                                       storage_options=opts)
            plan = {"table_id": tid, "resume": None if resume is None else str(resume), "run_id": uuid.uuid4().hex[:12],
                    "newest": newest, "decisions": decisions}
        except Exception as exc:  # noqa: BLE001 - re-raised below on every rank, so no rank waits forever
            plan = {"error": exc}
    if world > 1:
        box = [plan]
        dist.broadcast_object_list(box, src=0)
        plan = box[0]
    if "error" in plan:
        raise plan["error"]
    return plan


def consume(lake: Lake, tc: TrainerConfig, make_engine: EngineFactory, *, from_scratch: bool = False, keep_checkpoints: int = 3,
            max_versions: int | None = None, root: str | None = None,
            on_predictions: PredictionsHook | None = None, write_report: bool = True,
            pointers: PointerReader | None = None, warm: WarmEngine | None = None) -> ContinuousResult | None:
    """:func:`run_once` without the lock, on one process (:func:`trainer.loop.local_engine`) or on every rank
    of an initialised process group (:func:`trainer.sharded_engine.sharded_engine`, called by trainer.launch).

    Every rank reads the same rows (the same read batches, in the same order) and trains on its slice of
    each global batch, the batches of a one-process run; why not a share of the files per rank: the cursor
    stays one value, the global batches and so the losses stay those of one process, and no rows travel
    between ranks (the reader is several times faster than training, so reading N times costs little).
    Progressive predictions are gathered on rank 0, which alone writes ``training_metrics``, the
    checkpoint's meta.json, the report and the result. ``root``, ``on_predictions``, ``pointers`` and ``warm``: as
    :func:`run_once` (``warm`` is ignored on a process group).

    Returns:
        The :class:`ContinuousResult` on rank 0, None on the other ranks.

    Raises:
        As :func:`run_once`.
    """
    opts = lake.storage_options
    pointers = PointerReader(lake) if pointers is None else pointers
    rank, world = _rank_and_world()
    warm = warm if world == 1 else None
    if world > 1 and is_remote(lake):
        raise BadConfigError("train --once/--follow with --nproc > 1 needs a local (or shared file system) lake: the "
                         "sharded checkpoints (DCP) are written to a file system every rank sees; use --nproc 1 here")
    own_root = root is None
    if root is None:  # a new run (--from-scratch) gets its own folder below: what CURRENT says does not matter
        root = continuous_root(lake.root) if from_scratch else current_root(lake.root, opts)
    plan = _plan(lake, from_scratch, rank, world, root)
    tid = plan["table_id"]
    resume = plan["resume"]
    if resume is None and own_root:  # a new run: its own folder, and the lake's current run from now on
        root = run_root(lake.root, plan["run_id"])
        if rank == 0:
            _set_current(lake.root, plan["run_id"], opts)
    engine: Engine | None = None
    normalizer: DenseNormalizer | None = None
    ids: IdMapping | None = None
    domains: tuple[str, ...] = ()
    counters = Progress()
    if resume is not None:
        state = read_state(resume)
        cont = state.extra["continuous"]
        run_id, cursor = cont["run_id"], Cursor.from_dict(cont["cursor"])
        skipped, lineage, evaluations = list(cont["skipped"]), list(cont["lineage"]), int(cont["evaluations"])
        measured = int(cont.get("measured", 0))  # checkpoints from before trainer.freshness have no count
        # Checkpoints from before trainer.teacher_log have neither: their predictions are logged as of time 0.
        saved_ms = int(cont.get("saved_ms", 0))
        trained_until_ms = int(cont.get("trained_until_ms", teacher_log.NO_DATA_MS))
        if cursor.table_id != tid:
            raise CursorError(f"examples was recreated: its table id is {tid}, the run {run_id} read {cursor.table_id}; "
                              "start a new run with `gemline train --once --from-scratch`")
        if state.extra.get("model") != tc.model:
            raise BadConfigError(f"the continuous run {run_id} trains trainer.model={state.extra.get('model')!r}, not "
                                 f"{tc.model!r}: pass --set trainer.model={state.extra.get('model')}, or start a new run "
                                 "with --from-scratch")
        # A changed switch (trainer.gem.wide, deep_gate, ema_decay, ...) is refused here, before an idle poll returns:
        # the load below would say so only once a new version arrives. Checkpoints from before issue 20 carry no
        # signature and are checked by that load alone.
        saved_signature = state.extra.get("model_signature")
        if saved_signature is not None:
            ours = model_signature(tc, len(state.extra["normalizer"]["names"]), tuple(state.extra["domains"]))
            refusal = model_mismatch(resume, set(ours["parameters"]), set(saved_signature["parameters"]),
                                     saved_signature.get("param_average_decays"), ours["param_average_decays"])
            if refusal is not None:
                raise refusal
        # Nothing to consume or release (a follow poll between builds): the model is not built, the checkpoint not
        # loaded and the report not rewritten; GEM's 19M-parameter tables made that most of an idle poll's cost.
        idle = not any(d.allowed and (v >= cursor.version or v in skipped) for v, d in plan["decisions"].items())
        if not idle:
            normalizer = DenseNormalizer.from_dict(state.extra["normalizer"])
            domains = tuple(state.extra["domains"])
            held = None if warm is None else warm.take(str(resume), saved_ms)
            if held is not None:  # this process wrote the checkpoint and kept its engine (WarmEngine)
                engine, ids = held
            else:
                ids = start_mapping(tc, pa.table({}), resume)
                torch.manual_seed(tc.seed)
                engine = make_engine(with_rows(tc, ids), len(normalizer.names), domains, None)
                engine.load(resume, state)
        counters.step, counters.examples_seen = state.step, state.examples_seen
        log.info("continuous run %s resumed from %s at step %d, cursor %s", run_id, resume, counters.step, cursor)
    else:
        run_id, cursor, idle = plan["run_id"], Cursor(tid, 0), False
        skipped, lineage, evaluations, measured = [], [], 0, 0
        saved_ms, trained_until_ms = 0, teacher_log.NO_DATA_MS
    logs_teacher = tc.logs_teacher_predictions and world == 1
    if tc.logs_teacher_predictions and world > 1 and rank == 0:
        log.warning("trainer.log_teacher_predictions is not done with --nproc > 1: no teacher predictions are logged")

    result = ContinuousResult(run_id, counters.step, counters.examples_seen, cursor)
    newest, decisions = plan["newest"], plan["decisions"]
    allowed = [v for v, d in decisions.items() if d.allowed and v >= cursor.version]
    upto = max(allowed) if allowed else cursor.version - 1
    released = [v for v in skipped if decisions[v].allowed]
    todo = released + list(range(cursor.version, upto + 1))
    if upto < newest:
        waits = decisions[upto + 1]
        result.waiting_for, result.waiting_reason, result.waiting_quarantined = upto + 1, waits.reason, waits.validated
        log.info("examples@%d and later wait for their validation (%s)", upto + 1, decisions[upto + 1].reason)

    signature: dict[str, Any] = {}

    def checkpoint() -> str | None:
        nonlocal saved_ms
        assert engine is not None and normalizer is not None and ids is not None
        saved_ms = int(time.time() * 1000)  # the teacher time of the predictions these parameters will log
        if not signature:  # one per run: the model's switches do not change within it
            signature.update(model_signature(tc, len(normalizer.names), domains))
        extra = {"normalizer": normalizer.to_dict(), "domains": list(domains), "model": tc.model,
                 "model_signature": signature,
                 "continuous": {"run_id": run_id, "cursor": cursor.to_dict(), "skipped": skipped,
                                "lineage": lineage, "evaluations": evaluations, "measured": measured,
                                "saved_ms": saved_ms, "trained_until_ms": trained_until_ms}}
        state = TrainState(step=counters.step, examples_seen=counters.examples_seen,
                           examples_version=max(cursor.version - 1, 0), extra=extra)
        mapping = ids.to_bytes()
        path = engine.save(root, state, files={MAPPING_FILE: mapping}, storage_options=opts)
        if rank == 0:
            _prune(root, keep_checkpoints)
        if warm is not None and path is not None:
            warm.keep(engine, path, saved_ms, mapping)
        return path

    sources = _Sources(lake) if rank == 0 else None
    published: dict[int, int] | None = None  # examples commit times, read once when the first version is measured
    consumed = 0
    for version in todo:
        if max_versions is not None and consumed >= max_versions:
            break
        if warm is not None:
            warm.clear()  # the engine is about to move past the checkpoint it stands for
        decision = decisions[version]
        if decision.validated and not decision.allowed:
            if version not in skipped:
                skipped.append(version)
                record = {"version": version, "rows_trained": 0, "examples": 0, "examples_final": 0, "corrections": 0,
                          "quality": "quarantined", "evaluated": False, "mean_loss": None, "step": counters.step,
                          **(sources.of(version) if sources else {})}
                lineage.append(record)
                result.versions.append(record)
                log.warning("skipping %s; `gemline quality release %d` lets a later run consume it",
                            decision.reason, version)
            if version == cursor.version:
                cursor = Cursor(tid, version + 1)
            continue
        start = cursor if version == cursor.version else Cursor(tid, version)
        if engine is None:  # a new run: the first version's rows fit the input statistics and the output bias
            first = _bootstrap_sample(lake, tc, start, version)
            if first.num_rows == 0:
                result.empty_versions.append(version)
                cursor = Cursor(tid, version + 1) if version == cursor.version else cursor
                continue
            normalizer = fit_normalizer(first)
            # The towers are those of the domains the first version holds, as in a one-shot run
            # (trainer.train.training_domains); a domain that appears later shares the unknown-domain slot.
            # Sizing them by every configured domain instead (8 by default) made GEM rank MovieLens' second
            # version at AUC 0.30 where DLRM and LR reached 0.70: not understood yet, so not done.
            domains = tuple(sorted(set(first["domain"].to_pylist()) - {None}))
            ids = start_mapping(tc, _sizing_sample(lake, upto) if tc.ids.sized_by_counts else first, None)
            first_data = encode_for(first, tc, normalizer, pointers(first), ids=ids)
            torch.manual_seed(tc.seed)
            engine = make_engine(with_rows(tc, ids), len(normalizer.names), domains,
                                 prior_rates(first_data.labels, first_data.final))
        assert engine is not None and normalizer is not None and ids is not None
        evaluated = False
        kept: list[_Read] = []  # the version's reads as evaluation encoded them (REUSE_MAX_ROWS), for training
        if counters.step > 0 and start.file_index == 0 and start.row_offset == 0:
            capture = teacher_log.VectorCapture() if logs_teacher else None
            seen: list[ProgressivePredictions] = []

            def keep(predictions: ProgressivePredictions) -> None:
                seen.append(predictions)
                if on_predictions is not None:
                    on_predictions(predictions)

            metrics = _progressive(engine, lake, tc, normalizer, ids, start, version, pointers, keep, capture, kept)
            if metrics is not None:
                evaluations += 1
                evaluated = True
                if rank == 0:
                    _append_metrics(lake, run_id, evaluations, _metric_rows(run_id, counters.step, version, metrics,
                                                                             int(time.time() * 1000)))
                    if capture is not None and seen:
                        _log_teacher(lake, run_id, evaluations, counters.step, saved_ms, trained_until_ms, seen[0],
                                     capture)
                    click = metrics["click"]["overall"]
                    result.progressive.append({"examples_version": version, "rows": int(click["num_examples"]),
                                               "auc": nan_to_none(click["auc"]), "ne": nan_to_none(click["ne"])})
        rows, losses_before = 0, len(counters.losses)
        counted = {"corrections": 0, "examples_final": 0}  # of ``rows``, for the lineage (lineage())
        usable = [0]  # labels the loss may use (final, or trainer.final_labels off): 0 for every row is said
        clock = freshness.VersionClock()

        def global_batches(version: int = version) -> Iterator[GlobalBatch]:
            nonlocal rows, cursor, start
            noted = False
            # Evaluation read the version from this same position: its reads are the ones training would make.
            reads = kept or (_Read(table, None, after) for table, after in _reads(lake, tc, start, version))
            for read in reads:
                table, after = read.table, read.after
                if table is not None:
                    unread = sorted(set(dense_names(table)) - set(normalizer.names))
                    if unread and not noted and rank == 0:  # a build added features: the model keeps its inputs
                        log.info("examples@%d has dense columns the model does not read, trained as before: %s",
                                 version, unread)
                    noted = noted or bool(unread)
                    fresh = first_publications(table)  # each impression counted once, as evaluation does
                    if ids.mode == "managed":
                        fresh = with_history_ids(fresh, pointers(fresh))
                    ids.observe(fresh)
                    data = read.data if read.data is not None else encode_for(table, tc, normalizer, pointers(table),
                                                                               ids=ids)
                    # What on_step needs of its rows travels with each global batch: the loop prefetches, so the
                    # next read batch may be drawn before this one's last step is taken.
                    corrected = is_correction(table)
                    times = (table["event_time_ms"].to_numpy(), corrected)
                    final = data.final if data.final is not None else final_labels(table, tc.click_window_ms)
                    counted["corrections"] += int(corrected.sum())
                    counted["examples_final"] += int((final.all(axis=1) & ~_published_open(table) & ~corrected).sum())
                    usable[0] += int(final.sum()) if tc.final_labels else final.size
                    position = cursor if version == cursor.version else start
                    seed = [tc.seed, version, position.file_index, position.row_offset]
                    order = np.random.default_rng(seed).permutation(len(data))
                    for i in range(0, len(data), tc.batch_size):
                        yield GlobalBatch(data, order[i: i + tc.batch_size], after, times)
                    rows += len(data)
                if version == cursor.version:
                    cursor = after
                else:
                    start = after

        def on_step(batch: GlobalBatch, step: int) -> None:
            nonlocal trained_until_ms
            event_ms, corrected = batch.context
            clock.add_step(event_ms[batch.rows], corrected[batch.rows], step, freshness.wall_ms())
            trained_until_ms = max(trained_until_ms, int(event_ms[batch.rows].max()))

        train_loop(engine, counters, global_batches(), on_step=on_step)
        if clock.event_ms:
            measured += 1  # on every rank, so the checkpoint's count is the same whoever writes meta.json
            if rank == 0:
                published = freshness.commit_times(lake) if published is None or version not in published else published
                result.freshness += _measure(lake, run_id, measured, version, clock, published.get(version))
        if rows and not usable[0] and rank == 0:
            log.warning("examples@%d: every label of its %d rows is still open (label_window_closed false, the click "
                        "window not passed: e.g. a `build --final` of less than a window of traffic), and "
                        "trainer.final_labels=true masks open labels: nothing was learned from it; --set "
                        "trainer.final_labels=false trains on the labels as logged", version, rows)
        losses = counters.losses[losses_before:]
        quality = "released" if version in skipped else "passed"
        if version in skipped:
            skipped.remove(version)
        record = {"version": version, "rows_trained": rows, "examples": rows - counted["corrections"], **counted,
                  "quality": quality, "evaluated": evaluated,
                  "mean_loss": float(np.mean(losses)) if losses else None, "step": counters.step,
                  **(sources.of(version) if sources else {})}
        lineage.append(record)
        result.versions.append(record)
        consumed += 1
        if rank == 0:  # the lineage grows by one per version on every run, so its length numbers these appends
            _append_metrics(lake, run_id, len(lineage), _id_metric_rows(run_id, counters.step, version, ids,
                                                                        int(time.time() * 1000)), stream="train-ids")
        result.checkpoint_path = checkpoint()
        log.info("examples@%d: %d rows trained (step %d)", version, rows, counters.step)

    if engine is not None and consumed == 0 and cursor != result.cursor:
        result.checkpoint_path = checkpoint()  # only skips moved the cursor (rank 0 alone has the path: count instead)
    result.step, result.rows_trained_total, result.cursor = counters.step, counters.examples_seen, cursor
    if rank != 0:
        return None
    # An idle call (nothing new) redraws only a page older than its checkpoint, from what the resume already read.
    if lineage and write_report and (not idle or not _report_current(lake, run_id, saved_ms)):
        began = time.process_time()
        result.report_path = write_run_report(lake, run_id, lineage=lineage, step=counters.step,
                                              rows_trained_total=counters.examples_seen,
                                              checkpoint=result.checkpoint_path or resume)
        result.report_cpu_s = time.process_time() - began
    return result


class _Sources:
    """Where each examples version's rows came from: the ``events`` versions its build read (from the build's
    commit metadata, ``events_version``) and the Kafka offset ranges those ingest batches read (their
    ``offset_ranges``). Both tables' histories are read once per run."""

    def __init__(self, lake: Lake) -> None:
        self._lake = lake
        self._examples: dict[int, dict[str, Any]] | None = None
        self._events: dict[int, dict[str, Any]] = {}

    def _history(self, table: str) -> dict[int, dict[str, Any]]:
        dt = open_table(self._lake, table)
        out = {}
        for entry in [] if dt is None else dt.history():
            if entry.get("gemline") and "version" in entry:
                out[int(entry["version"])] = json.loads(entry["gemline"])
        return out

    def of(self, version: int) -> dict[str, Any]:
        """``{"events_versions": [...], "kafka_offsets": [{"events_version", "topic", "partition", "start",
        "end", "generation", "topic_id"}]}`` of examples@version (empty lists where the lake does not record them;
        ``generation`` and ``topic_id`` only where the batch recorded them)."""
        if self._examples is None:
            self._examples, self._events = self._history(EXAMPLES), self._history(Table.EVENTS)
        built = self._examples.get(version, {}).get("events_version")
        if built is None:
            return {"events_versions": [], "kafka_offsets": []}
        before = [int(m["events_version"]) for v, m in self._examples.items()
                  if v < version and m.get("events_version") is not None]
        first = max(before) + 1 if before else 0
        versions = list(range(first, int(built) + 1))
        offsets = [{"events_version": ev, **r, **_read_identity(self._events[ev])} for ev in versions
                   if ev in self._events for r in self._events[ev].get("offset_ranges", [])]
        return {"events_versions": versions, "kafka_offsets": offsets}


def _read_identity(meta: dict[str, Any]) -> dict[str, Any]:
    """Which topic an ingest batch read (its events commit ``meta``): ``{"generation", "topic_id"}``, each only where
    the batch recorded it (``ingest.schema``'s topic generations: after ``--reset-topic`` the same
    (topic, partition, offset) names another record)."""
    out: dict[str, Any] = {}
    if "generation" in meta:
        out["generation"] = meta["generation"]
    if (meta.get("topic_identity") or {}).get("topic_id") is not None:
        out["topic_id"] = meta["topic_identity"]["topic_id"]
    return out


FOLLOW_REPORT_EVERY_S = 60.0
"""``train --follow`` rewrites the run report after a run that trained only when the last rewrite is at least this
old (seconds), and its drawing's CPU time is at most :data:`gemline.polling.REPORT_CPU_SHARE` of the time since
(:class:`gemline.polling.ReportThrottle`): reading every metric and freshness row and drawing the page after every
version was about a tenth of training a version of 15-20k rows on the benchmark's lake (2026-12-02); a report a
minute behind is as useful."""


def follow(lake: Lake, tc: TrainerConfig, *, poll_interval_s: float = 30.0, from_scratch: bool = False,
           on_result: Any = None, max_polls: int | None = None, nproc: int = 1,
           report_every_s: float = FOLLOW_REPORT_EVERY_S, report_cpu_share: float = REPORT_CPU_SHARE,
           watch_s: float | None = 1.0, sleep: Callable[[float], bool] | None = None,
           clock: Callable[[], float] = time.monotonic) -> int:
    """Run :func:`run_once` again as soon as the quality gate judged an ``examples`` version (validated or
    released: a new ``quality`` commit about ``examples``, :class:`gemline.gate.GateWatch`, looked for every
    ``watch_s`` seconds), and at least every ``poll_interval_s`` seconds, until Ctrl-C or SIGTERM (``gemline train
    --follow``, :func:`gemline.polling.poll`); each call resumes from the checkpoint the previous one wrote. A new
    examples version not validated yet does not wake it: the gate would hold it back. Returns the calls made.

    An interrupt while waiting ends cleanly; one during a call propagates (the CLI prints one line, exit
    130) and the next run resumes from the newest checkpoint, so nothing is trained twice. Either way the run
    report and TensorBoard file are rewritten at the stop when older than the newest checkpoint (:func:`refresh_report`). Before the first
    ``examples`` version exists (``gemline run`` starts the trainer with the build), it waits, saying so once.

    Args:
        on_result: called with each :class:`ContinuousResult` (the CLI prints a JSON line).
        max_polls: stop after this many calls (tests); None: until interrupted.
        nproc: processes of each call (:func:`run_once`); each call with ``nproc > 1`` is one torchrun job.
        report_every_s: the run report is rewritten by a call that trained only when the last rewrite is at least
            this many seconds old (:data:`FOLLOW_REPORT_EVERY_S`; 0: after every such call), the first call always.
        report_cpu_share: and only when the last drawing's CPU time is at most this share of the time since
            (:class:`gemline.polling.ReportThrottle`; 1.0: ``report_every_s`` alone, for drawings shorter than it).
        watch_s: seconds between two looks at the gate (> 0); None: a call every ``poll_interval_s``.
        sleep, clock: the wait's sleep and monotonic clock (tests pass fakes; :func:`gemline.polling.wait_for_input`).

    Raises:
        ValueError: ``poll_interval_s < 0`` or ``watch_s <= 0``; and what :func:`run_once` raises.
    """
    reports = ReportThrottle(report_every_s, report_cpu_share, clock=time.monotonic)
    pointers = PointerReader(lake) if nproc == 1 else None  # history read by increments across the calls
    warm = WarmEngine() if nproc == 1 else None  # the model as the newest checkpoint holds it, across the calls

    def once(first: bool) -> ContinuousResult:
        result = run_once(lake, tc, from_scratch=from_scratch and first, nproc=nproc, write_report=reports.due(),
                          pointers=pointers, warm=warm)
        if result.report_path is not None:
            reports.drawn(result.report_cpu_s)
        return result

    try:
        return poll(once, name="train", interval_s=poll_interval_s, on_result=on_result, max_polls=max_polls,
                    watch=GateWatch(lake, EXAMPLES), watch_s=watch_s, sleep=sleep, clock=clock)
    finally:  # stopped (Ctrl-C, SIGTERM) or done: the report shows the last checkpoint, not the last drawing
        try:
            refresh_report(lake)
        except Exception as exc:  # noqa: BLE001 - a failed drawing must not hide why the loop ended
            log.warning("the run report was not rewritten at the stop: %s", exc)


def _published_open(table: pa.Table) -> np.ndarray:
    """(N,) bool: rows published before one of their label windows closed (``click_open`` / ``conversion_open`` of
    an early-publication build, :mod:`sequences.schema`), whose labels the trainer weights rather than takes as
    final; all False for a table without those columns."""
    open_ = np.zeros(table.num_rows, dtype=bool)
    for name in ("click_open", "conversion_open"):
        if name in table.schema.names:
            open_ |= table.column(name).to_numpy(zero_copy_only=False).astype(bool)
    return open_


def lineage(lake: Lake, *, checkpoint: str | None = None) -> dict[str, Any]:
    """The lineage of ``lake``'s newest continuous checkpoint (or ``checkpoint``): ``{"step", "run_id",
    "rows_trained_total", "examples_versions": [{"version", "rows_trained", "examples", "examples_final",
    "corrections", "quality", "evaluated", "mean_loss", "step", "events_versions", "kafka_offsets"}]}``.

    ``rows_trained`` = ``examples`` (impressions, each once) + ``corrections`` (rows that correct an earlier
    example's label, :mod:`trainer.delayed`); ``examples_final``: the examples whose labels were all final when
    trained (:func:`trainer.labels.final_labels`, and not published early with an open window). The others had
    their open labels masked, weighted (early publication), or, with ``trainer.final_labels`` off, trained as they
    stood. A checkpoint written before these counts has only ``rows_trained``.

    Raises:
        gemline.errors.MissingInputError: no continuous checkpoint.
    """
    root = current_root(lake.root, lake.storage_options)
    path = checkpoint or latest_checkpoint(root, storage_options=lake.storage_options)
    if path is None:
        raise MissingInputError(f"no continuous checkpoint under {root}: run `gemline train --once`")
    state = read_state(path)
    cont = state.extra["continuous"]
    return json.loads(json.dumps({"step": state.step, "run_id": cont["run_id"],
                                  "rows_trained_total": state.examples_seen, "examples_versions": cont["lineage"]}))
