"""Lake layout and idempotent Delta commits shared by every stage.

    LAKE/<table>             the Delta tables of gemline.tables.TABLES (events, examples, features/user, ...)
    LAKE/_quality/<table>/<version>/report.{json,html}
    LAKE/_checkpoints/step-N/
    LAKE/_runs/<run_id>/summary.json

Stages write tables through :mod:`gemline.tables`, which applies each table's spec (partition
columns, write mode) and calls :func:`commit_once` / :func:`commit_files_once` here; these two
also take any other table path (tests, benchmarks).

The lake root is a local directory or an object-store URI (``s3://bucket/prefix``). Every function
takes ``storage_options`` (delta-rs object-store keys such as ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_ALLOW_HTTP``,
``AWS_CONDITIONAL_PUT``; see delta-rs "AWS S3 Storage Backend"), ignored for local paths. Plain
files (reports, checkpoints, staging) go through :func:`lake_fs`, a ``pyarrow.fs`` filesystem for
the same root.

On S3 a commit is a conditional put: delta-rs (1.x) writes ``_delta_log/<N>.json`` with
``If-None-Match: *`` (``AWS_CONDITIONAL_PUT=etag``, object_store's default, spelled out in the
lake options so the requirement is visible; ``disabled`` makes every commit fail), so of two
writers that both commit version N one gets a conflict instead of overwriting the other's commit.
No rename, no ``AWS_S3_ALLOW_UNSAFE_RENAME`` and no DynamoDB lock are involved. The guarantee is
the store's: an S3-compatible server that ignores ``If-None-Match`` gives none.

Exactly-once writes follow delta-rs's app transactions: each commit carries
``Transaction(app_id, version)`` and the writer first checks ``DeltaTable.transaction_version``
(delta-rs itself accepts a repeated (app_id, version) and would write the rows twice). The check
and the commit use one snapshot of the table, so two writers of the same (app_id, version) racing
each other cannot both commit: the loser's commit meets the winner's transaction in delta-rs's
conflict check and :class:`CommitConflictError` is raised (nothing of it is committed). Writers
of different app ids do not conflict: delta-rs commits the loser at the next version.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal
from urllib.parse import urlsplit

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError, TableNotFoundError

from gemline.errors import GemlineError

StorageOptions = Mapping[str, str]
"""delta-rs / object_store configuration keys to string values (e.g. ``{"AWS_REGION": "us-east-1"}``)."""

REMOTE_SCHEMES = ("s3", "s3a")
"""URI schemes of object-store lakes that :func:`lake_fs` can open (delta-rs reads more)."""


def is_remote(lake: Lake | str | Path) -> bool:
    """True when ``lake`` is a URI with a scheme (``s3://...``), False for a local path."""
    scheme = urlsplit(lake.root if isinstance(lake, Lake) else str(lake)).scheme
    # A one-letter scheme is a Windows drive ("C:/lake"), not a URI.
    return len(scheme) > 1


def table_uri(lake: Lake | str | Path, table: str) -> str:
    """Path (local) or URI (``s3://bucket/prefix/events``) of a table under the lake root."""
    if isinstance(lake, Lake):
        lake = lake.root
    if is_remote(lake):
        return f"{str(lake).rstrip('/')}/{table}"
    return str(Path(lake) / table)


def _options(lake: Lake | str | Path, storage_options: StorageOptions | None) -> dict[str, str] | None:
    """Validated options for delta-rs: None for a local lake or when none are given.

    ``lake`` may be a :class:`Lake` (its options are used; ``storage_options`` must then be None or
    the same), so every function of this module takes a Lake or the old (root, storage_options) pair.
    """
    if isinstance(lake, Lake):
        checked = as_lake(lake, storage_options)
        lake, storage_options = checked.root, checked.storage_options
    if storage_options is None or not is_remote(lake):
        return None
    _check_option_types(storage_options)
    return dict(storage_options)


SECRET_MARKERS = ("SECRET", "TOKEN", "PASSWORD", "KEY")
"""An option whose key contains one of these (any case) is a secret: :func:`redact` hides its value."""

REDACTED = "***"


_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s:]*(?::[^/@\s]*)?@")
"""The ``user:password@`` part of a URL (RFC 3986 userinfo)."""


