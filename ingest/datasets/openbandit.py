"""Open Bandit Dataset (small sample) logged rounds mapped onto the Event schema.

Source: Saito et al., "Open Bandit Dataset and Pipeline: Towards Realistic and Reproducible
Off-Policy Evaluation", NeurIPS 2021 Datasets track: logs of ZOZOTOWN's fashion recommendation
widget under two behaviour policies (``random`` and Bernoulli Thompson sampling ``bts``) in three
campaigns (``all``, ``men``, ``women``). The 10,000-row-per-file sample ships in the
``obp==0.5.7`` sdist as ``obp/dataset/obd/<policy>/<campaign>/<campaign>.csv`` with
``item_context.csv`` beside it; columns: an unnamed row index, ``timestamp`` (ISO 8601, UTC),
``item_id``, ``position`` (slot 1..3), ``click`` (0/1), ``propensity_score``,
``user_feature_0..3`` (hashed categorical), ``user-item_affinity_*``.

Mapping of one logged round (row ``r`` of campaign ``c`` under policy ``p``):

* an ``impression`` at the round's timestamp (truncated to ms), plus a ``click`` at the same time
  if ``click == 1``;
* ``domain`` = ``obd_<c>``; ``position`` = the slot;
* ``item_id`` = ``<c>:<item_id>``: each campaign has its own item set (item 14 of ``men`` is not
  item 14 of ``all``);
* ``user_id``: the dataset has no user id. We use a **user-feature cohort**:
  ``obdu:`` + the first 16 hex digits of SHA-1 over ``user_feature_0..3`` joined by ``|``. Users
  with equal features share an id, so "user" sequences here are cohort sequences;
* ``category`` = ``item_feature_1`` of the item in the campaign's ``item_context.csv`` (a hashed
  categorical item attribute; None if the item is absent);
* ad_format, age, gender, location are None;
* ``event_id`` = ``obd:<p>:<c>:<r>:<event_type>``.

Campaigns are read one after another (``all``, ``men``, ``women``), each in file order. A row that
cannot be parsed becomes one :class:`RawRecord` with the JSON of the fields that could be read.
"""

from __future__ import annotations

import csv
import hashlib
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterator, Literal

from ingest.datasets.pypi import fetch_files, resolve_cache_dir
from ingest.datasets.types import Record, flatten, parse_int, partial_record
from ingest.schema import Event

SDIST_REQUIREMENT = "obp==0.5.7"
POLICIES: tuple[str, ...] = ("random", "bts")
CAMPAIGNS: tuple[str, ...] = ("all", "men", "women")
Policy = Literal["random", "bts"]
_MEMBER_ROOT = "obp-0.5.7/obp/dataset/obd"
FILES: dict[str, str] = {
    f"{policy}/{campaign}/{name}": f"{_MEMBER_ROOT}/{policy}/{campaign}/{name}"
    for policy in POLICIES
    for campaign in CAMPAIGNS
    for name in (f"{campaign}.csv", "item_context.csv")
}
"""Cache file name -> member path in the obp sdist."""

USER_FEATURES: tuple[str, ...] = tuple(f"user_feature_{i}" for i in range(4))
CATEGORY_FEATURE = "item_feature_1"
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def fetch(cache_dir: str | os.PathLike | None = None) -> Path:
    """Ensure the sample files of both policies are in ``cache_dir`` (default ``~/.cache/gemline/obd``).

    Downloads the obp sdist from PyPI only when a file is missing.

    Raises:
        RuntimeError: the download failed.
    """
    directory = resolve_cache_dir(cache_dir, "obd")
    pip_args = ["--no-deps", "--ignore-requires-python", "--no-binary", ":all:", SDIST_REQUIREMENT]
    return fetch_files(pip_args, FILES, directory)


def user_cohort_id(features: list[str]) -> str:
    """The derived user id of a user-feature vector: ``obdu:`` + SHA-1 prefix (see module docstring)."""
    digest = hashlib.sha1("|".join(features).encode()).hexdigest()
    return f"obdu:{digest[:16]}"


