"""`rtrl bench grpo --quick --json` runs ours (sync, async with 1 and 2 workers) and TRL's GRPOTrainer,
then ours on multi-turn agent episodes, and ends with one JSON line holding the issue's keys. Speed is
the benchmark's business, not asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_quick_bench_prints_the_comparison(tmp_path, tiny_model_dir):
    env = {"RTRL_VAR_DIR": str(tmp_path / "var"), "RTRL_MODEL__DIR": str(tiny_model_dir), "HF_HUB_OFFLINE": "1",
           "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "rtrl", "bench", "grpo", "--quick", "--json"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("ours_sync_sec_per_step", "ours_async_sec_per_step", "trl_sec_per_step", "ratio_vs_trl",
                "async_over_sync", "threads"):
        assert key in out, key
    assert out["bench"] == "grpo" and out["trainable"] == "norm"
    assert set(out["async_sec_per_step_by_workers"]) == {"1", "2"}
    assert out["ours_async_sec_per_step"] == min(out["async_sec_per_step_by_workers"].values())
    best = min(out["ours_sync_sec_per_step"], out["ours_async_sec_per_step"])
    assert abs(out["ratio_vs_trl"] - out["trl_sec_per_step"] / best) < 0.01 * out["ratio_vs_trl"]
    assert out["async_mean_staleness"] <= out["rollout_workers"]
    assert out["steps"]["trl"] >= 3 and out["ours_updated_fraction"] > 0
    # Where the time went: the async side carries the worker's phases, and the CPU all processes
    # spent per step (the trainer's, the rollout worker's, the sandbox's) gives the 2-core floor.
    assert {"wait_s", "train_cpu_s", "gen_cpu_s", "sandbox_cpu_s", "handoff_s", "slot_wait_s"} <= out["async_phases"].keys()
    assert {"gen_cpu_s", "train_cpu_s", "sandbox_cpu_s"} <= out["sync_phases"].keys()
    assert out["async_cpu_s_per_step"] > out["async_phases"]["train_cpu_s"] > 0
    assert out["async_cpu_floor_sec_per_step"] == pytest.approx(out["async_cpu_s_per_step"] / out["cpu_count"], abs=1e-3)
    assert out["rounds"] == 1 and len(out["async_over_sync_by_round"]) == 1
    # Multi-turn agent episodes: every episode runs to the turn limit (the warm-up model never submits).
    multi = out["multi_turn"]
    assert multi["turns_per_episode"] >= 8 and multi["ours_sync_sec_per_step"] > 0 < multi["ours_async_sec_per_step"]
    assert multi["trl"].startswith("not run")


def test_rounds_pool_into_one_measurement():
    """Alternating rounds of one mode combine as one run over all their steady steps: a slow round
    weighs by its steps, not as one vote among rounds."""
    from benchmarks.grpo import _pooled

    def round_(steady_steps: int, steady_s: float, staleness: float) -> dict:
        return {"sec_per_step": steady_s / steady_steps, "steady_steps": steady_steps, "steady_s": steady_s,
                "steady_tokens": 100.0 * steady_steps, "steps": steady_steps + 1, "wall_s": steady_s + 2,
                "updated_fraction": 1.0, "mean_staleness": staleness, "dropped_stale": 1, "mean_reward": 0.5,
                "phases": {"gen_s": steady_s / steady_steps / 2}, "cpu_s_per_step": 0.2 * steady_s / steady_steps,
                "cpu_floor_sec_per_step": 0.1 * steady_s / steady_steps}

    pooled = _pooled([round_(8, 1.6, 1.0), round_(2, 0.8, 0.0)])
    assert pooled["sec_per_step"] == pytest.approx(2.4 / 10)
    assert pooled["tokens_per_s"] == pytest.approx(1000 / 2.4)
    assert pooled["steps"] == 12 and pooled["dropped_stale"] == 2 and pooled["wall_s"] == pytest.approx(6.4)
    assert pooled["mean_staleness"] == pytest.approx(9 / 12)
    assert pooled["phases"]["gen_s"] == pytest.approx(0.12, abs=1e-4)
    assert pooled["cpu_s_per_step"] == pytest.approx(0.2 * 2.4 / 10, abs=1e-4)
    single = round_(4, 1.0, 0.5)
    assert _pooled([single]) is single
