"""The feedback tables (SQLAlchemy 2 models), written by the ingester and read by updaters and analysts.

Types work on SQLite and PostgreSQL alike: JSON via ``sqlalchemy.JSON``, raw bytes via
``LargeBinary``, timestamps as timezone-aware UTC (SQLite stores them as naive UTC text).
The schema itself is created by the Alembic revisions in ``migrations/``; a test checks that these
models and the migrations agree. Indexes are few on purpose: every one costs the ingester on every
row; the analyst views aggregate whole tables and need none beyond the keys.

- ``completions``: one row per served completion (idempotent on ``event_id`` and ``completion_id``).
- ``feedback``: every feedback event, history kept; ``is_latest`` marks the newest per completion
  (newest by the event's own timestamp, ties broken by event id, so arrival order does not matter).
- ``pending_feedback``: completions that have feedback but whose completion event has not arrived.
- ``training_examples``: the join an updater reads, one row per completion with feedback, updated
  in place when newer feedback arrives (``updated_at`` moves forward, ``feedback_count`` grows).
- ``model_versions`` + ``model_version_actions``: the registry's publish/promote/rollback history.
- ``dead_letters``: undecodable, schema-invalid, oversized or database-rejected events, raw bytes kept.
- ``consumer_offsets``: next offset per (group, topic, partition), written in the same transaction
  as the rows those offsets produced (that is what makes ingestion exactly-once in effect).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL gets a 64-bit identity.
BigId = BigInteger().with_variant(Integer(), "sqlite")
Timestamp = DateTime(timezone=True)
NullableJSON = JSON(none_as_null=True)
"""A missing array is SQL NULL (not the JSON text ``null``), whichever path wrote the row."""
Id = String(128)
IdC = String(128).with_variant(String(128, collation="C"), "postgresql")
"""The ingester's indexed ids: bytewise comparison on PostgreSQL (revision 0101; SQLite's text is
bytewise already). Their unique indexes take every ingested row; the locale's ``strcoll`` was a
visible share of the server's CPU per event."""


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Completion(Base):
    __tablename__ = "completions"

    completion_id: Mapped[str] = mapped_column(IdC, primary_key=True)
    event_id: Mapped[str] = mapped_column(IdC, unique=True)
    caller: Mapped[str] = mapped_column(Id)
    model: Mapped[str] = mapped_column(Id)
    version: Mapped[str] = mapped_column(Id)
    prompt: Mapped[str] = mapped_column(Text)
    completion: Mapped[str] = mapped_column(Text)
    prompt_token_ids: Mapped[list[int]] = mapped_column(JSON)
    completion_token_ids: Mapped[list[int]] = mapped_column(JSON)
    logprobs: Mapped[list[float]] = mapped_column(JSON)
    sampling_logprobs: Mapped[list[float] | None] = mapped_column(NullableJSON, nullable=True)
    routes: Mapped[dict[str, Any] | None] = mapped_column(NullableJSON, nullable=True)
    session: Mapped[dict[str, Any] | None] = mapped_column(NullableJSON, nullable=True)
    sampling: Mapped[dict[str, Any]] = mapped_column(JSON)
    finish_reason: Mapped[str] = mapped_column(String(32))
    latency_ms: Mapped[float] = mapped_column(Float)
    task_bucket: Mapped[str | None] = mapped_column(Id, nullable=True)
    choice_index: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(Timestamp)
    ingested_at: Mapped[datetime] = mapped_column(Timestamp)


