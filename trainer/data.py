"""From a version of the ``examples`` Delta table to TorchRec batches.

Shape letters: N examples in a split, B examples in a batch, S = len(SPARSE_FEATURES) sparse
features, F dense features, L_i history length of example i, T = sum L_i over a batch.

The sequence of each example is one jagged row; a batch keeps it jagged (no padding)::

    example      0         1      2
    seq_length   3         0      2
    values       [a b c]   []     [d e]     -> values (T=5,), lengths (B=3,) = [3, 0, 2]

String ids are hashed with ``hashlib.blake2b`` (keyed by a namespace, so ``item_id`` and
``seq_item_ids`` share one id space) into ``[1, num_embeddings)``; row 0 is reserved for null.
blake2b, unlike Python's ``hash``, is identical across processes and runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torchrec import KeyedJaggedTensor

from gemline.errors import InputSchemaError, MissingInputError
from gemline.lake import Lake, StorageOptions, commit_metadata, open_table, read_table
from gemline.tables import Table
from sequences.config import NOTHING_PUBLISHED
from sequences.history_tail import HistoryTail
from sequences.materialize import HistoryCut, SequenceIndex, read_history, sequence_index
from sequences.schema import HISTORY_SCHEMA, SPARSE_FEATURES, dense_feature_names
from sequences.sorted_history import SortedHistory
from trainer.config import TrainerConfig
from trainer.delayed import DelayedBatch, DelayedLabels, delayed_labels, to_torch
from trainer.labels import final_labels as labels_final

if TYPE_CHECKING:
    from trainer.id_mapping import IdMapping

log = logging.getLogger(__name__)

SEQUENCE_KEYS: tuple[str, ...] = ("seq_item_ids", "seq_categories", "seq_event_types")
"""Sequence columns the model embeds (``seq_domains`` is not used), keys of ``Batch.sequence``."""

HISTORY_COLUMN_OF = {"seq_item_ids": "item_id", "seq_categories": "category", "seq_event_types": "event_type"}
"""Sequence key -> the history table's column its ids come from (sequences.schema.HISTORY_SCHEMA)."""


HASH_NAMESPACE: dict[str, str] = {
    **{name: name for name in SPARSE_FEATURES},
    "item_id": "item",
    "category": "category",
    "seq_item_ids": "item",
    "seq_categories": "category",
    "seq_event_types": "event_type",
}
"""Hash namespace per column: a candidate and its history share ids (the target-aware attention needs it)."""

NULL_ID = 0
"""Embedding row of a null (or empty-string) id."""

TIME_BUCKETS_KEY = "seq_time_buckets"
"""Extra sequence key: log2-second bucket of each history event's ``seq_time_delta_ms`` (:func:`time_buckets`)."""

SAME_DOMAIN_KEYS: tuple[str, ...] = ("seq_same_domain_item_ids", "seq_same_domain_categories",
                                     "seq_same_domain_event_types", "seq_same_domain_time_buckets")
"""Extra sequence keys of the same-domain history (own lengths ``seq_same_domain_length``), ids mapped as the
main history's columns (SEQUENCE_KEYS, same order), the last one its time buckets."""

SEQUENCE_EXTRA_KEYS: tuple[str, ...] = (TIME_BUCKETS_KEY, *SAME_DOMAIN_KEYS)
"""Keys after SEQUENCE_KEYS in ``Batch.sequence`` when the examples were encoded with ``sequence_extras`` and
have the build's columns (sequences.schema.BUILD_EXTRA_SCHEMA)."""


