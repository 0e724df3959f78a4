"""Engine generations -> the response schemas (one pydantic model per body, serialised once)."""

from __future__ import annotations

import os

from serving.engines.base import Generation
from serving.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatDelta,
    ChatRequest,
    ChatResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    TokenLogprob,
    Usage,
)

Attribution = list[tuple[str, str]]  # (completion_id, feedback_token) per choice


def completion_id() -> str:
    return "cmpl-" + os.urandom(16).hex()  # uuid4().hex's length and alphabet, cheaper


def token_strings(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([t]) for t in ids]


def completion_logprobs(tokenizer, req: CompletionRequest, g: Generation) -> CompletionLogprobs | None:
    if req.logprobs is None:
        return None
    toks = token_strings(tokenizer, g.sample.token_ids)
    offsets, pos = [], 0
    for t in toks:
        offsets.append(pos)
        pos += len(t)
    lps = g.sample.logprobs
    return CompletionLogprobs(tokens=toks, token_logprobs=lps, text_offset=offsets,
                              top_logprobs=[{t: v} for t, v in zip(toks, lps, strict=True)] if req.logprobs > 0
                              else None)


def chat_logprobs(tokenizer, req: ChatRequest, g: Generation) -> ChoiceLogprobs | None:
    if not req.logprobs:
        return None
    toks = token_strings(tokenizer, g.sample.token_ids)
    return ChoiceLogprobs(content=[TokenLogprob(token=t, logprob=v, bytes=list(t.encode()))
                                   for t, v in zip(toks, g.sample.logprobs, strict=True)])


def usage(gens: list[Generation], prompts: list[list[int]]) -> Usage:
    pt = sum(len(p) for p in prompts)
    ct = sum(len(g.sample.token_ids) for g in gens)
    return Usage(prompt_tokens=pt, completion_tokens=ct, total_tokens=pt + ct)


def completion_response(tokenizer, model: str, req: CompletionRequest, gens: list[Generation],
                        prompts: list[list[int]], ids: Attribution, created: int) -> CompletionResponse:
    choices = [CompletionChoice(index=i, text=g.sample.text, logprobs=completion_logprobs(tokenizer, req, g),
                                finish_reason=g.sample.finish_reason, completion_id=cid, feedback_token=token)
               for i, (g, (cid, token)) in enumerate(zip(gens, ids, strict=True))]
    return CompletionResponse(id=CompletionChunks.new_id(), created=created, model=model, choices=choices,
                              usage=usage(gens, prompts))


def chat_response(tokenizer, model: str, req: ChatRequest, gens: list[Generation], prompts: list[list[int]],
                  ids: Attribution, created: int) -> ChatResponse:
    choices = [ChatChoice(index=i, message=AssistantMessage(content=g.sample.text),
                          logprobs=chat_logprobs(tokenizer, req, g), finish_reason=g.sample.finish_reason,
                          completion_id=cid, feedback_token=token)
               for i, (g, (cid, token)) in enumerate(zip(gens, ids, strict=True))]
    return ChatResponse(id=ChatChunks.new_id(), created=created, model=model, choices=choices,
                        usage=usage(gens, prompts))


class CompletionChunks:
    """The streamed bodies of ``/v1/completions``: one per text piece, the last with the log-probs."""

    def __init__(self, tokenizer, req: CompletionRequest, rid: str, created: int, model: str) -> None:
        self.tokenizer, self.req, self.rid, self.created, self.model = tokenizer, req, rid, created, model

    @staticmethod
    def new_id() -> str:
        return "cmpl-" + os.urandom(12).hex()

    def _body(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage)

    def start(self, i: int, cid: str, token: str) -> CompletionResponse | None:
        return None

    def delta(self, i: int, cid: str, token: str, text: str) -> CompletionResponse:
        return self._body([CompletionChoice(index=i, text=text, finish_reason=None, completion_id=cid,
                                            feedback_token=token)])

    def end(self, i: int, cid: str, token: str, rest: str, g: Generation) -> list[CompletionResponse]:
        return [self._body([CompletionChoice(index=i, text=rest, finish_reason=g.sample.finish_reason,
                                             logprobs=completion_logprobs(self.tokenizer, self.req, g),
                                             completion_id=cid, feedback_token=token)])]

    def usage(self, u: Usage) -> CompletionResponse:
        return self._body([], u)


class ChatChunks:
    """The streamed chunks of ``/v1/chat/completions``: the role first, then text pieces, then the finish."""

    def __init__(self, tokenizer, req: ChatRequest, rid: str, created: int, model: str) -> None:
        self.tokenizer, self.req, self.rid, self.created, self.model = tokenizer, req, rid, created, model

    @staticmethod
    def new_id() -> str:
        return "chatcmpl-" + os.urandom(12).hex()

    def _chunk(self, i: int, cid: str, token: str, delta: ChatDelta, finish_reason: str | None = None,
               lp: ChoiceLogprobs | None = None) -> ChatChunk:
        return ChatChunk(id=self.rid, created=self.created, model=self.model, choices=[ChatChunkChoice(
            index=i, delta=delta, finish_reason=finish_reason, logprobs=lp, completion_id=cid, feedback_token=token)])

    def start(self, i: int, cid: str, token: str) -> ChatChunk:
        return self._chunk(i, cid, token, ChatDelta(role="assistant", content=""))

    def delta(self, i: int, cid: str, token: str, text: str) -> ChatChunk:
        return self._chunk(i, cid, token, ChatDelta(content=text))

    def end(self, i: int, cid: str, token: str, rest: str, g: Generation) -> list[ChatChunk]:
        out = []
        lp = chat_logprobs(self.tokenizer, self.req, g)
        if rest or lp is not None:
            out.append(self._chunk(i, cid, token, ChatDelta(content=rest), lp=lp))
        out.append(self._chunk(i, cid, token, ChatDelta(), g.sample.finish_reason))
        return out

    def usage(self, u: Usage) -> ChatChunk:
        return ChatChunk(id=self.rid, created=self.created, model=self.model, choices=[], usage=u)
