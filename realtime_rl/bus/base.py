"""The bus interface every backend implements (Kafka, the embedded log).

Delivery is at-least-once; consumers get exactly-once *effect* by storing their offsets in the same
database transaction as the rows they produce, so the interface exposes explicit offsets and seeks
rather than hiding them behind auto-commit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import NamedTuple


class BusUnavailable(RuntimeError):
    """The bus cannot be reached right now (producers spill and retry; consumers back off)."""


class Record(NamedTuple):
    """One consumed message. Immutable; a named tuple because a consumer builds one per message and
    a frozen dataclass's ``__init__`` costs several times as much (it sets every field through
    ``object.__setattr__``)."""

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

    def subscribe(self, topics: list[str], on_rebalance: Callable[[str, set[tuple[str, int]]], None]) -> None:
        """Share the topics' partitions with the other consumers of this group (Kafka's group protocol).

        Which partitions this consumer holds changes inside :meth:`poll` when a member joins or leaves;
        ``on_rebalance("revoked" | "assigned", partitions)`` is called then, from inside that poll. The
        caller positions the assigned partitions with :meth:`seek`."""
        raise NotImplementedError(f"{type(self).__name__} has no consumer groups: use the Kafka bus")

    def assignment(self) -> set[tuple[str, int]]:
        """The (topic, partition) pairs this consumer holds now (after :meth:`subscribe`)."""
        raise NotImplementedError(f"{type(self).__name__} has no consumer groups: use the Kafka bus")

    def seek(self, positions: dict[tuple[str, int], int]) -> None:
        """Next offsets to read on partitions this consumer holds (after :meth:`subscribe`)."""
        raise NotImplementedError(f"{type(self).__name__} has no consumer groups: use the Kafka bus")

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
