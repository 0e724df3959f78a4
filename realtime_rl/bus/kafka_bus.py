"""The Kafka backend, through kafka-python.

Producer: ``acks=all``; the caller keys messages by completion id so a completion and its feedback
share a partition. The idempotent producer is off by default (``bus.enable_idempotence``): against
Tansu it could stop sending for good after batches expired in an outage, and nothing downstream
needs it (the ingester is idempotent on event ids and does not rely on order within a partition). The client is created lazily, so a producer can be opened while the broker is
down; every blocking step is bounded (``send_timeout_s`` for metadata and buffer space,
``delivery_timeout_ms`` for acknowledgement) and surfaces as :class:`BusUnavailable`.

Consumer: manual partition assignment with explicit seeks, or (``subscribe``) Kafka's group protocol,
which shares the partitions among the group's members and rebalances when one joins or dies. Either
way offsets are *not* committed to Kafka: the ingester stores them in its database, in the same
transaction as the rows, and seeks there. Group-protocol timeouts come from settings (short by
default so that a member that died is noticed within seconds).

Missing topics are created through the admin client with ``bus.partitions`` partitions.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from realtime_rl.bus.base import BusConsumer, BusProducer, BusUnavailable, Record
from realtime_rl.bus.embedded import kafka_partition
from realtime_rl.config import BusSettings

FETCH_MAX_WAIT_MS = 100
"""Longest a fetch waits at the broker for data. Apache Kafka answers as soon as data arrives, but the
Tansu test broker answers an empty fetch only about halfway through its wait, so at kafka-python's
usual 500 ms every event reached the consumer late by a large part of that wait; a short wait keeps
the delay small. The price is that an idle consumer makes one empty fetch per wait."""


def client_config(settings: BusSettings) -> dict[str, Any]:
    """Connection and security options shared by producer, consumer and admin client."""
    config: dict[str, Any] = {
        "bootstrap_servers": [s.strip() for s in settings.bootstrap_servers.split(",") if s.strip()],
        "client_id": settings.client_id,
        "security_protocol": settings.security_protocol,
        "request_timeout_ms": settings.request_timeout_ms,
        "reconnect_backoff_max_ms": settings.reconnect_backoff_max_ms,
    }
    if settings.sasl_mechanism:
        config["sasl_mechanism"] = settings.sasl_mechanism
        config["sasl_plain_username"] = settings.sasl_username
        if settings.sasl_password is not None:
            config["sasl_plain_password"] = settings.sasl_password.get_secret_value()
    for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
        if getattr(settings, name):
            config[name] = getattr(settings, name)
    return config


def _bootstrap_ms(settings: BusSettings) -> int:
    return int(settings.send_timeout_s * 1000)


class TopicCreator:
    """Creates missing topics once per process (idempotent: an existing topic is fine)."""

    def __init__(self, settings: BusSettings) -> None:
        self._settings = settings
        self._done: set[str] = set()
        self._lock = threading.Lock()

    def ensure(self, topic: str) -> None:
        if not self._settings.create_topics or topic in self._done:
            return
        with self._lock:
            if topic in self._done:
                return
            admin = None
            try:
                admin = KafkaAdminClient(**client_config(self._settings),
                                         bootstrap_timeout_ms=_bootstrap_ms(self._settings))
                existing = set(admin.list_topics())
                if topic not in existing:
                    with contextlib.suppress(TopicAlreadyExistsError):  # another process was first
                        admin.create_topics([NewTopic(topic, self._settings.partitions,
                                                      self._settings.replication_factor)])
            except (KafkaError, OSError) as err:
                raise BusUnavailable(f"cannot create topic {topic!r} on {self._settings.bootstrap_servers}: "
                                     f"{err}") from err
            finally:
                if admin is not None:
                    admin.close()
            self._done.add(topic)


class KafkaBusProducer(BusProducer):
    def __init__(self, settings: BusSettings) -> None:
        self._settings = settings
        self._topics = TopicCreator(settings)
        self._producer: KafkaProducer | None = None
        self._lock = threading.Lock()
        self._pending: list[Any] = []

    def _client(self) -> KafkaProducer:
        if self._producer is None:
            s = self._settings
            try:
                self._producer = KafkaProducer(
                    **client_config(s),
                    acks="all",
                    enable_idempotence=s.enable_idempotence,
                    linger_ms=s.linger_ms,
                    batch_size=256 * 1024,
                    max_block_ms=_bootstrap_ms(s),
                    bootstrap_timeout_ms=_bootstrap_ms(s),
                    delivery_timeout_ms=max(s.delivery_timeout_ms, s.linger_ms + s.request_timeout_ms),
                )
            except (KafkaError, OSError) as err:
                raise BusUnavailable(f"Kafka at {s.bootstrap_servers} unreachable: {err}") from err
        return self._producer

    def send(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        self._topics.ensure(topic)
        producer = self._client()
        try:
            # Keyed: the partition kafka-python's default partitioner would pick, by the faster
            # murmur2 the embedded bus uses (hashing is a visible part of a send's CPU); unkeyed: left
            # to kafka-python.
            partition = None if key is None else kafka_partition(key, len(producer.partitions_for(topic)))
            future = producer.send(topic, value=value, key=key, partition=partition)
        except (KafkaError, OSError) as err:
            raise BusUnavailable(f"Kafka send to {topic!r} failed: {err}") from err
        with self._lock:
            self._pending.append(future)

    def flush(self, timeout: float | None = None) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        if self._producer is None:
            return
        s = self._settings
        bound = timeout if timeout is not None else (s.delivery_timeout_ms + s.request_timeout_ms) / 1000
        try:
            self._producer.flush(timeout=bound)
        except KafkaError as err:
            self._discard_client()
            raise BusUnavailable(f"Kafka flush did not finish in {bound:.1f} s: {err}") from err
        failed = [f for f in pending if f.failed()]
        unfinished = sum(1 for f in pending if not f.is_done)
        if failed or unfinished:
            self._discard_client()
            first = failed[0].exception if failed else "not acknowledged in time"
            raise BusUnavailable(f"{len(failed) + unfinished} of {len(pending)} message(s) not acknowledged "
                                 f"by Kafka: {first}")

    def _discard_client(self) -> None:
        """After a failed flush start over with a fresh client on the next send: whatever state the
        old one kept about the lost batches (sequence numbers, a wedged accumulator) cannot block it."""
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(Exception):
                producer.close(timeout=0)

    def close(self) -> None:
        if self._producer is not None:
            try:
                self.flush()
            finally:
                self._producer.close(timeout=self._settings.send_timeout_s)
                self._producer = None


class _Listener(ConsumerRebalanceListener):
    """Hands kafka-python's rebalance callbacks to the consumer's owner as plain partition sets."""

    def __init__(self, on_rebalance: Callable[[str, set[tuple[str, int]]], None]) -> None:
        self._on_rebalance = on_rebalance

    def on_partitions_revoked(self, revoked) -> None:
        self._on_rebalance("revoked", {(tp.topic, tp.partition) for tp in revoked})

    def on_partitions_assigned(self, assigned) -> None:
        self._on_rebalance("assigned", {(tp.topic, tp.partition) for tp in assigned})


class KafkaBusConsumer(BusConsumer):
    def __init__(self, settings: BusSettings, group: str) -> None:
        self._settings = settings
        self._topics = TopicCreator(settings)
        s = settings
        try:
            self._consumer = KafkaConsumer(
                **client_config(s),
                group_id=group,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                session_timeout_ms=s.session_timeout_ms,
                heartbeat_interval_ms=s.heartbeat_interval_ms,
                max_poll_interval_ms=s.max_poll_interval_ms,
                fetch_max_bytes=s.fetch_max_bytes,
                max_partition_fetch_bytes=s.max_partition_fetch_bytes,
                fetch_max_wait_ms=min(FETCH_MAX_WAIT_MS, s.request_timeout_ms // 2),
                max_poll_records=10_000,
                bootstrap_timeout_ms=_bootstrap_ms(s),
            )
        except (KafkaError, OSError) as err:
            raise BusUnavailable(f"Kafka at {s.bootstrap_servers} unreachable: {err}") from err

    def partitions(self, topic: str) -> list[int]:
        self._topics.ensure(topic)
        deadline = time.monotonic() + self._settings.send_timeout_s
        while True:
            try:
                found = self._consumer.partitions_for_topic(topic)
            except (KafkaError, OSError) as err:
                raise BusUnavailable(f"Kafka metadata for {topic!r} unavailable: {err}") from err
            if found:
                return sorted(found)
            if time.monotonic() >= deadline:
                raise BusUnavailable(f"topic {topic!r} has no partitions visible on "
                                     f"{self._settings.bootstrap_servers}")
            time.sleep(0.1)  # a just-created topic takes a moment to appear in metadata

    def assign(self, positions: dict[tuple[str, int], int]) -> None:
        tps = {pos: TopicPartition(*pos) for pos in positions}
        self._consumer.assign(list(tps.values()))
        for pos, offset in positions.items():
            self._consumer.seek(tps[pos], offset)

    def subscribe(self, topics: list[str], on_rebalance: Callable[[str, set[tuple[str, int]]], None]) -> None:
        for topic in topics:
            self._topics.ensure(topic)
        self._consumer.subscribe(topics=list(topics), listener=_Listener(on_rebalance))

    def assignment(self) -> set[tuple[str, int]]:
        return {(tp.topic, tp.partition) for tp in self._consumer.assignment()}

    def seek(self, positions: dict[tuple[str, int], int]) -> None:
        for (topic, partition), offset in positions.items():
            self._consumer.seek(TopicPartition(topic, partition), offset)

    def poll(self, timeout_s: float = 1.0, max_records: int = 5000) -> list[Record]:
        try:
            batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        except (KafkaError, OSError) as err:
            raise BusUnavailable(f"Kafka poll failed: {err}") from err
        return [Record(m.topic, m.partition, m.offset, m.key, m.value, m.timestamp)
                for messages in batches.values() for m in messages]

    def end_offsets(self, topic: str) -> dict[int, int]:
        tps = [TopicPartition(topic, p) for p in self.partitions(topic)]
        try:
            ends = self._consumer.end_offsets(tps)
        except (KafkaError, OSError) as err:
            raise BusUnavailable(f"Kafka end offsets for {topic!r} unavailable: {err}") from err
        return {tp.partition: offset for tp, offset in ends.items()}

    def close(self) -> None:
        self._consumer.close(autocommit=False)
