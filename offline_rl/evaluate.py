"""Held-out evaluation: pass@k with the unbiased estimator (Chen et al., 2021), temperature grids, and
paired comparisons with confidence intervals.

For a task with n samples of which c succeed (every hidden test passes):  pass@k = 1 − C(n−c, k) / C(n, k),
averaged over tasks (k ≤ n). pass@1 is the mean of c/n ("success" for repository tasks). The
release gates call :func:`evaluate` with the same tasks and settings.

Learning claims are compared at each model's *best* temperature from a small grid
(:func:`temperature_grid`): a lower temperature alone sharpens a model's most likely choices, and
a gain it can produce is not a learning result. Confidence intervals are over tasks (the unit that
varies): a 95% normal interval of the mean per-task success, and for a comparison of two models on the
same tasks, of the mean per-task difference (:func:`paired_gain`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from math import comb

from offline_rl.agent_env import RepoEnv, SandboxTests
from offline_rl.config import EnvSettings, RewardSettings, SandboxSettings
from offline_rl.env import CodingEnv
from offline_rl.repo_tasks import RepoTask
from offline_rl.rewards import RewardFunction
from offline_rl.rollout import RolloutBackend, TorchBackend, run_episodes
from offline_rl.sandbox import Sandbox, SandboxPool
from offline_rl.splits import load_split
from offline_rl.tasks import Task

Z95 = 1.959964


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of P(at least one of k samples passes) from n samples with c passing."""
    if k > n:
        raise ValueError(f"k={k} exceeds the {n} samples per task")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def mean_ci(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its 95% normal interval (per-unit values, e.g. per task)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = sum(values) / n
    if n == 1:
        return mean, mean, mean
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = Z95 * sd / math.sqrt(n)
    return mean, mean - half, mean + half


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
    temperature: float = 1.0
    ci95: tuple[float, float] = (0.0, 0.0)
    """95% interval of pass@1 over tasks."""
    per_task: dict[str, float] = field(default_factory=dict)
    """Success rate of each task (for paired comparisons)."""
    behaviour: dict[str, float] = field(default_factory=dict)
    """Repository episodes: mean of each behaviour measure (offline_rl.agent_env.behaviour), plus
    turns per solved episode."""
    truncated: float = 0.0
    """Share of episodes cut off because their next turn would not fit the context."""
    summaries: dict = field(default_factory=dict)
    """Self-summarisation (``env.context_budget``): :func:`summary_metrics`; empty when no episode
    wrote a summary."""

    def to_dict(self, with_tasks: bool = False) -> dict:
        d = asdict(self)
        d["pass_at_k"] = {str(k): v for k, v in self.pass_at_k.items()}
        d["ci95"] = list(self.ci95)
        if not with_tasks:
            d.pop("per_task")
        return d


def _env_for(tasks: Sequence[Task | RepoTask], sandbox: Sandbox | SandboxPool,
             env_settings: EnvSettings | None) -> CodingEnv | RepoEnv:
    es = env_settings or EnvSettings()
    if isinstance(tasks[0], RepoTask):
        return RepoEnv.from_settings(SandboxTests(sandbox), es)
    return CodingEnv(sandbox, es)


def evaluate(model, tokenizer, tasks: Sequence[Task | RepoTask], samples: int = 4, k: Sequence[int] = (1, 4),
             temperature: float = 1.0, max_new_tokens: int = 32, *, seed: int = 0,
             sandbox: Sandbox | SandboxPool | None = None, env_settings: EnvSettings | None = None,
             backend: RolloutBackend | None = None, batch_tasks: int = 32,
             max_context: int | None = None) -> EvalResult:
    """Sample ``samples`` episodes per task and score them on the hidden tests (function tasks or
    repository tasks, whichever ``tasks`` holds). ``max_context``: cut episodes off at this many tokens
    instead of the model's context (see :func:`offline_rl.rollout.play_episodes`)."""
    if not tasks:
        raise ValueError("no tasks to evaluate")
    ks = sorted({int(x) for x in k} | {1})
    if max(ks) > samples:
        raise ValueError(f"pass@{max(ks)} needs at least {max(ks)} samples per task (got {samples})")
    t0 = time.perf_counter()
    own_sandbox = sandbox is None
    sandbox = sandbox or SandboxPool(SandboxSettings())
    try:
        env = _env_for(tasks, sandbox, env_settings)
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
                                  seed=seed + start, reward_fn=reward_fn, max_context=max_context)
        if model is not None and was_training:
            model.train()
    finally:
        if own_sandbox:
            sandbox.close()
    return summarise(trajs, ks, samples, temperature, time.perf_counter() - t0)


def summarise(trajs, ks: Sequence[int], samples: int, temperature: float, wall_s: float) -> EvalResult:
    per_task: dict[str, list] = {}
    for t in trajs:
        per_task.setdefault(t.task.task_id, []).append(t)
    pak = {kk: 0.0 for kk in ks}
    buckets: dict[str, list[float]] = {}
    rates: dict[str, float] = {}
    for tid, group in per_task.items():
        c = sum(t.passed for t in group)
        for kk in ks:
            pak[kk] += pass_at_k(len(group), c, kk)
        rates[tid] = c / len(group)
        buckets.setdefault(group[0].task.bucket, []).append(c / len(group))
    n = len(per_task)
    pak = {kk: v / n for kk, v in pak.items()}
    _, lo, hi = mean_ci(list(rates.values()))
    return EvalResult(pass_at_1=pak[1], pass_at_k=pak, n_tasks=n, samples=samples,
                      mean_reward=sum(t.reward for t in trajs) / len(trajs),
                      mean_test_fraction=sum(t.parts.get("tests", 0.0) for t in trajs) / len(trajs),
                      per_bucket={b: sum(v) / len(v) for b, v in sorted(buckets.items())},
                      wall_s=wall_s, temperature=temperature, ci95=(lo, hi), per_task=rates,
                      behaviour=behaviour_means(trajs), truncated=sum(t.truncated for t in trajs) / len(trajs),
                      summaries=summary_metrics(trajs))


