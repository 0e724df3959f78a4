"""Schema migrations for the feedback database, driven through Alembic's API (`rtrl db ...`).

The script directory is located through the ``migrations`` package, so the commands work from any
working directory; the URL comes from settings and is handed to Alembic in memory, never written.
"""

from __future__ import annotations

import io

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from migrations import SCRIPT_LOCATION
from realtime_rl.config import DatabaseSettings
from realtime_rl.database import make_engine, redacted_url, url_of


class SchemaNotReady(RuntimeError):
    """The database is not at the newest revision and auto-migration is off."""


def alembic_config(db: DatabaseSettings | str, stdout: io.TextIOBase | None = None) -> Config:
    cfg = Config(stdout=stdout or io.StringIO())
    cfg.set_main_option("script_location", str(SCRIPT_LOCATION))
    cfg.attributes["url"] = url_of(db)
    return cfg


def head_revision() -> str:
    head = ScriptDirectory(str(SCRIPT_LOCATION)).get_current_head()
    assert head is not None, "migrations/versions holds no revision"
    return head


def current_revision(engine: sa.Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def _run(db: DatabaseSettings | str, fn, revision: str) -> None:
    engine = make_engine(db)
    try:
        with engine.begin() as conn:
            cfg = alembic_config(db)
            cfg.attributes["connection"] = conn
            fn(cfg, revision)
    finally:
        engine.dispose()


def upgrade(db: DatabaseSettings | str, revision: str = "head") -> None:
    _run(db, command.upgrade, revision)


def downgrade(db: DatabaseSettings | str, revision: str = "-1") -> None:
    _run(db, command.downgrade, revision)


def ensure_schema(db: DatabaseSettings) -> None:
    """Upgrade to head when ``auto_migrate`` is on; otherwise refuse a database that is behind."""
    if db.auto_migrate:
        upgrade(db)
        return
    engine = make_engine(db)
    try:
        current = current_revision(engine)
    finally:
        engine.dispose()
    if current != head_revision():
        raise SchemaNotReady(f"database {redacted_url(db)} is at revision {current or 'none'}, "
                             f"not {head_revision()}: run `rtrl db upgrade`")