def parse_time_ms(text: str) -> int:
    """ISO 8601 time with an explicit offset -> ms since epoch UTC (sub-ms truncated).

    Raises:
        ValueError: not ISO 8601, or no UTC offset (a naive time has no defined instant).
    """
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is None:
        raise ValueError(f"timestamp: expected an ISO 8601 time with a UTC offset, got {text!r}")
    return (moment - _EPOCH) // timedelta(milliseconds=1)


def load_categories(path: Path) -> dict[str, str | None]:
    """item_id -> ``item_feature_1`` from an ``item_context.csv``."""
    with path.open(newline="", encoding="utf-8") as handle:
        return {row["item_id"]: row.get(CATEGORY_FEATURE) or None for row in csv.DictReader(handle)}


def map_round(row: dict[str, str], *, policy: str, campaign: str, categories: dict[str, str | None]) -> list[Record]:
    """Map one logged round (a CSV row as a dict) to its impression (+ click), or one RawRecord."""
    domain = f"obd_{campaign}"
    readable: dict[str, Any] = {"domain": domain}
    features = [row.get(name) or "" for name in USER_FEATURES]  # missing and empty alike: no user id
    user_id = user_cohort_id(features) if all(features) else None
    if user_id is not None:
        readable["user_id"] = user_id
    if row.get("item_id"):
        readable["item_id"] = f"{campaign}:{row['item_id']}"
    try:
        if user_id is None or not row.get("item_id"):
            raise ValueError(f"expected item_id and {', '.join(USER_FEATURES)}, some are missing")
        row_index = parse_int(row.get("") or "", "row index")
        time_ms = parse_time_ms(row.get("timestamp") or "")
        position = parse_int(row.get("position") or "", "position")
        click = parse_int(row.get("click") or "", "click")
        if click not in (0, 1):
            raise ValueError(f"click: expected 0 or 1, got {click}")
    except ValueError as err:
        return [partial_record(readable, key=user_id, reason_hint=str(err))]
    event_types = ("impression", "click") if click else ("impression",)
    return [
        Event(
            event_id=f"obd:{policy}:{campaign}:{row_index}:{event_type}",
            event_time_ms=time_ms,
            user_id=user_id,
            item_id=readable["item_id"],
            domain=domain,
            event_type=event_type,
            category=categories.get(row["item_id"]),
            position=position,
        )
        for event_type in event_types
    ]


def read_rows(
    *,
    path: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    policy: Policy = "random",
    campaigns: tuple[str, ...] = CAMPAIGNS,
) -> Iterator[list[Record]]:
    """The records of each logged round, campaign by campaign, in file order.

    Args:
        path: must be None (the data comes from the cache); present for the registry's signature.
        cache_dir: cache directory, default ``~/.cache/gemline/obd``.
        policy: behaviour policy whose logs to read: ``"random"`` or ``"bts"``.
        campaigns: subset of ``("all", "men", "women")``, read in this order.

    Raises:
        ValueError: ``path`` given, unknown policy or campaign.
        RuntimeError: the download failed.
    """
    if path is not None:
        raise ValueError(f"openbandit reads from its cache, not a path (got path={path!r}); pass cache_dir instead")
    if policy not in POLICIES:
        raise ValueError(f"openbandit policy: expected one of {POLICIES}, got {policy!r}")
    unknown = [c for c in campaigns if c not in CAMPAIGNS]
    if unknown:
        raise ValueError(f"openbandit campaigns: expected a subset of {CAMPAIGNS}, got unknown {unknown}")
    directory = fetch(cache_dir)
    for campaign in campaigns:
        categories = load_categories(directory / policy / campaign / "item_context.csv")
        with (directory / policy / campaign / f"{campaign}.csv").open(newline="", encoding="utf-8") as handle:
            for row in csv.DictReader(handle):
                yield map_round(row, policy=policy, campaign=campaign, categories=categories)


def iter_records(
    *, cache_dir: str | os.PathLike | None = None, policy: Policy = "random", campaigns: tuple[str, ...] = CAMPAIGNS
) -> Iterator[Record]:
    """All Open Bandit records of ``policy`` (mapping: module docstring)."""
    return flatten(read_rows(cache_dir=cache_dir, policy=policy, campaigns=campaigns))
