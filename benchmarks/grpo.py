"""`rtrl bench grpo`: GRPO step throughput, ours (sync and async) against TRL's GRPOTrainer, on
single-turn function tasks, and ours on multi-turn agent episodes.

Same model, same task prompts, same reward, same shape: 4 prompts x 8 samples x <= 32 new tokens per
step, one optimizer step per batch, no KL term, fp32, ``model.threads`` torch threads. The tiny model
first gets a short supervised warm-up (mid-training) so that rewards vary within groups and both
sides do a backward pass on (nearly) every batch; the reward keeps its shaping parts ungated
(``require_pass = False``) for the same reason. TRL runs with ``bf16=False`` and gradient
checkpointing off (ours does not checkpoint either); generation stops at the newline token on both
sides. Both train the same parameters (``grpo.trainable`` of the ``functions`` preset, which these
cells use). sec/step is the steady state: the first step (worker start-up, first forward) is excluded.

Multi-turn cells: repository episodes of ``MULTI_TURNS`` turns each (the warm-up model writes no
valid ``submit``, so every episode runs to the turn limit), sync and async, same model. TRL is not run
on them: its multi-turn path (``environment_factory`` / ``tools`` in GRPOTrainer 1.16) needs a chat
template that renders tool-calling conversations and a model whose completions parse as tool calls
in that template's format; the tiny model has neither (no chat template, a line-based command
protocol), so a TRL cell would measure single-turn generation under another name.

Sync and async (one worker) run in alternating rounds (``ROUNDS``: sync, async, sync, async, ...),
each round a fresh run from the same warm-up, and each mode's sec/step is pooled over its rounds.
On a shared VM the host's speed drifts by 20% within minutes (the same async configuration
measured 0.144 and 0.173 s/step a few minutes apart); back-to-back phases let such a drift land on
one mode only, alternating rounds spread it over both. The per-round ratios are reported too.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from offline_rl.config import RewardSettings
from offline_rl.corpus import build_default_model
from offline_rl.grpo import run_grpo
from offline_rl.midtrain import run_midtrain
from offline_rl.presets import apply_preset
from offline_rl.rewards import RewardFunction
from offline_rl.sandbox import SandboxPool
from offline_rl.splits import load_task_split
from policy.config import TinyModelSettings
from policy.loading import check_model_dir, load_policy
from rtrl.config import Settings

PROMPTS, GROUP, MAX_TOKENS = 4, 8, 32
MULTI_TURNS, MULTI_TOKENS = 8, 12
"""Turns per multi-turn episode and tokens per turn."""
ASYNC_WORKERS = (1, 2)
"""Async is measured with one and with two rollout workers; the headline is the faster (named)."""
ROUNDS = 3
"""Alternating sync / async (one worker) rounds; two workers run once, after them."""


def _steady_sec_per_step(times: list[float]) -> float:
    if len(times) < 3:
        raise RuntimeError("need at least 3 steps to measure a steady state")
    return (times[-1] - times[0]) / (len(times) - 1)


def _ours(settings: Settings, init_dir: Path, work: Path, mode: str, steps: int, log,
          workers: int = 1, tag: str = "", multi_turn: bool = False) -> dict[str, Any]:
    s = settings.model_copy(deep=True)
    g = s.grpo
    g.out_dir, g.mode, g.steps = str(work / f"ours-{mode}-{workers}{tag}"), mode, steps
    g.prompts_per_step, g.group_size, g.max_new_tokens = PROMPTS, GROUP, MAX_TOKENS
    if multi_turn:
        s.env.kind, s.env.max_turns, g.max_new_tokens = "repo", MULTI_TURNS, MULTI_TOKENS
    g.eval_every, g.checkpoint_every, g.publish, g.warmup_steps, g.kl_coef = 0, 10_000, False, 0, 0.0
    # Each worker keeps one batch in flight, so with W workers a batch is about W versions old when
    # the trainer takes it: the staleness bound follows the worker count (the TIS weight corrects it).
    g.workers, g.queue_size, g.max_staleness = workers, workers, max(g.max_staleness, workers)
    s.rewards.require_pass = False
    t0 = time.perf_counter()
    res = run_grpo(s, init_dir, progress=False, resume=False, evaluate_before=False, evaluate_after=False)
    wall = time.perf_counter() - t0
    recs = [json.loads(x) for x in res.metrics_path.read_text().splitlines()]
    times = [r["time"] for r in recs]
    sps = _steady_sec_per_step(times)
    tokens = sum(r["gen_tokens"] for r in recs[1:]) / max(1, len(recs) - 1)
    out = {"sec_per_step": sps, "tokens_per_s": tokens / sps, "steps": len(recs), "wall_s": wall,
           "updated_fraction": sum(bool(r.get("updated")) for r in recs) / len(recs),
           "mean_staleness": sum(r["staleness"] for r in recs) / len(recs), "dropped_stale": res.dropped_stale,
           "mean_reward": sum(r["reward_mean"] for r in recs) / len(recs),
           "steady_steps": len(recs) - 1, "steady_s": times[-1] - times[0], "steady_tokens": tokens * (len(recs) - 1),
           "mean_turns": sum(r["mean_turns"] for r in recs) / len(recs)}
    # Where a step's time went (means over the steady steps; see offline_rl/grpo.py for each key), and
    # the CPU it cost all processes: with both modes' work on this machine's cores, that CPU over
    # the core count is the least sec/step any overlap of rollouts and training could reach.
    steady = recs[1:]
    keys = ("wait_s", "gen_s", "gen_cpu_s", "sandbox_cpu_s", "train_s", "train_cpu_s", "step_cpu_s", "handoff_s",
            "slot_wait_s", "sync_s", "publish_s")
    out["phases"] = {k: round(sum(r[k] for r in steady) / len(steady), 4) for k in keys if k in steady[-1]}
    cpu = sum(r["step_cpu_s"] + r.get("sandbox_cpu_s", 0.0) + (r["gen_cpu_s"] if mode == "async" else 0.0)
              for r in steady) / len(steady)
    out["cpu_s_per_step"] = round(cpu, 4)
    out["cpu_floor_sec_per_step"] = round(cpu / (os.cpu_count() or 1), 4)
    log(f"ours[{mode}, {workers} worker(s)]: {sps:.3f} s/step, {out['tokens_per_s']:.0f} tok/s, updated {out['updated_fraction']:.2f}, "
        f"staleness {out['mean_staleness']:.2f}, dropped {res.dropped_stale}, CPU {cpu:.3f} s/step "
        f"(floor {out['cpu_floor_sec_per_step']:.3f} s/step on {os.cpu_count()} cores)")
    return out


def _pooled(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's rounds as one measurement: sec/step over all their steady steps, phases and CPU
    weighted by steady steps, staleness and updates by all steps."""
    if len(rounds) == 1:
        return rounds[0]
    n = sum(r["steady_steps"] for r in rounds)
    steps = sum(r["steps"] for r in rounds)
    sps = sum(r["steady_s"] for r in rounds) / n

    def by_steady(key: str) -> float:
        return sum(r[key] * r["steady_steps"] for r in rounds) / n

    def by_step(key: str) -> float:
        return sum(r[key] * r["steps"] for r in rounds) / steps

    return {"sec_per_step": sps, "tokens_per_s": sum(r["steady_tokens"] for r in rounds) / n / sps,
            "steps": steps, "wall_s": sum(r["wall_s"] for r in rounds),
            "updated_fraction": by_step("updated_fraction"), "mean_staleness": by_step("mean_staleness"),
            "dropped_stale": sum(r["dropped_stale"] for r in rounds), "mean_reward": by_step("mean_reward"),
            "phases": {k: round(sum(r["phases"][k] * r["steady_steps"] for r in rounds) / n, 4)
                       for k in rounds[0]["phases"]},
            "cpu_s_per_step": round(by_steady("cpu_s_per_step"), 4),
            "cpu_floor_sec_per_step": round(by_steady("cpu_floor_sec_per_step"), 4)}


