"""Fixtures for the real-time updater tests: a registry with the tiny model in production and logged
feedback in the real ``training_examples`` table, sampled from that very model (so the behaviour
log-probs are real). The simulated judgement is learnable by a few REINFORCE steps: a completion is
accepted when its first token id is even; sampling with top-k 4 keeps each prompt's first-token support
small, so what is learnt on the training part carries over to the held-out part of the same prompts."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from rtrl.config import Settings, load_settings


@dataclass
class World:
    settings: Settings
    production: str
    env: dict[str, str]


def make_settings(tmp: Path, db_url: str, **section_overrides) -> tuple[Settings, dict[str, str]]:
    env = {
        "RTRL_DB__URL": db_url,
        "RTRL_REGISTRY__URL": str(tmp / "registry"),
        "RTRL_REGISTRY__CACHE_DIR": str(tmp / "cache"),
        "RTRL_BUS__EMBEDDED_PATH": str(tmp / "bus.db"),
        "RTRL_UPDATE__WORK_DIR": str(tmp / "runs"),
        "RTRL_EVAL__GATE_THRESHOLD": "0",
        "RTRL_RELEASE__OFFLINE_EPSILON": "1",
        "RTRL_RELEASE__OFFLINE_TASKS": "8",
        "RTRL_RELEASE__OFFLINE_SAMPLES": "1",
        "RTRL_RELEASE__MIN_HELDOUT": "20",
        "RTRL_RELEASE__BOOTSTRAP_SAMPLES": "200",
        "RTRL_SCHEDULE__MIN_FEEDBACK": "50",
        "RTRL_UPDATE__LR": "1e-3",
        "RTRL_UPDATE__EPOCHS": "3",
        "RTRL_UPDATE__TARGET_KL": "5.0",
        "RTRL_UPDATE__CALLER_CAP_SHARE": "0.5",
        "RTRL_UPDATE__HELDOUT_FRACTION": "0.3",
    }
    for k, v in section_overrides.items():
        env[f"RTRL_{k.upper()}"] = str(v)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        settings = load_settings()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return settings, env


def accept_rule(token_ids: list[int]) -> bool:
    return token_ids[0] % 2 == 0


def insert_logged(settings: Settings, version: str, model_dir: Path, *, n: int = 240, seed: int = 0,
                  callers: int = 12, start: datetime | None = None) -> int:
    """Sample ``n`` completions from the model and write them as judged training examples."""
    import sqlalchemy as sa

    from offline_rl.tasks import generate_tasks
    from policy.loading import load_policy
    from policy.sampling import SamplingParams, generate
    from realtime_rl.database import make_engine
    from realtime_rl.tables import training_examples

    policy = load_policy(model_dir)
    tasks = generate_tasks(0).train[:12]
    per = n // len(tasks)
    groups = generate(policy.model, policy.tokenizer, [t.prompt for t in tasks],
                      SamplingParams(n=per, temperature=1.0, top_k=4, max_new_tokens=3, seed=seed))
    start = start or datetime.now(UTC) - timedelta(minutes=30)
    rows = []
    i = 0
    for task, samples in zip(tasks, groups, strict=True):
        for s in samples:
            t = start + timedelta(seconds=i)
            rows.append({
                "completion_id": f"{version[:8]}-{seed}-{i}", "version": version, "model": "tiny-coder",
                "caller": f"caller-{i % callers}", "task_bucket": task.bucket,
                "prompt_token_ids": s.prompt_token_ids, "completion_token_ids": s.token_ids,
                "logprobs": s.logprobs, "sampling_logprobs": s.sampling_logprobs,
                # MoE models: the sampler's routes, in the wire form the gateway's completion events carry.
                "routes": None if s.routes is None else s.routes.to_wire(),
                "sampling": {"temperature": 1.0, "top_k": 4}, "signal": "accept" if accept_rule(s.token_ids) else "reject",
                "kept_text": None, "score": None, "feedback_event_id": f"fb-{version[:8]}-{seed}-{i}",
                "feedback_count": 1, "feedback_at": t, "completion_at": t - timedelta(seconds=1), "updated_at": t})
            i += 1
    engine = make_engine(settings.db)
    try:
        with engine.begin() as conn:
            conn.execute(sa.insert(training_examples), rows)
    finally:
        engine.dispose()
    return len(rows)


def make_world(tmp: Path, db_url: str, model_dir: Path, **overrides) -> World:
    from realtime_rl.release import RegistryStore
    from realtime_rl.schema import upgrade

    settings, env = make_settings(tmp, db_url, **overrides)
    upgrade(settings.db)
    store = RegistryStore(settings)
    version = store.publish(model_dir, parent=None, metrics={})
    store.promote(version, "production")
    insert_logged(settings, version, model_dir)
    return World(settings, version, env)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'feedback.db'}"


def spy_on_update_passes(monkeypatch) -> list[tuple]:
    """(routes, replay, grad) of every forward pass the updater makes, in order. The spy replaces the
    updater's own reference to ``sequence_logprobs``, so it sees each of its passes."""
    import realtime_rl.update as update_mod

    calls: list[tuple] = []
    original = update_mod.sequence_logprobs

    def spy(model, prompts, comps, **kw):
        calls.append((kw.get("routes"), kw.get("replay"), kw.get("grad", False)))
        return original(model, prompts, comps, **kw)

    monkeypatch.setattr(update_mod, "sequence_logprobs", spy)
    return calls
