"""Turning one bus record into an event, or into the reason it must be dead-lettered.

Beyond the wire schema (``realtime_rl.events``), the ingester refuses what would corrupt training
data or fail in the database later: log-prob arrays that do not line up with the sampled tokens,
non-finite or positive log-probs, an ``edit`` without the kept text, a score outside [-1, 1], ids
longer than their columns, and NUL characters (PostgreSQL text cannot hold them); both databases
must refuse the same events.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import TypeAdapter, ValidationError

from realtime_rl.bus.base import Record
from realtime_rl.events import (
    MAX_EVENT_BYTES,
    CompletionEvent,
    FeedbackEvent,
    ModelVersionEvent,
)
from realtime_rl.events import Event as EventUnion

Event = CompletionEvent | FeedbackEvent | ModelVersionEvent

OVERSIZED = "oversized"
UNDECODABLE = "undecodable"
SCHEMA_INVALID = "schema_invalid"
CONFLICT = "conflict"
DB_REJECTED = "db_rejected"
REASONS = (OVERSIZED, UNDECODABLE, SCHEMA_INVALID, CONFLICT, DB_REJECTED)

MAX_ID_CHARS = 128
"""Ids and names are stored as VARCHAR(128) (PostgreSQL enforces it; SQLite would not)."""
_LOGPROB_SLACK = 1e-4
"""Log-probs a hair above 0 come from float rounding of probabilities near 1; more is a bug."""


@dataclass(slots=True)
class Decoded:
    record: Record
    event: Event | None = None
    reason: str | None = None
    detail: str | None = None


_EVENTS: TypeAdapter[Event] = TypeAdapter(EventUnion)
"""The schema's own (lax) rules, as ``events.decode_event`` applies them (its size check is done here)."""


def decode_record(record: Record, max_event_bytes: int) -> Decoded:
    value = record.value
    if len(value) > max_event_bytes:
        return Decoded(record, reason=OVERSIZED,
                       detail=f"{len(value)} bytes exceeds the {max_event_bytes}-byte limit")
    if len(value) > MAX_EVENT_BYTES:
        return Decoded(record, reason=OVERSIZED,
                       detail=f"{len(value)} bytes exceeds the schema's {MAX_EVENT_BYTES}-byte limit")
    try:
        event = _EVENTS.validate_json(value)
    except ValidationError as err:
        errors = err.errors(include_url=False)
        undecodable = any(e["type"].startswith("json") for e in errors)
        return Decoded(record, reason=UNDECODABLE if undecodable else SCHEMA_INVALID, detail=_summarise(errors))
    # JSON can only carry a NUL or a lone surrogate as a \u escape: without one, no string holds either.
    escaped = _has_unicode_escape(value)
    problem = semantic_problem(event, may_contain_nul=escaped and b"\\u0000" in value)
    if problem is None and escaped and (b"\\ud" in value or b"\\uD" in value):
        problem = _unencodable(event)
    if problem is not None:
        return Decoded(record, reason=SCHEMA_INVALID, detail=problem)
    return Decoded(record, event=event)


def _has_unicode_escape(value: bytes) -> bool:
    """Whether valid JSON ``value`` holds a ``\\u`` escape (four hex digits). Hops from backslash to backslash,
    skipping each escaped character, so it is exact; on gateway events (a few escapes each) measured
    2-3x faster than one two-byte search ``b"\\\\u" in value``."""
    i = value.find(b"\\")
    while i >= 0:
        if value[i + 1:i + 2] == b"u":
            return True
        i = value.find(b"\\", i + 2)
    return False


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return []


def _unencodable(event: Event) -> str | None:
    """Lone UTF-16 surrogates (``\\ud800``) are valid JSON escapes but not storable text."""
    for text in _strings(event.model_dump()):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "a string holds a lone UTF-16 surrogate (not valid UTF-8 text)"
    return None


def _summarise(errors: list[dict]) -> str:
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        parts.append(f"{loc}: {e['msg']}")
    more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(parts) + more


def _too_long(*values: str | None) -> bool:
    # A plain loop, not any() over a generator (ruff SIM110): twice as fast, and it runs on every event.
    for v in values:  # noqa: SIM110
        if v is not None and len(v) > MAX_ID_CHARS:
            return True
    return False


def _bad_logprobs(values: list[float] | None) -> bool:
    # A NaN or an infinity makes the sum non-finite: one test per list instead of one per value.
    return bool(values) and not (math.isfinite(sum(values)) and max(values) <= _LOGPROB_SLACK)


def semantic_problem(event: Event, may_contain_nul: bool = True) -> str | None:
    """What is wrong with a schema-valid event, or None (straight-line: this runs for every event)."""
    if may_contain_nul and any("\x00" in text for text in _strings(event.model_dump())):
        return "a string contains a NUL character"
    if isinstance(event, CompletionEvent):
        e = event
        if _too_long(e.event_id, e.completion_id, e.caller, e.model, e.version, e.task_bucket):
            return f"an id or name is longer than {MAX_ID_CHARS} characters"
        n = len(e.completion_token_ids)
        if len(e.logprobs) != n:
            return f"logprobs: {len(e.logprobs)} entries for {n} completion tokens"
        if e.sampling_logprobs is not None and len(e.sampling_logprobs) != n:
            return f"sampling_logprobs: {len(e.sampling_logprobs)} entries for {n} completion tokens"
        if e.expert_ids is not None and len(e.expert_ids) != n:
            return f"expert_ids: {len(e.expert_ids)} entries for {n} completion tokens"
        if _bad_logprobs(e.logprobs) or _bad_logprobs(e.sampling_logprobs):
            return "logprobs: log-probs must be finite and <= 0"
        if not (math.isfinite(e.latency_ms) and e.latency_ms >= 0):
            return "latency_ms: must be finite and >= 0"
    elif isinstance(event, FeedbackEvent):
        e = event
        if _too_long(e.event_id, e.completion_id, e.caller, e.version):
            return f"an id or name is longer than {MAX_ID_CHARS} characters"
        if e.signal == "edit" and e.kept_text is None:
            return "kept_text: required when signal is 'edit'"
        if e.score is not None and not (math.isfinite(e.score) and -1.0 <= e.score <= 1.0):
            return "score: must be in [-1, 1]"
    else:
        e = event
        if _too_long(e.event_id, e.model, e.version, e.parent, e.channel):
            return f"an id or name is longer than {MAX_ID_CHARS} characters"
        if not all(math.isfinite(v) for v in e.metrics.values()):
            return "metrics: values must be finite"
    return None
