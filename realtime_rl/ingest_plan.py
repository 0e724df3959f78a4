"""One batch's writes worked out from its decoded events alone, before any database is involved.

Nothing here touches a connection, so the ingester does it on its main thread, right after decoding,
while the previous batch's transaction is still running on the commit thread: that transaction is
the pipeline's slow stage, and it is left with little but database round trips.

Within the batch: a repeated event id counts as a duplicate; a second completion event for one
completion id is a conflict (dead-lettered); the newest feedback per completion is marked, so that
the common case (one judgement per completion) needs no correcting update. For the staged paths the
rows are encoded too, without the ingestion time (the transaction adds it), by ``staged_rows`` as the
writer streams them, or earlier by ``encode_ahead`` while the main thread waits for the previous
commit:

- PostgreSQL: typed tuples for COPY's binary format. JSON values are the compact text ``json_text``
  gives (the binary form of ``json`` is its text), timestamps timezone-aware datetimes.
- SQLite: the driver's parameter tuples, exactly as the column types would encode them:
  compact JSON, timestamps in SQLAlchemy's SQLite format (naive UTC, microseconds).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import sqlalchemy as sa
from pydantic_core import TzInfo, to_json

from realtime_rl.events import CompletionEvent, FeedbackEvent, ModelVersionEvent
from realtime_rl.ingest_decode import CONFLICT, Decoded

COPY_MIN_ROWS = 200
"""PostgreSQL: below this many events a plain multi-row INSERT is as fast as staging with COPY."""

COMPLETION_COLUMNS = ("completion_id", "event_id", "caller", "model", "version", "prompt", "completion",
                      "prompt_token_ids", "completion_token_ids", "logprobs", "sampling_logprobs", "expert_ids",
                      "sampling", "finish_reason", "latency_ms", "task_bucket", "choice_index", "created_at")
FEEDBACK_COLUMNS = ("event_id", "completion_id", "caller", "version", "signal", "kept_text", "score", "comment",
                    "created_at", "is_latest")
"""The staged columns, in tuple order; ``ingested_at`` is added by the INSERT ... SELECT."""
PG_COPY_TYPES = {
    "completions": ("text",) * 7 + ("text",) * 6 + ("text", "float8", "text", "int4", "timestamptz"),
    "feedback": ("text",) * 6 + ("float8", "text", "timestamptz", "bool"),
}
"""Binary COPY dumpers per staged column (``text`` for the json columns: their binary form is text)."""


@dataclass
class BatchPlan:
    staging: str | None
    """``"postgresql"`` (binary COPY), ``"sqlite"`` (multi-row INSERTs) or None (plain INSERTs)."""
    completions: dict[str, Decoded] = field(default_factory=dict)
    """By completion id; the first event for an id wins, later ones are conflicts."""
    feedback: dict[str, Decoded] = field(default_factory=dict)
    """By event id."""
    newest: set[str] = field(default_factory=set)
    """Event ids of the newest feedback per completion within the batch."""
    versions: list[ModelVersionEvent] = field(default_factory=list)
    dead: list[tuple[Decoded, str | None, str | None]] = field(default_factory=list)
    """(item, reason, detail) to dead-letter; None keeps the item's own reason and detail."""
    duplicates: int = 0
    encoded: dict[str, list[tuple]] = field(default_factory=dict, repr=False)
    """Staged rows ``encode_ahead`` encoded per table (a prefix, in the order of ``completions`` /
    ``feedback``), until ``staged_rows`` hands them over."""


def staging_for(dialect: sa.Dialect, use_copy: bool, n_events: int) -> str | None:
    if not use_copy:
        return None
    if dialect.name == "postgresql" and dialect.driver == "psycopg":
        return "postgresql" if n_events >= COPY_MIN_ROWS else None
    return "sqlite" if dialect.name == "sqlite" else None


