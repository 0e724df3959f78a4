"""Batched, idempotent writes of one batch of decoded events into the feedback tables.

Everything here runs inside the caller's transaction (the one that also advances the consumer
offsets). Each table is written with one multi-row statement per batch: ``INSERT ... ON CONFLICT
DO NOTHING RETURNING`` for events (idempotent on the event id, so a producer that resends after a
failed flush causes no duplicates), then set-based statements keep the derived tables right:

1. completions, then feedback (history: every feedback event is a row);
2. ``feedback.is_latest`` corrected (only where wrong) for the completions that got new feedback:
   the newest by the event's own timestamp (ties: event id), so arrival order does not matter;
3. ``training_examples`` upserted (``INSERT ... SELECT ... ON CONFLICT DO UPDATE``) for every
   completion touched by the batch that now has both halves; the join runs in the database;
4. ``pending_feedback`` gains the completions that have feedback but no completion yet, and loses
   the ones that just joined (feedback that arrived first is joined when its completion arrives);
5. model-version actions (history) and the per-version summary derived from them.

On PostgreSQL, large batches of completions and feedback travel as typed rows in COPY's binary
format into temporary tables shaped like the targets, and move with one ``INSERT ... SELECT ... ON
CONFLICT`` each; id lists travel as one array parameter (``= ANY(...)``, ``unnest(...)``). So no
statement grows with the batch, and the server parses nothing but the JSON arrays.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from pydantic_core import from_json
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite

from realtime_rl import tables as t
from realtime_rl.database import json_text
from realtime_rl.events import CompletionEvent, FeedbackEvent, ModelVersionEvent
from realtime_rl.ingest_decode import CONFLICT, Decoded
from realtime_rl.ingest_plan import (
    COMPLETION_COLUMNS,
    FEEDBACK_COLUMNS,
    PG_COPY_TYPES,
    BatchPlan,
    sqlite_timestamp,
    staged_rows,
    utc,
)

_IN_CHUNK = 2000
"""Ids per ``IN (...)`` list: well inside SQLite's and PostgreSQL's bound-parameter limits."""

# The sqlite3 driver "adapts" every parameter that is not exactly an int, float, str or bytearray,
# None included: finding no adapter registered for it, it asks the protocol type for ``__adapt__``,
# which raises and clears an AttributeError (costly for every None; a staged feedback row binds
# three, a completion one or two). With this entry the lookup hits, and the adapter returns its
# argument (``{}.get`` of anything is None, and a C call): binding is unchanged, None is NULL.
sqlite3.register_adapter(type(None), {}.get)


class OffsetsMoved(RuntimeError):
    """Another ingester of this group committed first; our view of the positions is stale."""


def advance(conn: sa.Connection, group: str, before: dict[tuple[str, int], int],
            after: dict[tuple[str, int], int], now: datetime) -> None:
    """Move ``group``'s stored positions from ``before`` to ``after``, only where they still are ``before``
    (else :class:`OffsetsMoved`: the transaction must not commit)."""
    o = t.consumer_offsets
    moving = sorted(p for p in after if after[p] != before[p])
    if conn.dialect.name == "postgresql" and len(moving) > 1:
        # One statement (one round trip) for every partition: the batch's slow stage is a
        # sequence of round trips, and this was one per partition.
        values = ", ".join(f"(:t{i}, :p{i}, :b{i}, :a{i})" for i in range(len(moving)))
        params: dict = {"group": group, "now": now}
        for i, (topic, partition) in enumerate(moving):
            params.update({f"t{i}": topic, f"p{i}": partition, f"b{i}": before[(topic, partition)],
                           f"a{i}": after[(topic, partition)]})
        moved = conn.execute(sa.text(
            "UPDATE consumer_offsets AS o SET next_offset = v.after, updated_at = :now "
            f"FROM (VALUES {values}) AS v(topic, partition, before, after) "
            "WHERE o.group_id = :group AND o.topic = v.topic AND o.partition = v.partition "
            "AND o.next_offset = v.before"), params).rowcount
        if moved != len(moving):
            raise OffsetsMoved(f"{moved} of {len(moving)} positions were where this batch began; the others "
                               "moved in another transaction")
        return
    for pos in moving:
        topic, partition = pos
        moved = conn.execute(
            sa.update(o).where(o.c.group_id == group, o.c.topic == topic, o.c.partition == partition,
                               o.c.next_offset == before[pos])
            .values(next_offset=after[pos], updated_at=now)).rowcount
        if moved != 1:
            raise OffsetsMoved(f"{topic}[{partition}] moved past {before[pos]} in another transaction")


@dataclass
class WriteResult:
    completions: int = 0
    feedback: int = 0
    model_versions: int = 0
    dead_letters: int = 0
    duplicates: int = 0
    joined: int = 0
    pending: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)

    def add(self, other: WriteResult) -> None:
        for name in ("completions", "feedback", "model_versions", "dead_letters", "duplicates", "joined", "pending"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for reason, n in other.by_reason.items():
            self.by_reason[reason] = self.by_reason.get(reason, 0) + n


def dialect_insert(conn: sa.Connection, table: sa.Table):
    """INSERT with ON CONFLICT support for the connection's dialect."""
    return (postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert)(table)


