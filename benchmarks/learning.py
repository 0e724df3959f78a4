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

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from offline_rl.compare import compare_models, grid_temperatures
from offline_rl.corpus import build_default_model
from offline_rl.grpo import run_grpo
from offline_rl.midtrain import continue_midtrain, midtrain_record, run_midtrain
from offline_rl.presets import apply_overrides

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


def run(settings, quick: bool = False, log: Callable[[str], None] = print,
        from_dir: str | None = None) -> dict[str, Any]:
    """The comparison; ``from_dir``: a mid-trained model to start from (steps 1 skipped, its recorded
    training time reported)."""
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
        work = Path(tmp) if quick else Path(settings.var_dir) / "bench" / "learning"
        work.mkdir(parents=True, exist_ok=True)
        s = _configure(settings, quick, work)
        log(f"learning: env={s.env.kind}, temperatures {grid_temperatures(s)}, work dir {work}")
        if from_dir:
            mid = Path(from_dir)
            record = midtrain_record(mid)
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
        cmp = compare_models(s, {"midtrain": mid, "control": control, "grpo": grpo.final_dir}, "grpo",
                             log=lambda m: log(f"learning: {m}")).to_dict()
    return {
        "env": s.env.kind,
        "temperatures": cmp["temperatures"],
        "serving_t": cmp["serving_t"],
        "midtrain_best_t": cmp["best_t"]["midtrain"],
        "control_best_t": cmp["best_t"]["control"],
        "grpo_best_t": cmp["best_t"]["grpo"],
        "grpo_at_serving_t": cmp["subject_at_serving_t"],
        "gain_vs_midtrain": cmp["gains"]["midtrain"]["gain"],
        "gain_vs_control": cmp["gains"]["control"]["gain"],
        "gain_vs_midtrain_detail": cmp["gains"]["midtrain"],
        "gain_vs_control_detail": cmp["gains"]["control"],
        "pass_at_1_by_t": cmp["pass_at_1_by_t"],
        "behaviours": {"before": cmp["behaviours"]["midtrain"], "after": cmp["behaviours"]["grpo"],
                       "before_at_serving_t": cmp["behaviours_at_serving_t"].get("midtrain", {}),
                       "after_at_serving_t": cmp["behaviours_at_serving_t"].get("grpo", {})},
        "heldout_tasks": cmp["heldout_tasks"],
        "samples_per_task": cmp["samples_per_task"],
        "midtrain_steps": s.midtrain.steps,
        "midtrain_s": round(midtrain_s, 1),
        "grpo_steps": grpo.steps,
        "grpo_s": round(grpo_s, 1),
        "quick": quick,
        "from_dir": from_dir,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
