"""Rollout workers anywhere: `rtrl rollout-worker` follows the registry's rollout channel and sends
batches over the shared-directory transport to a GRPO trainer in remote mode; the trainer refuses (and
logs) a batch stamped with a version it never published and one that is not a batch at all. The
bus transport carries the same bytes over the Kafka-protocol broker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zstandard

from offline_rl.remote import BadBatch, BusTransport, decode_batch, encode_batch
from offline_rl.rollout import Trajectory
from offline_rl.tasks import Task
from offline_rl.tasks import TestCase as Case
from offline_rl.workers import RolloutBatch
from policy.routes import Routes

REPO = Path(__file__).resolve().parent.parent
TASK = Task(task_id="t", prompt="# f(0)=1\ndef f(x): return ", tests=[Case([1], 2)], metadata={"split": "train"})


def _batch() -> RolloutBatch:
    trajs = [Trajectory(task=TASK, prompt_ids=[5, 6, 7], completion_ids=[8, 9], action_mask=[True, True],
                        behaviour_logprobs=[-0.5, -1.25], submission="x+1", turns=1, reward=0.25,
                        parts={"tests": 0.25}, passed=False)] * 2
    return RolloutBatch(version=3, trajectories=trajs, gen_s=0.5, tokens=4, info={"sandbox_cpu_s": 0.01})


def test_remote_workers_feed_the_trainer_and_unknown_versions_are_refused(tiny_model_dir, tmp_path, monkeypatch):
    from offline_rl.grpo import run_grpo
    from policy.distributed import shutdown
    from rtrl.config import load_settings

    env = {"RTRL_GRPO__MODE": "remote", "RTRL_GRPO__STEPS": "3", "RTRL_GRPO__PROMPTS_PER_STEP": "4",
           "RTRL_GRPO__GROUP_SIZE": "4", "RTRL_GRPO__MAX_NEW_TOKENS": "6", "RTRL_GRPO__LR": "1e-3",
           "RTRL_GRPO__TRAINABLE": ".", "RTRL_GRPO__EVAL_EVERY": "0", "RTRL_GRPO__OUT_DIR": str(tmp_path / "run"),
           "RTRL_REWARDS__REQUIRE_PASS": "false", "RTRL_SANDBOX__POOL_SIZE": "1",
           "RTRL_REGISTRY__URL": str(tmp_path / "registry"), "RTRL_REGISTRY__CACHE_DIR": str(tmp_path / "cache"),
           "RTRL_ROLLOUT__TRANSPORT": "dir", "RTRL_ROLLOUT__DIR": str(tmp_path / "rollouts"),
           "RTRL_ROLLOUT__POLL_INTERVAL_S": "0.1", "RTRL_VAR_DIR": str(tmp_path / "var"),
           "RTRL_ENV__KIND": "functions"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RTRL_CONFIG", raising=False)
    # Waiting in the directory before the trainer starts: a batch for a version nobody published, and junk.
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "0-forged-1.rtb").write_bytes(encode_batch(_batch(), "f" * 12, "intruder"))
    (tmp_path / "rollouts" / "0-junk-1.rtb").write_bytes(b"not a batch")
    worker = subprocess.Popen([sys.executable, "-m", "rtrl", "rollout-worker", "--worker-id", "w1", "--json"],
                              env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    logs: list[str] = []
    try:
        shutdown()
        result = run_grpo(load_settings(), tiny_model_dir, progress=False, log=logs.append,
                          evaluate_before=False, evaluate_after=False)
    finally:
        worker.send_signal(signal.SIGTERM)
        out, err = worker.communicate(timeout=120)
    assert worker.returncode == 0, err[-3000:]
    assert result.steps == 3
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["worker_id"] == "w1" and stats["batches"] >= 3 and stats["versions"] >= 2
    assert "rollout-worker w1: sampling with" in err

    refused = [m for m in logs if "refused a rollout batch" in m]
    assert len(refused) == 2, logs
    assert any("worker 'intruder'" in m and "f" * 12 in m and "never published" in m for m in refused)
    assert any("undecodable" in m for m in refused)
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(0 <= r["staleness"] <= 1 for r in rows)  # grpo.max_staleness applies unchanged
    assert rows[-1]["refused_batches"] == 2
    state = json.loads((tmp_path / "run" / "result.json").read_text())
    assert state["steps"] == 3


@pytest.mark.kafka
def test_bus_transport_carries_batches_over_kafka(kafka_bootstrap, tmp_path):
    from rtrl.config import load_settings

    s = load_settings(var_dir=str(tmp_path / "var"), bus={"backend": "kafka", "bootstrap_servers": kafka_bootstrap})
    topic = f"rollouts-{tmp_path.name[-8:]}"
    receiver = BusTransport(s.bus, topic, receiver=True)
    sender = BusTransport(s.bus, topic, receiver=False)
    try:
        payloads = [encode_batch(_batch(), "abc123", "w1"), encode_batch(_batch(), "abc124", "w2")]
        for p in payloads:
            sender.send(p, "w1")
        got: list[bytes] = []
        for _ in range(50):
            got += receiver.receive(0.2)
            if len(got) == 2:
                break
        assert sorted(got) == sorted(payloads)
        version, worker, batch = decode_batch(got[0] if got[0] == payloads[0] else got[1], 1 << 20)
        assert (version, worker) == ("abc123", "w1") and batch == _batch()
        with pytest.raises(BadBatch):
            decode_batch(payloads[0], 64)  # larger than the receiver accepts
    finally:
        sender.close()
        receiver.close()


def test_mixture_of_experts_routes_travel_packed_and_a_bad_record_is_refused():
    ids = np.random.default_rng(0).integers(0, 4, size=(4, 2, 2), dtype=np.uint8)
    tr = Trajectory(task=TASK, prompt_ids=[5, 6, 7], completion_ids=[8, 9], routes=Routes(ids, 4),
                    action_mask=[True, True], behaviour_logprobs=[-0.5, -1.25], turns=1)
    payload = encode_batch(RolloutBatch(version=1, trajectories=[tr], gen_s=0.1), "v1", "w1")
    _, _, batch = decode_batch(payload, 1 << 20)
    got = batch.trajectories[0].routes
    assert got is not None and got.same_as(tr.routes)
    body = json.loads(zstandard.ZstdDecompressor().decompress(payload))
    body["batch"]["trajectories"][0]["routes"]["data"] = "not base64!"
    bad = zstandard.ZstdCompressor().compress(json.dumps(body).encode())
    with pytest.raises(BadBatch, match="routes"):
        decode_batch(bad, 1 << 20)
