"""Staged rows of a batch plan (PostgreSQL: binary COPY tuples; SQLite: executemany tuples): rows
encoded ahead (while the previous batch commits), rows encoded as the writer streams them, and rows
read a second time (the fallback after a unique violation) are the same rows, in the same order."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from realtime_rl.bus.base import Record
from realtime_rl.event_samples import sample_stream
from realtime_rl.events import decode_event
from realtime_rl.ingest_decode import decode_record
from realtime_rl.ingest_plan import (
    encode_ahead,
    plan_batch,
    sqlite_timestamp,
    sqlite_timestamps,
    staged_rows,
    utc,
)

TABLES = ("completions", "feedback")


def _decoded(n: int = 700):
    stream = sample_stream(n, seed=2, revise_rate=0.3)  # event ids are random: decode once per test
    return [decode_record(Record("t", 0, i, k, v, 0), 1_000_000) for i, (k, v) in enumerate(stream.messages)]


DIALECTS = {"postgresql": postgresql.psycopg.dialect(), "sqlite": sqlite.dialect()}


def _plan(decoded, name: str):
    plan = plan_batch(decoded, DIALECTS[name])
    assert plan.staging == name
    return plan


@pytest.mark.parametrize("dialect", DIALECTS)
def test_rows_encoded_ahead_then_streamed_are_the_rows_streamed_alone(dialect: str) -> None:
    decoded = _decoded()
    expected = {t: list(staged_rows(_plan(decoded, dialect), t)) for t in TABLES}
    n_completions = len(expected["completions"])
    assert n_completions > 200 and len(expected["feedback"]) > 200
    assert len({r[0] for r in expected["completions"]}) == n_completions  # one row per completion id
    assert any(r[-1] for r in expected["feedback"]) and not all(r[-1] for r in expected["feedback"])  # is_latest

    # Stop part-way into feedback: both tables hold a mix of rows encoded ahead and rows left to encode.
    plan = _plan(decoded, dialect)
    ahead = 0
    while ahead < n_completions + 50:
        assert encode_ahead(plan, 64)
        ahead += 64
    assert len(plan.encoded["completions"]) == n_completions
    assert 0 < len(plan.encoded["feedback"]) < len(expected["feedback"])
    assert {t: list(staged_rows(plan, t)) for t in TABLES} == expected
    assert plan.encoded == {}  # handed over: no row outlives the COPY
    assert {t: list(staged_rows(plan, t)) for t in TABLES} == expected  # read again: the same rows

    plan = _plan(decoded, dialect)
    while encode_ahead(plan, 100):  # encodes 100 rows per call until nothing is left
        pass
    assert {t: len(rows) for t, rows in plan.encoded.items()} == {t: len(expected[t]) for t in TABLES}
    assert {t: list(staged_rows(plan, t)) for t in TABLES} == expected


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_copy_abandoned_midway_leaves_every_row_for_the_next_read(dialect: str) -> None:
    decoded = _decoded()
    expected = {t: list(staged_rows(_plan(decoded, dialect), t)) for t in TABLES}
    plan = _plan(decoded, dialect)
    for t in TABLES:
        assert list(itertools.islice(staged_rows(plan, t), 37)) == expected[t][:37]  # the COPY failed here
    assert {t: list(staged_rows(plan, t)) for t in TABLES} == expected


def test_nothing_is_encoded_ahead_for_the_plain_path() -> None:
    decoded = _decoded()
    for dialect in DIALECTS.values():
        plan = plan_batch(decoded, dialect, use_copy=False)
        assert plan.staging is None
        assert not encode_ahead(plan, 64)
        assert plan.encoded == {}


def test_sqlite_timestamps_are_the_text_the_column_type_writes() -> None:
    bind = sa.DateTime(timezone=True).dialect_impl(sqlite.dialect()).bind_processor(sqlite.dialect())
    berlin = ZoneInfo("Europe/Berlin")
    stamps = [decode_event(v).ts for _, v in sample_stream(20, seed=1).messages]  # pydantic's own UTC tzinfo
    stamps += [datetime(2026, 1, 1, 0, 0, 0, 5, tzinfo=timezone(timedelta(hours=h, minutes=m)))
               for h in (-12, -1, 0, 5, 14) for m in (0, 30)]
    stamps += [datetime(2026, 11, 30, 23, 59, 59, 999999), datetime(2026, 1, 1, tzinfo=UTC),
               datetime(2026, 1, 1, tzinfo=timezone(timedelta(seconds=-1, microseconds=7))),
               datetime(2026, 10, 25, 2, 30, fold=1, tzinfo=berlin), datetime(2026, 10, 25, 2, 30, tzinfo=berlin)]
    assert any(s.utcoffset() == timedelta(0) for s in stamps) and any(s.tzinfo is None for s in stamps)
    for ts in stamps:
        assert sqlite_timestamp(ts) == bind(utc(ts)), ts


def test_timestamps_formatted_together_are_the_ones_formatted_alone() -> None:
    """The batched form (one serializer call when every stamp is a decoded UTC one with microseconds)
    agrees with ``sqlite_timestamp`` whichever stamps a slice holds, the forms it must not take whole
    included: a microsecond offset (written ``Z``), second offsets (written ``+00:00``), no microseconds."""
    decoded = [decode_event(v).ts for _, v in sample_stream(300, seed=1).messages]
    odd = [datetime(2026, 1, 1, 0, 0, 0, 5, tzinfo=timezone(timedelta(microseconds=1))),
           datetime(2026, 1, 1, 0, 0, 0, 5, tzinfo=timezone(timedelta(seconds=30))),
           datetime(2026, 1, 1, 0, 0, 0, 5, tzinfo=UTC), datetime(2026, 1, 1, 0, 0, 0, 5),
           decode_event(sample_stream(1, seed=3).messages[0][1]).ts.replace(microsecond=0),
           datetime(5, 1, 1, 0, 0, 0, 5, tzinfo=decoded[0].tzinfo),
           datetime(2026, 1, 1, 0, 0, 0, 5, tzinfo=ZoneInfo("Europe/London"))]
    assert sqlite_timestamps(decoded) == [sqlite_timestamp(ts) for ts in decoded]
    assert sqlite_timestamps([]) == []
    for ts in odd:
        stamps = [*decoded[:3], ts, *decoded[3:6]]
        assert sqlite_timestamps(stamps) == [sqlite_timestamp(s) for s in stamps], ts