def redact_url(text: str) -> str:
    """``text`` with the credentials of every URL in it (``scheme://user:password@host``) replaced by ``***``."""
    return _URL_CREDENTIALS.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)


def redact(options: Mapping[Any, Any] | None) -> dict[Any, Any] | None:
    """A copy of ``options`` with the value of every secret key (see :data:`SECRET_MARKERS`) replaced
    by ``"***"``, and the credentials inside any URL value (``http://user:pass@host``, :func:`redact_url`) too, for
    messages, logs and reprs; None stays None."""
    if options is None:
        return None
    return {k: REDACTED if any(m in str(k).upper() for m in SECRET_MARKERS) else redact_url(v) if isinstance(v, str)
            else v for k, v in options.items()}


def _check_option_types(storage_options: Mapping[Any, Any]) -> None:
    """Raise TypeError (values of secret keys hidden) unless every key and value is a string."""
    bad = {k: v for k, v in storage_options.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise TypeError(f"storage_options: expected str keys and str values (e.g. 'true', not True), got {redact(bad)!r}")


SNAPSHOTS_KEPT = 64
"""Tables opened at an explicit version that :func:`open_table` keeps per process (least recently used out)."""

_snapshots: OrderedDict[tuple[str, int], tuple[tuple[int, int, int], DeltaTable]] = OrderedDict()
_snapshots_lock = threading.Lock()


def _log_entry_stat(uri: str, version: int) -> tuple[int, int, int] | None:
    """(inode, size, mtime in ns) of a local table's ``_delta_log`` entry of ``version``; None if it has none."""
    try:
        st = os.stat(Path(uri) / "_delta_log" / f"{version:020d}.json")
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def open_table(
    lake: Lake | str | Path, table: str, version: int | None = None, *, storage_options: StorageOptions | None = None
) -> DeltaTable | None:
    """The Delta table at ``version`` (latest when None), or None if it does not exist yet.

    A local table opened at an explicit version is a snapshot that never changes, so the last
    :data:`SNAPSHOTS_KEPT` of them are kept and handed out again: opening one replays the log from its
    last checkpoint (tens of ms on a table a streaming writer commits to every few seconds), and a
    ``build --follow`` pass opened the same ``events`` versions six times. A kept snapshot is checked against
    its log entry (same inode, size and mtime) and dropped when the table was replaced. Callers only read a
    versioned handle (moving it with ``load_as_version`` or committing through it would change what the
    next caller gets).
    """
    uri, options = table_uri(lake, table), _options(lake, storage_options)
    if version is None or is_remote(uri):
        return _open(uri, version, options)
    stat = _log_entry_stat(uri, version)
    if stat is None:
        return _open(uri, version, options)
    with _snapshots_lock:
        kept = _snapshots.get((uri, version))
        if kept is not None and kept[0] == stat:
            _snapshots.move_to_end((uri, version))
            return kept[1]
    dt = _open(uri, version, options)
    if dt is not None:
        with _snapshots_lock:
            _snapshots[(uri, version)] = (stat, dt)
            while len(_snapshots) > SNAPSHOTS_KEPT:
                _snapshots.popitem(last=False)
    return dt


def latest_table(lake: Lake | str | Path, table: str, storage_options: StorageOptions | None = None,
                 snapshot: DeltaTable | None = None) -> DeltaTable | None:
    """``snapshot`` (an open handle of ``table``) brought up to date (``update_incremental``: the log entries since
    its version only), or, without one, the table opened at its latest version (None if it does not exist)."""
    if snapshot is None:
        return open_table(lake, table, storage_options=storage_options)
    snapshot.update_incremental()
    return snapshot


def _open(uri: str, version: int | None, options: dict[str, str] | None) -> DeltaTable | None:
    try:
        return DeltaTable(uri, version=version, storage_options=options)
    except TableNotFoundError:
        return None


def lake_fs(lake: Lake | str | Path, storage_options: StorageOptions | None = None) -> tuple[pafs.FileSystem, str]:
    """A ``pyarrow.fs`` filesystem and the lake root's path in it, for non-Delta files.

    Local lake: ``(LocalFileSystem(), absolute path)``. ``s3://bucket/prefix``: an
    ``S3FileSystem`` built from the delta-rs keys ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
    ``AWS_SESSION_TOKEN``, ``AWS_REGION`` and ``AWS_ENDPOINT_URL`` (``http://`` endpoints need
    ``AWS_ALLOW_HTTP=true``, as in delta-rs), and the path ``bucket/prefix``. Join paths with ``/``.

    Raises:
        ValueError: an unsupported URI scheme, or an ``http://`` endpoint without ``AWS_ALLOW_HTTP=true``.
        TypeError: a non-string option value, or a Lake together with other ``storage_options``.
    """
    if isinstance(lake, Lake):
        checked = as_lake(lake, storage_options)
        lake, storage_options = checked.root, checked.storage_options
    if not is_remote(lake):
        return pafs.LocalFileSystem(), str(Path(lake).absolute())
    parts = urlsplit(str(lake))
    if parts.scheme not in REMOTE_SCHEMES:
        raise ValueError(f"lake_fs: expected a local path or one of {REMOTE_SCHEMES} URIs, got {str(lake)!r}")
    opts = _options(lake, storage_options or {}) or {}
    upper = {k.upper(): v for k, v in opts.items()}
    kwargs: dict[str, Any] = {}
    for key, arg in (("AWS_ACCESS_KEY_ID", "access_key"), ("AWS_SECRET_ACCESS_KEY", "secret_key"),
                     ("AWS_SESSION_TOKEN", "session_token"), ("AWS_REGION", "region")):
        if key in upper:
            kwargs[arg] = upper[key]
    endpoint = upper.get("AWS_ENDPOINT_URL") or upper.get("AWS_ENDPOINT")
    if endpoint:
        ep = urlsplit(endpoint)
        if ep.scheme == "http" and upper.get("AWS_ALLOW_HTTP", "false").lower() != "true":
            raise ValueError(f"lake_fs: endpoint {endpoint!r} is plain http: set AWS_ALLOW_HTTP='true' to allow it")
        kwargs["endpoint_override"] = ep.netloc or endpoint
        kwargs["scheme"] = ep.scheme or "https"
    return pafs.S3FileSystem(**kwargs), f"{parts.netloc}{parts.path}".rstrip("/")


@dataclass(frozen=True, repr=False)
class Lake:
    """Where the lake lives: its root and the object-store options that reach it.

    One value instead of ``(lake, storage_options)`` threaded by hand; every function of this
    module accepts it where it accepts a root (``open_table(lake, "events")``). Its ``repr`` hides
    the values of secret options (:func:`redact`) and ``str(lake)`` is the root, so a Lake is
    safe to put in a message or a log line.

    Attributes:
        root: a local directory or an object-store URI (``s3://bucket/prefix``).
        storage_options: delta-rs / object_store keys to string values (see the module docstring);
            ignored for a local root; None for none.

    Raises:
        TypeError: ``root`` is not a string, or an option key or value is not a string.
    """

    root: str
    storage_options: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.root, str):
            raise TypeError(f"Lake.root: expected a str (a directory or an s3:// URI), got {type(self.root).__name__}; "
                            "use as_lake() for a Path")
        if self.storage_options is not None:
            _check_option_types(self.storage_options)
            # A private read-only copy: a caller's later edits of its dict do not reach this value.
            object.__setattr__(self, "storage_options", MappingProxyType(dict(self.storage_options)))

    @classmethod
    def for_config(cls, config: Any) -> Lake:
        """The lake of a ``GemlineConfig`` (``config.lake`` and ``config.lake_storage_options``; empty options: None)."""
        return cls(str(config.lake), dict(config.lake_storage_options) or None)

    @property
    def is_remote(self) -> bool:
        """True for an object-store URI (``s3://...``), False for a local directory."""
        return is_remote(self.root)

    @property
    def delta_options(self) -> dict[str, str] | None:
        """The ``storage_options`` to hand delta-rs: None for a local lake or when there are none."""
        return _options(self.root, self.storage_options)

    def uri(self, table: str) -> str:
        """Path (local) or URI (``s3://bucket/prefix/events``) of ``table`` (e.g. ``"features/user"``)."""
        return table_uri(self.root, table)

    @functools.cached_property
    def _fs_and_root(self) -> tuple[pafs.FileSystem, str]:
        return lake_fs(self.root, self.storage_options)

    @property
    def fs(self) -> pafs.FileSystem:
        """A ``pyarrow.fs`` filesystem for plain files (reports, checkpoints) under the root (see :func:`lake_fs`).

        Raises:
            ValueError: an unsupported URI scheme, or an ``http://`` endpoint without ``AWS_ALLOW_HTTP=true``.
        """
        return self._fs_and_root[0]

    def fs_path(self, relative: str = "") -> str:
        """The path in :attr:`fs` of ``relative`` (``/``-separated, e.g. ``"_checkpoints/step-3"``) under the root."""
        root = self._fs_and_root[1]
        return f"{root}/{relative.strip('/')}" if relative.strip("/") else root

    def __str__(self) -> str:
        return self.root

    def __repr__(self) -> str:
        options = None if self.storage_options is None else redact(self.storage_options)
        return f"Lake(root={self.root!r}, storage_options={options!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Lake):
            return NotImplemented
        return (self.root, dict(self.storage_options or {})) == (other.root, dict(other.storage_options or {}))

    def __hash__(self) -> int:
        return hash((self.root, tuple(sorted((self.storage_options or {}).items()))))


