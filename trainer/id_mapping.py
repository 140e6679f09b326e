"""String ids -> embedding rows: hashed (collisions allowed) or managed (each frequent id its own row).

Shape letters: N ids in a column, U distinct ids among them.

Every id column belongs to a *namespace* (:data:`trainer.data.HASH_NAMESPACE`: ``item_id`` and
``seq_item_ids`` share ``item``), and every table of a feature of one namespace has the namespace's
rows, so a candidate and its history stay in one id space. Two modes (``trainer.ids.mapping``):

- ``hash``: blake2b modulo ``trainer.num_embeddings`` (:func:`trainer.data.hash_ids`). Distinct ids
  may share a row and nothing says so; this mapping only records the ids it saw, to count that.
- ``managed``: a vocabulary per namespace, Monolith's collisionless table with its occurrence filter
  (Liu et al. 2022, "Monolith: Real Time Recommendation System With Collisionless Embedding Table",
  arXiv 2209.07663, §2.1-2.2). An id seen at least ``min_count`` times in the training data gets
  the next free row and keeps it for good (across continuous increments and resumes: the
  vocabulary is saved with each checkpoint); a rarer id shares the namespace's OOV row until it
  has been seen often enough. Rows are handed out as ids qualify, up to the rows allocated for the
  namespace; once they are all taken, new ids stay on the OOV row and a warning says so.

Rows of every namespace (both modes)::

    row 0            null or "" id
    row 1            OOV: managed ids not (yet) admitted; unused by hash
    rows 2..R-1      managed: one admitted id each, in order of admission
    rows 1..R-1      hash: blake2b(id) % (R - 1) + 1, R = trainer.num_embeddings

Rows per namespace (managed), fixed when a run starts (TorchRec tables do not grow), the rule::

    R = min(trainer.num_embeddings, max(min_rows, 2 + ceil(headroom * U_k)))

with U_k the distinct ids of the namespace seen at least ``min_count`` times in the data a run starts
with (the train split of a one-shot run; every examples version a new continuous run can consume when it
starts: its first version alone can be a handful of rows), so a small namespace
(gender, event type) gets a small table and a large one room to grow by ``headroom``, never more
than the hashed table it replaces. ``trainer.ids.table_rows`` pins R per namespace instead.

Widths per namespace (``trainer.ids.widths = "cardinality"``, both modes), fixed when a run starts too::

    W = clip(round(width_factor * U ** 0.25), min_width, trainer.embedding_dim)

with U the namespace's distinct ids in the data the run is sized by (managed: those seen ``min_count`` times;
hash: all), the rule of the Deep & Cross Network (Wang et al. 2017, arXiv 1708.05123, §4.2: "6 x (category
cardinality)^1/4"), capped at the models' common width D: the models zero-pad a narrower row to D
(trainer.models.towers.pad_width), a fixed projection of Ginart et al.'s mixed-dimension embeddings (arXiv
1909.11810, §3), so the interactions still see D-wide vectors. ``trainer.ids.table_widths`` pins W per
namespace. With ``widths = "fixed"`` every table is D wide (width 0 in the stats: "the config's D").

Only the training data is counted (:meth:`IdMapping.observe`); evaluation looks ids up without
counting them (:meth:`IdMapping.lookup`), so a progressive evaluation sees the mapping the model was
trained with. Pointer-layout examples (build.examples_layout) hold no history lists: a managed run counts
them with their lists rebuilt from the history table (:func:`trainer.data.with_history_ids`), as a fat run
counts its rows, so both layouts admit the same ids; a hashed run's statistics count only the columns the
rows hold (rebuilding the lists for statistics alone would cost every read a second history index). Pending
counts are kept exactly (a dict) where Monolith uses a counting Bloom filter: memory grows with the distinct
rare ids (about 60 bytes each).

Collision statistics per namespace (:meth:`IdMapping.stats`), over every distinct id observed:
``collision_share`` is the share of distinct ids whose row holds another distinct id too (hash: a
shared bucket; managed: the OOV row, when two or more ids are there), ``oov_share`` the share on
the OOV row.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gemline.errors import BadConfigError
from trainer.config import IdsConfig, TrainerConfig
from trainer.data import HASH_NAMESPACE, hash_ids

log = logging.getLogger(__name__)

NULL_ROW = 0
"""Row of a null or empty id (both modes)."""
OOV_ROW = 1
"""Managed: the shared row of ids seen fewer than ``min_count`` times (or arriving once the table is full)."""
FIRST_ID_ROW = 2
"""Managed: the first row an admitted id can get."""

Mode = Literal["hash", "managed"]


@dataclass
class Vocabulary:
    """The rows of one namespace.

    Attributes:
        rows: R, table rows (rows 0 and 1 reserved, see the module docstring).
        width: W, table width (0: trainer.embedding_dim, the fixed rule).
        assigned: id -> row; managed: admitted ids, rows 2.. in order of admission; hash: every id
            observed with its hashed row (kept to count collisions).
        pending: managed: id -> times seen, for ids observed but without their own row; hash: empty.
        full_warned: a warning that the table is full was logged (not saved).
    """

    rows: int
    width: int = 0
    assigned: dict[str, int] = field(default_factory=dict)
    pending: dict[str, int] = field(default_factory=dict)
    full_warned: bool = False

    def stats(self) -> dict[str, float | int]:
        """``distinct_ids``, ``rows`` (R), ``width`` (W, 0: the config's D), ``rows_used``, ``colliding_ids``, ``collision_share``, ``oov_ids``,
        ``oov_share`` (shares of distinct ids, 0.0 when none was seen)."""
        per_row = Counter(self.assigned.values())
        oov = len(self.pending)
        colliding = sum(n for n in per_row.values() if n > 1) + (oov if oov > 1 else 0)
        distinct = len(self.assigned) + oov
        return {"distinct_ids": distinct, "rows": self.rows, "width": self.width, "rows_used": len(per_row) + (1 if oov else 0),
                "colliding_ids": colliding, "collision_share": colliding / distinct if distinct else 0.0,
                "oov_ids": oov, "oov_share": oov / distinct if distinct else 0.0}


def _strings(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One string array; a list column is flattened. Raises TypeError for any other type."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks() if values.num_chunks else pa.array([], values.type)
    if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        values = pc.list_flatten(values)
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        raise TypeError(f"id columns must be strings or lists of strings, got {values.type}; cast the column first")
    return values


class IdMapping:
    """Per-namespace id -> row mapping of one training run (module docstring).

    Args:
        mode: "hash" or "managed".
        rows: namespace -> R (table rows).
        min_count: managed: occurrences an id needs for its own row (>= 1).
        columns: column -> namespace of every id column mapped (:data:`trainer.data.HASH_NAMESPACE`).
        widths: namespace -> W (table width); a namespace left out: 0, the config's D.

    Raises:
        BadConfigError: a column whose namespace has no rows, R < 2 (managed: < 3), or ``min_count`` < 1.
    """

    def __init__(self, mode: Mode, rows: Mapping[str, int], *, min_count: int, columns: Mapping[str, str],
                 widths: Mapping[str, int] | None = None) -> None:
        if mode not in ("hash", "managed"):
            raise BadConfigError(f"trainer.ids.mapping must be 'hash' or 'managed', got {mode!r}")
        if min_count < 1:
            raise BadConfigError(f"trainer.ids.min_count must be >= 1, got {min_count}")
        least = FIRST_ID_ROW + 1 if mode == "managed" else 2
        missing = sorted(set(columns.values()) - set(rows))
        small = {ns: r for ns, r in rows.items() if r < least}
        if missing or small:
            raise BadConfigError(f"id mapping: every namespace needs >= {least} rows; missing {missing}, too small {small}")
        self.mode: Mode = mode
        self.min_count = min_count
        self.columns = dict(columns)
        self.vocabularies = {ns: Vocabulary(int(r), int((widths or {}).get(ns, 0))) for ns, r in rows.items()}

    @classmethod
    def sized(cls, config: IdsConfig, num_embeddings: int, first: pa.Table, columns: Mapping[str, str],
              embedding_dim: int = 0) -> IdMapping:
        """A fresh mapping whose rows (managed) and widths (``config.widths = "cardinality"``, capped at
        ``embedding_dim``) follow the rules of the module docstring on ``first`` (the data the run is sized by),
        or ``config.table_rows`` / ``table_widths`` where they name a namespace; hash mode: ``num_embeddings``
        rows everywhere.

        Raises:
            BadConfigError: ``config.table_rows`` or ``table_widths`` names a namespace no column has; cardinality
                widths without ``embedding_dim``; as :class:`IdMapping`.
        """
        namespaces = sorted(set(columns.values()))
        pinned, pinned_widths = config.pinned_rows(), config.pinned_widths()
        unknown = sorted((set(pinned) | set(pinned_widths)) - set(namespaces))
        if unknown:
            raise BadConfigError(f"trainer.ids.table_rows / table_widths name namespaces {unknown}; known: {namespaces}")
        counts = _count(first, columns) if config.sized_by_counts else {}
        least = config.min_count if config.mapping == "managed" else 1
        distinct = {ns: sum(1 for n in counts.get(ns, {}).values() if n >= least) for ns in namespaces}
        widths = dict(pinned_widths)
        if config.widths == "cardinality":
            if embedding_dim < 1:
                raise BadConfigError("cardinality widths need the models' embedding_dim (trainer.embedding_dim)")
            for ns in namespaces:
                widths.setdefault(ns, cardinality_width(distinct[ns], factor=config.width_factor,
                                                        least=config.min_width, most=embedding_dim))
        if config.mapping == "hash":
            return cls("hash", dict.fromkeys(namespaces, num_embeddings), min_count=config.min_count, columns=columns,
                       widths=widths)
        rows = {}
        for ns in namespaces:
            rule = max(config.min_rows, FIRST_ID_ROW + math.ceil(config.headroom * distinct[ns]))
            rows[ns] = pinned.get(ns, min(num_embeddings, rule))
        return cls("managed", rows, min_count=config.min_count, columns=columns, widths=widths)

    def table_widths(self) -> dict[str, int]:
        """Column -> W of its namespace (0: the config's D)."""
        return {column: self.vocabularies[ns].width for column, ns in self.columns.items()}

    def table_rows(self) -> dict[str, int]:
        """Column -> R of its namespace: the rows of each embedding table (trainer.models.towers)."""
        return {column: self.vocabularies[ns].rows for column, ns in self.columns.items()}

    def observe(self, table: pa.Table) -> None:
        """Count the ids of ``table``'s id columns (training data only) and give each managed id that reaches
        ``min_count`` the next free row; ids admitted by one call get rows in lexicographic order, so the
        mapping depends only on the sequence of tables observed."""
        for ns, counts in _count(table, self.columns).items():
            vocab = self.vocabularies[ns]
            if self.mode == "hash":
                new = sorted(s for s in counts if s not in vocab.assigned)
                hashed = hash_ids(pa.array(new, pa.string()), vocab.rows, ns)
                vocab.assigned.update(zip(new, hashed.tolist(), strict=True))
                continue
            admitted = []
            for s, n in counts.items():
                if s in vocab.assigned:
                    continue
                seen = vocab.pending.get(s, 0) + n
                if seen >= self.min_count:
                    admitted.append(s)
                vocab.pending[s] = seen
            for s in sorted(admitted):
                row = FIRST_ID_ROW + len(vocab.assigned)
                if row >= vocab.rows:
                    if not vocab.full_warned:
                        log.warning("id namespace %r: all %d rows are taken; further ids share the OOV row "
                                    "(raise trainer.ids.headroom or pin trainer.ids.table_rows)", ns, vocab.rows)
                        vocab.full_warned = True
                    break
                vocab.assigned[s] = row
                del vocab.pending[s]

    def lookup(self, values: pa.Array | pa.ChunkedArray, column: str) -> np.ndarray:
        """(N,) int64 rows of ``values`` (strings, or a list column flattened) of id column ``column``; counts
        nothing. Null and "" give row 0; managed ids without a row give row 1.

        Raises:
            KeyError: ``column`` is not an id column of this mapping.
            TypeError: ``values`` holds no strings.
        """
        ns = self.columns[column]
        vocab = self.vocabularies[ns]
        values = _strings(values)
        if self.mode == "hash":
            return hash_ids(values, vocab.rows, ns)
        encoded = values.dictionary_encode()
        known = vocab.assigned
        rows = np.fromiter((NULL_ROW if not s else known.get(s, OOV_ROW) for s in encoded.dictionary.to_pylist()),
                           dtype=np.int64, count=len(encoded.dictionary))
        out = np.full(len(values), NULL_ROW, dtype=np.int64)
        valid = ~np.asarray(encoded.indices.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        out[valid] = rows[encoded.indices.to_numpy(zero_copy_only=False)[valid].astype(np.int64)]
        return out

    def stats(self) -> dict[str, dict[str, float | int]]:
        """Namespace -> :meth:`Vocabulary.stats` over every id observed so far."""
        return {ns: vocab.stats() for ns, vocab in sorted(self.vocabularies.items())}

    def to_bytes(self) -> bytes:
        """JSON of the whole state (mode, min_count, columns, every vocabulary), saved with checkpoints."""
        state = {"mode": self.mode, "min_count": self.min_count, "columns": self.columns,
                 "vocabularies": {ns: {"rows": v.rows, "width": v.width, "assigned": v.assigned, "pending": v.pending}
                                  for ns, v in self.vocabularies.items()}}
        return json.dumps(state, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, payload: bytes) -> IdMapping:
        """Inverse of :meth:`to_bytes`. Raises ValueError on a payload that is not one."""
        try:
            state: dict[str, Any] = json.loads(payload)
            # "width" is absent from mappings saved before trainer.ids.widths: those tables were D wide.
            mapping = cls(state["mode"], {ns: v["rows"] for ns, v in state["vocabularies"].items()},
                          min_count=state["min_count"], columns=state["columns"],
                          widths={ns: v.get("width", 0) for ns, v in state["vocabularies"].items()})
            for ns, v in state["vocabularies"].items():
                mapping.vocabularies[ns].assigned = {str(k): int(r) for k, r in v["assigned"].items()}
                mapping.vocabularies[ns].pending = {str(k): int(n) for k, n in v["pending"].items()}
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a saved id mapping ({exc!r}); was the checkpoint written by this trainer?") from exc
        return mapping


def _count(table: pa.Table, columns: Mapping[str, str]) -> dict[str, dict[str, int]]:
    """Namespace -> {id: occurrences} over the id columns of ``table`` it holds (null and "" left out)."""
    by_ns: dict[str, list[pa.Array]] = {}
    for column, ns in columns.items():
        if column in table.schema.names:
            by_ns.setdefault(ns, []).append(_strings(table[column]).cast(pa.string()))
    out: dict[str, dict[str, int]] = {}
    for ns, arrays in by_ns.items():
        counts = pc.value_counts(pa.chunked_array(arrays, pa.string()).combine_chunks())
        ids: Iterable[Any] = counts.field("values").to_pylist()
        out[ns] = {s: int(n) for s, n in zip(ids, counts.field("counts").to_pylist(), strict=True) if s}
    return out


def cardinality_width(distinct: int, *, factor: float = 6.0, least: int = 2, most: int) -> int:
    """Embedding width of a namespace of ``distinct`` ids: ``round(factor * distinct ** 0.25)`` clipped to
    [least, most] (Wang et al. 2017, "Deep & Cross Network for Ad Click Predictions", arXiv 1708.05123, §4.2).

    E.g. 2 ids -> 7, 19 genres -> 13, 1,682 movies -> 38 (before the clip). Raises ValueError when least > most.
    """
    if least > most:
        raise ValueError(f"min width {least} > max width {most}")
    return min(most, max(least, round(factor * max(distinct, 0) ** 0.25)))


def table_widths(tc: TrainerConfig) -> int | dict[str, int]:
    """Widths of the id tables of a model built from ``tc`` (trainer.models.towers.TableWidths): fixed,
    ``trainer.embedding_dim`` for every table; else per id column, its namespace's pinned width
    (``trainer.ids.table_widths``, which the trainer sets from the run's mapping) or ``embedding_dim``."""
    pinned = tc.ids.pinned_widths()
    if not pinned:
        return tc.embedding_dim
    return {column: pinned.get(ns, tc.embedding_dim) or tc.embedding_dim for column, ns in HASH_NAMESPACE.items()}


def table_rows(tc: TrainerConfig) -> int | dict[str, int]:
    """Rows of the id tables of a model built from ``tc`` (trainer.models.towers.TableRows): hash mode
    ``trainer.num_embeddings`` for every table; managed, per id column, its namespace's pinned rows
    (``trainer.ids.table_rows``, which the trainer sets from the run's mapping) or ``num_embeddings``."""
    if tc.ids.mapping == "hash":
        return tc.num_embeddings
    pinned = tc.ids.pinned_rows()
    return {column: pinned.get(ns, tc.num_embeddings) for column, ns in HASH_NAMESPACE.items()}


def with_rows(tc: TrainerConfig, mapping: IdMapping) -> TrainerConfig:
    """``tc`` whose models get ``mapping``'s table rows and widths (a copy; managed mode pins every namespace's
    rows, a mapping with widths every namespace's width)."""
    if mapping.mode != tc.ids.mapping:
        raise BadConfigError(f"the run's id mapping is {mapping.mode!r} but trainer.ids.mapping={tc.ids.mapping!r}: "
                             "resume with the same mapping, or start a new run")
    vocabularies = sorted(mapping.vocabularies.items())
    if any(v.width for _, v in vocabularies):
        widths = tuple(f"{ns}={v.width or tc.embedding_dim}" for ns, v in vocabularies)
        tc = replace(tc, ids=replace(tc.ids, table_widths=widths))
    if mapping.mode == "hash":
        return tc
    pinned = tuple(f"{ns}={v.rows}" for ns, v in vocabularies)
    return replace(tc, ids=replace(tc.ids, table_rows=pinned))


MAPPING_FILE = "id_mapping.json"
"""The mapping's file in a checkpoint's ``step-N/`` folder (:meth:`IdMapping.to_bytes`)."""


def start_mapping(tc: TrainerConfig, first: pa.Table, resume_from: str | Path | None) -> IdMapping:
    """The run's mapping: the one saved in checkpoint ``resume_from`` (exact resume), else a fresh one sized on
    ``first`` (:meth:`IdMapping.sized`; nothing observed yet).

    Raises:
        BadConfigError: the checkpoint's mapping has another mode than ``tc``, or a managed run resumes from a
            checkpoint without one (written before trainer.ids).
    """
    if resume_from is not None:
        saved = Path(resume_from) / MAPPING_FILE
        if saved.is_file():
            mapping = IdMapping.from_bytes(saved.read_bytes())
            with_rows(tc, mapping)  # raises on a mode change
            return mapping
        if tc.ids.mapping == "managed":
            raise BadConfigError(f"checkpoint {resume_from} has no {MAPPING_FILE} (its ids were hashed): resume with "
                                 "trainer.ids.mapping=hash, or start a new run")
        log.info("checkpoint %s has no %s: collision counts start at this run", resume_from, MAPPING_FILE)
    return IdMapping.sized(tc.ids, tc.num_embeddings, first, HASH_NAMESPACE, tc.embedding_dim)


def stats_rows(mapping: IdMapping) -> list[dict[str, Any]]:
    """One dict per namespace: ``namespace``, ``mode`` and :meth:`Vocabulary.stats` (for reports and logs)."""
    return [{"namespace": ns, "mode": mapping.mode, **s} for ns, s in mapping.stats().items()]
