"""The gateway's event emitter under faults, on the real embedded bus and real kernel errors: events keep
their order through an outage and a full buffer; a spill disk that is full (writes fail with ENOSPC:
the spill file is a link to /dev/full) is counted and logged, events wait in memory, nothing is lost
once the disk has room, and only what exceeds both is dropped, counted."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from serving_fixtures import read_events

from realtime_rl.config import BusSettings
from realtime_rl.events import CompletionEvent
from serving.emitter import EventEmitter, default_producer_factory
from serving.metrics import GatewayMetrics


def _event(i: int) -> CompletionEvent:
    return CompletionEvent(completion_id=f"cmpl-{i:04d}", caller="k", model="m", version="v", prompt="p",
                           completion="c", prompt_token_ids=[1], completion_token_ids=[2], logprobs=[-0.1])


def _blocked_bus(tmp_path: Path) -> tuple[BusSettings, Path]:
    """A bus whose log path runs through a regular file (opening it fails: BusUnavailable) until the file
    is deleted; one partition, so the log's order is the order of arrival."""
    blocker = tmp_path / "blocked"
    blocker.write_text("not a directory")
    return BusSettings(embedded_path=str(blocker / "events.db"), partitions=1), blocker


def _wait(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_outage_and_overflow_keep_the_order(tmp_path: Path) -> None:
    bus, blocker = _blocked_bus(tmp_path)
    em = EventEmitter(bus.events_topic, tmp_path / "spill", default_producer_factory(bus), queue_size=5,
                      retry_s=0.1, linger_s=0)
    for i in range(30):  # not started yet: 5 in the buffer, 25 in the overflow file
        em.emit(_event(i))
    assert em._overflowed == 25
    em.start()
    _wait(lambda: em._spilled == 30)  # the bus is down: buffer, then the overflow file, to the spill file
    for i in range(30, 40):
        em.emit(_event(i))
    _wait(lambda: em._spilled == 40)
    blocker.unlink()
    assert em.wait_idle(20)
    em.stop()
    assert [e.completion_id for e in read_events(bus)] == [f"cmpl-{i:04d}" for i in range(40)]
    assert em.dropped == 0 and not list((tmp_path / "spill").iterdir())


def test_full_spill_disk_holds_events_in_memory_and_keeps_accepting(tmp_path: Path, caplog) -> None:
    bus, blocker = _blocked_bus(tmp_path)
    spill = tmp_path / "spill"
    spill.mkdir()
    os.symlink("/dev/full", spill / "events.spill")  # every write: ENOSPC
    metrics = GatewayMetrics()
    em = EventEmitter(bus.events_topic, spill, default_producer_factory(bus), queue_size=10, batch=4,
                      retry_s=0.1, linger_s=0, metrics=metrics)
    em.start()
    with caplog.at_level(logging.ERROR, logger="serving.emitter"):
        for i in range(8):
            em.emit(_event(i))  # never raises
        _wait(lambda: em.spill_errors >= 2)
    assert em.spill_failing and metrics.spill_failing._value.get() == 1
    assert metrics.spill_errors._value.get() >= 2
    assert any("cannot write to the event spill directory" in r.getMessage() for r in caplog.records)
    assert em.pending == 8 and em.dropped == 0
    # The disk has room again: the held events are spilled, in order, then delivered when the bus is back.
    (spill / "events.spill").unlink()
    _wait(lambda: em._spilled == 8)
    assert not em.spill_failing and metrics.spill_failing._value.get() == 0
    blocker.unlink()  # the bus is back: all of them arrive, in order
    assert em.wait_idle(20)
    em.stop()
    assert [e.completion_id for e in read_events(bus)] == [f"cmpl-{i:04d}" for i in range(8)]

    # Buffer full (nothing drains it) and the overflow file refused too: the excess is dropped, counted.
    other = tmp_path / "spill2"
    other.mkdir()
    os.symlink("/dev/full", other / "events.overflow")
    metrics = GatewayMetrics()
    em = EventEmitter(bus.events_topic, other, default_producer_factory(bus), queue_size=10, metrics=metrics)
    with caplog.at_level(logging.ERROR, logger="serving.emitter"):
        for i in range(15):
            em.emit(_event(100 + i))
    assert em.dropped == 5 and metrics.events_dropped._value.get() == 5 and len(em._buffer) == 10
    assert any("dropped" in r.getMessage() for r in caplog.records)
