"""A request on its way to the engine: its prompts as token ids, then its engine rows."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from policy.sampling import SamplingParams
from serving.schemas import ChatRequest, CompletionRequest

SamplingRequest = CompletionRequest | ChatRequest


@dataclass
class Prompted:
    """A validated request with its prompts tokenised, and where the gateway's time on it started."""

    key_id: str
    req: SamplingRequest
    route: str
    prompts: list[list[int]]
    texts: list[str]
    max_tokens: int | None
    t_start: float = field(default_factory=time.perf_counter)


@dataclass
class Plan:
    """A request as engine rows: one per prompt and choice."""

    rows: list[list[int]]
    params: list[SamplingParams]
    channel: str
    max_new: int
