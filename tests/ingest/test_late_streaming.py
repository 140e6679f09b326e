"""A late event under streaming ingest: it goes to ``late_events``, not ``events``, and stays there; later
micro-batches and builds leave it out, and ``backfill --late-events`` is the one way back into ``events``.

(The bounded-ingest case and the backfill's own guarantees are tests/ingest/test_pipeline.py and
tests/ingest/test_backfill.py; this is the streaming loop and the build after it.)
"""

from __future__ import annotations

import pytest
from confluent_kafka import Producer

from gemline.config import GemlineConfig
from gemline.lake import read_table
from ingest.backfill import backfill_late_events
from ingest.broker import EmbeddedBroker
from ingest.config import IngestConfig, KafkaConfig
from ingest.replay import ensure_topic
from ingest.schema import Event
from ingest.streaming import StreamingConfig, run_streaming
from sequences.config import BuildConfig
from sequences.pipeline import run_build
from tests.conftest import build_args, ingest_args

BASE_MS = 1_749_000_000_000
MINUTE = 60_000
LATENESS_MS = 10 * MINUTE


def _event(event_id: str, t_ms: int, event_type: str = "impression") -> bytes:
    return Event(event_id=event_id, event_time_ms=t_ms, user_id="u0", item_id=f"i-{event_id}", domain="facebook",
                 event_type=event_type, position=1).to_json()


def _produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
    for value in values:  # one key: one partition, so one watermark, in this order
        producer.produce(topic, key=b"u0", value=value)
    assert producer.flush(30) == 0


def _ids(lake: str, table: str) -> list[str]:
    rows = read_table(lake, table, columns=["event_id"])
    return sorted(rows["event_id"].to_pylist()) if rows is not None else []


@pytest.fixture(scope="module")
def broker():
    with EmbeddedBroker() as b:
        yield b


@pytest.mark.integration
@pytest.mark.slow
def test_a_late_event_stays_in_late_events_until_backfilled(broker, tmp_path):
    topic = "late-stream"
    ensure_topic(broker.bootstrap, topic, 1)
    config = GemlineConfig(lake=str(tmp_path / "lake"), kafka=KafkaConfig(topic=topic, partitions=1),
                           ingest=IngestConfig(allowed_lateness_ms=LATENESS_MS),
                           build=BuildConfig(events_gate="off", click_window_ms=MINUTE, conversion_window_ms=MINUTE))
    lake = config.lake
    # Batch 0 sets the watermark at BASE + 30 min; batch 1 brings an event 20 min behind it (late: allowed 10)
    # and one 5 min behind it (on time); batch 2 brings nothing.
    batches = {0: [_event("a", BASE_MS), _event("b", BASE_MS + 30 * MINUTE)],
               1: [_event("late", BASE_MS + 10 * MINUTE), _event("ontime", BASE_MS + 25 * MINUTE)]}
    _produce(broker.bootstrap, topic, batches[0])

    def on_batch(result):
        if result.batch_version + 1 in batches:
            _produce(broker.bootstrap, topic, batches[result.batch_version + 1])

    summary = run_streaming(*ingest_args(config), StreamingConfig(commit_interval_s=0.01, max_batches=3),
                            bootstrap=broker.bootstrap, on_batch=on_batch)
    assert (summary.committed, summary.events_written, summary.late_events_written) == ([0, 1], 3, 1)
    assert _ids(lake, "events") == ["a", "b", "ontime"] and _ids(lake, "late_events") == ["late"]
    late = read_table(lake, "late_events").to_pylist()[0]
    assert (late["watermark_ms"], late["lateness_ms"]) == (BASE_MS + 30 * MINUTE, 20 * MINUTE)

    run_build(*build_args(config), final=True)
    examples = read_table(lake, "examples", columns=["example_id"])["example_id"].to_pylist()
    sequence, = read_table(lake, "sequences").to_pylist()
    assert sorted(examples) == ["a", "b", "ontime"] and "late" not in sequence["seq_event_ids"]

    # Another streaming cycle with nothing new and another build: the late row stays where it is.
    again = run_streaming(*ingest_args(config), StreamingConfig(commit_interval_s=0.01, max_batches=1),
                          bootstrap=broker.bootstrap)
    assert again.committed == [] and _ids(lake, "late_events") == ["late"] and "late" not in _ids(lake, "events")
    assert run_build(*build_args(config), final=True).skipped

    # The explicit way back: the backfill re-admits it into events, once; the next build sees it.
    assert backfill_late_events(*ingest_args(config)).rows_readmitted == 1
    assert _ids(lake, "events") == ["a", "b", "late", "ontime"] and _ids(lake, "late_events") == ["late"]
    run_build(*build_args(config), final=True)
    sequence, = read_table(lake, "sequences").to_pylist()
    assert "late" in sequence["seq_event_ids"]
