"""Summarised agent sessions: ``completions.session`` (JSON, nullable).

The gateway's chat ``session`` extension summarises a long conversation when it outgrows its context
budget; each completion of such a session records which context it was written in, the completion id
of the summary that context started from, and whether it is itself a summary
(``realtime_rl.events.SessionRecord``). NULL outside sessions. Downgrading drops the column.

Revision ID: 0103
Revises: 0102
Create Date: 2026-12-06 22:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0103"
down_revision: str | Sequence[str] | None = "0102"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("completions", sa.Column("session", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("completions", "session")
