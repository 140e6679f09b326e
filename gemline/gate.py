"""The training gate: the ``quality`` Delta table and the decision whether a table version may be trained on.

``quality`` has one row per (table, table_version, expectation) from every validation run, plus
one row per release a person made (expectation ``__release__``). A version is quarantined when
any ``critical`` expectation failed in its newest validation run and no release row follows it.
A version that was never validated is not allowed either: the gate fails closed.

Readers: the trainer (``examples``) and the build (``events``, :func:`require_allowed`) read only
versions the gate allows. The validation stage writes the rows; the readers are other stages, so the
gate lives in the core (``gemline``), which every stage may import.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from gemline import tables
from gemline.errors import BadConfigError, GemlineError, MissingInputError
from gemline.increments import LogTip, ledger, read_increment
from gemline.lake import Lake, StorageOptions, as_lake, open_table
from gemline.tables import Table

if TYPE_CHECKING:
    from deltalake import DeltaTable

RELEASE = "__release__"

QUALITY_SCHEMA = pa.schema(
    [
        pa.field("table", pa.string(), nullable=False),  # e.g. "examples"
        pa.field("table_version", pa.int64(), nullable=False),  # Delta version validated
        pa.field("run_id", pa.string(), nullable=False),  # one validation run (or one release)
        pa.field("run_ts_ms", pa.int64(), nullable=False),  # wall clock of the run, ms since epoch UTC
        pa.field("expectation", pa.string(), nullable=False),  # expectation name, or __release__
        pa.field("severity", pa.string(), nullable=False),  # critical | warning | release
        pa.field("success", pa.bool_(), nullable=False),
        pa.field("observed", pa.string(), nullable=False),  # observed value / error message / release reason
        pa.field("report_path", pa.string(), nullable=False),  # JSON report of the run ("" for a release)
    ]
)


@dataclass(frozen=True)
class GateDecision:
    """Whether ``table`` at ``table_version`` may be trained on, and why."""

    table: str
    table_version: int
    allowed: bool
    reason: str
    validated: bool = True
    """False when the version has no validation run at all (the gate then fails closed)."""


def append_quality_rows(lake: Lake | str | Path, rows: list[dict], *, app_id: str | None = None,
                        storage_options: StorageOptions | None = None, snapshot: DeltaTable | None = None) -> bool:
    """Append rows (dicts with the QUALITY_SCHEMA fields) to the ``quality`` table in one commit, once.

    The commit is the app transaction ``(app_id, 0)`` (:func:`gemline.tables.commit`): a retry of the
    same write (same ``app_id``) writes nothing.

    Args:
        lake: a :class:`gemline.lake.Lake`, or a root with its ``storage_options`` (object-store
            options for a remote lake, see :mod:`gemline.lake`).
        app_id: the writer, one per run (a validation run passes ``validate:<run_id>``); None:
            ``quality:<digest of the rows>``, so only the very same rows count as a retry.
        snapshot: a long-running writer's open handle of ``quality`` (:func:`gemline.lake.commit_once`).

    Returns:
        True if this call committed; False for no rows, or when ``app_id`` already committed.

    Raises:
        gemline.lake.CommitConflictError: another writer committed the same ``app_id`` meanwhile.
    """
    if not rows:
        return False
    lake = as_lake(lake, storage_options)
    if app_id is None:
        digest = hashlib.blake2b(json.dumps(rows, sort_keys=True, default=str).encode(), digest_size=12).hexdigest()
        app_id = f"quality:{digest}"
    return tables.commit(lake, Table.QUALITY, pa.Table.from_pylist(rows, schema=QUALITY_SCHEMA), app_id=app_id,
                         version=0, snapshot=snapshot)


def gate_decision(lake: Lake | str | Path, table: str, table_version: int, *,
                  storage_options: StorageOptions | None = None) -> GateDecision:
    """Decide from the ``quality`` table whether ``table@table_version`` may be trained on.

    Never raises for a missing quality table: it answers not allowed ("never validated").
    """
    return gate_decisions(lake, table, [table_version], storage_options=storage_options)[table_version]


def gate_decisions(lake: Lake | str | Path, table: str, table_versions: Iterable[int], *,
                   storage_options: StorageOptions | None = None) -> dict[int, GateDecision]:
    """:func:`gate_decision` of each of ``table_versions`` from one read of the ``quality`` table.

    Returns ``{version: GateDecision}``; never raises for a missing quality table.
    """
    versions = list(table_versions)
    quality = quality_rows(lake, storage_options=storage_options)
    by_version: dict[int, list[dict]] = {v: [] for v in versions}
    if quality is not None and versions:
        mask = pc.and_(pc.equal(quality["table"], table),
                       pc.is_in(quality["table_version"], value_set=pa.array(versions, pa.int64())))
        for row in quality.filter(mask).to_pylist():
            by_version[row["table_version"]].append(row)
    return {v: _decide(table, v, by_version[v]) for v in versions}


def last_validated_before(lake: Lake | str | Path, table: str, table_version: int, *,
                          storage_options: StorageOptions | None = None) -> int | None:
    """The newest version of ``table`` below ``table_version`` with a validation run (whatever its verdict;
    a release alone is not one), or None when there is none (or no ``quality`` table)."""
    quality = quality_rows(lake, storage_options=storage_options)
    if quality is None:
        return None
    mask = pc.and_(pc.and_(pc.equal(quality["table"], table), pc.less(quality["table_version"], table_version)),
                   pc.not_equal(quality["expectation"], RELEASE))
    return pc.max(quality.filter(mask)["table_version"]).as_py()


def quality_rows(lake: Lake | str | Path, *, storage_options: StorageOptions | None = None) -> pa.Table | None:
    """Every row of the lake's ``quality`` table (QUALITY_SCHEMA), or None when it does not exist.

    Served by the process's :class:`gemline.increments.TableLedger` of the table: every follower asks the gate
    about every version at each pass (:func:`gate_decisions` over ``range(newest + 1)``) and ``quality`` gains a
    commit per validation run, so a whole read each time cost O(commits) per pass (0.23 CPU-s per validation pass
    over 41 commits, 0.59 over 163, on a 3-minute freshness lake); the ledger's pass costs 12 ms over 163.
    """
    return ledger(lake, Table.QUALITY, QUALITY_SCHEMA, storage_options=storage_options).rows()


def _decide(table: str, table_version: int, rows: list[dict]) -> GateDecision:
    """The decision for one version from its ``quality`` rows (checks of every run, and releases)."""
    checks = [r for r in rows if r["expectation"] != RELEASE]
    if not checks:
        return GateDecision(table, table_version, False, f"{table}@{table_version} was never validated",
                            validated=False)
    last_ts = max(r["run_ts_ms"] for r in checks)
    last_run = max((r for r in checks if r["run_ts_ms"] == last_ts), key=lambda r: r["run_id"])["run_id"]
    failed = sorted(
        r["expectation"] for r in checks if r["run_id"] == last_run and r["severity"] == "critical" and not r["success"]
    )
    if not failed:
        return GateDecision(table, table_version, True, f"{table}@{table_version} passed all critical expectations")
    releases = [r for r in rows if r["expectation"] == RELEASE and r["run_ts_ms"] >= last_ts]
    if releases:
        latest = max(releases, key=lambda r: r["run_ts_ms"])
        return GateDecision(table, table_version, True, f"{table}@{table_version} released by hand: {latest['observed']}")
    return GateDecision(
        table, table_version, False, f"{table}@{table_version} is quarantined: critical expectations failed: {', '.join(failed)}"
    )


class GateWatch:
    """Counts the ``quality`` commits that concern one table (a validation run of one of its versions, or a
    release), cheaply enough to ask every second: what a follower of the gate's verdicts waits for (the build
    for ``events``, the trainer for ``examples``).

    Each call looks for new ``quality`` commits (:class:`~gemline.increments.LogTip`: one file-existence check
    when there is none) and reads only the log entries of new ones: a commit concerns ``table`` when a file it
    added holds rows whose ``table`` column may equal it (the per-file minimum and maximum in the log's stats;
    a file without stats counts). Validation writes one commit per run and table version
    (:func:`append_quality_rows`), so a run about ``events`` does not wake a follower of ``examples``.
    Compactions (``dataChange = false``) add no rows and count for nothing.
    """

    def __init__(self, lake: Lake | str | Path, table: str, *, storage_options: StorageOptions | None = None) -> None:
        self._lake = as_lake(lake, storage_options)
        self._table = table
        self._tip = LogTip(self._lake.root, Table.QUALITY, storage_options=self._lake.storage_options)
        self._looked = False
        self.commits = 0
        """The commits about ``table`` seen since the first call (which counts none: the verdicts so far)."""

    def __call__(self) -> int:
        """Look for new ``quality`` commits; return :attr:`commits`, which grows by one per new one about the
        table. Raises CursorError when a new commit's log entry is gone before it was read."""
        before, looked = self._tip.version, self._looked
        now, self._looked = self._tip.advance(), True
        if not looked or now is None or now == before:
            return self.commits
        start = 0 if before is None else before + 1
        for version in range(start, now + 1):
            increment = read_increment(self._lake.root, Table.QUALITY, version,
                                       storage_options=self._lake.storage_options)
            self.commits += any(self._may_hold(f.min_values.get("table"), f.max_values.get("table"))
                                for f in increment.files)
        return self.commits

    def _may_hold(self, low: object, high: object) -> bool:
        if not isinstance(low, str) or not isinstance(high, str):
            return True  # no stats: it may
        # delta-rs truncates strings in stats only past 32 characters; table names are shorter.
        return low <= self._table <= high


