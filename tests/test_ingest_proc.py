"""The writer process (``realtime_rl.ingest_proc``): staged batches are written by a child process.
What happens when it dies (between batches, mid-transaction), when the database is out from under
it, and when the ingester is closed; the rows end up exactly once either way."""

from __future__ import annotations

import signal
import sqlite3
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from realtime_rl.ingest import Ingester
from realtime_rl.ingest_proc import WriterDatabaseUnavailable, WriterUnavailable
from tests.ingest_fixtures import completion, counts, feedback, make_settings, send


def _events(prefix: str, n: int) -> list:
    return [completion(f"{prefix}{i}") for i in range(n)] + [feedback(f"{prefix}{i}") for i in range(n)]


def test_staged_batches_are_written_by_the_writer_process(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'feedback.db'}"
    s = make_settings(tmp_path, url)
    send(s, _events("c", 150))
    ing = Ingester(s)
    try:
        ing.drain(timeout_s=60)
        assert ing._writer.alive and ing.writer_cpu_s > 0
        child = ing._writer._proc
    finally:
        ing.close()
    assert child.poll() == 0  # closing the ingester ends its writer
    assert ing.stats.written.completions == 150 and ing.stats.written.joined == 150
    assert counts(url, "completions", "feedback", "training_examples") == \
        {"completions": 150, "feedback": 150, "training_examples": 150}


def test_a_writer_gone_between_batches_is_replaced(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'feedback.db'}"
    s = make_settings(tmp_path, url)
    send(s, _events("a", 100))
    ing = Ingester(s)
    try:
        ing.drain(timeout_s=60)
        first = ing._writer._proc
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        send(s, _events("b", 100))
        ing.drain(timeout_s=60)
        assert ing._writer._proc is not first and ing._writer.alive
    finally:
        ing.close()
    assert counts(url, "completions", "training_examples") == {"completions": 200, "training_examples": 200}


