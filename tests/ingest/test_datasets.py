"""Dataset adapters: hand-checked mappings of real lines, counts, ordering, errors.

MovieLens and Open Bandit tests download their PyPI package once per session into a pytest tmp
dir (they need network access to PyPI); the Taobao sample is read from the shared data folder.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import zipfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ingest.datasets import DATASETS, iter_source_rows, load_records, movielens, openbandit, pypi, taobao
from ingest.datasets.types import RawRecord, event_time_sort_key, parse_int, partial_record
from ingest.schema import EVENT_TYPES, Event

TAOBAO_SAMPLE = Path(__file__).resolve().parents[3] / "shared/data/taobao_userbehavior/UserBehavior_sample.csv"
TAOBAO_FULL_LINES = 84_475  # complete lines; the file has one more, truncated, line at the end


@pytest.fixture(scope="session")
def taobao_records() -> list:
    return [r for row in iter_source_rows("taobao", path=TAOBAO_SAMPLE) for r in row]


@pytest.fixture(scope="session")
def ml_cache(tmp_path_factory) -> Path:
    return movielens.fetch(tmp_path_factory.mktemp("ml-100k"))


@pytest.fixture(scope="session")
def ml_rows(ml_cache) -> list:
    return list(iter_source_rows("movielens", cache_dir=ml_cache))


@pytest.fixture(scope="session")
def obd_cache(tmp_path_factory) -> Path:
    return openbandit.fetch(tmp_path_factory.mktemp("obd"))


def _no_download(*args, **kwargs):
    raise AssertionError(f"unexpected download: {args}")


# ---------------------------------------------------------------- Taobao


def test_taobao_hand_checked_lines(taobao_records):
    # File lines 1, 65 (fav), 72 (buy) and 155 (cart) of the sample, mapped by hand.
    by_id = {r.event_id: r for r in taobao_records if isinstance(r, Event)}
    first = by_id["taobao:1:2268318:1511544070:impression"]
    assert first == Event(event_id="taobao:1:2268318:1511544070:impression", event_time_ms=1_511_544_070_000,
                          user_id="1", item_id="2268318", domain="taobao", event_type="impression",
                          category="2520377")
    assert by_id["taobao:100:3763048:1511551860:engagement"].category == "3425094"
    assert by_id["taobao:100:1603476:1511579908:conversion"].event_time_ms == 1_511_579_908_000
    cart = by_id["taobao:1000:5120034:1511542034:click"]
    assert (cart.user_id, cart.item_id, cart.key) == ("1000", "5120034", b"1000")


def test_taobao_truncated_last_line_is_one_raw_record(taobao_records):
    raws = [r for r in taobao_records if isinstance(r, RawRecord)]
    events = [r for r in taobao_records if isinstance(r, Event)]
    assert len(raws) == 1
    assert len(events) == TAOBAO_FULL_LINES
    assert taobao_records[-1] is raws[0]  # the last line of the file
    # The readable fields of "100370,1968385,1875258,pv" and no time or id: missing_field downstream.
    assert json.loads(raws[0].value) == {"user_id": "100370", "item_id": "1968385", "category": "1875258",
                                         "event_type": "impression", "domain": "taobao", "schema_version": 1}
    assert raws[0].key == b"100370"


def test_taobao_counts_and_unique_ids(taobao_records):
    events = [r for r in taobao_records if isinstance(r, Event)]
    assert len({e.event_id for e in events}) == len(events)
    # Behaviour counts of the sample's complete lines, from an independent split of the file.
    lines = TAOBAO_SAMPLE.read_text().splitlines()
    behaviours = Counter(line.split(",")[3] for line in lines if line.count(",") == 4)
    mapped = Counter(e.event_type for e in events)
    assert mapped == {taobao.BEHAVIOR_TO_EVENT_TYPE[b]: n for b, n in behaviours.items()}


@pytest.mark.parametrize(
    ("line", "hint", "fields"),
    [
        ("7,8,9,pv", "got 4", {"user_id": "7", "item_id": "8", "category": "9", "event_type": "impression"}),
        ("7,8", "got 2", {"user_id": "7", "item_id": "8"}),
        ("7,8,9,like,1511544070", "behavior_type", {"user_id": "7", "item_id": "8", "category": "9",
                                                    "event_time_ms": 1_511_544_070_000}),
        ("7,8,9,pv,yesterday", "timestamp", {"user_id": "7", "item_id": "8", "category": "9",
                                             "event_type": "impression"}),
        ("7,8,9,pv,1.5", "timestamp", {"user_id": "7", "item_id": "8", "category": "9", "event_type": "impression"}),
        ("7,8,9,pv,1,extra", "got 6", {"user_id": "7", "item_id": "8", "category": "9", "event_type": "impression",
                                       "event_time_ms": 1000}),
    ],
)
def test_taobao_bad_lines_become_partial_json(line, hint, fields):
    record = taobao.map_line(line, Counter())
    assert isinstance(record, RawRecord)
    assert hint in record.reason_hint
    assert json.loads(record.value) == {**fields, "domain": "taobao", "schema_version": 1}
    assert record.key == b"7"


def test_taobao_repeated_line_gets_numbered_id():
    seen: Counter = Counter()
    ids = [taobao.map_line("1,2,3,pv,10", seen).event_id for _ in range(3)]
    assert ids == ["taobao:1:2:10:impression", "taobao:1:2:10:impression#1", "taobao:1:2:10:impression#2"]


def test_taobao_non_utf8_line_is_raw_bytes(tmp_path):
    path = tmp_path / "x.csv"
    path.write_bytes(b"1,2,3,pv,10\n\xff\xfe,2\n")
    records = load_records("taobao", path=path)
    assert isinstance(records[0], Event)
    assert records[1] == RawRecord(value=b"\xff\xfe,2", key=b"", reason_hint="line is not UTF-8")


@given(
    user=st.integers(0, 10**9), item=st.integers(0, 10**9), category=st.integers(0, 10**9),
    behavior=st.sampled_from(sorted(taobao.BEHAVIOR_TO_EVENT_TYPE)), ts=st.integers(0, 4 * 10**9),
)
def test_taobao_valid_line_round_trip(user, item, category, behavior, ts):
    event = taobao.map_line(f"{user},{item},{category},{behavior},{ts}", Counter())
    assert isinstance(event, Event)
    assert (event.user_id, event.item_id, event.category) == (str(user), str(item), str(category))
    assert event.event_time_ms == ts * 1000
    assert event.event_type == taobao.BEHAVIOR_TO_EVENT_TYPE[behavior]
    assert json.loads(event.to_json())["event_id"] == event.event_id


# ---------------------------------------------------------------- load_records


def test_load_records_sorted_stably_with_raw_last(taobao_records):
    records = load_records("taobao", path=TAOBAO_SAMPLE)
    assert len(records) == len(taobao_records)
    assert sorted(r.event_id for r in records if isinstance(r, Event)) == sorted(
        r.event_id for r in taobao_records if isinstance(r, Event))
    assert isinstance(records[-1], RawRecord)
    source_index = {r.event_id: i for i, r in enumerate(taobao_records) if isinstance(r, Event)}
    events = records[:-1]
    for before, after in zip(events, events[1:]):
        assert before.event_time_ms <= after.event_time_ms
        if before.event_time_ms == after.event_time_ms:  # ties keep file order
            assert source_index[before.event_id] < source_index[after.event_id]


def test_load_records_limit_counts_source_rows(taobao_records):
    first = load_records("taobao", path=TAOBAO_SAMPLE, limit=50)
    assert sorted(first, key=event_time_sort_key) == first
    assert {r.event_id for r in first} == {r.event_id for r in taobao_records[:50]}
    assert load_records("taobao", path=TAOBAO_SAMPLE, limit=0) == []


@pytest.mark.parametrize(
    ("name", "kwargs", "error", "message"),
    [
        ("imdb", {}, ValueError, "expected one of ['movielens', 'openbandit', 'taobao']"),
        ("taobao", {}, ValueError, "taobao needs the path of the UserBehavior CSV (--path"),
        ("taobao", {"path": "/nonexistent/UserBehavior.csv"}, FileNotFoundError, "no file at"),
        ("taobao", {"path": TAOBAO_SAMPLE, "cache_dir": "/tmp"}, ValueError, "not a cache"),
        ("taobao", {"path": TAOBAO_SAMPLE, "limit": -1}, ValueError, "limit must be >= 0"),
        ("movielens", {"path": "/tmp/ml"}, ValueError, "pass cache_dir instead"),
        ("openbandit", {"path": "/tmp/obd"}, ValueError, "pass cache_dir instead"),
    ],
)
def test_load_records_errors(name, kwargs, error, message):
    with pytest.raises(error) as info:
        load_records(name, **kwargs)
    assert message in str(info.value)


def test_registry_names():
    assert sorted(DATASETS) == ["movielens", "openbandit", "taobao"]


_records = st.lists(
    st.one_of(
        st.builds(lambda n, t: Event(event_id=f"e{n}", event_time_ms=t, user_id="u", item_id="i", domain="taobao",
                                     event_type="impression"), st.integers(0, 10**6), st.integers(0, 3)),
        st.builds(lambda n: RawRecord(value=str(n).encode(), key=b"", reason_hint="r"), st.integers(0, 10**6)),
    ),
    max_size=30,
)


@given(_records)
def test_sort_key_is_stable_with_raw_last(records):
    ordered = sorted(records, key=event_time_sort_key)
    events = [r for r in records if isinstance(r, Event)]
    raws = [r for r in records if isinstance(r, RawRecord)]
    # Reference: a stable bucket sort by time, then the raw records in input order.
    expected = [e for t in sorted({e.event_time_ms for e in events}) for e in events if e.event_time_ms == t] + raws
    assert [id(r) for r in ordered] == [id(r) for r in expected]


# ---------------------------------------------------------------- small types and the PyPI cache


@pytest.mark.parametrize(("text", "expected"), [("12", 12), ("-3", -3), ("881250949.0", 881250949)])
def test_parse_int_valid(text, expected):
    assert parse_int(text, "x") == expected


@pytest.mark.parametrize("text", ["", "1.5", "abc", "nan"])
def test_parse_int_invalid(text):
    with pytest.raises(ValueError, match="x: expected an integer"):
        parse_int(text, "x")


def test_raw_record_requires_bytes():
    with pytest.raises(TypeError, match="must be bytes"):
        RawRecord(value="text", key=b"", reason_hint="")


def test_partial_record_is_deterministic_json():
    a = partial_record({"user_id": "1", "domain": "d"}, key="1", reason_hint="r")
    b = partial_record({"domain": "d", "user_id": "1"}, key="1", reason_hint="r")
    assert a == b and json.loads(a.value) == {"user_id": "1", "domain": "d", "schema_version": 1}


def test_fetch_files_downloads_once(tmp_path, monkeypatch):
    calls = []

    def fake_download(pip_args, dest):
        calls.append(pip_args)
        archive = dest / "pkg-1.0-py3-none-any.whl"
        with zipfile.ZipFile(archive, "w") as zf:
            zf.writestr("pkg/data/a.txt", "alpha")
            zf.writestr("pkg/data/b.txt", "beta")
        return archive

    monkeypatch.setattr(pypi, "download", fake_download)
    members = {"a.txt": "pkg/data/a.txt", "sub/b.txt": "pkg/data/b.txt"}
    pypi.fetch_files(["pkg==1.0"], members, tmp_path / "cache")
    pypi.fetch_files(["pkg==1.0"], members, tmp_path / "cache")
    assert calls == [["pkg==1.0"]]
    assert (tmp_path / "cache/a.txt").read_text() == "alpha"
    assert (tmp_path / "cache/sub/b.txt").read_text() == "beta"
    assert not list((tmp_path / "cache").glob(".*.part"))


def test_fetch_files_missing_member_leaves_no_cache(tmp_path, monkeypatch):
    def fake_download(pip_args, dest):
        archive = dest / "pkg.whl"
        with zipfile.ZipFile(archive, "w") as zf:
            zf.writestr("pkg/a.txt", "alpha")
        return archive

    monkeypatch.setattr(pypi, "download", fake_download)
    with pytest.raises(KeyError):
        pypi.fetch_files([], {"b.txt": "pkg/b.txt"}, tmp_path)
    assert not pypi.is_cached(tmp_path, ["b.txt"])


def test_default_cache_dir_is_under_home():
    assert pypi.resolve_cache_dir(None, "ml-100k") == Path.home() / ".cache/gemline/ml-100k"


# ---------------------------------------------------------------- MovieLens


def test_movielens_hand_checked_rows(ml_rows):
    rows = ml_rows
    assert len(rows) == 100_000
    # inter line 1: 196 242 3 881250949; user 196 = 49 M writer 55105; item 242 = Kolya, Comedy.
    assert rows[0] == [Event(event_id="ml100k:196:242:881250949:impression", event_time_ms=881_250_949_000,
                             user_id="196", item_id="242", domain="movielens", event_type="impression",
                             category="Comedy", age=49, gender="M", location="55105")]
    # line 6: 298 474 4 -> impression + click; Dr. Strangelove is "Sci-Fi War"; user 298 = 44 M 01581.
    assert [e.event_type for e in rows[5]] == ["impression", "click"]
    assert {(e.category, e.age, e.gender, e.location, e.event_time_ms) for e in rows[5]} == {
        ("Sci-Fi", 44, "M", "01581", 884_182_806_000)}
    # line 8: 253 465 5 -> impression, click, conversion; Jungle Book "Adventure Children's Romance".
    assert [e.event_id for e in rows[7]] == [f"ml100k:253:465:891628467:{t}"
                                             for t in ("impression", "click", "conversion")]
    assert rows[7][0].category == "Adventure" and rows[7][0].gender == "F"


def test_movielens_counts_follow_ratings(ml_cache, ml_rows):
    ratings = Counter(line.split("\t")[2] for line in (ml_cache / "ml-100k.inter").read_text().splitlines()[1:])
    records = sorted((r for row in ml_rows for r in row), key=event_time_sort_key)
    types = Counter(r.event_type for r in records)
    assert types == {"impression": sum(ratings.values()), "click": ratings["4"] + ratings["5"],
                     "conversion": ratings["5"]}
    assert len({r.event_id for r in records}) == len(records)
    assert [r.event_time_ms for r in records] == sorted(r.event_time_ms for r in records)


def test_movielens_second_call_does_not_download(ml_cache, ml_rows, monkeypatch):
    monkeypatch.setattr(subprocess, "run", _no_download)
    assert movielens.fetch(ml_cache) == ml_cache
    limited = load_records("movielens", cache_dir=ml_cache, limit=8)
    # limit counts rating rows: rows 6 and 8 bring their clicks/conversion along.
    assert limited == sorted((r for row in ml_rows[:8] for r in row), key=event_time_sort_key)
    assert Counter(r.event_type for r in limited) == {"impression": 8, "click": 2, "conversion": 1}


@pytest.mark.parametrize(
    ("fields", "hint"),
    [(["1", "2", "x", "10"], "could not convert"), (["1", "2", "4", "ten"], "timestamp"),
     (["1", "2", "4"], "got 3")],
)
def test_movielens_bad_rating_rows(fields, hint):
    (record,) = movielens.map_rating(fields, {}, {})
    assert isinstance(record, RawRecord) and hint in record.reason_hint and record.key == b"1"


def test_movielens_unknown_user_and_item_leave_context_none():
    (event,) = movielens.map_rating(["9999", "8888", "1", "5"], {}, {})
    assert (event.category, event.age, event.gender, event.location) == (None, None, None, None)


# ---------------------------------------------------------------- Open Bandit


def test_openbandit_hand_checked_click_round(obd_cache):
    rows = list(openbandit.read_rows(cache_dir=obd_cache, campaigns=("men",)))
    assert len(rows) == 10_000
    # men.csv row 466: 2019-11-24 06:22:48.087590+00:00, item 17, slot 2, click 1.
    impression, click = rows[466]
    features = ["cef3390ed299c09874189c387777674a", "03a5648a76832f83c859d46bc06cb64a",
                "7bc94a2da491829b777c49c4b5e480f2", "05b76f5e97e51128862059ac7df9e42a"]
    user = "obdu:" + hashlib.sha1("|".join(features).encode()).hexdigest()[:16]
    assert impression == Event(event_id="obd:random:men:466:impression", event_time_ms=1_574_576_568_087,
                               user_id=user, item_id="men:17", domain="obd_men", event_type="impression",
                               category="cb4655bc2d2e54055efefb998883d6fe", position=2)
    assert click.event_type == "click" and click.event_time_ms == impression.event_time_ms
    assert len(rows[0]) == 1 and rows[0][0].position == 3  # row 0: item 14, slot 3, no click


def test_openbandit_all_campaigns_counts_and_ids(obd_cache):
    rows = list(openbandit.read_rows(cache_dir=obd_cache))
    bts_rows = list(openbandit.read_rows(cache_dir=obd_cache, policy="bts", campaigns=("women",)))
    records = [r for row in rows + bts_rows for r in row]
    assert (len(rows), len(bts_rows)) == (30_000, 10_000) and all(isinstance(r, Event) for r in records)
    assert Counter(r.domain for r in records if r.event_type == "impression") == {
        "obd_all": 10_000, "obd_men": 10_000, "obd_women": 20_000}
    assert all(len(row) == 1 + (row[-1].event_type == "click") for row in rows + bts_rows)
    assert len({r.event_id for r in records}) == len(records)  # the policy is part of the id
    assert {r.position for r in records} == {1, 2, 3}
    clicks = sum(r.event_type == "click" for r in records)
    assert 0 < clicks < len(rows) + len(bts_rows)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"policy": "greedy"}, "expected one of ('random', 'bts')"), ({"campaigns": ("kids",)}, "unknown ['kids']")],
)
def test_openbandit_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        next(openbandit.read_rows(cache_dir="/nonexistent", **kwargs))


@pytest.mark.parametrize(
    ("override", "hint"),
    [({"timestamp": "2019-11-24 00:00:00"}, "UTC offset"), ({"click": "2"}, "0 or 1"),
     ({"position": ""}, "position"), ({"user_feature_0": ""}, "missing")],
)
def test_openbandit_bad_rounds(override, hint):
    row = {"": "5", "timestamp": "2019-11-24 00:00:00.5+00:00", "item_id": "3", "position": "1", "click": "0",
           **{f"user_feature_{i}": f"f{i}" for i in range(4)}}
    (record,) = openbandit.map_round({**row, **override}, policy="random", campaign="all", categories={})
    assert isinstance(record, RawRecord) and hint in record.reason_hint
    assert json.loads(record.value)["item_id"] == "all:3"


def test_openbandit_time_parse_against_reference():
    assert openbandit.parse_time_ms("1970-01-01 00:00:01.999999+00:00") == 1999
    assert openbandit.parse_time_ms("2019-11-24 09:00:00+09:00") == 1_574_553_600_000


def test_event_types_are_schema_types():
    assert set(taobao.BEHAVIOR_TO_EVENT_TYPE.values()) <= set(EVENT_TYPES)
    assert set(movielens.event_types_for(5)) <= set(EVENT_TYPES)