class GateClosedError(GemlineError, RuntimeError):
    """A stage refused to read a table version that the quality gate does not allow (exit 3).

    ``decision`` is the refused version's :class:`GateDecision`; the message is one line that names
    the version and the command that opens the gate (validate, or release by hand).
    """

    exit_code = 3

    def __init__(self, decision: GateDecision, reader: str) -> None:
        self.decision, self.reader = decision, reader
        table, version = decision.table, decision.table_version
        if decision.validated:
            action = (f"inspect it (`gemline report --table {table} --version {version}`), then "
                      f"`gemline quality release {version} --table {table} --reason \"...\"` to let it through")
        else:
            action = f"run `gemline validate --table {table} --version {version}` first"
        super().__init__(f"{reader} refused: {decision.reason}; {action}")

    def __reduce__(self) -> tuple[type[GateClosedError], tuple[GateDecision, str]]:
        """Pickle by the constructor's arguments: a Beam or Dask worker sends its exception to the driver."""
        return type(self), (self.decision, self.reader)


def require_allowed(lake: str | Path, table: str, version: int, *, since: int | None = None, reader: str,
                    storage_options: StorageOptions | None = None) -> GateDecision:
    """Check that a reader may read the rows ``table`` gained after version ``since`` up to ``version``.

    ``table@version`` itself must be allowed (passed its newest validation, or released after it);
    a version that was never validated is refused, as the gate fails closed. The versions in
    between (``since`` exclusive, None: from version 0) are refused only when quarantined: their
    rows are judged by the validation of ``table@version`` (an events validation judges every row added since
    the version validated before it), but a batch-level check
    (dead-letter rate, drift) that closed one of them must not be skipped by reading past it.

    Args:
        reader: who reads, for the message (e.g. "build").

    Returns:
        The decision of ``table@version`` (allowed).

    Raises:
        GateClosedError: ``version`` is quarantined or never validated, or a version in between is
            quarantined (the oldest such version is named).
        MissingInputError: ``version`` does not exist (:func:`require_version`).
    """
    first = 0 if since is None else since + 1
    decisions = gate_decisions(lake, table, range(first, version + 1), storage_options=storage_options)
    for v in range(first, version):
        if decisions[v].validated and not decisions[v].allowed:
            raise GateClosedError(decisions[v], reader)
    if not decisions[version].allowed:
        if not decisions[version].validated:
            require_version(lake, table, version, storage_options=storage_options)
        raise GateClosedError(decisions[version], reader)
    return decisions[version]