def behaviour_means(trajs) -> dict[str, float]:
    """Mean of each behaviour measure over repository episodes, and turns per solved episode."""
    rows = [t.behaviour for t in trajs if t.behaviour]
    if not rows:
        return {}
    out = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    solved = [t.behaviour["turns"] for t in trajs if t.behaviour and t.passed]
    out["turns_per_solved"] = sum(solved) / len(solved) if solved else 0.0
    return out


def summary_metrics(trajs) -> dict:
    """What self-summarisation did in a batch of episodes ({} when none wrote a summary):

    * ``segments_mean``: contexts per episode (1 + its summaries), ``summaries_mean``;
    * ``summary_tokens_mean``; ``compression_ratio``: mean of summary tokens / tokens of the context it
      replaced; ``summaries_cut`` and ``summaries_empty``: shares of summaries cut at the cap or empty;
    * ``success_by_summaries``: success rate of the episodes with 0, 1, 2, ... summaries;
    * ``fact_kept``: share of summaries that kept the fact the fix needs (tasks whose metadata names
      one, the ``trace`` family), None when no such task."""
    trajs = [t for t in trajs if hasattr(t, "summaries")]
    records = [r for t in trajs for r in t.summaries]
    if not records:
        return {}
    by_n: dict[int, list[bool]] = {}
    for t in trajs:
        by_n.setdefault(len(t.summaries), []).append(bool(t.passed))
    facts = [(str(t.task.metadata["fact"]).replace(" ", ""), r.text.replace(" ", "")) for t in trajs
             if "fact" in getattr(t.task, "metadata", {}) for r in t.summaries]
    n = len(records)
    return {
        "segments_mean": sum(len(t.summaries) + 1 for t in trajs) / len(trajs),
        "summaries_mean": n / len(trajs),
        "summary_tokens_mean": sum(r.tokens for r in records) / n,
        "compression_ratio": sum(r.tokens / max(r.replaced_tokens, 1) for r in records) / n,
        "summaries_cut": sum(r.cut for r in records) / n,
        "summaries_empty": sum(r.empty for r in records) / n,
        "success_by_summaries": {str(k): sum(v) / len(v) for k, v in sorted(by_n.items())},
        "fact_kept": sum(f in text for f, text in facts) / len(facts) if facts else None,
    }


def evaluate_settings(settings, model, tokenizer, *, temperature: float | None = None,
                      tasks: Sequence[Task | RepoTask] | None = None, samples: int | None = None,
                      sandbox: Sandbox | SandboxPool | None = None, max_context: int | None = None) -> EvalResult:
    """:func:`evaluate` on the configured environment's held-out tasks with the configured sizes."""
    ev = settings.eval
    tasks = tasks if tasks is not None else load_split(settings.tasks, settings.env).heldout
    n = samples or ev.samples
    return evaluate(model, tokenizer, tasks, samples=n, k=[k for k in ev.k if k <= n],
                    temperature=ev.temperature if temperature is None else temperature,
                    max_new_tokens=settings.grpo.max_new_tokens, seed=settings.grpo.seed + 17, sandbox=sandbox,
                    env_settings=settings.env, max_context=max_context)


@dataclass
class GridResult:
    """A model evaluated at each temperature of a grid; ``best`` is the temperature with the highest pass@1."""

    results: dict[float, EvalResult]

    @property
    def best_t(self) -> float:
        return max(self.results, key=lambda t: (self.results[t].pass_at_1, -t))

    @property
    def best(self) -> EvalResult:
        return self.results[self.best_t]

    def to_dict(self) -> dict:
        return {"best_t": self.best_t, "pass_at_1": {str(t): r.pass_at_1 for t, r in self.results.items()},
                "ci95": {str(t): list(r.ci95) for t, r in self.results.items()},
                "behaviour": {str(t): r.behaviour for t, r in self.results.items()},
                "summaries": {str(t): r.summaries for t, r in self.results.items()}}


def temperature_grid(settings, model, tokenizer, temperatures: Sequence[float], *,
                     tasks: Sequence[Task | RepoTask] | None = None, samples: int | None = None,
                     sandbox: Sandbox | SandboxPool | None = None, max_context: int | None = None) -> GridResult:
    """:func:`evaluate_settings` at every temperature of ``temperatures`` (same tasks, same seeds)."""
    if not temperatures:
        raise ValueError("an empty temperature grid")
    return GridResult({float(t): evaluate_settings(settings, model, tokenizer, temperature=float(t), tasks=tasks,
                                                   samples=samples, sandbox=sandbox, max_context=max_context)
                       for t in temperatures})


def paired_gain(a: EvalResult, b: EvalResult) -> dict[str, float]:
    """``a`` minus ``b`` in pass@1 on the same tasks, with a 95% interval of the mean per-task difference."""
    common = sorted(set(a.per_task) & set(b.per_task))
    if not common:
        raise ValueError("the two results share no task")
    gain, lo, hi = mean_ci([a.per_task[t] - b.per_task[t] for t in common])
    return {"gain": gain, "ci95": [lo, hi], "tasks": len(common)}
