"""The ingester's writer process: staged batches' transactions run in a child process.

Why a process. The ingester's main thread polls, decodes and plans; the transaction of the previous
batch ran on a second thread of the same process. That thread held the GIL for everything but the
database's own C code: encoding each row for the driver (JSON text of the token-id and log-prob
lists, timestamps) and binding every value (SQLite copies each bound string under the GIL), nearly
as much work an event as decoding itself, and the two threads took turns. Here the main thread
hands each staged batch over as plain field values (``ingest_plan.staged_fields``: strings, number
lists, the token ids already as JSON, one JSON text of the timestamps), ``marshal``ed in C (a
fraction of that work), and this process encodes the rest, binds and runs the whole transaction
(offsets, rows, join, model versions, dead letters, commit) with its own interpreter, on the other
core.

Exactly once is unchanged: the offsets move in the same transaction as the rows, conditionally on
where they were (``ingest_writer.advance``). If the ingester dies, this process sees end-of-file on
its input and exits once the transaction in hand has committed or rolled back; a restarted ingester
reads the positions from the database either way (and on PostgreSQL a transaction still running is
fenced by the conditional offset update, on SQLite it holds the write lock until it ends).

What stays in the ingester's process (``Ingester._transaction``, the same code as before): batches
that are not staged (small PostgreSQL batches, ``staged_writes`` off), a batch where a unique index
refused a row (a redelivered or conflicting event: the writer rolls back and says so, and the batch is
resolved row by row), a batch the database refuses (isolated record by record), and one the shared
file could not take.

Protocol, on the child's stdin and stdout: frames of a 4-byte little-endian length and a body. The
first frame to the child is JSON (database settings with the secret, group, limits); the child
answers ``ready``; then one frame per batch, the size of the ``marshal``ed batch just written to a
file both processes hold open (``/dev/shm`` where there is one), each answered by one ``marshal``ed
reply: (kind, detail, the child's CPU seconds so far), kind ``ready``, ``ok`` (with the counts),
``resolve``, ``refused``, ``fenced``, ``unavailable`` or ``failed`` (with what happened).
"""

from __future__ import annotations

import contextlib
import gc
import json
import marshal
import operator
import os
import pickle
import sqlite3
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from realtime_rl.ingest_plan import encoded_rows, staged_fields
from realtime_rl.ingest_writer import (
    OffsetsMoved,
    WriteResult,
    advance,
    dead_letter_row,
    write_direct,
    write_rest,
)

_HEADER = struct.Struct("<I")
_SIZE = struct.Struct("<Q")
_MARSHAL_VERSION = 4
"""marshal's newest format: short ASCII strings and repeated objects (dict keys) are written compactly.
Both ends are the same interpreter, which is all marshal needs."""


class WriterUnavailable(RuntimeError):
    """The writer process is gone or could not start; the batch's outcome is read back from the database."""


class WriterDatabaseUnavailable(RuntimeError):
    """The writer's transaction failed on an outage (connection refused, lost, timed out)."""


class WriterFailed(RuntimeError):
    """The writer's transaction failed on something that is neither an outage nor the data (a bug)."""


class WriterRefused(RuntimeError):
    """The database refused a record of the batch: the caller isolates it record by record."""


class WriterSkipped(RuntimeError):
    """The batch could not be handed over (the shared file refused it: a full ``/dev/shm``); nothing was
    sent, and the caller writes this batch itself."""


def ship(plan, before: dict[tuple[str, int], int], after: dict[tuple[str, int], int]) -> bytes:
    """A staged ``plan`` (``ingest_plan.BatchPlan``) and its offsets as one frame body for the writer.
    Model-version events and dead letters (rare) are pickled whole."""

    c_fields, c_stamps = staged_fields(plan, "completions")
    f_fields, f_stamps = staged_fields(plan, "feedback")
    rare = pickle.dumps((plan.versions, plan.dead), pickle.HIGHEST_PROTOCOL) if plan.versions or plan.dead else b""
    return marshal.dumps((plan.staging, before, after, c_fields, c_stamps, f_fields, f_stamps, plan.duplicates, rare),
                         _MARSHAL_VERSION)