def require_version(lake: Lake | str | Path, table: str, version: int, *,
                    storage_options: StorageOptions | None = None) -> None:
    """Check that ``table@version`` exists where ``table`` does, so a version past its newest is not reported
    as "never validated" (a table that does not exist yet has no version validated: the gate's own answer).

    Raises:
        MissingInputError: ``version`` outside the existing table's versions 0..newest.
    """
    newest = open_table(lake, table, storage_options=storage_options)
    if newest is not None and not 0 <= version <= newest.version():
        raise MissingInputError(f"{table} has versions 0..{newest.version()}, not {version}")


def release(lake: str | Path, table: str, table_version: int, reason: str, *, now_ms: int | None = None,
            storage_options: StorageOptions | None = None) -> None:
    """Record that a person released a quarantined version (the reason is kept in ``observed``).

    Raises:
        BadConfigError: ``reason`` is empty, or ``table@table_version`` was never validated (a release
            answers a verdict; there is none to answer).
        MissingInputError: ``table@table_version`` does not exist.
    """
    if not reason.strip():
        raise BadConfigError("a release needs a non-empty --reason")
    if not gate_decision(lake, table, table_version, storage_options=storage_options).validated:
        require_version(lake, table, table_version, storage_options=storage_options)
        raise BadConfigError(f"{table}@{table_version} was never validated; run `gemline validate --table {table} "
                             f"--version {table_version}` first")
    ts = int(time.time() * 1000) if now_ms is None else now_ms
    append_quality_rows(
        lake,
        [
            {
                "table": table,
                "table_version": table_version,
                "run_id": f"release-{ts}",
                "run_ts_ms": ts,
                "expectation": RELEASE,
                "severity": "release",
                "success": True,
                "observed": reason,
                "report_path": "",
            }
        ],
        storage_options=storage_options,
    )
