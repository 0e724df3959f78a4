"""Alembic environment: the URL comes from the caller (``rtrl db``) or from rtrl's settings.

``realtime_rl.schema`` passes either an open connection (``config.attributes["connection"]``) or a
URL (``config.attributes["url"]``); run through the plain ``alembic`` command, the URL is taken from
``load_settings().db.url`` (rtrl.toml / ``RTRL_DB__URL``), so no URL is ever written to a file.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from realtime_rl.tables import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.attributes.get("url")
    if url:
        return url
    from rtrl.config import load_settings

    return load_settings().db.url.get_secret_value()


def _configure_and_run(connection: sa.Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things in place; batch mode rebuilds tables for later revisions.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure_and_run(connection)
        return
    engine = sa.create_engine(_url(), poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            _configure_and_run(conn)
            conn.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
