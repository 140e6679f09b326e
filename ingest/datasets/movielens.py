"""MovieLens-100K ratings mapped onto the Event schema.

Source: the copy of ml-100k (F. M. Harper, J. A. Konstan, "The MovieLens Datasets: History and
Context", ACM TiiS 2015) bundled in the ``recbole==1.2.1`` wheel as
``recbole/dataset_example/ml-100k/ml-100k.{inter,user,item}``: tab-separated, one typed header
line (``user_id:token  item_id:token  rating:float  timestamp:float``). GroupLens terms forbid
redistribution: the files live only in the local cache, never in the repository.

Mapping, one rating row ``(user, item, rating, t)`` with t in unix seconds:

* an ``impression`` at ``t * 1000`` ms: the user was shown the movie;
* also a ``click`` at the same time if ``rating >= 4``;
* also a ``conversion`` at the same time if ``rating == 5``.

``domain`` = ``"movielens"``; ``category`` = the first genre of the movie's ``class`` (None if
the movie is unknown or has no genre); ``age``, ``gender`` (``M``/``F``) and ``location`` (zip
code) from the user file (None if the user is unknown); ``position`` and ``ad_format`` None.
``event_id`` = ``ml100k:<user>:<item>:<t>:<event_type>`` (a user rates a movie once).

A rating row that cannot be parsed becomes one :class:`RawRecord`: the JSON of the fields that
could be read, or the raw line if it does not even have the four columns.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from ingest.datasets.pypi import fetch_files, resolve_cache_dir
from ingest.datasets.types import RawRecord, Record, flatten, parse_int, partial_record
from ingest.schema import Event

DOMAIN = "movielens"
WHEEL_REQUIREMENT = "recbole==1.2.1"
_MEMBER_DIR = "recbole/dataset_example/ml-100k"
FILES: dict[str, str] = {f"ml-100k.{ext}": f"{_MEMBER_DIR}/ml-100k.{ext}" for ext in ("inter", "user", "item")}
"""Cache file name -> member path in the recbole wheel."""

INTER_HEADER = ["user_id:token", "item_id:token", "rating:float", "timestamp:float"]
USER_HEADER = ["user_id:token", "age:token", "gender:token", "occupation:token", "zip_code:token"]
ITEM_HEADER = ["item_id:token", "movie_title:token_seq", "release_year:token", "class:token_seq"]


def fetch(cache_dir: str | os.PathLike | None = None) -> Path:
    """Ensure the three ml-100k files are in ``cache_dir`` (default ``~/.cache/gemline/ml-100k``).

    Downloads the recbole wheel from PyPI only when a file is missing.

    Raises:
        RuntimeError: the download failed.
    """
    directory = resolve_cache_dir(cache_dir, "ml-100k")
    return fetch_files(["--no-deps", WHEEL_REQUIREMENT], FILES, directory)


def _read_table(path: Path, header: list[str]) -> list[list[str]]:
    """The tab-separated rows of a recbole atomic file, after checking its typed header."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines or lines[0].split("\t") != header:
        got = lines[0].split("\t") if lines else "an empty file"
        raise ValueError(f"{path}: expected header {header}, got {got}; delete the cache and re-fetch")
    return [line.split("\t") for line in lines[1:] if line]


def load_users(path: Path) -> dict[str, tuple[int | None, str | None, str | None]]:
    """user_id -> (age in years, gender, zip code) from ``ml-100k.user``."""
    users = {}
    for row in _read_table(path, USER_HEADER):
        if len(row) != len(USER_HEADER):
            continue  # a malformed side row only loses context; the rating itself still maps
        user_id, age, gender, _occupation, zip_code = row
        users[user_id] = (int(age) if age.isdigit() else None, gender or None, zip_code or None)
    return users


def load_categories(path: Path) -> dict[str, str | None]:
    """item_id -> first genre of the movie's ``class`` (None when it lists none)."""
    categories: dict[str, str | None] = {}
    for row in _read_table(path, ITEM_HEADER):
        if len(row) != len(ITEM_HEADER):
            continue
        genres = row[3].split()
        categories[row[0]] = genres[0] if genres else None
    return categories


def event_types_for(rating: float) -> tuple[str, ...]:
    """The event types a rating maps to: impression, + click if >= 4, + conversion if == 5."""
    types = ["impression"]
    if rating >= 4:
        types.append("click")
    if rating == 5:
        types.append("conversion")
    return tuple(types)


def map_rating(
    fields: list[str],
    users: dict[str, tuple[int | None, str | None, str | None]],
    categories: dict[str, str | None],
) -> list[Record]:
    """Map one rating row (already split on tabs) to its Events, or to one RawRecord."""
    if len(fields) != len(INTER_HEADER):
        key = fields[0] if fields and fields[0] else None
        return [RawRecord(value="\t".join(fields).encode(), key=(key or "").encode(),
                          reason_hint=f"expected {len(INTER_HEADER)} tab-separated columns, got {len(fields)}")]
    user_id, item_id, rating_text, ts_text = fields
    try:
        rating = float(rating_text)
        ts_s = parse_int(ts_text, "timestamp")
    except ValueError as err:
        readable = {"user_id": user_id, "item_id": item_id, "domain": DOMAIN}
        return [partial_record(readable, key=user_id, reason_hint=str(err))]
    age, gender, location = users.get(user_id, (None, None, None))
    return [
        Event(
            event_id=f"ml100k:{user_id}:{item_id}:{ts_s}:{event_type}",
            event_time_ms=ts_s * 1000,
            user_id=user_id,
            item_id=item_id,
            domain=DOMAIN,
            event_type=event_type,
            category=categories.get(item_id),
            age=age,
            gender=gender,
            location=location,
        )
        for event_type in event_types_for(rating)
    ]


def read_rows(*, path: str | None = None, cache_dir: str | os.PathLike | None = None) -> Iterator[list[Record]]:
    """The records of each rating row, in file order (fetching the files on first use).

    Args:
        path: must be None (the data comes from the cache); present for the registry's signature.
        cache_dir: cache directory, default ``~/.cache/gemline/ml-100k``.

    Raises:
        ValueError: ``path`` was given, or a cached file has an unexpected header.
        RuntimeError: the download failed.
    """
    if path is not None:
        raise ValueError(f"movielens reads from its cache, not a path (got path={path!r}); pass cache_dir instead")
    directory = fetch(cache_dir)
    users = load_users(directory / "ml-100k.user")
    categories = load_categories(directory / "ml-100k.item")
    inter = directory / "ml-100k.inter"
    with inter.open(encoding="utf-8") as handle:
        header = handle.readline().rstrip("\n").split("\t")
        if header != INTER_HEADER:
            raise ValueError(f"{inter}: expected header {INTER_HEADER}, got {header}; delete the cache and re-fetch")
        for line in handle:
            line = line.rstrip("\n")
            if line:
                yield map_rating(line.split("\t"), users, categories)


def iter_records(*, cache_dir: str | os.PathLike | None = None) -> Iterator[Record]:
    """All MovieLens-100K records in file order (see the module docstring for the mapping)."""
    return flatten(read_rows(cache_dir=cache_dir))
