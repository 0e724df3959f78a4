"""The engine process's side of the pipes (protocol: :mod:`serving.engines.process`), shared by the torch
and vLLM workers. A worker supplies a :class:`Backend`; this module runs it:

* the *ctl* pipe is served by a thread, so that reading a new version's weights never delays a batch;
* the main thread generates: one ``gen`` at a time, streaming ``step``/``fin`` messages back as they
  happen. Work that must not overlap generation (a vLLM engine's start-up: its forward context is
  process-global) is posted to the main thread with :meth:`ChildLoop.on_main`, which runs it between
  batches.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing import util
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

from policy.sampling import Sample, SamplingParams


class Backend(Protocol):
    def load(self, slot: int, model_dir: str, channel: str) -> dict:
        """ctl thread: make ``model_dir`` available as ``slot`` (live only once a ``gen`` names it); return
        ``{"vocab_size", "context_len"}``."""

    def free(self, slot: int) -> None:
        """Forget ``slot`` (no batch uses it)."""

    def swap(self, slot: int) -> None:
        """Main thread, between batches: make ``slot`` live now (sent only by engines whose swap is work in
        the child, :class:`serving.engines.process.ChildStep`)."""

    def generate(self, slot: int, rows: list[list[int]], params: list[SamplingParams], *,
                 on_step: Callable[[list[int], list[int]], None] | None,
                 on_finish: Callable[[int, Sample], None]) -> None:
        """Main thread: one batch on ``slot``'s weights."""


def portable(err: BaseException) -> BaseException:
    """The error itself when it survives pickling, else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001 - any unpicklable error still reaches the caller as text
        return RuntimeError(f"{type(err).__name__}: {err}")


class ChildLoop:
    def __init__(self, gen_conn: Connection, ctl_conn: Connection) -> None:
        self.gen, self.ctl = gen_conn, ctl_conn
        self._tasks: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()

    def on_main(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the main thread between batches; wait for it; return its result or raise its error."""
        fut: Future = Future()
        self._tasks.put((fn, fut))
        os.write(self._wake_w, b"x")
        return fut.result()

    def serve_ctl(self, backend: Backend) -> None:
        while True:
            try:
                kind, slot, model_dir, channel = self.ctl.recv()
            except (EOFError, OSError):
                return
            if kind == "free":  # a load the parent refused: it was never live
                backend.free(slot)
                continue
            try:
                reply: tuple = ("ok", backend.load(slot, model_dir, channel))
            except BaseException as err:  # noqa: BLE001 - reported to the caller of load()
                reply = ("err", portable(err))
            try:
                self.ctl.send(reply)
            except (EOFError, OSError):
                return

    def serve_gen(self, backend: Backend) -> None:
        send = self.gen.send
        while True:
            ready = wait([self.gen, self._wake_r])
            if self._wake_r in ready:
                os.read(self._wake_r, 1)
                fn, fut = self._tasks.get()
                try:
                    fut.set_result(fn())
                except BaseException as err:  # noqa: BLE001 - re-raised in the posting thread
                    fut.set_exception(err)
            if self.gen not in ready:
                continue
            try:
                msg = self.gen.recv()
            except (EOFError, OSError):
                return
            kind = msg[0]
            if kind == "exit":
                return
            if kind == "free":
                backend.free(msg[1])
                continue
            if kind == "swap":
                t0 = time.perf_counter()
                try:
                    backend.swap(msg[1])
                    reply: tuple = ("done", time.perf_counter() - t0, None)
                except BaseException as err:  # noqa: BLE001 - the caller of load() gets it
                    reply = ("done", None, portable(err))
                try:
                    send(reply)
                except (EOFError, OSError):
                    return
                continue
            _, slot, rows, params, stream = msg
            try:
                backend.generate(slot, rows, params, on_step=(lambda r, t: send(("step", r, t))) if stream else None,
                                 on_finish=lambda r, s: send(("fin", r, s)))
                error = None
            except BaseException as err:  # noqa: BLE001 - the batch's requests get it; the process lives on
                error = portable(err)
            try:
                send(("end", error))
            except (EOFError, OSError):
                return


def run(loop: ChildLoop, backend: Backend) -> None:
    """Serve both pipes until the parent says exit or goes away, then leave the process."""
    # The parent owns shutdown (it flushes events first): a Ctrl-C to the process group must not
    # kill the generator under batches in flight.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=loop.serve_ctl, args=(backend,), name="engine-worker-loader", daemon=True).start()
    status = 0
    try:
        loop.serve_gen(backend)
    except BaseException:  # noqa: BLE001 - reported below; the parent sees the pipe close
        traceback.print_exc()
        status = 1
    # Leave without the interpreter's teardown: a native thread pool still holding a joinable
    # std::thread when static destructors run aborts the process ("terminate called without an
    # active exception", exit status -6). Nothing here needs flushing but the standard streams.
    # multiprocessing's exit-time finalizers still run: they unlink the named semaphores a library made
    # (vLLM does), which the parent's resource tracker would otherwise report as leaked when it exits.
    util._run_finalizers(0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