class WriterProcess:
    """The ingester's handle on its writer process (started by ``start``, one batch at a time by ``apply``)."""

    def __init__(self, db, group: str, *, max_raw: int, gc_threshold: int) -> None:
        self._hello = json.dumps({"db": {**db.model_dump(mode="json"), "url": _secret(db.url)}, "group": group,
                                  "max_raw": max_raw, "gc_threshold": gc_threshold}).encode()
        self._proc: subprocess.Popen | None = None
        self._shared: BinaryIO | None = None
        self._lock = threading.Lock()
        self.cpu_s = 0.0
        """CPU seconds of every writer process this handle started (as they last reported)."""
        self._cpu_before = 0.0

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the child (if it is not running) and wait until it has imported everything."""
        with self._lock:
            if self.alive:
                return
            self._stop()
            # The child imports this very package (``-P``: not whatever the working directory holds), and
            # keeps the working directory: relative database paths mean the same file.
            root = str(Path(__file__).resolve().parent.parent)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
            # Open as long as the child runs (closed by _stop), so not a with block.
            self._shared = tempfile.TemporaryFile(  # noqa: SIM115
                dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
            fd = self._shared.fileno()
            self._proc = subprocess.Popen([sys.executable, "-P", "-m", "realtime_rl.ingest_proc", str(fd)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, pass_fds=(fd,))
            self._cpu_before = self.cpu_s
            try:
                _write(self._proc.stdin, self._hello)
                kind, detail, cpu_s = marshal.loads(_read(self._proc.stdout) or marshal.dumps(("exited", "", 0.0)))
            except OSError as err:
                kind, detail, cpu_s = "exited", str(err), 0.0
            if kind != "ready":
                self._stop()
                raise WriterUnavailable("ingest writer process did not start" + (f": {detail}" if detail else ""))
            self.cpu_s = self._cpu_before + cpu_s

    def apply(self, body: bytes) -> WriteResult | None:
        """Run one batch's transaction (``ship``'s body). Returns its counts, or None when a unique index
        refused a row (nothing was committed: the caller resolves the batch in its own transaction).
        Raises ``OffsetsMoved``, ``WriterRefused``, ``WriterDatabaseUnavailable``, ``WriterFailed`` or
        ``WriterUnavailable``; in every case but the last, the transaction was rolled back. Raises
        ``WriterSkipped`` when the batch was not handed over at all."""

        if not self.alive:  # gone between batches (nothing in hand): a new one takes this batch
            self.start()
        proc, shared = self._proc, self._shared
        assert proc is not None and shared is not None
        # The batch goes through a shared file, the pipe carries its size: a pipe takes 64 KiB at a time,
        # and each of a batch's many partial writes would wait for the GIL (the main thread decodes
        # meanwhile); one write here.
        try:
            _pwrite_all(shared.fileno(), body)
        except OSError as err:
            raise WriterSkipped(f"batch of {len(body)} bytes not handed to the writer: {err}") from err
        try:
            _write(proc.stdin, _SIZE.pack(len(body)))
            reply = _read(proc.stdout)
        except OSError as err:
            raise WriterUnavailable(f"ingest writer process lost: {err}") from err
        if not reply:
            raise WriterUnavailable(f"ingest writer process exited (code {proc.poll()})")
        kind, detail, cpu_s = marshal.loads(reply)
        self.cpu_s = self._cpu_before + cpu_s
        if kind == "ok":
            return WriteResult(**detail)
        if kind == "resolve":
            return None
        raise {"fenced": OffsetsMoved, "refused": WriterRefused, "unavailable": WriterDatabaseUnavailable}.get(
            kind, WriterFailed)(detail)

    def close(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self._stop(timeout_s)

    def _stop(self, timeout_s: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            proc.stdin.close()  # end-of-file: the child exits after the transaction in hand
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        if self._shared is not None:
            self._shared.close()
            self._shared = None


def _secret(value) -> str:
    return value.get_secret_value() if hasattr(value, "get_secret_value") else value


def _pwrite_all(fd: int, body: bytes) -> None:
    done = 0
    view = memoryview(body)
    while done < len(body):
        done += os.pwrite(fd, view[done:], done)


def _pread_all(fd: int, size: int) -> bytes:
    chunks, done = [], 0
    while done < size:
        chunk = os.pread(fd, size - done, done)
        if not chunk:
            raise EOFError(f"shared batch file ended after {done} of {size} bytes")
        chunks.append(chunk)
        done += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _write(stream: BinaryIO, body: bytes) -> None:
    stream.write(_HEADER.pack(len(body)))
    stream.write(body)
    stream.flush()


def _read(stream: BinaryIO) -> bytes:
    """One frame's body; empty at end-of-file."""
    header = _read_exactly(stream, _HEADER.size)
    if not header:
        return b""
    (size,) = _HEADER.unpack(header)
    body = _read_exactly(stream, size)
    if len(body) != size:
        return b""
    return body


