"""`rtrl bench ingest`: events/s from producer to committed rows, per bus (Kafka, embedded) and
database (SQLite, PostgreSQL), against the consumer-only ceiling measured in the same run.

For each bus, with the producer running in its own process (as the gateway would) sending a
synthetic stream (``realtime_rl.event_samples``) as fast as it can:

- ``ceiling_events_per_s``: the same producer, consumed by poll + decode + validation with no
  database: the most the ingester could do on this bus and machine;
- ``events_per_s``: first send to the commit of the last row, through ``Ingester.run`` (what
  ``rtrl ingest`` runs), into a fresh database; the tables are then checked against the stream
  (``rows_ok``).

Also reported: the producer's own rate, ``backlog_events_per_s`` / ``backlog_ceiling_events_per_s``
(the same two measurements over a topic already full, i.e. catching up, with no producer competing
for the cores), and CPU microseconds per event of the backlog runs (consumer-only pass, ingester
processes, i.e. its own and its writer process's, the writer's also alone, PostgreSQL server
processes read from /proc): wall-clock rates on a shared machine move
with its load, CPU per event much less. Kafka is the broker in ``bus.*`` when ``bus.backend = "kafka"``, else a local Tansu
broker; PostgreSQL is a temporary database on ``BENCH_PG_ADMIN_URL`` (default: the local server;
not ``RTRL_``-prefixed, because the settings loader refuses unknown ``RTRL_*`` variables).
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from pydantic import SecretStr

from realtime_rl.bus import open_consumer, open_producer
from realtime_rl.config import BusSettings
from realtime_rl.event_samples import sample_stream
from realtime_rl.ingest import Ingester
from realtime_rl.ingest_decode import decode_record
from rtrl import devservices

GOAL_PG_EVENTS_PER_S = 20_000
GOAL_FRACTION_OF_CEILING = 0.5


def _produce(bus_json: str, topic: str, n: int, seed: int, ready, go, out) -> None:
    """Child process: build the stream, wait for the start signal, send everything, flush."""

    bus = BusSettings.model_validate_json(bus_json)
    messages = sample_stream(n, seed).messages
    producer = open_producer(bus)
    ready.set()
    go.wait()
    t0 = time.time()
    for key, value in messages:
        producer.send(topic, value, key=key)
    producer.flush()
    t1 = time.time()
    producer.close()
    out.put((t0, t1))


class _Producer:
    def __init__(self, bus, topic: str, n: int, seed: int) -> None:
        ctx = mp.get_context("spawn")
        self.ready, self.go, self.out = ctx.Event(), ctx.Event(), ctx.Queue()
        secret_bus = bus.model_dump_json()
        if bus.sasl_password is not None:  # model_dump_json masks secrets; the child needs the real one

            data = json.loads(secret_bus)
            data["sasl_password"] = bus.sasl_password.get_secret_value()
            secret_bus = json.dumps(data)
        self.proc = ctx.Process(target=_produce, args=(secret_bus, topic, n, seed, self.ready, self.go, self.out),
                                daemon=True)
        self.proc.start()
        if not self.ready.wait(120):
            self.proc.kill()
            raise RuntimeError("benchmark producer did not start")

    def start(self) -> None:
        self.go.set()

    def result(self, timeout: float = 300) -> tuple[float, float]:
        t0, t1 = self.out.get(timeout=timeout)
        self.proc.join(10)
        return t0, t1


def _consume_only(settings, topic: str, n: int, timeout_s: float) -> tuple[float, float]:
    """Poll + decode ``n`` records from offset 0; returns (wall-clock time the last one was decoded,
    CPU seconds this process spent)."""

    consumer = open_consumer(settings.bus, f"bench-ceiling-{uuid.uuid4().hex[:6]}")
    try:
        consumer.assign({(topic, p): 0 for p in consumer.partitions(topic)})
        seen, deadline, cpu0 = 0, time.monotonic() + timeout_s, time.process_time()
        max_bytes = settings.ingest.max_event_bytes
        while seen < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"consumer-only pass saw {seen} of {n} records")
            for record in consumer.poll(timeout_s=0.5, max_records=settings.ingest.batch_max_records):
                decode_record(record, max_bytes)
                seen += 1
        return time.time(), time.process_time() - cpu0
    finally:
        consumer.close()


def _backend_cpu_s(engine) -> Callable[[], float]:
    """CPU seconds used so far by this database's PostgreSQL server processes (0 for SQLite, which
    runs inside the ingester and is counted there). Read from /proc: the server is on this machine."""

    if engine.dialect.name != "postgresql":
        return lambda: 0.0
    with engine.connect() as conn:
        pids = [r[0] for r in conn.execute(sa.text(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"))]
    ticks = os.sysconf("SC_CLK_TCK")

    def total() -> float:
        used = 0
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            used += int(fields[11]) + int(fields[12])  # utime + stime
        return used / ticks

    return total


def _ingest(settings, n: int, timeout_s: float, on_ready: Callable[[], None] | None = None) -> tuple[float, Any, dict]:
    """Run the ingester until ``n`` records are committed; returns (wall time of last commit, stats,
    CPU seconds of the ingester's processes (its writer process's also apart) and of its database
    server processes)."""

    ingester = Ingester(settings)
    try:
        ingester._attach()  # schema, positions and topics ready before the clock starts
        stop = threading.Event()
        deadline = time.monotonic() + timeout_s

        def watch() -> None:
            while not stop.is_set():
                if ingester.stats.records >= n or time.monotonic() > deadline:
                    stop.set()
                time.sleep(0.005)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        backend_cpu = _backend_cpu_s(ingester.engine)
        cpu0, db0, writer0 = time.process_time(), backend_cpu(), ingester.writer_cpu_s
        if on_ready is not None:
            on_ready()
        ingester.run(stop)
        watcher.join()
        writer = ingester.writer_cpu_s - writer0
        cpu = {"ingester": time.process_time() - cpu0 + writer, "writer": writer, "database": backend_cpu() - db0}
        if ingester.stats.records < n:
            raise TimeoutError(f"ingested {ingester.stats.records} of {n} records in {timeout_s} s")
        last_commit = time.time() - (time.monotonic() - ingester.stats.last_commit_s)
        return last_commit, ingester.stats, cpu
    finally:
        ingester.close()


def _check_rows(url: str, stream) -> bool:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            counts = {name: conn.execute(sa.text(f"SELECT COUNT(*) FROM {name}")).scalar_one()
                      for name in ("completions", "feedback", "training_examples")}
    finally:
        engine.dispose()
    return counts == {"completions": len(stream.completions), "feedback": len(stream.feedback),
                      "training_examples": len(stream.expected_examples())}


def _rate(n: int, seconds: float) -> float:
    return round(n / seconds, 1) if seconds > 0 else float("inf")


def run(settings, quick: bool = False, log: Callable[[str], None] = print,
        buses: tuple[str, ...] = ("kafka", "embedded")) -> dict[str, Any]:
    """``buses``: the bus rows to measure (all of them from ``rtrl bench``; one, to iterate on it)."""

    n = 5_000 if quick else 50_000
    seed = 7
    stream = sample_stream(n, seed)  # the same stream the producer process builds (same seed)
    # The reference stream (~50k pydantic events) and the imports only live on: frozen, the cyclic
    # collector no longer scans them. Unfrozen, a full collection every few runs scanned them all
    # and stopped the measured pass for 0.1-0.24 s (measured inside the ~1 s consumer-only pass and
    # inside ingest runs): noise in whichever measurement it hit, the ceiling included.
    gc.collect()
    gc.freeze()
    try:
        return _run(settings, quick, log, buses, n, seed, stream)
    finally:
        gc.unfreeze()


def _run(settings, quick: bool, log: Callable[[str], None], buses: tuple[str, ...], n: int, seed: int,
         stream) -> dict[str, Any]:
    mean_bytes = sum(len(v) for _, v in stream.messages) / n
    log(f"ingest bench: {n} events per run ({mean_bytes:.0f} B mean; {len(stream.completions)} completions, "
        f"{len(stream.feedback)} feedback)")
    pg_admin = os.environ.get("BENCH_PG_ADMIN_URL", devservices.DEFAULT_PG_ADMIN_URL)
    results = []
    with ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rtrl-bench-ingest-")))
        configured: dict[str, Any] = {"embedded": settings.bus.model_copy(
            update={"backend": "embedded", "embedded_path": str(root / "bus.db")})}
        if "kafka" in buses:  # a broker only when the Kafka row is measured
            if settings.bus.backend == "kafka":
                configured["kafka"] = settings.bus
            else:
                broker = devservices.start_tansu_broker()
                stack.callback(broker.stop)
                configured["kafka"] = settings.bus.model_copy(update={"backend": "kafka",
                                                                      "bootstrap_servers": broker.bootstrap})
        for bus_name in buses:
            bus = configured[bus_name]

            def fresh(db_url: str, bus=bus) -> Any:
                topic = f"bench-{uuid.uuid4().hex[:8]}"
                return settings.model_copy(update={
                    "bus": bus.model_copy(update={"events_topic": topic, "versions_topic": topic + "-versions"}),
                    "db": settings.db.model_copy(update={"url": SecretStr(db_url), "auto_migrate": True}),
                    "ingest": settings.ingest.model_copy(update={"group": f"bench-{uuid.uuid4().hex[:6]}"}),
                })

            # Ceiling: the same producer, consumed without a database.
            s = fresh("sqlite://")

            with open_consumer(s.bus, "bench-setup") as c:
                c.partitions(s.bus.events_topic)  # create the topic before the clock starts
            producer = _Producer(s.bus, s.bus.events_topic, n, seed)
            producer.start()
            t_done, _ = _consume_only(s, s.bus.events_topic, n, timeout_s=300)
            t0, t1 = producer.result()
            ceiling = _rate(n, t_done - t0)
            producer_rate = _rate(n, t1 - t0)
            t_start = time.time()
            t_done, ceiling_cpu = _consume_only(s, s.bus.events_topic, n, timeout_s=300)
            backlog_ceiling = _rate(n, t_done - t_start)
            ceiling_cpu_us = ceiling_cpu / n * 1e6
            log(f"{bus_name}: producer {producer_rate:.0f}/s, consumer-only ceiling {ceiling:.0f}/s "
                f"(backlog {backlog_ceiling:.0f}/s)")
            for db_name in ("sqlite", "postgresql"):
                if db_name == "sqlite":
                    url = f"sqlite:///{root / f'{bus_name}-{uuid.uuid4().hex[:6]}.db'}"
                else:
                    url = stack.enter_context(devservices.temporary_postgres_database(pg_admin, "rtrl_bench"))
                s = fresh(url)
                producer = _Producer(s.bus, s.bus.events_topic, n, seed)
                t_last, stats, _ = _ingest(s, n, timeout_s=600, on_ready=producer.start)
                t0, t1 = producer.result()
                rows_ok = _check_rows(url, stream)
                rate = _rate(n, t_last - t0)
                # Backlog: a second, empty database catching up on the now-full topic.
                if db_name == "sqlite":
                    url2 = f"sqlite:///{root / f'{bus_name}-{uuid.uuid4().hex[:6]}.db'}"
                else:
                    url2 = stack.enter_context(devservices.temporary_postgres_database(pg_admin, "rtrl_bench"))
                s2 = s.model_copy(update={"db": s.db.model_copy(update={"url": SecretStr(url2)}),
                                          "ingest": s.ingest.model_copy(update={"group": "bench-backlog"})})
                starts: list[float] = []
                t_last2, _, cpu = _ingest(s2, n, timeout_s=600,
                                          on_ready=lambda starts=starts: starts.append(time.time()))
                ingest_cpu_us = cpu["ingester"] / n * 1e6
                db_cpu_us = cpu["database"] / n * 1e6
                backlog = _rate(n, t_last2 - starts[0])
                rows_ok = rows_ok and _check_rows(url2, stream)
                log(f"{bus_name} -> {db_name}: {rate:.0f} events/s end to end ({rate / ceiling:.0%} of ceiling), "
                    f"backlog {backlog:.0f}/s, {stats.transactions} transactions, rows ok: {rows_ok}")
                results.append({
                    "bus": bus_name, "db": db_name, "events": n, "events_per_s": rate,
                    "ceiling_events_per_s": ceiling, "fraction_of_ceiling": round(rate / ceiling, 3),
                    "producer_events_per_s": producer_rate, "backlog_events_per_s": backlog,
                    "backlog_ceiling_events_per_s": backlog_ceiling,
                    "backlog_fraction_of_ceiling": round(backlog / backlog_ceiling, 3),
                    "transactions": stats.transactions, "rows_ok": rows_ok,
                    # Load-independent view (backlog runs): CPU per event of the consumer-only pass,
                    # of the ingester's processes (its writer process's part also alone), and of the
                    # PostgreSQL server (SQLite is in-process).
                    "ceiling_cpu_us_per_event": round(ceiling_cpu_us, 1),
                    "ingest_cpu_us_per_event": round(ingest_cpu_us, 1),
                    "ingest_writer_cpu_us_per_event": round(cpu["writer"] / n * 1e6, 1),
                    "db_server_cpu_us_per_event": round(db_cpu_us, 1),
                    "cpu_fraction_of_ceiling": round(ceiling_cpu_us / (ingest_cpu_us + db_cpu_us), 3),
                })
    pg = [r for r in results if r["db"] == "postgresql"]
    return {
        "events": n, "event_bytes_mean": round(mean_bytes, 1),
        "batch_max_records": settings.ingest.batch_max_records, "partitions": settings.bus.partitions,
        "results": results,
        "goals": {"postgresql_events_per_s": GOAL_PG_EVENTS_PER_S, "fraction_of_ceiling": GOAL_FRACTION_OF_CEILING},
        "goals_met": {
            "postgresql_events_per_s": all(r["events_per_s"] >= GOAL_PG_EVENTS_PER_S for r in pg),
            "fraction_of_ceiling": all(r["fraction_of_ceiling"] >= GOAL_FRACTION_OF_CEILING for r in results),
        },
    }