def as_lake(lake: Lake | str | Path, storage_options: StorageOptions | None = None) -> Lake:
    """``lake`` itself when it is a :class:`Lake`, else ``Lake(str(lake), storage_options)``.

    The bridge for functions that still take the old ``(lake, storage_options)`` pair.

    Raises:
        TypeError: a Lake together with ``storage_options`` other than its own (give them once),
            or a non-string option key or value.
    """
    if isinstance(lake, Lake):
        if storage_options is not None and dict(storage_options) != dict(lake.storage_options or {}):
            raise TypeError(f"got {lake!r} and other storage_options {redact(storage_options)!r}: "
                            "pass the options in the Lake only")
        return lake
    return Lake(str(lake), storage_options)


def committed_version(
    lake: Lake | str | Path, table: str, app_id: str, *, storage_options: StorageOptions | None = None,
    snapshot: DeltaTable | None = None,
) -> int | None:
    """Last app-transaction version ``app_id`` committed to ``table``; None if never (or no table).
    ``snapshot``: an open handle of ``table``, brought up to date and read (None opens the table)."""
    dt = latest_table(lake, table, storage_options, snapshot)
    if dt is None:
        return None
    return dt.transaction_version(app_id)


class CommitConflictError(GemlineError, RuntimeError):
    """Another writer committed the same app transaction to a table while this writer was
    committing; this commit was refused whole (its data files stay unreferenced until vacuum). Exit 2."""


