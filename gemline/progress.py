"""How far each stage of ``gemline run`` has got, read from what the stages committed (the live status table).

Every number comes from the lake (and Kafka for ingest), never from a stage's process, so it is the same for a
stage run alone with ``--follow`` on another machine, and a stage restarted mid-pass shows what it committed:

==========  ===============================  ==================================  ==========================================
stage       last                             rows                                lag
==========  ===============================  ==================================  ==========================================
ingest      newest ``events`` version        events committed (dead-letter rows) messages in Kafka not committed yet
validate    newest validated events/examples versions validated                  versions not validated yet
build       ``events`` version built         examples published                  events versions not built yet
train       newest examples version trained  rows trained by the current run     examples versions not trained yet
distill     newest examples version          rows the students distilled         versions the teacher trained, not
            distilled                                                            distilled yet
==========  ===============================  ==================================  ==========================================

"Trained" is read from the ``freshness`` table the continuous trainer writes once per version it has trained,
before its checkpoint (``trainer.freshness``): no checkpoint is opened, so an object-store lake costs a Delta read,
not a download. Each part is read on its own: one that fails (a table being created, Kafka unreachable) shows as
unknown, never stops the view.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pyarrow.compute as pc

from gemline.gate import gate_decisions
from gemline.increments import latest_version
from gemline.lake import Lake, commit_metadata, commit_version_of, lake_fs, open_table, read_table
from gemline.metrics import consumer_lag, lake_offsets, table_rows
from gemline.tables import Table

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class StageProgress:
    """One stage's progress (module docstring's table).

    Attributes:
        last: the newest version it committed or consumed (``"events@12"``); '' when none yet.
        rows: rows done so far (for validate: versions validated); None when unknown.
        lag: how far it is behind its input, in ``lag_unit``; None when unknown (no input yet, a read failed).
        lag_unit: ``"messages"`` (ingest) or ``"versions"``.
        dead_letter: ingest only: the ``dead_letter`` table's rows (records refused); None when unknown or none.
    """

    last: str = ""
    rows: int | None = None
    lag: int | None = None
    lag_unit: str = "versions"
    dead_letter: int | None = None

    def rows_cell(self) -> str:
        """The status table's rows cell: ``120,000``, with ingest's refused records ``120,000 (dead-letter 5)``."""
        if self.rows is None:
            return ""
        return f"{self.rows:,}" + (f" (dead-letter {self.dead_letter:,})" if self.dead_letter else "")


Watermarks = Callable[[], Mapping[int, tuple[int, int]]]
"""Per Kafka partition, (low, high) watermark offsets now (:class:`gemline.metrics.LagSource`'s ``watermarks``)."""


def _guarded(stage: str, read: Callable[[], StageProgress]) -> StageProgress:
    try:
        return read()
    except Exception as exc:  # noqa: BLE001 - a status line must not stop the run (module docstring)
        log.debug("progress of %s unknown: %s", stage, exc)
        return StageProgress()


def ingest_progress(lake: Lake, app_id: str, watermarks: Watermarks | None) -> StageProgress:
    """``last``: the newest ``events`` version; ``rows``: the events table's rows (file statistics, no data
    read); ``lag``: Kafka messages not committed to the lake yet (None without ``watermarks`` or when they
    raise: Kafka unreachable); ``dead_letter``: the ``dead_letter`` table's rows (file statistics)."""
    events = open_table(lake, Table.EVENTS)
    if events is None:
        return StageProgress(lag_unit="messages")
    lag = None
    if watermarks is not None:
        try:
            lag = sum(consumer_lag(watermarks(), lake_offsets(lake, app_id)).values())
        except Exception as exc:  # noqa: BLE001 - Kafka unreachable: the lake's part still shows
            log.debug("ingest lag unknown: %s", exc)
    dead = open_table(lake, Table.DEAD_LETTER)
    return StageProgress(f"events@{events.version()}", table_rows(events), lag, "messages",
                         None if dead is None else table_rows(dead))


@dataclass(frozen=True)
class DeadLetterShare:
    """The records the newest ingest batch refused.

    Attributes:
        batch: the batch (the ingest writer's transaction version, shared by its events, dead_letter and
            late_events commits).
        records: Kafka records the batch read (its offset ranges).
        dead_letter: of those, the rows it wrote to ``dead_letter``.
        reasons: dead-letter rows per reason code (``duplicate_conflict``, ``not_json``, ...), most first.
    """

    batch: int
    records: int
    dead_letter: int
    reasons: dict[str, int]

    @property
    def share(self) -> float:
        """``dead_letter / records`` (1.0 for a batch of records that all went there), 0.0 for an empty batch."""
        return self.dead_letter / max(self.records, self.dead_letter) if self.dead_letter else 0.0


def last_ingest_dead_letter(lake: Lake, app_id: str) -> DeadLetterShare | None:
    """What the newest batch of the ingest writer ``app_id`` dead-lettered (the rows its ``dead_letter`` commit
    added, ``reason`` column only); None before any batch or when the newest batch dead-lettered nothing (it
    then commits no ``dead_letter`` part)."""
    from gemline.increments import rows_added

    batches = [dt.transaction_version(app_id) for table in (Table.EVENTS, Table.DEAD_LETTER, Table.LATE_EVENTS)
               if (dt := open_table(lake, table)) is not None]
    newest = max((b for b in batches if b is not None), default=None)
    if newest is None:
        return None
    meta = commit_metadata(lake, Table.DEAD_LETTER, app_id)
    if meta is None or meta.get("txn_version") != newest:
        return None
    version = commit_version_of(lake, Table.DEAD_LETTER, app_id, newest)
    added = None if version is None else rows_added(lake.root, Table.DEAD_LETTER, version, columns=["reason"],
                                                      storage_options=lake.storage_options)
    if added is None or added.num_rows == 0:
        return None
    counts = sorted(((str(c["values"]), int(c["counts"])) for c in pc.value_counts(added["reason"]).to_pylist()),
                    key=lambda rc: (-rc[1], rc[0]))
    records = sum(int(r["end"]) - int(r["start"]) for r in meta.get("offset_ranges", []))
    return DeadLetterShare(newest, records, added.num_rows, dict(counts))


DEAD_LETTER_WARN_SHARE = 0.5
"""``gemline run`` warns (once) when more than this share of the newest ingest batch's records went to
``dead_letter`` (:func:`dead_letter_warning`)."""


def dead_letter_warning(share: DeadLetterShare | None) -> str | None:
    """One line about a batch that dead-lettered more than :data:`DEAD_LETTER_WARN_SHARE` of its records, naming
    the top reason and, for ``duplicate_conflict``, its likely cause; None below that."""
    if share is None or share.share <= DEAD_LETTER_WARN_SHARE:
        return None
    reason, count = next(iter(share.reasons.items()))
    line = (f"warning: ingest batch {share.batch} sent {share.dead_letter:,} of its {share.records:,} records "
            f"({share.share:.0%}) to dead_letter, most as {reason} ({count:,})")
    if reason == "duplicate_conflict":
        return line + (": event ids the lake already holds with other payloads, most likely a generator with the "
                       "same generate.seed (and generate.wall_clock) as an earlier run into this lake; give it "
                       "another generate.seed and a generate.start_ms after the lake's newest event")
    return line + ": see the dead_letter table's reason and detail columns"


def validate_progress(lake: Lake) -> StageProgress:
    """``last``: the newest validated version of ``events`` and of ``examples``; ``rows``: versions validated;
    ``lag``: versions not validated yet. Events validation judges every version since the last one validated, so
    only the newest events version counts as waiting (``gemline.follow``)."""
    last, validated, waiting, seen = [], 0, 0, False
    for table in (Table.EVENTS, Table.EXAMPLES):
        newest = latest_version(lake.root, table, storage_options=lake.storage_options)
        if newest is None:
            continue
        seen = True
        decisions = gate_decisions(lake, table, range(newest + 1))
        done = [v for v, d in decisions.items() if d.validated]
        validated += len(done)
        if done:
            last.append(f"{table}@{max(done)}")
        if table == Table.EVENTS:
            waiting += int(not decisions[newest].validated)
        else:
            waiting += sum(not d.validated for d in decisions.values())
    if not seen:
        return StageProgress()
    return StageProgress(" ".join(last), validated, waiting)


def build_progress(lake: Lake) -> StageProgress:
    """``last``: the ``events`` version the newest build read; ``rows``: examples published (file statistics);
    ``lag``: ``events`` versions committed since."""
    from sequences.pipeline import APP_ID  # the build's writer id: its commits name the events version read

    examples = open_table(lake, Table.EXAMPLES)
    built = (commit_metadata(lake, Table.EXAMPLES, APP_ID) or {}).get("events_version")
    if examples is None or built is None:
        return StageProgress()
    events = latest_version(lake.root, Table.EVENTS, storage_options=lake.storage_options)
    lag = None if events is None else max(0, events - int(built))
    return StageProgress(f"events@{int(built)}", table_rows(examples), lag)


def _versions_with_rows(lake: Lake, after: int, newest: int) -> int:
    """``examples`` versions in (after, newest] that added rows (one log entry read each; a version without row
    statistics counts): a version that added none (nothing published yet) leaves the trainer nothing to do."""
    from gemline.increments import read_increment

    added = (read_increment(lake.root, Table.EXAMPLES, v, storage_options=lake.storage_options).num_records
             for v in range(after + 1, newest + 1))
    return sum(n is None or n > 0 for n in added)


def _teacher_run(lake: Lake) -> tuple[int, int] | None:
    """(newest examples version the current trainer run trained rows of, rows it trained) from the ``freshness``
    table (the run of its newest row); None before the first trained version."""
    from trainer.freshness import HOPS

    rows = read_table(lake, Table.FRESHNESS, columns=["run_id", "examples_version", "hop", "rows", "wall_time_ms"])
    if rows is None or rows.num_rows == 0:
        return None
    newest = rows.slice(int(pc.index(rows["wall_time_ms"], pc.max(rows["wall_time_ms"])).as_py()), 1)
    run = rows.filter(pc.equal(rows["run_id"], newest["run_id"][0]))
    trained_hop = HOPS[1]  # published->trained: every trained row, corrections included
    done = int(pc.sum(run.filter(pc.equal(run["hop"], trained_hop))["rows"]).as_py() or 0)
    return int(pc.max(run["examples_version"]).as_py()), done


def train_progress(lake: Lake) -> StageProgress:
    """``last``: the newest examples version the current trainer run trained rows of (the run of the newest
    ``freshness`` row); ``rows``: the rows that run trained; ``lag``: ``examples`` versions committed since that
    added rows (the trainer passes over empty ones without a ``freshness`` row)."""
    return _train_from(lake, _teacher_run(lake))


def _train_from(lake: Lake, teacher: tuple[int, int] | None) -> StageProgress:
    """:func:`train_progress` from the trainer's :func:`_teacher_run`."""
    examples = latest_version(lake.root, Table.EXAMPLES, storage_options=lake.storage_options)
    if teacher is None:
        # Before the first trained version every examples version with rows waits for the trainer.
        return StageProgress(lag=None if examples is None else _versions_with_rows(lake, -1, examples))
    trained, done = teacher
    lag = None if examples is None else _versions_with_rows(lake, trained, examples)
    return StageProgress(f"examples@{trained}", done, lag)


DISTILL_CHECKPOINTS = "_distill/_checkpoints"
"""Where ``gemline distill`` keeps its checkpoints under the lake root (``trainer.distill.distill_root`` +
``trainer.checkpoint.CHECKPOINTS_DIR``; a test holds the two equal), read here without importing torch."""


def distill_meta(lake: Lake) -> dict | None:
    """The ``meta.json`` of the students' newest complete checkpoint (the highest ``step-N`` holding one); None
    when there is none. One directory listing and one small file read, also on an object-store lake."""
    import json

    import pyarrow.fs as pafs

    fs, root = lake_fs(lake)
    base = f"{root}/{DISTILL_CHECKPOINTS}"
    steps = sorted((int(info.base_name[5:]), info.path) for info in fs.get_file_info(
        pafs.FileSelector(base, allow_not_found=True))
        if info.type == pafs.FileType.Directory and info.base_name.startswith("step-") and info.base_name[5:].isdigit())
    for _, path in reversed(steps):  # the newest step may still be written (meta.json comes last)
        if fs.get_file_info(f"{path}/meta.json").type == pafs.FileType.File:
            with fs.open_input_stream(f"{path}/meta.json") as f:
                return json.loads(f.read())
    return None


def distill_progress(lake: Lake) -> StageProgress:
    """``last``: the newest examples version the students distilled (their checkpoint's cursor minus one);
    ``rows``: the rows they distilled; ``lag``: the examples versions with rows that the teacher's current run
    trained (:func:`train_progress`'s ``last``) and the students have not distilled yet: distill follows the
    teacher, so a version the teacher has not trained is not distill's lag. Unknown (``StageProgress()``)
    before the teacher's first trained version."""
    return _distill_from(lake, _teacher_run(lake))


def _distill_from(lake: Lake, teacher: tuple[int, int] | None) -> StageProgress:
    """:func:`distill_progress` from the trainer's :func:`_teacher_run`."""
    if teacher is None:
        return StageProgress()
    meta = distill_meta(lake)
    extra = {} if meta is None else meta.get("extra", {})
    cursor = int(extra.get("cursor", 0))
    done = sum(int(v.get("rows") or 0) for v in extra.get("versions", []))
    lag = _versions_with_rows(lake, cursor - 1, teacher[0]) if teacher[0] >= cursor else 0
    return StageProgress(f"examples@{cursor - 1}" if cursor else "", done if meta else None, lag)


def pipeline_progress(lake: Lake, *, ingest_app_id: str | None = None,
                      watermarks: Watermarks | None = None) -> dict[str, StageProgress]:
    """Each stage's progress (module docstring), keyed by the stage names of ``gemline run``; ingest's only with
    its writer id ``ingest_app_id`` (``ingest.pipeline.app_id_for(topic)``)."""
    teacher = functools.cache(lambda: _teacher_run(lake))  # the freshness table, read once for train and distill
    out = {"validate": _guarded("validate", lambda: validate_progress(lake)),
           "build": _guarded("build", lambda: build_progress(lake)),
           "train": _guarded("train", lambda: _train_from(lake, teacher())),
           "distill": _guarded("distill", lambda: _distill_from(lake, teacher()))}
    if ingest_app_id is not None:
        out["ingest"] = _guarded("ingest", lambda: ingest_progress(lake, ingest_app_id, watermarks))
    return out


__all__ = ["DEAD_LETTER_WARN_SHARE", "DISTILL_CHECKPOINTS", "DeadLetterShare", "StageProgress", "Watermarks",
           "build_progress", "dead_letter_warning", "distill_progress", "ingest_progress", "last_ingest_dead_letter", "pipeline_progress", "train_progress",
           "validate_progress"]
