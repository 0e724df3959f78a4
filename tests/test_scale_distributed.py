"""Trainers under torchrun on CPU (gloo, FSDP2), two ranks against one process on the same global
batches: loss curves equal to 1e-4 relative for mid-training and the online update (five steps each,
tests/distributed_helper.py) and for GRPO (six steps through a run with one rank SIGKILLed after a
checkpoint, resumed by ``torchrun -m rtrl grpo`` from the sharded checkpoint on every rank); each rank
holds half the parameters; a rank that cannot reach the rendezvous fails with a clear error in time.

The two launches of the two-rank job are shared by the tests of this module (a fixture)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.distributed_helper import run as run_helper

REPO = Path(__file__).resolve().parent.parent
GRPO_ENV = {"RTRL_GRPO__MODE": "sync", "RTRL_GRPO__CHECKPOINT_EVERY": "2", "RTRL_GRPO__EVAL_EVERY": "0",
            "RTRL_GRPO__PROMPTS_PER_STEP": "4", "RTRL_GRPO__GROUP_SIZE": "4", "RTRL_GRPO__MAX_NEW_TOKENS": "6",
            "RTRL_GRPO__MICRO_BATCH": "5", "RTRL_GRPO__LR": "1e-3", "RTRL_GRPO__TRAINABLE": ".",
            "RTRL_GRPO__STEPS": "6", "RTRL_REWARDS__REQUIRE_PASS": "false", "RTRL_EVAL__SAMPLES": "1",
            "RTRL_EVAL__K": "[1]", "RTRL_SANDBOX__POOL_SIZE": "1", "RTRL_ENV__KIND": "functions"}
STEPS = 6


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]


def _children(pid: int) -> list[int]:
    """Process ids of ``pid``'s children (Linux)."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def close(a: float, b: float) -> bool:
    """Equal to 1e-4 relative (and 1e-7 absolute, for values that are zero up to rounding)."""
    return abs(a - b) <= 1e-4 * max(abs(a), abs(b)) + 1e-7


@dataclass
class TwoRanks:
    root: Path
    helper: dict
    killed_at: int
    resumed: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory) -> TwoRanks:
    """Launch 1: mid-training and update steps, then GRPO, until one rank is SIGKILLed after a GRPO
    checkpoint; launch 2: `torchrun -m rtrl grpo` resumes the run."""
    root = tmp_path_factory.mktemp("two_ranks")
    run = root / "grpo"
    env = {**os.environ, **GRPO_ENV, "RTRL_GRPO__OUT_DIR": str(run), "RTRL_VAR_DIR": str(root / "var"),
           "PYTHONPATH": str(REPO)}
    env.pop("RTRL_CONFIG", None)
    first = subprocess.Popen(torchrun(str(REPO / "tests" / "distributed_helper.py"), str(tiny_model_dir), str(root),
                                      "--then-grpo"),
                             env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    latest = run / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while not (latest.is_file() and latest.read_text().strip() >= "step-000002"):
        assert first.poll() is None, first.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline, "no GRPO checkpoint at step 2 in time"
        time.sleep(0.05)
    ranks = _children(first.pid)
    assert len(ranks) == 2, ranks
    os.kill(ranks[-1], signal.SIGKILL)  # one rank dies; torchrun stops the other and fails
    assert first.wait(60) != 0
    killed_at = int(latest.read_text().strip().split("-")[1])
    resumed = subprocess.run(torchrun("-m", "rtrl", "grpo", "--init", str(tiny_model_dir), "--no-progress",
                                      "--no-publish", "--json"),
                             env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return TwoRanks(root, json.loads((root / "result.json").read_text()), killed_at, resumed)


def test_midtrain_and_update_two_ranks_match_one_process(two_ranks, tiny_model_dir, tmp_path):
    from policy.distributed import shutdown

    shutdown()
    one, two = run_helper(tiny_model_dir, tmp_path), two_ranks.helper
    assert two["ranks"] == 2 and one["ranks"] == 1
    assert two["param_fraction_per_rank"] == [pytest.approx(0.5, abs=0.01)] * 2
    assert one["param_fraction_per_rank"] == [1.0]
    for name in ("midtrain_losses", "update_losses"):
        assert len(one[name]) == len(two[name]) == 5
        assert all(close(a, b) for a, b in zip(one[name], two[name], strict=True)), (name, one[name], two[name])
    assert one["midtrain_losses"][-1] < one["midtrain_losses"][0]  # it trained


def test_grpo_two_ranks_killed_and_resumed_match_one_process(two_ranks, tiny_model_dir, tmp_path, monkeypatch):
    from offline_rl.grpo import run_grpo
    from policy.distributed import shutdown
    from rtrl.config import load_settings

    run, k, out = two_ranks.root / "grpo", two_ranks.killed_at, two_ranks.resumed
    assert k < STEPS, "the run finished before the kill"
    assert f"resumed from {run / 'checkpoints' / f'step-{k:06d}'} (step {k}, version" in out.stderr
    assert "all 2 ranks" in out.stderr and "0.500 of the parameters on rank 0" in out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1 and json.loads(lines[0])["steps"] == STEPS  # rank 0 alone prints the result
    two = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))

    # One process, interrupted at the same step (a resumed run draws its tasks from the step it resumed at).
    shutdown()
    for name, value in {**GRPO_ENV, "RTRL_GRPO__OUT_DIR": str(tmp_path / "one"),
                        "RTRL_VAR_DIR": str(tmp_path / "var")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RTRL_CONFIG", raising=False)
    for steps in (k, STEPS):
        s = load_settings()
        s.grpo.steps = steps
        run_grpo(s, tiny_model_dir, progress=False, resume=True)
    one = [json.loads(ln) for ln in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in one] == list(range(1, STEPS + 1))
    assert sum(r["updated"] for r in one) >= 3, "too few steps with a learning signal to compare"
    for a, b in zip(one, two, strict=True):
        assert a["updated"] == b["updated"] and a["reward_mean"] == b["reward_mean"]
        if a["updated"]:
            assert close(a["loss"], b["loss"]), (a["step"], a["loss"], b["loss"])
            assert close(a["grad_norm"], b["grad_norm"]), (a["step"], a["grad_norm"], b["grad_norm"])


def test_unreachable_rendezvous_fails_clearly_within_the_timeout(monkeypatch):
    from policy.config import DistributedSettings
    from policy.distributed import DistributedError, RendezvousError, setup, shutdown

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shutdown()
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    try:
        t0 = time.monotonic()
        with pytest.raises(RendezvousError) as err:
            setup(DistributedSettings(rendezvous_timeout_s=1.5))
        assert time.monotonic() - t0 < 1.5 + 1.0
        assert f"rank 1 of 2: rendezvous at 127.0.0.1:{port}" in str(err.value)
        assert "rendezvous_timeout_s=1.5" in str(err.value)
        with pytest.raises(DistributedError, match="mode = 'off' but torchrun started 2 ranks"):
            setup(DistributedSettings(mode="off"))
        monkeypatch.delenv("WORLD_SIZE")
        with pytest.raises(DistributedError, match="needs a launch by torchrun"):
            setup(DistributedSettings(mode="on"))
    finally:
        shutdown()
