"""`rtrl bench learning`: does offline RL teach the model something, beyond what a temperature or more
mid-training gives? The whole comparison from a fresh tiny model, on the configured environment.

1. build the tiny default model and mid-train it (``midtrain.*``);
2. GRPO from the mid-trained model (``grpo.*``; no evaluation inside the run, so its wall time is
   training alone);
3. the matched-compute control: mid-training continued from the same checkpoint for GRPO's wall time
   (:func:`offline_rl.midtrain.continue_midtrain`);
4. each of the three evaluated on the held-out tasks at every temperature of ``eval.temperatures``;
   each is compared at its own best temperature, with 95% intervals of the paired per-task
   differences, and the agent's behaviour (tests before editing and before submitting, retries after a
   failing run, turns per solved task) before and after RL.

Artefacts stay in ``<var_dir>/bench/learning`` (a temporary directory with ``--quick``, which runs
every step at toy sizes to check the pipeline, not to measure).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from offline_rl.corpus import build_default_model
from offline_rl.evaluate import GridResult, paired_gain, temperature_grid
from offline_rl.grpo import run_grpo
from offline_rl.midtrain import continue_midtrain, run_midtrain
from offline_rl.presets import apply_overrides
from offline_rl.sandbox import SandboxPool
from offline_rl.splits import load_split
from policy.loading import load_policy

QUICK = {
    "tiny": {"corpus_examples": 600},
    "midtrain": {"steps": 30, "batch_tokens": 1024, "warmup_steps": 2},
    "grpo": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 12, "mode": "sync"},
    "env": {"max_turns": 3},
    "tasks": {"repo_heldout_per_family": 1},
    "eval": {"samples": 2, "k": [1], "temperatures": [1.0, 0.5]},
}


def _configure(settings, quick: bool, work: Path):
    s = settings.model_copy(deep=True)
    if quick:
        apply_overrides(s, QUICK)
    s.midtrain.eval_at_end = False
    s.grpo.out_dir = str(work / "grpo")
    s.grpo.eval_every, s.grpo.publish = 0, False
    return s


def _best(grid: GridResult) -> dict[str, Any]:
    r = grid.best
    return {"t": grid.best_t, "pass_at_1": round(r.pass_at_1, 4), "ci95": [round(x, 4) for x in r.ci95]}


def _gain(a: GridResult, b: GridResult) -> dict[str, Any]:
    g = paired_gain(a.best, b.best)
    return {"gain": round(g["gain"], 4), "ci95": [round(x, 4) for x in g["ci95"]], "tasks": g["tasks"]}


def run(settings, quick: bool = False, log: Callable[[str], None] = print,
        from_dir: str | None = None) -> dict[str, Any]:
    """The comparison; ``from_dir``: a mid-trained model to start from (steps 1 skipped, its recorded
    training time reported)."""
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
        work = Path(tmp) if quick else Path(settings.var_dir) / "bench" / "learning"
        work.mkdir(parents=True, exist_ok=True)
        s = _configure(settings, quick, work)
        temps = sorted(set(s.eval.temperatures) | {s.eval.temperature}, reverse=True)
        log(f"learning: env={s.env.kind}, temperatures {temps}, work dir {work}")
        if from_dir:
            mid = Path(from_dir)
            record = json.loads((mid / "midtrain.json").read_text()) if (mid / "midtrain.json").is_file() else {}
            midtrain_s = float(record.get("train_s", 0.0))
            s.midtrain.steps = int(record.get("steps", s.midtrain.steps))
            log(f"learning: starting from the mid-trained model {mid}")
        else:
            base = build_default_model(work / "tiny", s.tiny)
            t0 = time.perf_counter()
            mid = run_midtrain(s, init_dir=base, out_dir=work / "mid", progress=not quick, log=log)
            midtrain_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        grpo = run_grpo(s, mid, progress=not quick, log=log, resume=False, evaluate_before=False,
                        evaluate_after=False)
        grpo_s = time.perf_counter() - t0
        log(f"learning: GRPO took {grpo_s:.0f}s; the control mid-trains for as long")
        control = continue_midtrain(s, mid, work / "control", seconds=grpo_s, progress=not quick, log=log)
        heldout = load_split(s.tasks, s.env).heldout
        grids: dict[str, GridResult] = {}
        with SandboxPool(s.sandbox) as sandbox:
            for name, path in (("midtrain", mid), ("control", control), ("grpo", grpo.final_dir)):
                policy = load_policy(path, "float32", s.model.device)
                grids[name] = temperature_grid(s, policy.model, policy.tokenizer, temps, tasks=heldout, sandbox=sandbox)
                log(f"learning: {name}: " + ", ".join(f"T={t}: {r.pass_at_1:.3f}" for t, r in grids[name].results.items()))
    serving_t = s.eval.temperature
    grpo_serving = grids["grpo"].results.get(serving_t)
    return {
        "env": s.env.kind,
        "temperatures": temps,
        "serving_t": serving_t,
        "midtrain_best_t": _best(grids["midtrain"]),
        "control_best_t": _best(grids["control"]),
        "grpo_best_t": _best(grids["grpo"]),
        "grpo_at_serving_t": round(grpo_serving.pass_at_1, 4) if grpo_serving else None,
        "gain_vs_midtrain": _gain(grids["grpo"], grids["midtrain"])["gain"],
        "gain_vs_control": _gain(grids["grpo"], grids["control"])["gain"],
        "gain_vs_midtrain_detail": _gain(grids["grpo"], grids["midtrain"]),
        "gain_vs_control_detail": _gain(grids["grpo"], grids["control"]),
        "pass_at_1_by_t": {name: {str(t): round(r.pass_at_1, 4) for t, r in g.results.items()}
                           for name, g in grids.items()},
        "behaviours": {"before": grids["midtrain"].best.behaviour, "after": grids["grpo"].best.behaviour,
                       "before_at_serving_t": grids["midtrain"].results[serving_t].behaviour
                       if serving_t in grids["midtrain"].results else {},
                       "after_at_serving_t": grpo_serving.behaviour if grpo_serving else {}},
        "heldout_tasks": len(heldout),
        "samples_per_task": s.eval.samples,
        "midtrain_steps": s.midtrain.steps,
        "midtrain_s": round(midtrain_s, 1),
        "grpo_steps": grpo.steps,
        "grpo_s": round(grpo_s, 1),
        "quick": quick,
        "from_dir": from_dir,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