def _trl(settings: Settings, init_dir: Path, work: Path, steps: int, log) -> dict[str, Any]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    policy = load_policy(init_dir)
    tok = policy.tokenizer
    # The same trainable subset as ours (grpo.trainable): TRL's optimizer takes only parameters that
    # require a gradient, and the backward pass skips the frozen weights' gradients on both sides.
    pattern = re.compile(settings.grpo.trainable)
    for name, param in policy.model.named_parameters():
        param.requires_grad_(bool(pattern.search(name)))
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    split = load_task_split(settings.tasks)
    by_prompt = {t.prompt: t for t in split.train}
    prompts = [split.train[i % len(split.train)].prompt for i in range(PROMPTS * (steps + 2))]
    sandbox = SandboxPool(settings.sandbox)
    reward_fn = RewardFunction(sandbox, RewardSettings(**{**settings.rewards.model_dump(), "require_pass": False}))

    def reward(prompts, completions, **_):
        items = []
        for p, c in zip(prompts, completions, strict=True):
            line, nl, _ = c.partition("\n")
            items.append((by_prompt[p], line, bool(nl)))
        return [r.total for r in reward_fn.score_many(items)]

    stamps: list[float] = []
    lengths: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    cfg = GRPOConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP,
        max_completion_length=MAX_TOKENS, learning_rate=settings.grpo.lr, beta=0.0, max_steps=steps,
        logging_steps=1, save_strategy="no", report_to="none", bf16=False, use_cpu=True,
        gradient_checkpointing=False, temperature=1.0, seed=settings.grpo.seed, dataloader_num_workers=0,
        disable_tqdm=True,
        epsilon=settings.grpo.clip_low, epsilon_high=settings.grpo.clip_high, loss_type="dapo",
        scale_rewards="none",
    )
    # TRL takes its stop tokens (for generation *and* the completion mask) from the model's
    # generation config: make the newline a stop token there, as our sampler's stop string is.
    policy.model.generation_config.eos_token_id = [tok.eos_token_id, *newline]
    policy.model.train()
    trainer = GRPOTrainer(model=policy.model, reward_funcs=[reward], args=cfg,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok,
                          callbacks=[Stamp()])
    torch.set_num_threads(settings.model.threads)
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        sandbox.close()
    wall = time.perf_counter() - t0
    sps = _steady_sec_per_step(stamps)
    tokens = (sum(lengths) / len(lengths)) * PROMPTS * GROUP if lengths else float("nan")
    log(f"trl: {sps:.3f} s/step, {tokens / sps:.0f} tok/s")
    return {"sec_per_step": sps, "tokens_per_s": tokens / sps, "steps": len(stamps), "wall_s": wall}


