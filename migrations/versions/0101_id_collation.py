"""PostgreSQL: the ingester's indexed id columns compare bytewise (``COLLATE "C"``).

Every row the ingester writes goes into unique indexes on text ids (completions: completion_id,
event_id; feedback: event_id and the (completion_id, ...) order index; training_examples and
pending_feedback: completion_id). Under the database's default collation each comparison in those
B-trees goes through the C library's locale-aware ``strcoll`` (a ``C.UTF-8`` or ``en_US.UTF-8``
database is not the "C" collation to PostgreSQL); ``"C"`` compares bytes. Equality is unchanged
(byte-equal strings, as before), and so is order in a ``C.UTF-8`` database (code-point order, which
is byte order in UTF-8); in other locales ``ORDER BY`` these ids becomes byte order.

A column used by a view cannot change collation in place, so the analyst views are dropped and
re-created (with their grants) by revision 0002's own functions. SQLite compares text bytewise
already (its default ``BINARY`` collation): nothing to do there.

Revision ID: 0101
Revises: 0100
Create Date: 2026-12-01 14:40:00
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from alembic import op

revision: str = "0101"
down_revision: str | Sequence[str] | None = "0100"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID_COLUMNS = {
    "completions": ("completion_id", "event_id"),
    "feedback": ("event_id", "completion_id"),
    "pending_feedback": ("completion_id",),
    "training_examples": ("completion_id",),
}
"""The same list as ``realtime_rl.tables.IdC`` columns (a test compares models and migrations)."""


def _set_collation(collation: str) -> None:
    views = importlib.import_module("migrations.versions.0002_analyst_views")
    views.downgrade()
    for table, columns in ID_COLUMNS.items():
        changes = ", ".join(f"ALTER COLUMN {c} TYPE VARCHAR(128) COLLATE {collation}" for c in columns)
        op.execute(f"ALTER TABLE {table} {changes}")
    views.upgrade()


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _set_collation('"C"')


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _set_collation('pg_catalog."default"')
