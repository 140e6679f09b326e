"""The ingest job end to end against the embedded broker: exactly once, restartable, recoverable."""

from __future__ import annotations

import dataclasses
import itertools
import json

import apache_beam as beam
import pyarrow as pa
import pytest
from apache_beam.testing import test_pipeline  # module import: pytest would try to collect class TestPipeline
from apache_beam.testing.util import assert_that, equal_to
from confluent_kafka import Producer

import gemline.lake as lake_mod
from gemline.config import GemlineConfig
from gemline.errors import BadConfigError
from gemline.lake import commit_metadata, committed_version, read_table
from ingest.broker import EmbeddedBroker
from ingest.config import IngestConfig, KafkaConfig
from ingest.kafka_source import KafkaRecord, OffsetRange, plan_topic
from ingest.parse import event_date
from ingest.pipeline import (
    STAGED_SUFFIX,
    ReadRecordBatches,
    _check_batch,
    app_id_for,
    cap_ranges,
    ingest_backlog,
    read_staged,
    run_ingest,
    staging_dir,
    uses_beam,
)
from ingest.replay import ensure_topic
from ingest.schema import DEAD_LETTER_SCHEMA, EVENTS_TABLE_SCHEMA, Event
from tests.conftest import ingest_args

pytestmark = pytest.mark.integration

NOW_MS = 1_750_000_000_000  # fixed ingest clock: 2025-06-15T15:06:40Z
BASE_MS = 1_749_000_000_000  # events span < NOW_MS - BASE_MS (11.5 days at 2 h apart)
PARTITIONS = 3
_topic_ids = itertools.count()


@pytest.fixture(scope="module")
def broker():
    with EmbeddedBroker() as b:
        yield b


@pytest.fixture
def topic(broker) -> str:
    name = f"events-{next(_topic_ids)}"
    ensure_topic(broker.bootstrap, name, PARTITIONS)
    return name


def _config(lake, topic: str) -> GemlineConfig:
    return GemlineConfig(lake=str(lake), kafka=KafkaConfig(topic=topic, partitions=PARTITIONS), ingest=IngestConfig())


def _produce(bootstrap: str, topic: str, values: list[tuple[bytes, bytes]]) -> None:
    # One message per record batch: tansu's high watermark is (base offset of last batch) + 1.
    producer = Producer({"bootstrap.servers": bootstrap, "batch.num.messages": 1, "linger.ms": 0})
    for key, value in values:
        producer.produce(topic, key=key, value=value)
        producer.flush(30)  # flushing each keeps the per-partition order = production order
    assert producer.flush(30) == 0


def _good(start: int, n: int) -> list[tuple[bytes, bytes]]:
    out = []
    for i in range(start, start + n):
        ev = Event(event_id=f"e{i}", event_time_ms=BASE_MS + i * 7_200_000, user_id=f"u{i % 5}",
                   item_id=f"i{i}", domain="facebook", event_type="impression", position=i % 4 + 1)
        out.append((ev.key, ev.to_json()))
    return out


BAD = [
    (b"u0", b"{not json"),
    (b"u1", b'{"event_id":"x","event_time_ms":1,"user_id":"u","item_id":"i","domain":"facebook"}'),
    (b"u2", Event(event_id="y", event_time_ms=BASE_MS, user_id="u2", item_id="i", domain="tiktok",
                  event_type="click").to_json()),
]


def _coords(table: pa.Table | None) -> list[tuple[int, int]]:
    if table is None:
        return []
    return list(zip(table["kafka_partition"].to_pylist(), table["kafka_offset"].to_pylist()))


def _all_offsets(bootstrap: str, topic: str) -> set[tuple[int, int]]:
    return {(r.partition, o) for r in plan_topic(bootstrap, topic, {}, previous=None).ranges
            for o in range(r.start, r.end)}


