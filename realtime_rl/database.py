"""Engines for the feedback database (SQLite default, PostgreSQL in production).

SQLite is opened in WAL mode with ``synchronous=NORMAL``: a crash of the process never loses a
committed transaction, and a power cut can only lose the *latest* transactions, offsets and rows
together (the consumer offsets live in the same database), so exactly-once still holds. Writer
transactions start with ``BEGIN IMMEDIATE`` so that two writers queue on the lock instead of
failing mid-transaction, and so that savepoints work under Python's sqlite3 driver.
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from pydantic_core import from_json, to_json
from sqlalchemy.engine import make_url

from realtime_rl.config import DatabaseSettings


def url_of(db: DatabaseSettings | str) -> str:
    if isinstance(db, str):
        return db
    return db.url if isinstance(db.url, str) else db.url.get_secret_value()


def redacted_url(db: DatabaseSettings | str) -> str:
    """The URL with its password masked, for messages and logs."""
    return make_url(url_of(db)).render_as_string(hide_password=True)


def json_text(value: object) -> str:
    """Compact JSON (pydantic-core's serializer: several times faster than ``json.dumps`` on number lists)."""
    return to_json(value).decode()


# JSON columns hold token ids and log-probs; encoding them is a visible share of ingest time.
_JSON_ARGS = {"json_serializer": json_text, "json_deserializer": from_json}


def make_engine(db: DatabaseSettings | str, *, readonly: bool = False) -> sa.Engine:
    """An engine for ``db``; ``readonly`` refuses every write at the connection level."""
    settings = db if isinstance(db, DatabaseSettings) else DatabaseSettings(url=db)
    url = make_url(url_of(db))
    if url.get_backend_name() == "sqlite":
        return _sqlite_engine(url, settings, readonly)
    connect_args: dict = {}
    if url.get_backend_name() == "postgresql":
        connect_args["connect_timeout"] = settings.connect_timeout_s
        # UTC sessions: an offset-less timestamp means the same instant in SQL as in Python.
        connect_args["options"] = "-c timezone=UTC" + (" -c default_transaction_read_only=on" if readonly else "")
    return sa.create_engine(url, pool_pre_ping=True, connect_args=connect_args, **_JSON_ARGS)


SQLITE_WRITER_PRAGMAS = ("cache_size=-65536", "wal_autocheckpoint=10000", "temp_store=MEMORY")
"""Speed; what a commit guarantees is as above. ``cache_size``: 64 MiB of page cache per connection
instead of 2 MiB (the indexes on random event ids touch pages all over the file; pages are allocated
as used). ``wal_autocheckpoint``: copy the WAL back into the database every ~40 MiB instead of
every ~4 MiB: an ingest batch writes more than 4 MiB, so each commit also ran a checkpoint (copying
every page, two fsyncs); less often, a page rewritten by several batches is copied once. A process
crash still loses nothing committed. At ``synchronous=NORMAL`` the WAL is fsynced only at
checkpoints, so a power cut or OS crash can roll back the transactions since the last one: now up to
~40 MiB of them instead of ~4 MiB, each with its offsets, so they are read from the bus again (the
bus must still hold them: Kafka's retention, the embedded log keeps everything). ``temp_store``:
the fallback path's staging tables and the sorter's scratch space in memory (temporary anyway).
The ingester's writer process turns automatic checkpoints off on its connection and runs them from a
thread of its own in the pauses of the traffic, or during it past 128 MiB of log
(``realtime_rl.ingest_proc``): what a power cut can roll back is then what was committed since that
thread's last checkpoint, in a sustained burst up to 128 MiB of log."""


def _sqlite_engine(url: sa.URL, settings: DatabaseSettings, readonly: bool) -> sa.Engine:
    if url.database and url.database != ":memory:" and not readonly:
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(url, connect_args={"timeout": settings.sqlite_busy_timeout_s}, **_JSON_ARGS)

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:
        # Take transaction control away from the driver; we emit BEGIN ourselves below.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        if readonly:
            cur.execute("PRAGMA query_only=ON")
        else:
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            for pragma in SQLITE_WRITER_PRAGMAS:
                cur.execute(f"PRAGMA {pragma}")
        cur.close()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:
        conn.exec_driver_sql("BEGIN" if readonly else "BEGIN IMMEDIATE")

    return engine
