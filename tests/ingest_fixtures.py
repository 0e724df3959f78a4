"""Helpers and fixtures for the event-pipeline tests (bus, ingest, migrations, analytics)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from realtime_rl.events import CompletionEvent, FeedbackEvent, SamplingRecord

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def make_settings(tmp_path: Path, db_url: str, *, bus: dict | None = None, ingest: dict | None = None):
    """Settings with a private embedded log (or the given bus), private topics and the given database."""
    from rtrl.config import load_settings

    topic = f"ev-{uuid.uuid4().hex[:8]}"
    bus_cfg = {"embedded_path": str(tmp_path / f"bus-{uuid.uuid4().hex[:6]}.db"), "events_topic": topic,
               "versions_topic": topic + "-versions", "partitions": 3, "embedded_poll_interval_ms": 5,
               **(bus or {})}
    ingest_cfg = {"poll_timeout_s": 0.2, "batch_max_wait_ms": 20, "retry_backoff_s": 0.2, **(ingest or {})}
    return load_settings(var_dir=str(tmp_path / "var"), bus=bus_cfg, db={"url": db_url}, ingest=ingest_cfg)


def completion(cid: str, *, version: str = "v1", ts: datetime = T0, caller: str = "key-a",
               bucket: str | None = "affine", text: str = "x*2+1\n", latency_ms: float = 12.5,
               **extra) -> CompletionEvent:
    n = len(text)
    fields = dict(completion_id=cid, caller=caller, model="tiny-coder", version=version,
                  prompt="# f(0)=1 f(1)=3\ndef f(x): return ", completion=text,
                  prompt_token_ids=[35, 32, 102, 40], completion_token_ids=list(range(7, 7 + n)),
                  logprobs=[-0.25] * n, sampling_logprobs=[-0.5] * n,
                  sampling=SamplingRecord(temperature=0.7, top_p=0.9, max_tokens=16), latency_ms=latency_ms,
                  task_bucket=bucket, ts=ts)
    fields.update(extra)
    return CompletionEvent(**fields)


def feedback(cid: str, signal: str = "accept", *, ts: datetime = T0 + timedelta(seconds=5),
             version: str = "v1", caller: str = "key-a", kept_text: str | None = None, **extra) -> FeedbackEvent:
    if signal == "edit" and kept_text is None:
        kept_text = "x*2 + 1\n"
    return FeedbackEvent(completion_id=cid, caller=caller, version=version, signal=signal, kept_text=kept_text,
                         ts=ts, **extra)


def send(settings, items: Iterable, topic: str | None = None) -> None:
    """Publish events (keyed by completion id) or raw ``(key, bytes)`` pairs, then flush."""
    from realtime_rl.bus import open_producer

    topic = topic or settings.bus.events_topic
    with open_producer(settings.bus) as producer:
        for item in items:
            if isinstance(item, tuple):
                producer.send(topic, item[1], key=item[0])
            else:
                key = getattr(item, "completion_id", None)
                producer.send(topic, item.to_bytes(), key=key.encode() if key else None)
        producer.flush()


def counts(url: str, *tables: str) -> dict[str, int]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return {t: conn.execute(sa.text(f"SELECT COUNT(*) FROM {t}")).scalar_one() for t in tables}
    finally:
        engine.dispose()


def rows(url: str, sql: str, **params) -> list[sa.Row]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text(sql), params))
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request, tmp_path: Path) -> str:
    """The same test on SQLite (a file) and on a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'feedback.db'}"
    return request.getfixturevalue("postgres_url")
