"""The staged write paths (PostgreSQL: typed rows by binary COPY into a temp table; SQLite:
executemany into a temp table) store exactly what the plain SQLAlchemy path stores, and
both databases store the same: for canonical gateway events and for lax-but-valid ones (coerced
types, missing defaults, offsets, naive timestamps, unknown fields)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa

from policy.routes import Routes
from realtime_rl.event_samples import sample_stream
from realtime_rl.ingest import Ingester
from tests.ingest_fixtures import make_settings, rows, send


def _raw(**fields) -> bytes:
    return json.dumps(fields).encode()


def _lax_events() -> list[tuple[bytes, bytes]]:
    base = {"type": "completion", "caller": "k", "model": "m", "version": "v9", "prompt": "p ü 🙂 \\ \"q\"\n",
            "completion": "x*3\t\n", "prompt_token_ids": [1, 2], "completion_token_ids": [3, 4],
            "logprobs": [-1, -0.5]}
    fb = {"type": "feedback", "caller": "k", "version": "v9"}
    events = [
        {**base, "event_id": "e-extra", "completion_id": "lax-extra", "ts": "2026-11-30T12:00:00Z",
         "future_field": {"nested": [1, 2]}},
        {**base, "event_id": "e-defaults", "completion_id": "lax-defaults", "ts": "2026-11-30T12:00:01Z"},
        {**base, "event_id": "e-coerced", "completion_id": "lax-coerced", "ts": "2026-11-30T12:00:02.123456",
         "latency_ms": "12.5", "choice_index": "1", "sampling": {"temperature": 0.5}},
        {**base, "event_id": "e-offset", "completion_id": "lax-offset", "ts": "2026-11-30T14:00:03+02:00",
         "sampling_logprobs": [-2, -1.5], "routes": Routes(np.array([[[1, 2]], [[3, 0]], [[2, 1]]]), 4).to_wire(),
         "task_bucket": "abs"},
        {**fb, "event_id": "f-int-score", "completion_id": "lax-extra", "signal": "accept", "score": 1,
         "ts": "2026-11-30T12:00:09Z"},
        {**fb, "event_id": "f-naive", "completion_id": "lax-coerced", "signal": "edit", "kept_text": "x * 3",
         "ts": "2026-11-30T12:00:10"},
        {**fb, "event_id": "f-offset", "completion_id": "lax-offset", "signal": "reject", "comment": "nope",
         "ts": "2026-11-30T13:00:11-01:00"},
    ]
    return [(e["completion_id"].encode(), _raw(**e)) for e in events]


def _snapshot(url: str) -> dict:
    def norm(value):
        if isinstance(value, str) and value[:1] in "[{":
            return json.loads(value)
        if isinstance(value, datetime):
            return (value if value.tzinfo else value.replace(tzinfo=UTC)).astimezone(UTC)
        return value

    engine = sa.create_engine(url)
    try:
        out = {}
        with engine.connect() as conn:
            for table, key, skip in (("completions", "completion_id", {"ingested_at"}),
                                     ("feedback", "event_id", {"id", "ingested_at"}),
                                     ("training_examples", "completion_id", {"updated_at"}),
                                     ("pending_feedback", "completion_id", {"first_seen_at"})):
                t = sa.Table(table, sa.MetaData(), autoload_with=conn)
                # Reflected SQLite timestamps come back as text: read them through the models' types.
                from realtime_rl import tables as models

                model = models.Base.metadata.tables[table]
                cols = [model.c[c.name] for c in t.c if c.name not in skip]
                rows = conn.execute(sa.select(*cols).order_by(model.c[key])).mappings().all()
                out[table] = [{k: norm(v) for k, v in r.items()} for r in rows]
        return out
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_fast_path_plain_path_and_sqlite_store_the_same(tmp_path: Path, postgres_admin_url: str) -> None:
    from rtrl import devservices

    # Over 512 completions: SQLite's multi-row inserts run full chunks and power-of-two remainders.
    messages = sample_stream(1200, seed=3).messages + _lax_events()
    snapshots, nulls = [], []
    with devservices.temporary_postgres_database(postgres_admin_url) as pg_fast, \
            devservices.temporary_postgres_database(postgres_admin_url) as pg_plain:
        for url, staged in ((pg_fast, True), (pg_plain, False), (f"sqlite:///{tmp_path / 'staged.db'}", True),
                            (f"sqlite:///{tmp_path / 'plain.db'}", False)):
            s = make_settings(tmp_path, url, ingest={"staged_writes": staged, "batch_max_records": 5000})
            send(s, messages)
            ing = Ingester(s)
            ing.drain(timeout_s=60)
            ing.close()
            assert ing.stats.written.dead_letters == 0
            assert ing.stats.transactions == 1  # one batch: the fast path really ran on pg_fast
            snapshots.append(_snapshot(url))
            nulls.append(rows(url, "SELECT COUNT(*) FROM completions WHERE sampling_logprobs IS NULL")[0][0])
    fast, plain, lite, lite_plain = snapshots
    assert len(fast["completions"]) > 512 and len(fast["training_examples"]) > 100
    lax = {r["completion_id"]: r for r in fast["completions"] if r["completion_id"].startswith("lax-")}
    assert lax["lax-coerced"]["latency_ms"] == 12.5 and lax["lax-coerced"]["choice_index"] == 1
    assert lax["lax-coerced"]["created_at"] == datetime(2026, 11, 30, 12, 0, 2, 123456, tzinfo=UTC)
    assert lax["lax-offset"]["created_at"] == datetime(2026, 11, 30, 12, 0, 3, tzinfo=UTC)
    assert lax["lax-defaults"]["finish_reason"] == "stop" and lax["lax-defaults"]["sampling"]["top_p"] == 1.0
    assert lax["lax-extra"]["prompt"] == "p ü 🙂 \\ \"q\"\n"
    assert fast == plain
    assert fast == lite
    assert lite == lite_plain
    assert nulls == [nulls[0]] * 4 and nulls[0] > 0  # missing arrays are SQL NULL on every path


@pytest.mark.postgres
def test_many_small_batches_store_what_one_batch_stores(tmp_path: Path, postgres_admin_url: str,
                                                        monkeypatch) -> None:
    """Revisions, early feedback and their joins split across many transactions (staged path forced
    on PostgreSQL for every batch) end in exactly the rows one big batch gives, on both databases."""
    from realtime_rl import ingest_plan
    from rtrl import devservices

    monkeypatch.setattr(ingest_plan, "COPY_MIN_ROWS", 1)
    messages = sample_stream(1500, seed=5, revise_rate=0.3, early_rate=0.15).messages
    snapshots, counted = [], []
    with devservices.temporary_postgres_database(postgres_admin_url) as pg_small, \
            devservices.temporary_postgres_database(postgres_admin_url) as pg_one:
        for url, batch in ((pg_small, 97), (pg_one, 5000), (f"sqlite:///{tmp_path / 'small.db'}", 97)):
            s = make_settings(tmp_path, url, ingest={"batch_max_records": batch})
            send(s, messages)
            ing = Ingester(s)
            ing.drain(timeout_s=120)
            ing.close()
            assert ing.stats.written.dead_letters == 0
            assert (ing.stats.transactions > 10) == (batch == 97)
            snapshots.append(_snapshot(url))
            counted.append((ing.stats.written.joined, ing.stats.written.pending))
    small, one, lite = snapshots
    assert small == one
    assert small == lite
    # The same batches join and leave pending the same counts on both databases (each counts them in
    # its own SQL), and feedback did wait for its completion.
    assert counted[0] == counted[2] and counted[0][1] > 0
    assert any(r["feedback_count"] > 1 for r in small["training_examples"])
