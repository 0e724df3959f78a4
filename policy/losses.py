"""Policy-gradient losses as pure functions of tensors. Notation (per token t of completion i):

* ``logp``       log π_θ(y_t | ·), current parameters, with gradient;
* ``old_logp``   log π_old(y_t | ·), the trainer's recompute under the weights that produced the
  rollout (no gradient);
* ``behaviour_logp``  log μ(y_t | ·), what the inference engine reported when it sampled y_t;
* ``mask``       True on real completion tokens; ``A`` an advantage per completion (shape [B]).

All functions return ``(loss, metrics)`` or a tensor; none of them touch a model.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

Level = Literal["token", "sequence"]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·m / Σ m over ``dim`` (all elements when None); 0 where the mask is empty."""
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp_min(1.0)
    return (x * m).sum(dim) / m.sum(dim).clamp_min(1.0)


def _reduce(per_token: torch.Tensor, mask: torch.Tensor, level: Level) -> torch.Tensor:
    """token: Σ_{i,t} ℓ / Σ_{i,t} 1 (DAPO, long answers weigh more);
    sequence: (1/B) Σ_i (1/|y_i|) Σ_t ℓ (the GRPO paper's normalisation)."""
    if level == "token":
        return masked_mean(per_token, mask)
    if level == "sequence":
        return masked_mean(per_token, mask, dim=1).mean()
    raise ValueError(f"unknown level {level!r}")


