"""Turning one bus record into an event, or into the reason it must be dead-lettered.

Beyond the wire schema (``realtime_rl.events``), the ingester refuses what would corrupt training
data or fail in the database later; both databases must refuse the same events. Every field a
trainer reads is checked here, on every ingest path (they all decode through :func:`decode_record`):

- token ids (prompt and completion): integers in ``[0, TOKEN_ID_LIMIT)``, the range of a 32-bit
  signed integer column (a negative id indexes an embedding table backwards; a larger one fits no
  integer column a production database would use). Whether an id is inside a *model's* vocabulary
  is checked again when a dataset is built for that model (``realtime_rl.dataset``);
- log-probs and sampling log-probs: one per completion token, finite, and ``<= LOGPROB_TOLERANCE``
  (a probability of 1 can round to a log-prob a hair above 0; more than that is a bug);
- the sampling record: finite temperature >= 0, top_p in [0, 1], top_k >= 0, max_tokens >= 0;
- feedback: an ``edit`` carries the kept text, a score is in [-1, 1];
- ids no longer than their columns, no NUL characters in them (PostgreSQL text cannot hold them); a
  NUL in free text (prompt, completion, kept text, comment), which a model can write, is stored as
  U+FFFD instead (the token ids keep the exact sequence).

Mixture-of-experts routes are checked by a function of their own (:func:`routes_problem`): a record
that does not decode, does not cover the completion's prompt + completion - 1 positions, or does not
fit the served model's MoE geometry (layer count, top-k, an expert id out of range or named twice) is
dead-lettered with a reason that names the layer, since every trainer would refuse to replay it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import TypeAdapter, ValidationError

from policy.routes import RouteFormatError, RouteGeometry, Routes, route_problem
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
LOGPROB_TOLERANCE = 1e-4
"""Largest log-prob accepted: values a hair above 0 come from float rounding of probabilities near 1
(fp32 softmax and log-sum-exp); anything larger is a bug in the producer."""
TOKEN_ID_LIMIT = 2**31
"""Token ids must be below this: the range of a 32-bit signed integer column (PostgreSQL ``integer``,
``int[]``). Real vocabularies are far smaller; the model's own bound is applied by the dataset builder."""


@dataclass(frozen=True)
class RouteRules:
    """What completion events' routes are checked against: the served model's MoE ``geometry``
    (None: a dense model, which has no routes to record)."""

    geometry: RouteGeometry | None


@dataclass(slots=True)
class Decoded:
    record: Record
    event: Event | None = None
    reason: str | None = None
    detail: str | None = None


_EVENTS: TypeAdapter[Event] = TypeAdapter(EventUnion)
"""The schema's own (lax) rules, as ``events.decode_event`` applies them (its size check is done here)."""


def decode_record(record: Record, max_event_bytes: int, route_rules: RouteRules | None = None) -> Decoded:
    """``route_rules`` None: the served model's geometry is unknown, and routes are only checked
    for their own consistency."""
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
    nul = escaped and b"\\u0000" in value
    if nul:
        event = _nul_free_text(event)
    problem = semantic_problem(event, may_contain_nul=nul)
    if problem is None and escaped and (b"\\ud" in value or b"\\uD" in value):
        problem = _unencodable(event)
    if problem is None and isinstance(event, CompletionEvent) and event.routes is not None:
        problem = routes_problem(event, route_rules)
    if problem is not None:
        return Decoded(record, reason=SCHEMA_INVALID, detail=problem)
    return Decoded(record, event=event)


_FREE_TEXT = {CompletionEvent: ("prompt", "completion"), FeedbackEvent: ("kept_text", "comment")}


def _nul_free_text(event: Event) -> Event:
    """``event`` with each NUL in its free text (prompt, completion, kept text, comment) replaced by U+FFFD:
    a model can write one, PostgreSQL text cannot hold one, and the token ids (the training data) keep
    the exact sequence. A NUL anywhere else (an id, a name) is still refused."""
    fields = _FREE_TEXT.get(type(event), ())
    update = {f: getattr(event, f).replace("\x00", "\ufffd") for f in fields
              if getattr(event, f) is not None and "\x00" in getattr(event, f)}
    return event.model_copy(update=update) if update else event


