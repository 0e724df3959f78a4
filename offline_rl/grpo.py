"""GRPO (Shao et al., 2024, DeepSeekMath) on the sandboxed coding environment, sync or async.

Per step: G episodes for each of ``prompts_per_step`` train tasks; rewards r_ij from the composite
reward; advantages A_ij = r_ij − mean_j r_i· (optionally / std: ``scale_by_std``); groups whose G
rewards are all equal carry no signal and are dropped (counted); PPO clipped surrogate with separate
low/high clip (DAPO), token- or sequence-level normalisation; optional k3 KL to the initial policy;
gradient-norm clipping; AdamW with warm-up and a schedule.

Where this departs from the paper, and why:

* **Decoupled behaviour / proximal policy** (as in AReaL, Fu et al. 2025). In async mode a batch was
  sampled by weights up to ``max_staleness`` versions old, and by a different engine (vLLM or the
  KV-cache sampler) whose numerics differ from the trainer's. The trainer recomputes the log-probs of
  every sampled token with its own current weights (π_old, the proximal policy), clips the ratio
  π_θ/π_old, and multiplies each token's loss by the truncated importance weight
  w_t = min(π_old / μ, C) with μ the engine's log-probs (Yao et al. 2025). In sync mode μ and π_old
  differ by numerics only; the logged ``mismatch_*`` metrics measure that gap every step.
* Batches older than ``max_staleness`` versions are dropped (``dropped_stale``), not reweighted.
* **Which parameters learn** (``trainable``, a regex; default ``norm``). On the tiny default model,
  full-parameter updates on fresh prompts lowered held-out pass@1 at every learning rate tried, while
  the same update on fixed prompts raised *their* pass rate fast: it learns answers to the training
  functions. Updating only the RMSNorm gains (0.1% of the weights) keeps the part of the signal that
  transfers (rescaling features, sharpening the output distribution) and took held-out pass@1
  0.42 -> 0.52 in 20 steps (measurements in offline_rl/presets.py). Use ``.`` for a large model.
* Prompt sharing: the G completions of a prompt are recomputed against one pass over the prompt
  (:func:`policy.logprobs.sequence_logprobs`), identical in value and gradient to the plain layout.
* Multi-turn episodes: tool observations are part of the context but masked out of the loss.
* The trainer counts a step per consumed batch; a batch with only zero-variance groups makes no
  update (the version does not advance).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from offline_rl.evaluate import EvalResult
from rtrl.config import Settings

CKPT_DIR = "checkpoints"
METRICS = "metrics.jsonl"


@dataclass
class GRPOResult:
    out_dir: Path
    final_dir: Path
    metrics_path: Path
    steps: int
    before: EvalResult | None
    after: EvalResult | None
    gate_threshold: float
    published_version: str | None = None
    published_step: int | None = None
    final_version: str | None = None  # the final checkpoint, published when it beat the first by a margin
    wall_s: float = 0.0
    dropped_stale: int = 0
    zero_variance_groups: int = 0
    evals: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        return {"out_dir": str(self.out_dir), "final_dir": str(self.final_dir), "metrics": str(self.metrics_path),
                "steps": self.steps, "pass_at_1_before": self.before.pass_at_1 if self.before else None,
                "pass_at_1_after": self.after.pass_at_1 if self.after else None,
                "gate_threshold": self.gate_threshold, "published_version": self.published_version,
                "published_step": self.published_step, "final_version": self.final_version, "wall_s": round(self.wall_s, 1),
                "dropped_stale": self.dropped_stale, "zero_variance_groups": self.zero_variance_groups}


def load_task_split(settings: Settings):
    """Train / held-out tasks: the generator, or a JSONL file whose tasks say ``metadata.split``."""
    from offline_rl.tasks import TaskSplit, generate_tasks, load_tasks_jsonl, make_task, split_specs

    ts = settings.tasks
    if ts.jsonl:
        tasks = load_tasks_jsonl(ts.jsonl)
        held = [t for t in tasks if t.metadata.get("split") == "heldout"]
        train = [t for t in tasks if t.metadata.get("split") != "heldout"]
        if not held or not train:
            raise ValueError(f"{ts.jsonl}: needs tasks with metadata.split == 'heldout' and others for training")
        return TaskSplit(train=train, heldout=held)
    split = generate_tasks(ts.seed, ts.heldout_fraction)
    if ts.train_instances == 1:
        return split
    # More training prompts per train function (fresh visible examples each), from the same split, so
    # the held-out set is exactly the generator's and no held-out function can leak in.
    train_specs, _ = split_specs(ts.seed, ts.heldout_fraction)
    rng = random.Random(ts.seed + 10_007)
    train = [make_task(spec, rng, f"train-{i}-{k}") for i, spec in enumerate(train_specs)
             for k in range(ts.train_instances)]
    return TaskSplit(train=train, heldout=split.heldout)


def pad_float(rows: list[list[float]], width: int):
    import torch

    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.tensor(r[:width], dtype=torch.float32)
    return out


def pad_bool(rows: list[list[bool]], width: int):
    import torch

    out = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.tensor(r[:width], dtype=torch.bool)
    return out


class GRPOTrainer:
    """The learner: policy, optional frozen reference, AdamW, schedule; ``train_on(batch) -> metrics``."""

    def __init__(self, settings: Settings, model_dir: str | Path):
        import torch

        from policy.loading import load_policy

        self.settings = settings
        self.cfg = settings.grpo
        torch.manual_seed(self.cfg.seed)
        policy = load_policy(model_dir, "float32", settings.model.device)
        self.model, self.tokenizer, self.device = policy.model, policy.tokenizer, policy.device
        self.model.train()
        pattern = re.compile(self.cfg.trainable)
        for name, param in self.model.named_parameters():
            param.requires_grad_(bool(pattern.search(name)))
        self.n_trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        if not self.n_trainable:
            raise ValueError(f"grpo.trainable={self.cfg.trainable!r} matches no parameter of {model_dir}")
        self.ref = None
        if self.cfg.kl_coef > 0:
            self.ref = load_policy(model_dir, "float32", settings.model.device).model.eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=self.cfg.lr, weight_decay=self.cfg.weight_decay,
                                     betas=(0.9, 0.99))
        self.version = 0
        self.step = 0

    def lr_at(self, step: int) -> float:
        from offline_rl.midtrain import lr_factor

        c = self.cfg
        return c.lr * lr_factor(step, c.steps, c.warmup_steps, c.min_lr_ratio, c.schedule)

    def train_on(self, trajs, staleness: int = 0) -> dict:
        import torch

        from policy.logprobs import sequence_logprobs
        from policy.losses import (
            group_advantages,
            grpo_policy_loss,
            masked_mean,
            mismatch_metrics,
            truncated_importance_weight,
            zero_variance_groups,
        )

        c = self.cfg
        G = c.group_size
        n_groups = len(trajs) // G
        rewards = torch.tensor([t.reward for t in trajs[:n_groups * G]], dtype=torch.float32).view(n_groups, G)
        zero = zero_variance_groups(rewards)
        adv_all = group_advantages(rewards, c.scale_by_std)
        keep = [g for g in range(n_groups) if not bool(zero[g])]
        m: dict = {"zero_variance_groups": int(zero.sum()), "groups": n_groups}
        sel = [trajs[g * G + j] for g in keep for j in range(G)]
        sel = [t for t in sel if t.completion_ids]
        if not sel:
            m.update({"updated": False, "lr": self.lr_at(self.step)})
            self.step += 1
            return m
        adv = torch.tensor([float(adv_all[g, j]) for g in keep for j in range(G)
                            if trajs[g * G + j].completion_ids], dtype=torch.float32)
        prompts = [t.prompt_ids for t in sel]
        comps = [t.completion_ids for t in sel]
        width = max(len(x) for x in comps)
        action = pad_bool([t.action_mask for t in sel], width).to(self.device)
        behaviour = pad_float([t.behaviour_logprobs for t in sel], width).to(self.device)
        pad_id = self.tokenizer.pad_token_id
        mb = c.micro_batch
        chunks = [list(range(i, min(i + mb, len(sel)))) for i in range(0, len(sel), mb)]
        mask = action
        n_tok = mask.sum().clamp_min(1).item()
        # π_old is the trainer's own log-prob of each sampled token under its current weights. With one
        # pass over the batch those weights are exactly the ones the gradient forward uses, so π_old is
        # that forward's output, detached (same numbers as a separate no-grad recompute, one forward
        # fewer). With several epochs it must be frozen first, so it is recomputed up front.
        fused = c.epochs_per_batch == 1
        old = tis = ref = None
        if not fused:
            old = torch.zeros((len(sel), width), device=self.device)
            ent = torch.zeros((len(sel), width), device=self.device)
            for ch in chunks:
                tl = sequence_logprobs(self.model, [prompts[i] for i in ch], [comps[i] for i in ch],
                                       with_entropy=True, pad_token_id=pad_id)
                old[ch, :tl.logprobs.shape[1]] = tl.logprobs
                ent[ch, :tl.entropy.shape[1]] = tl.entropy
            tis = truncated_importance_weight(old, behaviour, c.tis_cap)
        if self.ref is not None:
            ref = torch.zeros((len(sel), width), device=self.device)
            for ch in chunks:
                rl = sequence_logprobs(self.ref, [prompts[i] for i in ch], [comps[i] for i in ch], pad_token_id=pad_id)
                ref[ch, :rl.logprobs.shape[1]] = rl.logprobs
        lr = self.lr_at(self.step)
        for group in self.opt.param_groups:
            group["lr"] = lr
        agg: dict[str, float] = {}
        grad_norm = 0.0
        loss_total = 0.0
        if fused:
            old = torch.zeros((len(sel), width), device=self.device)
            ent = torch.zeros((len(sel), width), device=self.device)
        for _ in range(c.epochs_per_batch):
            self.opt.zero_grad(set_to_none=True)
            for ch in chunks:
                idx = torch.tensor(ch)
                tl = sequence_logprobs(self.model, [prompts[i] for i in ch], [comps[i] for i in ch], grad=True,
                                       with_entropy=fused, pad_token_id=pad_id)
                w = tl.logprobs.shape[1]
                cm = mask[idx][:, :w]
                if fused:
                    old_c = tl.logprobs.detach()
                    old[ch, :w] = old_c
                    ent[ch, :w] = tl.entropy.detach()
                    tis_c = truncated_importance_weight(old_c, behaviour[idx][:, :w], c.tis_cap)
                else:
                    old_c, tis_c = old[idx][:, :w], tis[idx][:, :w]
                loss, lm = grpo_policy_loss(
                    tl.logprobs, old_c, adv[idx], cm, clip_low=c.clip_low, clip_high=c.clip_high,
                    level=c.loss_level, tis_weight=tis_c,
                    ref_logp=None if ref is None else ref[idx][:, :w], kl_coef=c.kl_coef)
                share = (cm.sum().item() / n_tok) if c.loss_level == "token" else len(ch) / len(sel)
                (loss * share).backward()
                loss_total += loss.item() * share
                for k, v in lm.items():
                    agg[k] = agg.get(k, 0.0) + v * share
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip))
            self.opt.step()
        if fused:
            tis = truncated_importance_weight(old, behaviour, c.tis_cap)
        m.update(mismatch_metrics(old, behaviour, mask))
        m["tis_mean"] = masked_mean(tis, mask).item()
        m["tis_truncated_frac"] = masked_mean((torch.exp(old - behaviour) > c.tis_cap).float(), mask).item()
        m["entropy"] = masked_mean(ent, mask).item()
        self.version += 1
        self.step += 1
        e = c.epochs_per_batch
        m.update({k: v / e for k, v in agg.items()})
        m.update({"updated": True, "loss": loss_total / e, "grad_norm": grad_norm, "lr": lr,
                  "policy_tokens": int(n_tok), "trained_completions": len(sel), "staleness": staleness})
        return m

    # -- checkpoints ---------------------------------------------------------------------------

    def save_hf(self, out: Path) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out, safe_serialization=True)
        self.tokenizer.save_pretrained(out)
        return out

    def save_checkpoint(self, run_dir: Path, extra: dict) -> Path:
        """Atomic: write ``step-N.tmp``, rename, then replace the ``latest`` pointer."""
        import torch

        root = run_dir / CKPT_DIR
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step-{self.step:06d}"
        tmp = root / f"step-{self.step:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.save_hf(tmp)
        torch.save({"optimizer": self.opt.state_dict(), "step": self.step, "version": self.version,
                    "torch_rng": torch.get_rng_state(), "extra": extra}, tmp / "trainer_state.pt")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = root / "latest.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, root / "latest")
        done = sorted(d for d in root.glob("step-*") if d.is_dir() and not d.name.endswith(".tmp"))
        for stale in done[:-2]:  # keep the newest two
            shutil.rmtree(stale, ignore_errors=True)
        return final

    def load_checkpoint(self, ckpt: Path) -> dict:
        import torch
        from safetensors.torch import load_file

        state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
        weights = {}
        for f in sorted(ckpt.glob("*.safetensors")):
            weights.update(load_file(f))
        self.model.load_state_dict(weights, strict=False)
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.version = int(state["step"]), int(state["version"])
        torch.set_rng_state(state["torch_rng"])
        return state["extra"]


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / CKPT_DIR / "latest"
    if not pointer.is_file():
        return None
    path = run_dir / CKPT_DIR / pointer.read_text().strip()
    return path if (path / "trainer_state.pt").is_file() else None


def truncate_metrics(path: Path, max_step: int) -> None:
    """After a crash the log may hold steps past the checkpoint; keep only what the checkpoint saw."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line torn by the kill
        if rec.get("step", 0) <= max_step:
            kept.append(line)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    os.replace(tmp, path)


