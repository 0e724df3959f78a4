"""The embedded bus: a durable SQLite log shared by processes, partitioned like Kafka."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
import time
from collections import defaultdict
from pathlib import Path

import pytest

from realtime_rl.bus import BusUnavailable, open_consumer, open_producer
from realtime_rl.bus.embedded import kafka_partition, murmur2
from realtime_rl.config import BusSettings


def _settings(tmp_path: Path, **kw) -> BusSettings:
    return BusSettings(**{"embedded_path": str(tmp_path / "log" / "bus.db"), "partitions": 3,
                          "embedded_poll_interval_ms": 5, **kw})


def _read_all(settings: BusSettings, topic: str, expect: int, timeout_s: float = 10.0):
    with open_consumer(settings, "test") as consumer:
        consumer.assign({(topic, p): 0 for p in consumer.partitions(topic)})
        out, deadline = [], time.monotonic() + timeout_s
        while len(out) < expect and time.monotonic() < deadline:
            out.extend(consumer.poll(timeout_s=0.2))
        return out


def test_keyed_messages_keep_order_per_partition_like_kafka(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    with open_producer(s) as producer:
        for i in range(300):
            producer.send("events", f"{i}".encode(), key=f"c{i % 17}".encode())
        producer.flush()
    records = _read_all(s, "events", 300)
    assert len(records) == 300
    by_partition = defaultdict(list)
    for r in records:
        assert r.partition == kafka_partition(r.key, 3)
        by_partition[r.partition].append(r)
    for part in by_partition.values():
        assert [r.offset for r in part] == list(range(len(part)))  # dense, from 0
    # Per key, the values come back in send order.
    per_key = defaultdict(list)
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        per_key[r.key].append(int(r.value))
    assert all(values == sorted(values) for values in per_key.values())


def test_murmur2_and_partitions_are_kafka_pythons() -> None:
    import random

    from kafka.partitioner.default import DefaultPartitioner
    from kafka.partitioner.default import murmur2 as kafka_murmur2

    rng = random.Random(7)
    keys = [rng.randbytes(n) for n in range(40) for _ in range(50)] + [b"c7-0012345", "ü-🙂".encode()]
    assert [murmur2(k) for k in keys] == [kafka_murmur2(k) for k in keys]
    # Both buses place keyed messages themselves, where kafka-python's default partitioner would.
    for n in (1, 3, 4, 7):
        class Cluster:
            def topics(self):
                return {"t"}

            def partitions_for_topic(self, topic):
                return set(range(n))  # noqa: B023 (used within this iteration)

            available_partitions_for_topic = partitions_for_topic

        expected = [DefaultPartitioner().partition("t", k, k, b"", b"", Cluster()) for k in keys]
        assert [kafka_partition(k, n) for k in keys] == expected


def test_linger_writes_without_an_explicit_flush(tmp_path: Path) -> None:
    s = _settings(tmp_path, linger_ms=5)
    producer = open_producer(s)
    try:
        producer.send("events", b"hello", key=b"k")
        assert [r.value for r in _read_all(s, "events", 1, timeout_s=3)] == [b"hello"]
    finally:
        producer.close()


def test_log_survives_restarts_and_is_shared_between_processes(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    script = textwrap.dedent(f"""
        import sys
        from realtime_rl.bus import open_producer
        from realtime_rl.config import BusSettings
        s = BusSettings.model_validate_json({s.model_dump_json()!r})
        p = open_producer(s)
        for i in range(int(sys.argv[1]), int(sys.argv[2])):
            p.send("events", str(i).encode(), key=("k%d" % (i % 5)).encode())
        p.flush()
    """)
    subprocess.run([sys.executable, "-c", script, "0", "100"], check=True, timeout=60)
    assert len(_read_all(s, "events", 100)) == 100
    # Two writers at once: offsets stay dense and nothing is lost or duplicated.
    procs = [subprocess.Popen([sys.executable, "-c", script, str(a), str(a + 1000)]) for a in (100, 1100)]
    for p in procs:
        assert p.wait(60) == 0
    records = _read_all(s, "events", 2100)
    assert sorted(int(r.value) for r in records) == list(range(2100))
    with open_consumer(s, "x") as consumer:
        ends = consumer.end_offsets("events")
    per_partition = defaultdict(set)
    for r in records:
        per_partition[r.partition].add(r.offset)
    assert {p: len(o) for p, o in per_partition.items()} == {p: e for p, e in ends.items() if e}
    assert all(o == set(range(len(o))) for o in per_partition.values())


def test_assign_starts_at_the_given_offsets(tmp_path: Path) -> None:
    s = _settings(tmp_path, partitions=1)
    with open_producer(s) as producer:
        for i in range(10):
            producer.send("events", str(i).encode(), key=b"same")
    with open_consumer(s, "g") as consumer:
        assert consumer.partitions("events") == [0]
        assert consumer.end_offsets("events") == {0: 10}
        consumer.assign({("events", 0): 7})
        assert [int(r.value) for r in consumer.poll(timeout_s=1)] == [7, 8, 9]
        t0 = time.monotonic()
        assert consumer.poll(timeout_s=0.3) == []
        assert 0.25 <= time.monotonic() - t0 < 2


def test_flush_raises_bus_unavailable_within_the_timeout_when_the_log_is_locked(tmp_path: Path) -> None:
    s = _settings(tmp_path, send_timeout_s=0.3, linger_ms=0)
    producer = open_producer(s)
    producer.send("events", b"first", key=b"k")
    producer.flush()
    blocker = sqlite3.connect(s.embedded_path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another writer holds the lock
    try:
        producer.send("events", b"x", key=b"k")
        t0 = time.monotonic()
        with pytest.raises(BusUnavailable, match="not written"):
            producer.flush()
        assert time.monotonic() - t0 < 3
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    producer.send("events", b"y", key=b"k")
    producer.flush()  # the lock is gone: works again
    producer.close()
    assert [r.value for r in _read_all(s, "events", 2)] == [b"first", b"y"]


def test_unwritable_path_is_bus_unavailable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(BusUnavailable, match="cannot be opened"):
        open_producer(BusSettings(embedded_path=str(blocker / "bus.db")))
