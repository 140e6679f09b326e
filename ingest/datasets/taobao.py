"""Taobao UserBehavior logs mapped onto the Event schema.

Source: Alibaba's UserBehavior dataset (Zhu et al., "Learning Tree-based Deep Model for
Recommender Systems", KDD 2018, Tianchi dataset 649): a headerless CSV of
``user_id,item_id,category_id,behavior_type,timestamp`` with the timestamp in unix seconds.

Mapping of one line:

* ``behavior_type``: ``pv`` -> ``impression``, ``cart`` -> ``click``, ``fav`` -> ``engagement``,
  ``buy`` -> ``conversion``;
* ``event_time_ms`` = timestamp * 1000; ``domain`` = ``"taobao"``; ``category`` = category_id;
  position, ad_format, age, gender and location are None (the log has none of them);
* ``event_id`` = ``taobao:<user>:<item>:<timestamp>:<event_type>``; an exact repeat of an earlier
  line gets ``#<n>`` appended (n = 1, 2, ...), so ids stay unique and deterministic while the
  repeat itself is kept (it is in the source).

A line with the wrong number of fields, an unknown behavior or a non-integer timestamp becomes a
:class:`RawRecord` holding the JSON of the fields that could be read (a truncated line thus
reaches the ingest job as one ``missing_field`` dead-letter row). A line that is not UTF-8 is
passed on as its raw bytes.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

from gemline.errors import BadConfigError, MissingInputError
from ingest.datasets.types import RawRecord, Record, flatten, parse_int, partial_record
from ingest.schema import Event

DOMAIN = "taobao"
COLUMNS: tuple[str, ...] = ("user_id", "item_id", "category_id", "behavior_type", "timestamp")
BEHAVIOR_TO_EVENT_TYPE: dict[str, str] = {
    "pv": "impression",
    "cart": "click",
    "fav": "engagement",
    "buy": "conversion",
}


def _readable_fields(values: dict[str, str]) -> dict[str, Any]:
    """The Event fields that can be read from a partial line's named columns."""
    fields: dict[str, Any] = {"domain": DOMAIN}
    for column, field in (("user_id", "user_id"), ("item_id", "item_id"), ("category_id", "category")):
        if values.get(column):
            fields[field] = values[column]
    behavior = values.get("behavior_type")
    if behavior in BEHAVIOR_TO_EVENT_TYPE:
        fields["event_type"] = BEHAVIOR_TO_EVENT_TYPE[behavior]
    timestamp = values.get("timestamp")
    if timestamp is not None:
        try:
            fields["event_time_ms"] = parse_int(timestamp, "timestamp") * 1000
        except ValueError:
            pass  # left out: the ingest validator reports it missing
    return fields


def map_line(line: str, seen: Counter[str]) -> Record:
    """Map one CSV line (no newline) to an Event or a RawRecord.

    Args:
        line: the text of the line.
        seen: counts of base event ids met so far in this file; updated (repeat numbering).
    """
    parts = line.split(",")
    values = dict(zip(COLUMNS, parts))
    if len(parts) != len(COLUMNS):
        return partial_record(_readable_fields(values), key=values.get("user_id"),
                              reason_hint=f"expected {len(COLUMNS)} comma-separated fields, got {len(parts)}")
    user_id, item_id, category_id, behavior, ts_text = parts
    event_type = BEHAVIOR_TO_EVENT_TYPE.get(behavior)
    if event_type is None:
        return partial_record(_readable_fields(values), key=user_id,
                              reason_hint=f"behavior_type: expected one of {sorted(BEHAVIOR_TO_EVENT_TYPE)}, got {behavior!r}")
    try:
        ts_s = parse_int(ts_text, "timestamp")
    except ValueError as err:
        return partial_record(_readable_fields(values), key=user_id, reason_hint=str(err))
    base_id = f"taobao:{user_id}:{item_id}:{ts_s}:{event_type}"
    repeat = seen[base_id]
    seen[base_id] += 1
    return Event(
        event_id=base_id if repeat == 0 else f"{base_id}#{repeat}",
        event_time_ms=ts_s * 1000,
        user_id=user_id,
        item_id=item_id,
        domain=DOMAIN,
        event_type=event_type,
        category=category_id or None,
    )


def read_rows(*, path: str | os.PathLike | None, cache_dir: str | None = None) -> Iterator[list[Record]]:
    """One single-record list per line of the CSV at ``path``, in file order.

    Raises:
        BadConfigError: ``path`` is None, or ``cache_dir`` is given (this dataset is read from a path).
        MissingInputError: no file at ``path``.
    """
    if path is None:
        raise BadConfigError("taobao needs the path of the UserBehavior CSV (--path, e.g. UserBehavior_sample.csv)")
    if cache_dir is not None:
        raise BadConfigError(f"taobao reads the file at path, not a cache (got cache_dir={cache_dir!r})")
    csv_path = Path(path)
    if not csv_path.is_file():
        raise MissingInputError(f"taobao: no file at {csv_path}; pass the path of UserBehavior.csv or its sample")
    seen: Counter[str] = Counter()
    with csv_path.open("rb") as handle:
        for raw in handle:
            raw = raw.rstrip(b"\r\n")
            if not raw:
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield [RawRecord(value=raw, key=b"", reason_hint="line is not UTF-8")]
                continue
            yield [map_line(line, seen)]


def iter_records(path: str | os.PathLike) -> Iterator[Record]:
    """All records of the UserBehavior CSV at ``path`` in file order (mapping: module docstring)."""
    return flatten(read_rows(path=path))
