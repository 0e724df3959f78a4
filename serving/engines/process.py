"""An engine whose models live in a child process, driven from an asyncio event loop.

``serving.engine_process = true`` (the default, both engines). Generation is Python-driven (the torch
sampler loop, vLLM's scheduler and step loop): in the gateway's process it would share the GIL with the
HTTP event loop, so the models live in a child process (:mod:`serving.engines.torch_worker`,
:mod:`serving.engines.vllm_worker`; the pipe protocol below). Everything on the gateway's side of the
pipe runs on **one event loop thread**, the engine's own, which is also the loop the gateway's HTTP
server runs on (:class:`serving.server.GatewayServer`, ``rtrl serve``):

* a request handler's :meth:`submit_async` queues its rows and, when the child is idle, pickles the
  batch onto the pipe before it returns, so the child starts while the handler goes on;
* the pipe's read end is registered with the loop (``add_reader``): each finished row is unpickled
  there and resolves its request's future in the same thread, and the next batch is sent at once;
* weight swaps are control items in the same queue, run between batches.

So a request crosses no thread on its way to the child and back, and no second thread competes with
the HTTP handlers for the GIL. With a batcher thread in the gateway's process each request costs two
thread hand-offs (handler -> batcher -> event loop), and generation waits for the GIL whenever a
handler holds it, which shows in the gateway benchmark as slower generation behind the gateway than
when called directly (``generate_diff_p50_ms``). vLLM's own API server has the same shape: the engine
core in its own process, the API process's event loop doing the I/O with it.

The pipes. *gen* (the loop <-> the child's main thread), one batch at a time:
``("gen", slot, rows, params, stream)`` -> ``("step", rows, tokens)`` per decoding step (only when
``stream``), ``("fin", row, sample)`` per finished row, then ``("end", error_or_None)``;
``("free", slot)`` (no reply) drops a version no channel serves any more; ``("exit",)``.
*ctl* (callers of ``load``, one at a time <-> a thread of the child): ``("load", slot, model_dir,
channel)`` -> ``("ok", {"vocab_size", "context_len"})`` or ``("err", error)``; ``("free", slot, None,
None)`` for a load the parent refused. Weights are read while the child keeps generating on the
current ones; a new slot becomes live only when the loop names it in a later ``gen``, so the swap
happens between batches, in the order the gateway attributes versions.

Batching rules are those of :mod:`serving.engines.base` (window, ``max_batch``, the adaptive start of a
lone request, per-request answers as rows finish, version attribution at batch start, swaps
between batches); only who runs them differs. Callers on other threads (the version watcher, tests,
offline users) use the thread-safe :meth:`submit`, :meth:`load` and :meth:`generate_now`; a handler
on another event loop gets the same through :func:`asyncio.wrap_future`. A child that dies is
restarted with the versions it served (requests in flight get 503 meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
import struct
import threading
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from policy.sampling import SamplingParams
from serving.engines.base import (
    PRODUCTION,
    Batch,
    Engine,
    EngineClosed,
    Overloaded,
    TokenListener,
    _Control,
    _Job,
    _settle,
)
from serving.versions import VersionRef

log = logging.getLogger("serving.engine")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (a dependency; the loop uvicorn would pick), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class Frames:
    """The child's messages on the gen pipe (``multiprocessing.Connection`` framing: a 4-byte big-endian
    length, then the pickle), read with one ``os.read`` per readiness callback: every message already
    sent arrives in one call (a batch's rows often finish in the same step)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buf = bytearray()

    def read(self) -> list[Any]:
        chunk = os.read(self._fd, 1 << 20)
        if not chunk:
            raise EOFError("the engine process closed its pipe")
        buf = self._buf
        buf += chunk
        out, pos, end = [], 0, len(buf)
        while end - pos >= 4:
            (size,) = struct.unpack_from("!i", buf, pos)
            if size < 0:  # Connection's marker for a message over 2 GiB: never sent by the worker
                raise OSError("oversized message from the engine process")
            if end - pos - 4 < size:
                break
            out.append(pickle.loads(buf[pos + 4:pos + 4 + size]))
            pos += 4 + size
        del buf[:pos]
        return out


@dataclass
class SlotHandle:
    version: str
    slot: int  # where the child holds this version


@dataclass
class ChildStep:
    """Work the child does between batches for the loop (a vLLM engine's in-place weight reload), returned by
    a control action: in flight as a batch is, so nothing else is sent until the child answers
    ``("done", value, error)``, which settles the control item's future."""

    message: tuple
    future: Future | None = None

    def fail(self, err: BaseException) -> None:
        if self.future is not None:
            _settle(self.future, error=err)


class ProcessEngine(Engine):
    """The micro-batcher on an event loop, the models in a child process. Subclasses name the child's entry
    point (:meth:`_child`)."""

    def __init__(self, settings, metrics=None) -> None:
        self._admit = threading.Lock()  # _queued_rows and _closed, which callers on any thread check
        self._inflight: Batch | ChildStep | None = None  # what the child is working on
        self._next_groups: deque[tuple[SlotHandle, list[_Job]]] = deque()  # rest of a mixed-channel batch
        self._deadline: float | None = None  # window end for the job at the head of the queue
        self._timer: asyncio.TimerHandle | None = None
        self._pump_soon = False
        self._dead: str | None = None  # why the child is gone
        self._died_at = 0.0
        self._drained: Future | None = None  # set by close(): resolved when no batch is in flight
        self._slots = itertools.count(1)
        self._slot_refs: dict[int, VersionRef] = {}  # what each slot in the child holds (to reload after a restart)
        self.restarts = 0
        self.last_restart_s: float | None = None  # how long the last restart took (death to serving again)
        super().__init__(settings, metrics)

    # -- the child process and the loop thread ----------------------------------------------------------
    def _start_worker(self) -> None:
        self._ctl_lock = threading.Lock()
        self._proc, self._gen, self._ctl = self._spawn_child()
        self._frames = Frames(self._gen.fileno())
        self.loop = new_event_loop()
        started = threading.Event()
        self._worker = threading.Thread(target=self._run_loop, args=(started,), name=f"{self.name}-engine-loop",
                                        daemon=True)
        self._worker.start()
        started.wait()

    def _spawn_child(self):
        """A new engine process and the parent's ends of its two pipes: (process, gen, ctl)."""
        import multiprocessing

        # spawn, not fork: this process runs threads (server, emitter, watcher) that fork would clone
        # mid-state.
        ctx = multiprocessing.get_context("spawn")
        gen, gen_child = ctx.Pipe()
        ctl, ctl_child = ctx.Pipe()
        target, args = self._child()
        proc = ctx.Process(target=target, args=(gen_child, ctl_child, *args), name=f"rtrl-{self.name}-engine",
                           daemon=True)
        proc.start()
        gen_child.close()
        ctl_child.close()
        return proc, gen, ctl

    @abstractmethod
    def _child(self) -> tuple[Callable[..., None], tuple]:
        """The child's entry point and its arguments after the two pipe ends."""

    def _run_loop(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self._loop_thread = threading.get_ident()
        self.loop.add_reader(self._gen.fileno(), self._on_readable)
        self.loop.call_soon(started.set)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def on_loop(self) -> bool:
        """True on the engine's event loop thread."""
        return threading.get_ident() == self._loop_thread

    @property
    def ready(self) -> bool:
        return super().ready and self._dead is None and self._proc.is_alive()

    # -- loading (caller's thread, over the ctl pipe) ---------------------------------------------------
    def _load_remote(self, model_dir, channel: str, ctl=None) -> tuple[int, dict]:
        """Load ``model_dir`` for ``channel`` into a new slot of the child (``ctl``: a new child's pipe,
        during a restart; the caller then holds ``_ctl_lock``)."""
        slot = next(self._slots)
        with contextlib.nullcontext() if ctl is not None else self._ctl_lock:
            conn = ctl if ctl is not None else self._ctl
            try:
                conn.send(("load", slot, str(model_dir), channel))
                status, info = conn.recv()
            except (EOFError, OSError) as err:
                raise EngineClosed(f"the {self.name} engine process is gone ({err!r})") from None
        if status != "ok":
            raise info
        return slot, info

    def _prepare(self, ref: VersionRef, channel: str) -> Any:
        slot, info = self._load_remote(ref.model_dir, channel)
        self._slot_refs[slot] = ref
        try:
            self._adopt(ref, info["vocab_size"], info["context_len"])
        except ValueError:
            with self._ctl_lock:  # never installed: no batch can be using it
                self._ctl.send(("free", slot, None, None))
            raise
        return slot

    def _install(self, channel: str, prepared: int, ref: VersionRef) -> SlotHandle:
        return SlotHandle(ref.version, prepared)

    def _release(self, handle: SlotHandle) -> None:  # on the loop, between batches: the gen pipe is ours
        self._slot_refs.pop(handle.slot, None)
        with contextlib.suppress(EOFError, OSError):  # the process is gone, and its models with it
            self._gen.send(("free", handle.slot))

    def _generate(self, handle, rows, params, *, on_step=None, on_finish=None):
        raise RuntimeError("a process engine sends batches from its event loop (_send), not a batcher thread")

    # -- submitting --------------------------------------------------------------------------------------
    def _admit_rows(self, n: int) -> None:
        with self._admit:
            if self._closed:
                raise EngineClosed("engine is shutting down")
            if self._dead is not None:
                raise EngineClosed(self._dead)
            if self._queued_rows + n > self.max_queue:
                raise Overloaded(f"{self._queued_rows} sequences already waiting (max_queue {self.max_queue})")
            self._queued_rows += n

    def _unadmit(self, n: int) -> None:
        with self._admit:
            self._queued_rows -= n

    def submit(self, rows: list[list[int]], params: list[SamplingParams], channel: str = PRODUCTION,
               listener: TokenListener | None = None) -> Future:
        """Thread-safe; the future resolves to ``list[Generation]`` in row order (see :meth:`Engine.submit`)."""
        self._admit_rows(len(rows))
        fut: Future = Future()
        job = _Job(rows, params, channel, fut, listener)
        if self.on_loop():
            self._queue.append(job)
            self._pump()
        else:
            self.loop.call_soon_threadsafe(self._enqueue, job)
        return fut

    def submit_async(self, rows: list[list[int]], params: list[SamplingParams], channel: str = PRODUCTION,
                     listener: TokenListener | None = None) -> asyncio.Future:
        """On the engine's loop: queue the rows and, if the child is idle and no window applies, send them
        before returning. From any other loop: through the thread-safe :meth:`submit`."""
        if not self.on_loop():
            return asyncio.wrap_future(self.submit(rows, params, channel, listener))
        self._admit_rows(len(rows))
        fut = self.loop.create_future()
        self._queue.append(_Job(rows, params, channel, fut, listener))
        self._pump()
        return fut

    def _enqueue(self, item: _Job | _Control) -> None:
        """A thread caller's item, on the loop. The pump runs once after every item already handed over
        has been queued (they arrive as separate callbacks), so concurrent submissions can share a batch."""
        if self._closed or self._dead is not None:
            error = EngineClosed(self._dead or "engine is shutting down")
            _settle(item.future, error=error)
            return
        self._queue.append(item)
        if not self._pump_soon:
            self._pump_soon = True
            self.loop.call_soon(self._pump)

    def _control(self, action: Callable[[], Any]) -> Any:
        fut: Future = Future()
        if self.on_loop():
            raise RuntimeError("a control action cannot wait for itself on the engine's loop")
        with self._admit:
            if self._closed:
                raise EngineClosed("engine is shutting down")
        self.loop.call_soon_threadsafe(self._enqueue, _Control(action, fut))
        return fut.result()

    # -- the batcher, on the loop ------------------------------------------------------------------------
    def _pump(self) -> None:
        """Start the next batch if the child is idle: control items first, then jobs by the window rule
        of :meth:`Engine._take_batch` (a lone request after a lone batch starts at once; otherwise
        wait up to ``batch_window_ms`` from when the head job could have started, or until
        ``max_batch`` rows wait)."""
        self._pump_soon = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._inflight is not None or self._dead is not None:
            return
        if self._next_groups:
            self._send(*self._next_groups.popleft())
            return
        queue = self._queue
        while queue:
            head = queue[0]
            if isinstance(head, _Control):
                queue.popleft()
                if self._run_control(head):
                    return
                continue
            if head.future.cancelled():  # its caller gave up (timeout, disconnect) before it started
                queue.popleft()
                self._unadmit(len(head.rows))
                continue
            break
        else:
            self._deadline = None
            return
        now = time.perf_counter()
        if self._deadline is None:
            alone = len(queue) == 1 and self._last_batch_jobs <= 1
            self._deadline = now if alone else now + self.window_s
        if now < self._deadline and self._rows_ready() < self.max_batch:
            self._timer = self.loop.call_at(self.loop.time() + (self._deadline - now), self._pump)
            return
        self._deadline = None
        self._start_batch()

    def _run_control(self, item: _Control) -> bool:
        """Run a control item between batches; True when it handed work to the child, whose answer
        settles the item's future (nothing else is sent until then)."""
        try:
            result = item.action()
        except BaseException as err:  # noqa: BLE001 - reported to the caller of load()
            log.exception("engine control action failed")
            _settle(item.future, error=err)
            return False
        if not isinstance(result, ChildStep):
            _settle(item.future, result)
            return False
        result.future = item.future
        self._inflight = result
        try:
            self._gen.send(result.message)
        except (EOFError, OSError) as err:
            self._child_gone(err)
        return True

    def _rows_ready(self) -> int:
        rows = 0
        for item in self._queue:
            if isinstance(item, _Control):
                break
            rows += len(item.rows)
        return rows

    def _start_batch(self) -> None:
        """Take jobs from the head of the queue (up to ``max_batch`` rows or the next control item), as
        the thread batcher does; jobs for different versions become consecutive generate calls."""
        queue, jobs, rows = self._queue, [], 0
        while queue and not isinstance(queue[0], _Control):
            nxt = queue[0]
            if jobs and rows + len(nxt.rows) > self.max_batch:
                break
            queue.popleft()
            if nxt.future.cancelled():
                self._unadmit(len(nxt.rows))
                continue
            jobs.append(nxt)
            rows += len(nxt.rows)
        self._unadmit(rows)
        self._last_batch_jobs = len(jobs)
        self._next_groups.extend(self._by_handle(jobs))
        if self._next_groups:
            self._send(*self._next_groups.popleft())
        elif self._queue:
            self._pump()

    def _send(self, handle: SlotHandle, jobs: list[_Job]) -> None:
        batch = Batch(jobs, handle.version)
        self._started(batch)
        self._inflight = batch
        try:
            self._gen.send(("gen", handle.slot, batch.rows, batch.params, batch.streaming))
        except (EOFError, OSError) as err:
            self._child_gone(err)

    def _on_readable(self) -> None:
        try:
            messages = self._frames.read()
        except (EOFError, OSError) as err:
            self._child_gone(err)
            return
        for msg in messages:
            batch = self._inflight
            if batch is None:  # nothing was sent: a protocol error, never silently dropped
                log.error("message from the engine process with no batch in flight: %r", msg[0])
                continue
            kind = msg[0]
            if kind == "done":  # a ChildStep's answer
                self._inflight = None
                _settle(batch.future, msg[1], msg[2])
                if msg[2] is not None:
                    self._step_failed(msg[2])
                    return
            elif kind == "fin":
                batch.on_finish(msg[1], msg[2])
            elif kind == "step":
                batch.on_step(msg[1], msg[2])
            else:  # "end"
                self._inflight = None
                if msg[1] is not None:
                    batch.fail(msg[1])
                else:
                    batch.check_complete()
        if self._inflight is None:
            if self._drained is not None:
                _settle(self._drained)
            else:
                self._pump()

    def _step_failed(self, err: BaseException) -> None:
        """A swap that failed in the child may have left its engine on a mix of two versions' weights: start
        a new child on the versions the channels now name, as after a crash."""
        log.error("the %s engine process failed a swap (%r); replacing it", self.name, err)
        self._proc.kill()
        self._child_gone(err)

    def _child_gone(self, err: BaseException) -> None:
        """The engine process died: every request in flight or waiting gets 503 (EngineClosed), new ones
        too while a new process starts and reloads the versions that were live (on a thread of its own:
        this loop is the HTTP server's). The engine is not ready (``/readyz`` 503) until it serves again."""
        if self._dead is not None:
            return
        code = self._proc.exitcode if not self._proc.is_alive() else None
        how = f"exit status {code}" if code is not None else repr(err)
        self._dead = f"the {self.name} engine process died ({how}); restarting it"
        self._died_at = time.monotonic()
        log.error("%s; failing %d queued requests", self._dead, len(self._queue) + (self._inflight is not None))
        with contextlib.suppress(ValueError, OSError):
            self.loop.remove_reader(self._gen.fileno())
        self._fail_all(EngineClosed(self._dead))
        if self._drained is not None:
            _settle(self._drained)
            return
        if self.metrics is not None:
            self.metrics.engine_up.set(0)
        live = {channel: (handle.version, self._slot_refs.get(handle.slot)) for channel, handle in self._handles.items()}
        threading.Thread(target=self._restart, args=(live,), name=f"{self.name}-engine-restart", daemon=True).start()

    def _restart(self, live: dict[str, tuple[str, VersionRef | None]]) -> None:
        """Start a new engine process and load ``live`` (channel -> version, ref) into it, retrying with a
        growing pause until it works or the engine is closed; then hand it to the loop (``_adopt_child``)."""
        pause = 0.5
        while not self._closed:
            proc = None
            try:
                with self._ctl_lock:  # no load() may use the old pipe meanwhile
                    proc, gen, ctl = self._spawn_child()
                    handles = {}
                    for channel, (version, ref) in live.items():
                        if ref is None:
                            raise RuntimeError(f"no record of what channel {channel} served")
                        slot, _ = self._load_remote(ref.model_dir, channel, ctl)
                        handles[channel] = (SlotHandle(version, slot), ref)
                    old = (self._proc, self._gen, self._ctl)
                    self._proc, self._ctl = proc, ctl
                with contextlib.suppress(OSError):
                    old[1].close()
                    old[2].close()
                self.loop.call_soon_threadsafe(self._adopt_child, gen, handles)
                return
            except BaseException as err:  # noqa: BLE001 - retried; the gateway stays not ready meanwhile
                log.exception("restarting the %s engine process failed (%s); retrying in %.1f s", self.name, err, pause)
                if proc is not None and proc.is_alive():
                    proc.kill()
                time.sleep(pause)
                pause = min(pause * 2, 30.0)

    def _adopt_child(self, gen, handles: dict[str, tuple[SlotHandle, VersionRef]]) -> None:
        """On the loop: serve from the new process."""
        if self._closed:
            with contextlib.suppress(OSError):
                gen.close()
            return
        self._gen, self._frames = gen, Frames(gen.fileno())
        self._handles = {channel: handle for channel, (handle, _) in handles.items()}
        self._slot_refs = {handle.slot: ref for handle, ref in handles.values()}
        self.loop.add_reader(gen.fileno(), self._on_readable)
        self.restarts += 1
        self.last_restart_s = time.monotonic() - self._died_at
        with self._admit:
            self._dead = None
        if self.metrics is not None:
            self.metrics.engine_restarts.inc()
            self.metrics.engine_up.set(1)
        log.warning("%s engine process restarted in %.1f s, serving %s", self.name, self.last_restart_s, self.versions())
        self._pump()

    def _fail_all(self, error: BaseException) -> None:
        if self._inflight is not None:
            self._inflight.fail(error)
            self._inflight = None
        for _, jobs in self._next_groups:
            for job in jobs:
                _settle(job.future, error=error)
        self._next_groups.clear()
        while self._queue:
            _settle(self._queue.popleft().future, error=error)
        with self._admit:
            self._queued_rows = 0

    # -- shutdown ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Refuse new requests, fail the waiting ones, let the batch in flight finish (its requests are
        answered), then stop the child and the loop. Anything else running on the loop (the HTTP server)
        must have stopped first."""
        with self._admit:
            if self._closed:
                return
            self._closed = True
        drained: Future = Future()

        def begin() -> None:
            self._drained = drained
            if self._timer is not None:
                self._timer.cancel()
            for _, jobs in self._next_groups:
                for job in jobs:
                    _settle(job.future, error=EngineClosed("engine is shutting down"))
            self._next_groups.clear()
            while self._queue:
                _settle(self._queue.popleft().future, error=EngineClosed("engine is shutting down"))
            if self._inflight is None:
                _settle(drained)

        if self._worker.is_alive():
            self.loop.call_soon_threadsafe(begin)
            with contextlib.suppress(TimeoutError):
                drained.result(timeout=30)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._worker.join(timeout=30)
        self._shutdown()

    def _shutdown(self) -> None:
        self._handles.clear()
        with contextlib.suppress(EOFError, OSError):
            self._gen.send(("exit",))
        for conn in (self._gen, self._ctl):
            with contextlib.suppress(OSError):
                conn.close()
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout=5)