def hash_ids(values: pa.Array | pa.ChunkedArray, num_embeddings: int, namespace: str) -> np.ndarray:
    """Hash strings to embedding rows, stable across processes.

    Args:
        values: (N,) strings, nulls allowed.
        num_embeddings: table rows; ids land in ``[1, num_embeddings)``, null and "" map to 0.
        namespace: salt of the hash (blake2b ``person``), so equal strings of different
            columns can land on different rows.

    Returns:
        (N,) int64 ids.

    Raises:
        ValueError: ``num_embeddings`` < 2 (no room for a non-null row).
        TypeError: ``values`` is not a string array.
    """
    if num_embeddings < 2:
        raise ValueError(f"num_embeddings must be >= 2 (row 0 is the null id), got {num_embeddings}")
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        raise TypeError(f"hash_ids expects a string array, got {values.type}; cast the column to string first")
    encoded = values.dictionary_encode()
    person = namespace.encode()[:16]
    rows = np.fromiter(
        (
            NULL_ID
            if not s
            else 1 + int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8, person=person).digest(), "little")
            % (num_embeddings - 1)
            for s in encoded.dictionary.to_pylist()
        ),
        dtype=np.int64,
        count=len(encoded.dictionary),
    )
    indices = encoded.indices.to_numpy(zero_copy_only=False)
    out = np.full(len(values), NULL_ID, dtype=np.int64)
    valid = ~np.asarray(encoded.indices.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    out[valid] = rows[indices[valid].astype(np.int64)]
    return out


def time_buckets(delta_ms: np.ndarray) -> np.ndarray:
    """Log2-second buckets of time deltas: ``1 + floor(log2(1 + delta_ms / 1000))`` for ``delta_ms >= 0`` (1: under
    a second, 2: 1-3 s, ..., 27: ~2 years), 0 for a negative or missing (NaN) delta; (T,) any numeric -> (T,) int64.

    Log buckets as in the time-interval embeddings of sequential recommenders (e.g. TiSASRec, Li et al. WSDM 2020,
    clips intervals; Meta's HSTU, arXiv 2402.17152, buckets them by log): recent events need fine resolution,
    old ones coarse.
    """
    delta = np.asarray(delta_ms, dtype=np.float64)
    valid = np.isfinite(delta) & (delta >= 0)
    out = np.zeros(delta.shape, dtype=np.int64)
    out[valid] = 1 + np.floor(np.log2(1 + delta[valid] / 1000.0)).astype(np.int64)
    return out


def signed_log1p(x: np.ndarray) -> np.ndarray:
    """sign(x) * log1p(|x|) with NaN and ±inf mapped to 0; float64 in, float64 out, same shape."""
    x = np.asarray(x, dtype=np.float64)
    finite = np.isfinite(x)
    safe = np.where(finite, x, 0.0)
    return np.sign(safe) * np.log1p(np.abs(safe))


@dataclass(frozen=True)
class DenseNormalizer:
    """Standardizes signed-log dense features with train-set statistics; cannot emit NaN or inf.

    ``mean`` and ``std`` are (F,) float64; a constant feature gets std 1.
    """

    names: tuple[str, ...]
    mean: np.ndarray
    std: np.ndarray

    @classmethod
    def fit(cls, names: tuple[str, ...], raw: np.ndarray) -> DenseNormalizer:
        """Statistics of ``raw`` (N, F) float64 (NaN for null) after :func:`signed_log1p`."""
        logged = signed_log1p(raw)
        if len(logged) == 0:
            return cls(names, np.zeros(len(names)), np.ones(len(names)))
        std = logged.std(axis=0)
        return cls(names, logged.mean(axis=0), np.where(std > 1e-12, std, 1.0))

    def transform(self, raw: np.ndarray) -> np.ndarray:
        """(N, F) float64 raw values -> (N, F) float32 normalized, finite."""
        return ((signed_log1p(raw) - self.mean) / self.std).astype(np.float32)

    def to_dict(self) -> dict:
        """JSON-able form, saved with checkpoints."""
        return {"names": list(self.names), "mean": self.mean.tolist(), "std": self.std.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> DenseNormalizer:
        """Inverse of :meth:`to_dict`."""
        return cls(tuple(d["names"]), np.asarray(d["mean"], dtype=np.float64), np.asarray(d["std"], dtype=np.float64))


@dataclass(frozen=True)
class Batch:
    """One training batch.

    Attributes:
        sparse: KeyedJaggedTensor, keys = SPARSE_FEATURES, one id per key per example
            (lengths all 1, values (S*B,) int64, key-major).
        sequence: KeyedJaggedTensor, keys = SEQUENCE_KEYS, lengths = seq_length per key
            (values (3*T,) int64, key-major), no padding.
        dense: (B, F) float32, normalized.
        labels: (B, 2) float32, columns (click, conversion).
        domains: (B,) domain strings, for per-domain metrics.
        delayed: the rows' late-label weighting inputs as tensors (:mod:`trainer.delayed`); None: every
            label final, plain BCE.
        final: (B, 2) bool, the labels the loss may use (:func:`trainer.labels.final_labels`); None: all.
    """

    sparse: KeyedJaggedTensor
    sequence: KeyedJaggedTensor
    dense: torch.Tensor
    labels: torch.Tensor
    domains: list[str]
    delayed: DelayedBatch | None = None
    final: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        """B."""
        return int(self.labels.shape[0])

    def _map(self, move: Callable[[torch.Tensor], torch.Tensor], kjt: Callable[[KeyedJaggedTensor], KeyedJaggedTensor]) -> Batch:
        delayed = self.delayed
        if delayed is not None:
            delayed = DelayedBatch(*(move(getattr(delayed, f.name)) for f in dataclasses.fields(delayed)))
        return dataclasses.replace(self, sparse=kjt(self.sparse), sequence=kjt(self.sequence), dense=move(self.dense),
                                   labels=move(self.labels), delayed=delayed,
                                   final=None if self.final is None else move(self.final))

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Batch:
        """This batch with every tensor on ``device`` (``non_blocking``: asynchronous from pinned memory on CUDA).

        The KJTs' per-key lengths are computed first (``KeyedJaggedTensor.sync``) while they are on the host, so
        reading a key of the moved KJTs does not copy lengths back from the device."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking),
                         lambda k: k.sync().to(torch.device(device), non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        """This batch with every tensor in page-locked host memory (what an asynchronous copy to CUDA reads)."""
        return self._map(lambda t: t.pin_memory(), lambda k: k.sync().pin_memory())


def validate_batch(batch: Batch, num_dense: int) -> None:
    """Check a batch against the layout :class:`Batch` documents; run it where batches enter the model, on the host
    (trainer.loop.prepare_batch, before the batch moves to its device), so the forward checks nothing that syncs.

    Raises:
        ValueError: wrong keys, a sparse feature without exactly one id per example, sequence keys
            with different lengths, or a dense/labels/domains shape that disagrees with B.
    """
    num_rows = batch.batch_size
    if batch.sparse.keys() != list(SPARSE_FEATURES):
        raise ValueError(f"sparse keys must be {list(SPARSE_FEATURES)}, got {batch.sparse.keys()}")
    if batch.sparse.lengths().numel() != len(SPARSE_FEATURES) * num_rows or bool(torch.any(batch.sparse.lengths() != 1)):
        raise ValueError(f"sparse features need exactly one id per example for B={num_rows}, got lengths {batch.sparse.lengths().tolist()}")
    if batch.sequence.keys() not in (list(SEQUENCE_KEYS), [*SEQUENCE_KEYS, *SEQUENCE_EXTRA_KEYS]):
        raise ValueError(f"sequence keys must be {list(SEQUENCE_KEYS)} (then optionally {list(SEQUENCE_EXTRA_KEYS)}), "
                         f"got {batch.sequence.keys()}")
    keys = len(batch.sequence.keys())
    lengths = batch.sequence.lengths()
    if lengths.numel() != keys * num_rows:
        raise ValueError(f"sequence lengths must have {keys}*B={keys * num_rows} entries, got {lengths.numel()}")
    if lengths.numel() and bool(torch.any(lengths < 0)):
        raise ValueError(f"sequence lengths must be >= 0, got {lengths.tolist()[:20]}")
    per_key = lengths.view(keys, num_rows)
    main = per_key[: len(SEQUENCE_KEYS) + (keys > len(SEQUENCE_KEYS))]  # the history keys and its time buckets
    same = per_key[len(SEQUENCE_KEYS) + 1:]
    if bool(torch.any(main != main[0])) or (same.numel() and bool(torch.any(same != same[0]))):
        raise ValueError("sequence keys must share one length per example (aligned histories), got different lengths")
    if tuple(batch.dense.shape) != (num_rows, num_dense) or batch.dense.dtype != torch.float32:
        raise ValueError(f"dense must be ({num_rows}, {num_dense}) float32, got {tuple(batch.dense.shape)} {batch.dense.dtype}")
    if tuple(batch.labels.shape) != (num_rows, 2):
        raise ValueError(f"labels must be ({num_rows}, 2), got {tuple(batch.labels.shape)}")
    if len(batch.domains) != num_rows:
        raise ValueError(f"domains must have B={num_rows} entries, got {len(batch.domains)}")


@dataclass(frozen=True)
class EncodedExamples:
    """A split with every column hashed and normalized, ready to slice into batches.

    Attributes:
        sparse_ids: (N, S) int64.
        seq_values: SEQUENCE_KEYS -> (sum L_i,) int64, row i at ``seq_offsets[i]:seq_offsets[i+1]``; with
            sequence extras also TIME_BUCKETS_KEY (aligned with them) and SAME_DOMAIN_KEYS (at ``same_domain_offsets``).
        seq_offsets: (N+1,) int64.
        dense: (N, F) float32.
        labels: (N, 2) float32.
        domains: (N,) object array of str.
        delayed: late-label weighting inputs (:func:`trainer.delayed.delayed_labels`); None: all final.
        final: (N, 2) bool, labels whose window has closed (:func:`trainer.labels.final_labels`); None: all.
    """

    sparse_ids: np.ndarray
    seq_values: dict[str, np.ndarray]
    seq_offsets: np.ndarray
    dense: np.ndarray
    labels: np.ndarray
    domains: np.ndarray
    delayed: DelayedLabels | None = None
    final: np.ndarray | None = None
    same_domain_offsets: np.ndarray | None = None
    """(N+1,) int64 offsets of the same-domain keys; None: encoded without sequence extras."""

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True)
class PointerHistory:
    """What :func:`encode_examples` rebuilds pointer-layout sequences from (``build.examples_layout =
    "pointer"``, :mod:`sequences.materialize`): the ``history`` rows of the examples' users and the
    ``max_seq_len`` of the build that wrote them."""

    history: pa.Table
    max_seq_len: int
    same_domain_seq_len: int | None = None
    """The build's ``same_domain_seq_len``; None (a lake built before it was recorded): no same-domain stream."""
    cut: HistoryCut | None = None
    """For a compacted ``history`` (:class:`sequences.history_tail.HistoryTail`): what it left out."""
    sorted_history: SortedHistory | None = None
    """A long-running reader's history held sorted (:class:`sequences.sorted_history.SortedHistory`): the
    sequences come from it, ``history`` is unused."""

    def index(self, table: pa.Table, same_domain: bool = False) -> SequenceIndex:
        """The :class:`~sequences.materialize.SequenceIndex` of ``table``'s cross-domain (or same-domain)
        sequences (raises ValueError as :func:`sequences.materialize.sequence_index`)."""
        max_len = self.same_domain_seq_len if same_domain and self.same_domain_seq_len is not None else self.max_seq_len
        if self.sorted_history is not None:
            return self.sorted_history.sequence_index(table, max_len, same_domain=same_domain)
        return sequence_index(table, self.history, max_len, same_domain=same_domain, cut=self.cut)


@dataclass(frozen=True)
class ExamplesSplit:
    """The temporal split of one examples version: train on every date but the last, eval on the last.
    ``pointers``: set when the rows are pointer-layout (no list columns); pass it to :func:`encode_examples`."""

    examples_version: int
    train: pa.Table
    eval: pa.Table
    train_dates: tuple[str, ...]
    eval_date: str
    pointers: PointerHistory | None = None


def latest_examples_version(lake: Lake | str | Path, *, storage_options: StorageOptions | None = None) -> int:
    """Newest Delta version of ``examples`` (``lake``: a Lake, or a root with its ``storage_options``);
    raises MissingInputError (a FileNotFoundError) if the table does not exist."""
    dt = open_table(lake, Table.EXAMPLES, storage_options=storage_options)
    if dt is None:
        raise MissingInputError(f"no examples table under {str(lake)!r}; run the build stage first")
    return dt.version()


def temporal_split(table: pa.Table, examples_version: int) -> ExamplesSplit:
    """Split by ``event_date``: the last date is eval, every earlier date is train.

    Raises:
        MissingInputError: the version holds no rows (:data:`sequences.config.NOTHING_PUBLISHED`).
        ValueError: fewer than 2 distinct dates (names the dates found).
    """
    if table.num_rows == 0:
        raise MissingInputError(f"examples@{examples_version} holds no rows: {NOTHING_PUBLISHED}; train once the build "
                                "has published examples on >= 2 event dates")
    dates = sorted(pc.unique(table["event_date"]).to_pylist())
    if len(dates) < 2:
        raise ValueError(
            f"temporal split needs examples on >= 2 distinct event_date values, got {dates}; "
            "build more days of examples before training"
        )
    eval_date = dates[-1]
    is_eval = pc.equal(table["event_date"], eval_date)
    return ExamplesSplit(
        examples_version=examples_version,
        train=table.filter(pc.invert(is_eval)),
        eval=table.filter(is_eval),
        train_dates=tuple(dates[:-1]),
        eval_date=eval_date,
    )


def load_split(lake: Lake | str | Path, examples_version: int, *,
               storage_options: StorageOptions | None = None) -> ExamplesSplit:
    """Read ``examples@examples_version``, order rows by (event_time_ms, example_id), split by date.

    See :func:`temporal_split`.

    Raises:
        FileNotFoundError: the table or version does not exist (MissingInputError, as when the version holds no rows).
        ValueError: fewer than 2 dates, or a missing required column.
    """
    table = read_table(lake, Table.EXAMPLES, examples_version, storage_options=storage_options)
    if table is None:
        raise MissingInputError(f"no examples table under {str(lake)!r}; run the build stage first")
    pointers = pointer_history(lake, table, storage_options=storage_options)
    lists = [] if pointers is not None else list(SEQUENCE_KEYS)
    required = ["example_id", "event_time_ms", "event_date", "domain", "seq_length", *SPARSE_FEATURES, *lists, "label_click", "label_conversion"]
    missing = [c for c in required if c not in table.schema.names]
    if missing:
        raise ValueError(f"examples@{examples_version} lacks columns {missing}; expected the sequences/schema.py contract")
    # Delta's file order is not stable across reads; a fixed row order makes a seeded run reproducible.
    table = table.sort_by([("event_time_ms", "ascending"), ("example_id", "ascending")])
    split = temporal_split(table, examples_version)
    return split if pointers is None else dataclasses.replace(split, pointers=pointers)


def _pointer_lengths(lake: Lake | str | Path, storage_options: StorageOptions | None) -> tuple[int, int | None]:
    """(``max_seq_len``, ``same_domain_seq_len`` or None) from the build's commit metadata.

    Raises:
        InputSchemaError: no build metadata naming ``max_seq_len`` (a lake written by another tool).
    """
    meta = commit_metadata(lake, Table.EXAMPLES, "build", storage_options=storage_options) or {}
    if "max_seq_len" not in meta:
        raise InputSchemaError(f"examples lack the sequence columns {list(SEQUENCE_KEYS)} (pointer layout) but the "
                               "build's commit metadata has no max_seq_len to rebuild them with; rebuild the lake")
    same = meta.get("same_domain_seq_len")
    return int(meta["max_seq_len"]), None if same is None else int(same)


def pointer_history(lake: Lake | str | Path, table: pa.Table, *, storage_options: StorageOptions | None = None,
                    tail: HistoryTail | None = None) -> PointerHistory | None:
    """None for fat examples rows (they carry :data:`SEQUENCE_KEYS`); for pointer-layout rows the
    ``history`` rows of their users and the build's ``max_seq_len`` (from the build's commit metadata):
    read whole (only those users' buckets), or, given the ``tail`` of a long-running reader
    (:class:`PointerReader`), its compacted rows of those users and what it left out.

    Raises:
        InputSchemaError: pointer rows but no build metadata naming ``max_seq_len`` (a lake written by
            another tool).
    """
    if all(key in table.schema.names for key in SEQUENCE_KEYS):
        return None
    max_seq_len, same = _pointer_lengths(lake, storage_options)
    if tail is None:
        return PointerHistory(read_history(lake, table.column("user_id"), storage_options=storage_options),
                              max_seq_len, same)
    history, cut = tail.history_for(table)
    return PointerHistory(history, max_seq_len, same, cut)


class PointerReader:
    """:func:`pointer_history` for a long-running reader (``train --follow``, distillation), kept across its calls.

    By default a :class:`sequences.sorted_history.SortedHistory`: the history held sorted by key and time, new
    commits merged in, each row's sequence cut from a window of its key's events (cost per row, exact). With
    ``sorted_history=False`` one :class:`sequences.history_tail.HistoryTail`: each batch costs the rows the
    commits added and its users' compacted rows, whose compaction label corrections hold back (defer keeps every
    row: a batch's cost then grows with the run). Measured on the tenth minute of ``benchmarks.freshness``: the
    sorted history's two indexes cost 0.76x the tail's (README "Freshness").
    Created on the first pointer-layout batch (the build's lengths are in its commit metadata by then)."""

    def __init__(self, lake: Lake | str | Path, *, storage_options: StorageOptions | None = None,
                 sorted_history: bool = True) -> None:
        self.lake, self.storage_options = lake, storage_options
        self.tail: HistoryTail | None = None
        self.sorted: SortedHistory | None = None
        self.use_sorted = sorted_history
        self.lengths: tuple[int, int | None] = (0, None)

    def __call__(self, table: pa.Table) -> PointerHistory | None:
        """:func:`pointer_history` of ``table`` through the tail (raises as it does)."""
        if all(key in table.schema.names for key in SEQUENCE_KEYS):
            return None
        if self.use_sorted:
            if self.sorted is None:
                self.sorted = SortedHistory(self.lake, storage_options=self.storage_options)
                self.lengths = _pointer_lengths(self.lake, self.storage_options)
            return PointerHistory(HISTORY_SCHEMA.empty_table(), *self.lengths, sorted_history=self.sorted)
        if self.tail is None:
            max_seq_len, same = _pointer_lengths(self.lake, self.storage_options)
            # Without a recorded same-domain length, compacting by max_seq_len keeps at least what is needed.
            self.tail = HistoryTail(self.lake, max_seq_len, max_seq_len if same is None else same,
                                    storage_options=self.storage_options)
        return pointer_history(self.lake, table, storage_options=self.storage_options, tail=self.tail)


def with_history_ids(table: pa.Table, pointers: PointerHistory | None) -> pa.Table:
    """``table`` as :meth:`trainer.id_mapping.IdMapping.observe` counts it: fat rows unchanged, pointer-layout rows
    with their :data:`SEQUENCE_KEYS` lists (list<string>, a null category as "") rebuilt from ``pointers`` as the
    fat build writes them, so a managed mapping admits the same ids on either layout (build.examples_layout).

    Raises:
        InputSchemaError: pointer rows without ``pointers``. ValueError: as :func:`sequences.materialize.sequence_index`.
    """
    if all(key in table.schema.names for key in SEQUENCE_KEYS) or table.num_rows == 0:
        return table
    if pointers is None:
        raise InputSchemaError(f"examples lack the sequence columns {list(SEQUENCE_KEYS)} (pointer layout): pass "
                               "the PointerHistory of load_split / pointer_history")
    index = pointers.index(table)
    for key in SEQUENCE_KEYS:
        table = table.append_column(key, index.lists(HISTORY_COLUMN_OF[key], pa.string()))
    return table


def _dense_raw(table: pa.Table, names: tuple[str, ...]) -> np.ndarray:
    """(N, F) float64 of the named columns, null -> NaN; raises InputSchemaError (a TypeError) on a non-numeric column."""
    if not names:
        return np.zeros((table.num_rows, 0), dtype=np.float64)
    for n in names:
        kind = table.schema.field(n).type
        if not (pa.types.is_floating(kind) or pa.types.is_integer(kind)):
            raise InputSchemaError(f"dense feature {n} must be float64 (sequences/schema.py), got {kind}")
    cols = [table[n].cast(pa.float64()).to_numpy(zero_copy_only=False) for n in names]
    return np.stack([np.asarray(c, dtype=np.float64) for c in cols], axis=1)


def dense_names(table: pa.Table) -> tuple[str, ...]:
    """The ``f_*`` columns of ``table`` in schema order."""
    return tuple(dense_feature_names(table.schema))


def fit_normalizer(train: pa.Table) -> DenseNormalizer:
    """Fit dense statistics on the train split only (the eval day must not leak into them)."""
    names = dense_names(train)
    return DenseNormalizer.fit(names, _dense_raw(train, names))


RowsOf = Callable[[pa.Array | pa.ChunkedArray, str], np.ndarray]
"""(values, id column) -> (N,) int64 embedding rows: hashing or an id mapping's lookup."""


def _pointer_sequences(index: SequenceIndex, rows: RowsOf) -> dict[str, np.ndarray]:
    """SEQUENCE_KEYS -> (T,) ids of pointer-layout rows from their cross-domain :class:`SequenceIndex`: each
    (user, build) pair's candidate events are mapped to rows once and the examples gather from them (RecD's
    inverse indices, arXiv 2211.05239)."""
    return {key: rows(index.events.column(HISTORY_COLUMN_OF[key]).cast(pa.string()), key)[index.index]
            for key in SEQUENCE_KEYS}


def _with_pointer_extras(table: pa.Table, pointers: PointerHistory, whole: SequenceIndex) -> pa.Table:
    """``table`` (pointer-layout rows) with the build's extra list columns rebuilt from history as the fat build
    writes them (``seq_time_delta_ms`` and the ``seq_same_domain_*`` lists), so the sequence extras encode the
    same on both layouts; unchanged when ``pointers`` does not know the same-domain length. ``whole``: the
    rows' cross-domain :class:`SequenceIndex`."""
    if pointers.same_domain_seq_len is None:
        return table
    same = pointers.index(table, same_domain=True)
    columns = {
        "seq_time_delta_ms": whole.time_deltas(),
        "seq_same_domain_item_ids": same.lists("item_id", pa.string()),
        "seq_same_domain_categories": same.lists("category", pa.string()),
        "seq_same_domain_event_types": same.lists("event_type", pa.string()),
        "seq_same_domain_time_delta_ms": same.time_deltas(),
    }
    for name, column in columns.items():
        index = table.schema.get_field_index(name)
        table = table.append_column(name, column) if index < 0 else table.set_column(index, name, column)
    return table


def encode_for(table: pa.Table, tc: TrainerConfig, normalizer: DenseNormalizer, pointers: PointerHistory | None = None, *,
               ids: IdMapping | None = None, sequences: bool = True) -> EncodedExamples:
    """:func:`encode_examples` as the trainer ``tc`` reads examples (final labels, the sequence extras its model needs)."""
    return encode_examples(table, tc.num_embeddings, normalizer, pointers, ids=ids, final_labels=tc.final_labels,
                           click_window_ms=tc.click_window_ms, sequence_extras=tc.reads_sequence_extras,
                           sequences=sequences)


def encode_examples(table: pa.Table, num_embeddings: int, normalizer: DenseNormalizer,
                    pointers: PointerHistory | None = None, *, ids: IdMapping | None = None, final_labels: bool = False,
                    click_window_ms: int | None = None, sequence_extras: bool = False,
                    sequences: bool = True) -> EncodedExamples:
    """Hash (or map with ``ids``, trainer.id_mapping, which counts nothing here), flatten and normalize a split;
    pointer-layout rows take their sequences from ``pointers`` (:attr:`ExamplesSplit.pointers`), fat rows from
    their list columns. With ``final_labels``, mark the labels whose window has closed
    (:func:`trainer.labels.final_labels` with ``click_window_ms``); with ``sequence_extras`` and the build's
    columns (``seq_time_delta_ms``, ``seq_same_domain_*``; pointer rows rebuild them from history), also the :data:`SEQUENCE_EXTRA_KEYS`.
    Without ``sequences`` (a reader of the other columns only: the distillation students) no sequence is
    encoded: ``seq_values`` is empty, ``seq_offsets`` zeros, ``pointers`` unused; every other field is the same.

    Raises:
        ValueError: a sequence column's list lengths disagree with ``seq_length`` (or, for pointer
            rows, the history rebuilds other lengths; :func:`sequences.materialize.sequence_index`).
        gemline.errors.InputSchemaError: a dense column of ``normalizer`` is missing or not numeric, or
            the rows lack the sequence columns and no ``pointers`` were given.
    """
    missing = [n for n in normalizer.names if n not in table.schema.names]
    if missing:
        raise InputSchemaError(f"dense features {missing} were in the train split (the model reads them) but are "
                               "missing here")
    n = table.num_rows
    def rows(values: pa.Array | pa.ChunkedArray, column: str) -> np.ndarray:
        return hash_ids(values, num_embeddings, HASH_NAMESPACE[column]) if ids is None else ids.lookup(values, column)

    sparse = np.stack(
        [rows(table[name], name) for name in SPARSE_FEATURES], axis=1
    ) if n else np.zeros((0, len(SPARSE_FEATURES)), dtype=np.int64)
    if sequences:
        seq_values, offsets, same_offsets = _encode_sequences(table, rows, pointers, sequence_extras)
    else:
        seq_values, offsets, same_offsets = {}, np.zeros(n + 1, dtype=np.int64), None
    labels = np.stack(
        [table[c].to_numpy(zero_copy_only=False).astype(np.float32) for c in ("label_click", "label_conversion")], axis=1
    ) if n else np.zeros((0, 2), dtype=np.float32)
    return EncodedExamples(
        sparse_ids=sparse,
        seq_values=seq_values,
        seq_offsets=offsets,
        dense=normalizer.transform(_dense_raw(table, normalizer.names)),
        labels=labels,
        domains=np.asarray(table["domain"].to_pylist(), dtype=object),
        delayed=delayed_labels(table),
        final=labels_final(table, click_window_ms) if final_labels else None,
        same_domain_offsets=same_offsets,
    )


def _encode_sequences(table: pa.Table, rows: RowsOf, pointers: PointerHistory | None,
                      sequence_extras: bool) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray | None]:
    """(seq_values, seq_offsets, same_domain_offsets) of :class:`EncodedExamples` for ``table``
    (:func:`encode_examples`, which documents what it raises)."""
    n = table.num_rows
    seq_length = table["seq_length"].to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(seq_length, out=offsets[1:])
    seq_values: dict[str, np.ndarray] = {}
    if pointers is not None and n:
        # One cross-domain index serves the ids and the time deltas (each index is a sorted join over the history).
        whole = pointers.index(table)
        seq_values = _pointer_sequences(whole, rows)
        if sequence_extras:
            table = _with_pointer_extras(table, pointers, whole)
    elif any(key not in table.schema.names for key in SEQUENCE_KEYS) and n:
        raise InputSchemaError(f"examples lack the sequence columns {list(SEQUENCE_KEYS)} (pointer layout): pass "
                               "the PointerHistory of load_split / pointer_history")
    for key in SEQUENCE_KEYS:
        if key in seq_values:
            continue
        column = table[key].combine_chunks() if n else pa.array([], pa.list_(pa.string()))
        lengths = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        if not np.array_equal(lengths, seq_length):
            bad = int(np.flatnonzero(lengths != seq_length)[0])
            raise ValueError(
                f"{key} row {bad} has {lengths[bad]} elements but seq_length={seq_length[bad]}; "
                "sequence columns must be aligned with seq_length (sequences/schema.py)"
            )
        seq_values[key] = rows(pc.list_flatten(column), key)
    same_offsets = None
    if sequence_extras and n and {"seq_time_delta_ms", *SAME_DOMAIN_KEYS[:3]} <= set(table.schema.names):
        same_offsets = _encode_extras(table, rows, seq_length, seq_values)
    return seq_values, offsets, same_offsets


def _encode_extras(table: pa.Table, rows: RowsOf, seq_length: np.ndarray, seq_values: dict[str, np.ndarray]) -> np.ndarray:
    """Add the :data:`SEQUENCE_EXTRA_KEYS` of ``table`` to ``seq_values``; returns the same-domain offsets (N+1,).

    Raises:
        ValueError: a time-delta or same-domain list whose length disagrees with its sequence.
    """
    def flat(name: str, expected: np.ndarray) -> pa.Array:
        column = table[name].combine_chunks()
        lengths = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        if not np.array_equal(lengths, expected):
            bad = int(np.flatnonzero(lengths != expected)[0])
            raise ValueError(f"{name} row {bad} has {lengths[bad]} elements, expected {expected[bad]} (sequences/schema.py)")
        return pc.list_flatten(column)

    seq_values[TIME_BUCKETS_KEY] = time_buckets(flat("seq_time_delta_ms", seq_length).to_numpy(zero_copy_only=False))
    same_length = pc.list_value_length(table[SAME_DOMAIN_KEYS[0]].combine_chunks()).fill_null(0).to_numpy(
        zero_copy_only=False).astype(np.int64)
    for key, history_key in zip(SAME_DOMAIN_KEYS[:3], SEQUENCE_KEYS, strict=True):
        seq_values[key] = rows(flat(key, same_length), history_key)  # the history's id column: same rows
    deltas = (flat("seq_same_domain_time_delta_ms", same_length).to_numpy(zero_copy_only=False)
              if "seq_same_domain_time_delta_ms" in table.schema.names else np.full(int(same_length.sum()), np.nan))
    seq_values[SAME_DOMAIN_KEYS[3]] = time_buckets(deltas)
    offsets = np.zeros(len(same_length) + 1, dtype=np.int64)
    np.cumsum(same_length, out=offsets[1:])
    return offsets


def _gather_index(offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions of ``rows``' elements in the flat values, in row order; (B,) lengths) for jagged ``offsets``."""
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    # Element j of the gathered values comes from position starts[row] + (j - first j of that row).
    gather = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths) + np.arange(lengths.sum())
    return gather, lengths


def make_batch(data: EncodedExamples, rows: np.ndarray) -> Batch:
    """Gather ``rows`` (B,) int64 of ``data`` into a :class:`Batch` without padding."""
    rows = np.asarray(rows, dtype=np.int64)
    gather, lengths = _gather_index(data.seq_offsets, rows)
    keys, values, all_lengths = list(SEQUENCE_KEYS), [data.seq_values[k][gather] for k in SEQUENCE_KEYS], [lengths] * len(SEQUENCE_KEYS)
    if data.same_domain_offsets is not None:
        same_gather, same_lengths = _gather_index(data.same_domain_offsets, rows)
        keys += SEQUENCE_EXTRA_KEYS
        values += [data.seq_values[TIME_BUCKETS_KEY][gather], *(data.seq_values[k][same_gather] for k in SAME_DOMAIN_KEYS)]
        all_lengths += [lengths] + [same_lengths] * len(SAME_DOMAIN_KEYS)
    sparse_ids = data.sparse_ids[rows]
    sparse = KeyedJaggedTensor(
        keys=list(SPARSE_FEATURES),
        values=torch.from_numpy(np.ascontiguousarray(sparse_ids.T).reshape(-1)),
        lengths=torch.ones(len(SPARSE_FEATURES) * len(rows), dtype=torch.int64),
    )
    sequence = KeyedJaggedTensor(
        keys=keys, values=torch.from_numpy(np.concatenate(values)), lengths=torch.from_numpy(np.concatenate(all_lengths)),
    )
    return Batch(
        sparse=sparse,
        sequence=sequence,
        dense=torch.from_numpy(data.dense[rows]),
        labels=torch.from_numpy(data.labels[rows]),
        domains=[str(d) for d in data.domains[rows]],
        delayed=None if data.delayed is None else to_torch(data.delayed.take(rows)),
        final=None if data.final is None else torch.from_numpy(data.final[rows]),
    )


def take_rows(data: EncodedExamples, rows: np.ndarray) -> EncodedExamples:
    """The rows ``rows`` (K,) int64 of ``data``, in that order: what :func:`encode_examples` gives for those rows of
    its table (every column is encoded row by row; jagged values are gathered and their offsets rebuilt), so a
    version encoded once serves both its progressive evaluation (a subset) and its training (all rows)."""
    rows = np.asarray(rows, dtype=np.int64)

    def offsets_of(lengths: np.ndarray) -> np.ndarray:
        out = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=out[1:])
        return out

    gather, lengths = _gather_index(data.seq_offsets, rows)
    same_offsets, same_gather = None, None
    if data.same_domain_offsets is not None:
        same_gather, same_lengths = _gather_index(data.same_domain_offsets, rows)
        same_offsets = offsets_of(same_lengths)
    # TIME_BUCKETS_KEY is aligned with the history; SAME_DOMAIN_KEYS with the same-domain offsets.
    seq_values = {key: values[same_gather if key in SAME_DOMAIN_KEYS and same_gather is not None else gather]
                  for key, values in data.seq_values.items()}
    return EncodedExamples(
        sparse_ids=data.sparse_ids[rows], seq_values=seq_values, seq_offsets=offsets_of(lengths),
        dense=data.dense[rows], labels=data.labels[rows], domains=data.domains[rows],
        delayed=None if data.delayed is None else data.delayed.take(rows),
        final=None if data.final is None else data.final[rows], same_domain_offsets=same_offsets)


def iter_batches(data: EncodedExamples, batch_size: int, rng: np.random.Generator | None = None):
    """Yield batches of ``batch_size`` (the last may be smaller); shuffled by ``rng`` when given."""
    order = np.arange(len(data)) if rng is None else rng.permutation(len(data))
    for start in range(0, len(order), batch_size):
        yield make_batch(data, order[start : start + batch_size])


def num_batches(data: EncodedExamples, batch_size: int) -> int:
    """ceil(N / batch_size)."""
    return -(-len(data) // batch_size)