def _chunks(conn: sa.Connection, items: Sequence) -> Iterable[Sequence]:
    """Id lists small enough for one ``IN``; PostgreSQL takes any length as one array parameter."""
    size = (len(items) or 1) if conn.dialect.name == "postgresql" else _IN_CHUNK
    for i in range(0, len(items), size):
        yield items[i:i + size]


def dead_letter_row(item: Decoded, now: datetime, max_raw: int, reason: str | None = None,
                    detail: str | None = None) -> dict[str, Any]:
    r = item.record
    return {"topic": r.topic, "partition": r.partition, "offset": r.offset, "key": r.key,
            "raw": r.value[:max_raw], "raw_size": len(r.value), "reason": reason or item.reason,
            "detail": (detail or item.detail or "")[:4000], "created_at": now, "replayed_at": None}


def _completion_row(e: CompletionEvent, now: datetime) -> dict[str, Any]:
    return {
        "completion_id": e.completion_id, "event_id": e.event_id, "caller": e.caller, "model": e.model,
        "version": e.version, "prompt": e.prompt, "completion": e.completion,
        "prompt_token_ids": e.prompt_token_ids, "completion_token_ids": e.completion_token_ids,
        "logprobs": e.logprobs, "sampling_logprobs": e.sampling_logprobs, "routes": e.routes, "session": e.session,
        "sampling": e.sampling.model_dump(mode="json"), "finish_reason": e.finish_reason,
        "latency_ms": e.latency_ms, "task_bucket": e.task_bucket, "choice_index": e.choice_index,
        "created_at": utc(e.ts), "ingested_at": now,
    }


def _feedback_row(e: FeedbackEvent, now: datetime, is_latest: bool) -> dict[str, Any]:
    return {
        "event_id": e.event_id, "completion_id": e.completion_id, "caller": e.caller, "version": e.version,
        "signal": e.signal, "kept_text": e.kept_text, "score": e.score, "comment": e.comment,
        "created_at": utc(e.ts), "ingested_at": now, "is_latest": is_latest,
    }


def write_plan(conn: sa.Connection, plan: BatchPlan, now: datetime, *, max_raw: int,
               direct: bool = True) -> WriteResult:
    """Write a planned batch (:func:`realtime_rl.ingest_plan.plan_batch`) inside the open transaction.
    ``direct=False`` skips the staged path's first try straight into the tables (known to conflict)."""
    result = None
    if plan.staging is not None and direct:
        result = write_direct(conn, functools.partial(staged_rows, plan), list(plan.completions),
                              [i.event.completion_id for i in plan.feedback.values()], now)
    elif conn.dialect.name == "postgresql":
        _pg_session(conn, savepoint=False)
    dead = [dead_letter_row(item, now, max_raw, reason, detail) for item, reason, detail in plan.dead]
    if result is None:
        result = _write_resolving(conn, plan, now, max_raw, dead)
    result.duplicates += plan.duplicates
    return write_rest(conn, result, plan.versions, dead, now)


def write_direct(conn: sa.Connection, rows: Callable[[str], Iterable[tuple]], completion_ids: list[str],
                 feedback_cids: list[str], now: datetime) -> WriteResult | None:
    """The staged path when nothing conflicts: ``rows(table)`` (the staged rows of ``"completions"``
    and ``"feedback"``, in the order of ``completion_ids`` and ``feedback_cids``, their completion ids)
    straight into the tables, then ``is_latest`` and the join. None when a unique index refused a row
    (rolled back to the savepoint: nothing written; the caller resolves the batch row by row)."""
    if conn.dialect.name == "postgresql":
        _pg_session(conn, savepoint=True)
    if not _insert_direct(conn, rows, {"completions": bool(completion_ids), "feedback": bool(feedback_cids)}, now):
        return None
    result = WriteResult(completions=len(completion_ids), feedback=len(feedback_cids))
    _join(conn, result, completion_ids, set(feedback_cids), now)
    return result


