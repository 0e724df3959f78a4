"""Tables of the real-time updater: runs, release decisions, the per-bucket baseline, the updater lock.

They share ``realtime_rl.tables.Base`` (same metadata and naming convention) so that one Alembic
history covers the whole feedback database; the revision is ``migrations/versions/*_releases.py``.

- ``update_runs``: one row per scheduled/manual cycle (skipped ones too), with what it trained on.
- ``releases``: one row per gate decision on a candidate: the numbers the gate saw and the reason.
- ``baselines``: running reward sum and count per task bucket (the REINFORCE baseline b).
- ``updater_locks``: the SQLite lock row (PostgreSQL uses ``pg_try_advisory_lock`` instead).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Float, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from realtime_rl.tables import Base, BigId, Id, Timestamp


class UpdateRun(Base):
    __tablename__ = "update_runs"

    run_id: Mapped[str] = mapped_column(Id, primary_key=True)
    status: Mapped[str] = mapped_column(String(16), index=True)  # skipped | released | refused | canary | failed
    production_version: Mapped[str | None] = mapped_column(Id, nullable=True)
    candidate_version: Mapped[str | None] = mapped_column(Id, nullable=True)
    fingerprint: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    data_since: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)
    data_until: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)
    n_train: Mapped[int] = mapped_column(Integer, default=0)
    n_heldout: Mapped[int] = mapped_column(Integer, default=0)
    reason: Mapped[str] = mapped_column(Text, default="")
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    started_at: Mapped[datetime] = mapped_column(Timestamp)
    finished_at: Mapped[datetime] = mapped_column(Timestamp, index=True)


class Release(Base):
    __tablename__ = "releases"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(Id, index=True)
    candidate_version: Mapped[str] = mapped_column(Id, index=True)
    parent_version: Mapped[str | None] = mapped_column(Id, nullable=True)
    decision: Mapped[str] = mapped_column(String(16))  # released | refused | canary
    reason: Mapped[str] = mapped_column(Text)
    offline_pass_at_1: Mapped[float | None] = mapped_column(Float, nullable=True)
    production_pass_at_1: Mapped[float | None] = mapped_column(Float, nullable=True)
    ope_estimate: Mapped[float | None] = mapped_column(Float, nullable=True)
    ope_ci_low: Mapped[float | None] = mapped_column(Float, nullable=True)
    ope_ci_high: Mapped[float | None] = mapped_column(Float, nullable=True)
    production_accept_rate: Mapped[float | None] = mapped_column(Float, nullable=True)
    gate: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(Timestamp, index=True)


class BucketBaseline(Base):
    __tablename__ = "baselines"

    bucket: Mapped[str] = mapped_column(Id, primary_key=True)
    reward_sum: Mapped[float] = mapped_column(Float)
    count: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[datetime] = mapped_column(Timestamp)


class UpdaterLock(Base):
    __tablename__ = "updater_locks"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    holder: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    hostname: Mapped[str] = mapped_column(String(255))
    acquired_at: Mapped[datetime] = mapped_column(Timestamp)


update_runs = UpdateRun.__table__
releases = Release.__table__
baselines = BucketBaseline.__table__
updater_locks = UpdaterLock.__table__
