"""The embedded bus: a durable single-machine log in one SQLite file (WAL mode), no server needed.

Layout: ``topics(topic, partitions)`` and ``records(topic, partition, offset, key, value, ts)``.
Messages are partitioned like Kafka's default partitioner (murmur2 of the key modulo the partition
count), so a completion and its feedback share a partition and keep their order, exactly as on
Kafka. Offsets are dense per partition; a writer takes SQLite's write lock (``BEGIN IMMEDIATE``)
to append, so several producer processes can share one log. Readers never block writers (WAL).

Semantics match the Kafka backend: ``send`` queues, a background thread writes queued messages
after ``linger_ms``, and ``flush`` raises :class:`BusUnavailable` if any message queued since the
previous flush could not be written (the caller resends; consumers are idempotent on event ids).
The log is never truncated: a demo-sized deployment keeps everything (there is no retention).
"""

from __future__ import annotations

import random
import sqlite3
import struct
import threading
import time
from pathlib import Path

from realtime_rl.bus.base import BusConsumer, BusProducer, BusUnavailable, Record
from realtime_rl.config import BusSettings

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS topics (topic TEXT PRIMARY KEY, partitions INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS records (topic TEXT NOT NULL, partition INTEGER NOT NULL, "
    "offset INTEGER NOT NULL, key BLOB, value BLOB NOT NULL, ts INTEGER NOT NULL)",
    "CREATE UNIQUE INDEX IF NOT EXISTS records_position ON records (topic, partition, offset)",
)
_AUTO_FLUSH_RECORDS = 2000
"""A producer writes at once when this many messages are queued (bounds memory and batch size)."""


def kafka_partition(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner picks for ``key`` (murmur2, positive, modulo)."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """kafka-python's ``murmur2`` (the Java client's), same results: whole 32-bit words unpacked at
    once instead of byte by byte, which is faster, and a producer hashes every key it sends."""
    length = len(data)
    h = (0x9747B28C ^ length) & _MASK
    whole = length & ~3
    if whole:
        for k in struct.unpack_from(f"<{whole // 4}I", data):
            k = (k * _M) & _MASK
            k ^= k >> 24
            h = ((h * _M) & _MASK) ^ ((k * _M) & _MASK)
    extra = length & 3
    if extra:
        if extra == 3:
            h ^= data[whole + 2] << 16
        if extra >= 2:
            h ^= data[whole + 1] << 8
        h = ((h ^ data[whole]) * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    return h ^ (h >> 15)


def _connect(settings: BusSettings) -> sqlite3.Connection:
    path = Path(settings.embedded_path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path, timeout=settings.send_timeout_s, isolation_level=None,
                               check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={settings.embedded_synchronous}")
        for statement in _SCHEMA:
            conn.execute(statement)
    except (sqlite3.Error, OSError) as err:
        raise BusUnavailable(f"embedded bus log {path} cannot be opened: {err}") from err
    return conn


class _TopicCatalog:
    """Partition counts per topic; a topic is created with ``settings.partitions`` on first use."""

    def __init__(self, conn: sqlite3.Connection, default_partitions: int) -> None:
        self._conn = conn
        self._default = default_partitions
        self._cache: dict[str, int] = {}

    def partitions(self, topic: str) -> int:
        if topic not in self._cache:
            try:
                row = self._conn.execute("SELECT partitions FROM topics WHERE topic = ?", (topic,)).fetchone()
                if row is None:  # only a new topic needs the write lock
                    self._conn.execute("INSERT OR IGNORE INTO topics (topic, partitions) VALUES (?, ?)",
                                       (topic, self._default))
                    row = self._conn.execute("SELECT partitions FROM topics WHERE topic = ?", (topic,)).fetchone()
            except sqlite3.Error as err:
                raise BusUnavailable(f"embedded bus: cannot read topic {topic!r}: {err}") from err
            self._cache[topic] = int(row[0])
        return self._cache[topic]


class EmbeddedProducer(BusProducer):
    def __init__(self, settings: BusSettings) -> None:
        self._settings = settings
        self._conn = _connect(settings)
        self._catalog = _TopicCatalog(self._conn, settings.partitions)
        self._lock = threading.Lock()
        self._queue: list[tuple[str, int, bytes | None, bytes, int]] = []
        self._failure: str | None = None
        self._closed = False
        self._wake = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="embedded-bus-linger", daemon=True)
        self._flusher.start()

    def send(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        if self._closed:
            raise BusUnavailable("producer is closed")
        with self._lock:
            n = self._catalog.partitions(topic)
            partition = kafka_partition(key, n) if key is not None else random.randrange(n)
            self._queue.append((topic, partition, key, bytes(value), int(time.time() * 1000)))
            full = len(self._queue) >= _AUTO_FLUSH_RECORDS
        if full:
            self._write_queued()
        elif not self._wake.is_set():  # set() takes a lock and notifies: not per message
            self._wake.set()

    def flush(self, timeout: float | None = None) -> None:
        self._write_queued()
        with self._lock:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise BusUnavailable(failure)

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._wake.set()
            self._flusher.join(timeout=5)
            self._conn.close()

    def _flush_loop(self) -> None:
        linger = self._settings.linger_ms / 1000
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            time.sleep(linger)
            self._write_queued()

    def _write_queued(self) -> None:
        """Append everything queued in one write transaction; a failure is reported by the next flush."""
        with self._lock:
            batch, self._queue = self._queue, []
            if not batch:
                return
            try:
                self._append(batch)
            except sqlite3.Error as err:
                self._failure = f"embedded bus: {len(batch)} message(s) not written: {err}"

    def _append(self, batch: list[tuple[str, int, bytes | None, bytes, int]]) -> None:
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            next_offset: dict[tuple[str, int], int] = {}
            rows = []
            for topic, partition, key, value, ts in batch:
                pos = (topic, partition)
                if pos not in next_offset:
                    row = conn.execute("SELECT MAX(offset) FROM records WHERE topic = ? AND partition = ?",
                                       pos).fetchone()
                    next_offset[pos] = 0 if row[0] is None else row[0] + 1
                rows.append((topic, partition, next_offset[pos], key, value, ts))
                next_offset[pos] += 1
            conn.executemany("INSERT INTO records (topic, partition, offset, key, value, ts) "
                             "VALUES (?, ?, ?, ?, ?, ?)", rows)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise


class EmbeddedConsumer(BusConsumer):
    def __init__(self, settings: BusSettings, group: str) -> None:
        self._settings = settings
        self.group = group  # positions are the caller's (stored in its database), not the log's
        self._conn = _connect(settings)
        self._catalog = _TopicCatalog(self._conn, settings.partitions)
        self._positions: dict[tuple[str, int], int] = {}
        self._rotation = 0

    def partitions(self, topic: str) -> list[int]:
        return list(range(self._catalog.partitions(topic)))

    def assign(self, positions: dict[tuple[str, int], int]) -> None:
        self._positions = dict(positions)

    def poll(self, timeout_s: float = 1.0, max_records: int = 5000) -> list[Record]:
        deadline = time.monotonic() + timeout_s
        while True:
            records = self._read(max_records)
            if records or time.monotonic() >= deadline:
                return records
            time.sleep(min(self._settings.embedded_poll_interval_ms / 1000, max(0.0, deadline - time.monotonic())))

    def _read(self, max_records: int) -> list[Record]:
        if not self._positions:
            return []
        order = sorted(self._positions)
        # Rotate the starting partition so that one busy partition cannot starve the others.
        self._rotation = (self._rotation + 1) % len(order)
        order = order[self._rotation:] + order[:self._rotation]
        out: list[Record] = []
        try:
            for topic, partition in order:
                room = max_records - len(out)
                if room <= 0:
                    break
                start = self._positions[(topic, partition)]
                rows = self._conn.execute(
                    "SELECT offset, key, value, ts FROM records WHERE topic = ? AND partition = ? AND offset >= ? "
                    "ORDER BY offset LIMIT ?", (topic, partition, start, room)).fetchall()
                out.extend([Record(topic, partition, offset, key, value, ts) for offset, key, value, ts in rows])
                if rows:
                    self._positions[(topic, partition)] = rows[-1][0] + 1
        except sqlite3.Error as err:
            raise BusUnavailable(f"embedded bus: read failed: {err}") from err
        return out

    def end_offsets(self, topic: str) -> dict[int, int]:
        ends = dict.fromkeys(self.partitions(topic), 0)
        try:
            for partition in ends:
                row = self._conn.execute("SELECT MAX(offset) FROM records WHERE topic = ? AND partition = ?",
                                         (topic, partition)).fetchone()
                ends[partition] = 0 if row[0] is None else row[0] + 1
        except sqlite3.Error as err:
            raise BusUnavailable(f"embedded bus: read failed: {err}") from err
        return ends

    def close(self) -> None:
        self._conn.close()
