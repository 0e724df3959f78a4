"""Real-time updater tables: update_runs, releases (gate decisions), baselines, updater_locks.

Models: ``realtime_rl.release_tables`` (same metadata as ``realtime_rl.tables``).

Revision ID: 0100
Revises: 0002
Create Date: 2026-12-01 08:29:43.032627
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0100'
down_revision: str | Sequence[str] | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('baselines',
    sa.Column('bucket', sa.String(length=128), nullable=False),
    sa.Column('reward_sum', sa.Float(), nullable=False),
    sa.Column('count', sa.Float(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('bucket', name=op.f('pk_baselines'))
    )
    op.create_table('releases',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=128), nullable=False),
    sa.Column('candidate_version', sa.String(length=128), nullable=False),
    sa.Column('parent_version', sa.String(length=128), nullable=True),
    sa.Column('decision', sa.String(length=16), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('offline_pass_at_1', sa.Float(), nullable=True),
    sa.Column('production_pass_at_1', sa.Float(), nullable=True),
    sa.Column('ope_estimate', sa.Float(), nullable=True),
    sa.Column('ope_ci_low', sa.Float(), nullable=True),
    sa.Column('ope_ci_high', sa.Float(), nullable=True),
    sa.Column('production_accept_rate', sa.Float(), nullable=True),
    sa.Column('gate', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_releases'))
    )
    with op.batch_alter_table('releases', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_releases_candidate_version'), ['candidate_version'], unique=False)
        batch_op.create_index(batch_op.f('ix_releases_created_at'), ['created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_releases_run_id'), ['run_id'], unique=False)

    op.create_table('update_runs',
    sa.Column('run_id', sa.String(length=128), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('production_version', sa.String(length=128), nullable=True),
    sa.Column('candidate_version', sa.String(length=128), nullable=True),
    sa.Column('fingerprint', sa.String(length=64), nullable=True),
    sa.Column('data_since', sa.DateTime(timezone=True), nullable=True),
    sa.Column('data_until', sa.DateTime(timezone=True), nullable=True),
    sa.Column('n_train', sa.Integer(), nullable=False),
    sa.Column('n_heldout', sa.Integer(), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('metrics', sa.JSON(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('run_id', name=op.f('pk_update_runs'))
    )
    with op.batch_alter_table('update_runs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_update_runs_fingerprint'), ['fingerprint'], unique=False)
        batch_op.create_index(batch_op.f('ix_update_runs_finished_at'), ['finished_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_update_runs_status'), ['status'], unique=False)

    op.create_table('updater_locks',
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('holder', sa.String(length=255), nullable=False),
    sa.Column('pid', sa.Integer(), nullable=False),
    sa.Column('hostname', sa.String(length=255), nullable=False),
    sa.Column('acquired_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_updater_locks'))
    )


def downgrade() -> None:
    op.drop_table('updater_locks')
    with op.batch_alter_table('update_runs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_update_runs_status'))
        batch_op.drop_index(batch_op.f('ix_update_runs_finished_at'))
        batch_op.drop_index(batch_op.f('ix_update_runs_fingerprint'))

    op.drop_table('update_runs')
    with op.batch_alter_table('releases', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_releases_run_id'))
        batch_op.drop_index(batch_op.f('ix_releases_created_at'))
        batch_op.drop_index(batch_op.f('ix_releases_candidate_version'))

    op.drop_table('releases')
    op.drop_table('baselines')
