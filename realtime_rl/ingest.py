"""`rtrl ingest`: completion, feedback and model-version events from the bus into the feedback tables.

Exactly-once effect. The bus delivers at least once; the ingester stores its consumer positions in
``consumer_offsets`` in the *same* database transaction as the rows those records produced, and
seeks the bus to the stored positions whenever it (re)starts or a transaction fails. A process
killed at any instant therefore leaves either the whole batch and its offsets, or neither. Rows
are also idempotent on the event id, so a producer that resends after a failed flush does not
double-count. The offset update is conditional (``WHERE next_offset = <what we read>``): if two
ingesters of one group ever run at once, the slower one's transaction changes nothing, rolls back
and re-reads the positions, so even then nothing is written twice.

Poison records (oversized, undecodable, schema-invalid, conflicting ids) become ``dead_letters``
rows in the same transaction and the offsets move past them. A record the database itself rejects
(a data error) makes the batch retry one record at a time in savepoints, and only that record is
dead-lettered. Database or bus outages are not poison: the ingester backs off and retries from
the committed positions.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url

from policy.routes import geometry_from_config
from realtime_rl import tables as t
from realtime_rl.bus import BusConsumer, BusUnavailable, Record, open_consumer
from realtime_rl.database import make_engine, redacted_url, url_of
from realtime_rl.ingest_decode import DB_REJECTED, Decoded, RouteRules, decode_record
from realtime_rl.ingest_plan import BatchPlan, plan_batch
from realtime_rl.ingest_proc import (
    WriterDatabaseUnavailable,
    WriterProcess,
    WriterRefused,
    WriterSkipped,
    WriterUnavailable,
    ship,
)
from realtime_rl.ingest_writer import (
    OffsetsMoved,
    WriteResult,
    advance,
    dead_letter_row,
    dialect_insert,
    write_plan,
)
from realtime_rl.schema import ensure_schema

log = logging.getLogger("realtime_rl.ingest")

_TRANSIENT_DB_ERRORS = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError,
                        sa_exc.TimeoutError)
_DATA_ERRORS = (sa_exc.DataError, sa_exc.IntegrityError)


_RECOVERABLE = (OffsetsMoved, BusUnavailable, WriterUnavailable, WriterDatabaseUnavailable, *_TRANSIENT_DB_ERRORS)

GIL_SWITCH_INTERVAL_S = 0.0005
"""While ingesting. The commit thread mostly waits on database round trips; when an answer arrives
it needs the GIL back from the main thread, which is decoding the next batch and, at Python's default
of 5 ms, would keep it up to that long per round trip (a batch makes about a dozen)."""


@dataclass
class IngestStats:
    records: int = 0
    transactions: int = 0
    fenced: int = 0
    retries: int = 0
    last_commit_s: float | None = None
    """``time.monotonic()`` of the newest commit (benchmarks time producer-to-committed-rows with it)."""
    written: WriteResult = field(default_factory=WriteResult)

    def as_dict(self) -> dict:
        data = asdict(self)
        data.pop("last_commit_s")
        data.update(data.pop("written"))
        return data


@dataclass
class _Batch:
    before: dict[tuple[str, int], int]
    after: dict[tuple[str, int], int]
    decoded: list[Decoded]
    plan: BatchPlan
    shipped: bytes | None = None
    """The batch for the writer process (``ingest_proc.ship``), if it takes it."""


_BUSY_CHECK_S = 0.02
"""While filling a batch beside a running transaction: how often to look whether it has ended."""


def _first_batch(cfg) -> int:
    """Records in a batch taken while no transaction is in flight (see ``Ingester.run``)."""
    return max(1, cfg.batch_max_records // 5)


def utcnow() -> datetime:
    return datetime.now(UTC)


def route_rules(settings, say: Callable[[str], None] = log.info) -> RouteRules | None:
    """The MoE geometry routes are checked against, from ``ingest.routes_model_dir`` (default
    ``model.dir``); None when that directory holds no config.json."""
    path = Path(settings.ingest.routes_model_dir or settings.model.dir) / "config.json"
    if not path.is_file():
        say(f"ingest: no {path}: route records are checked against their own shape only")
        return None
    return RouteRules(geometry_from_config(json.loads(path.read_text())))


class Ingester:
    """Consumes the events and versions topics for ``settings.ingest.group`` into the feedback tables.

    ``settings`` is the composed :class:`rtrl.config.Settings` (sections ``bus``, ``db``, ``ingest``).
    The bus connection is opened lazily, so an ingester can start while the bus is down. Staged
    batches are written by a child process (``realtime_rl.ingest_proc``), started when the ingester
    attaches; ``writer_process=False`` writes every batch in this process (slower, same rows).
    """

    def __init__(self, settings, *, consumer: BusConsumer | None = None,
                 log_fn: Callable[[str], None] | None = None, writer_process: bool = True) -> None:
        self.settings = settings
        self.cfg = settings.ingest
        self.group = self.cfg.group
        self.topics = list(dict.fromkeys([settings.bus.events_topic, settings.bus.versions_topic]))
        ensure_schema(settings.db)
        self.engine = make_engine(settings.db)
        self._consumer = consumer
        self.positions: dict[tuple[str, int], int] | None = None
        self.stats = IngestStats()
        self._log = log_fn or log.info
        self._empty_polls = 0
        # An in-memory SQLite database exists in this process only: nothing for a writer process to write to.
        url = make_url(url_of(settings.db))
        in_memory = url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")
        self._writer = WriterProcess(settings.db, self.group, max_raw=self.cfg.dead_letter_max_raw_bytes,
                                     gc_threshold=self.cfg.gc_threshold) if writer_process and not in_memory else None
        self._shared = self.cfg.partition_assignment == "group"
        if self._shared and settings.bus.backend != "kafka" and consumer is None:
            raise ValueError("ingest.partition_assignment = 'group' needs bus.backend = 'kafka' (Kafka's "
                             "consumer-group protocol shares the partitions)")
        self._subscribed = False
        self._rebalanced = False  # set from inside a poll when the group moved partitions
        self.rebalances = 0
        self.route_rules = route_rules(settings, self._log)

    # -- bus attachment -------------------------------------------------------------------------

    @property
    def consumer(self) -> BusConsumer:
        if self._consumer is None:
            self._consumer = open_consumer(self.settings.bus, self.group)
        return self._consumer

    @property
    def writer_cpu_s(self) -> float:
        """CPU seconds of the writer process(es) so far (0 without one): the ingester's CPU is this
        process's and theirs."""
        return self._writer.cpu_s if self._writer is not None else 0.0

    def _attach(self) -> None:
        """Read (and initialise) this group's positions from the database, seek the bus there, and have
        the writer process running. Sharing the partitions (``partition_assignment = "group"``), only
        those the group gave this member, which may be none until the first poll has joined it."""
        if self._writer is not None:
            self._writer.start()
        if self._shared:
            if not self._subscribed:
                self.consumer.subscribe(self.topics, self._on_rebalance)
                self._subscribed = True
            self._rebalanced = False
            wanted = sorted(self.consumer.assignment())
        else:
            wanted = [(topic, p) for topic in self.topics for p in self.consumer.partitions(topic)]
        offsets = t.consumer_offsets
        with self.engine.begin() as conn:
            stored = self._stored_positions(conn)
            missing = [pos for pos in wanted if pos not in stored]
            if missing:
                ends: dict[str, dict[int, int]] = {}
                if self.cfg.start_from == "latest":
                    ends = {topic: self.consumer.end_offsets(topic) for topic in {tp for tp, _ in missing}}
                now = utcnow()
                rows = [{"group_id": self.group, "topic": topic, "partition": p,
                         "next_offset": ends.get(topic, {}).get(p, 0), "updated_at": now} for topic, p in missing]
                conn.execute(dialect_insert(conn, offsets).on_conflict_do_nothing(), rows)
                stored = self._stored_positions(conn)
        self.positions = {pos: stored[pos] for pos in wanted}
        self._seek(self.positions)

    def _seek(self, positions: dict[tuple[str, int], int]) -> None:
        if self._shared:
            self.consumer.seek(positions)
        else:
            self.consumer.assign(positions)

    def _on_rebalance(self, kind: str, partitions: set[tuple[str, int]]) -> None:
        """Called inside a poll when the group takes partitions from this member or gives it some: what
        was read in this batch is dropped and the positions are read again from the database. No row
        can be written twice meanwhile: another member's transaction for a partition this one still
        writes fails its offset check (``OffsetsMoved``) and is retried from the stored positions."""
        self._rebalanced = True
        self.rebalances += 1
        held = self.consumer.assignment() if kind == "assigned" else partitions
        by_topic = "; ".join(f"{topic} {sorted(p for t, p in held if t == topic)}" for topic in self.topics)
        self._log(f"ingest: rebalance ({kind}): {'holding' if kind == 'assigned' else 'gave up'} {by_topic}")

    def _stored_positions(self, conn: sa.Connection) -> dict[tuple[str, int], int]:
        o = t.consumer_offsets
        rows = conn.execute(sa.select(o.c.topic, o.c.partition, o.c.next_offset)
                            .where(o.c.group_id == self.group, o.c.topic.in_(self.topics)))
        return {(topic, p): off for topic, p, off in rows}

    def _rewind(self) -> None:
        """The database kept the old positions; make the bus agree (or re-attach from scratch)."""
        try:
            if self.positions is not None:
                self._seek(self.positions)
        except BusUnavailable:
            self.positions = None

    # -- one batch ------------------------------------------------------------------------------

    def run_once(self, max_records: int | None = None) -> int:
        """Poll up to ``max_records`` records, write them and their offsets in one transaction.

        Returns the number of records consumed (dead-lettered ones included); 0 when the poll timed
        out empty. Raises :class:`BusUnavailable` or a SQLAlchemy operational error on outages
        (nothing is committed then; the next call resumes from the committed positions).
        """
        if self.positions is None:
            self._attach()
        assert self.positions is not None
        records = self._gather(max_records or self.cfg.batch_max_records, self.positions)
        if self._rebalanced:
            self.positions = None  # re-attach: the group moved partitions while these were read
            self._empty_polls = 0
            return 0
        if not records:
            self._empty_polls += 1
            return 0
        self._empty_polls = 0
        try:
            self._apply(self._prepare(records, self.positions))
        except OffsetsMoved as err:
            self._fenced(err)
        except BaseException:
            self._rewind()
            raise
        return len(records)

    def _gather(self, limit: int, floor: dict[tuple[str, int], int], busy: Future | None = None) -> list[Record]:
        """Up to ``limit`` records; once some arrived, waits up to ``batch_max_wait_ms`` for more. With
        ``busy`` (the transaction in flight) the wait lasts only while that runs, and a dry poll does
        not end it while the batch is below ``_first_batch``: the wait is there to grow batches while
        the database is occupied anyway; once it is idle, waiting only delays the rows (the last batch
        of a burst waited the whole 100 ms). A batch of ``_first_batch`` or more ends at a dry poll:
        its decoding then overlaps the transaction instead of following it (the last batch of a
        burst was decoded only after the previous commit, which added all its decoding to the burst).
        Then it takes what it has, unless the bus still has records and the batch is below
        ``_first_batch``: a transaction costs milliseconds however small, so tiny batches beside a fast
        commit would spend more on transactions than they save in latency."""
        records: list[Record] = []
        deadline: float | None = None
        timeout = self.cfg.poll_timeout_s
        least = _first_batch(self.cfg)
        while len(records) < limit:
            polled = self.consumer.poll(timeout_s=timeout, max_records=limit - len(records))
            # Anything below ``floor`` (a fetch that raced a rewind) was already taken care of.
            records.extend(r for r in polled if r.offset >= floor.get((r.topic, r.partition), 1 << 62))
            if self._rebalanced:
                return []
            if not polled and (busy is None or busy.done() or not records or len(records) >= least):
                break
            if deadline is None:
                deadline = time.monotonic() + self.cfg.batch_max_wait_ms / 1000
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                break
            if busy is not None:
                if busy.done() and (not polled or len(records) >= least):
                    break
                timeout = min(timeout, _BUSY_CHECK_S)
        return records

    def _prepare(self, records: list[Record], before: dict[tuple[str, int], int]) -> _Batch:
        """Decode and plan a batch: everything that needs no database (runs beside the previous commit)."""
        after = dict(before)
        for r in records:
            pos = (r.topic, r.partition)
            if r.offset >= after[pos]:
                after[pos] = r.offset + 1
        decoded = [decode_record(r, self.cfg.max_event_bytes, self.route_rules) for r in records]
        plan = plan_batch(decoded, self.engine.dialect, use_copy=self.cfg.staged_writes)
        shipped = ship(plan, before, after) if self._writer is not None and plan.staging is not None else None
        return _Batch(before, after, decoded, plan, shipped)

    def _apply(self, batch: _Batch) -> None:
        """One transaction: advance the offsets from ``batch.before`` to ``batch.after``, write the rows
        (a second one, record by record, if the database refused a record in the first).

        Staged batches go to the writer process; one it rolled back because a unique index refused a
        row comes back here and is resolved row by row. Never touches the bus consumer (it may run on
        the commit thread while the main thread polls).
        """
        try:
            result = self._in_writer(batch) if batch.shipped is not None and self._writer is not None else None
            if result is None:
                result = self._transaction(batch, isolate=False, direct=batch.shipped is None)
        except (*_DATA_ERRORS, WriterRefused):
            # Some record is refused by the database itself: the transaction is gone; do the batch
            # again with a savepoint per record, so that only that record is dead-lettered.
            result = self._transaction(batch, isolate=True)
        self.positions = batch.after
        self.stats.records += len(batch.decoded)
        self.stats.transactions += 1
        self.stats.last_commit_s = time.monotonic()
        self.stats.written.add(result)

    def _in_writer(self, batch: _Batch) -> WriteResult | None:
        """The batch's transaction in the writer process; None when this process must write it: a unique
        index refused a row there (rolled back), or the batch could not be handed over."""
        assert self._writer is not None and batch.shipped is not None
        try:
            return self._writer.apply(batch.shipped)
        except WriterSkipped as err:
            self._log(f"ingest: {err}; written by the ingester itself")
            batch.shipped = None
            return None

    def _fenced(self, err: OffsetsMoved) -> None:
        self.stats.fenced += 1
        self._log(f"ingest: {err}; re-reading positions")
        self.positions = None

    def _transaction(self, batch: _Batch, *, isolate: bool, direct: bool = True) -> WriteResult:
        now = utcnow()
        with self.engine.begin() as conn:
            advance(conn, self.group, batch.before, batch.after, now)
            if not isolate:
                return write_plan(conn, batch.plan, now, max_raw=self.cfg.dead_letter_max_raw_bytes, direct=direct)
            return self._write_isolated(conn, batch.decoded, now)

    def _write_isolated(self, conn: sa.Connection, decoded: list[Decoded], now: datetime) -> WriteResult:
        """One savepoint per record; a record the database refuses becomes a ``db_rejected`` dead letter."""
        max_raw = self.cfg.dead_letter_max_raw_bytes
        result = WriteResult()
        for item in decoded:
            try:
                with conn.begin_nested():
                    plan = plan_batch([item], conn.dialect, use_copy=False)
                    result.add(write_plan(conn, plan, now, max_raw=max_raw))
            except _DATA_ERRORS as err:
                detail = f"{type(err.orig).__name__}: {err.orig}" if getattr(err, "orig", None) else str(err)
                row = dead_letter_row(item, now, max_raw, DB_REJECTED, detail)
                conn.execute(sa.insert(t.dead_letters), [row])
                result.dead_letters += 1
                result.by_reason[DB_REJECTED] = result.by_reason.get(DB_REJECTED, 0) + 1
        return result

    # -- loops ----------------------------------------------------------------------------------

    def lag(self) -> int:
        """Records between the committed positions and the bus's end offsets (as the broker reports them)."""
        if self.positions is None:
            self._attach()
        assert self.positions is not None
        total = 0
        for topic in self.topics:
            for p, end in self.consumer.end_offsets(topic).items():
                if (topic, p) in self.positions:  # sharing partitions: only this member's
                    total += max(0, end - self.positions[(topic, p)])
        return total

    def run(self, stop_event: threading.Event | None = None, max_idle_s: float | None = None) -> IngestStats:
        """Ingest until ``stop_event`` is set, or until nothing arrived for ``max_idle_s`` seconds.

        Pipelined: while one batch's transaction runs on a helper thread (the database works, the
        GIL is free), the next batch is polled and decoded. A batch is only submitted after the
        previous one committed, so transactions never overlap and a failure discards what was read
        ahead (the bus is rewound to the committed positions). The first batch after the pipeline
        ran empty is a fifth of ``batch_max_records``, so that the database starts sooner. Outages of
        the bus or the database are waited out, ``retry_backoff_s`` between tries.
        """
        stop = stop_event or threading.Event()
        idle_since = last_log = time.monotonic()
        logged = 0
        inflight: tuple[Future, _Batch] | None = None
        with self._interpreter_tuned(), ThreadPoolExecutor(1, thread_name_prefix="ingest-commit") as pool:
            while not stop.is_set():
                n = 0
                try:
                    if self.positions is None:
                        self._attach()
                    assert self.positions is not None
                    floor = inflight[1].after if inflight is not None else self.positions
                    # With no transaction in flight the database idles until this batch is decoded:
                    # start it on a smaller one (at start-up, after an idle spell or a failure).
                    limit = self.cfg.batch_max_records if inflight is not None else _first_batch(self.cfg)
                    records = self._gather(limit, floor, busy=inflight[0] if inflight is not None else None)
                    batch = self._prepare(records, floor) if records else None
                    if inflight is not None:
                        done, inflight = inflight[0], None
                        done.result()
                    if self._rebalanced:
                        self.positions = None  # re-read the positions of what this member holds now
                        continue
                    if batch is not None:
                        inflight = (pool.submit(self._apply, batch), batch)
                        n = len(batch.decoded)
                except _RECOVERABLE as err:
                    if inflight is not None:
                        # Let the running transaction end first: either way, resume from the database.
                        done, inflight = inflight[0], None
                        with contextlib.suppress(*_RECOVERABLE):
                            done.result()
                    self._recover(err, stop)
                now = time.monotonic()
                if n:
                    idle_since = now
                elif max_idle_s is not None and now - idle_since >= max_idle_s and inflight is None:
                    break
                if now - last_log >= self.cfg.log_every_s and self.stats.records != logged:
                    s = self.stats
                    self._log(f"ingest: {s.records} records ({s.written.completions} completions, "
                              f"{s.written.feedback} feedback, {s.written.joined} joined, "
                              f"{s.written.dead_letters} dead letters)")
                    last_log, logged = now, s.records
            if inflight is not None:
                try:
                    inflight[0].result()  # commit the last batch before returning
                except _RECOVERABLE as err:
                    self._log(f"ingest: last batch not committed ({err}); it will be read again")
        return self.stats

    def drain(self, timeout_s: float | None = None,
              progress: Callable[[int], None] | None = None) -> IngestStats:
        """Ingest until caught up: two empty polls in a row and no lag by the broker's end offsets.

        Two empty polls, not one: a broker may under-report end offsets (Tansu reports the last
        batch's base offset), and a first poll right after a seek can come back before the fetch.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._empty_polls = 0
        with self._interpreter_tuned():
            while True:
                n = self.run_once()
                if progress is not None and n:
                    progress(n)
                if n == 0 and self._empty_polls >= 2 and self.lag() == 0:
                    return self.stats
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"ingest did not catch up within {timeout_s} s (lag {self.lag()})")

    @contextlib.contextmanager
    def _interpreter_tuned(self):
        """For the duration: the gen-0 GC threshold raised (see ``ingest.gc_threshold``) and the GIL's
        switch interval shortened to ``GIL_SWITCH_INTERVAL_S``; both restored afterwards."""
        previous, interval = gc.get_threshold(), sys.getswitchinterval()
        if self.cfg.gc_threshold:
            gc.set_threshold(self.cfg.gc_threshold, *previous[1:])
        sys.setswitchinterval(min(interval, GIL_SWITCH_INTERVAL_S))
        try:
            yield
        finally:
            gc.set_threshold(*previous)
            sys.setswitchinterval(interval)

    def _recover(self, err: BaseException, stop: threading.Event) -> None:
        """After a failed step: nothing half-done is kept, so re-attach from the stored positions."""
        if isinstance(err, OffsetsMoved):
            self._fenced(err)
        elif isinstance(err, BusUnavailable):
            self._outage(f"bus unavailable: {err}", stop)
        else:
            self._outage(f"database {redacted_url(self.settings.db)} unavailable: "
                         f"{type(err).__name__}: {str(err).splitlines()[0]}", stop)

    def _outage(self, message: str, stop: threading.Event) -> None:
        self.stats.retries += 1
        if self.stats.retries == 1 or self.stats.retries % 10 == 0:
            self._log(f"ingest: {message}; retrying every {self.cfg.retry_backoff_s:g} s")
        self.positions = None  # re-attach (and re-seek) once the outage is over
        stop.wait(self.cfg.retry_backoff_s)

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        if self._writer is not None:
            self._writer.close()
        self.engine.dispose()