def _batch_metrics(trajs) -> dict:
    n = len(trajs)
    out = {"reward_mean": sum(t.reward for t in trajs) / n, "pass_rate": sum(t.passed for t in trajs) / n,
           "completions": n, "mean_turns": sum(t.turns for t in trajs) / n,
           "gen_tokens": sum(t.n_policy_tokens for t in trajs)}
    keys = sorted({k for t in trajs for k in t.parts})
    for k in keys:
        out[f"reward_{k}"] = sum(t.parts.get(k, 0.0) for t in trajs) / n
    return out


def run_grpo(settings: Settings, init_dir: str | Path | None = None, *, progress: bool = True,
             log: Callable[[str], None] | None = None, resume: bool = True, evaluate_before: bool = True,
             evaluate_after: bool = True, publish_fn: Callable[..., str | None] | None = None) -> GRPOResult:
    """Train with GRPO from ``init_dir`` (default: the mid-trained model) into ``grpo.out_dir``.

    Resumes from the newest checkpoint in the run directory when ``resume``. Evaluates held-out
    pass@1 before and after (and every ``eval_every`` steps); the first evaluation at or over
    ``eval.gate_threshold`` is published (``publish_fn``, default :func:`offline_rl.publish.publish_model`)."""
    import torch
    from tqdm import tqdm

    from offline_rl.env import CodingEnv
    from offline_rl.evaluate import evaluate
    from offline_rl.judge import make_judge
    from offline_rl.rewards import RewardFunction
    from offline_rl.rollout import TorchBackend, run_episodes
    from offline_rl.sandbox import SandboxPool
    from offline_rl.workers import AsyncRollouts, WorkerConfig, sample_tasks

    say = log or (lambda msg: None)
    cfg, ev_cfg = settings.grpo, settings.eval
    torch.set_num_threads(settings.model.threads)
    t_start = time.perf_counter()
    run_dir = Path(cfg.out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = run_dir / METRICS
    init_dir = Path(init_dir or settings.midtrain.out_dir)
    ckpt = latest_checkpoint(run_dir) if resume else None
    trainer = GRPOTrainer(settings, init_dir)
    state = {"published_version": None, "published_step": None, "dropped_stale": 0, "zero_variance_groups": 0,
             "before": None, "evals": [], "init_dir": str(init_dir)}
    if ckpt is not None:
        state.update(trainer.load_checkpoint(ckpt))
        truncate_metrics(metrics_path, trainer.step)
        say(f"grpo: resumed from {ckpt} (step {trainer.step}, version {trainer.version})")
    elif metrics_path.exists():
        metrics_path.unlink()
    split = load_task_split(settings)
    sandbox = SandboxPool(settings.sandbox)
    env = CodingEnv(sandbox, settings.env)
    reward_fn = RewardFunction(sandbox, settings.rewards, make_judge(settings.judge))
    say(f"grpo: sandbox isolation={sandbox.isolation} ({sandbox.isolation_reason}); mode={cfg.mode}, "
        f"engine={cfg.rollout_engine}, {len(split.train)} train / {len(split.heldout)} held-out tasks")

    def run_eval(tag: str) -> EvalResult:
        r = evaluate(trainer.model, trainer.tokenizer, split.heldout, samples=ev_cfg.samples, k=ev_cfg.k,
                     temperature=ev_cfg.temperature, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed + 17,
                     sandbox=sandbox, env_settings=settings.env)
        trainer.model.train()
        rec = {"step": trainer.step, "tag": tag, "pass_at_1": r.pass_at_1,
               "pass_at_k": {str(k): v for k, v in r.pass_at_k.items()}}
        state["evals"].append(rec)
        say(f"grpo: step {trainer.step} held-out pass@1 {r.pass_at_1:.3f} ({tag})")
        return r

    def maybe_publish(r: EvalResult, final: bool = False) -> None:
        """The first evaluation at or over the gate is published; at the end of the run the final
        checkpoint supersedes it if it beat it by ``supersede_margin`` (users should get the better one)."""
        if not cfg.publish or r.pass_at_1 < ev_cfg.gate_threshold:
            return
        first = state["published_version"] is None
        best = state.get("final_pass_at_1") or state.get("published_pass_at_1") or 0.0
        if not first and not (final and r.pass_at_1 >= best + cfg.supersede_margin):
            return
        from offline_rl.publish import publish_model

        hf = trainer.save_hf(run_dir / f"gate-step-{trainer.step:06d}")
        fn = publish_fn or publish_model
        metrics = {"heldout_pass_at_1": r.pass_at_1, **{f"heldout_pass_at_{k}": v for k, v in r.pass_at_k.items()},
                   "n_tasks": r.n_tasks, "samples": r.samples, "gate_threshold": ev_cfg.gate_threshold,
                   "grpo_step": trainer.step}
        if first:
            version = fn(settings, hf, metrics, log=say)
            state["published_version"], state["published_step"] = version, trainer.step
            state["published_pass_at_1"] = r.pass_at_1
            say(f"grpo: gate passed at step {trainer.step} (pass@1 {r.pass_at_1:.3f} >= {ev_cfg.gate_threshold}); "
                f"published {version}")
            return
        version = fn(settings, hf, metrics, log=say, supersede=state["published_version"])
        state["final_version"], state["final_step"], state["final_pass_at_1"] = version, trainer.step, r.pass_at_1
        say(f"grpo: final checkpoint (step {trainer.step}, pass@1 {r.pass_at_1:.3f} >= {best:.3f} + "
            f"{cfg.supersede_margin}) published {version}, superseding {state['published_version']}")

    before = None
    if evaluate_before and state["before"] is None:
        before = run_eval("before")
        state["before"] = asdict(before)
        maybe_publish(before)
    elif state["before"] is not None:
        before = EvalResult(**{**state["before"], "pass_at_k": {int(k): v for k, v in state["before"]["pass_at_k"].items()}})

    rollouts = None
    if cfg.mode == "async":
        base = ckpt or init_dir
        wcfgs = [WorkerConfig(worker_id=i, model_dir=str(base), engine=cfg.rollout_engine,
                              env_settings=settings.env.model_dump(), sandbox_settings=settings.sandbox.model_dump(),
                              reward_settings=settings.rewards.model_dump(),
                              judge_settings={**settings.judge.model_dump(), "api_key": settings.judge.api_key.get_secret_value()},
                              prompts_per_batch=cfg.prompts_per_step, group_size=cfg.group_size,
                              temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                              seed=cfg.seed + 7 * trainer.step, threads=settings.model.threads)
                 for i in range(cfg.workers)]
        live = [name for name, param in trainer.model.named_parameters() if param.requires_grad]
        rollouts = AsyncRollouts(trainer.model, wcfgs, split.train, cfg.queue_size, version=trainer.version,
                                 live=live)
    sync_backend = TorchBackend(trainer.model, trainer.tokenizer, version=trainer.version)
    rng = random.Random(cfg.seed * 31 + trainer.step)
    bar = tqdm(total=cfg.steps, initial=trainer.step, desc=f"grpo[{cfg.mode}]", disable=not progress,
               dynamic_ncols=True)
    after = None
    try:
        with metrics_path.open("a") as mlog:
            while trainer.step < cfg.steps:
                # CPU seconds beside wall seconds: on a shared machine they tell work from waiting for
                # a core (the rollout side's sandbox children are not counted in either).
                t0, c0 = time.perf_counter(), time.process_time()
                phases: dict[str, float] = {}
                if rollouts is None:
                    trainer.model.eval()
                    sync_backend.version = trainer.version
                    tasks = sample_tasks(split.train, cfg.prompts_per_step, rng)
                    sb0 = reward_fn.sandbox_cpu_s
                    trajs = run_episodes(sync_backend, trainer.tokenizer, env, tasks, cfg.group_size,
                                         cfg.temperature, cfg.max_new_tokens, seed=rng.randrange(1 << 30),
                                         reward_fn=reward_fn)
                    trainer.model.train()
                    batch_version, gen_s, wait_s = trainer.version, time.perf_counter() - t0, 0.0
                    gen_cpu_s = time.process_time() - c0
                    phases["sandbox_cpu_s"] = reward_fn.sandbox_cpu_s - sb0
                else:
                    batch = rollouts.get()
                    wait_s = time.perf_counter() - t0
                    staleness = trainer.version - batch.version
                    if staleness > cfg.max_staleness:
                        state["dropped_stale"] += 1
                        continue
                    trajs, batch_version, gen_s = batch.trajectories, batch.version, batch.gen_s
                    gen_cpu_s = batch.info.get("cpu_s", 0.0)
                    # The worker's side of the step: its idle time, weight pickup, the sandbox CPU its
                    # batch cost, and how long the finished batch took to reach this process.
                    for k in ("sandbox_cpu_s", "slot_wait_s", "sync_s"):
                        if k in batch.info:
                            phases[k] = batch.info[k]
                    if "ready_at" in batch.info:
                        phases["handoff_s"] = rollouts.received_at - batch.info["ready_at"]
                staleness = trainer.version - batch_version
                t1, c1 = time.perf_counter(), time.process_time()
                m = trainer.train_on(trajs, staleness=staleness)
                train_s, train_cpu_s = time.perf_counter() - t1, time.process_time() - c1
                if rollouts is not None and m.get("updated"):
                    t2 = time.perf_counter()
                    rollouts.publish(trainer.model, trainer.version)
                    phases["publish_s"] = time.perf_counter() - t2
                state["zero_variance_groups"] += m.get("zero_variance_groups", 0)
                rec = {"step": trainer.step, "version": trainer.version, "batch_version": batch_version,
                       "staleness": staleness, **_batch_metrics(trajs), **m, "gen_s": round(gen_s, 4),
                       "wait_s": round(wait_s, 4), "train_s": round(train_s, 4),
                       "gen_cpu_s": round(gen_cpu_s, 4), "train_cpu_s": round(train_cpu_s, 4),
                       **{k: round(v, 4) for k, v in phases.items()},
                       "step_cpu_s": round(time.process_time() - c0, 4),
                       "step_s": round(time.perf_counter() - t0, 4), "dropped_stale": state["dropped_stale"],
                       "zero_variance_groups_total": state["zero_variance_groups"],
                       "judge_errors": reward_fn.judge_errors, "time": round(time.perf_counter() - t_start, 2)}
                if cfg.eval_every and trainer.step % cfg.eval_every == 0 and trainer.step < cfg.steps:
                    r = run_eval("periodic")
                    rec["heldout_pass_at_1"] = r.pass_at_1
                    maybe_publish(r)
                mlog.write(json.dumps(rec) + "\n")
                mlog.flush()
                bar.update(1)
                bar.set_postfix(reward=f"{rec['reward_mean']:.3f}", pass_rate=f"{rec['pass_rate']:.2f}",
                                stale=staleness)
                if trainer.step % cfg.checkpoint_every == 0 or trainer.step == cfg.steps:
                    trainer.save_checkpoint(run_dir, state)
        if evaluate_after:
            after = run_eval("after")
            maybe_publish(after, final=True)
            trainer.save_checkpoint(run_dir, state)
    finally:
        bar.close()
        if rollouts is not None:
            rollouts.close()
        sandbox.close()
    final_dir = trainer.save_hf(run_dir / "final")
    result = GRPOResult(out_dir=run_dir, final_dir=final_dir, metrics_path=metrics_path, steps=trainer.step,
                        before=before, after=after, gate_threshold=ev_cfg.gate_threshold,
                        published_version=state["published_version"], published_step=state["published_step"],
                        final_version=state.get("final_version"),
                        wall_s=time.perf_counter() - t_start, dropped_stale=state["dropped_stale"],
                        zero_variance_groups=state["zero_variance_groups"], evals=state["evals"])
    (run_dir / "result.json").write_text(json.dumps(result.summary(), indent=2))
    return result
