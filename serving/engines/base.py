"""The engine interface and the micro-batcher the engines share.

Here one worker thread owns the model(s) (the vLLM engine, the in-thread torch engine); the torch
engines with their models in a child process run the same rules from an event loop instead
(:mod:`serving.engines.process`), reusing :class:`Batch` for the per-request bookkeeping. Requests queue as *jobs* (a request's rows: prompts x n, each
with its own sampling parameters); the worker takes the first waiting job, waits up to
``batch_window_ms`` for more, and runs up to ``max_batch`` rows in one generate call. Control jobs
(weight swaps) go through the same queue, so a swap happens *between* batches: the batch in flight
finishes on the weights it started with, and every row is attributed to the version of the handle
that actually produced it (resolved when its batch starts). The time the worker spends on a control
job is the swap pause: while it runs, nothing is generated; requests wait in the queue, none fail.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from policy.loading import load_tokenizer
from policy.sampling import Sample, SamplingParams
from serving.versions import VersionRef

log = logging.getLogger("serving.engine")

PRODUCTION, CANDIDATE = "production", "candidate"


class Overloaded(RuntimeError):
    """The engine queue is full (the gateway answers 503 with Retry-After)."""


class EngineClosed(RuntimeError):
    """The engine is shutting down."""


@dataclass
class Generation:
    sample: Sample
    version: str
    queued_ms: float  # waiting for a batch
    engine_ms: float  # the generate call that produced it


TokenListener = Callable[[str, list[tuple[int, int]]], None]
"""``listener(version, [(row_in_job, token_id), ...])``, called on the engine thread after each step."""

StepHook = Callable[[list[int], list[int]], None]  # (batch rows that sampled, their token ids)
FinishHook = Callable[[int, Sample], None]  # (batch row, its finished sample)


@dataclass
class _Job:
    rows: list[list[int]]
    params: list[SamplingParams]
    channel: str
    future: Future
    listener: TokenListener | None = None
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass
class _Control:
    action: Callable[[], Any]
    future: Future
    enqueued: float = field(default_factory=time.perf_counter)


def _settle(fut: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve a future unless its caller gave up on it (a client that disconnected cancels it)."""
    if fut.cancelled() or fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class Engine(ABC):
    """Micro-batching engine. Subclasses hold weights as opaque *handles* and implement the hooks."""

    supports_candidate = True
    name = "engine"

    def __init__(self, settings, metrics=None) -> None:
        self.settings = settings
        self.metrics = metrics
        s = settings.serving
        self.window_s = s.batch_window_ms / 1000
        self.max_batch = s.max_batch
        self.max_queue = s.max_queue
        self._queue: deque[_Job | _Control] = deque()
        self._queued_rows = 0
        self._last_batch_jobs = 0  # >1: requests are arriving concurrently, so the window is worth waiting
        self._cond = threading.Condition()
        self._handles: dict[str, Any] = {}
        self._closed = False
        self.tokenizer = None
        self.context_len: int | None = None
        self._vocab_size: int | None = None
        self.swap_pauses_s: list[float] = []  # swaps only (a channel's first load is start-up)
        self.batches_run = 0
        self._start_worker()
        if metrics is not None:
            metrics.engine_up.set(1)

    def _start_worker(self) -> None:
        """Start what runs the batches: here the batcher thread (an engine may drive them otherwise)."""
        self._worker = threading.Thread(target=self._run, name=f"{self.name}-batcher", daemon=True)
        self._worker.start()

    # -- hooks -------------------------------------------------------------------------------------
    @abstractmethod
    def _prepare(self, ref: VersionRef, channel: str) -> Any:
        """Caller's thread, off the serving path: read weights for ``ref`` into something installable."""

    @abstractmethod
    def _install(self, channel: str, prepared: Any, ref: VersionRef) -> Any:
        """Worker thread, between batches: make ``prepared`` live; return the handle to store."""

    @abstractmethod
    def _generate(self, handle: Any, rows: list[list[int]], params: list[SamplingParams], *,
                  on_step: StepHook | None = None, on_finish: FinishHook | None = None) -> list[Sample]:
        """Worker thread: one batched generate call. ``on_step(rows, tokens)`` after each decoding step
        (when given), ``on_finish(row, sample)`` as each row finishes (always given by the batcher)."""

    def _adopt(self, ref: VersionRef, vocab_size: int, context_len: int | None) -> None:
        """The first version brings the tokenizer the gateway encodes with; later ones must share its vocabulary."""
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(ref.model_dir)
            self.context_len = context_len
        elif vocab_size != self._vocab_size:
            raise ValueError(f"version {ref.version} has vocabulary {vocab_size}, the served "
                             f"tokenizer {self._vocab_size}: a tokenizer change needs a restart")
        self._vocab_size = vocab_size

    def _finish_swap(self, handle: Any, pause: float) -> Any:
        """Worker, right after a swap installed ``handle``: the swap's pause (an engine whose swap is not done
        yet returns what will finish it; see :class:`serving.engines.process.ChildStep`)."""
        return pause

    def _handle_version(self, handle: Any) -> str:
        return handle.version

    def _release(self, handle: Any) -> None:  # noqa: B027 - optional hook: most engines free nothing
        """Worker thread: ``handle`` no longer serves any channel (replaced or dropped); no batch uses it."""

    # -- public ------------------------------------------------------------------------------------
    def versions(self) -> dict[str, str]:
        return {ch: self._handle_version(h) for ch, h in self._handles.items()}

    @property
    def ready(self) -> bool:
        return PRODUCTION in self._handles and not self._closed

    @property
    def queue_depth(self) -> int:
        return self._queued_rows

    def submit(self, rows: list[list[int]], params: list[SamplingParams], channel: str = PRODUCTION,
               listener: TokenListener | None = None) -> Future:
        """Queue one request's rows; the future resolves to ``list[Generation]`` in row order.

        ``listener`` (optional, for streaming) receives the job's tokens as they are sampled, on the
        engine thread: it must be quick and must not block (hand the tokens to another thread)."""
        fut: Future = Future()
        with self._cond:
            if self._closed:
                raise EngineClosed("engine is shutting down")
            if self._queued_rows + len(rows) > self.max_queue:
                raise Overloaded(f"{self._queued_rows} sequences already waiting (max_queue {self.max_queue})")
            self._queue.append(_Job(rows, params, channel, fut, listener))
            self._queued_rows += len(rows)
            self._cond.notify()
        return fut

    def submit_async(self, rows: list[list[int]], params: list[SamplingParams], channel: str = PRODUCTION,
                     listener: TokenListener | None = None) -> asyncio.Future:
        """:meth:`submit` for a caller on an asyncio event loop: an asyncio future of the same result.
        Overload and shutdown raise here, as in :meth:`submit`; cancelling the future withdraws a request
        that has not started."""
        return asyncio.wrap_future(self.submit(rows, params, channel, listener))

    def load(self, ref: VersionRef, channel: str = PRODUCTION) -> float:
        """Install ``ref`` on ``channel``; block until live; return the serving pause in seconds."""
        first = channel not in self._handles
        prepared = self._prepare(ref, channel)

        def action() -> float:
            t0 = time.perf_counter()
            old = self._handles.get(channel)
            new = self._handles[channel] = self._install(channel, prepared, ref)
            pause = time.perf_counter() - t0
            if old is None:
                return pause
            self._release(old)  # after the pause: freeing the old weights does not hold up serving
            return self._finish_swap(new, pause)

        pause = self._control(action)
        if not first:
            self.swap_pauses_s.append(pause)
            del self.swap_pauses_s[:-1000]  # bounded: a long-lived gateway swaps every few hours
        return pause

    def drop(self, channel: str) -> None:
        def action() -> None:
            old = self._handles.pop(channel, None)
            if old is not None:
                self._release(old)

        self._control(action)

    def _control(self, action: Callable[[], Any]) -> Any:
        """Run ``action`` where batches run, between two of them; block until it has; return its result."""
        fut: Future = Future()
        with self._cond:
            if self._closed:
                raise EngineClosed("engine is shutting down")
            self._queue.append(_Control(action, fut))
            self._cond.notify()
        return fut.result()

    def generate_now(self, rows: list[list[int]], params: list[SamplingParams], channel: str = PRODUCTION,
                     timeout: float | None = None) -> list[Generation]:
        """Submit and wait: the direct engine path (benchmarks compare the gateway against it)."""
        return self.submit(rows, params, channel).result(timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            self._queued_rows = 0
            self._cond.notify_all()
        for item in pending:
            _settle(item.future, error=EngineClosed("engine is shutting down"))
        self._worker.join(timeout=30)
        self._shutdown()

    def _shutdown(self) -> None:
        self._handles.clear()

    # -- worker ------------------------------------------------------------------------------------
    def _take_batch(self) -> list[_Job] | _Control | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            first = self._queue.popleft()
            if isinstance(first, _Control):
                return first
            batch, rows = [first], len(first.rows)
            # Alone (nothing else waiting, and the last batch was a lone request too): start now, there is
            # nobody to wait for. Under concurrent load batches hold several jobs and the window stays on.
            window = self.window_s if (self._queue or self._last_batch_jobs > 1) else 0.0
            deadline = time.perf_counter() + window
            while rows < self.max_batch:
                if not self._queue:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                    if self._closed:
                        break
                    continue
                nxt = self._queue[0]
                if isinstance(nxt, _Control) or rows + len(nxt.rows) > self.max_batch:
                    break
                batch.append(self._queue.popleft())
                rows += len(nxt.rows)
            self._queued_rows -= rows
            self._last_batch_jobs = len(batch)
            return batch

    def _run(self) -> None:
        while True:
            item = self._take_batch()
            if item is None:
                return
            if isinstance(item, _Control):
                try:
                    _settle(item.future, item.action())
                except BaseException as err:  # noqa: BLE001 - reported to the caller of load()
                    log.exception("engine control action failed")
                    _settle(item.future, error=err)
                continue
            self._run_batch(item)

    def _by_handle(self, batch: list[_Job]) -> list[tuple[Any, list[_Job]]]:
        """The batch's jobs grouped by the handle (version) their channel is served by, resolved now: each
        group is one generate call. A job with no version to serve it is answered with EngineClosed."""
        groups: dict[int, tuple[Any, list[_Job]]] = {}
        for job in batch:
            handle = self._handles.get(job.channel) or self._handles.get(PRODUCTION)
            if handle is None:
                _settle(job.future, error=EngineClosed("no model version is loaded yet"))
                continue
            groups.setdefault(id(handle), (handle, []))[1].append(job)
        return list(groups.values())

    def _run_batch(self, batch: list[_Job]) -> None:
        for handle, jobs in self._by_handle(batch):
            self._run_group(handle, jobs)

    def _run_group(self, handle: Any, jobs: list[_Job]) -> None:
        batch = Batch(jobs, self._handle_version(handle))
        self._started(batch)
        try:
            self._generate(handle, batch.rows, batch.params, on_step=batch.on_step if batch.streaming else None,
                           on_finish=batch.on_finish)
        except BaseException as err:  # noqa: BLE001 - each request gets the error, the worker lives on
            log.exception("generate failed for a batch of %d rows", len(batch.rows))
            batch.fail(err)
            return
        batch.check_complete()

    def _started(self, batch: Batch) -> None:
        self.batches_run += 1  # counted at the start: its first requests may be answered before it ends
        if self.metrics is not None:
            self.metrics.batch_rows.observe(len(batch.rows))


class Batch:
    """One generate call's requests: which request each row belongs to, and their answers as rows finish.

    A request is answered (its future resolved) as soon as its own rows are done, so a short request in
    a batch with long ones does not wait for them. Its ``engine_ms`` is the time from the batch's start
    to its last row."""

    def __init__(self, jobs: list[_Job], version: str) -> None:
        self.jobs, self.version = jobs, version
        self.rows = [r for j in jobs for r in j.rows]
        self.params = [p for j in jobs for p in j.params]
        self.owner: list[tuple[int, int]] = [(ji, k) for ji, j in enumerate(jobs) for k in range(len(j.rows))]
        self.results: list[list[Sample | None]] = [[None] * len(j.rows) for j in jobs]
        self.left = [len(j.rows) for j in jobs]
        self.streaming = any(j.listener is not None for j in jobs)
        self.t0 = time.perf_counter()

    def on_finish(self, row: int, sample: Sample) -> None:
        ji, k = self.owner[row]
        self.results[ji][k] = sample
        self.left[ji] -= 1
        if self.left[ji] == 0:  # this request is complete: answer it now, the batch may go on
            j, t0 = self.jobs[ji], self.t0
            engine_ms = (time.perf_counter() - t0) * 1000
            _settle(j.future, [Generation(s, self.version, (t0 - j.enqueued) * 1000, engine_ms)
                               for s in self.results[ji]])

    def on_step(self, batch_rows: list[int], tokens: list[int]) -> None:
        per_job: dict[int, list[tuple[int, int]]] = {}
        for row, tok in zip(batch_rows, tokens, strict=True):
            ji, k = self.owner[row]
            if self.jobs[ji].listener is not None:
                per_job.setdefault(ji, []).append((k, tok))
        for ji, step in per_job.items():
            try:
                self.jobs[ji].listener(self.version, step)
            except Exception:  # noqa: BLE001 - a broken listener must not fail the batch
                log.exception("token listener failed; detaching it")
                self.jobs[ji].listener = None

    def fail(self, err: BaseException) -> None:
        """Every request not answered yet gets ``err``."""
        for j in self.jobs:
            _settle(j.future, error=err)

    def check_complete(self) -> None:
        for ji, j in enumerate(self.jobs):
            if self.left[ji]:  # an engine that did not report every row: a bug, never a silent hang
                _settle(j.future, error=RuntimeError(f"engine returned {len(j.rows) - self.left[ji]} of "
                                                     f"{len(j.rows)} rows"))
