"""Event schemas: what crosses the bus between the gateway, the registry and the ingester.

JSON on the wire, one object per message, with a ``schema_version``. Unknown fields are tolerated
(ignored) so that a newer producer never breaks an older consumer; missing required fields are not.
``completion`` and ``feedback`` events share one topic keyed by ``completion_id`` so that, on Kafka,
a completion and its feedback land in the same partition in order.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, TypeAdapter
from typing_extensions import TypedDict

SCHEMA_VERSION = 1
MAX_EVENT_BYTES = 1_000_000
"""Events larger than this are refused by the ingester (dead-lettered as oversized)."""


def new_event_id() -> str:
    return uuid.uuid4().hex


def utcnow() -> datetime:
    return datetime.now(UTC)


class _Event(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: int = Field(SCHEMA_VERSION, description="Wire schema version.")
    event_id: str = Field(default_factory=new_event_id, description="Unique id; ingestion is idempotent on it.")
    ts: datetime = Field(default_factory=utcnow, description="When the producer created the event (UTC).")

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()


class SamplingRecord(BaseModel):
    """The sampling parameters a completion was drawn with (needed to reconstruct the behaviour policy)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None


class RoutesRecord(TypedDict):
    """A mixture-of-experts completion's routes (``policy.routes``' wire form): for each of the
    ``shape[0]`` positions the model consumed (prompt + completion - 1) and each of its ``shape[1]``
    MoE layers, the ``shape[2]`` expert ids the router chose, bit-packed at ceil(log2 ``experts``)
    bits an id and base64-encoded in ``data``. Validated as a plain dict, so ingestion handles it as
    it handles the other JSON columns."""

    shape: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=3, max_length=3)]
    experts: Annotated[int, Field(ge=1, le=1 << 16)]
    data: str


class SessionRecord(TypedDict):
    """Where a completion sits in a long agent session that the gateway summarised (the chat
    ``session`` extension): the context it was written in (``segment``, 0 = the first), the completion
    id of the summary that context started from (``summary_id``, None in the first), and whether the
    completion is itself a summary (``summary``: written at the end of context ``segment``). Validated
    as a plain dict, like the routes."""

    segment: Annotated[int, Field(ge=0)]
    summary_id: Annotated[str | None, Field(max_length=128)]
    summary: bool


class CompletionEvent(_Event):
    """One served completion: everything a later update needs to learn from it."""

    type: Literal["completion"] = "completion"
    completion_id: str = Field(description="Id returned to the caller (one per choice).")
    caller: str = Field(description="API key id of the caller (never the key itself).")
    model: str = Field(description="Model name.")
    version: str = Field(description="Registry version id whose weights produced the tokens.")
    prompt: str
    completion: str
    prompt_token_ids: list[StrictInt] = Field(description="JSON integers only (no strings, booleans or "
                                              "floats); the ingester also requires 0 <= id < 2**31.")
    completion_token_ids: list[StrictInt] = Field(description="As prompt_token_ids.")
    logprobs: list[float] = Field(description="Per sampled token: log-prob under the serving version at "
                                  "temperature 1 (raw softmax), aligned with completion_token_ids.")
    sampling_logprobs: list[float] | None = Field(None, description="Per sampled token: log-prob under the "
                                                  "distribution actually sampled from (temperature/top-p/top-k).")
    routes: RoutesRecord | None = Field(None, description="Mixture-of-experts models: the experts each MoE layer "
                                        "chose at every position, for router replay in the updater; None for dense "
                                        "models.")
    session: SessionRecord | None = Field(None, description="Completions of a summarised agent session: which "
                                          "context, after which summary, and whether it is a summary; None "
                                          "outside sessions.")
    sampling: SamplingRecord = Field(default_factory=SamplingRecord)
    finish_reason: str = "stop"
    latency_ms: float = 0.0
    task_bucket: str | None = Field(None, description="Caller-supplied task bucket (baseline grouping).")
    choice_index: int = 0


class FeedbackEvent(_Event):
    """A user's judgement of one completion, validated by the gateway (token checked)."""

    type: Literal["feedback"] = "feedback"
    completion_id: str
    caller: str
    version: str
    signal: Literal["accept", "reject", "edit"]
    kept_text: str | None = Field(None, description="For `edit`: the text the user kept.")
    score: float | None = Field(None, description="Optional explicit score in [-1, 1].")
    comment: str | None = None


class ModelVersionEvent(_Event):
    """A registry change: a version published, promoted to a channel, or rolled back."""

    type: Literal["model_version"] = "model_version"
    model: str
    version: str
    parent: str | None = None
    action: Literal["published", "promoted", "rollback"]
    channel: str | None = Field(None, description="`candidate` or `production` for promote/rollback.")
    sha256: str | None = Field(None, description="Whole-version SHA-256 from the manifest.")
    metrics: dict[str, float] = Field(default_factory=dict)


Event = Annotated[CompletionEvent | FeedbackEvent | ModelVersionEvent, Field(discriminator="type")]
_EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


def decode_event(raw: bytes) -> CompletionEvent | FeedbackEvent | ModelVersionEvent:
    """Parse one wire message. Raises ``pydantic.ValidationError`` (or ``ValueError``) on bad input."""
    if len(raw) > MAX_EVENT_BYTES:
        raise ValueError(f"event of {len(raw)} bytes exceeds the {MAX_EVENT_BYTES}-byte limit")
    return _EVENT_ADAPTER.validate_json(raw)
