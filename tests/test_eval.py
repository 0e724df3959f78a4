"""pass@k estimator, evaluate() on a model, `rtrl eval --json`, and publishing only past the gate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from math import comb
from pathlib import Path

import pytest

from offline_rl.evaluate import evaluate, pass_at_k
from offline_rl.publish import GateNotPassed, publish_model
from offline_rl.tasks import generate_tasks
from rtrl.config import load_settings


def test_pass_at_k_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - comb(6, 4) / comb(8, 4))
    assert pass_at_k(5, 3, 4) == 1.0  # fewer failures than k: some draw always holds a pass
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 4)


def test_evaluate_on_a_model(tiny_model_dir):
    from policy.loading import load_policy

    policy = load_policy(tiny_model_dir)
    tasks = generate_tasks(0).heldout[:6]
    r = evaluate(policy.model, policy.tokenizer, tasks, samples=2, k=[1, 2], max_new_tokens=8, seed=1)
    assert r.n_tasks == 6 and r.samples == 2 and set(r.pass_at_k) == {1, 2}
    assert 0.0 <= r.pass_at_1 <= r.pass_at_k[2] <= 1.0
    with pytest.raises(ValueError):
        evaluate(policy.model, policy.tokenizer, tasks, samples=2, k=[4])


def test_eval_cli_json_last_line(tiny_model_dir, tmp_path):
    env = {**os.environ, "RTRL_VAR_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "rtrl", "eval", "--model", str(tiny_model_dir), "--samples", "2",
                          "-k", "1", "-k", "2", "--limit", "4", "--preset", "functions", "-t", "1.0", "--json"], capture_output=True, text=True,
                         env=env, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"pass_at_1", "pass_at_k", "n_tasks"} <= last.keys()
    assert last["n_tasks"] == 4 and set(last["pass_at_k"]) == {"1", "2"}
    bad = subprocess.run([sys.executable, "-m", "rtrl", "eval", "--model", str(tmp_path / "nope")],
                         capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert bad.returncode == 2 and "not found" in bad.stderr


def test_publish_only_past_the_gate(tiny_model_dir, tmp_path):
    from policy.registry import Registry

    s = load_settings()
    s.registry.url = str(tmp_path / "registry")
    s.registry.cache_dir = str(tmp_path / "cache")
    s.eval.gate_threshold = 0.5
    with pytest.raises(GateNotPassed):
        publish_model(s, tiny_model_dir, {"heldout_pass_at_1": 0.49})
    reg = Registry.from_settings(s.registry)
    assert reg.list() == []
    v = publish_model(s, tiny_model_dir, {"heldout_pass_at_1": 0.61, "n_tasks": 63})
    info = reg.info(v)
    assert info.stage == "offline" and info.metrics["heldout_pass_at_1"] == pytest.approx(0.61)
    assert reg.channel("production") == v  # the first eligible model serves


def test_a_better_final_checkpoint_supersedes_the_first_only_while_it_still_serves(tiny_model_dir, tmp_path):
    from policy.loading import load_policy
    from policy.registry import Registry

    s = load_settings()
    s.registry.url, s.registry.cache_dir = str(tmp_path / "registry"), str(tmp_path / "cache")
    s.eval.gate_threshold = 0.5
    reg = Registry.from_settings(s.registry)
    first = publish_model(s, tiny_model_dir, {"heldout_pass_at_1": 0.52})

    def variant(name: str, scale: float) -> Path:
        p = load_policy(tiny_model_dir)
        for w in p.model.parameters():
            w.data.mul_(scale)
        p.model.save_pretrained(tmp_path / name)
        p.tokenizer.save_pretrained(tmp_path / name)
        return tmp_path / name

    final = publish_model(s, variant("final", 1.01), {"heldout_pass_at_1": 0.55}, supersede=first)
    assert reg.channel("production") == final
    assert "supersedes" in reg.history("production")[-1]["note"]
    # Once something else holds production (a real-time release), an offline run does not override it.
    reg.promote(first, "production", note="stand-in for a real-time release")
    late = publish_model(s, variant("late", 1.02), {"heldout_pass_at_1": 0.58}, supersede=final)
    assert reg.channel("production") == first and reg.channel("candidate") == late
