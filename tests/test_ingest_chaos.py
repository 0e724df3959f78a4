"""Done-when: exactly-once ingestion against the real broker and PostgreSQL while the ingester is
SIGKILLed at random points and the network path to the broker is cut for ~10 s.

The producer plays the gateway: it sends 10k events (completions, feedback, out-of-order feedback,
revised feedback) keyed by completion id through a Tansu proxy, and when a flush fails it resends
everything since the last good flush (so the log holds duplicates). The ingester is a separate
process (``rtrl ingest``). The Tansu test broker keeps its log only in memory, so
the path is cut by stopping the proxy, not the broker. Afterwards every event is in the tables
exactly once, and the joins are the ones the stream implies.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from realtime_rl.bus import BusUnavailable, open_producer
from realtime_rl.config import BusSettings
from realtime_rl.event_samples import sample_stream
from realtime_rl.schema import upgrade
from rtrl import devservices
from tests.ingest_fixtures import counts, rows

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

N_EVENTS = 10_000
RATE_PER_S = 450
KILLS = 4
CUT_AT_S, CUT_FOR_S = 7.0, 10.0


class GatewayLikeProducer(threading.Thread):
    """Sends at a steady pace; on a failed flush, resends everything since the last good flush."""

    def __init__(self, bus: BusSettings, topic: str, messages: list[tuple[bytes, bytes]]) -> None:
        super().__init__(daemon=True)
        self.bus, self.topic, self.messages = bus, topic, messages
        self.failed_flushes = 0
        self.resent = 0
        self.sent = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            producer = open_producer(self.bus)
            start, i, chunk = time.monotonic(), 0, 50
            while i < len(self.messages):
                batch = self.messages[i:i + chunk]
                while True:
                    try:
                        for key, value in batch:
                            producer.send(self.topic, value, key=key)
                        producer.flush()
                        break
                    except BusUnavailable:
                        self.failed_flushes += 1
                        self.resent += len(batch)
                        time.sleep(0.2)
                i += len(batch)
                self.sent = i
                ahead = i / RATE_PER_S - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)
            producer.close()
        except BaseException as err:  # surfaced by the test
            self.error = err


def test_every_event_lands_exactly_once_despite_kills_and_a_network_cut(
        kafka_bootstrap: str, postgres_url: str, tmp_path: Path) -> None:
    rng = random.Random(1234)
    proxy = devservices.start_tansu_proxy(kafka_bootstrap)
    topic = f"chaos-{uuid.uuid4().hex[:8]}"
    env = {**os.environ,
           "RTRL_BUS__BACKEND": "kafka", "RTRL_BUS__BOOTSTRAP_SERVERS": proxy.bootstrap,
           "RTRL_BUS__EVENTS_TOPIC": topic, "RTRL_BUS__VERSIONS_TOPIC": topic + "-versions",
           "RTRL_BUS__SEND_TIMEOUT_S": "2", "RTRL_BUS__REQUEST_TIMEOUT_MS": "1500",
           "RTRL_BUS__RECONNECT_BACKOFF_MAX_MS": "300", "RTRL_DB__URL": postgres_url,
           "RTRL_INGEST__BATCH_MAX_RECORDS": "400", "RTRL_INGEST__POLL_TIMEOUT_S": "0.3",
           "RTRL_INGEST__RETRY_BACKOFF_S": "0.3", "RTRL_INGEST__LOG_EVERY_S": "2",
           "RTRL_VAR_DIR": str(tmp_path / "var")}
    env.pop("RTRL_CONFIG", None)
    upgrade(postgres_url)
    stream = sample_stream(N_EVENTS, seed=11, prefix=f"chaos{uuid.uuid4().hex[:4]}-")
    bus = BusSettings(backend="kafka", bootstrap_servers=proxy.bootstrap, partitions=4, send_timeout_s=2,
                      request_timeout_ms=1000, delivery_timeout_ms=3000, reconnect_backoff_max_ms=300)
    logs = open(tmp_path / "ingester.log", "ab")  # noqa: SIM115 (kept open across restarts)

    def start_ingester() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "rtrl", "ingest"], env=env, stdout=logs, stderr=logs)

    producer = GatewayLikeProducer(bus, topic, stream.messages)
    ingester = start_ingester()
    t0 = time.monotonic()
    producer.start()
    kills_mid_stream = 0
    cut_done = False
    timeline: list[str] = []

    def mark(what: str) -> None:
        timeline.append(f"{time.monotonic() - t0:.1f}s {what} (sent {producer.sent})")

    def wait_for_progress(timeout_s: float = 15.0) -> None:
        """Kill only once the (re)started ingester has committed something: kills land mid-work."""
        before = counts(postgres_url, "completions")["completions"]
        deadline = time.monotonic() + timeout_s
        while counts(postgres_url, "completions")["completions"] == before and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))

    try:
        for _ in range(KILLS):
            wait_for_progress()
            if not cut_done and time.monotonic() - t0 >= CUT_AT_S:
                proxy.stop()
                mark("cut")
                time.sleep(CUT_FOR_S / 2)
                ingester.send_signal(signal.SIGKILL)  # a kill while the path is down, too
                ingester.wait(10)
                ingester = start_ingester()
                mark("kill during cut")
                time.sleep(CUT_FOR_S / 2)
                proxy.start()
                mark("restored")
                cut_done = True
                continue
            done = counts(postgres_url, "completions")["completions"]
            ingester.send_signal(signal.SIGKILL)
            ingester.wait(10)
            mark(f"kill at {done} completions")
            kills_mid_stream += 0 < done < len(stream.completions)
            ingester = start_ingester()
        if not cut_done:
            time.sleep(max(0.0, CUT_AT_S - (time.monotonic() - t0)))
            proxy.stop()
            mark("cut")
            time.sleep(CUT_FOR_S)
            proxy.start()
            mark("restored")
        producer.join(90)
        assert not producer.is_alive() and producer.error is None, \
            f"{producer.error!r}; sent {producer.sent}, failed flushes {producer.failed_flushes}, timeline {timeline}"
        ingester.send_signal(signal.SIGKILL)  # one more kill, wherever it is, then catch up
        ingester.wait(10)
        drain = subprocess.run([sys.executable, "-m", "rtrl", "ingest", "--once"], env=env, timeout=120,
                               capture_output=True, text=True)
        assert drain.returncode == 0, drain.stderr[-2000:]
    finally:
        if ingester.poll() is None:
            ingester.kill()
            ingester.wait(10)
        proxy.stop()
        logs.close()
    elapsed = time.monotonic() - t0

    # The chaos really happened: kills landed mid-stream, and the cut made the producer resend.
    assert kills_mid_stream >= 2
    assert producer.failed_flushes >= 1 and producer.resent > 0

    # Every event exactly once.
    stored_completions = {r[0] for r in rows(postgres_url, "SELECT event_id FROM completions")}
    stored_feedback = {r[0] for r in rows(postgres_url, "SELECT event_id FROM feedback")}
    assert counts(postgres_url, "completions", "feedback", "dead_letters") == {
        "completions": len(stream.completions), "feedback": len(stream.feedback), "dead_letters": 0}
    assert stored_completions == {c.event_id for c in stream.completions.values()}
    assert stored_feedback == set(stream.feedback)
    # The joins: one example per completion with feedback, carrying the newest judgement.
    examples = dict(rows(postgres_url, "SELECT completion_id, feedback_event_id FROM training_examples"))
    assert examples == {cid: fb.event_id for cid, fb in stream.expected_examples().items()}
    pending = {r[0] for r in rows(postgres_url, "SELECT completion_id FROM pending_feedback")}
    assert pending == {fb.completion_id for fb in stream.feedback.values()} - set(stream.completions)
    assert elapsed < 120
