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
* Self-summarisation (``env.context_budget``): an episode that summarised has several contexts; each is
  a row of its own with the episode's advantage (summary tokens included, ReSum's advantage
  broadcasting), and ``summary_token_weight`` multiplies the loss on summary tokens. Rows are what
  the staleness bound, the importance weight and router replay already work on.
* The trainer counts a step per consumed batch; a batch with only zero-variance groups makes no
  update (the version does not advance).
* **Router replay** (mixture-of-experts models, ``router_replay = "replay"``). Each trajectory
  carries the experts its sampler chose at every position (``routes``); the trainer's recompute and
  gradient passes force them and recompute the gate weights from the live router logits
  (:mod:`policy.routing`), so π_old and π_θ are evaluated on the expert mixture that produced the
  tokens while the router still learns. Every ``router_compare_every``-th batch also recomputes
  π_old the other way (no gradient) and logs k3 KL and the |Δlogp| > ln 2 share both ways with the
  route disagreement. The frozen reference model (``kl_coef``) routes freely.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from offline_rl.agent_env import RepoEnv, header
from offline_rl.config import OfflineSettings
from offline_rl.evaluate import (
    EvalResult,
    behaviour_means,
    evaluate_settings,
    summary_metrics,
    temperature_grid,
)
from offline_rl.judge import make_judge
from offline_rl.midtrain import lr_factor
from offline_rl.publish import publish_model
from offline_rl.remote import RemoteRollouts
from offline_rl.rewards import RewardFunction
from offline_rl.rollout import TorchBackend, check_budget, make_env, run_episodes
from offline_rl.sandbox import SandboxPool
from offline_rl.splits import load_split
from offline_rl.workers import AsyncRollouts, WorkerConfig, sample_tasks
from policy.distributed import DataParallel, DistributedError, setup
from policy.loading import load_policy
from policy.logprobs import pad_rows, sequence_logprobs
from policy.losses import (
    group_advantages,
    grpo_policy_loss,
    masked_mean,
    mismatch_metrics,
    replay_metrics,
    truncated_importance_weight,
    zero_variance_groups,
)
from policy.routing import RouteStats

CKPT_DIR = "checkpoints"
SHARDS = "shards"
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


def _take(routes: list | None, idx: list[int]) -> list | None:
    return None if routes is None else [routes[i] for i in idx]


