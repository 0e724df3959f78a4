"""`rtrl bench summarise`: does RL teach the model summaries that carry a long episode across its context
budget? On the held-out long-horizon ``trace`` family, at one budget, from one start model:

* ``trained``: after a short GRPO run on the ``trace`` training tasks with the budget on (summary turns
  are part of the episodes, credited with the episode's reward);
* ``untrained``: the start model's own summaries, same budget;
* ``control``: the matched-compute control, the start model mid-trained for as long as that GRPO run
  took (on the same corpus, whose demonstrations summarise imperfectly), same budget;
* ``truncation``: the start model with the same budget as a hard limit, no summary turn: an episode
  that outgrows it is cut off (no reward);
* ``no_budget``: the start model with its whole context (the ceiling), measured first: under
  :data:`START_FLOOR` the bench stops before training.

Every arm is held-out success (pass@1) at its own best temperature of the grid (``eval.temperatures``,
``eval.temperature`` and greedy decoding): a gain that a lower temperature also gives is not one RL made. The paired
gains of ``trained`` over ``untrained`` and over ``control`` come with 95% intervals over tasks.

The start model (unless ``--from``) is the tiny default model mid-trained (:data:`MIDTRAIN_STEPS`) on
``trace`` transcripts mixed with the standard families' (:data:`CORPUS_FAMILIES`, :data:`RULE_DRILL`,
:data:`DIRECT_HABITS`; :func:`start_model`). No RL precedes the budgeted GRPO run: GRPO on the same
tasks *without* a budget also taught the start model's summaries to keep the rule (it copies the rule
in every edit it is rewarded for), so "untrained" would not have been.

The summary figures (tokens per summary, the share of the replaced context they take, segments per
episode, whether the rule the fix needs survived: ``fact_kept``) are each model's at its best
temperature.

The budget is ``env.context_budget`` when set, else the smallest budget every held-out task allows
plus :data:`BUDGET_SLACK` tokens: reading a task's notes then fills the context, so the rule reaches
the fix only through a summary. ``--quick`` runs every step at toy sizes to check the pipeline, not
to measure. Artefacts stay in ``<var_dir>/bench/summarise`` (a temporary directory with ``--quick``).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from offline_rl.agent_env import RepoEnv, TrustedTests, header
from offline_rl.compare import Comparison, grid_temperatures
from offline_rl.corpus import build_default_model
from offline_rl.evaluate import GridResult, temperature_grid
from offline_rl.grpo import run_grpo
from offline_rl.midtrain import continue_midtrain, midtrain_record, run_midtrain
from offline_rl.presets import apply_overrides
from offline_rl.repo_tasks import FAMILIES
from offline_rl.rollout import min_budget
from offline_rl.sandbox import SandboxPool
from offline_rl.splits import load_split
from policy.loading import load_policy

BUDGET_SLACK = 32
"""Tokens above the smallest legal budget: room for two or three turns after a summary, less than an
episode that reads the notes and then fixes the function."""
DIRECT_HABITS = {"test_first": 0.0, "grep": 1.0, "verify": 0.0, "correct": 1.0}
"""The demonstrator's habits on this bench (``midtrain.demo_habits`` overrides them): straight from the
notes to the fix (read the notes, ``grep``, edit, submit), so that at the bench's budget the context after
a summary holds the rest of the episode (a detour would need a second summary, which the
demonstrations never show); an informed edit is always right. ``ls`` comes before the notes if at all.
Summaries state the rule as often as the demonstrator's default has them do (docs/limits.md: a rarer
habit was tried)."""
CORPUS_FAMILIES = [*FAMILIES, *["trace"] * len(FAMILIES)]
"""The start model's corpus (``midtrain.families`` overrides it): ``trace`` transcripts for half of the
transcripts, the standard mix for the other half. Trained on ``trace`` transcripts alone, the tiny model
copied the rule and the function's name but predicted module names at their base rate in both places a
command needs one (the notes in ``cat``, the broken module in ``edit``), so it solved almost nothing; the
standard mix names modules in many more commands and outputs."""
RULE_DRILL = 0.5
"""``midtrain.rule_drill`` on this bench (a nonzero setting overrides it): half the ``trace`` transcripts
state a rule outside the task grammar, which the start model can only copy, not recall."""
MIDTRAIN_STEPS = 4000
"""Mid-training steps of the start model (``midtrain.steps``, a larger setting wins): twice the default.
After the default's 2,000 steps whether the model had learnt to copy the notes' rule into the fix
depended on the host (docs/limits.md), and its summaries still kept the rule far more often than the
demonstrations do; with twice the steps it copies, and its own summaries keep the rule about as often as
the demonstrations show, which leaves the reward something to teach."""
HELDOUT_PER_FAMILY = 48
"""Held-out ``trace`` tasks (``tasks.repo_heldout_per_family``, a larger setting wins): 48 draws over the
held-out functions (about 70) cover most of them, so the paired intervals are over distinct rules, not
over repeats of a few."""
SAMPLES = 8
"""Samples per held-out task (``eval.samples``, a larger setting wins)."""
GREEDY = 0.0
"""Added to the temperature grid: on this family the start model's success still rose at the default
grid's lowest temperature, so its best temperature is only known once greedy decoding is in the grid."""
START_FLOOR = 0.2
"""Held-out success the start model must reach with its whole context (``no_budget``, at its best
temperature) before the budgeted arms are run: below it there is nothing for a summary to carry, and the
bench stops with the reason instead of measuring noise for half an hour (not checked with ``--quick``)."""
QUICK = {
    "tiny": {"corpus_examples": 600},
    "midtrain": {"steps": 20, "batch_tokens": 1024, "warmup_steps": 2},
    "grpo": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 12, "mode": "sync"},
    "env": {"max_turns": 6, "summary_max_tokens": 16},
    "tasks": {"repo_heldout_per_family": 2},
    "eval": {"samples": 2, "temperatures": [1.0, 0.5]},
}


