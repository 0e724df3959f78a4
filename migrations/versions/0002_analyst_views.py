"""Read-only analyst views over the feedback tables (the documented view layer).

Analysts query these views, never the base tables (whose layout may change with the ingester):

- ``v_feedback_latest``: one row per completion that has feedback, with its newest judgement:
  completion_id, model, version, caller, task_bucket, completion, finish_reason, latency_ms,
  completion_at, day (UTC date of the completion), signal, kept_text, score, comment, feedback_at,
  feedback_count, accepted / edited / rejected (0 or 1).
- ``v_accept_rate_by_version`` / ``v_accept_rate_by_day`` (day, version) /
  ``v_accept_rate_by_bucket`` (task_bucket, version; a missing bucket shows as ``(none)``):
  n_feedback, n_accept, n_edit, n_reject, accept_rate, edit_rate, reject_rate. Rates are over
  completions with feedback, using each completion's newest judgement only.
- ``v_latency_by_version``: every served completion (with or without feedback): n_completions,
  mean_latency_ms, max_latency_ms, first_completion_at, last_completion_at (quantiles: the pandas
  loaders in ``realtime_rl.analytics``).
- ``v_completions``: every served completion without token arrays: completion_id, model, version,
  caller, task_bucket, finish_reason, latency_ms, completion_at, day, has_feedback (0 or 1).
- ``v_kept_edits``: edit judgements with the served completion and the text the user kept.
- ``v_model_versions``: the registry's versions as ingested: version, model, parent, sha256,
  last_action, last_channel, created_at, updated_at.
- ``v_dead_letter_summary``: dead letters per reason: n, n_replayed, first_at, last_at.

On PostgreSQL the views are granted to a ``rtrl_analyst`` role (created NOLOGIN when the migrating
user may create roles): grant it to analysts' logins so they see the views and nothing else.
``realtime_rl.analytics.connect_readonly`` opens read-only sessions on either database.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 09:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ANALYST_ROLE = "rtrl_analyst"

_RATES = """
    COUNT(*) AS n_feedback,
    SUM(accepted) AS n_accept,
    SUM(edited) AS n_edit,
    SUM(rejected) AS n_reject,
    AVG(CAST(accepted AS FLOAT)) AS accept_rate,
    AVG(CAST(edited AS FLOAT)) AS edit_rate,
    AVG(CAST(rejected AS FLOAT)) AS reject_rate"""


def _views(dialect: str) -> dict[str, str]:
    day = ("CAST((c.created_at AT TIME ZONE 'UTC') AS DATE)" if dialect == "postgresql"
           else "date(c.created_at)")
    return {
        "v_feedback_latest": f"""
SELECT c.completion_id, c.model, c.version, c.caller, c.task_bucket, c.completion, c.finish_reason,
       c.latency_ms, c.created_at AS completion_at, {day} AS day,
       f.signal, f.kept_text, f.score, f.comment, f.created_at AS feedback_at,
       (SELECT COUNT(*) FROM feedback h WHERE h.completion_id = c.completion_id) AS feedback_count,
       CASE WHEN f.signal = 'accept' THEN 1 ELSE 0 END AS accepted,
       CASE WHEN f.signal = 'edit' THEN 1 ELSE 0 END AS edited,
       CASE WHEN f.signal = 'reject' THEN 1 ELSE 0 END AS rejected
FROM completions c JOIN feedback f ON f.completion_id = c.completion_id AND f.is_latest""",
        "v_accept_rate_by_version": f"""
SELECT version, {_RATES},
       MIN(completion_at) AS first_completion_at, MAX(completion_at) AS last_completion_at
FROM v_feedback_latest GROUP BY version""",
        "v_accept_rate_by_day": f"SELECT day, version, {_RATES}\nFROM v_feedback_latest GROUP BY day, version",
        "v_accept_rate_by_bucket": f"""
SELECT COALESCE(task_bucket, '(none)') AS task_bucket, version, {_RATES}
FROM v_feedback_latest GROUP BY COALESCE(task_bucket, '(none)'), version""",
        "v_latency_by_version": """
SELECT version, COUNT(*) AS n_completions, AVG(latency_ms) AS mean_latency_ms,
       MAX(latency_ms) AS max_latency_ms, MIN(created_at) AS first_completion_at,
       MAX(created_at) AS last_completion_at
FROM completions GROUP BY version""",
        "v_completions": f"""
SELECT c.completion_id, c.model, c.version, c.caller, c.task_bucket, c.finish_reason, c.latency_ms,
       c.created_at AS completion_at, {day} AS day,
       CASE WHEN EXISTS (SELECT 1 FROM feedback f WHERE f.completion_id = c.completion_id) THEN 1 ELSE 0 END
         AS has_feedback
FROM completions c""",
        "v_model_versions": """
SELECT version, model, parent, sha256, last_action, last_channel, created_at, updated_at FROM model_versions""",
        "v_kept_edits": """
SELECT completion_id, version, task_bucket, completion, kept_text, feedback_at
FROM v_feedback_latest WHERE signal = 'edit' AND kept_text IS NOT NULL""",
        "v_dead_letter_summary": """
SELECT reason, COUNT(*) AS n, COUNT(replayed_at) AS n_replayed, MIN(created_at) AS first_at,
       MAX(created_at) AS last_at
FROM dead_letters GROUP BY reason""",
    }


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    views = _views(dialect)
    for name, body in views.items():
        op.execute(f"CREATE VIEW {name} AS {body}")
    if dialect == "postgresql":
        # Roles are cluster-wide: create it only if absent and allowed; racing migrations are harmless.
        op.execute(f"""
DO $$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ANALYST_ROLE}') THEN
    BEGIN CREATE ROLE {ANALYST_ROLE} NOLOGIN;
    EXCEPTION WHEN duplicate_object OR unique_violation OR insufficient_privilege THEN NULL;
    END;
  END IF;
  IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ANALYST_ROLE}') THEN
    EXECUTE 'GRANT SELECT ON {", ".join(views)} TO {ANALYST_ROLE}';
  END IF;
END $$""")


def downgrade() -> None:
    # Dependent views first; dropping a view drops its grants. The role stays (other databases).
    for name in reversed(list(_views(op.get_bind().dialect.name))):
        op.execute(f"DROP VIEW IF EXISTS {name}")
