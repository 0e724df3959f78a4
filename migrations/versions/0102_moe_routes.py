"""Mixture-of-experts routes: ``routes`` (a route record, JSON) replaces the unused ``expert_ids``.

``completions`` and ``training_examples`` carried an ``expert_ids`` JSON column (a list of id lists)
that nothing wrote or read. Router replay needs every consumed position's experts in every MoE layer,
in the compact wire form of ``policy.routes`` (``{"shape": [T, L, K], "experts": E, "data":
base64}``), so the column is replaced by ``routes``. Downgrading drops the route records (the old
column cannot hold them) and restores an empty ``expert_ids``.

Revision ID: 0102
Revises: 0101
Create Date: 2026-12-04 16:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0102"
down_revision: str | Sequence[str] | None = "0101"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("completions", "training_examples")


def upgrade() -> None:
    for table in TABLES:
        op.drop_column(table, "expert_ids")
        op.add_column(table, sa.Column("routes", sa.JSON(), nullable=True))


def downgrade() -> None:
    for table in TABLES:
        op.drop_column(table, "routes")
        op.add_column(table, sa.Column("expert_ids", sa.JSON(), nullable=True))