def _configure(settings, quick: bool, work: Path):
    s = settings.model_copy(deep=True)
    if quick:
        apply_overrides(s, QUICK)
    else:
        s.midtrain.steps = max(s.midtrain.steps, MIDTRAIN_STEPS)
        s.tasks.repo_heldout_per_family = max(s.tasks.repo_heldout_per_family, HELDOUT_PER_FAMILY)
        s.eval.samples = max(s.eval.samples, SAMPLES)
        s.eval.temperatures = sorted({*s.eval.temperatures, GREEDY}, reverse=True)
    s.env.kind = "repo"
    s.tasks.repo_families = ["trace"]
    s.midtrain.demo_habits = {**DIRECT_HABITS, **settings.midtrain.demo_habits}
    s.midtrain.families = settings.midtrain.families or CORPUS_FAMILIES
    s.midtrain.rule_drill = settings.midtrain.rule_drill or RULE_DRILL
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


def start_model(s, work: Path, quick: bool, log: Callable[[str], None]) -> Path:
    """The start model: the tiny default model, mid-trained on the bench's corpus."""
    base = build_default_model(work / "tiny", s.tiny)
    return run_midtrain(s, init_dir=base, out_dir=work / "mid", progress=not quick, log=log)


def _grid(s, path, tasks, sandbox, temperatures, *, budget: int, summarise: bool) -> GridResult:
    """Held-out success of the model at ``path`` at each temperature: with the budget and summaries, with
    the budget as a hard limit (``summarise`` False, ``budget`` > 0), or with no budget (``budget`` 0)."""
    policy = load_policy(path, "float32", s.model.device)
    arm = s.model_copy(deep=True)
    arm.env.context_budget = budget if summarise else 0
    return temperature_grid(arm, policy.model, policy.tokenizer, temperatures, tasks=tasks, sandbox=sandbox,
                            max_context=None if summarise or not budget else budget)


