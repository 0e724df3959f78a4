"""Completion and feedback events to the bus, from a background thread, never blocking a response.

Path of an event: ``emit()`` puts it in a bounded in-memory queue (or, when that is full, appends it
straight to the spill file); the sender thread takes up to ``emit_batch`` events, sends them and
flushes the producer. If the bus raises :class:`BusUnavailable` (at open, send or flush), the whole
batch is appended to the spill file (fsync'd) and the bus is retried every ``bus_retry_s``; once it
answers, the spill file is replayed first, then truncated. Delivery is at-least-once: a batch that
was partly delivered before the failure is sent again in full, and the ingester is idempotent on
``event_id``. A spill line cut short by a crash is skipped on replay (counted).

Spill format: one event per line, the event's JSON wire bytes (they never contain a newline).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from realtime_rl.bus.base import BusProducer, BusUnavailable
from realtime_rl.events import CompletionEvent, FeedbackEvent

log = logging.getLogger("serving.emitter")

Event = CompletionEvent | FeedbackEvent


def default_producer_factory(bus_settings) -> Callable[[], BusProducer]:
    def factory() -> BusProducer:
        from realtime_rl.bus import open_producer

        return open_producer(bus_settings)

    return factory


class EventEmitter:
    def __init__(self, topic: str, spill_dir: str | Path, producer_factory: Callable[[], BusProducer], *,
                 queue_size: int = 10_000, batch: int = 500, retry_s: float = 1.0, fsync: bool = True,
                 linger_s: float = 0.005, metrics=None) -> None:
        self.topic = topic
        self.spill_path = Path(spill_dir) / "events.spill"
        self.spill_path.parent.mkdir(parents=True, exist_ok=True)
        self._factory = producer_factory
        self._queue: queue.Queue[tuple[bytes, bytes]] = queue.Queue(maxsize=queue_size)
        self._batch, self._retry_s, self._fsync, self._linger_s = batch, retry_s, fsync, linger_s
        self.metrics = metrics
        self._producer: BusProducer | None = None
        self._spill_lock = threading.Lock()
        self._spilled = self._count_spilled()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self.bus_up = False
        self._reserved = 0  # events promised by responses already sent, emitted right after (see reserve)
        self._inflight = 0  # taken off the queue by the sender thread, not yet acknowledged nor spilled
        self._reserved_lock = threading.Lock()  # never the spill lock: a replay holds that one for long
        self.sent = 0
        self.replayed = 0
        self.corrupt_spill_lines = 0
        self._thread = threading.Thread(target=self._loop, name="event-emitter", daemon=True)

    # -- producer side (request threads) ----------------------------------------------------------
    def emit(self, event: Event, reserved: bool = False) -> None:
        """Never blocks on the bus, never raises for a bus problem."""
        item = (event.completion_id.encode(), event.to_bytes())
        self._idle.clear()
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._spill([item])
        finally:
            if reserved:
                self._settle_reserved()
        if self.metrics is not None:
            self.metrics.events.labels(event.type).inc()
            self.metrics.event_queue.set(self._queue.qsize())

    def reserve(self, n: int = 1) -> None:
        """Announce ``n`` events that will be emitted shortly (after a response is sent), so that
        :attr:`pending` and :meth:`wait_idle` count them from now on. Each :meth:`emit` with
        ``reserved=True`` settles one."""
        self._idle.clear()
        with self._reserved_lock:
            self._reserved += n

    def _settle_reserved(self) -> None:
        with self._reserved_lock:
            self._reserved = max(0, self._reserved - 1)

    @property
    def pending(self) -> int:
        """Events not yet acknowledged by the bus (reserved + queued + in the sender's hands + spilled)."""
        return self._reserved + self._queue.qsize() + self._inflight + self._spilled

    def start(self) -> None:
        self._thread.start()

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until everything emitted so far is on the bus (tests, shutdown). False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pending == 0 and self._idle.is_set():
                return True
            time.sleep(0.01)
        return self.pending == 0

    def stop(self, timeout: float = 10.0) -> None:
        """Deliver what can be delivered within ``timeout``; spill the rest durably."""
        if self.bus_up:
            self.wait_idle(timeout)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout + 5)
        rest = []
        while True:
            try:
                rest.append(self._queue.get_nowait())
            except queue.Empty:
                break
        if rest:
            self._spill(rest)
        if self._producer is not None:
            try:
                self._producer.close()
            except Exception as err:  # noqa: BLE001 - everything unsent is already spilled
                log.warning("closing the bus producer: %s", err)
            self._producer = None

    # -- spill file ------------------------------------------------------------------------------
    def _count_spilled(self) -> int:
        try:
            with self.spill_path.open("rb") as fh:
                return sum(1 for _ in fh)
        except FileNotFoundError:
            return 0

    def _spill(self, items: list[tuple[bytes, bytes]]) -> None:
        with self._spill_lock:
            with self.spill_path.open("ab") as fh:
                fh.write(b"".join(value + b"\n" for _, value in items))
                fh.flush()
                if self._fsync:
                    os.fsync(fh.fileno())
            self._spilled += len(items)
        if self.metrics is not None:
            self.metrics.events_spilled.inc(len(items))
            self.metrics.spill_depth.set(self._spilled)

    def _replay_spill(self) -> None:
        """Send the spill file's events; truncate it only after the bus acknowledged them all."""
        from realtime_rl.events import decode_event

        with self._spill_lock:
            if self._spilled == 0 and not self.spill_path.exists():
                return
            try:
                lines = self.spill_path.read_bytes().split(b"\n")
            except FileNotFoundError:
                return
            items = []
            for line in lines:
                if not line:
                    continue
                try:
                    ev = decode_event(line)
                except ValueError:
                    self.corrupt_spill_lines += 1
                    log.warning("skipping a damaged spill line (%d bytes)", len(line))
                    continue
                items.append((ev.completion_id.encode(), line))
            for start in range(0, len(items), self._batch):
                self._send(items[start:start + self._batch])  # raises BusUnavailable: file stays as is
            self.spill_path.unlink(missing_ok=True)
            self.replayed += len(items)
            self._spilled = 0
        if self.metrics is not None:
            self.metrics.events_replayed.inc(len(items))
            self.metrics.spill_depth.set(0)
        if items:
            log.info("replayed %d spilled event(s) to the bus", len(items))

    # -- sender thread -----------------------------------------------------------------------------
    def _send(self, items: list[tuple[bytes, bytes]]) -> None:
        if self._producer is None:
            self._producer = self._factory()
        for key, value in items:
            self._producer.send(self.topic, value, key=key)
        self._producer.flush()

    def _bus_down(self, err: Exception) -> None:
        if self.bus_up:
            log.warning("event bus unavailable, spilling to %s: %s", self.spill_path, err)
        self.bus_up = False
        if self.metrics is not None:
            self.metrics.bus_up.set(0)
        producer, self._producer = self._producer, None
        if producer is not None:
            # A producer of a dead bus may fail to close; it is dropped either way.
            with contextlib.suppress(Exception):
                producer.close()

    def _loop(self) -> None:
        retry_at = 0.0
        while not self._stop.is_set():
            try:
                retry_at = self._step(retry_at)
            finally:
                self._inflight = 0

    def _step(self, retry_at: float) -> float:
        """One batch: take what is queued, send it (or spill it); returns the next retry time."""
        try:
            first = self._queue.get(timeout=0.05)
            # In flight from here on, so `pending` (what callers wait on) never misses an event the
            # sender holds, e.g. during the linger below.
            self._inflight = 1
            items = [first]
            # Let a burst accumulate: one bus flush (an fsync on the embedded log) per batch, not per
            # event, and less CPU taken from requests in flight.
            if self._linger_s and self._queue.qsize() < self._batch:
                time.sleep(self._linger_s)
        except queue.Empty:
            items = []
        while items and len(items) < self._batch:
            try:
                items.append(self._queue.get_nowait())
                self._inflight += 1
            except queue.Empty:
                break
        if not self.bus_up and time.monotonic() < retry_at:
            if items:
                self._spill(items)
            return retry_at
        try:
            if self._spilled or not self.bus_up:
                self._replay_spill()
            if items:
                self._send(items)
                self.sent += len(items)
            if not self.bus_up:
                log.info("event bus reachable")
            self.bus_up = True
            if self.metrics is not None:
                self.metrics.bus_up.set(1)
                self.metrics.event_queue.set(self._queue.qsize())
        except BusUnavailable as err:
            self._bus_down(err)
            retry_at = time.monotonic() + self._retry_s
            if items:
                self._spill(items)
        except Exception as err:  # noqa: BLE001 - unexpected: keep the events, keep the thread
            log.exception("event sender error; spilling")
            self._bus_down(err)
            retry_at = time.monotonic() + self._retry_s
            if items:
                self._spill(items)
        self._inflight = 0  # acknowledged, or counted in _spilled
        if not items and self._queue.empty() and self.bus_up:
            self._idle.set()
        return retry_at
