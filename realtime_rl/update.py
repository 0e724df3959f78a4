"""Single-rollout policy update from logged user feedback: REINFORCE with a baseline, importance
corrected against the serving version, inside a trust region.

Objective. For a batch B of logged completions y_i ~ μ(·|x_i) (μ = the version that served them,
normally the current production version π_prod) with rewards r_i (accept +0.75, reject −0.25, edits
graded; see :mod:`realtime_rl.dataset`) and advantages A_i = r_i − b(x_i) (:mod:`realtime_rl.baseline`),
starting from θ = θ_prod we minimise for ``epochs`` passes of AdamW:

    token level:     L(θ) = (1/Σ|y_i|) Σ_i Σ_t ℓ(ρ_it, A_i) + β · k3(π_θ, π_prod)
                     ρ_it = π_θ(y_it | x_i, y_i<t) / μ(y_it | x_i, y_i<t)
    sequence level:  ρ_it = ρ_i = Π_t ρ_it   (per-sequence normalisation (1/B) Σ_i (1/|y_i|) Σ_t)

    ℓ(ρ, A) = −min(ρA, clip(ρ, 1−ε, 1+ε)A)             A ≥ 0
    ℓ(ρ, A) = −max(min(ρA, clip(ρ, 1−ε, 1+ε)A), C·A)   A < 0   (dual clip: a large ratio can't blow up)

or, with ``clip`` = None, truncated-IS REINFORCE ℓ = −sg(min(ρ, C)) · A · log π_θ. This is
``policy.losses.reinforce_loss``; k3 is Schulman's KL estimator against the serving weights (β =
``kl_coef``, off by default: the ratio clip is the trust region). On top of the clip, the epochs stop
early once a minibatch's mean k3 KL to the serving version exceeds ``target_kl`` (PPO's target-KL
rule): the clip only stops the gradient of tokens already outside [1−ε, 1+ε], while shared parameters
keep moving, so without a KL bound the drift grows with the batch size.

Which logged log-prob is μ. The gateway logs ``logprobs`` (raw softmax at temperature 1) and
``sampling_logprobs`` (the temperature/top-k/top-p distribution the token was drawn from). The
default μ is ``logprobs``: it is the same function of the weights that the trainer recomputes, so at
θ = θ_prod the ratio is exactly 1 (up to train/inference numerics, logged as the mismatch) and the
clip bounds how far π_θ moves from the serving version; the sampling transform is then treated as
part of the environment. ``behaviour_logprobs = "sampling"`` uses the strict behaviour density instead;
with temperature 1 and no truncation (the default gateway request) the two are identical.

Departures from textbook REINFORCE: the importance ratio against μ instead of on-policy sampling
(the data was produced before the update, and with ``on_policy_only`` off by older versions); the
PPO-style clip with μ as the old policy (single rollout, several epochs); a leave-one-out bucket
baseline rather than a learned critic by default.

``run_update_cycle`` is one full cycle: dataset → update → candidate published in the registry →
release gate → promote or refuse → run record. It takes the updater lock, so two schedulers never
update at once.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from realtime_rl.config import UpdateSettings
from realtime_rl.dataset import TrainingExample


@dataclass
class CycleResult:
    """What one update cycle did (also the row written to ``update_runs``)."""

    run_id: str
    status: str  # skipped | released | refused | canary | locked | failed
    reason: str
    production_version: str | None = None
    candidate_version: str | None = None
    n_train: int = 0
    n_heldout: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    gate: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _pad(rows: Sequence[Sequence[float]], width: int):
    import torch

    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(list(r), dtype=torch.float32)
    return out


def behaviour_logprobs(e: TrainingExample, which: str) -> list[float]:
    if which == "sampling" and e.example.sampling_logprobs is not None:
        return e.example.sampling_logprobs
    return e.example.logprobs


def train_policy(model, examples: Sequence[TrainingExample], advantages: Sequence[float], cfg: UpdateSettings,
                 *, pad_token_id: int = 0, log: Callable[[str], None] = lambda _m: None,
                 should_stop: Callable[[], bool] = lambda: False) -> dict[str, float]:
    """A few epochs of AdamW on the objective in the module docstring; returns averaged metrics."""
    import torch

    from policy.logprobs import sequence_logprobs
    from policy.losses import masked_mean, mismatch_metrics, reinforce_loss

    if len(examples) != len(advantages):
        raise ValueError("one advantage per example")
    if not examples:
        raise ValueError("no training examples")
    model.train()
    prompts = [e.example.prompt_token_ids for e in examples]
    comps = [e.example.completion_token_ids for e in examples]
    mu_all = [behaviour_logprobs(e, cfg.behaviour_logprobs) for e in examples]
    # Reference = the serving (production) weights we start from; computed before the first step.
    ref_all: list[list[float]] = []
    mismatch = {"mismatch_abs_logp": 0.0, "mismatch_kl_k3": 0.0}
    for i in range(0, len(examples), cfg.minibatch_size):
        sl = slice(i, i + cfg.minibatch_size)
        tl = sequence_logprobs(model, prompts[sl], comps[sl], pad_token_id=pad_token_id)
        n = tl.mask.sum(1).tolist()
        ref_all += [row[:k] for row, k in zip(tl.logprobs.tolist(), n, strict=True)]
        logged = _pad([e.example.logprobs for e in examples[sl]], tl.mask.shape[1]).to(tl.logprobs.device)
        mm = mismatch_metrics(tl.logprobs, logged, tl.mask)
        w = len(n) / len(examples)
        for k in mismatch:
            mismatch[k] += w * mm[k]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    order = list(range(len(examples)))
    sums: dict[str, float] = {}
    steps = 0
    stopped = False
    for epoch in range(cfg.epochs):
        rng.shuffle(order)
        for i in range(0, len(order), cfg.minibatch_size):
            if should_stop():
                raise InterruptedError("update interrupted")
            idx = order[i:i + cfg.minibatch_size]
            tl = sequence_logprobs(model, [prompts[j] for j in idx], [comps[j] for j in idx], grad=True,
                                   pad_token_id=pad_token_id)
            width, dev = tl.mask.shape[1], tl.logprobs.device
            mu = _pad([mu_all[j] for j in idx], width).to(dev)
            ref = _pad([ref_all[j] for j in idx], width).to(dev) if cfg.kl_coef else None
            adv = torch.tensor([advantages[j] for j in idx], dtype=torch.float32, device=dev)
            loss, m = reinforce_loss(tl.logprobs, mu, adv, tl.mask, clip=cfg.clip, tis_cap=cfg.tis_cap,
                                     level=cfg.is_level, ref_logp=ref, kl_coef=cfg.kl_coef)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            opt.step()
            steps += 1
            with torch.no_grad():
                refk = _pad([ref_all[j] for j in idx], width).to(dev)
                m["kl_to_serving_k3"] = masked_mean(torch.exp(refk - tl.logprobs) - (refk - tl.logprobs) - 1,
                                                    tl.mask).item()
            m.update(loss=float(loss.item()), grad_norm=float(gn))
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
            if cfg.target_kl is not None and m["kl_to_serving_k3"] > cfg.target_kl:
                stopped = True
                break
        if stopped:
            log(f"  early stop at epoch {epoch + 1}, step {steps}: KL to the serving version "
                f"{m['kl_to_serving_k3']:.3f} > target {cfg.target_kl}")
            break
        log(f"  epoch {epoch + 1}/{cfg.epochs}: loss {sums.get('loss', 0) / max(steps, 1):+.4f} "
            f"ratio {sums.get('ratio_mean', 0) / max(steps, 1):.3f}")
    model.eval()
    out = {k: v / max(steps, 1) for k, v in sums.items()}
    out.update(mismatch)
    out["steps"] = float(steps)
    out["early_stopped"] = float(stopped)
    return out


def compute_advantages(examples: Sequence[TrainingExample], cfg: UpdateSettings, history, model=None,
                       pad_token_id: int = 0) -> tuple[list[float], list[float]]:
    from realtime_rl.baseline import bucket_mean_advantages, value_head_advantages

    if cfg.baseline == "value_head":
        if model is None:
            raise ValueError("the value-head baseline needs the model")
        return value_head_advantages(model, examples, pad_token_id=pad_token_id)
    return bucket_mean_advantages(examples, history, cfg.baseline_prior)


def run_update_cycle(settings, *, force: bool = False, log: Callable[[str], None] = print, store=None,
                     evaluator=None, producer=None, should_stop: Callable[[], bool] = lambda: False,
                     now: datetime | None = None) -> CycleResult:
    """One cycle under the updater lock; see :func:`realtime_rl.release.cycle_body` for the steps."""
    from realtime_rl.database import make_engine
    from realtime_rl.locks import updater_lock
    from realtime_rl.release import cycle_body
    from realtime_rl.schema import ensure_schema

    t0 = time.perf_counter()
    run_id = f"run-{datetime.now(UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
    ensure_schema(settings.db)
    engine = make_engine(settings.db)
    try:
        with updater_lock(engine, settings.schedule.lock_name, stale_s=settings.schedule.lock_stale_s) as held:
            if not held:
                return CycleResult(run_id, "locked", "another updater holds the lock",
                                   seconds=time.perf_counter() - t0)
            result = cycle_body(settings, engine, run_id, force=force, log=log, store=store, evaluator=evaluator,
                                producer=producer, should_stop=should_stop, now=now)
    finally:
        engine.dispose()
    result.seconds = time.perf_counter() - t0
    return result


def save_candidate(policy, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    policy.model.save_pretrained(out_dir)
    policy.tokenizer.save_pretrained(out_dir)
    return out_dir
