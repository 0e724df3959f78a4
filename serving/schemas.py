"""Typed request and response bodies: OpenAI's completions / chat schema plus rtrl's extras.

Extras on the wire (the contract other stages rely on): every choice carries ``completion_id`` and
``feedback_token``; the response's ``model`` is ``name@version``; a request may pass
``metadata: {"task_bucket": "..."}``; a chat request may pass ``session`` (long agent sessions,
summarised when they outgrow a context budget) and its response then carries ``session``. Fields OpenAI defines that this gateway cannot honour
(``echo``, ``best_of``, ``suffix``, penalties, ``logit_bias``, tools) are refused with 422 when set to
anything but their neutral value, instead of being silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP = 4
MAX_LOGPROBS = 5


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RequestMetadata(BaseModel):
    model_config = ConfigDict(extra="allow")

    task_bucket: str | None = Field(None, max_length=200, description="Baseline grouping for updates.")


class _SamplingFields(_Body):
    model: str = Field(min_length=1, max_length=300)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="rtrl extra (vLLM-style): 0 = off.")
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = Field(None, max_length=256)
    metadata: RequestMetadata | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    @model_validator(mode="after")
    def _unsupported(self):
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty / frequency_penalty are not supported (must be 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        return self

    @property
    def task_bucket(self) -> str | None:
        return self.metadata.task_bucket if self.metadata else None

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_unsupported(self):
        if self.echo:
            raise ValueError("echo is not supported")
        if self.best_of not in (None, 1) or self.suffix:
            raise ValueError("best_of and suffix are not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class SessionOptions(_Body):
    """rtrl extension for long agent sessions (docs/agent.md, "Self-summarisation"): when the
    conversation would outgrow ``context_budget``, the model first summarises it (the summary turn it
    was trained with), then answers from a fresh context: the first message, the summary and the last
    exchange. The response's ``session`` says what happened and what to send next."""

    context_budget: int = Field(ge=1, description="Tokens one context of the session may hold: the "
                                "conversation, the answer (max_tokens) and room for a summary turn.")
    segment: int = Field(0, ge=0, le=1_000_000, description="Which context of the session this conversation is "
                         "(0: the first): the previous response's session.segment.")
    summary_id: str | None = Field(None, min_length=1, max_length=128, description="The completion id of the "
                                   "summary this context starts from: the previous response's session.summary_id.")
    summary_max_tokens: int = Field(48, ge=1, le=1024, description="Cap of one summary, in tokens.")
    carry: Literal["last_observation", "none"] = Field(
        "last_observation", description="What the fresh context keeps besides the first message and the "
        "summary: the last assistant message and what followed it, or nothing.")


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    session: SessionOptions | None = Field(None, description="rtrl extension: summarise long sessions.")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_unsupported(self):
        if self.session is not None and (self.n != 1 or self.stream):
            raise ValueError("session works with n=1 and without stream")
        if self.tools or self.tool_choice not in (None, "none"):
            raise ValueError("tools are not supported")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise ValueError("only response_format {type: text} is supported")
        return self


# -- responses -----------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    completion_id: str
    feedback_token: str


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None
    completion_id: str
    feedback_token: str


class SessionInfo(BaseModel):
    """What the gateway did with a request's ``session``."""

    segment: int = Field(description="The context the answer was written in: send it back as session.segment.")
    summary_id: str | None = Field(description="The completion id of the summary that context starts from "
                                   "(send it back as session.summary_id); None in the first context.")
    summarised: bool = Field(description="Whether this request summarised the conversation.")
    summary: str | None = Field(None, description="The summary (when summarised).")
    summary_feedback_token: str | None = Field(None, description="The summary's feedback token: it is a "
                                               "completion of its own (`POST /v1/feedback` with summary_id).")
    messages: list[ChatMessage] | None = Field(None, description="When summarised: the conversation the answer "
                                               "was written from, to continue the session with (append the "
                                               "answer and what follows to it).")
    prompt_tokens: int = Field(description="Tokens of the context the answer was written from.")


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    session: SessionInfo | None = Field(None, description="rtrl extension: present when the request had one.")


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    completion_id: str
    feedback_token: str


class ChatChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rtrl"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class FeedbackRequest(_Body):
    completion_id: str = Field(min_length=1, max_length=200)
    feedback_token: str = Field(min_length=1, max_length=2000)
    signal: Literal["accept", "reject", "edit"]
    kept_text: str | None = Field(None, max_length=100_000, description="For `edit`: the text the user kept.")
    score: float | None = Field(None, ge=-1, le=1)
    comment: str | None = Field(None, max_length=10_000)

    @model_validator(mode="after")
    def _edit_needs_text(self):
        if self.signal == "edit" and self.kept_text is None:
            raise ValueError("signal `edit` needs kept_text")
        return self


class FeedbackResponse(BaseModel):
    status: Literal["accepted"] = "accepted"
    completion_id: str
    version: str
    event_id: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    details: list[Any] | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    status: Literal["ready", "not_ready"]
    versions: dict[str, str] = Field(description="The version live on each channel.")
    bus_up: bool = Field(description="Whether the last send to the event bus succeeded.")
    events_pending: int = Field(description="Events accepted but not yet on the bus.")
    watcher_error: str | None = Field(description="The version watcher's last error, if its last poll failed.")
