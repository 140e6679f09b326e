"""The embedded broker starts, serves Kafka clients, and stops."""

import socket

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from ingest.broker import EmbeddedBroker

pytestmark = pytest.mark.integration


def _accepts(host, port):
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def test_produce_consume_roundtrip_and_clean_stop():
    with EmbeddedBroker() as broker:
        host, port = broker.bootstrap.split(":")
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        for future in admin.create_topics([NewTopic("t", num_partitions=2, replication_factor=1)]).values():
            future.result(timeout=10)
        producer = Producer({"bootstrap.servers": broker.bootstrap, "batch.num.messages": 1, "linger.ms": 0})
        sent = {f"v{i}".encode() for i in range(50)}
        for value in sorted(sent):
            producer.produce("t", key=value[-1:], value=value)
        assert producer.flush(10) == 0
        consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "g", "enable.auto.commit": False})
        got = []
        for partition in (0, 1):
            low, high = consumer.get_watermark_offsets(TopicPartition("t", partition), timeout=10)
            consumer.assign([TopicPartition("t", partition, low)])
            while len(got) < 50:
                batch = consumer.consume(100, timeout=2)
                if not batch:
                    break
                got.extend(m.value() for m in batch if m.error() is None and m.offset() < high)
        consumer.close()
        assert sorted(got) == sorted(sent)
    assert not _accepts(host, int(port))


def test_port_in_use_is_a_clear_error():
    with EmbeddedBroker() as first:
        with pytest.raises(RuntimeError, match="already in use"):
            EmbeddedBroker(port=first.port).start()


def test_broker_dies_with_a_killed_parent():
    """A job killed by SIGKILL (no chance to stop the broker) leaves no orphaned broker behind."""
    import os
    import signal
    import subprocess
    import sys
    import time

    code = ("import sys, time; from ingest.broker import EmbeddedBroker; b = EmbeddedBroker().start(); "
            "print(b._proc.pid, b.port, flush=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid, port = map(int, parent.stdout.readline().split())
    assert _accepts("127.0.0.1", port)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 30  # liveness bound only: the kernel signals the broker at once
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)  # still there (or a zombie until init reaps it)?
        except ProcessLookupError:
            break
        if not _accepts("127.0.0.1", port):
            break
        time.sleep(0.1)
    assert not _accepts("127.0.0.1", port)
