"""Alembic revisions up and down on SQLite and PostgreSQL; models and migrations agree; `rtrl db` works
from any directory."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from realtime_rl import schema, tables
from realtime_rl.analytics import VIEWS
from realtime_rl.config import DatabaseSettings
from tests import ingest_fixtures

db_url = ingest_fixtures.db_url  # the fixture: SQLite and PostgreSQL

OURS = {t.name for t in tables.Base.metadata.sorted_tables if t.name in {
    "completions", "feedback", "pending_feedback", "training_examples", "model_versions", "model_version_actions",
    "dead_letters", "consumer_offsets"}}


def _inspect(url: str) -> tuple[set[str], set[str]]:
    engine = sa.create_engine(url)
    try:
        insp = sa.inspect(engine)
        return set(insp.get_table_names()), set(insp.get_view_names())
    finally:
        engine.dispose()


def test_up_and_down_step_by_step(db_url: str) -> None:
    schema.upgrade(db_url, "0001")
    found, views = _inspect(db_url)
    assert found >= OURS and not views & set(VIEWS)
    schema.upgrade(db_url, "0002")
    found, views = _inspect(db_url)
    assert set(VIEWS) <= views
    schema.downgrade(db_url, "0001")
    found, views = _inspect(db_url)
    assert found >= OURS and not views & set(VIEWS)
    schema.downgrade(db_url, "base")
    found, views = _inspect(db_url)
    assert not found & OURS and not views
    schema.upgrade(db_url, "head")  # and back up again, all the way
    found, views = _inspect(db_url)
    assert found >= OURS and set(VIEWS) <= views


def test_models_match_the_migrations(db_url: str) -> None:
    schema.upgrade(db_url, "head")
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            diffs = compare_metadata(ctx, tables.Base.metadata)
    finally:
        engine.dispose()

    def table_of(diff) -> str:
        kind, *args = diff[0] if isinstance(diff, list) else diff  # modify_* diffs come grouped
        if kind in ("add_column", "remove_column") or kind.startswith("modify_"):
            return args[1]  # (schema, table name, ...)
        obj = args[0]
        return obj.name if isinstance(obj, sa.Table) else obj.table.name

    ours = [d for d in diffs if table_of(d) in OURS]
    assert ours == []


def test_views_survive_a_round_trip_of_their_revision_with_data_kept(tmp_path: Path, db_url: str) -> None:
    from realtime_rl.ingest import Ingester
    from tests.ingest_fixtures import completion, feedback, make_settings, rows, send

    s = make_settings(tmp_path, db_url)
    send(s, [completion("c1"), feedback("c1", "accept"), completion("c2"), feedback("c2", "reject")])
    ing = Ingester(s)
    ing.drain(timeout_s=30)
    ing.close()
    schema.downgrade(db_url, "0001")
    schema.upgrade(db_url, "head")
    assert [tuple(r) for r in rows(db_url, "SELECT version, n_feedback, n_accept FROM v_accept_rate_by_version")] \
        == [("v1", 2, 1)]


def test_ingester_refuses_a_stale_schema_without_auto_migrate(tmp_path: Path) -> None:
    db = DatabaseSettings(url=f"sqlite:///{tmp_path / 'x.db'}", auto_migrate=False)
    with pytest.raises(schema.SchemaNotReady, match="rtrl db upgrade"):
        schema.ensure_schema(db)
    schema.upgrade(db)
    schema.ensure_schema(db)  # now at head: fine


@pytest.mark.postgres
def test_analyst_role_sees_views_only(postgres_url: str) -> None:
    schema.upgrade(postgres_url, "head")
    engine = sa.create_engine(postgres_url)
    try:
        with engine.connect() as conn:
            def can(obj: str) -> bool:
                return conn.execute(sa.text("SELECT has_table_privilege('rtrl_analyst', :o, 'SELECT')"),
                                    {"o": obj}).scalar_one()
            assert all(can(v) for v in VIEWS)
            assert not can("completions") and not can("training_examples")
    finally:
        engine.dispose()


def _collations(url: str) -> dict[tuple[str, str], str | None]:
    return {(t, c): coll for t, c, coll in ingest_fixtures.rows(url, """
        SELECT table_name, column_name, collation_name FROM information_schema.columns
        WHERE table_schema = current_schema() AND data_type = 'character varying'""") if t in OURS}


@pytest.mark.postgres
def test_id_columns_compare_bytewise_on_postgresql_up_and_down(tmp_path: Path, postgres_url: str) -> None:
    """Revision 0101 gives exactly the models' ``IdC`` columns ``COLLATE "C"`` (Alembic's model comparison
    does not look at collations), keeps the views and their grants, and its downgrade restores the
    database default; rows ingested before the change read back the same."""
    from sqlalchemy.dialects import postgresql

    from realtime_rl.ingest import Ingester
    from tests.ingest_fixtures import completion, feedback, make_settings, rows, send

    wanted = {(table.name, col.name) for table in tables.Base.metadata.sorted_tables if table.name in OURS
              for col in table.c if getattr(col.type.dialect_impl(postgresql.dialect()), "collation", None) == "C"}
    assert {c for _, c in wanted} == {"completion_id", "event_id"} and len(wanted) == 6

    schema.upgrade(postgres_url, "0100")
    before = _collations(postgres_url)
    assert not {k for k, v in before.items() if v == "C"}
    schema.upgrade(postgres_url, "head")
    s = make_settings(tmp_path, postgres_url)
    send(s, [completion("c-2"), completion("c-10"), feedback("c-10", "accept"), feedback("c-2", "reject")])
    ing = Ingester(s)
    ing.drain(timeout_s=30)
    ing.close()
    after = _collations(postgres_url)
    assert {k for k, v in after.items() if v == "C"} == wanted
    assert {k: v for k, v in after.items() if k not in wanted} == {k: v for k, v in before.items() if k not in wanted}
    assert set(VIEWS) <= _inspect(postgres_url)[1]
    test_analyst_role_sees_views_only(postgres_url)
    ordered = [r[0] for r in rows(postgres_url, "SELECT completion_id FROM training_examples ORDER BY completion_id")]
    assert ordered == ["c-10", "c-2"]  # bytewise ('1' < '2')

    schema.downgrade(postgres_url, "0100")
    assert _collations(postgres_url) == before
    assert set(VIEWS) <= _inspect(postgres_url)[1]
    assert [tuple(r) for r in rows(postgres_url, "SELECT version, n_feedback, n_accept FROM v_accept_rate_by_version")] \
        == [("v1", 2, 1)]

def test_rtrl_db_commands_work_from_any_directory(tmp_path: Path) -> None:
    elsewhere = tmp_path / "somewhere" / "else"
    elsewhere.mkdir(parents=True)
    url = f"sqlite:///{tmp_path / 'db' / 'feedback.db'}"
    env = {**os.environ, "RTRL_DB__URL": url}
    env.pop("RTRL_CONFIG", None)

    def rtrl(*args: str) -> str:
        done = subprocess.run(["rtrl", "db", *args], cwd=elsewhere, env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "at base" in rtrl("current")
    head = schema.head_revision()
    assert f"at {head}" in rtrl("upgrade")
    assert _inspect(url)[0] >= OURS
    rtrl("downgrade", "base")
    assert not _inspect(url)[0] & OURS
    assert not list(elsewhere.iterdir())  # nothing written into the working directory
