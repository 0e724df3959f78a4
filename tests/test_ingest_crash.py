"""The default deployment (embedded bus, SQLite): an ingester SIGKILLed at random points while it
catches up on a backlog, restarted each time, still writes every event exactly once."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from realtime_rl.event_samples import sample_stream
from realtime_rl.schema import upgrade
from tests.ingest_fixtures import counts, make_settings, rows, send


def test_sigkill_during_ingest_leaves_every_event_exactly_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'feedback.db'}"
    s = make_settings(tmp_path, url)
    upgrade(url)
    stream = sample_stream(6000, seed=5)
    send(s, stream.messages)
    env = {**os.environ, "RTRL_BUS__EMBEDDED_PATH": s.bus.embedded_path, "RTRL_BUS__EVENTS_TOPIC": s.bus.events_topic,
           "RTRL_BUS__VERSIONS_TOPIC": s.bus.versions_topic, "RTRL_BUS__PARTITIONS": "3", "RTRL_DB__URL": url,
           "RTRL_INGEST__BATCH_MAX_RECORDS": "150", "RTRL_INGEST__POLL_TIMEOUT_S": "0.2",
           "RTRL_VAR_DIR": str(tmp_path / "var")}
    env.pop("RTRL_CONFIG", None)
    rng = random.Random(7)
    killed_mid_way = 0
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-m", "rtrl", "ingest"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        before = counts(url, "completions")["completions"]
        # At a random share of the work left, not after a random delay: a delay that used to land
        # mid-way let a faster ingester finish first.
        target = before + rng.uniform(0.05, 0.5) * (len(stream.completions) - before)
        deadline = time.monotonic() + 20
        while counts(url, "completions")["completions"] < target and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        done = counts(url, "completions")["completions"]
        killed_mid_way += before < done < len(stream.completions)
    assert killed_mid_way >= 2, "the kills did not land while the ingester was working"
    subprocess.run([sys.executable, "-m", "rtrl", "ingest", "--once"], env=env, check=True, timeout=120,
                   capture_output=True)
    assert counts(url, "completions", "feedback", "training_examples", "dead_letters") == {
        "completions": len(stream.completions), "feedback": len(stream.feedback),
        "training_examples": len(stream.expected_examples()), "dead_letters": 0}
    examples = dict(rows(url, "SELECT completion_id, feedback_event_id FROM training_examples"))
    assert examples == {cid: fb.event_id for cid, fb in stream.expected_examples().items()}
    offsets = sum(r[0] for r in rows(url, "SELECT next_offset FROM consumer_offsets"))
    assert offsets == len(stream.messages)
