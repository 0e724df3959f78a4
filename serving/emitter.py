"""Completion and feedback events to the bus, from a background thread, never blocking a response.

Path of an event: ``emit()`` appends it to a bounded in-memory buffer; the sender thread takes up to
``emit_batch`` events, sends them and flushes the producer. If the bus raises :class:`BusUnavailable`
(at open, send or flush), the whole batch is appended to the spill file (fsync'd) and the bus is
retried every ``bus_retry_s``; once it answers, the spill file is replayed first, then removed.
Delivery is at-least-once: a batch that was partly delivered before the failure is sent again in
full, and the ingester is idempotent on ``event_id``. A spill line cut short by a crash is skipped on
replay (counted).

Order. Events reach the bus in the order they were emitted, outages or not. Oldest to newest, an
event is in: the spill file (written by the sender only), the batch the sender holds, the buffer,
then the *overflow* file. ``emit()`` appends to the overflow file when the buffer is full (the sender
is slow or stuck), and keeps doing so, so that no later event overtakes those, until the sender has
emptied the buffer and takes the overflow file over (renamed under the emit lock, then handled as
one more batch).

Disk full. A spill or overflow write that fails (no space, a quota, an I/O error) is undone (the file
cut back to where the write began), counted in ``rtrl_events_spill_errors_total`` and logged;
``rtrl_events_spill_failing`` is 1 until a write succeeds again. The sender keeps the batch it could
neither send nor spill in memory (ahead of the buffer) and retries both every ``bus_retry_s``; requests
are served throughout. Only when the buffer is full *and* the overflow file cannot be written is an
event dropped (``rtrl_events_dropped_total``, logged): memory stays bounded by ``event_queue_size``.

Spill format: one event per line, the event's JSON wire bytes (they never contain a newline).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from realtime_rl.bus import open_producer
from realtime_rl.bus.base import BusProducer, BusUnavailable
from realtime_rl.events import CompletionEvent, FeedbackEvent, decode_event

log = logging.getLogger("serving.emitter")

Event = CompletionEvent | FeedbackEvent
Item = tuple[bytes, bytes]  # (key, wire bytes)


def default_producer_factory(bus_settings) -> Callable[[], BusProducer]:
    def factory() -> BusProducer:
        return open_producer(bus_settings)

    return factory


def append_lines(path: Path, items: list[Item], fsync: bool) -> None:
    """Append ``items``' values, one a line, to ``path``; on failure the file is cut back to its old size
    (so no partial line stays behind) and the OSError raised."""
    data = b"".join(value + b"\n" for _, value in items)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


def _read(path: Path) -> bytes:
    """The file's bytes up to the size it has now (never more: not a device that reads forever)."""
    try:
        with path.open("rb") as fh:
            return fh.read(os.fstat(fh.fileno()).st_size)
    except FileNotFoundError:
        return b""


def _read_lines(path: Path) -> tuple[list[Item], int]:
    """The events of a spill file as (key, value) items, and the number of damaged lines skipped."""

    lines = _read(path).split(b"\n")
    items, corrupt = [], 0
    for line in lines:
        if not line:
            continue
        try:
            ev = decode_event(line)
        except ValueError:
            corrupt += 1
            log.warning("skipping a damaged spill line (%d bytes)", len(line))
            continue
        items.append((ev.completion_id.encode(), line))
    return items, corrupt


def _count_lines(path: Path) -> int:
    data = _read(path)
    return data.count(b"\n") + (not data.endswith(b"\n") and bool(data))