VersionRule = Literal["next", "increasing"]
"""Which app-transaction versions a commit accepts: ``"next"``, only the last committed version + 1
(0 first); ``"increasing"``, any version above the last (any first one): for a writer whose app
committed its earlier versions to other tables only (ingest's ``late_events``, added to lakes that
already had events; the continuous trainer's metrics)."""


def _is_next_version(dt: DeltaTable | None, table: str, app_id: str, version: int,
                     rule: VersionRule = "next") -> bool:
    """False when (app_id, version) or a later version is committed in the snapshot ``dt`` (None:
    no table yet); True when ``version`` may be committed under ``rule``.

    Raises:
        ValueError: ``rule`` is "next" and ``version`` skips ahead of the last committed version + 1.
    """
    last = None if dt is None else dt.transaction_version(app_id)
    if last is not None and version <= last:
        return False
    if rule == "increasing":
        return True
    expected = 0 if last is None else last + 1
    if version != expected:
        raise ValueError(f"{table}: app {app_id!r} must commit version {expected} next, got {version}")
    return True


@contextlib.contextmanager
def _conflict_is_an_error(lake: Lake | str | Path, table: str, app_id: str, version: int) -> Iterator[None]:
    """Turn delta-rs's refusal of a commit that lost a race into :class:`CommitConflictError`."""
    try:
        yield
    except CommitFailedError as exc:
        raise CommitConflictError(
            f"{table_uri(lake, table)}: another writer committed to this table while this one committed "
            f"(app {app_id!r}, version {version}); this commit was refused and nothing of it is in the table. "
            f"Run one writer per table; a rerun continues from what is committed (delta-rs: {exc})"
        ) from exc


