"""No completion record lost when the Kafka path goes down and comes back (real Tansu broker + proxy)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from serving_fixtures import PROMPT, gateway_settings

from rtrl import devservices


@pytest.mark.kafka
def test_gateway_spills_while_kafka_is_unreachable_and_replays(tmp_path, tiny_model_dir, kafka_bootstrap):
    from kafka import KafkaConsumer, TopicPartition

    from serving.auth import create_api_key
    from serving.server import GatewayServer

    proxy = devservices.start_tansu_proxy(kafka_bootstrap)
    topic = f"events-{time.time_ns()}"
    bus = {"backend": "kafka", "bootstrap_servers": proxy.bootstrap, "events_topic": topic, "partitions": 2,
           "request_timeout_ms": 1000, "delivery_timeout_ms": 2000, "send_timeout_s": 1.0,
           "reconnect_backoff_max_ms": 200}
    settings = gateway_settings(tmp_path, tiny_model_dir, bus=bus, bus_retry_s=0.3)
    key = create_api_key(settings, "kafka-user")
    served: list[str] = []
    server = GatewayServer(settings).start()
    try:
        def ask(n: int) -> None:
            r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": "tiny-coder", "prompt": PROMPT, "max_tokens": 3, "n": n}, timeout=30)
            assert r.status_code == 200, r.text
            served.extend(ch["completion_id"] for ch in r.json()["choices"])

        for _ in range(3):
            ask(2)
        assert server.gateway.emitter.wait_idle(30) and server.gateway.emitter.bus_up
        proxy.stop()  # the network path to Kafka is cut
        t0 = time.perf_counter()
        for _ in range(5):
            ask(2)
        assert time.perf_counter() - t0 < 20  # responses did not wait for the bus
        deadline = time.monotonic() + 30
        while server.gateway.emitter.bus_up and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not server.gateway.emitter.bus_up
        assert server.gateway.emitter.pending > 0
        proxy.start()  # the path is back
        assert server.gateway.emitter.wait_idle(60)
        assert server.gateway.emitter.replayed > 0
    finally:
        server.stop()
        proxy.stop()

    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap, enable_auto_commit=False)
    parts = [TopicPartition(topic, p) for p in range(2)]
    consumer.assign(parts)
    consumer.seek_to_beginning(*parts)
    ends = consumer.end_offsets(parts)
    seen: list[str] = []
    deadline = time.monotonic() + 30
    while sum(consumer.position(p) for p in parts) < sum(ends.values()) and time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=500).values():
            for rec in records:
                seen.append(json.loads(rec.value)["completion_id"])
    consumer.close()
    assert len(served) == 16
    assert set(seen) == set(served)  # every completion recorded (at-least-once: duplicates allowed)