def _has_unicode_escape(value: bytes) -> bool:
    """Whether valid JSON ``value`` holds a ``\\u`` escape (four hex digits). Hops from backslash to backslash,
    skipping each escaped character, so it is exact; on gateway events (a few escapes each) it is
    faster than one two-byte search ``b"\\\\u" in value``."""
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
    return bool(values) and not (math.isfinite(sum(values)) and max(values) <= LOGPROB_TOLERANCE)


def _bad_token_ids(ids: list[int]) -> bool:
    # min and max in C: two passes over a list of ints, no Python loop.
    return bool(ids) and (min(ids) < 0 or max(ids) >= TOKEN_ID_LIMIT)


def _bad_sampling(s) -> str | None:
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        return "sampling.temperature: must be finite and >= 0"
    if not 0.0 <= s.top_p <= 1.0:  # False for NaN too
        return "sampling.top_p: must be in [0, 1]"
    if s.top_k < 0 or s.max_tokens < 0:
        return "sampling.top_k, sampling.max_tokens: must be >= 0"
    return None


def _out_of_range(ids: list[int]) -> str:
    bad = next(i for i in ids if i < 0 or i >= TOKEN_ID_LIMIT)
    text = str(bad)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text)} digits)"


def semantic_problem(event: Event, may_contain_nul: bool = True) -> str | None:
    """What is wrong with a schema-valid event, or None (straight-line: this runs for every event)."""
    if may_contain_nul and any("\x00" in text for text in _strings(event.model_dump())):
        return "a string contains a NUL character"
    if isinstance(event, CompletionEvent):
        e = event
        if _too_long(e.event_id, e.completion_id, e.caller, e.model, e.version, e.task_bucket):
            return f"an id or name is longer than {MAX_ID_CHARS} characters"
        if _bad_token_ids(e.prompt_token_ids):
            return f"prompt_token_ids: token ids must be integers in [0, 2**31) (got {_out_of_range(e.prompt_token_ids)})"
        if _bad_token_ids(e.completion_token_ids):
            return (f"completion_token_ids: token ids must be integers in [0, 2**31) "
                    f"(got {_out_of_range(e.completion_token_ids)})")
        n = len(e.completion_token_ids)
        if len(e.logprobs) != n:
            return f"logprobs: {len(e.logprobs)} entries for {n} completion tokens"
        if e.sampling_logprobs is not None and len(e.sampling_logprobs) != n:
            return f"sampling_logprobs: {len(e.sampling_logprobs)} entries for {n} completion tokens"
        if _bad_logprobs(e.logprobs):
            return f"logprobs: log-probs must be finite and <= 0 (tolerance {LOGPROB_TOLERANCE:g})"
        if _bad_logprobs(e.sampling_logprobs):
            return f"sampling_logprobs: log-probs must be finite and <= 0 (tolerance {LOGPROB_TOLERANCE:g})"
        problem = _bad_sampling(e.sampling)
        if problem is not None:
            return problem
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


def routes_problem(event: CompletionEvent, rules: RouteRules | None) -> str | None:
    """Why a completion's route record cannot be stored, or None (see the module docstring). Without
    ``rules`` the record is checked against its own shape and expert count only."""
    try:
        routes = Routes.from_wire(event.routes)
    except RouteFormatError as err:
        return str(err)
    if rules is None:
        _, layers, top_k = routes.shape
        geometry = RouteGeometry(layers, routes.experts, top_k)
    else:
        geometry = rules.geometry
    problem = route_problem(routes, geometry, len(event.prompt_token_ids) + len(event.completion_token_ids) - 1)
    return None if problem is None else f"routes: {problem}"
