"""`rtrl bench summarise`: does RL teach the model summaries that carry a long episode across its context
budget? On the held-out long-horizon ``trace`` family, at one budget, four arms from one start model:

* ``trained``: after a short GRPO run on the ``trace`` training tasks with the budget on (summary turns
  are part of the episodes, credited with the episode's reward);
* ``untrained``: the start model's own summaries, same budget;
* ``truncation``: the same budget as a hard limit, no summary turn: an episode that outgrows it is cut
  off (no reward);
* ``no_budget``: the model's whole context (the ceiling).

The start model (unless ``--from``) is the tiny default model, mid-trained on the ``trace`` family's
transcripts and then trained with GRPO on its training tasks *without* a budget (:func:`agent_start`):
mid-training alone reads the notes and finds the function but rarely copies the rule's constants, so
it solves almost no task even with its whole context, and nothing could be learnt about summaries.

Each arm is held-out success (pass@1) at ``eval.temperature``; the summary figures (tokens per summary,
the share of the replaced context they take, segments per episode, whether the rule the fix needs
survived) are the trained arm's, the untrained arm's beside them in ``untrained_detail``.

The budget is ``env.context_budget`` when set, else the smallest budget every held-out task allows
plus :data:`BUDGET_SLACK` tokens. ``--quick`` runs every step at toy sizes to check the
pipeline, not to measure. Artefacts stay in ``<var_dir>/bench/summarise`` (a temporary directory with
``--quick``).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from offline_rl.agent_env import RepoEnv, TrustedTests, header
from offline_rl.corpus import build_default_model
from offline_rl.evaluate import EvalResult, evaluate
from offline_rl.grpo import run_grpo
from offline_rl.midtrain import run_midtrain
from offline_rl.presets import apply_overrides
from offline_rl.rollout import min_budget
from offline_rl.sandbox import SandboxPool
from offline_rl.splits import load_split
from policy.loading import load_policy

BUDGET_SLACK = 64
"""Tokens above the smallest legal budget: room for a few turns per context, far less than an episode."""
QUICK = {
    "tiny": {"corpus_examples": 600},
    "midtrain": {"steps": 20, "batch_tokens": 1024, "warmup_steps": 2},
    "grpo": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 12, "mode": "sync"},
    "env": {"max_turns": 6, "summary_max_tokens": 16},
    "tasks": {"repo_heldout_per_family": 2},
    "eval": {"samples": 2},
}


def _configure(settings, quick: bool, work: Path):
    s = settings.model_copy(deep=True)
    if quick:
        apply_overrides(s, QUICK)
    s.env.kind = "repo"
    s.tasks.repo_families = ["trace"]
    s.tasks.repo_path = None
    s.midtrain.eval_at_end = False
    s.grpo.out_dir = str(work / "grpo")
    s.grpo.eval_every, s.grpo.publish = 0, False
    return s


def pick_budget(settings, tokenizer, tasks) -> int:
    """``env.context_budget``, or the smallest budget every task allows plus :data:`BUDGET_SLACK`."""
    if settings.env.context_budget:
        return settings.env.context_budget
    env = RepoEnv(TrustedTests(), summary_max_tokens=settings.env.summary_max_tokens)
    prompt = max(len(tokenizer(header(t), add_special_tokens=False)["input_ids"]) for t in tasks)
    return min_budget(tokenizer, env, prompt, settings.grpo.max_new_tokens) + BUDGET_SLACK


def agent_start(s, work: Path, quick: bool, log: Callable[[str], None]) -> Path:
    """The start model: the tiny default model, mid-trained, then GRPO on the training tasks with no
    context budget (the same steps as the budgeted run that follows)."""
    base = build_default_model(work / "tiny", s.tiny)
    mid = run_midtrain(s, init_dir=base, out_dir=work / "mid", progress=not quick, log=log)
    free = s.model_copy(deep=True)
    free.env.context_budget = 0
    free.grpo.out_dir = str(work / "agent")
    return run_grpo(free, mid, progress=not quick, log=log, resume=False, evaluate_before=False,
                    evaluate_after=False).final_dir


def _arm(s, path, tasks, sandbox, *, budget: int, summarise: bool) -> EvalResult:
    """Held-out success of the model at ``path``: with the budget and summaries, with the budget as a hard
    limit (``summarise`` False, ``budget`` > 0), or with no budget (``budget`` 0)."""
    policy = load_policy(path, "float32", s.model.device)
    es = s.env.model_copy(update={"context_budget": budget if summarise else 0})
    return evaluate(policy.model, policy.tokenizer, tasks, samples=s.eval.samples, k=[1],
                    temperature=s.eval.temperature, max_new_tokens=s.grpo.max_new_tokens, seed=s.grpo.seed + 17,
                    sandbox=sandbox, env_settings=es, max_context=None if summarise or not budget else budget)


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def run(settings, quick: bool = False, log: Callable[[str], None] = print,
        from_dir: str | None = None) -> dict[str, Any]:
    """The four arms; ``from_dir``: the start model (else :func:`agent_start` builds one)."""
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-summarise-") as tmp:
        work = Path(tmp) if quick else Path(settings.var_dir) / "bench" / "summarise"
        work.mkdir(parents=True, exist_ok=True)
        s = _configure(settings, quick, work)
        start = Path(from_dir) if from_dir else agent_start(s, work, quick, log)
        split = load_split(s.tasks, s.env)
        tokenizer = load_policy(start, "float32", s.model.device).tokenizer
        budget = pick_budget(s, tokenizer, [*split.train, *split.heldout])
        s.env.context_budget = budget
        log(f"summarise: budget {budget} tokens, {len(split.heldout)} held-out trace tasks x {s.eval.samples}, "
            f"start model {start}")
        t0 = time.perf_counter()
        grpo = run_grpo(s, start, progress=not quick, log=log, resume=False, evaluate_before=False,
                        evaluate_after=False)
        grpo_s = time.perf_counter() - t0
        arms: dict[str, EvalResult] = {}
        with SandboxPool(s.sandbox) as sandbox:
            arms["trained"] = _arm(s, grpo.final_dir, split.heldout, sandbox, budget=budget, summarise=True)
            arms["untrained"] = _arm(s, start, split.heldout, sandbox, budget=budget, summarise=True)
            arms["truncation"] = _arm(s, start, split.heldout, sandbox, budget=budget, summarise=False)
            arms["no_budget"] = _arm(s, start, split.heldout, sandbox, budget=0, summarise=False)
        for name, r in arms.items():
            log(f"summarise: {name}: success {r.pass_at_1:.3f}, truncated {r.truncated:.2f}, "
                f"summaries {r.summaries.get('summaries_mean', 0.0):.2f} per episode")
    trained = arms["trained"].summaries
    ok = {name: round(r.pass_at_1, 4) for name, r in arms.items()}
    return {
        "budget_tokens": budget,
        **ok,
        "summary_tokens_mean": trained.get("summary_tokens_mean"),
        "compression_ratio": trained.get("compression_ratio"),
        "segments_mean": trained.get("segments_mean", 1.0),
        "trained_over_truncation": _ratio(ok["trained"], ok["truncation"]),
        "trained_over_untrained": _ratio(ok["trained"], ok["untrained"]),
        "trained_detail": {**trained, "ci95": list(arms["trained"].ci95)},
        "untrained_detail": {**arms["untrained"].summaries, "ci95": list(arms["untrained"].ci95)},
        "truncation_detail": {"truncated_share": arms["truncation"].truncated,
                              "ci95": list(arms["truncation"].ci95)},
        "no_budget_detail": {"truncated_share": arms["no_budget"].truncated, "ci95": list(arms["no_budget"].ci95)},
        "heldout_tasks": len(split.heldout),
        "samples_per_task": s.eval.samples,
        "grpo_steps": grpo.steps,
        "grpo_s": round(grpo_s, 1),
        "quick": quick,
        "from_dir": from_dir,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