def write_rest(conn: sa.Connection, result: WriteResult, versions: list[ModelVersionEvent],
               dead: list[dict[str, Any]], now: datetime) -> WriteResult:
    """The batch's model-version events and dead letters, counted into ``result``."""
    if versions:
        result.model_versions = _write_versions(conn, versions, now)
    if dead:
        conn.execute(sa.insert(t.dead_letters), dead)
        result.dead_letters = len(dead)
        for row in dead:
            result.by_reason[row["reason"]] = result.by_reason.get(row["reason"], 0) + 1
    return result


def _write_resolving(conn: sa.Connection, plan: BatchPlan, now: datetime, max_raw: int,
                     dead: list[dict[str, Any]]) -> WriteResult:
    """Completions and feedback by ``INSERT ... ON CONFLICT DO NOTHING`` (staged through temp tables, or
    plain), sorting the refused rows into re-deliveries (duplicates) and conflicts (appended to
    ``dead``); then ``is_latest`` and the join."""
    result = WriteResult()
    completions, feedback = plan.completions, plan.feedback
    new_completion_ids: list[str] = []
    if completions:
        if plan.staging == "postgresql":
            new_completion_ids = _pg_stage_insert(conn, "completions", list(staged_rows(plan, "completions")), now)
        elif plan.staging == "sqlite":
            new_completion_ids = _sqlite_stage_insert(conn, "completions", list(staged_rows(plan, "completions")), now)
        else:
            stmt = dialect_insert(conn, t.completions).on_conflict_do_nothing().returning(t.completions.c.completion_id)
            rows = [_completion_row(i.event, now) for i in completions.values()]
            new_completion_ids = list(conn.execute(stmt, rows).scalars().all())
        result.completions = len(new_completion_ids)
        rejected = set(completions) - set(new_completion_ids)
        if rejected:
            wanted = {cid: completions[cid].event.event_id for cid in rejected}
            dups, conflicts = _classify_rejected(conn, wanted)
            result.duplicates += dups
            for cid, why in conflicts.items():
                dead.append(dead_letter_row(completions[cid], now, max_raw, CONFLICT, why))

    feedback_ids: set[str] = set()
    if feedback:
        if plan.staging == "postgresql":
            inserted = _pg_stage_insert(conn, "feedback", list(staged_rows(plan, "feedback")), now)
        elif plan.staging == "sqlite":
            inserted = _sqlite_stage_insert(conn, "feedback", list(staged_rows(plan, "feedback")), now)
        else:
            rows = [_feedback_row(i.event, now, i.event.event_id in plan.newest) for i in feedback.values()]
            stmt = (dialect_insert(conn, t.feedback).on_conflict_do_nothing(index_elements=[t.feedback.c.event_id])
                    .returning(t.feedback.c.completion_id))
            inserted = list(conn.execute(stmt, rows).scalars().all())
        result.feedback = len(inserted)
        result.duplicates += len(feedback) - len(inserted)
        feedback_ids = set(inserted)
    _join(conn, result, new_completion_ids, feedback_ids, now)
    return result


def _join(conn: sa.Connection, result: WriteResult, new_completion_ids: list[str], feedback_ids: set[str],
          now: datetime) -> None:
    """After the batch's rows are in: ``is_latest`` corrected, training examples upserted, pending
    feedback moved; the joined and pending counts go into ``result``."""
    if feedback_ids and conn.dialect.name != "postgresql":  # PostgreSQL: in the join statement
        conn.exec_driver_sql(_SQLITE_MARK_LATEST, (json_text(sorted(feedback_ids)),))
    touched = sorted(set(new_completion_ids) | feedback_ids)
    if touched and conn.dialect.name == "postgresql":  # the join and pending_feedback in one statement
        result.joined, result.pending = _pg_join(conn, touched, sorted(feedback_ids), now)
    elif touched:
        result.joined, result.pending = _sqlite_join(conn, touched, new_completion_ids, sorted(feedback_ids), now)