def _read_exactly(stream: BinaryIO, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = stream.read(left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# -- the child ----------------------------------------------------------------------------------------


_first, _second = operator.itemgetter(0), operator.itemgetter(1)
"""A completion's id in its field tuple; a feedback's completion id in its."""


class _Resolve(Exception):
    """A unique index refused a row: roll the transaction back and let the ingester resolve the batch."""


def run_batch(engine, group: str, max_raw: int, body: bytes) -> WriteResult | None:
    """One shipped batch in one transaction: the offsets, the rows straight into the tables, the join,
    model versions and dead letters. None (rolled back) when a unique index refused a row."""

    staging, before, after, c_fields, c_stamps, f_fields, f_stamps, duplicates, rare = marshal.loads(body)
    versions, dead = pickle.loads(rare) if rare else ([], [])
    shipped = {"completions": (c_fields, c_stamps), "feedback": (f_fields, f_stamps)}

    def rows(table: str):
        fields, stamps = shipped[table]
        return encoded_rows(staging, table, fields, stamps)

    now = datetime.now(UTC)
    try:
        with engine.begin() as conn:
            advance(conn, group, before, after, now)
            result = write_direct(conn, rows, list(map(_first, c_fields[0])), list(map(_second, f_fields[0])), now)
            if result is None:
                raise _Resolve
            result.duplicates += duplicates
            letters = [dead_letter_row(item, now, max_raw, reason, detail) for item, reason, detail in dead]
            return write_rest(conn, result, versions, letters, now)
    except _Resolve:
        return None


def _reply(engine, group: str, max_raw: int, body: bytes) -> tuple[str, Any]:
    """``run_batch``'s outcome as a reply: kind and detail."""

    try:
        result = run_batch(engine, group, max_raw, body)
    except OffsetsMoved as err:
        return "fenced", str(err)
    except (sa_exc.DataError, sa_exc.IntegrityError) as err:
        return "refused", f"{type(err).__name__}: {err}"
    except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError, sa_exc.TimeoutError) as err:
        return "unavailable", f"{type(err).__name__}: {str(err).splitlines()[0]}"
    except Exception:  # reported to the ingester, which raises it there
        return "failed", traceback.format_exc()
    if result is None:
        return "resolve", None
    return "ok", asdict(result)


class _Checkpointer:
    """SQLite only: the write-ahead log copied back into the database file by a thread of its own, in
    the pauses of the traffic.

    SQLite's automatic checkpoint runs inside the commit that crosses its threshold: that commit then
    copies the whole log back and syncs the database file (~40 MB at ``wal_autocheckpoint`` 10000
    pages), while the ingester's main thread waits for the batch. Run from a thread after every
    commit instead, checkpoints no longer stalled a batch, but their copying and syncing still took
    CPU and disk from the ingester, which then caught up with a backlog more slowly. So the writer's
    connection does none (``wal_autocheckpoint=0``), and this thread runs a PASSIVE checkpoint (it
    neither waits for the writer nor stops it; the sqlite3 driver releases the GIL meanwhile) once no
    batch has been committed for ``IDLE_S``, or during the traffic once the log has grown past
    ``BUSY_BYTES``. SQLite starts the log over at the first write after a checkpoint caught up.
    Should it still pass ``LIMIT_BYTES`` (the log grows while checkpoints cannot keep up with the
    traffic), the writer checkpoints it to the end itself between two transactions (``RESTART``: a
    pause, as before, but rare).

    Durability: a process crash loses nothing committed. At ``synchronous=NORMAL`` the log is synced
    by checkpoints, so a power cut can roll back what was committed since the last one: in a burst up
    to ``BUSY_BYTES`` of log (~60k events), otherwise what came since the last pause. Offsets roll back
    with their rows, so those records are read from the bus again (it must still hold them)."""

    IDLE_S = 0.25
    BUSY_BYTES = 128 << 20
    LIMIT_BYTES = 1 << 30

    def __init__(self, path: str, busy_timeout_s: float) -> None:
        self._wal = f"{path}-wal"
        self._conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._committed_at = 0.0
        self._pending = False
        threading.Thread(target=self._run, name="wal-checkpoint", daemon=True).start()

    def after_commit(self) -> None:
        self._committed_at = time.monotonic()
        self._pending = True
        try:
            size = os.stat(self._wal).st_size
        except OSError:
            return
        if size >= self.LIMIT_BYTES:
            # A reader in the way (busy) only postpones it to a later commit.
            with self._lock, contextlib.suppress(sqlite3.Error):
                self._conn.execute("PRAGMA wal_checkpoint(RESTART)").fetchall()
        elif size >= self.BUSY_BYTES:
            self._wake.set()

    def _run(self) -> None:
        while True:
            woken = self._wake.wait(self.IDLE_S)
            self._wake.clear()
            if not self._pending or not woken and time.monotonic() - self._committed_at < self.IDLE_S:
                continue
            self._pending = False  # a commit from here on asks for another one
            # One that fails (a busy database, a disk error) is tried again at the next occasion.
            with self._lock, contextlib.suppress(sqlite3.Error):
                self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()


def _checkpointer(engine, db) -> _Checkpointer | None:
    """A ``_Checkpointer`` for a SQLite file database (the writer's connections then leave checkpoints to it)."""

    if engine.dialect.name != "sqlite" or not engine.url.database or engine.url.database == ":memory:":
        return None

    @sa.event.listens_for(engine, "connect")
    def _no_autocheckpoint(dbapi_conn, _record) -> None:  # after make_engine's pragmas
        dbapi_conn.execute("PRAGMA wal_autocheckpoint=0")

    return _Checkpointer(engine.url.database, db.sqlite_busy_timeout_s)


def main() -> None:
    """The child: read the hello, then batches until end-of-file."""

    shared = int(sys.argv[1])
    inp = os.fdopen(os.dup(0), "rb")
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, not into the frames
    hello = _read(inp)
    if not hello:
        return
    try:
        from realtime_rl.config import DatabaseSettings
        from realtime_rl.database import make_engine

        setup = json.loads(hello)
        db = DatabaseSettings.model_validate(setup["db"])
        engine = make_engine(db)
        checkpointer = _checkpointer(engine, db)
        group, max_raw = setup["group"], setup["max_raw"]
    except Exception as err:  # reported to the ingester, which cannot start without it
        _write(out, marshal.dumps(("failed", f"{type(err).__name__}: {err}", time.process_time()), _MARSHAL_VERSION))
        return
    # Connected before the first batch (the pool keeps the connection). A database that is down now is
    # reported by the first batch, as an outage the ingester waits out with this process still running.
    with contextlib.suppress(Exception), engine.connect():
        pass
    # The modules and the engine live as long as the process: out of the cyclic collector's sight, and
    # a batch's objects (acyclic) rarely wake it (as in the ingester, ``ingest.gc_threshold``).
    gc.collect()
    gc.freeze()
    if setup["gc_threshold"]:
        gc.set_threshold(setup["gc_threshold"], *gc.get_threshold()[1:])
    _write(out, marshal.dumps(("ready", None, time.process_time()), _MARSHAL_VERSION))
    # A broken pipe: the ingester is gone; what was committed stays, with its offsets.
    with contextlib.suppress(BrokenPipeError):
        while size := _read(inp):
            kind, detail = _reply(engine, group, max_raw, _pread_all(shared, _SIZE.unpack(size)[0]))
            _write(out, marshal.dumps((kind, detail, time.process_time()), _MARSHAL_VERSION))
            if checkpointer is not None and kind == "ok":
                checkpointer.after_commit()
    engine.dispose()


if __name__ == "__main__":
    main()