class GRPOTrainer:
    """The learner: policy, optional frozen reference, AdamW, schedule; ``train_on(batch) -> metrics``.

    Under torchrun (``dp``, see policy/distributed.py) the model is sharded with FSDP2; every rank
    gets the whole batch and computes the gradient of its rows of each micro-batch."""

    def __init__(self, settings: OfflineSettings, model_dir: str | Path, dp: DataParallel | None = None):
        self.settings = settings
        self.cfg = settings.grpo
        self.dp = dp or setup(settings.distributed, settings.model.device)
        torch.manual_seed(self.cfg.seed)
        policy = load_policy(model_dir, "float32", self.dp.device)
        self.model, self.tokenizer, self.device = policy.model, policy.tokenizer, policy.device
        self.model.train()
        pattern = re.compile(self.cfg.trainable)
        for name, param in self.model.named_parameters():
            param.requires_grad_(bool(pattern.search(name)))
        self.n_trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        if not self.n_trainable:
            raise ValueError(f"grpo.trainable={self.cfg.trainable!r} matches no parameter of {model_dir}")
        self.replay = self.cfg.router_replay == "replay"
        self.model = self.dp.shard(self.model)
        self.ref = None
        if self.cfg.kl_coef > 0:
            self.ref = load_policy(model_dir, "float32", self.dp.device).model.eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=self.cfg.lr, weight_decay=self.cfg.weight_decay,
                                     betas=(0.9, 0.99))
        self.version = 0
        self.step = 0

    def lr_at(self, step: int) -> float:
        c = self.cfg
        return c.lr * lr_factor(step, c.steps, c.warmup_steps, c.min_lr_ratio, c.schedule)

    def _rows_and_advantages(self, trajs) -> tuple[list, list[float], dict]:
        """The rows to train on and each one's group-relative advantage. One row per context: an episode
        without a budget is one row; a summarised one has a row per segment, each credited with the
        episode's advantage (summary tokens included). Groups whose rewards are all equal carry no signal."""
        G = self.cfg.group_size
        n_groups = len(trajs) // G
        rewards = torch.tensor([t.reward for t in trajs[:n_groups * G]], dtype=torch.float32).view(n_groups, G)
        zero = zero_variance_groups(rewards)
        adv_all = group_advantages(rewards, self.cfg.scale_by_std)
        sel, adv_rows = [], []
        for g in range(n_groups):
            if bool(zero[g]):
                continue
            for j in range(G):
                for row in trajs[g * G + j].rows():
                    if row.completion_ids:
                        sel.append(row)
                        adv_rows.append(float(adv_all[g, j]))
        return sel, adv_rows, {"zero_variance_groups": int(zero.sum()), "groups": n_groups}

    def _no_grad_logprobs(self, model, prompts, comps, routes, chunks, width: int, *, entropy: bool,
                          replay: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs (and entropies) of every row under ``model``, micro-batch by micro-batch."""
        logp = torch.zeros((len(prompts), width), device=self.device)
        ent = torch.zeros((len(prompts), width), device=self.device) if entropy else None
        for ch in chunks:
            tl = sequence_logprobs(model, [prompts[i] for i in ch], [comps[i] for i in ch], with_entropy=entropy,
                                   pad_token_id=self.tokenizer.pad_token_id, routes=_take(routes, ch),
                                   replay=replay)
            logp[ch, :tl.logprobs.shape[1]] = tl.logprobs
            if ent is not None:
                ent[ch, :tl.entropy.shape[1]] = tl.entropy
        return logp, ent

    def train_on(self, trajs, staleness: int = 0) -> dict:
        c = self.cfg
        sel, adv_rows, m = self._rows_and_advantages(trajs)
        if not sel:
            m.update({"updated": False, "lr": self.lr_at(self.step)})
            self.step += 1
            return m
        adv = torch.tensor(adv_rows, dtype=torch.float32)
        prompts = [t.prompt_ids for t in sel]
        comps = [t.completion_ids for t in sel]
        routes = [t.routes for t in sel] if any(t.routes is not None for t in sel) else None
        width = max(len(x) for x in comps)
        action = pad_rows([t.action_mask for t in sel], width, torch.bool).to(self.device)
        behaviour = pad_rows([t.behaviour_logprobs for t in sel], width).to(self.device)
        summary = pad_rows([t.summary_mask for t in sel], width, torch.bool).to(self.device)
        # The loss on summary tokens is scaled by summary_token_weight (folded into the per-token
        # importance weight, which multiplies each token's loss); None keeps the plain path exact.
        token_w = None
        if c.summary_token_weight != 1.0 and bool(summary.any()):
            token_w = torch.where(summary, torch.tensor(c.summary_token_weight, device=self.device),
                                  torch.tensor(1.0, device=self.device))
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
        compare = routes is not None and c.router_compare_every and self.step % c.router_compare_every == 0
        if compare:  # before any step: the weights π_old is computed with
            m.update(self._router_compare(prompts, comps, routes, chunks, behaviour, mask, pad_id))
        old = tis = ref = None
        if not fused:
            self.dp.gather(self.model)  # every rank recomputes every row: no-grad passes on gathered weights
            old, ent = self._no_grad_logprobs(self.model, prompts, comps, routes, chunks, width, entropy=True,
                                              replay=self.replay)
            tis = truncated_importance_weight(old, behaviour, c.tis_cap)
        if self.ref is not None:
            ref, _ = self._no_grad_logprobs(self.ref, prompts, comps, None, chunks, width, entropy=False,
                                            replay=False)
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
            self.dp.begin_backward(self.model)
            for ch in chunks:
                ch = self.dp.rows(ch)  # this rank's rows of the micro-batch (all of them in one process)
                if not ch:
                    continue
                idx = torch.tensor(ch)
                tl = sequence_logprobs(self.model, [prompts[i] for i in ch], [comps[i] for i in ch], grad=True,
                                       with_entropy=fused, pad_token_id=pad_id, routes=_take(routes, ch),
                                       replay=self.replay)
                w = tl.logprobs.shape[1]
                cm = mask[idx][:, :w]
                if fused:
                    old_c = tl.logprobs.detach()
                    old[ch, :w] = old_c
                    ent[ch, :w] = tl.entropy.detach()
                    tis_c = truncated_importance_weight(old_c, behaviour[idx][:, :w], c.tis_cap)
                else:
                    old_c, tis_c = old[idx][:, :w], tis[idx][:, :w]
                if token_w is not None:
                    tis_c = tis_c * token_w[idx][:, :w]
                loss, lm = grpo_policy_loss(
                    tl.logprobs, old_c, adv[idx], cm, clip_low=c.clip_low, clip_high=c.clip_high,
                    level=c.loss_level, tis_weight=tis_c,
                    ref_logp=None if ref is None else ref[idx][:, :w], kl_coef=c.kl_coef)
                share = (cm.sum().item() / n_tok) if c.loss_level == "token" else len(ch) / len(sel)
                (loss * share).backward()
                loss_total += loss.item() * share
                for k, v in lm.items():
                    agg[k] = agg.get(k, 0.0) + v * share
            self.dp.end_backward(self.model)
            grad_norm = self.dp.clip_grad_norm(self.model.parameters(), c.grad_clip)
            self.opt.step()
        # Every rank filled its own rows and summed its share of the loss: put the pieces together.
        loss_total, agg = self.dp.sum(loss_total), self.dp.sum_dict(agg)
        if fused:
            old, ent = self.dp.assemble(old), self.dp.assemble(ent)
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
                  "policy_tokens": int(n_tok), "trained_completions": len(sel), "staleness": staleness,
                  "summary_tokens": int((summary & mask).sum().item())})
        return m

    def _router_compare(self, prompts, comps, routes, chunks, behaviour, mask, pad_id) -> dict:
        """π_old both ways, routers free and routes replayed (no gradient, current weights): the
        train/inference k3 KL and |Δlogp| > ln 2 share of each, and the share of (position, layer)
        pairs where the trainer's free routers differ from the sampler's."""

        both = {mode: torch.zeros_like(behaviour) for mode in (False, True)}
        stats = RouteStats()
        for ch in chunks:
            for mode in (False, True):
                tl = sequence_logprobs(self.model, [prompts[i] for i in ch], [comps[i] for i in ch],
                                       pad_token_id=pad_id, routes=_take(routes, ch), replay=mode)
                both[mode][ch, :tl.logprobs.shape[1]] = tl.logprobs
                if not mode:
                    stats = stats + tl.route_stats
        out = replay_metrics(both[False], both[True], behaviour, mask)
        out.update(route_disagreement=stats.rate, route_disagreement_tokens=stats.token_rate,
                   router_replay=float(self.replay))
        return out

    # -- checkpoints ---------------------------------------------------------------------------

    def save_hf(self, out: Path) -> Path:
        """An HF directory of the current weights (rank 0 writes it; a collective under torchrun)."""
        return self.dp.save_pretrained(self.model, self.tokenizer, out)

    def save_checkpoint(self, run_dir: Path, extra: dict) -> Path:
        """Atomic: write ``step-N.tmp``, rename, then replace the ``latest`` pointer. Under torchrun the
        model and optimizer state go in ``shards/`` (one file per rank, torch.distributed.checkpoint)
        beside the HF weights that rollout workers load; rank 0 alone renames and moves the pointer."""

        root = run_dir / CKPT_DIR
        final = root / f"step-{self.step:06d}"
        tmp = root / f"step-{self.step:06d}.tmp"
        if self.dp.is_main:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        self.save_hf(tmp)
        if self.dp.enabled:
            self.dp.save_state(tmp / SHARDS, self.model, self.opt)
            self.dp.barrier()
        if self.dp.is_main:
            optimizer = None if self.dp.enabled else self.opt.state_dict()
            torch.save({"optimizer": optimizer, "step": self.step, "version": self.version,
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
        self.dp.barrier()
        return final

    def load_checkpoint(self, ckpt: Path) -> dict:
        state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
        if (ckpt / SHARDS).is_dir():
            # Written by N ranks; loads on any number of them (one process included).
            self.dp.load_state(ckpt / SHARDS, self.model, self.opt)
        elif self.dp.enabled:
            raise DistributedError(f"{ckpt} was written by a single process; resume it without torchrun, or "
                                   "start over with --no-resume")
        else:
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
    out.update({f"behaviour_{k}": v for k, v in behaviour_means(trajs).items()})
    out["truncated"] = sum(t.truncated for t in trajs)
    out.update(summary_metrics(trajs))
    return out


@dataclass
class _Batch:
    """One batch of trajectories as the loop sees it, wherever it was sampled."""

    trajs: list
    version: int
    gen_s: float
    wait_s: float
    gen_cpu_s: float
    phases: dict[str, float]


class GRPORun:
    """The control flow of a GRPO run: batches in (sampled here or by rollout workers), one trainer
    step per batch, evaluations, the gate, checkpoints and the metrics log. The math is in
    :class:`GRPOTrainer` and :mod:`policy.losses`; the sampling in :mod:`offline_rl.rollout`.

    Under torchrun every rank runs it: rank 0 alone samples (or reads the rollout workers),
    evaluates, publishes and writes the metrics; each batch, evaluation result and published version
    reaches the other ranks by broadcast, so every rank takes the same steps (policy/distributed.py)."""

    def __init__(self, settings: OfflineSettings, init_dir: str | Path | None, *, resume: bool,
                 log: Callable[[str], None], publish_fn: Callable[..., str | None] | None):
        self.settings, self.cfg, self.ev_cfg = settings, settings.grpo, settings.eval
        self.publish_fn = publish_fn
        torch.set_num_threads(settings.model.threads)
        self.t_start = time.perf_counter()
        self.run_dir = Path(self.cfg.out_dir)
        self.metrics_path = self.run_dir / METRICS
        self.init_dir = Path(init_dir or settings.midtrain.out_dir)
        self.trainer = GRPOTrainer(settings, self.init_dir)
        dp = self.dp = self.trainer.dp
        self.say = log if dp.is_main else (lambda _msg: None)
        if dp.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt = dp.broadcast(latest_checkpoint(self.run_dir) if resume and dp.is_main else None)
        self.state: dict = {"published_version": None, "published_step": None, "dropped_stale": 0,
                            "zero_variance_groups": 0, "before": None, "base_best": None, "evals": [],
                            "init_dir": str(self.init_dir)}
        if self.ckpt is not None:
            self.state.update(self.trainer.load_checkpoint(self.ckpt))
            if dp.is_main:
                truncate_metrics(self.metrics_path, self.trainer.step)
            self.say(f"grpo: resumed from {self.ckpt} (step {self.trainer.step}, version {self.trainer.version}"
                     + (f", all {dp.world} ranks)" if dp.enabled else ")"))
        elif dp.is_main and self.metrics_path.exists():
            self.metrics_path.unlink()
        self.split = self.sandbox = self.env = self.reward_fn = None
        if dp.is_main:  # rank 0 alone samples and evaluates
            self.split = load_split(settings.tasks, settings.env)
            self.sandbox = SandboxPool(settings.sandbox)
            self.env = make_env(settings.env, self.sandbox)
            self.reward_fn = RewardFunction(self.sandbox, settings.rewards, make_judge(settings.judge))
            if isinstance(self.env, RepoEnv) and self.env.context_budget:
                # Refused here, before any worker starts, rather than at the first batch that meets the task.
                tok = self.trainer.tokenizer
                for task in [*self.split.train, *self.split.heldout]:
                    check_budget(tok, self.env, task, len(tok(header(task), add_special_tokens=False)["input_ids"]),
                                 self.cfg.max_new_tokens)
            self.say(f"grpo: sandbox isolation={self.sandbox.isolation} ({self.sandbox.isolation_reason}); "
                     f"env={settings.env.kind}, mode={self.cfg.mode}, engine={self.cfg.rollout_engine}, "
                     f"{len(self.split.train)} train / {len(self.split.heldout)} held-out tasks"
                     + (f"; {dp.world} ranks, {dp.param_fraction(self.trainer.model):.3f} of the parameters "
                        "on rank 0" if dp.enabled else ""))
        self.rollouts = None
        self.sync_backend = TorchBackend(self.trainer.model, self.trainer.tokenizer, version=self.trainer.version)
        self.rng = random.Random(self.cfg.seed * 31 + self.trainer.step)

    # -- evaluation and the gate -------------------------------------------------------------------

    def evaluate(self, tag: str) -> EvalResult:
        t, r = self.trainer, None
        with self.dp.gathered(t.model):
            if self.dp.is_main:
                r = evaluate_settings(self.settings, t.model, t.tokenizer, tasks=self.split.heldout,
                                      sandbox=self.sandbox)
        r = self.dp.broadcast(r)
        t.model.train()
        self.state["evals"].append({"step": t.step, "tag": tag, "pass_at_1": r.pass_at_1,
                                    "pass_at_k": {str(k): v for k, v in r.pass_at_k.items()},
                                    "behaviour": r.behaviour})
        self.say(f"grpo: step {t.step} held-out success {r.pass_at_1:.3f} at T={r.temperature} ({tag})")
        return r

    def best_over_grid(self) -> tuple[float, float]:
        """(best pass@1, its temperature) of the current weights over ``eval.temperatures``."""
        t, best = self.trainer, None
        with self.dp.gathered(t.model):
            if self.dp.is_main:
                grid = temperature_grid(self.settings, t.model, t.tokenizer, self.ev_cfg.temperatures,
                                        tasks=self.split.heldout, sandbox=self.sandbox)
                best = (grid.best.pass_at_1, grid.best_t)
        t.model.train()
        return self.dp.broadcast(best)

    def passes_gate(self, r: EvalResult) -> bool:
        """Success at the serving temperature over the threshold and, unless ``eval.gate_min_gain`` is
        None, a best-temperature success above the starting model's best by that margin."""
        if r.pass_at_1 < self.ev_cfg.gate_threshold:
            return False
        if self.ev_cfg.gate_min_gain is None:
            return True
        base = self.state["base_best"]
        if base is None:
            base = self.state["base_best"] = self.dp.broadcast(list(self.starting_best()) if self.dp.is_main else None)
        best, best_t = self.best_over_grid()
        ok = best >= base[0] + self.ev_cfg.gate_min_gain
        self.say(f"grpo: best over the temperature grid {best:.3f} (T={best_t}) vs the starting model's "
                 f"{base[0]:.3f} (T={base[1]}): {'passes' if ok else 'refused: a lower temperature gives as much'}")
        return ok

    def starting_best(self) -> tuple[float, float]:
        policy = load_policy(self.init_dir, "float32", self.settings.model.device)
        grid = temperature_grid(self.settings, policy.model, policy.tokenizer, self.ev_cfg.temperatures,
                                tasks=self.split.heldout, sandbox=self.sandbox)
        return grid.best.pass_at_1, grid.best_t

    def maybe_publish(self, r: EvalResult, final: bool = False) -> None:
        """The first evaluation that passes the gate is published; at the end of the run the final
        checkpoint supersedes it if it beat it by ``supersede_margin`` (users should get the better one)."""

        st, t, cfg = self.state, self.trainer, self.cfg
        first = st["published_version"] is None
        best = st.get("final_pass_at_1") or st.get("published_pass_at_1") or 0.0
        if not cfg.publish or (not first and not (final and r.pass_at_1 >= best + cfg.supersede_margin)):
            return
        if not self.passes_gate(r):
            return
        hf = t.save_hf(self.run_dir / f"gate-step-{t.step:06d}")
        fn = self.publish_fn or publish_model
        metrics = {"heldout_pass_at_1": r.pass_at_1, **{f"heldout_pass_at_{k}": v for k, v in r.pass_at_k.items()},
                   "n_tasks": r.n_tasks, "samples": r.samples, "gate_threshold": self.ev_cfg.gate_threshold,
                   "grpo_step": t.step}
        if first:
            version = self.dp.broadcast(fn(self.settings, hf, metrics, log=self.say) if self.dp.is_main else None)
            st["published_version"], st["published_step"], st["published_pass_at_1"] = version, t.step, r.pass_at_1
            self.say(f"grpo: gate passed at step {t.step} (success {r.pass_at_1:.3f} >= "
                     f"{self.ev_cfg.gate_threshold}); published {version}")
            return
        version = self.dp.broadcast(fn(self.settings, hf, metrics, log=self.say, supersede=st["published_version"])
                                    if self.dp.is_main else None)
        st["final_version"], st["final_step"], st["final_pass_at_1"] = version, t.step, r.pass_at_1
        self.say(f"grpo: final checkpoint (step {t.step}, success {r.pass_at_1:.3f} >= {best:.3f} + "
                 f"{cfg.supersede_margin}) published {version}, superseding {st['published_version']}")

    # -- batches --------------------------------------------------------------------------------

    def start_workers(self) -> None:
        """Rollout worker processes started here (``async``) or workers anywhere (``remote``, see
        offline_rl/remote.py), read by rank 0; collective under torchrun (the workers start from the
        full weights, which every rank helps gather)."""
        cfg, s, t, dp = self.cfg, self.settings, self.trainer, self.dp
        base = self.ckpt or self.init_dir
        if cfg.mode == "remote":
            if dp.is_main:
                # ``base`` (the checkpoint, or the initial model) holds the trainer's current weights.
                self.rollouts = RemoteRollouts(s, base, t.version, self.state.setdefault("rollout_versions", {}),
                                               log=self.say)
                self.say(f"grpo: version {t.version} is {self.rollouts.registry.url} channel {s.rollout.channel}; "
                         f"waiting for `rtrl rollout-worker` batches over the {s.rollout.transport} transport")
            return
        weights = dp.full_state_dict(t.model) if dp.enabled else t.model
        if not dp.is_main:
            return
        wcfgs = [WorkerConfig(worker_id=i, model_dir=str(base), engine=cfg.rollout_engine,
                              env_settings=s.env.model_dump(), sandbox_settings=s.sandbox.model_dump(),
                              reward_settings=s.rewards.model_dump(),
                              judge_settings={**s.judge.model_dump(), "api_key": s.judge.api_key.get_secret_value()},
                              prompts_per_batch=cfg.prompts_per_step, group_size=cfg.group_size,
                              temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                              seed=cfg.seed + 7 * t.step, threads=s.model.threads)
                 for i in range(cfg.workers)]
        live = [name for name, param in t.model.named_parameters() if param.requires_grad]
        self.rollouts = AsyncRollouts(weights, wcfgs, self.split.train, cfg.queue_size, version=t.version, live=live)

    def sample_here(self) -> _Batch:
        """A batch sampled by this process (rank 0, on gathered weights), on every rank."""
        cfg, t, b = self.cfg, self.trainer, None
        with self.dp.gathered(t.model):
            if self.dp.is_main:
                t0, c0 = time.perf_counter(), time.process_time()
                t.model.eval()
                self.sync_backend.version = t.version
                tasks = sample_tasks(self.split.train, cfg.prompts_per_step, self.rng)
                sb0 = self.reward_fn.sandbox_cpu_s
                trajs = run_episodes(self.sync_backend, t.tokenizer, self.env, tasks, cfg.group_size,
                                     cfg.temperature, cfg.max_new_tokens, seed=self.rng.randrange(1 << 30),
                                     reward_fn=self.reward_fn)
                b = _Batch(trajs, t.version, time.perf_counter() - t0, 0.0, time.process_time() - c0,
                           {"sandbox_cpu_s": self.reward_fn.sandbox_cpu_s - sb0})
        t.model.train()
        return self.dp.broadcast(b)

    def receive(self) -> _Batch | None:
        """The next batch from the workers (read by rank 0), on every rank; None when it is staler than
        ``max_staleness`` (dropped)."""
        b = self._receive() if self.dp.is_main else None
        return self.dp.broadcast(b)

    def _receive(self) -> _Batch | None:
        assert self.rollouts is not None
        t0 = time.perf_counter()
        batch = self.rollouts.get()
        if self.trainer.version - batch.version > self.cfg.max_staleness:
            return None
        # The worker's side of the step: its idle time, weight pickup, the sandbox CPU its batch cost,
        # and how long the finished batch took to reach this process.
        phases = {k: batch.info[k] for k in ("sandbox_cpu_s", "slot_wait_s", "sync_s") if k in batch.info}
        if "ready_at" in batch.info:
            phases["handoff_s"] = self.rollouts.received_at - batch.info["ready_at"]
        return _Batch(batch.trajectories, batch.version, batch.gen_s, time.perf_counter() - t0,
                      batch.info.get("cpu_s", 0.0), phases)

    # -- the loop -------------------------------------------------------------------------------

    def step(self, b: _Batch, c0: float) -> dict:
        """Train on one batch, hand the new weights to the workers, and return the step's record."""
        t, st = self.trainer, self.state
        staleness = t.version - b.version
        t1, c1 = time.perf_counter(), time.process_time()
        m = t.train_on(b.trajs, staleness=staleness)
        train_s, train_cpu_s = time.perf_counter() - t1, time.process_time() - c1
        if self.cfg.mode != "sync" and m.get("updated"):
            t2 = time.perf_counter()
            weights = self.dp.full_state_dict(t.model) if self.dp.enabled else t.model
            if self.rollouts is not None:
                self.rollouts.publish(weights, t.version)
            b.phases["publish_s"] = time.perf_counter() - t2
        st["zero_variance_groups"] += m.get("zero_variance_groups", 0)
        return {"step": t.step, "version": t.version, "batch_version": b.version, "staleness": staleness,
                **_batch_metrics(b.trajs), **m, "gen_s": round(b.gen_s, 4), "wait_s": round(b.wait_s, 4),
                "train_s": round(train_s, 4), "gen_cpu_s": round(b.gen_cpu_s, 4),
                "train_cpu_s": round(train_cpu_s, 4), **{k: round(v, 4) for k, v in b.phases.items()},
                "step_cpu_s": round(time.process_time() - c0, 4), "dropped_stale": st["dropped_stale"],
                "zero_variance_groups_total": st["zero_variance_groups"],
                "judge_errors": self.reward_fn.judge_errors if self.reward_fn is not None else 0,
                **({"refused_batches": self.rollouts.refused} if getattr(self.rollouts, "refused", 0) else {}),
                "time": round(time.perf_counter() - self.t_start, 2)}

    def train(self, progress: bool) -> None:
        cfg, t = self.cfg, self.trainer
        bar = tqdm(total=cfg.steps, initial=t.step, desc=f"grpo[{cfg.mode}]", disable=not progress or not self.dp.is_main,
                   dynamic_ncols=True)
        with bar, contextlib.ExitStack() as files:
            mlog = files.enter_context(self.metrics_path.open("a")) if self.dp.is_main else None
            while t.step < cfg.steps:
                # CPU seconds beside wall seconds: on a shared machine they tell work from waiting for
                # a core (the rollout side's sandbox children are not counted in either).
                t0, c0 = time.perf_counter(), time.process_time()
                b = self.sample_here() if cfg.mode == "sync" else self.receive()
                if b is None:
                    self.state["dropped_stale"] += 1
                    continue
                rec = self.step(b, c0)
                rec["step_s"] = round(time.perf_counter() - t0, 4)
                if cfg.eval_every and t.step % cfg.eval_every == 0 and t.step < cfg.steps:
                    r = self.evaluate("periodic")
                    rec["heldout_pass_at_1"] = r.pass_at_1
                    self.maybe_publish(r)
                if mlog is not None:
                    mlog.write(json.dumps(rec) + "\n")
                    mlog.flush()
                bar.update(1)
                bar.set_postfix(reward=f"{rec['reward_mean']:.3f}", pass_rate=f"{rec['pass_rate']:.2f}",
                                stale=rec["staleness"])
                if t.step % cfg.checkpoint_every == 0 or t.step == cfg.steps:
                    t.save_checkpoint(self.run_dir, self.state)

    def close(self) -> None:
        if self.rollouts is not None:
            self.rollouts.close()
        if self.sandbox is not None:
            self.sandbox.close()


def run_grpo(settings: OfflineSettings, init_dir: str | Path | None = None, *, progress: bool = True,
             log: Callable[[str], None] | None = None, resume: bool = True, evaluate_before: bool = True,
             evaluate_after: bool = True, publish_fn: Callable[..., str | None] | None = None) -> GRPOResult:
    """Train with GRPO from ``init_dir`` (default: the mid-trained model) into ``grpo.out_dir``.

    Resumes from the newest checkpoint in the run directory when ``resume``. Evaluates held-out
    success before and after (and every ``eval_every`` steps); the first evaluation that passes the
    gate (:meth:`GRPORun.passes_gate`) is published (``publish_fn``, default
    :func:`offline_rl.publish.publish_model`). Under torchrun every rank runs it (:class:`GRPORun`)."""
    run = GRPORun(settings, init_dir, resume=resume, log=log or (lambda msg: None), publish_fn=publish_fn)
    st, before, after = run.state, None, None
    try:
        if evaluate_before and st["before"] is None:
            before = run.evaluate("before")
            st["before"] = before.to_dict()
            run.maybe_publish(before)
        elif st["before"] is not None:
            before = EvalResult(**{**st["before"], "ci95": tuple(st["before"]["ci95"]),
                                   "pass_at_k": {int(k): v for k, v in st["before"]["pass_at_k"].items()}})
        if settings.grpo.mode in ("async", "remote"):
            run.start_workers()
        run.train(progress)
        if evaluate_after:
            after = run.evaluate("after")
            run.maybe_publish(after, final=True)
            run.trainer.save_checkpoint(run.run_dir, st)
    finally:
        run.close()
    final_dir = run.trainer.save_hf(run.run_dir / "final")
    result = GRPOResult(out_dir=run.run_dir, final_dir=final_dir, metrics_path=run.metrics_path,
                        steps=run.trainer.step, before=before, after=after,
                        gate_threshold=settings.eval.gate_threshold, published_version=st["published_version"],
                        published_step=st["published_step"], final_version=st.get("final_version"),
                        wall_s=time.perf_counter() - run.t_start, dropped_stale=st["dropped_stale"],
                        zero_variance_groups=st["zero_variance_groups"], evals=st["evals"])
    if run.dp.is_main:
        (run.run_dir / "result.json").write_text(json.dumps(result.summary(), indent=2))
    return result