def run(settings: Settings, quick: bool, log) -> dict[str, Any]:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(settings.model.threads)
    # 24 steps, not 12: one step of ours is ~0.1 s, so 12 steps were about a second of steady state,
    # and one burst of load from another process moved sec/step by 10-30% (sync 0.129-0.167 s on
    # an otherwise idle machine). Longer runs average such bursts out for every mode alike.
    rounds = 1 if quick else ROUNDS
    steps = 5 if quick else 1 + 24 // rounds  # per round: one start-up step, then the steady ones
    trl_steps = 4 if quick else 8
    with tempfile.TemporaryDirectory(prefix="bench-grpo-") as tmp:
        work = Path(tmp)
        try:
            base = check_model_dir(settings.model.dir)
        except Exception:
            log(f"no model at {settings.model.dir}: building the tiny default in a temporary directory")
            base = build_default_model(work / "tiny", TinyModelSettings(corpus_examples=4000))
        s = settings.model_copy(deep=True)
        s.midtrain.steps, s.midtrain.warmup_steps, s.midtrain.eval_at_end = (30 if quick else 120), 10, False
        s.midtrain.agent_share, s.midtrain.batch_tokens = 0.0, 2880  # function documents, as TRL sees them
        log(f"warm-up: {s.midtrain.steps} mid-training steps")
        init = run_midtrain(s, init_dir=base, out_dir=work / "warm", progress=False)
        s = apply_preset(s, "functions")
        sync_rounds, async_rounds = [], []
        for k in range(rounds):
            sync_rounds.append(_ours(s, init, work, "sync", steps, log, tag=f"-r{k}"))
            async_rounds.append(_ours(s, init, work, "async", steps + 2, log, tag=f"-r{k}"))
        sync = _pooled(sync_rounds)
        by_workers = {1: _pooled(async_rounds)}
        for w in ASYNC_WORKERS[1:]:
            by_workers[w] = _ours(s, init, work, "async", rounds * (steps - 1) + 1 + 2 * w, log, workers=w)
        best_w = min(by_workers, key=lambda w: by_workers[w]["sec_per_step"])
        asyn = by_workers[best_w]
        trl = _trl(s, init, work, trl_steps, log)
        multi = {mode: _ours(s, init, work, mode, 4 if quick else 7, log, tag="-multi", multi_turn=True)
                 for mode in ("sync", "async")}
    return {
        "ours_sync_sec_per_step": round(sync["sec_per_step"], 4),
        "ours_async_sec_per_step": round(asyn["sec_per_step"], 4),
        "trl_sec_per_step": round(trl["sec_per_step"], 4),
        "ours_sync_tokens_per_s": round(sync["tokens_per_s"], 1),
        "ours_async_tokens_per_s": round(asyn["tokens_per_s"], 1),
        "trl_tokens_per_s": round(trl["tokens_per_s"], 1),
        "ratio_vs_trl": round(trl["sec_per_step"] / min(sync["sec_per_step"], asyn["sec_per_step"]), 3),
        "sync_vs_trl": round(trl["sec_per_step"] / sync["sec_per_step"], 3),
        "async_over_sync": round(sync["sec_per_step"] / asyn["sec_per_step"], 3),
        "async_over_sync_by_round": [round(sr["sec_per_step"] / ar["sec_per_step"], 3)
                                     for sr, ar in zip(sync_rounds, async_rounds, strict=True)],
        "rounds": rounds,
        "async_mean_staleness": round(asyn["mean_staleness"], 3),
        "async_dropped_stale": asyn["dropped_stale"],
        "ours_updated_fraction": round(min(sync["updated_fraction"], asyn["updated_fraction"]), 3),
        "shape": {"prompts": PROMPTS, "samples": GROUP, "max_new_tokens": MAX_TOKENS},
        "steps": {"sync": sync["steps"], "async": asyn["steps"], "trl": trl["steps"]},
        "async_sec_per_step_by_workers": {str(w): round(r["sec_per_step"], 4) for w, r in by_workers.items()},
        "rollout_workers": best_w, "sync_phases": sync["phases"], "async_phases": asyn["phases"],
        "sync_cpu_s_per_step": sync["cpu_s_per_step"], "async_cpu_s_per_step": asyn["cpu_s_per_step"],
        "async_cpu_floor_sec_per_step": asyn["cpu_floor_sec_per_step"],
        "trainable": s.grpo.trainable, "trl_gradient_checkpointing": False,
        "dtype": "float32", "quick": quick,
        "multi_turn": {
            "turns_per_episode": round(multi["sync"]["mean_turns"], 2), "max_new_tokens_per_turn": MULTI_TOKENS,
            "shape": {"prompts": PROMPTS, "samples": GROUP},
            "ours_sync_sec_per_step": round(multi["sync"]["sec_per_step"], 4),
            "ours_async_sec_per_step": round(multi["async"]["sec_per_step"], 4),
            "ours_sync_tokens_per_s": round(multi["sync"]["tokens_per_s"], 1),
            "ours_async_tokens_per_s": round(multi["async"]["tokens_per_s"], 1),
            "async_over_sync": round(multi["sync"]["sec_per_step"] / multi["async"]["sec_per_step"], 3),
            "trl": "not run: TRL's multi-turn GRPO needs a tool-calling chat template and a model trained to "
                   "emit its tool-call format (see benchmarks/grpo.py)",
        },
    }
