"""Feedback tables: completions, feedback (+ pending), training_examples, model versions, dead letters, offsets.

Revision ID: 0001
Revises:
Create Date: 2026-12-01 08:28:56.250477
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0001'
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('completions',
    sa.Column('completion_id', sa.String(length=128), nullable=False),
    sa.Column('event_id', sa.String(length=128), nullable=False),
    sa.Column('caller', sa.String(length=128), nullable=False),
    sa.Column('model', sa.String(length=128), nullable=False),
    sa.Column('version', sa.String(length=128), nullable=False),
    sa.Column('prompt', sa.Text(), nullable=False),
    sa.Column('completion', sa.Text(), nullable=False),
    sa.Column('prompt_token_ids', sa.JSON(), nullable=False),
    sa.Column('completion_token_ids', sa.JSON(), nullable=False),
    sa.Column('logprobs', sa.JSON(), nullable=False),
    sa.Column('sampling_logprobs', sa.JSON(), nullable=True),
    sa.Column('expert_ids', sa.JSON(), nullable=True),
    sa.Column('sampling', sa.JSON(), nullable=False),
    sa.Column('finish_reason', sa.String(length=32), nullable=False),
    sa.Column('latency_ms', sa.Float(), nullable=False),
    sa.Column('task_bucket', sa.String(length=128), nullable=True),
    sa.Column('choice_index', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('ingested_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('completion_id', name=op.f('pk_completions')),
    sa.UniqueConstraint('event_id', name=op.f('uq_completions_event_id'))
    )

    op.create_table('consumer_offsets',
    sa.Column('group_id', sa.String(length=255), nullable=False),
    sa.Column('topic', sa.String(length=255), nullable=False),
    sa.Column('partition', sa.Integer(), nullable=False),
    sa.Column('next_offset', sa.BigInteger(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('group_id', 'topic', 'partition', name=op.f('pk_consumer_offsets'))
    )
    op.create_table('dead_letters',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('topic', sa.String(length=255), nullable=False),
    sa.Column('partition', sa.Integer(), nullable=False),
    sa.Column('offset', sa.BigInteger(), nullable=False),
    sa.Column('key', sa.LargeBinary(), nullable=True),
    sa.Column('raw', sa.LargeBinary(), nullable=False),
    sa.Column('raw_size', sa.Integer(), nullable=False),
    sa.Column('reason', sa.String(length=32), nullable=False),
    sa.Column('detail', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('replayed_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_dead_letters'))
    )
    op.create_index(op.f('ix_dead_letters_created_at'), 'dead_letters', ['created_at'], unique=False)
    op.create_index('ix_dead_letters_position', 'dead_letters', ['topic', 'partition', 'offset'], unique=False)
    op.create_index(op.f('ix_dead_letters_reason'), 'dead_letters', ['reason'], unique=False)

    op.create_table('feedback',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('event_id', sa.String(length=128), nullable=False),
    sa.Column('completion_id', sa.String(length=128), nullable=False),
    sa.Column('caller', sa.String(length=128), nullable=False),
    sa.Column('version', sa.String(length=128), nullable=False),
    sa.Column('signal', sa.String(length=16), nullable=False),
    sa.Column('kept_text', sa.Text(), nullable=True),
    sa.Column('score', sa.Float(), nullable=True),
    sa.Column('comment', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('ingested_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('is_latest', sa.Boolean(), server_default=sa.false(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_feedback')),
    sa.UniqueConstraint('event_id', name=op.f('uq_feedback_event_id'))
    )
    op.create_index('ix_feedback_completion_order', 'feedback', ['completion_id', 'created_at', 'event_id'], unique=False)

    op.create_table('model_version_actions',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('event_id', sa.String(length=128), nullable=False),
    sa.Column('version', sa.String(length=128), nullable=False),
    sa.Column('model', sa.String(length=128), nullable=False),
    sa.Column('action', sa.String(length=16), nullable=False),
    sa.Column('channel', sa.String(length=32), nullable=True),
    sa.Column('parent', sa.String(length=128), nullable=True),
    sa.Column('sha256', sa.String(length=64), nullable=True),
    sa.Column('metrics', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('ingested_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_model_version_actions')),
    sa.UniqueConstraint('event_id', name=op.f('uq_model_version_actions_event_id'))
    )
    op.create_index('ix_model_version_actions_version_order', 'model_version_actions', ['version', 'created_at', 'event_id'], unique=False)

    op.create_table('model_versions',
    sa.Column('version', sa.String(length=128), nullable=False),
    sa.Column('model', sa.String(length=128), nullable=False),
    sa.Column('parent', sa.String(length=128), nullable=True),
    sa.Column('sha256', sa.String(length=64), nullable=True),
    sa.Column('metrics', sa.JSON(), nullable=False),
    sa.Column('last_action', sa.String(length=16), nullable=False),
    sa.Column('last_channel', sa.String(length=32), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('version', name=op.f('pk_model_versions'))
    )
    op.create_table('pending_feedback',
    sa.Column('completion_id', sa.String(length=128), nullable=False),
    sa.Column('first_seen_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('completion_id', name=op.f('pk_pending_feedback'))
    )
    op.create_index(op.f('ix_pending_feedback_first_seen_at'), 'pending_feedback', ['first_seen_at'], unique=False)

    op.create_table('training_examples',
    sa.Column('completion_id', sa.String(length=128), nullable=False),
    sa.Column('version', sa.String(length=128), nullable=False),
    sa.Column('model', sa.String(length=128), nullable=False),
    sa.Column('caller', sa.String(length=128), nullable=False),
    sa.Column('task_bucket', sa.String(length=128), nullable=True),
    sa.Column('prompt_token_ids', sa.JSON(), nullable=False),
    sa.Column('completion_token_ids', sa.JSON(), nullable=False),
    sa.Column('logprobs', sa.JSON(), nullable=False),
    sa.Column('sampling_logprobs', sa.JSON(), nullable=True),
    sa.Column('expert_ids', sa.JSON(), nullable=True),
    sa.Column('sampling', sa.JSON(), nullable=False),
    sa.Column('signal', sa.String(length=16), nullable=False),
    sa.Column('kept_text', sa.Text(), nullable=True),
    sa.Column('score', sa.Float(), nullable=True),
    sa.Column('feedback_event_id', sa.String(length=128), nullable=False),
    sa.Column('feedback_count', sa.Integer(), nullable=False),
    sa.Column('feedback_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('completion_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('completion_id', name=op.f('pk_training_examples'))
    )
    op.create_index(op.f('ix_training_examples_feedback_at'), 'training_examples', ['feedback_at'], unique=False)
    op.create_index(op.f('ix_training_examples_updated_at'), 'training_examples', ['updated_at'], unique=False)



def downgrade() -> None:
    # Dropping a table drops its indexes too.
    for table in ("training_examples", "pending_feedback", "model_versions", "model_version_actions",
                  "feedback", "dead_letters", "consumer_offsets", "completions"):
        op.drop_table(table)
