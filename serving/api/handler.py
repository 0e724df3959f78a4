""":class:`GatewayHandler`: what the HTTP routes do, without HTTP.

One handler per app, held on ``app.state.handler``; the routers reach it through a dependency. It
owns the request path's work over a :class:`serving.gateway.Gateway` (engine, versions, keys, feedback
tokens, event emitter, metrics): authenticate and rate-limit a key, turn a request into engine rows,
generate, sign each choice's completion id and feedback token, build the response model, and record
the completion events once the response is out. Its methods take and return the schema models, so
they can be called (and tested) without a server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from policy.sampling import ContextTooLong, SamplingParams
from policy.summary import SUMMARY_PREFIX, SUMMARY_REQUEST, clean_summary
from realtime_rl.events import CompletionEvent, FeedbackEvent, SamplingRecord, SessionRecord
from serving.api import render, sessions
from serving.api.errors import APIError, engine_error
from serving.api.plan import Plan, Prompted, SamplingRequest
from serving.api.streaming import StreamSession
from serving.chat import render_chat
from serving.engines.base import PRODUCTION, EngineClosed, Generation, Overloaded
from serving.gateway import Gateway, UnknownModel
from serving.schemas import (
    ChatMessage,
    ChatRequest,
    ChatResponse,
    CompletionRequest,
    CompletionResponse,
    FeedbackRequest,
    FeedbackResponse,
    ModelCard,
    ModelList,
    Readiness,
    SessionInfo,
)

log = logging.getLogger("serving.api")
SEED_STRIDE = 1_000_003  # row seed = seed + SEED_STRIDE * prompt index + choice index (as policy.sampling)
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
FEEDBACK_REFUSALS = {"forged": "feedback token is not valid for this completion",
                     "foreign": "this completion was not served to this API key",
                     "expired": "feedback token has expired",
                     "replayed": "feedback for this completion was already recorded"}

@dataclass
class Reply:
    """A finished completion: the response body, diagnostic headers, and ``after`` (record its events and
    metrics; call it once the body is sent, so that this work stays off the caller's latency)."""

    body: CompletionResponse | ChatResponse
    headers: dict[str, str]
    after: Callable[[], None]


class GatewayHandler:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self.metrics = gateway.metrics
        self._ok = {r: (self.metrics.requests.labels(r, "200"), self.metrics.latency.labels(r))
                    for r in (COMPLETIONS, CHAT)}

    @property
    def serving(self):
        return self.gw.settings.serving

    @property
    def tokenizer(self):
        return self.gw.engine.tokenizer

    # -- callers ---------------------------------------------------------------------------------
    def authenticate(self, key: str | None) -> str:
        """The key id of a valid API key (the bearer token), else 401."""
        key_id = self.gw.keys.authenticate(key.strip()) if key else None
        if key_id is None:
            self.metrics.auth_failures.inc()
            raise APIError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                           "invalid_request_error", "invalid_api_key")
        return key_id

    def admit(self, key_id: str) -> str:
        """Take one request from the key's rate limit, else 429 with the wait."""
        wait = self.gw.limiter.acquire(key_id)
        if wait > 0:
            self.metrics.rate_limited.inc()
            raise APIError(429, "rate limit exceeded for this key", "rate_limit_error", "rate_limited",
                           retry_after=wait)
        return key_id

    # -- prompts and engine rows -----------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        tok = self.tokenizer
        # The Rust tokenizer directly: the ids of tokenizer(text, add_special_tokens=False) without the
        # transformers wrapper's per-call work (the tests compare the two).
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None:
            return backend.encode(text, add_special_tokens=False).ids
        return tok(text, add_special_tokens=False)["input_ids"]

    def completion_prompts(self, key_id: str, req: CompletionRequest) -> Prompted:
        p = req.prompt
        if isinstance(p, str) or all(isinstance(x, str) for x in p):
            texts = [p] if isinstance(p, str) else list(p)
            return Prompted(key_id, req, COMPLETIONS, [self.encode(t) for t in texts], texts, req.max_tokens)
        ids = [list(p)] if all(isinstance(x, int) for x in p) else [list(x) for x in p]
        vocab = len(self.tokenizer)
        for row in ids:
            if row and (min(row) < 0 or max(row) >= vocab):
                raise APIError(422, f"prompt token ids must be in [0, {vocab})", "invalid_request_error",
                               "invalid_token_id", param="prompt")
        return Prompted(key_id, req, COMPLETIONS, ids, [self.tokenizer.decode(x) for x in ids], req.max_tokens)

    def chat_prompts(self, key_id: str, req: ChatRequest) -> Prompted:
        text = render_chat(self.tokenizer, req.messages)
        return Prompted(key_id, req, CHAT, [self.encode(text)], [text], req.max_completion_tokens or req.max_tokens)

    def plan(self, p: Prompted) -> Plan:
        """Check the request's limits and build its engine rows."""
        s, req = self.serving, p.req
        if req.n > s.max_n:
            raise APIError(422, f"n={req.n} exceeds the limit {s.max_n}", "invalid_request_error", "n_too_large",
                           param="n")
        max_new = p.max_tokens or s.default_max_tokens
        if max_new > s.max_tokens_limit:
            raise APIError(422, f"max_tokens={max_new} exceeds the limit {s.max_tokens_limit}",
                           "invalid_request_error", "max_tokens_too_large", param="max_tokens")
        try:
            channel = self.gw.channel_for(p.key_id, req.model)
        except UnknownModel as err:
            raise APIError(404, str(err), "invalid_request_error", "model_not_found", param="model") from None
        ctx = self.gw.engine.context_len
        for ids in p.prompts:
            if not ids:
                raise APIError(422, "prompt is empty", "invalid_request_error", "empty_prompt", param="prompt")
            if len(ids) > s.max_prompt_tokens or (ctx is not None and len(ids) + max_new > ctx):
                raise APIError(413, f"prompt of {len(ids)} tokens + max_tokens {max_new} exceeds the limit "
                               f"(max_prompt_tokens {s.max_prompt_tokens}, context {ctx})",
                               "invalid_request_error", "context_length_exceeded", param="prompt")
        rows, params = [], []
        for i, ids in enumerate(p.prompts):
            for k in range(req.n):
                rows.append(ids)
                seed = None if req.seed is None else (req.seed + SEED_STRIDE * i + k) % 2**63
                params.append(SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                             max_new_tokens=max_new, stop=list(req.stop), seed=seed))
        if len(rows) > s.max_batch * 4:
            raise APIError(422, f"{len(rows)} sequences (prompts x n) in one request exceed the limit "
                           f"{s.max_batch * 4}", "invalid_request_error", "too_many_sequences")
        return Plan(rows, params, channel, max_new)

    def submit(self, plan: Plan, listener=None) -> asyncio.Future:
        try:
            return self.gw.engine.submit_async(plan.rows, plan.params, plan.channel, listener)
        except Overloaded as err:
            raise APIError(503, f"overloaded: {err}", "server_overloaded", "overloaded", retry_after=1) from None
        except EngineClosed as err:
            raise APIError(503, str(err), "server_unavailable", "unavailable", retry_after=5) from None

    def attribution(self, key_id: str, n_choices: int, version: str) -> render.Attribution:
        """(completion_id, feedback_token) for each choice."""
        now = time.time()
        return [(cid, self.gw.tokens.issue(cid, key_id, version, now))
                for cid in (render.completion_id() for _ in range(n_choices))]

    # -- completions -----------------------------------------------------------------------------
    async def complete(self, key_id: str, req: CompletionRequest, t_start: float | None = None) -> Reply:
        p = self.completion_prompts(key_id, req)
        return await self._reply(p, render.completion_response, t_start)

    async def chat(self, key_id: str, req: ChatRequest, t_start: float | None = None) -> Reply:
        if req.session is not None:
            return await self.session_chat(key_id, req, t_start)
        p = self.chat_prompts(key_id, req)
        return await self._reply(p, render.chat_response, t_start)

    async def session_chat(self, key_id: str, req: ChatRequest, t_start: float | None = None) -> Reply:
        """A chat request with ``session`` (:mod:`serving.api.sessions`): answered as it is while its
        context has room, else summarised first and answered from the fresh context."""
        opts = req.session
        p = self.chat_prompts(key_id, req)
        budget = sessions.Budget(opts.context_budget, p.max_tokens or self.serving.default_max_tokens,
                                 len(self.encode(SUMMARY_REQUEST)) + opts.summary_max_tokens)
        here = SessionRecord(segment=opts.segment, summary_id=opts.summary_id, summary=False)
        if budget.fits(len(p.prompts[0])):
            reply = await self._reply(p, render.chat_response, t_start, session=here)
            reply.body.session = SessionInfo(segment=opts.segment, summary_id=opts.summary_id, summarised=False,
                                             prompt_tokens=len(p.prompts[0]))
            return reply
        # The smallest context after a summary: the first message and a summary of the cap's length.
        least = opts.summary_max_tokens + len(self.encode(render_chat(
            self.tokenizer, [req.messages[0], ChatMessage(role="user", content=SUMMARY_PREFIX)])))
        if len(req.messages) < 2 or not budget.fits(least):
            raise sessions.too_small(opts, least, budget)
        # The summary turn: the conversation, the summary request, one line of at most summary_max_tokens.
        asked = req.model_copy(update={"messages": sessions.summary_request(req.messages), "stop": ["\n"],
                                       "max_tokens": opts.summary_max_tokens, "max_completion_tokens": None})
        summarised = await self._reply(self.chat_prompts(key_id, asked), render.chat_response, t_start,
                                       session={**here, "summary": True})
        choice = summarised.body.choices[0]
        text = clean_summary(choice.message.content)
        after = SessionRecord(segment=opts.segment + 1, summary_id=choice.completion_id, summary=False)
        fresh = sessions.fresh_context(req.messages, text, carry=opts.carry == "last_observation")
        answer = self.chat_prompts(key_id, req.model_copy(update={"messages": fresh}))
        if not budget.fits(len(answer.prompts[0])) and len(fresh) > 2:  # the carried exchange leaves no room
            fresh = fresh[:2]
            answer = self.chat_prompts(key_id, req.model_copy(update={"messages": fresh}))
        try:
            reply = await self._reply(answer, render.chat_response, t_start, session=after)
        except BaseException:
            summarised.after()  # the summary was served: its event is recorded whatever happens next
            raise
        reply.body.session = SessionInfo(segment=after["segment"], summary_id=choice.completion_id, summarised=True,
                                         summary=text, summary_feedback_token=choice.feedback_token,
                                         messages=fresh, prompt_tokens=len(answer.prompts[0]))

        def both() -> None:
            summarised.after()
            reply.after()

        return Reply(reply.body, reply.headers, both)

    async def _reply(self, p: Prompted, build, t_start: float | None, session: SessionRecord | None = None) -> Reply:
        if t_start is not None:
            p.t_start = t_start
        plan = self.plan(p)
        fut = self.submit(plan)
        t0 = time.perf_counter()
        # The version that serves the rows is fixed when their batch starts; it is almost always the one
        # live now, so the ids are signed now, while the engine works, and again only after a swap.
        live = self.gw.engine.versions()
        expected = live.get(plan.channel) or live.get(PRODUCTION)
        ids = self.attribution(p.key_id, len(plan.rows), expected) if expected is not None else None
        try:
            async with asyncio.timeout(self.serving.request_timeout_s):
                gens: list[Generation] = await fut
        except (TimeoutError, EngineClosed, ContextTooLong) as err:
            raise engine_error(err) from None
        engine_s = time.perf_counter() - t0
        if ids is None or gens[0].version != expected:
            ids = self.attribution(p.key_id, len(gens), gens[0].version)
        body = build(self.tokenizer, f"{self.gw.model_name}@{gens[0].version}", p.req, gens, p.prompts, ids,
                     int(time.time()))
        total = time.perf_counter() - p.t_start
        gen_ms = max(g.engine_ms for g in gens)
        headers = {"x-rtrl-overhead-ms": f"{(total - engine_s) * 1000:.3f}",
                   "x-rtrl-engine-ms": f"{engine_s * 1000:.3f}", "x-rtrl-generate-ms": f"{gen_ms:.3f}"}
        self.gw.emitter.reserve(len(gens))  # counted as pending from now: wait_idle() cannot miss them

        def after() -> None:
            try:
                self.record(p, gens, plan.max_new, total, ids, reserved=True, session=session)
                self.observe(p.route, total, engine_s)
            except Exception:  # noqa: BLE001 - the response is out; never lose the others' events over it
                log.exception("recording a completion after its response failed")

        return Reply(body, headers, after)

    async def stream(self, key_id: str, req: SamplingRequest, t_start: float | None = None) -> AsyncIterator[bytes]:
        """A streamed completion's server-sent events; returns once the first tokens (or an error) exist,
        so that refusals before then still get their HTTP status."""
        p = self.chat_prompts(key_id, req) if isinstance(req, ChatRequest) else self.completion_prompts(key_id, req)
        if t_start is not None:
            p.t_start = t_start
        plan = self.plan(p)
        session = StreamSession(self, p, plan)
        await session.open()
        return session.events()

    def record(self, p: Prompted, gens: list[Generation], max_new: int, latency_s: float,
               ids: render.Attribution, reserved: bool = False, session: SessionRecord | None = None) -> None:
        """Emit each choice's completion event (``latency_s``: until the response was ready).
        ``reserved``: the events were announced with ``emitter.reserve`` before the response went out;
        ``session``: the session record of a summarised agent session's completion."""
        req, m = p.req, self.metrics
        sampling = SamplingRecord(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                  max_tokens=max_new, stop=list(req.stop), seed=req.seed)
        for idx, (g, (cid, _)) in enumerate(zip(gens, ids, strict=True)):
            sample = g.sample
            self.gw.emitter.emit(CompletionEvent(
                completion_id=cid, caller=p.key_id, model=self.gw.model_name, version=g.version,
                prompt=p.texts[idx // req.n], completion=sample.text,
                prompt_token_ids=sample.prompt_token_ids, completion_token_ids=sample.token_ids,
                logprobs=sample.logprobs, sampling_logprobs=sample.sampling_logprobs, sampling=sampling,
                routes=None if sample.routes is None else sample.routes.to_wire(),
                finish_reason=sample.finish_reason, latency_ms=latency_s * 1000, task_bucket=req.task_bucket,
                choice_index=idx, session=session), reserved=reserved)
            m.completions.labels(g.version).inc()
            m.tokens.inc(len(sample.token_ids))

    def observe(self, route: str, total: float, engine_s: float) -> None:
        count, latency = self._ok[route]
        count.inc()
        latency.observe(total)
        self.metrics.overhead.observe(max(0.0, total - engine_s))
        self.metrics.engine_queue.set(self.gw.engine.queue_depth)

    # -- feedback, models, operations ------------------------------------------------------------
    def feedback(self, key_id: str, req: FeedbackRequest) -> FeedbackResponse:
        tokens, m = self.gw.tokens, self.metrics
        verdict, claims = tokens.check(req.feedback_token, req.completion_id, key_id)
        m.replay_evictions.set(tokens.replay.evictions)
        if verdict != "ok":
            m.feedback_rejected.labels(verdict).inc()
            raise APIError(403, FEEDBACK_REFUSALS[verdict], "permission_error", f"feedback_{verdict}")
        event = FeedbackEvent(completion_id=req.completion_id, caller=key_id, version=claims.version,
                              signal=req.signal, kept_text=req.kept_text, score=req.score, comment=req.comment)
        self.gw.emitter.emit(event)
        m.feedback.labels(req.signal).inc()
        m.requests.labels("/v1/feedback", "200").inc()
        return FeedbackResponse(completion_id=req.completion_id, version=claims.version, event_id=event.event_id)

    def models(self) -> ModelList:
        now, name = int(time.time()), self.gw.model_name
        cards = [ModelCard(id=name, created=now)]
        cards += [ModelCard(id=f"{name}@{v}", created=now) for v in sorted(set(self.gw.engine.versions().values()))]
        self.metrics.requests.labels("/v1/models", "200").inc()
        return ModelList(data=cards)

    def readiness(self) -> Readiness:
        gw = self.gw
        return Readiness(status="ready" if gw.ready else "not_ready", versions=gw.engine.versions(),
                         bus_up=gw.emitter.bus_up, events_pending=gw.emitter.pending,
                         watcher_error=gw.watcher.last_error)

    def prometheus(self) -> tuple[bytes, str]:
        """The metrics page and its content type."""
        self.metrics.engine_queue.set(self.gw.engine.queue_depth)
        return generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST

