"""Staged rows of a batch plan (PostgreSQL: binary COPY tuples; SQLite: multi-row INSERT parameters):
rows encoded in the ingester's process as the writer streams them, rows read a second time (the
fallback after a unique violation), and rows the writer process encodes from the shipped field
values are the same rows, in the same order; odd timestamps and sampling records included."""

from __future__ import annotations

import itertools
import json
import marshal
from datetime import UTC, datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import numpy as np
import pytest
import sqlalchemy as sa
from pydantic_core import TzInfo, to_json
from sqlalchemy.dialects import postgresql, sqlite

from policy.routes import Routes
from realtime_rl.bus.base import Record
from realtime_rl.event_samples import sample_stream
from realtime_rl.events import SamplingRecord, decode_event
from realtime_rl.ingest_decode import decode_record
from realtime_rl.ingest_plan import (
    _sampling_json,
    encoded_rows,
    plan_batch,
    sqlite_timestamp,
    sqlite_timestamps,
    staged_rows,
    stamps_for,
    stamps_json,
    utc,
)
from realtime_rl.ingest_proc import ship

TABLES = ("completions", "feedback")
LAX_ROUTES = Routes(np.array([[[1, 0]], [[2, 3]], [[3, 1]]]), 4)


def _lax() -> list[bytes]:
    """Valid events that pydantic coerces: offsets, naive and second-less timestamps, numbers as text,
    ints for floats, missing defaults (an event id too), unknown fields, a mixture-of-experts route record.
    Token ids are JSON integers only, in [0, 2**31) (tests/test_token_validation.py has the ones refused)."""
    routes = LAX_ROUTES.to_wire()
    base = {"type": "completion", "caller": "k", "model": "m", "version": "v9", "prompt": "p ü 🙂 \\ \"q\"\n",
            "completion": "x", "prompt_token_ids": [1, 2], "completion_token_ids": [3, 4], "logprobs": [-1, -0.5]}
    events = [
        {**base, "event_id": "e1", "completion_id": "lax-offset", "ts": "2026-11-30T14:00:03.5+02:00", "routes": routes,
         "session": {"segment": "2", "summary_id": "c-1", "summary": False}, "sampling_logprobs": ["-2", -1e-7], "sampling": {"temperature": -0.0, "stop": ["\n", "é"], "seed": 3}},
        {**base, "event_id": "e2", "completion_id": "lax-naive", "ts": "2026-11-30T12:00:02", "latency_ms": "12.5",
         "choice_index": "1", "future_field": {"nested": [1]}, "sampling": {"temperature": 0}},
        {**base, "completion_id": "lax-unix", "ts": 1_800_000_000, "sampling": {"temperature": 0.0}},
        {**base, "completion_id": "lax-empty", "ts": "2026-11-30T12:00:04Z", "prompt_token_ids": [],
         "completion_token_ids": [0, 2**31 - 1], "logprobs": [-0.1, -0.2]},
        {"type": "feedback", "event_id": "f1", "completion_id": "lax-offset", "caller": "k", "version": "v9", "signal": "accept",
         "score": 1, "ts": "2026-11-30T13:00:11-01:00"},
        {"type": "feedback", "event_id": "f2", "completion_id": "lax-naive", "caller": "k", "version": "v9", "signal": "edit",
         "kept_text": "x", "ts": "2026-11-30T12:00:10"},
    ]
    return [json.dumps(e).encode() for e in events]


def _decoded(n: int = 700, lax: bool = False):
    stream = sample_stream(n, seed=2, revise_rate=0.3)  # event ids are random: decode once per test
    values = [v for _, v in stream.messages] + (_lax() if lax else [])
    decoded = [decode_record(Record("t", 0, i, None, v, 0), 1_000_000) for i, v in enumerate(values)]
    assert all(d.event is not None for d in decoded)
    return decoded


DIALECTS = {"postgresql": postgresql.psycopg.dialect(), "sqlite": sqlite.dialect()}


def _plan(decoded, name: str):
    plan = plan_batch(decoded, DIALECTS[name])
    assert plan.staging == name
    return plan


@pytest.mark.parametrize("dialect", DIALECTS)
def test_rows_from_shipped_fields_are_the_rows_encoded_here(dialect: str) -> None:
    decoded = _decoded(lax=True)
    plan = _plan(decoded, dialect)
    expected = {t: list(staged_rows(plan, t)) for t in TABLES}
    assert len(expected["completions"]) > 200 and len(expected["feedback"]) > 200
    assert len({r[0] for r in expected["completions"]}) == len(expected["completions"])  # one row per id
    assert any(r[-1] for r in expected["feedback"]) and not all(r[-1] for r in expected["feedback"])  # is_latest
    # What the writer process receives: ship's frame through marshal, as ingest_proc.run_batch unpacks it.
    body = marshal.loads(ship(plan, {("t", 0): 0}, {("t", 0): len(decoded)}))
    assert body[:3] == (dialect, {("t", 0): 0}, {("t", 0): len(decoded)})
    shipped = {"completions": body[3:5], "feedback": body[5:7]}
    for table in TABLES:
        assert list(encoded_rows(dialect, table, *shipped[table])) == expected[table]


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_copy_abandoned_midway_leaves_every_row_for_the_next_read(dialect: str) -> None:
    decoded = _decoded()
    expected = {t: list(staged_rows(_plan(decoded, dialect), t)) for t in TABLES}
    plan = _plan(decoded, dialect)
    for t in TABLES:
        assert list(itertools.islice(staged_rows(plan, t), 37)) == expected[t][:37]  # the COPY failed here
    assert {t: list(staged_rows(plan, t)) for t in TABLES} == expected


def test_lax_values_are_encoded_as_the_column_types_write_them(monkeypatch) -> None:
    """The JSON columns are json_text of the validated values (ints made ints, floats floats, missing
    arrays NULL); the timestamps are the UTC instant, in SQLite's text and as aware datetimes."""
    from realtime_rl import ingest_plan

    monkeypatch.setattr(ingest_plan, "COPY_MIN_ROWS", 1)
    decoded = _decoded(0, lax=True)
    by_id = {}
    for dialect in DIALECTS:
        plan = _plan(decoded, dialect)
        by_id[dialect] = {r[0]: r for r in staged_rows(plan, "completions")}
    lite, pg = by_id["sqlite"], by_id["postgresql"]
    routes = json.dumps(LAX_ROUTES.to_wire(), separators=(",", ":"))
    assert lite["lax-offset"][7:14] == ("[1,2]", "[3,4]", "[-1.0,-0.5]", "[-2.0,-1e-7]", routes,
                                        '{"segment":2,"summary_id":"c-1","summary":false}', '{"temperature":-0.0,"top_p":1.0,"top_k":0,"max_tokens":16,'
                                        '"stop":["\\n","é"],"seed":3}')
    assert lite["lax-offset"][-1] == "2026-11-30 12:00:03.500000"
    assert pg["lax-offset"][-1] == datetime(2026, 11, 30, 12, 0, 3, 500000, tzinfo=UTC)
    assert lite["lax-naive"][10:14] == (None, None, None, '{"temperature":0.0,"top_p":1.0,"top_k":0,"max_tokens":16,'
                                                    '"stop":[],"seed":null}')
    assert lite["lax-naive"][14:] == ("stop", 12.5, None, 1, "2026-11-30 12:00:02.000000")
    assert pg["lax-naive"][-1] == datetime(2026, 11, 30, 12, 0, 2, tzinfo=UTC)
    assert lite["lax-unix"][-1] == "2027-01-15 08:00:00.000000"
    assert lite["lax-empty"][7:9] == ("[]", f"[0,{2**31 - 1}]")
    for row in pg.values():
        assert row[:-1] == lite[row[0]][:-1]


def test_a_sampling_record_is_written_as_its_field_dict() -> None:
    """The writer gets the record's field dict; pydantic-core writes it exactly as the record. Distinct
    records that compare equal (-0.0 and 0.0) keep their own text."""
    records = [SamplingRecord(), SamplingRecord(temperature=0.7, top_p=0.9, top_k=40, max_tokens=64,
                                                stop=["\n\n", "ü\"", ""], seed=123456789012),
               SamplingRecord(temperature=-0.0), SamplingRecord(temperature=0.0), SamplingRecord(temperature=1e-7)]
    seen: dict[str, str] = {}
    for record in records * 2:
        assert to_json(record.__dict__) == to_json(record)
        assert _sampling_json(record.__dict__, seen) == to_json(record).decode()
    assert len(seen) == len(records)


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


def test_the_stamps_text_stands_for_the_stamps() -> None:
    """``stamps_json`` is all the writer process gets of the timestamps: read back it gives the same
    instant, and SQLite's text of it, for every kind of stamp; pydantic-core writes some offsets
    lossily (seconds dropped, a few microseconds as ``Z``), and those travel as their UTC instant."""
    decoded = [decode_event(v).ts for _, v in sample_stream(50, seed=1).messages]
    odd = [datetime(2026, 1, 1, 0, 0, 0, 5, tzinfo=timezone(timedelta(microseconds=1))),
           datetime(2026, 1, 1, 0, 0, 0, 5, tzinfo=timezone(timedelta(seconds=30))),
           datetime(2026, 1, 1, 0, 0, 0, 5, tzinfo=TzInfo(3601)), datetime(2026, 1, 1, tzinfo=TzInfo(-19800)),
           datetime(2026, 1, 1, 0, 0, 0, 5), datetime(2026, 1, 1), datetime(2026, 1, 1, tzinfo=UTC),
           datetime(2026, 10, 25, 2, 30, fold=1, tzinfo=ZoneInfo("Europe/Berlin")),
           decoded[0].replace(microsecond=0)]
    for stamps in (decoded, [*decoded[:3], *odd], odd):
        text = stamps_json(stamps)
        assert stamps_for("sqlite", text, len(stamps)) == [sqlite_timestamp(ts) for ts in stamps]
        aware = stamps_for("postgresql", text, len(stamps))
        assert aware == [utc(ts) for ts in stamps] and all(ts.tzinfo is not None for ts in aware)
        assert sqlite_timestamps(stamps) == [sqlite_timestamp(ts) for ts in stamps]