class EventEmitter:
    def __init__(self, topic: str, spill_dir: str | Path, producer_factory: Callable[[], BusProducer], *,
                 queue_size: int = 10_000, batch: int = 500, retry_s: float = 1.0, fsync: bool = True,
                 linger_s: float = 0.005, metrics=None) -> None:
        self.topic = topic
        self.spill_path = Path(spill_dir) / "events.spill"
        self.overflow_path = Path(spill_dir) / "events.overflow"
        self.spill_path.parent.mkdir(parents=True, exist_ok=True)
        self._factory = producer_factory
        self._buffer: deque[Item] = deque()
        self._max_buffer = queue_size
        self._batch, self._retry_s, self._fsync, self._linger_s = batch, retry_s, fsync, linger_s
        self.metrics = metrics
        self._producer: BusProducer | None = None
        self._spill_lock = threading.Lock()
        self._emit_lock = threading.Lock()  # the buffer-or-overflow choice, and the overflow file's takeover
        self._spilled = _count_lines(self.spill_path)
        self._overflowed = _count_lines(self.overflow_path)  # a previous process's overflow: replayed after the spill
        self._overflowing = self._overflowed > 0
        self._held: list[Item] = []  # a batch neither sent nor spilled (bus down, spill disk full)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self.bus_up = False
        self.spill_failing = False
        self._reserved = 0  # events promised by responses already sent, emitted right after (see reserve)
        self._inflight = 0  # taken by the sender thread, not yet acknowledged, spilled nor held
        self._reserved_lock = threading.Lock()  # never the spill lock: a replay holds that one for long
        self.sent = 0
        self.replayed = 0
        self.dropped = 0
        self.spill_errors = 0
        self.corrupt_spill_lines = 0
        self._thread = threading.Thread(target=self._loop, name="event-emitter", daemon=True)

    # -- producer side (request threads) ----------------------------------------------------------
    def emit(self, event: Event, reserved: bool = False) -> None:
        """Never blocks on the bus, never raises for a bus or disk problem."""
        item = (event.completion_id.encode(), event.to_bytes())
        self._idle.clear()
        try:
            with self._emit_lock:
                if not self._overflowing and len(self._buffer) < self._max_buffer:
                    self._buffer.append(item)
                else:
                    self._overflow(item)
        finally:
            if reserved:
                self._settle_reserved()
        self._wake.set()
        if self.metrics is not None:
            self.metrics.events.labels(event.type).inc()
            self.metrics.event_queue.set(len(self._buffer) + len(self._held))

    def _overflow(self, item: Item) -> None:
        """The buffer is full (or earlier events went this way): append to the overflow file; if that
        cannot be written either, the event is dropped and counted (emit lock held)."""
        try:
            append_lines(self.overflow_path, [item], self._fsync)
        except OSError as err:
            self.dropped += 1
            self._spill_error(err)
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.error("event buffer full (%d) and the overflow file %s cannot be written (%s): %d event(s) "
                          "dropped so far", self._max_buffer, self.overflow_path, err, self.dropped)
            if self.metrics is not None:
                self.metrics.events_dropped.inc()
            return
        self._overflowing = True
        self._overflowed += 1
        if self.metrics is not None:
            self.metrics.events_spilled.inc()

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
        """Events not yet acknowledged by the bus (reserved + buffered + in the sender's hands + held +
        spilled + overflowed)."""
        return (self._reserved + len(self._buffer) + self._inflight + len(self._held) + self._spilled
                + self._overflowed)

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
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout + 5)
        with self._emit_lock:
            rest = self._held + list(self._buffer)
            self._held, self._inflight = [], 0
            self._buffer.clear()
            if rest and not self._spill(rest):
                # The spill disk refuses them: they are lost with this process. Said loudly.
                log.error("stopping with %d undelivered event(s) that the spill file %s cannot take",
                          len(rest), self.spill_path)
                self.dropped += len(rest)
        if self._producer is not None:
            try:
                self._producer.close()
            except Exception as err:  # noqa: BLE001 - everything unsent is already spilled
                log.warning("closing the bus producer: %s", err)
            self._producer = None

    # -- spill file ------------------------------------------------------------------------------
    def _spill(self, items: list[Item]) -> bool:
        """Append ``items`` to the spill file; False (nothing written) when the disk refuses."""
        with self._spill_lock:
            try:
                append_lines(self.spill_path, items, self._fsync)
            except OSError as err:
                self._spill_error(err)
                return False
            self._spilled += len(items)
        if self.spill_failing:
            self.spill_failing = False
            log.warning("the event spill directory %s is writable again", self.spill_path.parent)
            if self.metrics is not None:
                self.metrics.spill_failing.set(0)
        if self.metrics is not None:
            self.metrics.events_spilled.inc(len(items))
            self.metrics.spill_depth.set(self._spilled + self._overflowed)
        return True

    def _spill_error(self, err: OSError) -> None:
        self.spill_errors += 1
        if not self.spill_failing:
            log.error("cannot write to the event spill directory %s (%s); holding events in memory (at most "
                      "%d) until it can", self.spill_path.parent, err, self._max_buffer)
        self.spill_failing = True
        if self.metrics is not None:
            self.metrics.spill_errors.inc()
            self.metrics.spill_failing.set(1)

    def _replay_spill(self) -> None:
        """Send the spill file's events; remove it only after the bus acknowledged them all."""
        with self._spill_lock:
            if self._spilled == 0:  # counted from the file at start-up, then by every append
                return
            items, corrupt = _read_lines(self.spill_path)
            self.corrupt_spill_lines += corrupt
            for start in range(0, len(items), self._batch):
                self._send(items[start:start + self._batch])  # raises BusUnavailable: file stays as is
            self.spill_path.unlink(missing_ok=True)
            self.replayed += len(items)
            self._spilled = 0
        if self.metrics is not None:
            self.metrics.events_replayed.inc(len(items))
            self.metrics.spill_depth.set(self._overflowed)
        if items:
            log.info("replayed %d spilled event(s) to the bus", len(items))

    def _take_overflow(self) -> list[Item]:
        """Once the buffer is empty: the overflow file's events (the oldest not yet taken); new events go
        to the buffer again from here on."""
        with self._emit_lock:
            if not self._overflowing or self._buffer:
                return []
            taken = self.overflow_path.with_name(f"events.overflow.{time.monotonic_ns()}")
            try:
                os.replace(self.overflow_path, taken)
            except FileNotFoundError:
                taken = None
            self._overflowing = False
            n, self._overflowed = self._overflowed, 0
        if taken is None:
            return []
        items, corrupt = _read_lines(taken)
        self.corrupt_spill_lines += corrupt
        taken.unlink(missing_ok=True)  # the items are the sender's now: sent, spilled or held
        self._inflight = len(items)
        log.info("taking %d overflowed event(s) (of %d written) after the buffer", len(items), n)
        return items

    # -- sender thread -----------------------------------------------------------------------------
    def _send(self, items: list[Item]) -> None:
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

    def _take(self) -> list[Item]:
        """The next batch, oldest first: what is held, else from the buffer, else the overflow file."""
        if self._held:
            return self._held
        self._wake.clear()
        buf = self._buffer
        if not buf:
            items = self._take_overflow()
            if items:
                return items
            self._wake.wait(0.05)
            if not buf:
                return []
        # In flight from here on, so `pending` (what callers wait on) never misses an event the sender
        # holds, e.g. during the linger below.
        items = [buf.popleft()]
        self._inflight = 1
        # Let a burst accumulate: one bus flush (an fsync on the embedded log) per batch, not per event,
        # and less CPU taken from requests in flight.
        if self._linger_s and len(buf) < self._batch:
            time.sleep(self._linger_s)
        while buf and len(items) < self._batch:
            items.append(buf.popleft())
            self._inflight += 1
        return items

    def _step(self, retry_at: float) -> float:
        """One batch: send it (after the spill file), or spill it, or hold it; returns the next retry time."""
        items = self._take()
        held = items is self._held
        delivered = False
        if self.bus_up or time.monotonic() >= retry_at:
            try:
                if self._spilled or not self.bus_up:
                    self._replay_spill()
                if items:
                    self._send(items)
                    self.sent += len(items)
                delivered = True
                if not self.bus_up:
                    log.info("event bus reachable")
                self.bus_up = True
                if self.metrics is not None:
                    self.metrics.bus_up.set(1)
            except BusUnavailable as err:
                self._bus_down(err)
                retry_at = time.monotonic() + self._retry_s
            except Exception as err:  # noqa: BLE001 - unexpected: keep the events, keep the thread
                log.exception("event sender error; spilling")
                self._bus_down(err)
                retry_at = time.monotonic() + self._retry_s
        if delivered or not items or self._spill(items):
            self._held = []
        else:
            self._held = items  # ahead of the buffer; both retried after a pause
            self._inflight = 0
            self._stop.wait(min(self._retry_s, max(0.0, retry_at - time.monotonic())) or self._retry_s)
        if held and not self._held:
            log.info("%d held event(s) delivered or spilled", len(items))
        self._inflight = 0  # acknowledged, or counted in _spilled / _held
        if self.metrics is not None:
            self.metrics.event_queue.set(len(self._buffer) + len(self._held))
        if not items and not self._buffer and not self._overflowing and self.bus_up and not self._spilled:
            self._idle.set()
        return retry_at