@pytest.mark.postgres
def test_a_writer_killed_mid_transaction_commits_nothing(tmp_path: Path, postgres_url: str) -> None:
    """A trigger holds the writer inside its transaction (rows copied, the join under way); killed
    there, the server rolls it back. The ingester gets ``WriterUnavailable`` (the outcome is unknown to
    it), and reads the positions from the database again: every event ends up in the tables once."""
    s = make_settings(tmp_path, postgres_url)
    Ingester(s, writer_process=False).close()  # the schema
    engine = sa.create_engine(postgres_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE hold (until timestamptz)")
        conn.exec_driver_sql("CREATE FUNCTION hold() RETURNS trigger AS $$ BEGIN "
                             "PERFORM pg_sleep(0.05) FROM hold WHERE until > clock_timestamp(); RETURN NEW; END "
                             "$$ LANGUAGE plpgsql")
        conn.exec_driver_sql("CREATE TRIGGER hold BEFORE INSERT ON training_examples FOR EACH ROW "
                             "EXECUTE FUNCTION hold()")
        conn.exec_driver_sql("INSERT INTO hold VALUES (now() + interval '60 seconds')")
    send(s, _events("c", 150))
    ing = Ingester(s)
    try:
        ing._attach()
        writer = ing._writer._proc
        failure: list[BaseException] = []

        def once() -> None:
            try:
                ing.run_once()
            except BaseException as err:  # the test looks at it below
                failure.append(err)

        worker = threading.Thread(target=once)
        worker.start()
        with engine.connect() as conn:  # wait until the writer is in the trigger, inside the join
            for _ in range(600):
                if conn.exec_driver_sql("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep' "
                                        "AND datname = current_database()").scalar_one():
                    break
                time.sleep(0.05)
            else:
                pytest.fail("the writer never reached the join")
        writer.send_signal(signal.SIGKILL)
        worker.join(30)
        assert len(failure) == 1 and isinstance(failure[0], WriterUnavailable)
        with engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM hold")
        assert counts(postgres_url, "completions", "feedback", "training_examples") == \
            {"completions": 0, "feedback": 0, "training_examples": 0}
        ing.positions = None  # as the ingester's recovery does: the database holds the truth
        ing.drain(timeout_s=60)
    finally:
        ing.close()
        engine.dispose()
    assert counts(postgres_url, "completions", "feedback", "training_examples") == \
        {"completions": 150, "feedback": 150, "training_examples": 150}


def test_a_database_the_writer_cannot_reach_is_an_outage(tmp_path: Path) -> None:
    """A write lock held elsewhere past the busy timeout: the writer's transaction fails as an outage,
    which the ingester waits out (``run`` retries; here ``run_once`` raises it), and nothing moved."""
    path = tmp_path / "feedback.db"
    s = make_settings(tmp_path, f"sqlite:///{path}")
    s = s.model_copy(update={"db": s.db.model_copy(update={"sqlite_busy_timeout_s": 0.2})})
    send(s, _events("c", 50))
    ing = Ingester(s)
    try:
        ing._attach()
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        with pytest.raises(WriterDatabaseUnavailable, match="locked"):
            ing.run_once()
        blocker.execute("ROLLBACK")
        blocker.close()
        ing.drain(timeout_s=60)
    finally:
        ing.close()
    assert ing.stats.records == 100
    assert counts(f"sqlite:///{path}", "completions", "training_examples") == \
        {"completions": 50, "training_examples": 50}


def test_run_recovers_from_a_writer_that_died_mid_batch(tmp_path: Path) -> None:
    """``run`` treats a lost writer like an outage: it re-reads the positions, starts a new writer and
    carries on; the rows end up exactly once."""
    url = f"sqlite:///{tmp_path / 'feedback.db'}"
    s = make_settings(tmp_path, url, ingest={"batch_max_records": 40, "retry_backoff_s": 0.05})
    ing = Ingester(s)
    killed = threading.Event()
    real_apply = type(ing._writer).apply

    def apply_then_die(self, body):
        if not killed.is_set() and ing.stats.transactions >= 2:
            killed.set()
            self._proc.send_signal(signal.SIGKILL)  # before the reply: the outcome is unknown
        return real_apply(self, body)

    stop = threading.Event()
    worker = threading.Thread(target=ing.run, kwargs={"stop_event": stop})
    try:
        type(ing._writer).apply = apply_then_die
        worker.start()
        send(s, _events("c", 200))
        for _ in range(400):
            if ing.stats.records >= 400:
                break
            time.sleep(0.05)
    finally:
        stop.set()
        worker.join(30)
        type(ing._writer).apply = real_apply
        ing.close()
    assert killed.is_set() and ing.stats.retries >= 1
    assert counts(url, "completions", "feedback", "training_examples") == \
        {"completions": 200, "feedback": 200, "training_examples": 200}


def test_a_batch_the_shared_file_refuses_is_written_here(tmp_path: Path, monkeypatch) -> None:
    """A full ``/dev/shm`` refuses the batch before anything is sent: the ingester writes it itself."""
    import errno

    from realtime_rl import ingest_proc

    def full(fd: int, body: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    url = f"sqlite:///{tmp_path / 'feedback.db'}"
    s = make_settings(tmp_path, url)
    send(s, _events("c", 60))
    logged: list[str] = []
    ing = Ingester(s, log_fn=logged.append)
    try:
        monkeypatch.setattr(ingest_proc, "_pwrite_all", full)
        ing.drain(timeout_s=60)
    finally:
        ing.close()
    assert any("written by the ingester itself" in line for line in logged)
    assert ing.stats.written.joined == 60
    assert counts(url, "completions", "training_examples") == {"completions": 60, "training_examples": 60}


def test_the_checkpoint_thread_keeps_the_log_from_growing(tmp_path: Path) -> None:
    """Without automatic checkpoints on the writing connection, the thread copies what was committed
    back into the database file in a pause of the traffic, or during it past ``BUSY_BYTES``; past
    ``LIMIT_BYTES``, a checkpoint to the end starts the log over."""
    from realtime_rl.ingest_proc import _Checkpointer

    path = tmp_path / "db.sqlite"
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("PRAGMA journal_mode=WAL")
    writer.execute("PRAGMA wal_autocheckpoint=0")
    writer.execute("CREATE TABLE t (x BLOB)")
    checkpointer = _Checkpointer(str(path), 5.0)

    def write(n: int) -> None:
        writer.execute("BEGIN IMMEDIATE")
        writer.executemany("INSERT INTO t VALUES (?)", [(bytes(4000),)] * n)
        writer.execute("COMMIT")

    db, wal = path, Path(f"{path}-wal")

    def copied_back(within_s: float) -> bool:
        """Whether the table's pages reached the database file (it holds the schema alone before)."""
        for _ in range(max(1, int(within_s / 0.01))):
            if db.stat().st_size > 100_000:
                with checkpointer._lock:  # the checkpoint under way, to its end
                    return True
            time.sleep(0.01)
        return False

    def starts_over(n: int) -> bool:
        """Whether ``n`` more rows reuse the log from its start (after a complete checkpoint) instead
        of growing it."""
        size = wal.stat().st_size
        write(n)
        return wal.stat().st_size == size

    write(200)
    checkpointer.after_commit()
    assert not copied_back(checkpointer.IDLE_S / 2)  # the traffic may go on: not yet
    assert copied_back(10)  # a pause: copied back
    assert starts_over(10)

    checkpointer.BUSY_BYTES = 400_000
    write(300)  # ~1.2 MB of log: over BUSY_BYTES, copied back without waiting for a pause
    checkpointer.after_commit()
    time.sleep(checkpointer.IDLE_S / 2)
    with checkpointer._lock:
        assert starts_over(10)

    checkpointer.LIMIT_BYTES = checkpointer.BUSY_BYTES = 1 << 20
    checkpointer.IDLE_S = 3600.0  # only the limit acts now
    write(600)  # ~2.4 MB of log, over the limit
    checkpointer.after_commit()  # copies to the end before it returns
    assert starts_over(10)
    assert writer.execute("SELECT count(*) FROM t").fetchone()[0] == 1130
    writer.close()