def _commit_properties(app_id: str, version: int, metadata: dict[str, Any] | None) -> CommitProperties:
    """The app transaction (app_id, version) and the custom metadata :func:`commit_metadata` reads."""
    custom = {"gemline": json.dumps({**(metadata or {}), "app_id": app_id, "txn_version": version}, sort_keys=True)}
    return CommitProperties(custom_metadata=custom, app_transactions=[Transaction(app_id=app_id, version=version)])


def commit_once(
    lake: Lake | str | Path,
    table: str,
    data: pa.Table,
    *,
    app_id: str,
    version: int,
    mode: Literal["append", "overwrite"] = "append",
    partition_by: list[str] | None = None,
    metadata: dict[str, Any] | None = None,
    version_rule: VersionRule = "next",
    storage_options: StorageOptions | None = None,
    snapshot: DeltaTable | None = None,
) -> bool:
    """Write ``data`` to ``table`` in one commit tagged (app_id, version), unless already committed.

    Args:
        data: rows to write; its schema must match the table's.
        app_id: the writer's identity (one per pipeline and partition set).
        version: monotonically increasing batch sequence number of that writer.
        metadata: JSON-serialisable values stored in the commit's custom metadata
            (e.g. Kafka offset ranges), readable with :func:`commit_metadata`.
        version_rule: which versions are accepted (:data:`VersionRule`; default: only the next).
        storage_options: object-store options for a remote lake (see the module docstring).
        snapshot: a long-running writer's open handle of ``table``, brought up to date here
            (``update_incremental``: the log entries since its version only) instead of opening the table,
            whose cost grows with the log since its last checkpoint; None opens it.

    Returns:
        True if this call committed, False if (app_id, version) or a later version was already there.

    Raises:
        ValueError: ``version_rule`` is "next" and ``version`` skips ahead of the last committed version + 1.
        CommitConflictError: another writer committed the same (app_id, version) meanwhile.
    """
    dt = latest_table(lake, table, storage_options, snapshot)
    if not _is_next_version(dt, table, app_id, version, version_rule):
        return False
    with _conflict_is_an_error(lake, table, app_id, version):
        write_deltalake(
            table_uri(lake, table) if dt is None else dt,  # commit on the snapshot just checked
            data,
            mode=mode,
            partition_by=partition_by,
            schema_mode="merge" if mode == "append" else "overwrite",
            storage_options=_options(lake, storage_options),
            commit_properties=_commit_properties(app_id, version, metadata),
        )
    return True


