"""The HTTP layer: OpenAI-compatible routes over a :class:`serving.gateway.Gateway`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming), ``GET /v1/models``,
``POST /v1/feedback``, ``GET /healthz`` (alive), ``GET /readyz`` (a version is loaded), ``GET /metrics``.

Error contract (OpenAI's ``{"error": {...}}`` body): 401 bad key, 403 refused feedback token, 404
unknown model, 413 body or prompt too large, 422 invalid JSON or schema (with details), 429 rate
limited and 503 overloaded (both with ``Retry-After``). A 500 means a bug in the gateway, never a
client mistake.

Bodies are read and validated here (not by FastAPI's parameter injection) so that the size limit
applies while reading and every validation error has the same shape.

Streaming is incremental: a streamed request is submitted with a token listener (see
:mod:`serving.engines.base`); the engine thread hands each decoding step's tokens to the request's
event loop (:class:`TokenFeed`), and each choice's new text is sent as soon as it is final
(:class:`StreamText`: an incomplete UTF-8 sequence, or a tail that could still become a stop
string, is held back until it resolves). The response starts when the first tokens exist, so errors
before that (overload, timeout in the queue) still get their HTTP status; a failure after it arrives
as an SSE ``{"error": ...}`` event, which the openai client raises. Completion ids and feedback tokens
are in every chunk; per-token log-probs (when asked for) come with each choice's last chunk; the
completion event (all token ids and log-probs) is emitted when the choices are complete, also when
the client disconnected mid-stream.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from policy.sampling import ContextTooLong, SamplingParams
from realtime_rl.events import CompletionEvent, FeedbackEvent, SamplingRecord
from serving.chat import render_chat
from serving.engines.base import PRODUCTION, EngineClosed, Generation, Overloaded
from serving.gateway import Gateway, UnknownModel
from serving.schemas import (
    ChatChunk,
    ChatChunkChoice,
    ChatDelta,
    ChatRequest,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
    FeedbackRequest,
    FeedbackResponse,
    ModelCard,
    ModelList,
    TokenLogprob,
    Usage,
)

log = logging.getLogger("serving.app")
SEED_STRIDE = 1_000_003  # row seed = seed + SEED_STRIDE * prompt index + choice index (as policy.sampling)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str | None = None,
                 retry_after: float | None = None, details: list | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code
        self.retry_after, self.details, self.param = retry_after, details, param


def _error_response(err: APIError) -> JSONResponse:
    body = ErrorResponse(error=ErrorDetail(message=err.message, type=err.type, code=err.code, param=err.param,
                                           details=err.details))
    headers = {}
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(1, int(err.retry_after + 0.999)))
    return JSONResponse(body.model_dump(exclude_none=True), status_code=err.status, headers=headers)


def _json(model: BaseModel, headers: dict[str, str] | None = None) -> Response:
    return Response(model.model_dump_json(), media_type="application/json", headers=headers)


# Response bodies of the two completion routes are built as plain dicts and encoded by the C JSON
# encoder: same fields and order as the pydantic schemas in serving.schemas (the tests compare them),
# without validating what the gateway itself just built.
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode
_JSON_TYPE = (b"content-type", b"application/json")


def _finite(values: list[float]) -> list[float | None]:
    """JSON has no infinities: a -inf log-prob is sent as null (as pydantic serialises it)."""
    return [v if math.isfinite(v) else None for v in values]


class _ThenResponse:
    """A JSON response that runs ``after()`` once its bytes are handed to the server, whether or not the
    client is still there: work the caller does not wait for (events, metrics) stays off its latency.
    Sent as raw ASGI messages with the headers already encoded (no per-request header object)."""

    __slots__ = ("body", "headers", "_after")

    def __init__(self, body: bytes, headers: list[tuple[bytes, bytes]], after: Callable[[], None]) -> None:
        self.body, self._after = body, after
        self.headers = [_JSON_TYPE, (b"content-length", str(len(body)).encode()), *headers]

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            await send({"type": "http.response.body", "body": self.body})
        finally:
            self._after()


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the {limit}-byte limit",
                       "invalid_request_error", "request_too_large")
    chunks, size = [], 0
    receive = request.receive
    while True:  # the ASGI messages directly: Request.stream() is an async generator per request
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the {limit}-byte limit", "invalid_request_error",
                           "request_too_large")
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _parse(model: type[BaseModel], raw: bytes):
    try:
        return model.model_validate_json(raw)
    except ValidationError as err:
        details = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in err.errors()]
        first = details[0] if details else {"loc": [], "msg": "invalid body"}
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise APIError(422, f"{where}: {first['msg']}", "invalid_request_error", "invalid_body",
                       details=details, param=where) from None


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
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
        _call_soon(self.loop, self._put, ("tokens", version, step))

    def done(self, fut: Future) -> None:  # engine thread (or here, if already done)
        _call_soon(self.loop, self._put, ("done", fut))

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


class _GatewayApp(FastAPI):
    """FastAPI, with the completion routes called straight from the ASGI entry point: Starlette's
    middleware stack (error middleware, exception middleware, exit stack, router matching, the
    request/response wrapper) is about a tenth of a completion request's Python time on the event
    loop (profiled), for nothing these routes use. Other routes, the lifespan, and any request under
    a ``root_path`` take the regular path."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.direct: dict[tuple[str, str], Callable] = {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and not scope.get("root_path"):
            run = self.direct.get((scope["method"], scope["path"]))
            if run is not None:
                scope["app"] = self
                await run(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(settings, gateway: Gateway | None = None) -> FastAPI:
    """The FastAPI app. Without ``gateway`` one is built from settings and started with the app."""
    own = gateway is None
    gw = gateway or Gateway(settings)
    s = settings.serving

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if own:
            await asyncio.to_thread(gw.start)
        yield
        if own:
            await asyncio.to_thread(gw.stop)

    app = _GatewayApp(title="rtrl gateway", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                      openapi_url=None)
    app.state.gateway = gw

    def route(path: str, method: str, direct: bool = False):
        """Plain Starlette routes: every handler takes the Request and reads and validates its body itself,
        so FastAPI's per-request dependency solving would only add latency. ``direct``: also dispatched
        by :class:`_GatewayApp` without the middleware stack (the errors are turned into responses here,
        by the same handlers the app registers)."""
        def register(fn):
            app.add_route(path, fn, methods=[method], include_in_schema=False)
            if direct:
                async def run(scope, receive, send) -> None:
                    request = Request(scope, receive, send)
                    try:
                        response = await fn(request)
                    except APIError as err:
                        response = await _api_error(request, err)
                    except ClientDisconnect:
                        return  # nobody to answer
                    except Exception as err:  # noqa: BLE001 - answered 500 and logged, as by the app's handler
                        response = await _unexpected(request, err)
                    await response(scope, receive, send)

                app.direct[(method, path)] = run
            return fn
        return register
    m = gw.metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        route = getattr(request.state, "route", request.url.path)
        m.requests.labels(route, str(err.status)).inc()
        return _error_response(err)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        log.exception("unhandled error on %s", request.url.path)
        m.requests.labels(request.url.path, "500").inc()
        return _error_response(APIError(500, "internal error", "server_error"))

    def authenticate(request: Request, route: str) -> str:
        request.state.route = route
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        key_id = gw.keys.authenticate(key.strip()) if scheme.lower() == "bearer" else None
        if key_id is None:
            m.auth_failures.inc()
            raise APIError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                           "invalid_request_error", "invalid_api_key")
        wait = gw.limiter.acquire(key_id)
        if wait > 0:
            m.rate_limited.inc()
            raise APIError(429, "rate limit exceeded for this key", "rate_limit_error", "rate_limited",
                           retry_after=wait)
        return key_id

    def encode(text: str) -> list[int]:
        tok = gw.engine.tokenizer
        # The Rust tokenizer directly: same ids as tokenizer(text, add_special_tokens=False), ~15x less
        # Python overhead (the test suite checks the ids against the transformers call).
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None:
            return backend.encode(text, add_special_tokens=False).ids
        return tok(text, add_special_tokens=False)["input_ids"]

    def prompt_rows(req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
        p = req.prompt
        if isinstance(p, str):
            texts = [p]
        elif all(isinstance(x, str) for x in p):
            texts = list(p)
        else:
            ids = [list(p)] if all(isinstance(x, int) for x in p) else [list(x) for x in p]
            vocab = len(gw.engine.tokenizer)
            for row in ids:
                if row and (min(row) < 0 or max(row) >= vocab):
                    raise APIError(422, f"prompt token ids must be in [0, {vocab})", "invalid_request_error",
                                   "invalid_token_id", param="prompt")
            return ids, [gw.engine.tokenizer.decode(x) for x in ids]
        return [encode(t) for t in texts], texts

    def plan(req, prompts: list[list[int]], max_tokens: int | None, key_id: str):
        """Validate limits and build the engine rows: (rows, params, channel, max_new)."""
        if req.n > s.max_n:
            raise APIError(422, f"n={req.n} exceeds the limit {s.max_n}", "invalid_request_error", "n_too_large",
                           param="n")
        max_new = max_tokens or s.default_max_tokens
        if max_new > s.max_tokens_limit:
            raise APIError(422, f"max_tokens={max_new} exceeds the limit {s.max_tokens_limit}",
                           "invalid_request_error", "max_tokens_too_large", param="max_tokens")
        try:
            channel = gw.channel_for(key_id, req.model)
        except UnknownModel as err:
            raise APIError(404, str(err), "invalid_request_error", "model_not_found", param="model") from None
        ctx = gw.engine.context_len
        for ids in prompts:
            if not ids:
                raise APIError(422, "prompt is empty", "invalid_request_error", "empty_prompt", param="prompt")
            if len(ids) > s.max_prompt_tokens or (ctx is not None and len(ids) + max_new > ctx):
                raise APIError(413, f"prompt of {len(ids)} tokens + max_tokens {max_new} exceeds the limit "
                               f"(max_prompt_tokens {s.max_prompt_tokens}, context {ctx})",
                               "invalid_request_error", "context_length_exceeded", param="prompt")
        rows, params = [], []
        stop = list(req.stop)
        for i, ids in enumerate(prompts):
            for k in range(req.n):
                rows.append(ids)
                seed = None if req.seed is None else (req.seed + SEED_STRIDE * i + k) % 2**63
                params.append(SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                             max_new_tokens=max_new, stop=stop, seed=seed))
        if len(rows) > s.max_batch * 4:
            raise APIError(422, f"{len(rows)} sequences (prompts x n) in one request exceed the limit "
                           f"{s.max_batch * 4}", "invalid_request_error", "too_many_sequences")
        return rows, params, channel, max_new

    def submit(rows, params, channel, listener=None) -> asyncio.Future:
        try:
            return gw.engine.submit_async(rows, params, channel, listener)
        except Overloaded as err:
            raise APIError(503, f"overloaded: {err}", "server_overloaded", "overloaded", retry_after=1) from None
        except EngineClosed as err:
            raise APIError(503, str(err), "server_unavailable", "unavailable", retry_after=5) from None

    def engine_error(err: BaseException) -> APIError:
        if isinstance(err, TimeoutError):
            return APIError(503, "timed out waiting for the engine", "server_overloaded", "timeout", retry_after=5)
        if isinstance(err, EngineClosed):
            return APIError(503, str(err), "server_unavailable", "unavailable", retry_after=5)
        if isinstance(err, ContextTooLong):
            return APIError(413, str(err), "invalid_request_error", "context_length_exceeded")
        raise err  # a bug: the 500 handler logs it

    async def generate(key_id: str, req, prompts: list[list[int]], max_tokens: int | None):
        """Generate, and sign each choice's completion id and feedback token while the engine works:
        returns (generations, engine seconds, max_new, attribution)."""
        rows, params, channel, max_new = plan(req, prompts, max_tokens, key_id)
        fut = submit(rows, params, channel)
        t0 = time.perf_counter()
        # The version that will serve the rows is fixed when their batch starts; it is almost always the
        # one live now, so the ids are made now, off the response's path, and again only after a swap.
        live = gw.engine.versions()
        expected = live.get(channel) or live.get(PRODUCTION)
        ids = attribution(key_id, len(rows), expected) if expected is not None else None
        try:
            async with asyncio.timeout(s.request_timeout_s):
                gens: list[Generation] = await fut
        except (TimeoutError, EngineClosed, ContextTooLong) as err:
            raise engine_error(err) from None
        engine_s = time.perf_counter() - t0
        if ids is None or gens[0].version != expected:
            ids = attribution(key_id, len(gens), gens[0].version)
        return gens, engine_s, max_new, ids

    def attribution(key_id: str, n_choices: int, version: str) -> list[tuple[str, str]]:
        """(completion_id, feedback_token) for each choice."""
        now = time.time()
        out = []
        for _ in range(n_choices):
            cid = "cmpl-" + os.urandom(16).hex()  # uuid4().hex's length and alphabet, a third of its cost
            out.append((cid, gw.tokens.issue(cid, key_id, version, now)))
        return out

    def record(key_id: str, req, gens: list[Generation], prompt_texts: list[str], max_new: int,
               latency_s: float, ids: list[tuple[str, str]], reserved: bool = False) -> None:
        """Emit each choice's completion event (``latency_s``: until the response was ready).
        ``reserved``: the events were announced with ``emitter.reserve`` before the response went out."""
        latency_ms = latency_s * 1000
        sampling = SamplingRecord(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                  max_tokens=max_new, stop=list(req.stop), seed=req.seed)
        for idx, (g, (cid, _)) in enumerate(zip(gens, ids, strict=True)):
            sample = g.sample
            gw.emitter.emit(CompletionEvent(
                completion_id=cid, caller=key_id, model=gw.model_name, version=g.version,
                prompt=prompt_texts[idx // req.n], completion=sample.text,
                prompt_token_ids=sample.prompt_token_ids, completion_token_ids=sample.token_ids,
                logprobs=sample.logprobs, sampling_logprobs=sample.sampling_logprobs, sampling=sampling,
                finish_reason=sample.finish_reason, latency_ms=latency_ms, task_bucket=req.task_bucket,
                choice_index=idx), reserved=reserved)
            m.completions.labels(g.version).inc()
            m.tokens.inc(len(sample.token_ids))

    def token_strings(ids: list[int]) -> list[str]:
        return [gw.engine.tokenizer.decode([t]) for t in ids]

    def completion_logprobs_dict(req, g: Generation, values=list) -> dict | None:
        """``CompletionLogprobs`` as a dict; ``values`` maps the log-prob list (``_finite`` for raw JSON)."""
        if req.logprobs is None:
            return None
        toks = token_strings(g.sample.token_ids)
        offsets, pos = [], 0
        for t in toks:
            offsets.append(pos)
            pos += len(t)
        lps = values(g.sample.logprobs)
        return {"tokens": toks, "token_logprobs": lps,
                "top_logprobs": [{t: v} for t, v in zip(toks, lps, strict=True)] if req.logprobs > 0 else None,
                "text_offset": offsets}

    def chat_logprobs_dict(req, g: Generation, values=list) -> dict | None:
        """``ChoiceLogprobs`` as a dict (see :func:`completion_logprobs_dict`)."""
        if not req.logprobs:
            return None
        toks = token_strings(g.sample.token_ids)
        return {"content": [{"token": t, "logprob": v, "bytes": list(t.encode()), "top_logprobs": []}
                            for t, v in zip(toks, values(g.sample.logprobs), strict=True)]}

    def completion_logprobs(req, g: Generation) -> CompletionLogprobs | None:
        d = completion_logprobs_dict(req, g)
        return None if d is None else CompletionLogprobs(**d)

    def chat_logprobs(req, g: Generation) -> ChoiceLogprobs | None:
        d = chat_logprobs_dict(req, g)
        return None if d is None else ChoiceLogprobs(content=[TokenLogprob(**t) for t in d["content"]])

    def usage_dict(gens: list[Generation], prompts: list[list[int]]) -> dict[str, int]:
        pt = sum(len(p) for p in prompts)
        ct = sum(len(g.sample.token_ids) for g in gens)
        return {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}

    def usage(gens: list[Generation], prompts: list[list[int]]) -> Usage:
        return Usage(**usage_dict(gens, prompts))

    ok = {r: (m.requests.labels(r, "200"), m.latency.labels(r)) for r in ("/v1/completions", "/v1/chat/completions")}

    def observe(route: str, total: float, engine_s: float) -> None:
        count, latency = ok[route]
        count.inc()
        latency.observe(total)
        m.overhead.observe(max(0.0, total - engine_s))
        m.engine_queue.set(gw.engine.queue_depth)

    def timing(t_start: float, engine_s: float, gens: list[Generation]) -> tuple[float, list[tuple[bytes, bytes]]]:
        """Time so far and the diagnostic headers: the gateway's time outside the engine, the time from
        submit to result (queue + generate), and the engine's own generate time for this request."""
        total = time.perf_counter() - t_start
        gen_ms = max(g.engine_ms for g in gens)
        return total, [(b"x-rtrl-overhead-ms", b"%.3f" % ((total - engine_s) * 1000)),
                       (b"x-rtrl-engine-ms", b"%.3f" % (engine_s * 1000)), (b"x-rtrl-generate-ms", b"%.3f" % gen_ms)]

    def respond(route: str, body: dict, t_start: float, engine_s: float, key_id: str, req,
                gens: list[Generation], prompt_texts: list[str], max_new: int,
                ids: list[tuple[str, str]]) -> _ThenResponse:
        """The response; its completion events and metrics follow once it is sent."""
        raw = _dumps(body).encode()
        total, headers = timing(t_start, engine_s, gens)
        gw.emitter.reserve(len(gens))  # counted as pending from now: wait_idle() cannot miss them

        def after() -> None:
            try:
                record(key_id, req, gens, prompt_texts, max_new, total, ids, reserved=True)
                observe(route, total, engine_s)
            except Exception:  # noqa: BLE001 - the response is out; never lose the others' events over it
                log.exception("recording a completion after its response failed")

        return _ThenResponse(raw, headers, after)

    def sse(obj: BaseModel | str) -> bytes:
        data = obj if isinstance(obj, str) else obj.model_dump_json(exclude_none=False)
        return f"data: {data}\n\n".encode()

    async def stream(key_id: str, req, route: str, prompts: list[list[int]], prompt_texts: list[str],
                     max_tokens: int | None, t_start: float, chunks) -> StreamingResponse:
        """Submit with a token listener; answer once the first tokens (or an error) arrive, then send each
        choice's text as it is generated. ``chunks`` renders the route's chunk bodies."""
        rows, params, channel, max_new = plan(req, prompts, max_tokens, key_id)
        loop = asyncio.get_running_loop()
        feed = TokenFeed(loop)
        fut = submit(rows, params, channel, feed.listener)
        t_submit = time.perf_counter()
        fut.add_done_callback(feed.done)
        deadline = loop.time() + s.request_timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                first = await feed.get()
        except TimeoutError as err:
            fut.cancel()
            raise engine_error(err) from None
        if first[0] == "done" and first[1].exception() is not None:
            raise engine_error(first[1].exception())
        version = first[1] if first[0] == "tokens" else first[1].result()[0].version
        ids = attribution(key_id, len(rows), version)
        model = f"{gw.model_name}@{version}"
        rid, created = chunks.new_id(), int(time.time())
        texts = [StreamText(gw.engine.tokenizer, p.stop) for p in params]
        state = {"recorded": False}

        def record_done(f: Future) -> None:
            if state["recorded"] or f.cancelled() or f.exception() is not None:
                return
            state["recorded"] = True
            record(key_id, req, f.result(), prompt_texts, max_new, time.perf_counter() - t_start, ids)

        async def events() -> AsyncIterator[bytes]:
            item = first
            try:
                for i, (cid, token) in enumerate(ids):
                    head = chunks.start(rid, created, model, i, cid, token)
                    if head is not None:
                        yield sse(head)
                while True:
                    if item[0] == "tokens":
                        out = []
                        for k, tok in item[2]:
                            delta = texts[k].push(tok)
                            if delta:
                                out.append(sse(chunks.delta(rid, created, model, k, *ids[k], delta)))
                        if out:
                            yield b"".join(out)
                    else:
                        f = item[1]
                        if f.exception() is not None:
                            err = engine_error(f.exception())
                            yield sse(ErrorResponse(error=ErrorDetail(message=err.message, type=err.type,
                                                                      code=err.code)))
                            return
                        gens = f.result()
                        record_done(f)
                        out = []
                        for k, g in enumerate(gens):
                            rest = texts[k].finish(g.sample.text)
                            out += [sse(c) for c in chunks.end(rid, created, model, k, *ids[k], rest, g)]
                        if req.include_usage:
                            out.append(sse(chunks.usage(rid, created, model, usage(gens, prompts))))
                        out.append(sse("[DONE]"))
                        yield b"".join(out)
                        observe(route, time.perf_counter() - t_start, time.perf_counter() - t_submit)
                        return
                    async with asyncio.timeout_at(deadline):
                        item = await feed.get()
            except TimeoutError:
                err = engine_error(TimeoutError())
                yield sse(ErrorResponse(error=ErrorDetail(message=err.message, type=err.type, code=err.code)))
            finally:
                if not state["recorded"]:
                    # The client went away (or the stream failed) before the end: the engine still finishes
                    # the rows, and what it generated is recorded like any other completion.
                    fut.add_done_callback(lambda f: _call_soon(loop, record_done, f))

        return StreamingResponse(events(), media_type="text/event-stream")

    class CompletionChunks:
        def __init__(self, req) -> None:
            self.req = req

        @staticmethod
        def new_id() -> str:
            return "cmpl-" + os.urandom(12).hex()

        @staticmethod
        def _body(rid, created, model, choices, usage=None):
            return CompletionResponse(id=rid, created=created, model=model, choices=choices, usage=usage)

        def start(self, rid, created, model, i, cid, token):
            return None

        def delta(self, rid, created, model, i, cid, token, text):
            return self._body(rid, created, model, [CompletionChoice(
                index=i, text=text, finish_reason=None, completion_id=cid, feedback_token=token)])

        def end(self, rid, created, model, i, cid, token, rest, g: Generation):
            return [self._body(rid, created, model, [CompletionChoice(
                index=i, text=rest, finish_reason=g.sample.finish_reason, logprobs=completion_logprobs(self.req, g),
                completion_id=cid, feedback_token=token)])]

        def usage(self, rid, created, model, u):
            return self._body(rid, created, model, [], u)

    class ChatChunks:
        def __init__(self, req) -> None:
            self.req = req

        @staticmethod
        def new_id() -> str:
            return "chatcmpl-" + os.urandom(12).hex()

        @staticmethod
        def _chunk(rid, created, model, i, cid, token, delta, finish_reason=None, lp=None):
            return ChatChunk(id=rid, created=created, model=model, choices=[ChatChunkChoice(
                index=i, delta=delta, finish_reason=finish_reason, logprobs=lp, completion_id=cid,
                feedback_token=token)])

        def start(self, rid, created, model, i, cid, token):
            return self._chunk(rid, created, model, i, cid, token, ChatDelta(role="assistant", content=""))

        def delta(self, rid, created, model, i, cid, token, text):
            return self._chunk(rid, created, model, i, cid, token, ChatDelta(content=text))

        def end(self, rid, created, model, i, cid, token, rest, g: Generation):
            out = []
            lp = chat_logprobs(self.req, g)
            if rest or lp is not None:
                out.append(self._chunk(rid, created, model, i, cid, token, ChatDelta(content=rest), lp=lp))
            out.append(self._chunk(rid, created, model, i, cid, token, ChatDelta(), g.sample.finish_reason))
            return out

        def usage(self, rid, created, model, u):
            return ChatChunk(id=rid, created=created, model=model, choices=[], usage=u)

    @route("/v1/completions", "POST", direct=True)
    async def completions(request: Request):
        t_start = time.perf_counter()
        route = "/v1/completions"
        key_id = authenticate(request, route)
        req = _parse(CompletionRequest, await _read_body(request, s.max_request_bytes))
        prompts, texts = prompt_rows(req)
        if req.stream:
            return await stream(key_id, req, route, prompts, texts, req.max_tokens, t_start, CompletionChunks(req))
        gens, engine_s, max_new, ids = await generate(key_id, req, prompts, req.max_tokens)
        choices = [{"index": idx, "text": g.sample.text, "logprobs": completion_logprobs_dict(req, g, _finite),
                    "finish_reason": g.sample.finish_reason, "completion_id": cid, "feedback_token": token}
                   for idx, (g, (cid, token)) in enumerate(zip(gens, ids, strict=True))]
        body = {"id": CompletionChunks.new_id(), "object": "text_completion", "created": int(time.time()),
                "model": f"{gw.model_name}@{gens[0].version}", "choices": choices,
                "usage": usage_dict(gens, prompts), "system_fingerprint": None}
        return respond(route, body, t_start, engine_s, key_id, req, gens, texts, max_new, ids)

    @route("/v1/chat/completions", "POST", direct=True)
    async def chat_completions(request: Request):
        t_start = time.perf_counter()
        route = "/v1/chat/completions"
        key_id = authenticate(request, route)
        req = _parse(ChatRequest, await _read_body(request, s.max_request_bytes))
        text = render_chat(gw.engine.tokenizer, req.messages)
        prompts = [encode(text)]
        max_tokens = req.max_completion_tokens or req.max_tokens
        if req.stream:
            return await stream(key_id, req, route, prompts, [text], max_tokens, t_start, ChatChunks(req))
        gens, engine_s, max_new, ids = await generate(key_id, req, prompts, max_tokens)
        choices = [{"index": i, "message": {"role": "assistant", "content": g.sample.text},
                    "logprobs": chat_logprobs_dict(req, g, _finite), "finish_reason": g.sample.finish_reason,
                    "completion_id": cid, "feedback_token": token}
                   for i, (g, (cid, token)) in enumerate(zip(gens, ids, strict=True))]
        body = {"id": ChatChunks.new_id(), "object": "chat.completion", "created": int(time.time()),
                "model": f"{gw.model_name}@{gens[0].version}", "choices": choices,
                "usage": usage_dict(gens, prompts), "system_fingerprint": None}
        return respond(route, body, t_start, engine_s, key_id, req, gens, [text], max_new, ids)

    @route("/v1/models", "GET")
    async def models(request: Request):
        authenticate(request, "/v1/models")
        now = int(time.time())
        cards = [ModelCard(id=gw.model_name, created=now)]
        cards += [ModelCard(id=f"{gw.model_name}@{v}", created=now) for v in sorted(set(gw.engine.versions().values()))]
        m.requests.labels("/v1/models", "200").inc()
        return _json(ModelList(data=cards))

    @route("/v1/feedback", "POST")
    async def feedback(request: Request):
        key_id = authenticate(request, "/v1/feedback")
        req = _parse(FeedbackRequest, await _read_body(request, s.max_request_bytes))
        verdict, claims = gw.tokens.check(req.feedback_token, req.completion_id, key_id)
        m.replay_evictions.set(gw.tokens.replay.evictions)
        if verdict != "ok":
            m.feedback_rejected.labels(verdict).inc()
            reasons = {"forged": "feedback token is not valid for this completion",
                       "foreign": "this completion was not served to this API key",
                       "expired": "feedback token has expired",
                       "replayed": "feedback for this completion was already recorded"}
            raise APIError(403, reasons[verdict], "permission_error", f"feedback_{verdict}")
        event = FeedbackEvent(completion_id=req.completion_id, caller=key_id, version=claims.version,
                              signal=req.signal, kept_text=req.kept_text, score=req.score, comment=req.comment)
        gw.emitter.emit(event)
        m.feedback.labels(req.signal).inc()
        m.requests.labels("/v1/feedback", "200").inc()
        return _json(FeedbackResponse(completion_id=req.completion_id, version=claims.version,
                                      event_id=event.event_id))

    @route("/healthz", "GET")
    async def healthz(request: Request):
        return JSONResponse({"status": "ok"})

    @route("/readyz", "GET")
    async def readyz(request: Request):
        body: dict[str, Any] = {"versions": gw.engine.versions(), "bus_up": gw.emitter.bus_up,
                                "events_pending": gw.emitter.pending,
                                "watcher_error": gw.watcher.last_error}
        if gw.ready:
            return JSONResponse({"status": "ready", **body})
        return JSONResponse({"status": "not_ready", **body}, status_code=503)

    @route("/metrics", "GET")
    async def metrics(request: Request):
        m.engine_queue.set(gw.engine.queue_depth)
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    return app

