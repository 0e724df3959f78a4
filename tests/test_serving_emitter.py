"""The event emitter against the real embedded bus: outage, spill, replay, damaged spill lines."""

from __future__ import annotations

import time

from serving_fixtures import read_events

from realtime_rl.config import BusSettings
from realtime_rl.events import CompletionEvent
from serving.emitter import EventEmitter, default_producer_factory


def _event(i: int) -> CompletionEvent:
    return CompletionEvent(completion_id=f"cmpl-{i}", caller="k", model="m", version="v", prompt="p",
                           completion="c", prompt_token_ids=[1], completion_token_ids=[2], logprobs=[-0.1])


def test_bus_down_then_back_loses_nothing(tmp_path):
    # The bus is really unreachable: its log path runs through a regular file, so opening it fails
    # (BusUnavailable); deleting the file brings the bus back.
    blocker = tmp_path / "blocked"
    blocker.write_text("not a directory")
    bus = BusSettings(embedded_path=str(blocker / "events.db"))
    em = EventEmitter(bus.events_topic, tmp_path / "spill", default_producer_factory(bus), retry_s=0.1)
    em.start()
    t0 = time.perf_counter()
    for i in range(50):
        em.emit(_event(i))
    assert time.perf_counter() - t0 < 1.0  # emitting never waits for the bus
    deadline = time.monotonic() + 10
    while em.pending and em._buffer and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert not em.bus_up and em.spill_path.exists() and em.pending == 50
    blocker.unlink()
    assert em.wait_idle(20)
    em.stop()
    ids = [e.completion_id for e in read_events(bus)]
    assert sorted(set(ids)) == sorted(f"cmpl-{i}" for i in range(50))
    assert em.replayed == 50 and not em.spill_path.exists()


def test_full_queue_spills_and_spill_is_replayed_at_start(tmp_path):
    bus = BusSettings(embedded_path=str(tmp_path / "bus" / "events.db"))
    # Not started: nothing drains the buffer of 5, so the rest goes to the overflow file.
    em = EventEmitter(bus.events_topic, tmp_path / "spill", default_producer_factory(bus), queue_size=5)
    for i in range(12):
        em.emit(_event(i))
    assert em._overflowed == 7
    em.stop()  # never started: the 5 buffered are spilled (the overflow file keeps the newer 7)
    # A crash mid-write leaves a cut line; the next process replays the good ones and skips it.
    with em.spill_path.open("ab") as fh:
        fh.write(_event(99).to_bytes()[:40])
    again = EventEmitter(bus.events_topic, tmp_path / "spill", default_producer_factory(bus))
    again.start()
    assert again.wait_idle(20)
    again.stop()
    ids = sorted(e.completion_id for e in read_events(bus))
    assert ids == sorted(f"cmpl-{i}" for i in range(12))
    assert again.corrupt_spill_lines == 1


def test_pending_counts_events_the_sender_holds(tmp_path):
    """An event taken off the queue is pending until the bus acknowledged it (waiters on `pending`,
    e.g. the gateway benchmark between calls, must not see 0 while it is being sent)."""
    import threading

    release, sending = threading.Event(), threading.Event()
    sent: list[bytes] = []

    class SlowProducer:
        """Stands in for the bus client (the state under test is the emitter's): a send that blocks
        until released; flushing and closing have nothing to do."""

        def send(self, topic, value, key=None):
            sending.set()
            release.wait(10)
            sent.append(value)

        def flush(self):
            pass

        def close(self):
            pass

    em = EventEmitter("events", tmp_path / "spill", SlowProducer, linger_s=0)
    em.start()
    em.emit(_event(1))
    assert sending.wait(10)
    assert not em._buffer and em.pending == 1 and not em.wait_idle(0.2)
    release.set()
    assert em.wait_idle(10) and em.pending == 0 and len(sent) == 1
    em.stop()
