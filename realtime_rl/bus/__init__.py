"""The event bus: ``open_producer`` / ``open_consumer`` pick the backend named in ``bus.backend``.

``embedded`` (default) is a durable SQLite log on this machine; ``kafka`` talks to a Kafka cluster.
Both partition keyed messages the same way, so ordering per completion id is the same on either.
"""

from __future__ import annotations

from realtime_rl.bus.base import BusConsumer, BusProducer, BusUnavailable, Record
from realtime_rl.bus.embedded import EmbeddedConsumer, EmbeddedProducer
from realtime_rl.bus.kafka_bus import KafkaBusConsumer, KafkaBusProducer
from realtime_rl.config import BusSettings

__all__ = ["BusConsumer", "BusProducer", "BusUnavailable", "Record", "open_consumer", "open_producer"]


def open_producer(bus_settings: BusSettings) -> BusProducer:
    """A producer for the configured backend (Kafka connects lazily, on the first send)."""
    if bus_settings.backend == "kafka":
        return KafkaBusProducer(bus_settings)

    return EmbeddedProducer(bus_settings)


def open_consumer(bus_settings: BusSettings, group: str) -> BusConsumer:
    """A consumer with manual positions; ``group`` names it (Kafka group id; the ingester's offset key)."""
    if bus_settings.backend == "kafka":
        return KafkaBusConsumer(bus_settings, group)

    return EmbeddedConsumer(bus_settings, group)
