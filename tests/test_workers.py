"""Async rollout transport: one pipe per worker into the trainer, slots bounding the batches in
flight. With several workers every one is served; a worker that dies is reported, not waited for."""

from __future__ import annotations

import os
import signal
import time

import pytest

from offline_rl.presets import apply_preset
from offline_rl.splits import load_task_split
from offline_rl.workers import AsyncRollouts, WorkerConfig
from policy.loading import load_policy
from rtrl.config import load_settings


def start(model_dir, workers: int, queue_size: int) -> AsyncRollouts:
    s = apply_preset(load_settings(), "functions")
    split = load_task_split(s.tasks)
    cfgs = [WorkerConfig(worker_id=i, model_dir=str(model_dir), engine="torch", env_settings=s.env.model_dump(),
                         sandbox_settings={**s.sandbox.model_dump(), "pool_size": 1},
                         reward_settings={**s.rewards.model_dump(), "require_pass": False},
                         judge_settings={**s.judge.model_dump(), "api_key": "none"}, prompts_per_batch=1,
                         group_size=2, temperature=1.0, max_new_tokens=4, seed=3)
            for i in range(workers)]
    model = load_policy(model_dir).model
    return AsyncRollouts(model, cfgs, split.train[:8], queue_size=queue_size)


def test_every_worker_is_served_and_batches_carry_their_phase_times(tiny_model_dir):
    rollouts = start(tiny_model_dir, workers=2, queue_size=2)
    batches = []
    try:
        # The first worker up may take both slots while the other still loads its model: keep
        # consuming (a liveness bound, not a speed check) until the second one gets a turn.
        end = time.monotonic() + 120
        while len({b.worker for b in batches}) < 2 and time.monotonic() < end:
            batches.append(rollouts.get(timeout=120))
    finally:
        rollouts.close()
    assert {b.worker for b in batches} == {0, 1}
    for b in batches:
        assert len(b.trajectories) == 2 and b.version == 0
        assert {"cpu_s", "sandbox_cpu_s", "slot_wait_s", "sync_s", "ready_at"} <= b.info.keys()
    assert rollouts.received_at >= max(b.info["ready_at"] for b in batches)
    assert not any(p.is_alive() for p in rollouts.procs)


def test_a_killed_worker_is_reported_instead_of_waited_for(tiny_model_dir):
    rollouts = start(tiny_model_dir, workers=1, queue_size=1)
    try:
        rollouts.get(timeout=120)
        os.kill(rollouts.procs[0].pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="exited with code -9"):
            rollouts.get(timeout=60)
    finally:
        rollouts.close()


def test_a_waiting_trainer_lets_the_worker_sample_ahead_and_a_busy_one_keeps_the_slot_bound(tiny_model_dir):
    rollouts = start(tiny_model_dir, workers=1, queue_size=1)
    model = load_policy(tiny_model_dir).model
    try:
        # A trainer always waiting in get(): each batch after the first is started while the one
        # before it is still being scored and sent, and every batch arrives whole, in order.
        batches = []
        for v in range(1, 7):
            batches.append(rollouts.get(timeout=120))
            rollouts.publish(model, v)
        # A busy trainer: nobody takes a batch for 2 s. With one slot one batch waits and the
        # worker waits too, instead of sampling another (which would be staler still).
        time.sleep(2.0)
        parked = rollouts.get(timeout=60)
        after = rollouts.get(timeout=60)
    finally:
        rollouts.close()
    assert sum(b.info["started_early"] for b in batches[1:]) >= 3
    for b in [*batches, parked, after]:
        assert len(b.trajectories) == 2 and b.info["sandbox_cpu_s"] >= 0 and b.info["cpu_s"] > 0
        assert all(t.parts for t in b.trajectories)  # rewards assigned before the batch was sent
    versions = [b.version for b in [*batches, parked, after]]
    assert versions == sorted(versions)
    assert not after.info["started_early"] and after.info["slot_wait_s"] > 1.0