class Feedback(Base):
    __tablename__ = "feedback"
    __table_args__ = (Index("ix_feedback_completion_order", "completion_id", "created_at", "event_id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    event_id: Mapped[str] = mapped_column(IdC, unique=True)
    completion_id: Mapped[str] = mapped_column(IdC)
    caller: Mapped[str] = mapped_column(Id)
    version: Mapped[str] = mapped_column(Id)
    signal: Mapped[str] = mapped_column(String(16))
    kept_text: Mapped[str | None] = mapped_column(Text, nullable=True)
    score: Mapped[float | None] = mapped_column(Float, nullable=True)
    comment: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(Timestamp)
    ingested_at: Mapped[datetime] = mapped_column(Timestamp)
    is_latest: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class PendingFeedback(Base):
    __tablename__ = "pending_feedback"

    completion_id: Mapped[str] = mapped_column(IdC, primary_key=True)
    first_seen_at: Mapped[datetime] = mapped_column(Timestamp, index=True)


class TrainingExample(Base):
    __tablename__ = "training_examples"

    completion_id: Mapped[str] = mapped_column(IdC, primary_key=True)
    version: Mapped[str] = mapped_column(Id)
    model: Mapped[str] = mapped_column(Id)
    caller: Mapped[str] = mapped_column(Id)
    task_bucket: Mapped[str | None] = mapped_column(Id, nullable=True)
    prompt_token_ids: Mapped[list[int]] = mapped_column(JSON)
    completion_token_ids: Mapped[list[int]] = mapped_column(JSON)
    logprobs: Mapped[list[float]] = mapped_column(JSON)
    sampling_logprobs: Mapped[list[float] | None] = mapped_column(NullableJSON, nullable=True)
    routes: Mapped[dict[str, Any] | None] = mapped_column(NullableJSON, nullable=True)
    sampling: Mapped[dict[str, Any]] = mapped_column(JSON)
    signal: Mapped[str] = mapped_column(String(16))
    kept_text: Mapped[str | None] = mapped_column(Text, nullable=True)
    score: Mapped[float | None] = mapped_column(Float, nullable=True)
    feedback_event_id: Mapped[str] = mapped_column(Id)
    feedback_count: Mapped[int] = mapped_column(Integer)
    feedback_at: Mapped[datetime] = mapped_column(Timestamp, index=True)  # updaters read time windows
    completion_at: Mapped[datetime] = mapped_column(Timestamp)
    updated_at: Mapped[datetime] = mapped_column(Timestamp, index=True)  # "what changed since" polling


class ModelVersion(Base):
    __tablename__ = "model_versions"

    version: Mapped[str] = mapped_column(Id, primary_key=True)
    model: Mapped[str] = mapped_column(Id)
    parent: Mapped[str | None] = mapped_column(Id, nullable=True)
    sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    metrics: Mapped[dict[str, float]] = mapped_column(JSON)
    last_action: Mapped[str] = mapped_column(String(16))
    last_channel: Mapped[str | None] = mapped_column(String(32), nullable=True)
    created_at: Mapped[datetime] = mapped_column(Timestamp)
    updated_at: Mapped[datetime] = mapped_column(Timestamp)


class ModelVersionAction(Base):
    __tablename__ = "model_version_actions"
    __table_args__ = (Index("ix_model_version_actions_version_order", "version", "created_at", "event_id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    event_id: Mapped[str] = mapped_column(Id, unique=True)
    version: Mapped[str] = mapped_column(Id)
    model: Mapped[str] = mapped_column(Id)
    action: Mapped[str] = mapped_column(String(16))
    channel: Mapped[str | None] = mapped_column(String(32), nullable=True)
    parent: Mapped[str | None] = mapped_column(Id, nullable=True)
    sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    metrics: Mapped[dict[str, float]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(Timestamp)
    ingested_at: Mapped[datetime] = mapped_column(Timestamp)


class DeadLetter(Base):
    __tablename__ = "dead_letters"
    __table_args__ = (Index("ix_dead_letters_position", "topic", "partition", "offset"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    topic: Mapped[str] = mapped_column(String(255))
    partition: Mapped[int] = mapped_column(Integer)
    offset: Mapped[int] = mapped_column(BigInteger)
    key: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    raw: Mapped[bytes] = mapped_column(LargeBinary)
    raw_size: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(String(32), index=True)
    detail: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(Timestamp, index=True)
    replayed_at: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)


class ConsumerOffset(Base):
    __tablename__ = "consumer_offsets"

    group_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    topic: Mapped[str] = mapped_column(String(255), primary_key=True)
    partition: Mapped[int] = mapped_column(Integer, primary_key=True)
    next_offset: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(Timestamp)


completions = Completion.__table__
feedback = Feedback.__table__
pending_feedback = PendingFeedback.__table__
training_examples = TrainingExample.__table__
model_versions = ModelVersion.__table__
model_version_actions = ModelVersionAction.__table__
dead_letters = DeadLetter.__table__
consumer_offsets = ConsumerOffset.__table__
