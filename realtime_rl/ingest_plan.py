"""One batch's writes worked out from its decoded events alone, before any database is involved.

Nothing here touches a connection, so the ingester does it on its main thread, right after decoding,
while the previous batch's transaction is still running: that transaction is the pipeline's slow
stage, and it is left with little but database round trips.

Within the batch: a repeated event id counts as a duplicate; a second completion event for one
completion id is a conflict (dead-lettered); the newest feedback per completion is marked, so that
the common case (one judgement per completion) needs no correcting update.

For the staged paths the rows are encoded in two steps. ``staged_fields`` takes each event's raw
values (strings, number lists, the sampling record's fields, the newest flag) and the batch's
timestamps as one JSON text: cheap, and plain data that ``marshal`` ships to the writer process
(``realtime_rl.ingest_proc``). ``encode_rows`` turns them into the driver's rows, without the
ingestion time (the transaction adds it), where the transaction runs:

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
from pydantic_core import TzInfo, from_json, to_json

from realtime_rl.events import CompletionEvent, FeedbackEvent, ModelVersionEvent
from realtime_rl.ingest_decode import CONFLICT, Decoded

COPY_MIN_ROWS = 200
"""PostgreSQL: below this many events a plain multi-row INSERT is as fast as staging with COPY."""

COMPLETION_COLUMNS = ("completion_id", "event_id", "caller", "model", "version", "prompt", "completion",
                      "prompt_token_ids", "completion_token_ids", "logprobs", "sampling_logprobs", "routes",
                      "session", "sampling", "finish_reason", "latency_ms", "task_bucket", "choice_index",
                      "created_at")
FEEDBACK_COLUMNS = ("event_id", "completion_id", "caller", "version", "signal", "kept_text", "score", "comment",
                    "created_at", "is_latest")
"""The staged columns, in tuple order; ``ingested_at`` is added by the INSERT ... SELECT."""
PG_COPY_TYPES = {
    "completions": ("text",) * 7 + ("text",) * 7 + ("text", "float8", "text", "int4", "timestamptz"),
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


def staged_fields(plan: BatchPlan, table: str, start: int = 0,
                  stop: int | None = None) -> tuple[list, bytes]:
    """``table``'s staged items from position ``start`` (to ``stop``) as field values by column, and
    their timestamps as one JSON text (``stamps_json``): plain values only (str, bytes, int, float,
    bool, None, lists, the sampling record's field dict), which ``marshal`` ships to the writer
    process in C, and ``encode_rows`` turns into rows there.

    Completions: ``[fields, token ids, samplings]``: a tuple of the text and number columns
    (``_completion_fields``), all the prompt and then all the completion token-id lists as one JSON
    text (pydantic-core writes an int cheaply, while shipping a list of small ints costs more than
    that: marshal looks each shared small int up in its reference table, both ways; and one call
    instead of two a completion saves a call's overhead on every event), and the sampling record's
    fields. Feedback: ``[fields, newest]``: the columns up to ``comment``, and whether the event
    is the newest of its completion in the batch. Built by C-level ``map`` calls over the events'
    ``__dict__``: a Python loop (or a pydantic model's attribute access, which goes through its
    ``__getattr__`` hook) cost several times as much per event."""
    items = itertools.islice((plan.completions if table == "completions" else plan.feedback).values(), start, stop)
    events = list(map(_event_dict, items))
    if table == "completions":
        fields = [list(map(_completion_fields, events)),
                  to_json([*map(_prompt_ids, events), *map(_completion_ids, events)]),
                  list(map(_dict_of, map(_sampling, events)))]
    else:
        fields = [list(map(_feedback_fields, events)), list(map(plan.newest.__contains__, map(_event_id, events)))]
    return fields, stamps_json(list(map(_ts, events)))


def stamps_for(staging: str, stamps: bytes, n: int) -> list:
    """The ``n`` timestamps of ``stamps_json``'s text as the rows carry them: SQLite's text, or
    timezone-aware datetimes for PostgreSQL's COPY (naive ones mean UTC)."""
    if staging == "sqlite":
        return _sqlite_stamps(stamps, n)
    return [_aware(datetime.fromisoformat(s)) for s in from_json(stamps)]


def encode_rows(staging: str, table: str, fields: list, times: list) -> list[tuple]:
    """The driver's rows for ``staged_fields``' values (``_by_row``'s form) and their ``stamps_for``
    timestamps: ``staging`` is ``"postgresql"`` (binary COPY tuples) or ``"sqlite"`` (parameter
    tuples). The JSON columns are ``json_text``'s encoding (pydantic-core's, called directly)."""
    if table == "completions":
        values, prompt_ids, completion_ids, samplings = fields
        sampling_json: dict[str, str] = {}
        return [(*f[:7], p, c, to_json(f[7]).decode(), None if f[8] is None else to_json(f[8]).decode(),
                 None if f[9] is None else to_json(f[9]).decode(), None if f[10] is None else to_json(f[10]).decode(),
                 _sampling_json(sampling, sampling_json), *f[11:], ts)
                for f, p, c, sampling, ts in zip(values, prompt_ids, completion_ids, samplings, times, strict=True)]
    values, newest = fields
    if staging == "postgresql":
        return [(*f[:6], None if f[6] is None else float(f[6]), f[7], ts, latest)
                for f, latest, ts in zip(values, newest, times, strict=True)]
    return [(*f, ts, int(latest)) for f, latest, ts in zip(values, newest, times, strict=True)]


def _by_row(table: str, fields: list) -> list:
    """``staged_fields``' completions with their token-id text cut into one JSON text a list, prompt
    lists and completion lists apart (feedback as it is). A list of ints holds no bracket, so the lists
    are the text between ``[[`` and ``]]`` cut at each ``],[``."""
    if table != "completions":
        return fields
    values, token_ids, samplings = fields
    n = len(values)
    texts = ["[" + t + "]" for t in token_ids.decode()[2:-2].split("],[")] if n else []
    if len(texts) != 2 * n:
        raise ValueError(f"{len(texts)} token-id lists for {n} completions")
    return [values, texts[:n], texts[n:], samplings]


def _sampling_json(sampling: dict, seen: dict[str, str]) -> str:
    """The sampling record's JSON (its field dict is written exactly as the record itself: same fields,
    same order, same values). The completions of a batch mostly share their sampling parameters, so
    each distinct one is encoded once, found by its ``repr`` (exact: it tells -0.0 from 0.0 and 1 from
    1.0, which compare equal), far cheaper than encoding it again."""
    key = repr(sampling)
    text = seen.get(key)
    if text is None:
        text = seen[key] = to_json(sampling).decode()
    return text


def encoded_rows(staging: str, table: str, fields: list, stamps: bytes) -> Iterator[tuple]:
    """``encode_rows`` of all ``fields`` a slice at a time, as they are consumed: the writer streams them
    (COPY, multi-row INSERTs), so that encoding the rest overlaps the database's work on the rows
    already sent, and no row outlives its use."""
    fields = _by_row(table, fields)
    times = stamps_for(staging, stamps, len(fields[0]))
    for start in range(0, len(times), _ENCODE_SLICE):
        stop = start + _ENCODE_SLICE
        yield from encode_rows(staging, table, [column[start:stop] for column in fields], times[start:stop])


def staged_rows(plan: BatchPlan, table: str) -> Iterator[tuple]:
    """The staged path's rows for ``table`` in this process (PostgreSQL: typed tuples for binary COPY;
    SQLite: the driver's parameter tuples), encoded a slice at a time as they are consumed (see
    ``encoded_rows``). A second read (the fallback after a unique violation) encodes them again."""
    assert plan.staging is not None
    start = 0
    while True:
        fields, stamps = staged_fields(plan, table, start, start + _ENCODE_SLICE)
        n = len(fields[0])
        if not n:
            return
        yield from encode_rows(plan.staging, table, _by_row(table, fields), stamps_for(plan.staging, stamps, n))
        start += n


_ENCODE_SLICE = 256
"""Rows encoded at once as the writer consumes them (one SQLite INSERT's worth)."""

_event_dict = operator.attrgetter("event.__dict__")
_completion_fields = operator.itemgetter(*COMPLETION_COLUMNS[:7], "logprobs", "sampling_logprobs", "routes",
                                         "session", *COMPLETION_COLUMNS[14:18])
"""A completion's text columns, its two log-prob lists, its route record (a plain dict; None but for
mixture-of-experts models), its session record (a plain dict; None outside summarised sessions), and
the 4 columns after ``sampling``."""
_prompt_ids = operator.itemgetter("prompt_token_ids")
_completion_ids = operator.itemgetter("completion_token_ids")
_sampling = operator.itemgetter("sampling")
_dict_of = operator.attrgetter("__dict__")
_feedback_fields = operator.itemgetter(*FEEDBACK_COLUMNS[:8])
_event_id = operator.itemgetter("event_id")
_ts = operator.itemgetter("ts")


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
    gives the same text as ``strftime("%Y-%m-%d %H:%M:%S.%f")`` in less time (one per row).
    At offset zero (nearly every event) the aware text minus its "+00:00" is the answer: converting
    first cost more than the formatting (pydantic's ``TzInfo`` makes ``astimezone`` and ``replace``
    slow)."""
    offset = ts.utcoffset()
    if offset is None:
        return ts.isoformat(" ", "microseconds")
    if not offset:
        return ts.isoformat(" ", "microseconds")[:-6]
    return (ts - offset).replace(tzinfo=None).isoformat(" ", "microseconds")


def sqlite_timestamps(stamps: list[datetime]) -> list[str]:
    """``sqlite_timestamp`` of each of ``stamps``, through their ``stamps_json`` text (as ``encode_rows``
    formats them).

    pydantic-core writes a timestamp whose offset is zero with microseconds as
    ``"YYYY-MM-DDTHH:MM:SS.ffffffZ"`` (27 characters): the SQLite text once the ``T`` is a space and
    the ``Z`` gone. A list of only those is exactly ``30 n + 1`` characters long with ``n`` closing
    ``Z"`` (the other forms, naive, with an offset or without microseconds, are 19 to 32 characters,
    and a ``Z"`` closes only the zero-offset ones of 20 or 27), so the whole list is converted by three
    string operations, a fraction of the work of formatting each timestamp (``isoformat`` formats
    with ``printf`` and asks ``TzInfo`` for the offset twice). Anything else is parsed back and formatted
    one at a time."""
    return _sqlite_stamps(stamps_json(stamps), len(stamps))


def _sqlite_stamps_at_zero(text: str, n: int) -> list[str] | None:
    """``sqlite_timestamps``' three string operations on a JSON ``text`` of ``n`` stamps that holds a
    ``Z`` only for offset zero, or None unless every one is a zero-offset stamp with microseconds."""
    if len(text) == 30 * n + 1 and text.count('Z"') == n:
        return text[2:-3].replace("T", " ").split('Z","')
    return None


def stamps_json(stamps: list[datetime]) -> bytes:
    """``stamps`` as one JSON text that stands for them exactly (``encode_rows`` reads it back).

    pydantic-core writes an offset in whole minutes, and ``Z`` for a few microseconds' offset: a
    timestamp it would write lossily (never a decoded one: JSON offsets are minutes) goes as its UTC
    instant instead, which is what both databases store of it. The common case costs one serializer
    call and a length check (every stamp pydantic's own ``TzInfo`` at offset zero, with microseconds,
    as ``sqlite_timestamps`` uses it)."""
    text = to_json(stamps)
    n = len(stamps)
    if n and len(text) == 30 * n + 1 and set(map(type, map(_tzinfo, stamps))) == {TzInfo} \
            and text.count(b'Z"') == n:
        return text
    if all(map(_lossless, stamps)):
        return text
    return to_json([ts if _lossless(ts) else ts.astimezone(UTC) for ts in stamps])


def _lossless(ts: datetime) -> bool:
    offset = ts.utcoffset()
    return offset is None or not (offset.microseconds or offset.seconds % 60)


def _sqlite_stamps(stamps: bytes, n: int) -> list[str]:
    """``sqlite_timestamps`` of the ``n`` stamps in ``stamps_json``'s text: the same three string
    operations when all are at offset zero with microseconds (``stamps_json`` writes ``Z`` only for
    offset zero), else each stamp parsed back and formatted."""
    text = stamps.decode()
    fast = _sqlite_stamps_at_zero(text, n) if n else []
    if fast is not None:
        return fast
    return [sqlite_timestamp(datetime.fromisoformat(s)) for s in from_json(text)]


_tzinfo = operator.attrgetter("tzinfo")


def _aware(ts: datetime) -> datetime:
    """Naive event timestamps mean UTC (as everywhere in the schema); aware ones travel as they are."""
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)
