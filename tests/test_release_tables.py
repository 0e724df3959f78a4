"""The updater's tables: the Alembic revision creates exactly what the models declare."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

import realtime_rl.release_tables  # noqa: F401  (registers the tables on the shared metadata)
from realtime_rl.database import make_engine
from realtime_rl.schema import downgrade, upgrade
from realtime_rl.tables import Base

MINE = {"update_runs", "releases", "baselines", "updater_locks"}


def _diff(url: str) -> list:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return [d for d in compare_metadata(ctx, Base.metadata)
                    if MINE & {str(getattr(x, "name", "")) for x in _flat(d)}]
    finally:
        engine.dispose()


def _flat(d):
    for x in (d if isinstance(d, list | tuple) else [d]):
        if isinstance(x, list | tuple):
            yield from _flat(x)
        else:
            yield getattr(x, "table", x)
            yield x


def _tables(url: str) -> set[str]:
    import sqlalchemy as sa

    engine = make_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _check(url: str) -> None:
    upgrade(url)
    assert _tables(url) >= MINE
    assert _diff(url) == []
    downgrade(url, "0002")
    assert not MINE & _tables(url)
    upgrade(url)
    assert _tables(url) >= MINE


def test_migration_matches_models_sqlite(tmp_path):
    _check(f"sqlite:///{tmp_path / 'm.db'}")


@pytest.mark.postgres
def test_migration_matches_models_postgres(postgres_url):
    _check(postgres_url)
