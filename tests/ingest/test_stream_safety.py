"""No message or accident may block the stream or skip data silently (issue 16), against the embedded
broker with messages produced by a plain confluent-kafka producer.

Each test names the finding it guards: poison pills, a lagging high watermark, a recreated topic,
a changed partition count, a retention gap, a config change between a crash and its recovery,
and the accounting invariant over random mixes of messages, codecs and producer batching.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

import ingest.kafka_source as kafka_source
import ingest.pipeline as pipeline
from gemline.config import GemlineConfig
from gemline.lake import commit_metadata, committed_version, read_table
from ingest.broker import EmbeddedBroker
from ingest.config import IngestConfig, KafkaConfig
from ingest.kafka_clients import KafkaRecord
from ingest.kafka_source import Fingerprint, TopicChangedError, TopicIdentity, plan_topic
from ingest.pipeline import app_id_for, run_ingest
from ingest.replay import ensure_topic
from ingest.schema import Event
from tests.conftest import ingest_args

NOW_MS = 1_750_000_000_000  # fixed ingest clock: 2025-06-15T15:06:40Z
BASE_MS = 1_749_000_000_000
_ids = itertools.count()


@pytest.fixture(scope="module")
def broker():
    with EmbeddedBroker() as b:
        yield b


def _topic(broker, partitions: int = 2) -> str:
    name = f"safety-{next(_ids)}"
    ensure_topic(broker.bootstrap, name, partitions)
    return name


def _config(lake, topic: str, **ingest) -> GemlineConfig:
    return GemlineConfig(lake=str(lake), kafka=KafkaConfig(topic=topic), ingest=IngestConfig(**ingest))


def _event(i: int, **over) -> bytes:
    fields = dict(event_id=f"e{i}", event_time_ms=BASE_MS + i * 1000, user_id=f"u{i % 7}", item_id=f"i{i}",
                  domain="facebook", event_type="impression")
    fields.update(over)
    return Event(**fields).to_json()


def _produce(bootstrap: str, topic: str, messages: list[tuple[bytes | None, bytes | None]], *, partition: int = 0,
             **conf) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": False, **conf})
    for key, value in messages:
        producer.produce(topic, key=key, value=value, partition=partition)
    assert producer.flush(60) == 0


def _counts(lake) -> dict[str, int]:
    return {t: (0 if (tab := read_table(lake, t)) is None else tab.num_rows)
            for t in ("events", "dead_letter", "late_events")}


def test_poison_pills_are_dead_lettered_and_the_events_after_them_ingested(broker, tmp_path):
    topic = _topic(broker, 1)
    poison = [
        (b"u1", b'{"event_id": "\\ud800", "event_time_ms": 1749000000000, "user_id": "u", "item_id": "i", '
                b'"domain": "facebook", "event_type": "click"}'),  # crashed ParseBatches on every rerun
        (b"\xed\xa0\x80", _event(900)),  # a raw surrogate in the key
        (b"u2", None),  # a tombstone
        (b"u3", b""),  # an empty value
        (b"u4", b'{"a": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"),  # deeper than Python's json reads
        (b"u5", b"{" + b" " * (3 << 20) + b"}"),  # 3 MiB, above ingest.max_message_bytes (1 MiB)
    ]
    messages = [(b"u0", _event(i)) for i in range(3)] + poison + [(b"u0", _event(i)) for i in range(3, 8)]
    _produce(broker.bootstrap, topic, messages, **{"message.max.bytes": 10 << 20})
    lake = tmp_path / "lake"
    res = run_ingest(*ingest_args(_config(lake, topic)), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    assert (res.events_written, res.dead_letter_written) == (8, 6)
    events = read_table(lake, "events")
    assert sorted(events["event_id"].to_pylist()) == sorted(f"e{i}" for i in range(8))
    dead = sorted(read_table(lake, "dead_letter").to_pylist(), key=lambda r: r["kafka_offset"])
    assert [(r["kafka_offset"], r["reason"], r["kafka_key"]) for r in dead] == [
        (3, "lone_surrogate", b"u1"), (4, "lone_surrogate", b"\xed\xa0\x80"), (5, "tombstone", b"u2"),
        (6, "not_json", b"u3"), (7, "too_deep", b"u4"), (8, "too_large", b"u5")]
    assert dead[5]["raw"] == b"{" + b" " * 1023 and str((3 << 20) + 2) in dead[5]["detail"]
    assert not (lake / "_staging" / "ingest" / "0").exists(), "a finished batch leaves no staging folder"


def test_a_message_above_librdkafkas_default_receive_limit_is_read(broker, tmp_path):
    # 101 MB: above librdkafka's default receive.message.max.bytes (100 MB), "Invalid response size" before.
    topic = _topic(broker, 1)
    big = b"x" * 101_000_000
    _produce(broker.bootstrap, topic, [(b"u0", _event(0)), (b"u1", big), (b"u0", _event(1))],
             **{"message.max.bytes": 200_000_000})
    del big
    lake = tmp_path / "lake"
    res = run_ingest(*ingest_args(_config(lake, topic, read_timeout_s=60)), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    assert (res.events_written, res.dead_letter_written) == (2, 1)
    row, = read_table(lake, "dead_letter").to_pylist()
    assert row["reason"] == "too_large" and len(row["raw"]) == 1024 and "101000000 bytes" in row["detail"]


def test_one_ingest_reads_everything_a_batching_producer_wrote(broker, tmp_path):
    # tansu reports the high watermark as (base offset of the last record batch) + 1: with 500-message
    # batches one ingest used to write 1,502 of 2,000 and leave the rest until more data arrived.
    topic = _topic(broker, 1)
    _produce(broker.bootstrap, topic, [(b"u", _event(i)) for i in range(2000)],
             **{"linger.ms": 200, "batch.num.messages": 500})
    lake = tmp_path / "lake"
    res = run_ingest(*ingest_args(_config(lake, topic)), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    assert res.events_written == 2000
    assert res.offset_ranges[0].end == 2000
    assert run_ingest(*ingest_args(_config(lake, topic)), bootstrap=broker.bootstrap, now_ms=NOW_MS).skipped
    _produce(broker.bootstrap, topic, [(b"u", _event(i)) for i in range(2000, 2700)],
             **{"linger.ms": 200, "batch.num.messages": 500})
    assert run_ingest(*ingest_args(_config(lake, topic)), bootstrap=broker.bootstrap,
                      now_ms=NOW_MS).events_written == 700
    assert read_table(lake, "events").num_rows == 2700


def _recreate(broker, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    admin.delete_topics([topic])[topic].result(timeout=30)
    deadline = time.monotonic() + 30
    while True:
        try:
            admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])[topic].result(30)
            return
        except Exception:  # noqa: BLE001 -- the deletion may still be under way
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_a_recreated_topic_is_refused_until_reset_deliberately(broker, tmp_path):
    topic = _topic(broker, 1)
    _produce(broker.bootstrap, topic, [(b"u", _event(i)) for i in range(100)])
    lake = tmp_path / "lake"
    assert run_ingest(*ingest_args(_config(lake, topic)), bootstrap=broker.bootstrap,
                      now_ms=NOW_MS).events_written == 100
    _recreate(broker, topic, 1)
    _produce(broker.bootstrap, topic, [(b"u", _event(i)) for i in range(1000, 1130)])  # longer than the old one
    with pytest.raises(TopicChangedError, match=f"{topic}.*--reset-topic"):
        run_ingest(*ingest_args(_config(lake, topic)), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    assert read_table(lake, "events").num_rows == 100, "nothing was read from the new topic"

    res = run_ingest(*ingest_args(_config(lake, topic)), bootstrap=broker.bootstrap, now_ms=NOW_MS, reset_topic=True)
    assert res.reset and res.events_written == 130
    from gemline.errors import BadConfigError

    with pytest.raises(BadConfigError, match="is the one the lake read.*nothing to reset"):
        run_ingest(*ingest_args(_config(lake, topic)), bootstrap=broker.bootstrap, now_ms=NOW_MS, reset_topic=True)
    meta = commit_metadata(lake, "events", app_id_for(topic))
    assert meta["reset"]["previous_end_offsets"] == {"0": 100}
    assert meta["end_offsets"] == {"0": 130}
    assert read_table(lake, "events").num_rows == 230
    assert run_ingest(*ingest_args(_config(lake, topic)), bootstrap=broker.bootstrap, now_ms=NOW_MS).skipped


def test_a_recreated_topic_via_the_cli_is_one_line_naming_the_reset(broker, tmp_path, capsys):
    from gemline.cli import main

    topic = _topic(broker, 1)
    _produce(broker.bootstrap, topic, [(b"u", _event(i)) for i in range(5)])
    argv = ["ingest", "--bootstrap", broker.bootstrap, "--topic", topic, "--lake", str(tmp_path / "lake")]
    assert main(argv) == 0
    _recreate(broker, topic, 1)
    _produce(broker.bootstrap, topic, [(b"u", _event(i)) for i in range(10, 17)])
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and topic in err[0] and "gemline ingest --reset-topic" in err[0]
    assert main([*argv, "--reset-topic"]) == 0
    assert read_table(tmp_path / "lake", "events").num_rows == 12


class _FakeTopic:
    """A client over an in-memory partition log: {partition: (low, [records from low on])}."""

    def __init__(self, logs: dict[int, tuple[int, list[KafkaRecord]]], topic_id: str | None = None):
        self.logs, self.id = logs, topic_id

    def end_offsets(self, topic):
        return {p: (low, low + len(recs)) for p, (low, recs) in self.logs.items()}

    def topic_id(self, topic):
        return self.id

    def fetch(self, topic, partition, offset, *, max_records, timeout_s):
        low, recs = self.logs[partition]
        return [r for r in recs if r.offset >= offset][:max_records]

    def close(self):
        pass


def _log(partition: int, low: int, n: int, tag: bytes = b"v") -> tuple[int, list[KafkaRecord]]:
    return low, [KafkaRecord("t", partition, o, b"k", tag + b"%d" % o, 1_000 + o) for o in range(low, low + n)]


def test_plan_topic_reports_a_retention_gap_and_checks_fingerprints(monkeypatch):
    fake = _FakeTopic({0: _log(0, 40, 20), 1: _log(1, 0, 5)}, topic_id="id-1")
    monkeypatch.setattr(kafka_source, "make_client", lambda *a, **k: fake)
    monkeypatch.setattr(kafka_source, "PROBE_TIMEOUT_S", 0.05)
    first = TopicIdentity("id-1", 2, {1: Fingerprint.of(fake.logs[1][1][2])})
    snap = plan_topic("unused:1", "t", {0: 30, 1: 3}, previous=first)
    assert snap.gaps == {0: (30, 40)}  # offsets 30..39 were deleted before they were ingested
    assert [(r.partition, r.start, r.end) for r in snap.ranges] == [(0, 40, 60), (1, 3, 5)]
    assert snap.identity.last[0] == Fingerprint.of(fake.logs[0][1][-1])
    assert snap.identity.last[1].offset == 4

    with pytest.raises(TopicChangedError, match="recreated: its id is id-1, the lake's offsets are of id-2"):
        plan_topic("unused:1", "t", {}, previous=dataclasses.replace(first, topic_id="id-2"))
    with pytest.raises(TopicChangedError, match="has 2 partitions, the lake's offsets are of 3"):
        plan_topic("unused:1", "t", {}, previous=dataclasses.replace(first, partitions=3))
    other = _FakeTopic({0: _log(0, 40, 20), 1: _log(1, 0, 5, tag=b"other")}, topic_id=None)
    monkeypatch.setattr(kafka_source, "make_client", lambda *a, **k: other)
    with pytest.raises(TopicChangedError, match=r"t\[1\]: the record at offset 2 is not the one ingested"):
        plan_topic("unused:1", "t", {1: 3}, previous=first)
    shorter = _FakeTopic({0: _log(0, 0, 1), 1: _log(1, 0, 1)})
    monkeypatch.setattr(kafka_source, "make_client", lambda *a, **k: shorter)
    with pytest.raises(TopicChangedError, match="offsets went backwards"):
        plan_topic("unused:1", "t", {1: 3}, previous=first)


def test_a_gap_exits_non_zero_unless_accepted(monkeypatch, tmp_path, capsys):
    from gemline import cli

    gap = pipeline.IngestResult(3, 10, 0, (), skipped=False, gaps=((0, 30, 40),))
    monkeypatch.setattr(pipeline, "run_ingest", lambda *a, **k: gap)
    argv = ["ingest", "--bootstrap", "127.0.0.1:9", "--topic", "t", "--lake", str(tmp_path)]
    assert cli.main(argv) == 4
    assert "10 record(s) of t were deleted by retention" in capsys.readouterr().err
    assert cli.main([*argv, "--set", "ingest.accept_gaps=true"]) == 0


def test_recovery_decides_with_the_crashed_batchs_settings(broker, tmp_path, monkeypatch, caplog):
    topic = _topic(broker, 2)
    msgs = [(b"u0", _event(i, domain="facebook" if i % 2 else "instagram")) for i in range(10)]
    _produce(broker.bootstrap, topic, msgs)
    clean, crashy = tmp_path / "clean", tmp_path / "crashy"
    run_ingest(*ingest_args(_config(clean, topic)), bootstrap=broker.bootstrap, now_ms=NOW_MS)

    real_commit = pipeline.commit

    def crash(lake, table, *args, **kwargs):  # the registry's commit: dead_letter lands, the next one dies
        if table != "dead_letter":
            raise KeyboardInterrupt("killed between the dead_letter and events commits")
        return real_commit(lake, table, *args, **kwargs)

    monkeypatch.setattr(pipeline, "commit", crash)
    with pytest.raises(KeyboardInterrupt):
        run_ingest(*ingest_args(_config(crashy, topic)), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    monkeypatch.setattr(pipeline, "commit", real_commit)
    assert committed_version(crashy, "dead_letter", app_id_for(topic)) == 0
    assert committed_version(crashy, "events", app_id_for(topic)) is None

    # Between the crash and its recovery someone drops instagram: the batch must still be decided as planned.
    changed = _config(crashy, topic, domains=("facebook",), allowed_lateness_ms=0)
    res = run_ingest(*ingest_args(changed), bootstrap=broker.bootstrap, now_ms=NOW_MS + 86_400_000)
    assert res.recovered and set(res.rules_changed) == {"domains", "allowed_lateness_ms"}
    warned = [r.getMessage() for r in caplog.records if r.name == "ingest.pipeline" and r.levelname == "WARNING"]
    assert len(warned) == 1 and warned[0].endswith(
        f"overriding at run time ingest.domains=('facebook',) configured, {IngestConfig().domains!r} used; "
        "ingest.allowed_lateness_ms=0 configured, 86400000 used (the configured values apply from the next batch)"), warned
    assert _counts(crashy) == _counts(clean) == {"events": 10, "dead_letter": 0, "late_events": 0}
    # The new settings apply from the next batch on.
    _produce(broker.bootstrap, topic, [(b"u0", _event(50, domain="instagram"))])
    nxt = run_ingest(*ingest_args(changed), bootstrap=broker.bootstrap, now_ms=NOW_MS)
    assert (nxt.events_written, nxt.dead_letter_written, nxt.rules_changed) == (0, 1, ())
    assert commit_metadata(crashy, "events", app_id_for(topic))["rules"]["domains"] == ["facebook"]


POISON = [None, b"", b"{oops", b'{"x": "\\udc00"}', b"[" * 50 + b"]" * 50, b"\xed\xa0\x80", b"{" + b"a" * 1500 + b"}"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_produced_message_is_accounted_for(broker, tmp_path, seed):
    """events + dead_letter + late_events + dropped duplicates == produced, message by message, over random
    mixes of valid and poison messages, compression codecs and producer batching."""
    rng = random.Random(seed)
    topic = _topic(broker, 3)
    messages = []
    for i in range(rng.randint(150, 400)):
        roll = rng.random()
        if roll < 0.15:
            value = rng.choice(POISON)
        elif roll < 0.25 and i:
            value = _event(rng.randrange(i))  # a redelivery of an earlier event: a duplicate
        elif roll < 0.3:
            value = _event(i, event_time_ms=BASE_MS - 10 * 86_400_000)  # far behind: late once a watermark exists
        else:
            value = _event(i)
        messages.append((b"k%d" % rng.randrange(5), value))
    codec = rng.choice(["none", "gzip", "snappy", "lz4", "zstd"])
    conf = {"compression.type": codec, "linger.ms": rng.choice([0, 5, 50]),
            "batch.num.messages": rng.choice([1, 7, 100, 1000])}
    cut = len(messages) // 2
    lake = tmp_path / "lake"
    cfg = _config(lake, topic, max_message_bytes=1024)
    results = []
    for chunk in (messages[:cut], messages[cut:]):
        _produce(broker.bootstrap, topic, chunk, partition=rng.randrange(3), **conf)
        results.append(run_ingest(*ingest_args(cfg), bootstrap=broker.bootstrap, now_ms=NOW_MS))
    counts = _counts(lake)
    dropped = sum(r.duplicates_dropped for r in results)
    assert counts["events"] + counts["dead_letter"] + counts["late_events"] + dropped == len(messages), (codec, conf)
    coords = set()
    for table in ("events", "dead_letter", "late_events"):
        t = read_table(lake, table)
        if t is not None:
            coords |= set(zip(t["kafka_partition"].to_pylist(), t["kafka_offset"].to_pylist()))
    assert len(coords) == counts["events"] + counts["dead_letter"] + counts["late_events"], "no message written twice"
    reasons = read_table(lake, "dead_letter")["reason"].to_pylist() if counts["dead_letter"] else []
    assert reasons.count("too_large") == sum(1 for _, v in messages if v is not None and len(v) > 1024)
    assert reasons.count("tombstone") == sum(1 for _, v in messages if v is None)


def test_sigterm_stops_a_command_as_ctrl_c_does(monkeypatch, capsys, tmp_path):
    import os
    import signal

    from gemline import cli

    def slow_ingest(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # a service manager stopping the job mid-run
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the command")

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(pipeline, "run_ingest", slow_ingest)
    try:
        rc = cli.main(["ingest", "--bootstrap", "127.0.0.1:9", "--topic", "t", "--lake", str(tmp_path)])
    finally:
        signal.signal(signal.SIGTERM, before)
    assert rc == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("interrupted: ingest stopped")


def test_ctrl_c_inside_a_beam_step_is_not_logged_with_its_traceback(capsys, caplog):
    import logging

    from gemline import cli

    cli._quiet_interrupts()
    beam_log = logging.getLogger("apache_beam.runners.common")
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        beam_log.exception("KeyboardInterrupt [while running 'ParseBatches/ParseBatch/ParDo(_ParseBatchFn)']")
    try:
        raise ValueError("a real bug")
    except ValueError:
        beam_log.exception("ValueError [while running 'ParseBatches']")
    messages = [r.getMessage() for r in caplog.records if r.name == "apache_beam.runners.common"]
    assert messages == ["ValueError [while running 'ParseBatches']"], "only the interrupt is dropped"
