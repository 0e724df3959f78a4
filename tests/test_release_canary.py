"""Canary releases and the learned value-head baseline."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from typer.testing import CliRunner

from realtime_rl.release import RegistryStore
from tests.rtrl_update_fixtures import insert_logged, make_world, sqlite_url  # noqa: F401


def test_canary_then_promotion_by_realised_accept_rate(tmp_path, sqlite_url, tiny_model_dir, monkeypatch):  # noqa: F811
    w = make_world(tmp_path, sqlite_url, tiny_model_dir, RELEASE__CANARY_SHARE=0.2,
                   RELEASE__CANARY_MIN_FEEDBACK=50, RELEASE__CANARY_MAX_FEEDBACK=100)
    store = RegistryStore(w.settings)
    for k, v in w.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RTRL_RELEASE__CANARY_SHARE", "0.2")
    monkeypatch.setenv("RTRL_RELEASE__CANARY_MIN_FEEDBACK", "50")
    monkeypatch.setenv("RTRL_RELEASE__CANARY_MAX_FEEDBACK", "100")
    from rtrl.cli import app

    res = CliRunner().invoke(app, ["update", "--once", "--json"])
    assert res.exit_code == 0, res.output
    first = json.loads(res.output.strip().splitlines()[-1])
    assert first["status"] == "canary", first["reason"]
    cand = first["candidate_version"]
    assert store.candidate() == cand and store.production() == w.production

    # Too little canary feedback yet: wait.
    waiting = json.loads(CliRunner().invoke(app, ["update", "--json"]).output.strip().splitlines()[-1])
    assert waiting["status"] == "skipped" and "canary" in waiting["reason"]
    # Canary traffic (sampled from the candidate, judged by the same users) and control traffic.
    now = datetime.now(UTC)
    insert_logged(w.settings, cand, store.materialize(cand), n=120, seed=5, start=now)
    insert_logged(w.settings, w.production, tiny_model_dir, n=120, seed=6, start=now)
    done = json.loads(CliRunner().invoke(app, ["update", "--json"]).output.strip().splitlines()[-1])
    # 120 canary judgements, over canary_max_feedback: the sequential test decides (a verdict, or the sign).
    assert done["status"] == "released", done["reason"]
    assert done["metrics"]["canary_accept_rate"] >= done["metrics"]["production_accept_rate"]
    assert done["metrics"]["sequential_test"]["decision"] == "promote"
    assert store.production() == cand and store.candidate() == cand
    shown = CliRunner().invoke(app, ["releases"]).output
    assert "canary:" in shown and shown.count(cand) == 2  # the canary decision, then its promotion


def test_value_head_baseline_is_cross_fitted(tiny_model_dir):
    from policy.loading import load_policy
    from realtime_rl.baseline import value_head_advantages
    from realtime_rl.dataset import LoggedExample, TrainingExample

    policy = load_policy(tiny_model_dir)
    exs = [TrainingExample(LoggedExample(f"c{i}", "v", "a", "b", [5 + i % 7, 9, 11 + i % 3], [4], [-1.0], None,
                                         "accept"), float(i % 3) - 1.0, True) for i in range(24)]
    adv, base = value_head_advantages(policy.model, exs)
    assert len(adv) == 24 and all(abs(a - (e.reward - b)) < 1e-6 for a, b, e in zip(adv, base, exs, strict=True))
    # Changing example 0's reward (fold 0) moves no fold-0 baseline: the head scoring it never saw it.
    changed = [TrainingExample(exs[0].example, 10.0, True)] + exs[1:]
    _, base2 = value_head_advantages(policy.model, changed)
    assert all(abs(base2[i] - base[i]) < 1e-5 for i in range(0, 24, 2))
    assert any(abs(base2[i] - base[i]) > 1e-4 for i in range(1, 24, 2))


def test_target_kl_stops_the_update_early(tiny_model_dir):
    from policy.loading import load_policy
    from realtime_rl.config import UpdateSettings
    from realtime_rl.dataset import LoggedExample, TrainingExample
    from realtime_rl.update import train_policy

    policy = load_policy(tiny_model_dir)
    exs = [TrainingExample(LoggedExample(f"c{i}", "v", "a", "b", [5 + i % 7, 9], [4 + i % 5, 6], [-5.0, -5.0],
                                         None, "accept"), 1.0 if i % 2 else -1.0, bool(i % 2)) for i in range(32)]
    adv = [e.reward for e in exs]
    free = train_policy(policy.model, exs, adv, UpdateSettings(lr=1e-2, epochs=3, minibatch_size=8, target_kl=None))
    assert free["steps"] == 12 and free["early_stopped"] == 0
    policy = load_policy(tiny_model_dir)
    capped = train_policy(policy.model, exs, adv, UpdateSettings(lr=1e-2, epochs=3, minibatch_size=8,
                                                                 target_kl=1e-3))
    # One step at lr 1e-2 takes the next minibatch past 1e-3: the update stops there, before its step.
    assert capped["early_stopped"] == 1 and capped["steps"] == 1 and len(capped["loss_curve"]) == 1
