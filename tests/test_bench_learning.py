"""`rtrl bench learning --quick --json`: the whole comparison at toy sizes (fresh tiny model,
mid-training, GRPO, the matched-compute control, the temperature grid of all three) ends with one JSON
line holding the issue's keys. Toy sizes measure nothing; whether GRPO wins is the full run's business."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_quick_bench_prints_every_comparison(tmp_path):
    env = {"RTRL_VAR_DIR": str(tmp_path / "var"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "rtrl", "bench", "learning", "--quick", "--json"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["bench"] == "learning" and out["env"] == "repo" and out["quick"] is True
    assert out["threads"] >= 1 and out["wall_s"] > 0
    temps = out["temperatures"]
    assert temps == sorted(temps, reverse=True) and out["serving_t"] in temps
    for name in ("midtrain", "control", "grpo"):
        best = out[f"{name}_best_t"]
        by_t = out["pass_at_1_by_t"][name]
        assert set(by_t) == {str(t) for t in temps}
        # "best" is the grid's maximum, at the temperature it names, with an interval around it.
        assert best["t"] in temps and best["pass_at_1"] == max(by_t.values()) == by_t[str(best["t"])]
        lo, hi = best["ci95"]
        assert lo <= best["pass_at_1"] <= hi
    assert out["grpo_at_serving_t"] == out["pass_at_1_by_t"]["grpo"][str(out["serving_t"])]
    # The gains are paired per-task differences of the best-temperature results.
    assert out["gain_vs_midtrain"] == pytest.approx(out["grpo_best_t"]["pass_at_1"] - out["midtrain_best_t"]["pass_at_1"],
                                                    abs=1e-3)
    assert out["gain_vs_control"] == pytest.approx(out["grpo_best_t"]["pass_at_1"] - out["control_best_t"]["pass_at_1"],
                                                   abs=1e-3)
    behaviours = out["behaviours"]
    assert behaviours["before"].keys() == behaviours["after"].keys() and "test_before_edit" in behaviours["after"]
    assert out["grpo_steps"] == 2 and out["midtrain_steps"] == 30 and out["grpo_s"] > 0
