"""Replay into Kafka: ordering and keying logic without a broker, then a round trip through tansu."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from ingest.datasets import load_records
from ingest.datasets.types import RawRecord
from ingest.kafka_source import KafkaRecord
from ingest.parse import parse_record
from ingest.replay import ReplayResult, _key_value, ensure_topic, replay, replay_dataset
from ingest.schema import Event

TAOBAO_SAMPLE = Path(__file__).resolve().parents[3] / "shared/data/taobao_userbehavior/UserBehavior_sample.csv"


def _event(user: str, time_ms: int, n: int) -> Event:
    return Event(event_id=f"t:{n}", event_time_ms=time_ms, user_id=user, item_id=str(n), domain="taobao",
                 event_type="impression")


def test_key_value_of_records():
    event = _event("u1", 5, 0)
    assert _key_value(event) == (b"u1", event.to_json())
    raw = RawRecord(value=b"not json", key=b"u2", reason_hint="x")
    assert _key_value(raw) == (b"u2", b"not json")
    with pytest.raises(TypeError, match="expected an Event or RawRecord, got dict"):
        _key_value({"user_id": "u"})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"partitions": 0}, "partitions must be >= 1, got 0"), ({"batch_messages": 0}, "batch_messages must be >= 1")],
)
def test_replay_rejects_bad_arguments(kwargs, message):
    # Unreachable bootstrap: the checks must fire before any connection is attempted.
    args = {"bootstrap": "127.0.0.1:1", "topic": "t", "partitions": 1, "progress": False, **kwargs}
    with pytest.raises(ValueError, match=message):
        replay([_event("u", 1, 0)], **args)


def test_replay_rejects_non_records_before_connecting():
    with pytest.raises(TypeError, match="got str"):
        replay(["oops"], bootstrap="127.0.0.1:1", topic="t", partitions=1, progress=False)


def _consume_all(bootstrap: str, topic: str) -> dict[int, list]:
    """Every message of ``topic`` per partition, from offset 0 to the high watermark now."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "replay-test", "enable.auto.commit": False})
    try:
        partitions = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions}
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        got: dict[int, list] = {p: [] for p in partitions}
        while any(len(got[p]) < ends[p] for p in partitions):
            msg = consumer.poll(10)
            assert msg is not None, f"timed out with {({p: len(v) for p, v in got.items()})} of {ends}"
            assert msg.error() is None, msg.error()
            got[msg.partition()].append(msg)
        return got
    finally:
        consumer.close()


@pytest.fixture(scope="module")
def broker():
    from ingest.broker import EmbeddedBroker

    with EmbeddedBroker() as running:
        yield running


@pytest.mark.integration
def test_replay_round_trip(broker):
    records = load_records("taobao", path=TAOBAO_SAMPLE)
    # A small slice: 400 events spread over the file (many users) plus the truncated last line.
    events = [r for r in records if isinstance(r, Event)][::200]
    raw = [r for r in records if isinstance(r, RawRecord)]
    result = replay(events[::-1] + raw, bootstrap=broker.bootstrap, topic="replay.rt", partitions=3, progress=False)
    assert result == ReplayResult(num_events=len(events), num_raw=1, topic="replay.rt", partitions=3)

    got = _consume_all(broker.bootstrap, "replay.rt")
    sent = Counter(_key_value(r) for r in events + raw)
    received = Counter((m.key(), m.value()) for msgs in got.values() for m in msgs)
    assert received == sent and max(received.values()) == 1  # everything exactly once
    for partition, msgs in got.items():
        times = []
        for m in msgs:
            body = json.loads(m.value())
            assert m.key() == body["user_id"].encode()  # keyed by user
            if "event_time_ms" in body:
                times.append(body["event_time_ms"])
        assert times == sorted(times), f"partition {partition} is out of event-time order"
    # One user's events all land in one partition.
    partitions_of_user = {}
    for partition, msgs in got.items():
        for m in msgs:
            assert partitions_of_user.setdefault(m.key(), partition) == partition

    # Across the stage boundary: the ingest parser accepts every Event and dead-letters the raw line.
    outcomes = Counter()
    for partition, msgs in got.items():
        for m in msgs:
            rec = KafkaRecord(topic=m.topic(), partition=partition, offset=m.offset(), key=m.key(), value=m.value(),
                              timestamp_ms=m.timestamp()[1])
            status, row = parse_record(rec, domains=("taobao",), now_ms=2**62, max_future_skew_ms=0)
            outcomes[status if status == "ok" else row["reason"]] += 1
    assert outcomes == {"ok": len(events), "missing_field": 1}


