"""Dead letters: listing them, and replaying them onto the bus once the cause is fixed.

Replay re-publishes the stored raw bytes (and key) to the topic they came from; the ingester then
treats them like any other record: accepted now, or dead-lettered again as a new row. A letter is
marked ``replayed_at`` only after the bus acknowledged it, so a crash during replay can at worst
publish a letter twice, which ingestion absorbs (rows are idempotent on the event id). A letter
whose raw bytes were truncated on storage (``raw_size`` larger than what was kept) is not replayed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import sqlalchemy as sa

from realtime_rl import tables as t
from realtime_rl.bus import BusProducer


@dataclass(frozen=True)
class DeadLetterInfo:
    id: int
    topic: str
    partition: int
    offset: int
    reason: str
    detail: str
    raw_size: int
    created_at: datetime
    replayed_at: datetime | None
    preview: str

    def as_dict(self) -> dict:
        return {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in self.__dict__.items()}


@dataclass
class ReplayResult:
    replayed: list[int]
    skipped: dict[int, str]


def _preview(raw: bytes, width: int = 80) -> str:
    text = raw[:width * 2].decode("utf-8", errors="replace")
    text = text.replace("\n", "\\n")
    return text[:width] + ("..." if len(raw) > width else "")


def list_dead_letters(engine: sa.Engine, *, limit: int = 50, reason: str | None = None,
                      include_replayed: bool = False, ids: Sequence[int] | None = None) -> list[DeadLetterInfo]:
    d = t.dead_letters
    q = sa.select(d).order_by(d.c.id.desc()).limit(limit)
    if reason:
        q = q.where(d.c.reason == reason)
    if not include_replayed:
        q = q.where(d.c.replayed_at.is_(None))
    if ids:
        q = q.where(d.c.id.in_(list(ids)))
    with engine.connect() as conn:
        rows = conn.execute(q).mappings().all()
    return [DeadLetterInfo(r["id"], r["topic"], r["partition"], r["offset"], r["reason"], r["detail"],
                           r["raw_size"], r["created_at"], r["replayed_at"], _preview(r["raw"])) for r in rows]


def replay(engine: sa.Engine, producer: BusProducer, *, ids: Sequence[int] | None = None,
           reason: str | None = None, limit: int = 1000) -> ReplayResult:
    """Re-publish unreplayed dead letters (all, or ``ids``, or those with ``reason``); oldest first."""
    d = t.dead_letters
    q = sa.select(d.c.id, d.c.topic, d.c.key, d.c.raw, d.c.raw_size).where(d.c.replayed_at.is_(None))
    if ids:
        q = q.where(d.c.id.in_(list(ids)))
    if reason:
        q = q.where(d.c.reason == reason)
    with engine.connect() as conn:
        rows = conn.execute(q.order_by(d.c.id).limit(limit)).all()
    result = ReplayResult([], {})
    if ids:
        found = {r.id for r in rows}
        for missing in sorted(set(ids) - found):
            result.skipped[missing] = "no such unreplayed dead letter"
    for row in rows:
        if row.raw_size > len(row.raw):
            result.skipped[row.id] = f"raw bytes were truncated on storage ({len(row.raw)} of {row.raw_size})"
            continue
        producer.send(row.topic, row.raw, key=row.key)
        result.replayed.append(row.id)
    if not result.replayed:
        return result
    producer.flush()  # raises BusUnavailable: nothing is marked then
    with engine.begin() as conn:
        conn.execute(sa.update(d).where(d.c.id.in_(result.replayed)).values(replayed_at=datetime.now(UTC)))
    return result