ROW_GROUP_ROWS = 65_536
"""Rows per Parquet row group of the data files gemline writes. A reader decodes a whole row group at
once, so this bounds the memory of streaming reads (the continuous trainer's) whatever a file holds;
pyarrow's default (1Mi rows) made a one-million-row examples file one 5 GB decode."""

_WRITE_THREADS = 4
"""Partitions :func:`write_data_file` encodes at once."""


_PLAIN_SUFFIXES = ("_id", "_ms")
"""Columns named so are written without a dictionary (:func:`_dictionary_columns`)."""


def _dictionary_columns(schema: pa.Schema) -> list[str]:
    """Columns worth Parquet's dictionary encoding: all but the ``*_id`` ones, which are (nearly) distinct
    within a file (event and example ids) or repeat in runs zstd compresses anyway (user and item ids), and
    the ``*_ms`` ones, times in ms (nearly distinct too; lists of them included). A dictionary of distinct
    values is built, then dropped for plain encoding: on a 200,000-event build's parts, leaving ids plain
    cut the encoding's CPU by a third and the bytes by 4%, then leaving times plain cut it by another
    20-38% per table and the bytes by 13-25% (issue 15). Parquet names a list column's values
    ``<name>.list.element`` (pyarrow's compliant nested types); other nested columns (none today) would
    be written plain."""
    return [f"{f.name}.list.element" if pa.types.is_list(f.type) else f.name for f in schema
            if not f.name.endswith(_PLAIN_SUFFIXES) and (pa.types.is_list(f.type) or not pa.types.is_nested(f.type))]


def write_data_file(
    lake: Lake | str | Path,
    table: str,
    data: pa.Table,
    *,
    name: str,
    partition_by: list[str] | None = None,
    storage_options: StorageOptions | None = None,
    row_group_rows: int = ROW_GROUP_ROWS,
) -> list[dict[str, Any]]:
    """Write ``data`` as Parquet data files inside ``table``'s directory, not yet committed.

    One file per partition (Hive-style ``col=value/`` directories, partition columns left out of
    the file, as Delta writers do), each named ``name`` + ``.parquet``; writing the same name
    again replaces the file, so a retried writer does not add a second copy; row groups of up to
    ``row_group_rows`` rows (a reader of a few rows decodes their whole row groups). Files stay invisible
    to readers until :func:`commit_files_once` adds them; files never committed are removed by
    vacuum after its retention.

    Returns:
        one entry per file, JSON-serialisable: ``{"path": path relative to the table root
        (URL-encoded), "size": bytes, "partition_values": {col: str}, "num_records": rows}``.

    Raises:
        ValueError: a partition column is missing or null.
    """
    from urllib.parse import quote

    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    fs, root = lake_fs(lake, storage_options)
    partition_by = list(partition_by or [])
    missing = [c for c in partition_by if c not in data.column_names]
    if missing:
        raise ValueError(f"{table}: partition columns {missing} missing from the data ({data.column_names})")
    if partition_by and data.num_rows and any(pc.count_distinct(data.column(c)).as_py() > 1 for c in partition_by):
        # One sort by the partition columns, then a slice per partition (not one filter each).
        data = data.take(pc.sort_indices(data, sort_keys=[(c, "ascending") for c in partition_by]))
        n = data.num_rows
        changed = np.zeros(n, dtype=bool)
        changed[0] = True
        for column in partition_by:  # a partition starts wherever any partition column changes
            values = data.column(column)
            changed[1:] |= pc.fill_null(pc.not_equal(values.slice(1), values.slice(0, n - 1)), True).to_numpy(
                zero_copy_only=False)
        starts = np.flatnonzero(changed).tolist()
        slices = [(data.slice(a, 1).select(partition_by).to_pylist()[0], data.slice(a, b - a))
                  for a, b in zip(starts, [*starts[1:], n], strict=True)]
    elif partition_by and data.num_rows:
        # One partition (a build's examples of one day, the common case): no sort, whose take copies
        # every list column of the rows.
        slices = [(data.slice(0, 1).select(partition_by).to_pylist()[0], data)]
    else:
        slices = [({}, data)]
    for key, _ in slices:
        if any(v is None for v in key.values()):
            raise ValueError(f"{table}: null partition value in {key}; partition columns must be non-null")

    def write(key: dict[str, Any], part: pa.Table) -> dict[str, Any]:
        part = part.drop_columns(partition_by)
        relative = "/".join([*(f"{c}={quote(str(key[c]), safe='')}" for c in partition_by), f"{name}.parquet"])
        path = f"{root}/{table}/{relative}"
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        # Column statistics only where readers can prune with them: min/max of a list column are
        # not used by any reader and cost ~10% of the write.
        flat = [f.name for f in part.schema if not pa.types.is_nested(f.type)]
        with fs.open_output_stream(path) as sink:
            pq.write_table(part, sink, compression="zstd", write_statistics=flat, row_group_size=row_group_rows,
                           use_dictionary=_dictionary_columns(part.schema))
        return {"path": relative, "size": fs.get_file_info(path).size,
                "partition_values": {c: str(key[c]) for c in partition_by}, "num_records": part.num_rows}

    # Parquet encoding releases the GIL: partitions are written side by side.
    with ThreadPoolExecutor(max_workers=min(_WRITE_THREADS, len(slices))) as pool:
        entries = list(pool.map(lambda item: write(*item), slices))
    return entries