def _by_t(grid: GridResult) -> str:
    return ", ".join(f"T={t}: {r.pass_at_1:.3f} (fact kept {r.summaries.get('fact_kept')})"
                     for t, r in grid.results.items())


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def run(settings, quick: bool = False, log: Callable[[str], None] = print,
        from_dir: str | None = None) -> dict[str, Any]:
    """The five arms; ``from_dir``: the start model (else :func:`start_model` builds one)."""
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-summarise-") as tmp:
        work = Path(tmp) if quick else Path(settings.var_dir) / "bench" / "summarise"
        work.mkdir(parents=True, exist_ok=True)
        s = _configure(settings, quick, work)
        start = Path(from_dir) if from_dir else start_model(s, work, quick, log)
        split = load_split(s.tasks, s.env)
        tokenizer = load_policy(start, "float32", s.model.device).tokenizer
        budget = pick_budget(s, tokenizer, [*split.train, *split.heldout])
        s.env.context_budget = budget
        temps = grid_temperatures(s)
        log(f"summarise: budget {budget} tokens, {len(split.heldout)} held-out trace tasks x {s.eval.samples} "
            f"at T {temps}, start model {start}")
        with SandboxPool(s.sandbox) as sandbox:
            ceiling = _grid(s, start, split.heldout, sandbox, temps, budget=0, summarise=False)
        log(f"summarise: no_budget (the start model, whole context): {_by_t(ceiling)}")
        if not quick and ceiling.best.pass_at_1 < START_FLOOR:
            raise RuntimeError(
                f"the start model {start} solves {ceiling.best.pass_at_1:.3f} of the held-out trace tasks with its "
                f"whole context (best T={ceiling.best_t}), under {START_FLOOR}: no budgeted arm could tell summaries "
                "apart. Its mid-training did not learn the family (copying the notes' rule into the fix); mid-train "
                "it again (another tiny.seed or more midtrain.steps) or pass a capable model with --from")
        t0 = time.perf_counter()
        grpo = run_grpo(s, start, progress=not quick, log=log, resume=False, evaluate_before=False,
                        evaluate_after=False)
        grpo_s = time.perf_counter() - t0
        log(f"summarise: GRPO took {grpo_s:.0f}s; the control mid-trains the start model for as long")
        control = continue_midtrain(s, start, work / "control", seconds=grpo_s, progress=not quick, log=log)
        runs = {"trained": (grpo.final_dir, True), "untrained": (start, True), "control": (control, True),
                "truncation": (start, False)}
        grids: dict[str, GridResult] = {}
        with SandboxPool(s.sandbox) as sandbox:
            for name, (path, summarise) in runs.items():
                grids[name] = _grid(s, path, split.heldout, sandbox, temps, budget=budget, summarise=summarise)
                log(f"summarise: {name}: {_by_t(grids[name])}")
        grids["no_budget"] = ceiling
    cmp = Comparison(grids=grids, temperatures=temps, serving_t=s.eval.temperature, subject="trained",
                     n_tasks=len(split.heldout), samples=s.eval.samples)
    ok = {name: cmp.best(name)["pass_at_1"] for name in grids}
    summaries = {name: g.best.summaries for name, g in grids.items()}
    trained = summaries["trained"]
    return {
        "budget_tokens": budget,
        **ok,
        "summary_tokens_mean": trained.get("summary_tokens_mean"),
        "compression_ratio": trained.get("compression_ratio"),
        "segments_mean": trained.get("segments_mean", 1.0),
        "trained_over_truncation": _ratio(ok["trained"], ok["truncation"]),
        "trained_over_untrained": _ratio(ok["trained"], ok["untrained"]),
        "gain_vs_untrained": cmp.gain("untrained"),
        "gain_vs_control": cmp.gain("control"),
        "best_t": {name: cmp.best(name) for name in grids},
        "summaries": summaries,
        "truncated_share": {name: round(g.best.truncated, 4) for name, g in grids.items()},
        "temperatures": temps,
        "pass_at_1_by_t": cmp.to_dict()["pass_at_1_by_t"],
        "heldout_tasks": len(split.heldout),
        "samples_per_task": s.eval.samples,
        "start_midtrain_steps": midtrain_record(start).get("steps"),
        "grpo_steps": grpo.steps,
        "grpo_temperature": s.grpo.temperature,
        "summary_token_weight": s.grpo.summary_token_weight,
        "demo_habits": s.midtrain.demo_habits,
        "grpo_s": round(grpo_s, 1),
        "quick": quick,
        "from_dir": from_dir,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