def plan_batch(items: Sequence[Decoded], dialect: sa.Dialect, *, use_copy: bool = True) -> BatchPlan:
    completions: dict[str, Decoded] = {}
    feedback: dict[str, Decoded] = {}
    versions: dict[str, ModelVersionEvent] = {}
    dead: list[tuple[Decoded, str | None, str | None]] = []
    seen_events: set[str] = set()
    duplicates = 0
    for item in items:
        event = item.event
        if event is None:
            dead.append((item, None, None))
            continue
        # Fields from the model's __dict__: its attributes go through pydantic's __getattr__ hook.
        fields = event.__dict__
        event_id = fields["event_id"]
        if event_id in seen_events:
            duplicates += 1
            continue
        seen_events.add(event_id)
        if isinstance(event, CompletionEvent):
            completion_id = fields["completion_id"]
            if completion_id in completions:
                dead.append((item, CONFLICT, f"completion_id {completion_id!r} already used by another "
                                             "event in this batch"))
                continue
            completions[completion_id] = item
        elif isinstance(event, FeedbackEvent):
            feedback[event_id] = item
        else:
            versions[event_id] = event
    plan = BatchPlan(staging_for(dialect, use_copy, len(completions) + len(feedback)), completions, feedback,
                     newest_in_batch([i.event for i in feedback.values()]), list(versions.values()), dead,
                     duplicates)
    return plan


def staged_rows(plan: BatchPlan, table: str) -> Iterator[tuple]:
    """The staged path's rows for ``table`` (PostgreSQL: typed tuples for binary COPY; SQLite: the
    driver's parameter tuples): those ``encode_ahead`` prepared, then the rest, encoded a slice at a
    time as they are consumed. The writer streams them (COPY, multi-row INSERTs), so that encoding the
    rest overlaps the database's work on the rows already sent. No row outlives its use: thousands of
    live tuples made the batch's one garbage collection ~50 ms instead of a few; a second read (the
    fallback after a unique violation, rare) encodes them all again."""
    ahead = plan.encoded.pop(table, [])
    start = len(ahead)
    yield from ahead
    del ahead
    items = _items(plan, table, start)
    while chunk := list(itertools.islice(items, _ENCODE_SLICE)):
        yield from _encode(plan, table, chunk)


_ENCODE_SLICE = 256
"""Rows the writer's stream encodes at once (one SQLite INSERT's worth): the timestamps of a slice are
formatted in one call."""


def encode_ahead(plan: BatchPlan, rows: int) -> bool:
    """Encode up to ``rows`` more staged rows of ``plan`` before its transaction starts; False once
    none are left. The ingester calls it while it waits for the previous batch's commit: when the
    commit thread is the slower stage, encoding there delays the rows the database is waiting for,
    while the main thread would otherwise sit idle; when it is not, the commit thread encodes the
    rest (it would have waited for the main thread anyway)."""
    if plan.staging is None:
        return False
    for table in ("completions", "feedback"):
        ahead = plan.encoded.setdefault(table, [])
        before = len(ahead)
        chunk = list(_items(plan, table, before, before + rows))
        if chunk:
            ahead.extend(_encode(plan, table, chunk))
        rows -= len(chunk)
        if rows <= 0:
            return True
    return False


def _items(plan: BatchPlan, table: str, start: int, stop: int | None = None) -> Iterator[Decoded]:
    """``table``'s items from position ``start``, without copying the others: ``encode_ahead`` takes
    dozens of slices of one batch, and a list of every item for each would copy the batch each time."""
    return itertools.islice((plan.completions if table == "completions" else plan.feedback).values(), start, stop)


def _encode(plan: BatchPlan, table: str, items: list[Decoded]) -> list[tuple]:
    """``items``' staged rows for ``table``, in order. Fields come from each event's ``__dict__`` by one
    ``itemgetter`` call: a pydantic model's attribute access goes through its ``__getattr__`` hook
    (~0.1 us each, 18 per completion)."""
    events = [i.event.__dict__ for i in items]
    pg = plan.staging == "postgresql"
    if table == "completions":
        if pg:
            return [(*_completion_head(e), *_completion_json(e), *_completion_tail(e), _aware(e["ts"]))
                    for e in events]
        return [(*_completion_head(e), *_completion_json(e), *_completion_tail(e), ts)
                for e, ts in zip(events, sqlite_timestamps([e["ts"] for e in events]), strict=True)]
    newest = plan.newest
    if pg:
        return [(*_feedback_head(e), None if e["score"] is None else float(e["score"]), e["comment"],
                 _aware(e["ts"]), e["event_id"] in newest) for e in events]
    return [(*_feedback_head(e), e["score"], e["comment"], ts, int(e["event_id"] in newest))
            for e, ts in zip(events, sqlite_timestamps([e["ts"] for e in events]), strict=True)]


