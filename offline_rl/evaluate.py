"""Held-out evaluation: pass@1 and pass@k with the unbiased estimator (Chen et al., 2021).

For a task with n samples of which c pass every hidden test:  pass@k = 1 − C(n−c, k) / C(n, k),
averaged over tasks (k ≤ n). pass@1 is the same estimator at k = 1, i.e. the mean of c/n. The real-
time release gate calls :func:`evaluate` on a candidate with the same tasks and settings.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from math import comb

from offline_rl.config import EnvSettings, RewardSettings, SandboxSettings
from offline_rl.env import CodingEnv
from offline_rl.rewards import RewardFunction
from offline_rl.rollout import RolloutBackend, TorchBackend, run_episodes
from offline_rl.sandbox import Sandbox, SandboxPool
from offline_rl.tasks import Task


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of P(at least one of k samples passes) from n samples with c passing."""
    if k > n:
        raise ValueError(f"k={k} exceeds the {n} samples per task")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclass
class EvalResult:
    pass_at_1: float
    pass_at_k: dict[int, float]
    n_tasks: int
    samples: int
    mean_reward: float
    mean_test_fraction: float
    per_bucket: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["pass_at_k"] = {str(k): v for k, v in self.pass_at_k.items()}
        return d


def evaluate(model, tokenizer, tasks: Sequence[Task], samples: int = 4, k: Sequence[int] = (1, 4),
             temperature: float = 1.0, max_new_tokens: int = 32, *, seed: int = 0,
             sandbox: Sandbox | SandboxPool | None = None, env_settings: EnvSettings | None = None,
             backend: RolloutBackend | None = None, batch_tasks: int = 32) -> EvalResult:
    """Sample ``samples`` episodes per task and score them on the hidden tests."""
    if not tasks:
        raise ValueError("no tasks to evaluate")
    ks = sorted({int(x) for x in k} | {1})
    if max(ks) > samples:
        raise ValueError(f"pass@{max(ks)} needs at least {max(ks)} samples per task (got {samples})")
    t0 = time.perf_counter()
    own_sandbox = sandbox is None
    sandbox = sandbox or SandboxPool(SandboxSettings())
    try:
        env = CodingEnv(sandbox, env_settings or EnvSettings())
        # Pass/fail only: shaping weights do not change pass@k, the reward is reported for context.
        reward_fn = RewardFunction(sandbox, RewardSettings())
        backend = backend or TorchBackend(model, tokenizer)
        was_training = getattr(model, "training", False) if model is not None else False
        if model is not None:
            model.eval()
        trajs = []
        for start in range(0, len(tasks), batch_tasks):
            chunk = list(tasks[start:start + batch_tasks])
            trajs += run_episodes(backend, tokenizer, env, chunk, samples, temperature, max_new_tokens,
                                  seed=seed + start, reward_fn=reward_fn)
        if model is not None and was_training:
            model.train()
    finally:
        if own_sandbox:
            sandbox.close()
    per_task: dict[str, list] = {}
    for t in trajs:
        per_task.setdefault(t.task.task_id, []).append(t)
    pak = {kk: 0.0 for kk in ks}
    buckets: dict[str, list[float]] = {}
    for group in per_task.values():
        c = sum(t.passed for t in group)
        for kk in ks:
            pak[kk] += pass_at_k(len(group), c, kk)
        buckets.setdefault(group[0].task.bucket, []).append(c / len(group))
    n = len(per_task)
    pak = {kk: v / n for kk, v in pak.items()}
    return EvalResult(pass_at_1=pak[1], pass_at_k=pak, n_tasks=n, samples=samples,
                      mean_reward=sum(t.reward for t in trajs) / len(trajs),
                      mean_test_fraction=sum(t.parts.get("tests", 0.0) for t in trajs) / len(trajs),
                      per_bucket={b: sum(v) / len(v) for b, v in sorted(buckets.items())},
                      wall_s=time.perf_counter() - t0)
