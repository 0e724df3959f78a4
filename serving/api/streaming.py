"""Streamed completions (server-sent events), incremental as the engine decodes.

A streamed request is submitted with a token listener (see :mod:`serving.engines.base`); the engine
thread hands each decoding step's tokens to the request's event loop (:class:`TokenFeed`), and each
choice's new text is sent as soon as it is final (:class:`StreamText`: an incomplete UTF-8 sequence,
or a tail that could still become a stop string, is held back until it resolves). The response starts
when the first tokens exist, so errors before that (overload, timeout in the queue) still get their
HTTP status; a failure after it arrives as an SSE ``{"error": ...}`` event, which the openai client
raises. Completion ids and feedback tokens are in every chunk; per-token log-probs (when asked for)
come with each choice's last chunk; the completion events (all token ids and log-probs) are emitted
when the choices are complete, also when the client disconnected mid-stream.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, Protocol

from pydantic import BaseModel

from serving.api import render
from serving.api.errors import engine_error
from serving.api.plan import Plan, Prompted

log = logging.getLogger("serving.api")


def call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: the server is shutting down
        loop.call_soon_threadsafe(fn, *args)


class TokenFeed:
    """Engine thread -> one request's event loop: ``("tokens", version, [(row, token)])`` per decoding step,
    then ``("done", future)``. Items arrive in the order the engine produced them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: collections.deque = collections.deque()
        self.ready = asyncio.Event()

    def listener(self, version: str, step: list[tuple[int, int]]) -> None:  # engine thread
        call_soon(self.loop, self._put, ("tokens", version, step))

    def done(self, fut: Future) -> None:  # engine thread (or here, if already done)
        call_soon(self.loop, self._put, ("done", fut))

    def _put(self, item: tuple) -> None:
        self.items.append(item)
        self.ready.set()

    async def get(self) -> tuple:
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        return self.items.popleft()


class StreamText:
    """One choice's text as its tokens arrive: :meth:`push` returns the newly final text.

    Text is final when it cannot change any more: a trailing incomplete UTF-8 sequence (decoded as
    U+FFFD) waits for its next byte, and a tail that is the beginning of a stop string waits until it
    either completes the stop string (then it is cut, as in the engine) or diverges. So the pieces sent
    are always a prefix of the choice's final text, and :meth:`finish` sends the rest.
    """

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer, self.stop = tokenizer, [x for x in stop if x]
        self.ids: list[int] = []
        self.sent = ""

    def _held(self, text: str) -> int:
        held = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:n]):
                    held = n
                    break
        return held

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd")
        if self.stop:
            hit = min((text.find(x) for x in self.stop if x in text), default=-1)
            text = text[:hit] if hit >= 0 else text[:len(text) - self._held(text)]
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece

    def finish(self, final: str) -> str:
        """The rest of ``final`` (the engine's text for this choice) after what was sent."""
        if not final.startswith(self.sent):  # cannot happen with a prefix-stable decoder; never silent
            log.warning("streamed text %r is not a prefix of the final text %r", self.sent, final)
            return final[len(self.sent):] if len(final) > len(self.sent) else ""
        rest, self.sent = final[len(self.sent):], final
        return rest


def sse(obj: BaseModel | str) -> bytes:
    data = obj if isinstance(obj, str) else obj.model_dump_json(exclude_none=False)
    return f"data: {data}\n\n".encode()


class StreamOwner(Protocol):
    """What a stream needs from :class:`serving.api.handler.GatewayHandler` (which creates it)."""

    gw: Any
    tokenizer: Any
    serving: Any

    def submit(self, plan: Plan, listener: Callable | None = None) -> Future: ...
    def attribution(self, key_id: str, n_choices: int, version: str) -> render.Attribution: ...
    def record(self, p: Prompted, gens: list, max_new: int, latency_s: float, ids: render.Attribution,
               reserved: bool = False) -> None: ...
    def observe(self, route: str, total: float, engine_s: float) -> None: ...


class StreamSession:
    """One streamed request: :meth:`open` submits it and waits for its first tokens, :meth:`events` yields
    its SSE bytes. Its completion events are recorded exactly once, when all its choices are complete."""

    def __init__(self, handler: StreamOwner, prompted: Prompted, plan: Plan) -> None:
        self.h, self.p, self.plan = handler, prompted, plan
        self.loop = asyncio.get_running_loop()
        self.feed = TokenFeed(self.loop)
        self.recorded = False

    async def open(self) -> None:
        h, p = self.h, self.p
        self.fut = h.submit(self.plan, self.feed.listener)
        self.t_submit = time.perf_counter()
        self.fut.add_done_callback(self.feed.done)
        self.deadline = self.loop.time() + h.serving.request_timeout_s
        try:
            async with asyncio.timeout_at(self.deadline):
                self.first = await self.feed.get()
        except TimeoutError as err:
            self.fut.cancel()
            raise engine_error(err) from None
        if self.first[0] == "done" and self.first[1].exception() is not None:
            raise engine_error(self.first[1].exception())
        version = self.first[1] if self.first[0] == "tokens" else self.first[1].result()[0].version
        self.ids = h.attribution(p.key_id, len(self.plan.rows), version)
        model = f"{h.gw.model_name}@{version}"
        chunks = render.ChatChunks if p.route == "/v1/chat/completions" else render.CompletionChunks
        self.chunks = chunks(h.tokenizer, p.req, chunks.new_id(), int(time.time()), model)
        self.texts = [StreamText(h.tokenizer, x.stop) for x in self.plan.params]

    def record_done(self, f: Future) -> None:
        if self.recorded or f.cancelled() or f.exception() is not None:
            return
        self.recorded = True
        self.h.record(self.p, f.result(), self.plan.max_new, time.perf_counter() - self.p.t_start, self.ids)

    def _deltas(self, step: list[tuple[int, int]]) -> bytes:
        out = []
        for k, tok in step:
            delta = self.texts[k].push(tok)
            if delta:
                out.append(sse(self.chunks.delta(k, *self.ids[k], delta)))
        return b"".join(out)

    def _ending(self, f: Future) -> bytes:
        gens = f.result()
        self.record_done(f)
        out = []
        for k, g in enumerate(gens):
            rest = self.texts[k].finish(g.sample.text)
            out += [sse(c) for c in self.chunks.end(k, *self.ids[k], rest, g)]
        if self.p.req.include_usage:
            out.append(sse(self.chunks.usage(render.usage(gens, self.p.prompts))))
        out.append(sse("[DONE]"))
        return b"".join(out)

    async def events(self) -> AsyncIterator[bytes]:
        item = self.first
        try:
            for i, (cid, token) in enumerate(self.ids):
                head = self.chunks.start(i, cid, token)
                if head is not None:
                    yield sse(head)
            while True:
                if item[0] == "tokens":
                    out = self._deltas(item[2])
                    if out:
                        yield out
                elif item[1].exception() is not None:
                    yield sse(engine_error(item[1].exception()).body())
                    return
                else:
                    yield self._ending(item[1])
                    now = time.perf_counter()
                    self.h.observe(self.p.route, now - self.p.t_start, now - self.t_submit)
                    return
                async with asyncio.timeout_at(self.deadline):
                    item = await self.feed.get()
        except TimeoutError:
            yield sse(engine_error(TimeoutError()).body())
        finally:
            if not self.recorded:
                # The client went away (or the stream failed) before the end: the engine still finishes
                # the rows, and what it generated is recorded like any other completion.
                self.fut.add_done_callback(lambda f: call_soon(self.loop, self.record_done, f))