def commit_files_once(
    lake: Lake | str | Path,
    table: str,
    files: Sequence[Mapping[str, Any]],
    schema: pa.Schema,
    *,
    app_id: str,
    version: int,
    mode: Literal["append", "overwrite"] = "append",
    partition_by: list[str] | None = None,
    metadata: dict[str, Any] | None = None,
    storage_options: StorageOptions | None = None,
    removes: Sequence[Mapping[str, Any]] = (),
    snapshot: DeltaTable | None = None,
) -> bool:
    """:func:`commit_once` for data files already written by :func:`write_data_file`: one commit,
    tagged (app_id, version), adding ``files`` (append) or replacing the table's files with them
    (overwrite), unless that version is already committed. Creates the table (an empty
    ``CREATE TABLE`` commit of ``schema``) first when it does not exist.

    ``removes``: files of the table's current snapshot this commit removes, in the same commit as the
    adds (append mode only; entries ``{"path", "size", "partition_values"}``, the path relative to the
    table root as the Delta log holds it): a writer that rewrites some files of a table and keeps the
    rest (the build's state tables) replaces them atomically.

    Committing files instead of data means each row is encoded once, by the writer that made it
    (delta-rs ``DeltaTable.create_write_transaction``).

    Returns:
        True if this call committed, False if (app_id, version) or a later one was already there.

    Raises:
        ValueError: ``version`` skips ahead of the last committed version + 1, or ``removes`` with an overwrite.
        CommitConflictError: another writer committed the same (app_id, version) meanwhile.
    """
    import time

    from deltalake.transaction import AddAction, RemoveAction

    dt = latest_table(lake, table, storage_options, snapshot)
    if not _is_next_version(dt, table, app_id, version):
        return False
    if dt is None:
        dt = DeltaTable.create(table_uri(lake, table), schema=schema, partition_by=partition_by, mode="ignore",
                               storage_options=_options(lake, storage_options))
    now_ms = int(time.time() * 1000)
    actions: list[AddAction | RemoveAction] = [  # the element type create_write_transaction declares
        AddAction(path=f["path"], size=int(f["size"]), partition_values=dict(f["partition_values"]),
                  modification_time=now_ms, data_change=True, stats=json.dumps({"numRecords": int(f["num_records"])}))
        for f in files
    ]
    if removes and mode != "append":
        raise ValueError(f"{table}: removes go with mode='append' (an overwrite removes every file), got mode={mode!r}")
    actions += [RemoveAction(path=f["path"], deletion_timestamp=now_ms, data_change=True, size=int(f["size"]),
                             partition_values=dict(f["partition_values"])) for f in removes]
    with _conflict_is_an_error(lake, table, app_id, version):
        dt.create_write_transaction(
            actions, mode=mode, schema=schema, partition_by=partition_by,
            commit_properties=_commit_properties(app_id, version, metadata))
    return True


