"""One updater at a time: a database lock shared by every scheduler pointed at the same feedback DB.

* PostgreSQL: ``pg_try_advisory_lock(key)`` on a connection held for the whole run. The server drops
  the lock when that session ends, so a killed updater can never leave it behind.
* SQLite (and anything else): a row in ``updater_locks`` inserted in an IMMEDIATE transaction. A row
  whose holder process is gone (same host, pid not alive) or that is older than ``stale_s`` is taken
  over, which is how a SIGKILLed run stops blocking the next one.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

import sqlalchemy as sa

from realtime_rl.release_tables import updater_locks


def advisory_key(name: str) -> int:
    """A stable signed 64-bit key for ``pg_try_advisory_lock``."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=UTC)


@contextmanager
def _pg_lock(engine: sa.Engine, name: str) -> Iterator[bool]:
    key = advisory_key(name)
    with engine.connect() as conn:
        got = bool(conn.execute(sa.text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar())
        conn.commit()
        try:
            yield got
        finally:
            if got:
                conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                conn.commit()


def _row_lock_try(engine: sa.Engine, name: str, holder: str, stale_s: float) -> bool:
    now = datetime.now(UTC)
    host = socket.gethostname()
    with engine.begin() as conn:
        row = conn.execute(sa.select(updater_locks).where(updater_locks.c.name == name)).mappings().first()
        if row is not None:
            dead = row["hostname"] == host and not _pid_alive(row["pid"])
            stale = (now - _aware(row["acquired_at"])).total_seconds() > stale_s
            if not (dead or stale):
                return False
            conn.execute(sa.delete(updater_locks).where(updater_locks.c.name == name))
        conn.execute(sa.insert(updater_locks).values(name=name, holder=holder, pid=os.getpid(), hostname=host,
                                                     acquired_at=now))
    return True


@contextmanager
def _row_lock(engine: sa.Engine, name: str, stale_s: float) -> Iterator[bool]:
    holder = f"{socket.gethostname()}:{os.getpid()}:{id(engine):x}"
    try:
        got = _row_lock_try(engine, name, holder, stale_s)
    except sa.exc.IntegrityError:
        got = False  # another process inserted between our read and our write
    try:
        yield got
    finally:
        if got:
            with engine.begin() as conn:
                conn.execute(sa.delete(updater_locks).where(updater_locks.c.name == name,
                                                            updater_locks.c.holder == holder))


@contextmanager
def updater_lock(engine: sa.Engine, name: str, *, stale_s: float = 6 * 3600.0) -> Iterator[bool]:
    """Yield True when this process now holds the lock, False when someone else does (never blocks)."""
    if engine.dialect.name == "postgresql":
        with _pg_lock(engine, name) as got:
            yield got
    else:
        with _row_lock(engine, name, stale_s) as got:
            yield got