@pytest.mark.integration
def test_replay_dataset_into_existing_topic(broker):
    assert ensure_topic(broker.bootstrap, "replay.ds", 2) == 2
    assert ensure_topic(broker.bootstrap, "replay.ds", 2) == 2  # already exists: fine
    with pytest.raises(ValueError, match="exists with 2 partitions, expected 4"):
        ensure_topic(broker.bootstrap, "replay.ds", 4)
    result = replay_dataset("taobao", path=str(TAOBAO_SAMPLE), limit=30, bootstrap=broker.bootstrap,
                            topic="replay.ds", partitions=2, progress=False)
    assert (result.num_events, result.num_raw) == (30, 0)
    got = _consume_all(broker.bootstrap, "replay.ds")
    ids = sorted(json.loads(m.value())["event_id"] for msgs in got.values() for m in msgs)
    assert ids == sorted(r.event_id for r in load_records("taobao", path=TAOBAO_SAMPLE, limit=30))


@pytest.mark.integration
def test_an_interrupted_replay_counts_what_the_broker_acknowledged(broker, monkeypatch):
    import ingest.replay
    from ingest.replay import ReplayInterrupted

    class CtrlCOnThe30th(ingest.replay.Producer):
        calls = 0

        def produce(self, *args, **kwargs):
            CtrlCOnThe30th.calls += 1
            if CtrlCOnThe30th.calls == 30:
                raise KeyboardInterrupt
            return super().produce(*args, **kwargs)

    monkeypatch.setattr(ingest.replay, "Producer", CtrlCOnThe30th)
    events = [_event(f"u{n % 7}", 1_000 + n, n) for n in range(100)]
    with pytest.raises(ReplayInterrupted) as stopped:
        replay(events, bootstrap=broker.bootstrap, topic="replay.ctrlc", partitions=2, progress=False)
    assert (stopped.value.acknowledged, stopped.value.unacknowledged) == (29, 0)
    assert isinstance(stopped.value, KeyboardInterrupt), "callers that stop on Ctrl-C still stop"
    got = _consume_all(broker.bootstrap, "replay.ctrlc")
    assert sorted(m.key() + m.value() for msgs in got.values() for m in msgs) == sorted(
        k + v for k, v in map(_key_value, events[:29]))


@pytest.mark.parametrize("rate", [None, 25])
@pytest.mark.integration
def test_generate_stopped_by_a_real_sigint_prints_what_reached_the_broker(broker, monkeypatch, capsys, rate):
    """A SIGINT while the 30th message is produced (unpaced: one slice; at 25 events/s: the second slice's 5th):
    the first 30 reach the broker, the count says 30, exit 130 with the interrupt's line."""
    import signal

    import ingest.replay
    from gemline.cli import main

    class SigintOnThe30th(ingest.replay.Producer):
        calls = 0

        def produce(self, *args, **kwargs):
            SigintOnThe30th.calls += 1
            if SigintOnThe30th.calls == 30:
                signal.raise_signal(signal.SIGINT)  # the process's real handler runs, as for Ctrl-C
            return super().produce(*args, **kwargs)

    monkeypatch.setattr(ingest.replay, "Producer", SigintOnThe30th)
    topic = f"gen.sigint.{rate}"
    sets = ["--set", "generate.num_users=20", "--set", "generate.days=0.2", "--set", "generate.seed=5"]
    paced = [] if rate is None else ["--rate", str(rate)]
    previous = signal.getsignal(signal.SIGINT)
    try:
        assert main(["generate", "--bootstrap", broker.bootstrap, "--topic", topic, *paced, *sets]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    out, err = capsys.readouterr()
    assert json.loads(out) == {"produced": 30, "unacknowledged": 0, "interrupted": True, "topic": topic, "seed": 5}
    assert "\ninterrupted: generate stopped; the records it sent stay in the topic." in err  # after the progress bar
    assert sum(len(msgs) for msgs in _consume_all(broker.bootstrap, topic).values()) == 30