_completion_head = operator.itemgetter(*COMPLETION_COLUMNS[:7])
_completion_tail = operator.itemgetter(*COMPLETION_COLUMNS[13:17])
_feedback_head = operator.itemgetter(*FEEDBACK_COLUMNS[:6])


def _completion_json(e: dict) -> tuple:
    """The JSON columns of a completion (its ``__dict__``), in column order: ``json_text``'s encoding,
    called directly (six calls a completion, each a Python frame through ``json_text``)."""
    return (to_json(e["prompt_token_ids"]).decode(), to_json(e["completion_token_ids"]).decode(),
            to_json(e["logprobs"]).decode(),
            None if e["sampling_logprobs"] is None else to_json(e["sampling_logprobs"]).decode(),
            None if e["expert_ids"] is None else to_json(e["expert_ids"]).decode(), to_json(e["sampling"]).decode())


def newest_in_batch(events: list[FeedbackEvent]) -> set[str]:
    """Event ids of the newest feedback per completion *within* the batch (by the event's timestamp,
    ties by event id): ``is_latest`` is pre-set on them."""
    best: dict[str, FeedbackEvent] = {}
    for e in events:
        cur = best.get(e.completion_id)
        if cur is None or (utc(e.ts), e.event_id) > (utc(cur.ts), cur.event_id):
            best[e.completion_id] = e
    return {e.event_id for e in best.values()}


def utc(ts: datetime) -> datetime:
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)


def sqlite_timestamp(ts: datetime) -> str:
    """SQLAlchemy's SQLite text for ``ts`` (naive UTC, always six fractional digits). ``isoformat``
    gives the same text as ``strftime("%Y-%m-%d %H:%M:%S.%f")`` in a third less time (one per row).
    At offset zero (nearly every event) the aware text minus its "+00:00" is the answer: converting
    first cost more than the formatting (pydantic's ``TzInfo`` makes ``astimezone`` and ``replace``
    slow), 1.6 -> 1.1 us a row."""
    offset = ts.utcoffset()
    if offset is None:
        return ts.isoformat(" ", "microseconds")
    if not offset:
        return ts.isoformat(" ", "microseconds")[:-6]
    return (ts - offset).replace(tzinfo=None).isoformat(" ", "microseconds")


def sqlite_timestamps(stamps: list[datetime]) -> list[str]:
    """``sqlite_timestamp`` of each of ``stamps``, usually for all of them in one serializer call.

    pydantic-core writes a timestamp whose offset is zero with microseconds as
    ``"YYYY-MM-DDTHH:MM:SS.ffffffZ"`` (27 characters): the SQLite text once the ``T`` is a space and
    the ``Z`` gone. A list of only those is exactly ``30 n + 1`` characters long with ``n`` closing
    ``Z"`` (the other forms, naive, with an offset or without microseconds, are 19 to 32 characters,
    and a ``Z"`` closes only the zero-offset ones of 20 or 27), so the whole list is converted by three
    string operations. Only for pydantic's own ``TzInfo`` (what decoded events carry), whose offsets
    are whole seconds: a ``datetime.timezone`` of a few microseconds is written ``Z`` too. Anything
    else goes one at a time. ~5k instructions a timestamp instead of ~16k (``isoformat`` formats with
    ``printf`` and asks ``TzInfo`` for the offset twice)."""
    n = len(stamps)
    if n and set(map(type, map(_tzinfo, stamps))) == {TzInfo}:
        text = to_json(stamps).decode()
        if len(text) == 30 * n + 1 and text.count('Z"') == n:
            return text[2:-3].replace("T", " ").split('Z","')
    return [sqlite_timestamp(ts) for ts in stamps]


_tzinfo = operator.attrgetter("tzinfo")


def _aware(ts: datetime) -> datetime:
    """Naive event timestamps mean UTC (as everywhere in the schema); aware ones travel as they are."""
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)