# Staged batches go straight into completions and feedback inside a savepoint (PostgreSQL: typed rows
# in COPY's binary format; SQLite: multi-row INSERTs of the driver's parameters, which skip SQLAlchemy's per-value
# bind processing). Events are new almost always (the bus redelivers nothing the database committed:
# offsets commit with the rows); when one is not (a producer resent it, or an id conflicts), a unique
# index refuses the insert, the savepoint is rolled back, and the batch goes through temp tables and
# INSERT ... SELECT ... ON CONFLICT, which sorts duplicates from conflicts. The PostgreSQL server
# parses nothing but the JSON arrays (once, as the json columns require). The alternatives cost the
# server more CPU per event: staging whole JSON documents and extracting the columns with
# ``json_populate_record`` parses each document three times, and typed rows through temp tables with
# ON CONFLICT probe every unique index before each insert (`rtrl bench ingest` measures the path).
_STAGED_COLUMNS = {"completions": COMPLETION_COLUMNS, "feedback": FEEDBACK_COLUMNS}
_RETURNING = {"completions": "completion_id", "feedback": "completion_id"}
_CONFLICT = {"completions": "", "feedback": "(event_id)"}
"""Arbiters: a completion conflicts on either of its unique ids; feedback only on its event id (its
other unique key is a fresh identity, not worth a probe per row)."""
_SAVEPOINT = "rtrl_copy"
_UNIQUE_VIOLATION = "23505"


@contextlib.contextmanager
def _wrapped_errors(conn: sa.Connection, statement: str) -> Iterator[None]:
    """Driver errors from the raw cursor as SQLAlchemy's exceptions (OperationalError for an outage,
    DataError, ...), as every other statement raises them: the ingester sorts failures by those."""
    dbapi_error = conn.dialect.loaded_dbapi.Error
    try:
        yield
    except dbapi_error as err:
        raise sa_exc.DBAPIError.instance(statement, None, err, dbapi_error, dialect=conn.dialect) from err


def _pg_session(conn: sa.Connection, *, savepoint: bool) -> None:
    """Per transaction, in one round trip: JIT off (these short set-based statements cost more to
    compile than to run, and tables without statistics easily reach PostgreSQL's JIT cost threshold)
    and, for a staged batch, the savepoint its COPY may roll back to (left to the commit otherwise)."""
    statement = "SET LOCAL jit = off" + (f"; SAVEPOINT {_SAVEPOINT}" if savepoint else "")
    with _wrapped_errors(conn, statement), conn.connection.driver_connection.cursor() as cursor:
        cursor.execute(statement)  # no parameters: the simple protocol, several statements at once


def _insert_direct(conn: sa.Connection, rows: Callable[[str], Iterable[tuple]], tables: dict[str, bool],
                   now: datetime) -> bool:
    """Insert ``rows(table)`` straight into completions and feedback (those ``tables`` marks True) inside
    a savepoint (PostgreSQL: binary COPY; SQLite: multi-row ``INSERT OR FAIL``). False when a unique
    index refused a row: rolled back to the savepoint, nothing written, and the caller stages the batch
    instead."""
    dbapi_error = conn.dialect.loaded_dbapi.Error
    pg = conn.dialect.name == "postgresql"
    cursor = conn.connection.driver_connection.cursor()
    try:
        if not pg:
            cursor.execute(f"SAVEPOINT {_SAVEPOINT}")  # PostgreSQL's was set in _pg_session's round trip
        for table, wanted in tables.items():
            if not wanted:
                continue
            cols = ", ".join(f'"{c}"' for c in _STAGED_COLUMNS[table])
            if pg:
                with cursor.copy(f"COPY {table} ({cols}, ingested_at) FROM STDIN (FORMAT BINARY)") as copy:
                    copy.set_types([*PG_COPY_TYPES[table], "timestamptz"])
                    for row in rows(table):
                        copy.write_row((*row, now))
            else:
                _sqlite_insert_rows(cursor, table, rows(table), sqlite_timestamp(now))
        if not pg:
            cursor.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
    except dbapi_error as err:
        if not _unique_violation(err):
            raise sa_exc.DBAPIError.instance("INSERT", None, err, dbapi_error, dialect=conn.dialect) from err
        with _wrapped_errors(conn, "ROLLBACK TO SAVEPOINT"):
            cursor.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
            if not pg:
                cursor.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
        return False
    finally:
        cursor.close()
    return True


