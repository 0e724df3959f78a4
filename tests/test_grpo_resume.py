"""`rtrl grpo` killed with SIGKILL mid-run (mid-episode: most of a step is multi-turn agent episodes on
the long-horizon ``trace`` family under a context budget, so episodes are split into segments by
summary turns) resumes from its last checkpoint: no step lost past the checkpoint, none logged twice,
optimizer and counters restored."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from offline_rl.agent_env import RepoEnv, TrustedTests, header
from offline_rl.repo_tasks import generate_repo_tasks
from offline_rl.rollout import min_budget
from policy.loading import load_tokenizer


def test_resume_after_kill(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    tok, split = load_tokenizer(tiny_model_dir), generate_repo_tasks(seed=0, families=("trace",), heldout_per_family=1)
    prompt = max(len(tok(header(t), add_special_tokens=False)["input_ids"]) for t in [*split.train, *split.heldout])
    budget = min_budget(tok, RepoEnv(TrustedTests()), prompt, 8) + 24  # about a turn per context
    env = {**os.environ, "RTRL_GRPO__OUT_DIR": str(run), "RTRL_GRPO__STEPS": "10", "RTRL_GRPO__MODE": "sync",
           "RTRL_GRPO__CHECKPOINT_EVERY": "2", "RTRL_GRPO__EVAL_EVERY": "0", "RTRL_GRPO__PROMPTS_PER_STEP": "4",
           "RTRL_GRPO__GROUP_SIZE": "4", "RTRL_GRPO__MAX_NEW_TOKENS": "8", "RTRL_ENV__MAX_TURNS": "4",
           "RTRL_TASKS__REPO_HELDOUT_PER_FAMILY": "1", "RTRL_EVAL__SAMPLES": "1", "RTRL_EVAL__K": "[1]",
           "RTRL_GRPO__LR": "1e-3", "RTRL_ENV__KIND": "repo", "RTRL_TASKS__REPO_FAMILIES": '["trace"]',
           "RTRL_ENV__CONTEXT_BUDGET": str(budget)}
    cmd = [sys.executable, "-m", "rtrl", "grpo", "--init", str(tiny_model_dir), "--no-progress", "--no-publish"]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    latest = run / "checkpoints" / "latest"
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        if latest.is_file() and latest.read_text().strip() >= "step-000004":
            break
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.05)
    else:
        raise AssertionError("no checkpoint at step 4 in time")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = int(latest.read_text().strip().split("-")[1])
    assert killed_at < 10

    out = subprocess.run(cmd + ["--json"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert f"resumed from {run / 'checkpoints' / f'step-{killed_at:06d}'}" in out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 10
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 11))  # contiguous: nothing lost, nothing duplicated
    assert summary["pass_at_1_before"] is not None  # restored from the checkpoint, not recomputed
    assert out.stderr.count("(before)") == 0
    segments = [json.loads(line).get("segments_mean", 1.0) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(segments[:killed_at]) > 1 and max(segments[killed_at:]) > 1  # summaries before and after the kill