def commit_metadata(
    lake: Lake | str | Path, table: str, app_id: str, *, storage_options: StorageOptions | None = None,
    recent: int = 20, snapshot: DeltaTable | None = None,
) -> dict[str, Any] | None:
    """Custom metadata of the newest commit of ``table`` whose app transaction belongs to ``app_id``
    (``snapshot``: an open handle of ``table``, brought up to date and read; None opens the table).

    Reads the table history newest first: the newest ``recent`` commits, then, when none is ``app_id``'s, the
    whole history (one log file per commit: 61 ms at 1,000 commits, against 7 ms for the newest 20). Returns
    None when ``app_id`` never committed.
    """
    dt = latest_table(lake, table, storage_options, snapshot)
    if dt is None or dt.transaction_version(app_id) is None:
        return None
    return next((meta for _, meta in _gemline_commits(dt, recent) if meta.get("app_id") == app_id), None)


def _gemline_commits(dt: Any, recent: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """(version, gemline metadata) of ``dt``'s commits that carry it, newest first: the newest ``recent``
    commits, then the whole history (one log file per commit: 61 ms at 1,000 commits, against 7 ms for 20)."""
    for limit in (recent, None):
        for entry in dt.history(limit=limit):
            raw = entry.get("gemline")
            if raw is not None:
                yield int(entry["version"]), json.loads(raw)


def commit_version_of(lake: Lake | str | Path, table: str, app_id: str, txn_version: int, *,
                      storage_options: StorageOptions | None = None, recent: int = 20) -> int | None:
    """The Delta version of ``table`` that ``app_id``'s app transaction ``txn_version`` committed (the commits of
    one ingest batch share it across tables), or None when that transaction committed nothing to ``table``
    (the table's app version is below it: an empty part is not written) or left no ``gemline`` metadata.

    Reads the history newest first as :func:`commit_metadata` does: the newest ``recent`` commits, then all.
    """
    dt = open_table(lake, table, storage_options=storage_options)
    newest = None if dt is None else dt.transaction_version(app_id)
    if dt is None or newest is None or newest < txn_version:
        return None
    return next((version for version, meta in _gemline_commits(dt, recent)
                 if meta.get("app_id") == app_id and meta.get("txn_version") == txn_version), None)


def read_table(
    lake: Lake | str | Path,
    table: str,
    version: int | None = None,
    columns: list[str] | None = None,
    *,
    storage_options: StorageOptions | None = None,
) -> pa.Table | None:
    """Read a whole table (at ``version``, latest when None) into Arrow; None if it does not exist.

    Goes through ``to_pyarrow_dataset()``. With deltalake 1.6.6 and pyarrow 25 a process that read a
    table through pyarrow can abort at exit ("terminate called without an active exception", exit
    134, after the work is done): ``DeltaTable.to_pyarrow_table()`` did in 2 of 10 runs of a trial,
    this dataset path in 4-7 of 10 (delta-io/delta-rs#2184, apache/arrow#34314); ``polars.read_delta``
    did not. The abort comes after the read, so results and commits are complete.
    """
    dt = open_table(lake, table, version, storage_options=storage_options)
    if dt is None:
        return None
    return dt.to_pyarrow_dataset().to_table(columns=columns)