def test_ingest_is_exactly_once_and_incremental(broker, topic, tmp_path):
    cfg = _config(tmp_path / "lake", topic)
    _produce(broker.bootstrap, topic, _good(0, 20) + BAD)

    first = run_ingest(*ingest_args(cfg), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    assert (first.batch_version, first.events_written, first.dead_letter_written, first.skipped) == (0, 20, 3, False)
    events, dead = read_table(cfg.lake, "events"), read_table(cfg.lake, "dead_letter")
    assert events.schema == EVENTS_TABLE_SCHEMA and dead.schema == DEAD_LETTER_SCHEMA
    assert lake_mod.open_table(cfg.lake, "events").metadata().partition_columns == ["event_date"]
    ev_keys, dead_keys = _coords(events), _coords(dead)
    assert len(ev_keys) == len(set(ev_keys)) == 20 and len(dead_keys) == len(set(dead_keys)) == 3
    assert set(ev_keys).isdisjoint(dead_keys)
    assert set(ev_keys) | set(dead_keys) == _all_offsets(broker.bootstrap, topic)
    assert sorted(events["event_id"].to_pylist()) == sorted(f"e{i}" for i in range(20))
    assert sorted(dead["reason"].to_pylist()) == ["missing_field", "not_json", "unknown_domain"]
    for row in events.to_pylist():
        assert row["event_date"] == event_date(row["event_time_ms"])
        assert row["kafka_topic"] == topic
    assert not staging_dir(cfg.lake, 0).exists()
    meta = commit_metadata(cfg.lake, "events", app_id_for(topic))
    assert {int(p): e for p, e in meta["end_offsets"].items()} == {r.partition: r.end for r in first.offset_ranges}

    second = run_ingest(*ingest_args(cfg), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    assert second.skipped and (second.events_written, second.dead_letter_written) == (0, 0)
    assert read_table(cfg.lake, "events").num_rows == 20
    assert committed_version(cfg.lake, "events", app_id_for(topic)) == 0

    _produce(broker.bootstrap, topic, _good(20, 7) + BAD[:1])
    third = run_ingest(*ingest_args(cfg), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    assert (third.batch_version, third.events_written, third.dead_letter_written) == (1, 7, 1)
    assert all(r.start == prev.end for r, prev in zip(third.offset_ranges, first.offset_ranges))
    events, dead = read_table(cfg.lake, "events"), read_table(cfg.lake, "dead_letter")
    keys = _coords(events) + _coords(dead)
    assert len(keys) == len(set(keys)) and set(keys) == _all_offsets(broker.bootstrap, topic)
    assert sorted(events["event_id"].to_pylist()) == sorted(f"e{i}" for i in range(27))


def test_capped_batches_ingest_a_backlog_like_one_uncapped_batch(broker, topic, tmp_path):
    _produce(broker.bootstrap, topic, _good(0, 17) + BAD)  # 20 records over 3 partitions
    whole = _config(tmp_path / "whole", topic)
    capped = dataclasses.replace(whole, lake=str(tmp_path / "capped"),
                                 ingest=IngestConfig(max_offsets_per_partition=3))
    assert [r.skipped for r in ingest_backlog(*ingest_args(whole), bootstrap=broker.bootstrap,
                                              now_ms=NOW_MS)] == [False]
    results = ingest_backlog(*ingest_args(capped), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    longest = max(r.num_offsets for r in plan_topic(broker.bootstrap, topic, {}, previous=None).ranges)
    assert len(results) == -(-longest // 3)  # ceil: one batch per 3 offsets of the longest partition
    assert [r.batch_version for r in results] == list(range(len(results)))
    assert all(r.num_offsets <= 3 for res in results for r in res.offset_ranges)
    for table in ("events", "dead_letter"):
        assert _rows(read_table(capped.lake, table)) == _rows(read_table(whole.lake, table))
    assert run_ingest(*ingest_args(capped), bootstrap=broker.bootstrap, now_ms=NOW_MS).skipped


def test_cap_ranges_cuts_each_range_and_rejects_bad_caps():
    ranges = [OffsetRange("t", 0, 5, 9), OffsetRange("t", 1, 0, 2), OffsetRange("t", 2, 4, 4)]
    assert cap_ranges(ranges, 3) == [OffsetRange("t", 0, 5, 8), OffsetRange("t", 1, 0, 2), OffsetRange("t", 2, 4, 4)]
    assert cap_ranges(ranges, None) == ranges
    with pytest.raises(ValueError, match="expected max_offsets >= 1 or None, got 0"):
        cap_ranges(ranges, 0)
    with pytest.raises(ValueError, match="max_offsets_per_partition must be >= 1 or None"):
        IngestConfig(max_offsets_per_partition=0)
    with pytest.raises(ValueError, match="expected max_batches >= 1 or None, got 0"):
        ingest_backlog(*ingest_args(_config("unused", "t")), bootstrap="unused:1", max_batches=0)


def _rows(table: pa.Table) -> list[dict]:
    return sorted(table.to_pylist(), key=lambda r: (r["kafka_partition"], r["kafka_offset"]))


def test_crash_between_commits_recovers_to_the_clean_result(broker, topic, tmp_path, monkeypatch):
    msgs = _good(0, 12) + BAD
    _produce(broker.bootstrap, topic, msgs)
    clean_cfg = _config(tmp_path / "clean", topic)
    run_ingest(*ingest_args(clean_cfg), bootstrap=broker.bootstrap, now_ms=NOW_MS)

    cfg = _config(tmp_path / "crashy", topic)
    real_commit = lake_mod.commit_once
    crashed = []

    def commit_or_crash(lake, table, data, **kw):
        if table == "events" and not crashed:
            crashed.append(True)
            raise OSError("simulated crash before the events commit")
        return real_commit(lake, table, data, **kw)

    monkeypatch.setattr("gemline.lake.commit_once", commit_or_crash)
    with pytest.raises(OSError, match="simulated crash"):
        run_ingest(*ingest_args(cfg), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    assert committed_version(cfg.lake, "dead_letter", app_id_for(topic)) == 0
    assert committed_version(cfg.lake, "events", app_id_for(topic)) is None

    # More messages arrive before the restart: the recovered batch must still end where the crashed one did,
    # and use the crashed run's clock, not the new one.
    _produce(broker.bootstrap, topic, _good(100, 4))
    recovered = run_ingest(*ingest_args(cfg), bootstrap=broker.bootstrap, now_ms=NOW_MS + 10**12)
    assert recovered.recovered and recovered.batch_version == 0
    assert (recovered.events_written, recovered.dead_letter_written) == (12, 0)
    for table in ("events", "dead_letter"):
        assert _rows(read_table(cfg.lake, table)) == _rows(read_table(clean_cfg.lake, table))

    after = run_ingest(*ingest_args(cfg), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    assert (after.batch_version, after.events_written, after.dead_letter_written, after.recovered) == (1, 4, 0, False)


def test_all_dead_batch_still_advances_offsets(broker, topic, tmp_path):
    cfg = _config(tmp_path / "lake", topic)
    _produce(broker.bootstrap, topic, BAD)
    res = run_ingest(*ingest_args(cfg), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    assert (res.events_written, res.dead_letter_written) == (0, 3)
    assert read_table(cfg.lake, "events").num_rows == 0
    assert run_ingest(*ingest_args(cfg), bootstrap=broker.bootstrap, now_ms=NOW_MS).skipped


def test_kafka_python_client_reads_the_same_records(broker, topic, tmp_path):
    _produce(broker.bootstrap, topic, _good(0, 6) + BAD[:1])
    a = run_ingest(*ingest_args(_config(tmp_path / "a", topic)), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    cfg_b = dataclasses.replace(_config(tmp_path / "b", topic),
                                kafka=KafkaConfig(topic=topic, partitions=PARTITIONS, client="kafka-python"))
    b = run_ingest(*ingest_args(cfg_b), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    assert a.offset_ranges == b.offset_ranges
    for table in ("events", "dead_letter"):
        assert _rows(read_table(tmp_path / "a", table)) == _rows(read_table(tmp_path / "b", table))


def test_reshuffled_read_ingests_the_same_rows(broker, topic, tmp_path):
    _produce(broker.bootstrap, topic, _good(0, 9) + BAD[:2])
    a = run_ingest(*ingest_args(_config(tmp_path / "a", topic)), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    base = _config(tmp_path / "b", topic)
    b = run_ingest(*ingest_args(dataclasses.replace(base, ingest=dataclasses.replace(base.ingest, reshuffle=True,
                                                                                     batch_max_records=2))),
                   bootstrap=broker.bootstrap, now_ms=NOW_MS)
    assert a.events_written == b.events_written == 9 and a.dead_letter_written == b.dead_letter_written == 2
    for table in ("events", "dead_letter"):
        assert _rows(read_table(tmp_path / "a", table)) == _rows(read_table(tmp_path / "b", table))


def test_in_process_and_beam_batches_commit_the_same_rows(broker, topic, tmp_path):
    """The twin of the two engines: the same events, dead-letter rows (bad JSON, unknown domain, too large),
    duplicates dropped and commit metadata, over two batches of several record batches per range."""
    big = _ev(7, BASE_MS, item_id="x" * 3000)
    first = _good(0, 9) + BAD + [big, _good(2, 1)[0]]  # e2 twice: a duplicate within the batch
    _produce(broker.bootstrap, topic, first)
    configs = {}
    for engine in ("beam", "inprocess"):
        base = _config(tmp_path / engine, topic)
        configs[engine] = dataclasses.replace(base, ingest=dataclasses.replace(
            base.ingest, engine=engine, batch_max_records=2, max_message_bytes=2048))
    results: dict[str, list] = {engine: [] for engine in configs}
    for more in ([], _good(9, 5) + [_good(3, 1)[0]]):  # then e3 again: a duplicate of a committed event
        _produce(broker.bootstrap, topic, more)
        for engine, cfg in configs.items():
            results[engine].append(run_ingest(*ingest_args(cfg), bootstrap=broker.bootstrap, now_ms=NOW_MS))
    beam_runs, local_runs = results["beam"], results["inprocess"]
    assert [(r.events_written, r.dead_letter_written, r.duplicates_dropped) for r in beam_runs] == [(9, 4, 1), (5, 0, 1)]
    assert [dataclasses.replace(r, recovered=False) for r in local_runs] == [
        dataclasses.replace(r, recovered=False) for r in beam_runs]
    for table in ("events", "dead_letter"):
        assert _rows(read_table(tmp_path / "inprocess", table)) == _rows(read_table(tmp_path / "beam", table))
    assert sorted(read_table(tmp_path / "beam", "dead_letter")["reason"].to_pylist()) == sorted(
        ["not_json", "missing_field", "unknown_domain", "too_large"])
    for table in ("events", "dead_letter"):
        beam_meta = commit_metadata(tmp_path / "beam", table, app_id_for(topic))
        local_meta = commit_metadata(tmp_path / "inprocess", table, app_id_for(topic))
        assert local_meta == beam_meta and local_meta["end_offsets"]


def test_the_engine_follows_the_beam_flags():
    auto = IngestConfig()
    assert not uses_beam(auto, None) and not uses_beam(auto, [])
    assert uses_beam(auto, ["--direct_num_workers=2"])
    assert uses_beam(dataclasses.replace(auto, runner="DaskRunner"), None)
    assert uses_beam(dataclasses.replace(auto, engine="beam"), None)
    with pytest.raises(BadConfigError, match="ingest.engine='inprocess' runs no Beam pipeline"):
        uses_beam(dataclasses.replace(auto, engine="inprocess"), ["--runner=DaskRunner"])
    with pytest.raises(BadConfigError, match="ingest.engine must be"):
        IngestConfig(engine="spark")


def test_plan_rejects_offsets_past_the_watermark(broker, topic):
    _produce(broker.bootstrap, topic, _good(0, 2))
    with pytest.raises(ValueError, match="past the end of the partition"):
        plan_topic(broker.bootstrap, topic, {0: 10_000}, previous=None)
    with pytest.raises(ValueError, match="partitions \\[7\\]"):
        plan_topic(broker.bootstrap, topic, {7: 0}, previous=None)
    with pytest.raises(ValueError, match="not found"):
        plan_topic(broker.bootstrap, "no-such-topic", {}, previous=None)


def test_read_staged_drops_duplicate_coordinates(tmp_path):
    import pyarrow.feather as feather

    rows = [{"reason": "not_json", "detail": "d", "raw": b"x", "kafka_topic": "t", "kafka_partition": p,
             "kafka_offset": o, "created_ts_ms": 5} for p, o in [(1, 3), (0, 2), (1, 3), (0, 1)]]
    feather.write_feather(pa.Table.from_pylist(rows[:2], schema=DEAD_LETTER_SCHEMA), tmp_path / f"a{STAGED_SUFFIX}")
    feather.write_feather(pa.Table.from_pylist(rows[2:], schema=DEAD_LETTER_SCHEMA), tmp_path / f"b{STAGED_SUFFIX}",
                          compression="lz4")
    out = read_staged(tmp_path, DEAD_LETTER_SCHEMA)
    assert _coords(out) == [(0, 1), (0, 2), (1, 3)]
    assert read_staged(tmp_path / "missing", DEAD_LETTER_SCHEMA).num_rows == 0


def test_offset_range_validates_and_round_trips():
    r = OffsetRange("t", 2, 5, 9)
    assert r.num_offsets == 4 and OffsetRange.from_dict(r.to_dict()) == r
    for bad in [("t", -1, 0, 0), ("t", 0, -1, 0), ("t", 0, 5, 4)]:
        with pytest.raises(ValueError, match="expected"):
            OffsetRange(*bad)


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_read_record_batches_emits_exactly_the_range(broker, topic, client):
    msgs = [(f"k{i}".encode(), f"v{i}".encode()) for i in range(9)]
    producer = Producer({"bootstrap.servers": broker.bootstrap, "batch.num.messages": 1, "linger.ms": 0})
    for i, (key, value) in enumerate(msgs):
        producer.produce(topic, key=key, value=value, partition=i % 2, timestamp=1_000 + i)
    assert producer.flush(30) == 0
    # partition 0 holds v0 v2 v4 v6 v8 at offsets 0..4, partition 1 holds v1 v3 v5 v7 at 0..3
    ranges = [OffsetRange(topic, 0, 1, 4), OffsetRange(topic, 1, 0, 2), OffsetRange(topic, 2, 0, 0)]
    expected = [
        KafkaRecord(topic, 0, 1, b"k2", b"v2", 1_002), KafkaRecord(topic, 0, 2, b"k4", b"v4", 1_004),
        KafkaRecord(topic, 0, 3, b"k6", b"v6", 1_006), KafkaRecord(topic, 1, 0, b"k1", b"v1", 1_001),
        KafkaRecord(topic, 1, 1, b"k3", b"v3", 1_003),
    ]
    with test_pipeline.TestPipeline() as p:
        out = (p | beam.Create(ranges)
               | ReadRecordBatches(bootstrap=broker.bootstrap, client=client, timeout_s=20, max_records=2)
               | beam.FlatMap(lambda b: [KafkaRecord(**row) for row in b.to_pylist()]))
        assert_that(out, equal_to(expected))


def test_stale_staging_from_a_crashed_run_is_ignored(broker, topic, tmp_path):
    cfg = _config(tmp_path / "lake", topic)
    _produce(broker.bootstrap, topic, _good(0, 5))
    stale = staging_dir(cfg.lake, 0) / "events"
    stale.mkdir(parents=True)
    (stale / f"junk{STAGED_SUFFIX}").write_bytes(b"half-written file of a run that died in the pipeline")
    res = run_ingest(*ingest_args(cfg), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    assert res.events_written == 5 and read_table(cfg.lake, "events").num_rows == 5


def _coord_table(coords):
    # _check_batch reads only the Kafka coordinates
    return pa.table({"kafka_partition": pa.array([p for p, _ in coords], pa.int32()),
                     "kafka_offset": pa.array([o for _, o in coords], pa.int64())})


CHECK_ERRORS = [
    # (event coords, dead coords, expected message)
    ([(0, 1)], [(0, 1)], "staged to both tables"),
    ([(0, 5)], [], "outside the planned ranges"),
    ([], [(3, 0)], "outside the planned ranges"),
]


@pytest.mark.parametrize(("ev", "dead", "match"), CHECK_ERRORS)
def test_check_batch_catches_broken_invariants(ev, dead, match):
    ranges = (OffsetRange("t", 0, 0, 5), OffsetRange("t", 1, 0, 2))
    with pytest.raises(RuntimeError, match=match):
        _check_batch(_coord_table(ev), _coord_table(dead), ranges)


def _ev(i: int, t_ms: int | str, **over) -> tuple[bytes, bytes]:
    obj = {"event_id": f"e{i}", "event_time_ms": t_ms, "user_id": f"u{i % 5}", "item_id": f"i{i}",
           "domain": "facebook", "event_type": "impression", **over}
    return f"u{i % 5}".encode(), json.dumps(obj).encode()


def test_bad_inputs_duplicates_and_late_events_end_to_end(broker, topic, tmp_path):
    """Every bad-input kind dead-lettered with its code while the good rows of the batch are written;
    duplicate deliveries dropped within and across batches; late events kept in late_events."""
    cfg = dataclasses.replace(_config(tmp_path / "lake", topic),
                              ingest=IngestConfig(retention_days=30, dedup_window_ms=3_600_000,
                                                  allowed_lateness_ms=86_400_000, batch_max_records=4))
    day = 86_400_000
    first_batch = [
        _ev(0, BASE_MS), _ev(1, BASE_MS // 1000 + 1), _ev(2, (BASE_MS + 2) * 1000),  # ms, s, us
        _ev(3, "2025-06-04T01:20:00+02:00"), _ev(4, "2025-06-04T01:20:00"),  # ISO with offset, naive = UTC
        _ev(0, BASE_MS),  # second delivery of e0: dropped
        (b"u1", b"{broken"),
        _ev(90, BASE_MS, user_id=None),
        _ev(91, BASE_MS, position="3"),
        _ev(92, NOW_MS + cfg.ingest.max_future_skew_ms + 1),
        _ev(93, NOW_MS - 31 * day),
        _ev(94, BASE_MS, domain="tiktok"),
        _ev(95, BASE_MS, event_type="purchase"),
    ]
    # Key every message to one user so one partition holds them all, in order.
    first_batch = [(b"u0", v) for _, v in first_batch]
    _produce(broker.bootstrap, topic, first_batch)
    res = run_ingest(*ingest_args(cfg), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    assert (res.events_written, res.dead_letter_written, res.duplicates_dropped, res.late_events_written) == (5, 7, 1, 0)
    dead = read_table(cfg.lake, "dead_letter")
    assert sorted(dead["reason"].to_pylist()) == sorted(["not_json", "missing_field", "wrong_type", "future_event_time",
                                                         "expired_event_time", "unknown_domain", "unknown_event_type"])
    events = {r["event_id"]: r for r in read_table(cfg.lake, "events").to_pylist()}
    assert sorted(events) == ["e0", "e1", "e2", "e3", "e4"]
    assert events["e0"]["event_time_us"] == BASE_MS * 1000
    assert events["e1"]["event_time_us"] == (BASE_MS // 1000 + 1) * 1_000_000
    assert events["e2"]["event_time_us"] == (BASE_MS + 2) * 1000 and events["e2"]["event_time_ms"] == BASE_MS + 2
    assert events["e3"]["event_time_us"] == events["e4"]["event_time_us"] - 2 * 3_600_000_000
    meta = commit_metadata(cfg.lake, "events", app_id_for(topic))
    part = events["e0"]["kafka_partition"]
    assert meta["duplicates_dropped"] == 1 and meta["late_events"] == 0
    assert meta["duplicates_dropped_offsets"] == {str(part): [[5, 6]]}  # the second e0 (the 6th message)
    assert meta["generation"] == 0
    assert {r["kafka_generation"] for r in events.values()} == {0}
    assert set(read_table(cfg.lake, "dead_letter")["kafka_generation"].to_pylist()) == {0}
    assert meta["watermarks_ms"] == {str(part): max(r["event_time_ms"] for r in events.values())}

    watermark = meta["watermarks_ms"][str(part)]
    second_batch = [_ev(0, BASE_MS),  # e0 again, the same event: a duplicate across batches, only counted
                    _ev(0, BASE_MS + 1000),  # e0 1 s later: within the window (1 h) but another payload: a conflict
                    _ev(0, BASE_MS + 2 * 3_600_000),  # e0 2 h later: outside the window, a new event
                    _ev(5, watermark - day - 1),  # behind the watermark by more than a day: late
                    _ev(6, watermark - day)]  # exactly the allowed lateness: on time
    _produce(broker.bootstrap, topic, [(b"u0", v) for _, v in second_batch])
    res2 = run_ingest(*ingest_args(cfg), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    assert (res2.events_written, res2.dead_letter_written, res2.duplicates_dropped, res2.late_events_written,
            res2.duplicate_conflicts) == (2, 1, 1, 1, 1)
    conflict, = [r for r in read_table(cfg.lake, "dead_letter").to_pylist() if r["reason"] == "duplicate_conflict"]
    assert json.loads(conflict["raw"])["event_time_ms"] == BASE_MS + 1000 and "e0" in conflict["detail"]
    late = read_table(cfg.lake, "late_events").to_pylist()
    assert [(r["event_id"], r["watermark_ms"], r["lateness_ms"]) for r in late] == [("e5", watermark, day + 1)]
    ids = read_table(cfg.lake, "events")["event_id"].to_pylist()
    assert sorted(ids) == ["e0", "e0", "e1", "e2", "e3", "e4", "e6"]
    assert commit_metadata(cfg.lake, "late_events", app_id_for(topic))["late_events"] == 1


@pytest.mark.parametrize("reshuffle", [False, True])
def test_read_record_batches_yields_every_offset_once_in_small_batches(broker, topic, reshuffle):
    _produce(broker.bootstrap, topic, _good(0, 7))
    ranges = plan_topic(broker.bootstrap, topic, {}, previous=None).ranges
    with test_pipeline.TestPipeline() as p:
        batches = p | beam.Create(ranges) | ReadRecordBatches(bootstrap=broker.bootstrap, client="confluent",
                                                              timeout_s=20, max_records=2, reshuffle=reshuffle)
        shapes = batches | "Shape" >> beam.Map(
            lambda b: (b.num_rows <= 2, len(set(b.column("partition").to_pylist())) == 1,
                       b.column("offset").to_pylist() == sorted(b.column("offset").to_pylist())))
        coords = batches | "Coords" >> beam.FlatMap(
            lambda b: list(zip(b.column("partition").to_pylist(), b.column("offset").to_pylist())))
        assert_that(shapes | "Bad" >> beam.Filter(lambda s: s != (True, True, True)), equal_to([]), label="CheckShape")
        assert_that(coords, equal_to(sorted(_all_offsets(broker.bootstrap, topic))), label="CheckCoords")


def test_crash_after_late_events_commit_writes_late_rows_once(broker, topic, tmp_path, monkeypatch):
    cfg = _config(tmp_path / "lake", topic)
    day = 86_400_000
    _produce(broker.bootstrap, topic, [(b"u0", v) for _, v in [_ev(0, BASE_MS), _ev(1, BASE_MS + 3 * day)]])
    run_ingest(*ingest_args(cfg), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    # e2 is 2 days behind the watermark (late), e1 again is a duplicate, e3 is on time.
    _produce(broker.bootstrap, topic, [(b"u0", v) for _, v in [_ev(2, BASE_MS + day), _ev(1, BASE_MS + 3 * day),
                                                                _ev(3, BASE_MS + 3 * day)]])
    real_commit = lake_mod.commit_once

    def commit_or_crash(lake, table, data, **kw):
        if table == "events" and kw["version"] == 1:
            raise OSError("simulated crash before the events commit")
        return real_commit(lake, table, data, **kw)

    monkeypatch.setattr("gemline.lake.commit_once", commit_or_crash)
    with pytest.raises(OSError, match="simulated crash"):
        run_ingest(*ingest_args(cfg), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    assert committed_version(cfg.lake, "late_events", app_id_for(topic)) == 1
    monkeypatch.setattr("gemline.lake.commit_once", real_commit)
    recovered = run_ingest(*ingest_args(cfg), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    assert recovered.recovered and (recovered.events_written, recovered.late_events_written) == (1, 0)
    assert recovered.duplicates_dropped == 1
    assert read_table(cfg.lake, "late_events")["event_id"].to_pylist() == ["e2"]
    assert sorted(read_table(cfg.lake, "events")["event_id"].to_pylist()) == ["e0", "e1", "e3"]
    meta = commit_metadata(cfg.lake, "events", app_id_for(topic))
    assert (meta["late_events"], meta["duplicates_dropped"]) == (1, 1)