_SQLITE_ROWS_PER_INSERT = 256
"""Rows per multi-row INSERT on SQLite (fewer where the build's bound-parameter limit needs it)."""


def _sqlite_insert_rows(cursor: sqlite3.Cursor, table: str, rows: Iterable[tuple], stamp: str) -> None:
    """``rows`` into ``table`` by multi-row ``INSERT ... VALUES`` statements of up to
    ``_SQLITE_ROWS_PER_INSERT`` rows, not ``executemany``. The driver releases the GIL around every
    ``sqlite3_step`` and ``executemany`` steps once per row: each row then waited for the GIL while the
    ingester's main thread decoded the next batch (a row took many times as long as with an idle main
    thread), so the two threads ran one after the other. One statement binds its rows holding the
    GIL and then inserts them all in one step without it. Remainders go in power-of-two shapes, so a
    few prepared statements serve every batch (the driver caches them by text)."""
    width = len(_STAGED_COLUMNS[table])
    per = max(1, min(_SQLITE_ROWS_PER_INSERT,
                     (cursor.connection.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) - 1) // width))
    rows = iter(rows)
    while True:
        chunk = list(itertools.islice(rows, per))
        if not chunk:
            return
        start = 0
        while start < len(chunk):
            left = len(chunk) - start
            k = per if left >= per else 1 << (left.bit_length() - 1)
            params = [stamp]
            params.extend(itertools.chain.from_iterable(chunk[start:start + k]))
            cursor.execute(_sqlite_values_insert(table, width, k), params)
            start += k


@functools.cache
def _sqlite_values_insert(table: str, width: int, n_rows: int) -> str:
    """``INSERT`` of ``n_rows`` rows; the first parameter is ``ingested_at``, the rows' values follow.

    ``OR FAIL``, not the default ``ABORT``: an aborting multi-row statement keeps a statement journal
    (every page it changes copied first, so that it can undo itself), which made it slower than
    ``executemany``; a failed statement here rolls back to the caller's savepoint anyway. The
    timestamp is one parameter shared by the rows (``?NNN`` numbered parameters would do the same,
    but SQLite compiles a statement of many rows with them far more slowly)."""
    cols = ", ".join(f'"{c}"' for c in _STAGED_COLUMNS[table])
    row = "(" + ", ".join("?" * width) + ")"
    return f"INSERT OR FAIL INTO {table} ({cols}, ingested_at) SELECT *, ? FROM (VALUES {', '.join([row] * n_rows)})"


def _unique_violation(err: Exception) -> bool:
    """A unique (or primary-key) index refused a row: a re-delivered or conflicting event. Anything
    else (a trigger, a check) is the database refusing a record, which the ingester isolates."""
    if getattr(err, "sqlstate", None) == _UNIQUE_VIOLATION:
        return True
    return getattr(err, "sqlite_errorcode", None) in (sqlite3.SQLITE_CONSTRAINT_UNIQUE,
                                                      sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY)


def _pg_stage_insert(conn: sa.Connection, table: str, rows: list[tuple], now: datetime) -> list[str]:
    """Binary COPY of ``rows`` into a temp table (emptied at every commit), then one INSERT ... SELECT
    ... ON CONFLICT. The temp table is created in the transaction rather than cached (a rolled-back
    transaction takes its CREATE with it): cheap once it exists."""
    stage = f"rtrl_stage_{table}"
    cols = ", ".join(f'"{c}"' for c in _STAGED_COLUMNS[table])
    conn.exec_driver_sql(f"CREATE TEMP TABLE IF NOT EXISTS {stage} ON COMMIT DELETE ROWS AS "
                         f"SELECT {cols} FROM {table} WHERE false")
    statement = f"COPY {stage} ({cols}) FROM STDIN (FORMAT BINARY)"
    with _wrapped_errors(conn, statement), conn.connection.driver_connection.cursor() as cursor, \
            cursor.copy(statement) as copy:
        copy.set_types(PG_COPY_TYPES[table])
        for row in rows:
            copy.write_row(row)
    # Through SQLAlchemy, so that a refusal (a constraint, a trigger) arrives as its DataError or
    # IntegrityError, which the ingester isolates record by record.
    result = conn.exec_driver_sql(f"INSERT INTO {table} ({cols}, ingested_at) SELECT {cols}, %(now)s FROM {stage} "
                                  f"ON CONFLICT {_CONFLICT[table]} DO NOTHING RETURNING {_RETURNING[table]}", {"now": now})
    return [r[0] for r in result]


def _sqlite_stage_insert(conn: sa.Connection, table: str, rows: list[tuple], now: datetime) -> list[str]:
    columns = _STAGED_COLUMNS[table]
    stage = f"temp.rtrl_stage_{table}"
    cols = ", ".join(f'"{c}"' for c in columns)
    # Created inside the transaction each time (cheap), so a rollback cannot leave us without it.
    conn.exec_driver_sql(f"CREATE TEMP TABLE IF NOT EXISTS rtrl_stage_{table} AS SELECT {cols} FROM {table} WHERE 0")
    conn.exec_driver_sql(f"DELETE FROM {stage}")
    statement = f"INSERT INTO {stage} ({cols}) VALUES ({', '.join('?' * len(columns))})"
    with _wrapped_errors(conn, statement):
        cursor = conn.connection.driver_connection.cursor()
        try:
            cursor.executemany(statement, rows)
        finally:
            cursor.close()
    # ``WHERE true`` keeps SQLite from reading ON CONFLICT as part of the SELECT.
    result = conn.exec_driver_sql(f"INSERT INTO {table} ({cols}, ingested_at) SELECT {cols}, ? FROM {stage} "
                                  f"WHERE true ON CONFLICT {_CONFLICT[table]} DO NOTHING RETURNING {_RETURNING[table]}",
                                  (sqlite_timestamp(now),))
    return [r[0] for r in result]


def _in(conn: sa.Connection, column: sa.Column, ids: Sequence[str]):
    """``column IN ids``; on PostgreSQL as ``= ANY(array)``, one parameter however many ids."""
    if conn.dialect.name == "postgresql":
        return column == sa.any_(sa.literal(list(ids), postgresql.ARRAY(sa.String)))
    return column.in_(ids)


def _classify_rejected(conn: sa.Connection, wanted: dict[str, str]) -> tuple[int, dict[str, str]]:
    """Split completions the insert skipped into re-deliveries (same event) and conflicts."""
    stored: dict[str, str] = {}
    for chunk in _chunks(conn, sorted(wanted)):
        q = sa.select(t.completions.c.completion_id, t.completions.c.event_id).where(
            _in(conn, t.completions.c.completion_id, chunk))
        stored.update(dict(conn.execute(q).tuples().all()))
    duplicates, conflicts = 0, {}
    for cid, event_id in wanted.items():
        if stored.get(cid) == event_id:
            duplicates += 1
        elif cid in stored:
            conflicts[cid] = f"completion_id {cid!r} already recorded by event {stored[cid]!r}"
        else:
            conflicts[cid] = f"event_id {event_id!r} already recorded for another completion"
    return duplicates, conflicts


_EXAMPLE_FROM_COMPLETION = ("completion_id", "version", "model", "caller", "task_bucket", "prompt_token_ids",
                            "completion_token_ids", "logprobs", "sampling_logprobs", "routes", "sampling")
_EXAMPLE_FROM_FEEDBACK = ("signal", "kept_text", "score")
_EXAMPLE_UPDATED = ("signal", "kept_text", "score", "feedback_event_id", "feedback_count", "feedback_at",
                    "updated_at")


def _pg_join(conn: sa.Connection, completion_ids: list[str], feedback_ids: list[str],
             now: datetime) -> tuple[int, int]:
    """Upsert the example of every id that has both halves, correct ``is_latest`` for them, and move
    ``pending_feedback``: in ids that got feedback but joined nothing, out ids that joined. Returns
    (examples joined, feedback ids left pending)."""
    params = {"ids": json_text(completion_ids), "fb": json_text(feedback_ids), "now": now}
    joined, pending = conn.exec_driver_sql(_PG_JOIN, params).one()
    return joined, pending


def _sqlite_join(conn: sa.Connection, touched: list[str], new_completion_ids: list[str], feedback_ids: list[str],
                 now: datetime) -> tuple[int, int]:
    """What ``_pg_join`` does, in SQLite's statements (``_SQLITE_MARK_LATEST`` has corrected the flags);
    returns (examples joined, feedback ids left pending).

    No statement returns a row per id: the driver releases and retakes the GIL for every row it
    steps through, and while the main thread decodes the next batch each retake waits (as the join's
    ``RETURNING`` did, once for every row it returned). The joined count is the upsert's change count;
    a feedback id joins exactly when its completion is stored (its newest judgement is flagged by now),
    so the ids left pending are those without one, found by the database in one row. A pending id only
    ever lacked its completion, so the ones that just joined are among this batch's new completions."""
    stamp = sqlite_timestamp(now)
    joined = conn.exec_driver_sql(_SQLITE_EXAMPLES, (stamp, json_text(touched))).rowcount
    pending = 0
    if feedback_ids:
        waiting = conn.exec_driver_sql(_SQLITE_WAITING, (json_text(feedback_ids),)).scalar_one()
        pending = len(from_json(waiting))
        if pending:
            conn.exec_driver_sql(_SQLITE_PEND, (stamp, waiting))
    if new_completion_ids and joined:
        conn.exec_driver_sql(_SQLITE_UNPEND, (json_text(new_completion_ids),))
    return joined, pending


_EXAMPLE_TARGET = (*_EXAMPLE_FROM_COMPLETION, *_EXAMPLE_FROM_FEEDBACK, "feedback_event_id", "feedback_count",
                   "feedback_at", "completion_at", "updated_at")
# PostgreSQL: ``is_latest`` and the join in one statement, driven from the id list. Per id, one index
# range of feedback finds the newest judgement (the order ``_SQLITE_MARK_LATEST`` uses) and counts them all;
# the flags are corrected only where a completion has more than one judgement (a single one was
# flagged when it was inserted), and the example takes the newest's fields straight from that range,
# with one primary-key probe of completions. The CTE's UPDATE runs on the same snapshot as the INSERT,
# which reads nothing it changes. LIMIT / OFFSET 0 keep the planner from flattening the LATERALs, and
# the UPDATE finds its rows by primary key: the hash and merge joins planned otherwise scanned whole
# tables for every batch while their statistics were missing (fresh tables until autovacuum analyses
# them), which grows with the table; this does not.
# Long id lists travel to PostgreSQL as one JSON array: pydantic-core encodes it in C, where the
# driver's array adapter quoted each element in Python (thousands of ids per batch).
# The pending_feedback moves ride in the same statement (two round trips fewer per batch); the
# joined ids come from the INSERT's RETURNING, so "waiting" is exactly the feedback ids that did not
# join, as before. Only the two counts come back: thousands of returned ids would cost the commit
# thread Python work per id in the driver and SQLAlchemy's rows, holding the GIL the main thread decodes with.
# Data-modifying CTEs share one snapshot; these touch disjoint rows. The DELETE is a join (hashed or
# index-probed), not ``= ANY(array)``: a runtime array is searched linearly per row.
_PG_JOIN = f"""
WITH latest AS MATERIALIZED (
    SELECT k.id, l.*
    FROM json_array_elements_text(%(ids)s::json) AS k(id)
    CROSS JOIN LATERAL (SELECT {", ".join(_EXAMPLE_FROM_FEEDBACK)}, event_id, created_at, count(*) OVER () AS n
                        FROM feedback WHERE completion_id = k.id
                        ORDER BY created_at DESC, event_id DESC LIMIT 1) l
), flags AS (
    UPDATE feedback SET is_latest = NOT is_latest
    WHERE id = ANY(ARRAY(SELECT r.id FROM latest l
                         CROSS JOIN LATERAL (SELECT id, event_id, is_latest FROM feedback
                                             WHERE completion_id = l.id OFFSET 0) r
                         WHERE l.n > 1 AND r.is_latest <> (r.event_id = l.event_id)))
), joined AS (
    INSERT INTO training_examples ({", ".join(_EXAMPLE_TARGET)})
    SELECT {", ".join(f"c.{n}" for n in _EXAMPLE_FROM_COMPLETION)}, {", ".join(f"l.{n}" for n in _EXAMPLE_FROM_FEEDBACK)},
           l.event_id, l.n, l.created_at, c.created_at, %(now)s
    FROM latest l
    CROSS JOIN LATERAL (SELECT * FROM completions WHERE completion_id = l.id LIMIT 1) c
    ON CONFLICT (completion_id) DO UPDATE SET {", ".join(f"{n} = excluded.{n}" for n in _EXAMPLE_UPDATED)}
    RETURNING completion_id
), unpend AS (
    DELETE FROM pending_feedback p USING joined j WHERE p.completion_id = j.completion_id
), waiting AS MATERIALIZED (
    SELECT w.id FROM json_array_elements_text(%(fb)s::json) AS w(id)
    WHERE NOT EXISTS (SELECT FROM joined j WHERE j.completion_id = w.id)
), pend AS (
    INSERT INTO pending_feedback (completion_id, first_seen_at)
    SELECT id, %(now)s FROM waiting
    ON CONFLICT (completion_id) DO NOTHING
)
SELECT (SELECT count(*) FROM joined), (SELECT count(*) FROM waiting)"""


# SQLite: the same set-based steps as raw statements, each id list one JSON array parameter read with
# ``json_each``: no statement grows with the batch, and SQLAlchemy does not build and compile an
# ``IN`` of thousands of bound parameters per statement (a visible share of the ingester's CPU).
# ``is_latest`` is flipped only where it is wrong (newest by the event's timestamp, ties by event id),
# so a completion's single judgement, flagged when inserted, is never rewritten.
_SQLITE_MARK_LATEST = """
UPDATE feedback SET is_latest = NOT is_latest
WHERE completion_id IN (SELECT value FROM json_each(?))
  AND is_latest != (event_id = (SELECT n.event_id FROM feedback AS n WHERE n.completion_id = feedback.completion_id
                                ORDER BY n.created_at DESC, n.event_id DESC LIMIT 1))"""
# Driven from the id list: one primary-key probe of completions and one index range of feedback per id.
_SQLITE_EXAMPLES = f"""
INSERT INTO training_examples ({", ".join(_EXAMPLE_TARGET)})
SELECT {", ".join(f"c.{n}" for n in _EXAMPLE_FROM_COMPLETION)}, {", ".join(f"f.{n}" for n in _EXAMPLE_FROM_FEEDBACK)},
       f.event_id, (SELECT count(*) FROM feedback AS h WHERE h.completion_id = c.completion_id),
       f.created_at, c.created_at, ?1
FROM json_each(?2) AS k
JOIN completions AS c ON c.completion_id = k.value
JOIN feedback AS f ON f.completion_id = c.completion_id AND f.is_latest
WHERE true
ON CONFLICT (completion_id) DO UPDATE SET {", ".join(f"{n} = excluded.{n}" for n in _EXAMPLE_UPDATED)}"""
_SQLITE_WAITING = ("SELECT json_group_array(value) FROM json_each(?) "
                   "WHERE NOT EXISTS (SELECT 1 FROM completions WHERE completion_id = value)")
_SQLITE_PEND = ("INSERT INTO pending_feedback (completion_id, first_seen_at) SELECT value, ?1 FROM json_each(?2) "
                "WHERE true ON CONFLICT DO NOTHING")
_SQLITE_UNPEND = "DELETE FROM pending_feedback WHERE completion_id IN (SELECT value FROM json_each(?))"

def _write_versions(conn: sa.Connection, events: list[ModelVersionEvent], now: datetime) -> int:
    actions = t.model_version_actions
    rows = [{"event_id": e.event_id, "version": e.version, "model": e.model, "action": e.action,
             "channel": e.channel, "parent": e.parent, "sha256": e.sha256, "metrics": dict(e.metrics),
             "created_at": utc(e.ts), "ingested_at": now} for e in events]
    stmt = dialect_insert(conn, actions).on_conflict_do_nothing().returning(actions.c.version)
    inserted = conn.execute(stmt, rows).scalars().all()
    affected = sorted(set(inserted))
    for version in affected:
        history = conn.execute(sa.select(actions).where(actions.c.version == version)
                               .order_by(actions.c.created_at, actions.c.event_id)).mappings().all()
        last = history[-1]
        metrics: dict[str, float] = {}
        for h in history:
            metrics.update(h["metrics"] or {})
        summary = {
            "version": version, "model": last["model"],
            "parent": next((h["parent"] for h in reversed(history) if h["parent"]), None),
            "sha256": next((h["sha256"] for h in reversed(history) if h["sha256"]), None),
            "metrics": metrics, "last_action": last["action"], "last_channel": last["channel"],
            "created_at": history[0]["created_at"], "updated_at": now,
        }
        stmt = dialect_insert(conn, t.model_versions).values(summary)
        stmt = stmt.on_conflict_do_update(index_elements=[t.model_versions.c.version],
                                          set_={k: stmt.excluded[k] for k in summary if k != "version"})
        conn.execute(stmt)
    return len(inserted)