def group_advantages(rewards: torch.Tensor, scale_by_std: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages for rewards of shape [n_groups, G]:  A_ij = r_ij − mean_j(r_i·),
    divided by (std_j(r_i·) + eps) when ``scale_by_std`` (the paper's form; Dr. GRPO drops it)."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)
    return centred


def zero_variance_groups(rewards: torch.Tensor, tol: float = 1e-9) -> torch.Tensor:
    """Bool [n_groups]: groups whose G rewards are all equal (no learning signal, dropped)."""
    return (rewards.max(dim=1).values - rewards.min(dim=1).values) <= tol


def truncated_importance_weight(logp_num: torch.Tensor, logp_den: torch.Tensor, cap: float) -> torch.Tensor:
    """w = min(exp(logp_num − logp_den), C), no gradient.

    With ``logp_num`` = trainer's recompute under the rollout weights and ``logp_den`` = the inference
    engine's log-probs this is the train/inference mismatch correction of Yao et al. (2025)."""
    return torch.exp(logp_num - logp_den).clamp(max=cap).detach()


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log π − log π_ref  (unbiased for KL(π‖π_ref) under samples from π; can be negative)."""
    return logp - ref_logp


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = r − log r − 1 with r = π_ref / π (Schulman 2020): always ≥ 0, and an unbiased estimate of
    KL(π ‖ π_ref) on tokens *sampled from π* (there E[r] = 1), the case of a KL penalty on the policy's
    own rollouts. On tokens sampled from another distribution q, KL(q ‖ π) is ``kl_k3(q_logp, logp)``
    (r = π / q). The other order is no estimate of it: its mean adds χ²(q ‖ π), and grows like
    q/π on the tokens π has moved away from."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def grpo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    level: Level = "token",
    tis_weight: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO clipped surrogate with decoupled clip range (DAPO's clip-higher) and optional k3 KL:

        ρ_t = exp(logp_t − old_logp_t)
        ℓ_t = −w_t · min(ρ_t·A_i, clip(ρ_t, 1−ε_low, 1+ε_high)·A_i)  +  β · k3_t
        loss = reduce(ℓ, level)

    where w_t is the truncated importance weight min(π_old/μ, C) for the train/inference mismatch
    (``tis_weight``; 1 when None). ``reduce`` is token- or sequence-level (see ``_reduce``)."""
    A = advantages.unsqueeze(1)
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * A
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * A
    per_token = -torch.minimum(unclipped, clipped)
    if tis_weight is not None:
        per_token = per_token * tis_weight
    kl = None
    if ref_logp is not None and kl_coef:
        kl = kl_k3(logp, ref_logp)
        per_token = per_token + kl_coef * kl
    loss = _reduce(per_token, mask, level)
    with torch.no_grad():
        was_clipped = ((ratio < 1 - clip_low) & (A < 0)) | ((ratio > 1 + clip_high) & (A > 0))
        metrics = {
            "clip_fraction": masked_mean(was_clipped.float(), mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "approx_kl_old": masked_mean(kl_k3(old_logp, logp), mask).item(),  # KL(π_old ‖ π), rollouts ~ π_old
        }
        if kl is not None:
            metrics["kl_ref"] = masked_mean(kl, mask).item()
    return loss, metrics


def reinforce_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    tis_cap: float = 2.0,
    level: Level = "token",
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Single-rollout REINFORCE with a baseline, importance-corrected against the behaviour policy μ.

    ``advantages`` are A_i = r_i − b(bucket_i). Importance ratio against μ:
      token level     ρ_t = exp(logp_t − behaviour_logp_t)
      sequence level  ρ_t = ρ_i = exp(Σ_t (logp_t − behaviour_logp_t))   (the exact sequence ratio)

    With ``clip`` = ε (trust region by ratio clipping, PPO form with μ as the old policy, plus a
    dual-clip cap C for negative advantages so a large ratio cannot blow up a penalty):
        ℓ_t = −max( min(ρ_t A, clip(ρ_t, 1−ε, 1+ε) A),  C·A )   if A < 0
        ℓ_t = −min(ρ_t A, clip(ρ_t, 1−ε, 1+ε) A)                 otherwise
    With ``clip=None`` (pure truncated-IS REINFORCE):
        ℓ_t = −sg(min(ρ_t, C)) · A · logp_t
    Optional KL trust region: + β · k3(logp, ref_logp) per token (ref = the serving version).
    """
    A = advantages.unsqueeze(1)
    log_ratio = (logp - behaviour_logp).masked_fill(~mask, 0.0)
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(logp)
    elif level != "token":
        raise ValueError(f"unknown level {level!r}")
    ratio = torch.exp(log_ratio)
    if clip is None:
        per_token = -ratio.detach().clamp(max=tis_cap) * A * logp
        clipped_frac = (ratio > tis_cap).float()
    else:
        surrogate = torch.minimum(ratio * A, ratio.clamp(1 - clip, 1 + clip) * A)
        surrogate = torch.where(A < 0, torch.maximum(surrogate, tis_cap * A), surrogate)
        per_token = -surrogate
        clipped_frac = (((ratio < 1 - clip) & (A < 0)) | ((ratio > 1 + clip) & (A > 0))).float()
    kl = None
    if ref_logp is not None and kl_coef:
        kl = kl_k3(logp, ref_logp)
        per_token = per_token + kl_coef * kl
    loss = _reduce(per_token, mask, level)
    with torch.no_grad():
        metrics = {
            "ratio_mean": masked_mean(ratio, mask).item(),
            "clip_fraction": masked_mean(clipped_frac, mask).item(),
            "kl_behaviour_k3": masked_mean(kl_k3(behaviour_logp, logp), mask).item(),  # KL(μ ‖ π), samples ~ μ
        }
        if kl is not None:
            metrics["kl_ref"] = masked_mean(kl, mask).item()
    return loss, metrics


EXTREME_LOGP_GAP = math.log(2)
"""A token whose trainer and inference probabilities differ by more than a factor of 2."""


def mismatch_metrics(trainer_logp: torch.Tensor, inference_logp: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """Train/inference numerics gap, logged every step: mean |Δlogp|, a k3 KL estimate (of
    KL(inference ‖ trainer) from the inference engine's samples) and the share of tokens with
    |Δlogp| > ln 2."""
    with torch.no_grad():
        gap = (trainer_logp - inference_logp).abs()
        return {
            "mismatch_abs_logp": masked_mean(gap, mask).item(),
            "mismatch_kl_k3": masked_mean(kl_k3(inference_logp, trainer_logp), mask).item(),
            "mismatch_extreme_frac": masked_mean((gap > EXTREME_LOGP_GAP).float(), mask).item(),
        }


def replay_metrics(logp_off: torch.Tensor, logp_replay: torch.Tensor, inference_logp: torch.Tensor,
                   mask: torch.Tensor) -> dict[str, float]:
    """The train/inference gap of a mixture-of-experts model with its routers choosing freely
    (``off``) and with the inference routes replayed (``replay``): k3 KL and |Δlogp| > ln 2 share
    of each, as logged per batch beside the route disagreement rate."""
    off = mismatch_metrics(logp_off, inference_logp, mask)
    rep = mismatch_metrics(logp_replay, inference_logp, mask)
    return {"router_kl_k3_off": off["mismatch_kl_k3"], "router_kl_k3_replay": rep["mismatch_kl_k3"],
            "router_extreme_frac_off": off["mismatch_extreme_frac"],
            "router_extreme_frac_replay": rep["mismatch_extreme_frac"]}
