"""Ingesters as a Kafka consumer group (``ingest.partition_assignment = "group"``), on the Tansu broker
and PostgreSQL: two ingesters share the partitions; one is SIGKILLed in the middle of a stream of
20,000 events and restarted; every completion and feedback row is written exactly once."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from realtime_rl.event_samples import sample_stream
from realtime_rl.schema import upgrade
from tests.ingest_fixtures import counts, make_settings, rows

pytestmark = [pytest.mark.kafka, pytest.mark.postgres]

EVENTS = 20_000


def _start(env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, "-m", "rtrl", "ingest"], env=env, stdout=f, stderr=f)


def _assignments(log: Path, topic: str) -> list[list[int]]:
    """Every set of ``topic``'s partitions the member writing ``log`` was given, oldest first."""
    pattern = re.compile(r"rebalance \(assigned\): holding " + re.escape(topic) + r" \[([\d, ]*)\]")
    found = pattern.findall(log.read_text()) if log.exists() else []
    return [[int(p) for p in f.split(",") if p.strip()] for f in found]


def _holds(log: Path, topic: str) -> list[int]:
    found = _assignments(log, topic)
    return found[-1] if found else []


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_two_ingesters_share_partitions_and_a_killed_one_loses_and_duplicates_nothing(
        kafka_bootstrap: str, postgres_url: str, tmp_path: Path) -> None:
    from realtime_rl.bus import open_producer

    group = f"ingest-{uuid.uuid4().hex[:6]}"
    s = make_settings(tmp_path, postgres_url, bus={"backend": "kafka", "bootstrap_servers": kafka_bootstrap,
                                                   "partitions": 4},
                      ingest={"partition_assignment": "group", "group": group, "batch_max_records": 400})
    upgrade(postgres_url)
    stream = sample_stream(EVENTS, seed=11)
    env = {**os.environ, "RTRL_BUS__BACKEND": "kafka", "RTRL_BUS__BOOTSTRAP_SERVERS": kafka_bootstrap,
           "RTRL_BUS__EVENTS_TOPIC": s.bus.events_topic, "RTRL_BUS__VERSIONS_TOPIC": s.bus.versions_topic,
           "RTRL_BUS__PARTITIONS": "4", "RTRL_DB__URL": postgres_url, "RTRL_INGEST__GROUP": group,
           "RTRL_INGEST__PARTITION_ASSIGNMENT": "group", "RTRL_INGEST__BATCH_MAX_RECORDS": "400",
           "RTRL_INGEST__POLL_TIMEOUT_S": "0.2", "RTRL_VAR_DIR": str(tmp_path / "var"),
           # a dead member is noticed after the session timeout: short, to keep the test short
           "RTRL_BUS__SESSION_TIMEOUT_MS": "3000", "RTRL_BUS__HEARTBEAT_INTERVAL_MS": "500"}
    env.pop("RTRL_CONFIG", None)
    with open_producer(s.bus) as producer:  # the topics exist before the members join
        producer.send(s.bus.events_topic, stream.messages[0][1], key=stream.messages[0][0])
        producer.flush()
    logs = {name: tmp_path / f"ingest-{name}.log" for name in ("a", "b")}
    procs = {name: _start(env, log) for name, log in logs.items()}
    try:
        topic = s.bus.events_topic
        _wait(lambda: _holds(logs["a"], topic) and _holds(logs["b"], topic)
              and sorted(_holds(logs["a"], topic) + _holds(logs["b"], topic)) == [0, 1, 2, 3], 60,
              "both ingesters to hold partitions")

        sent = [1]

        def produce() -> None:  # a steady stream, ~5k events a second
            with open_producer(s.bus) as p:
                for i in range(1, EVENTS, 500):
                    for key, value in stream.messages[i:i + 500]:
                        p.send(s.bus.events_topic, value, key=key)
                    p.flush()
                    sent[0] = min(EVENTS, i + 500)
                    time.sleep(0.1)

        producer_thread = threading.Thread(target=produce)
        producer_thread.start()
        # Kill one member once rows are flowing, while most of the stream is still to come.
        _wait(lambda: counts(postgres_url, "completions")["completions"] >= len(stream.completions) // 5, 60,
              "rows from both ingesters")
        procs["a"].send_signal(signal.SIGKILL)
        procs["a"].wait(10)
        killed_at = sent[0]
        _wait(lambda: sent[0] >= min(EVENTS, killed_at + EVENTS // 4), 60, "more events while one member is dead")
        procs["a"] = _start(env, logs["a"])
        producer_thread.join(120)
        assert killed_at < EVENTS * 0.8, "the kill did not land in the middle of the stream"
        _wait(lambda: counts(postgres_url, "completions", "feedback") == {
            "completions": len(stream.completions), "feedback": len(stream.feedback)}, 90, "every row")
        _wait(lambda: len(_assignments(logs["a"], topic)) >= 2 and _holds(logs["a"], topic), 60,
              "the restarted ingester to rejoin")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert counts(postgres_url, "completions", "feedback", "training_examples", "dead_letters") == {
        "completions": len(stream.completions), "feedback": len(stream.feedback),
        "training_examples": len(stream.expected_examples()), "dead_letters": 0}
    examples = dict(rows(postgres_url, "SELECT completion_id, feedback_event_id FROM training_examples"))
    assert examples == {cid: fb.event_id for cid, fb in stream.expected_examples().items()}
    offsets = rows(postgres_url, "SELECT SUM(next_offset) FROM consumer_offsets WHERE group_id = :g AND topic = :t",
                   g=group, t=s.bus.events_topic)
    assert offsets[0][0] == EVENTS
