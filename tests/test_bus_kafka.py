"""The Kafka backend against a real Kafka-protocol broker (Tansu), with kafka-python."""

from __future__ import annotations

import time
import uuid

import pytest

from realtime_rl.bus import BusUnavailable, open_consumer, open_producer
from realtime_rl.bus.embedded import kafka_partition
from realtime_rl.config import BusSettings
from rtrl import devservices

pytestmark = pytest.mark.kafka


def _settings(bootstrap: str, **kw) -> BusSettings:
    return BusSettings(**{"backend": "kafka", "bootstrap_servers": bootstrap, "partitions": 3, **kw})


def _drain(consumer, expect: int, timeout_s: float = 15.0):
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < expect and time.monotonic() < deadline:
        out.extend(consumer.poll(timeout_s=0.3))
    return out


def test_topics_are_created_and_keys_partition_as_on_the_embedded_bus(kafka_bootstrap: str) -> None:
    s = _settings(kafka_bootstrap)
    topic = f"t-{uuid.uuid4().hex[:8]}"
    with open_consumer(s, "g1") as consumer:
        assert consumer.partitions(topic) == [0, 1, 2]  # created with bus.partitions
        with open_producer(s) as producer:
            for i in range(60):
                producer.send(topic, f"{i}".encode(), key=f"completion-{i % 11}".encode())
            producer.flush()
        consumer.assign({(topic, p): 0 for p in range(3)})
        records = _drain(consumer, 60)
    assert sorted(int(r.value) for r in records) == list(range(60))
    for r in records:
        # Same key, same partition, on both backends: ordering per completion id is the same.
        assert r.partition == kafka_partition(r.key, 3)
    last_by_key: dict[bytes, int] = {}
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        assert int(r.value) > last_by_key.get(r.key, -1)
        last_by_key[r.key] = int(r.value)


def test_assign_seeks_to_stored_positions(kafka_bootstrap: str) -> None:
    s = _settings(kafka_bootstrap, partitions=1)
    topic = f"t-{uuid.uuid4().hex[:8]}"
    with open_producer(s) as producer:
        for i in range(10):
            producer.send(topic, str(i).encode(), key=b"one")
            producer.flush()  # one batch per message, so the broker's offsets are per record
    with open_consumer(s, "g2") as consumer:
        consumer.assign({(topic, 0): 6})
        assert [int(r.value) for r in _drain(consumer, 4)] == [6, 7, 8, 9]
        assert consumer.end_offsets(topic) == {0: 10}


def test_unreachable_broker_raises_bus_unavailable_within_the_timeout() -> None:
    s = _settings(f"127.0.0.1:{devservices.free_port()}", send_timeout_s=1.0)
    producer = open_producer(s)  # lazy: opening never blocks on the network
    t0 = time.monotonic()
    with pytest.raises(BusUnavailable):
        producer.send("events", b"x", key=b"k")
    assert time.monotonic() - t0 < 6
    producer.close()


def test_a_cut_network_path_fails_flush_then_recovers(kafka_bootstrap: str) -> None:
    proxy = devservices.start_tansu_proxy(kafka_bootstrap)
    try:
        s = _settings(proxy.bootstrap, send_timeout_s=1.0, request_timeout_ms=1000, delivery_timeout_ms=2000,
                      reconnect_backoff_max_ms=200)
        topic = f"t-{uuid.uuid4().hex[:8]}"
        producer = open_producer(s)
        for i in range(30):
            producer.send(topic, b"before", key=f"k{i}".encode())
        producer.flush()
        proxy.stop()
        t0 = time.monotonic()
        with pytest.raises(BusUnavailable):
            for _ in range(3):  # batches on every partition expire while the path is down
                for i in range(100):
                    producer.send(topic, b"during", key=f"k{i}".encode())
                producer.flush()
        assert time.monotonic() - t0 < 10
        proxy.start()
        deadline = time.monotonic() + 15
        while True:  # what the gateway does: resend until the path is back
            try:
                for i in range(100):
                    producer.send(topic, b"after", key=f"k{i}".encode())
                producer.flush()
                break
            except BusUnavailable:
                assert time.monotonic() < deadline, "the producer did not recover after the path came back"
                time.sleep(0.2)
        producer.close()
        with open_consumer(s, "g3") as consumer:
            consumer.assign({(topic, p): 0 for p in consumer.partitions(topic)})
            values = [r.value for r in _drain(consumer, 130)]
        assert values.count(b"before") == 30 and values.count(b"after") == 100
    finally:
        proxy.stop()
