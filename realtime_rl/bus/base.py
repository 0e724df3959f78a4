"""The bus interface every backend implements (Kafka, the embedded log).

Delivery is at-least-once; consumers get exactly-once *effect* by storing their offsets in the same
database transaction as the rows they produce, so the interface exposes explicit offsets and seeks
rather than hiding them behind auto-commit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple


class BusUnavailable(RuntimeError):
    """The bus cannot be reached right now (producers spill and retry; consumers back off)."""


class Record(NamedTuple):
    """One consumed message. Immutable; a named tuple because a consumer builds one per message and
    a frozen dataclass's ``__init__`` costs ~4x as much (~1 us)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    timestamp_ms: int


class BusProducer(ABC):
    @abstractmethod
    def send(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        """Queue one message. May raise :class:`BusUnavailable`."""

    @abstractmethod
    def flush(self, timeout: float | None = None) -> None:
        """Block until every queued message is durably acknowledged, or raise :class:`BusUnavailable`."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> BusProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BusConsumer(ABC):
    """A consumer with manually managed positions over a set of (topic, partition) pairs."""

    @abstractmethod
    def partitions(self, topic: str) -> list[int]: ...

    @abstractmethod
    def assign(self, positions: dict[tuple[str, int], int]) -> None:
        """Consume exactly these partitions, starting at these offsets (next offset to read)."""

    @abstractmethod
    def poll(self, timeout_s: float = 1.0, max_records: int = 5000) -> list[Record]: ...

    @abstractmethod
    def end_offsets(self, topic: str) -> dict[int, int]: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> BusConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
