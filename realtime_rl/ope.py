"""Off-policy evaluation of a candidate's accept rate on held-out logged feedback.

Each logged example i has a completion y_i drawn from the serving version μ, an outcome
r_i = 1[accepted], and its behaviour log-probability log μ(y_i|x_i) = Σ_t logged log-prob. The
candidate π is scored by the sequence importance weight w_i = π(y_i|x_i) / μ(y_i|x_i), with
log π recomputed by teacher forcing (``policy.logprobs.sequence_logprobs``):

* IPS            V = (1/n) Σ w_i r_i                      (unbiased, high variance)
* clipped IPS    V = (1/n) Σ min(w_i, M) r_i              (biased low, bounded variance)
* SNIPS          V = Σ w_i r_i / Σ w_i                    (self-normalised; bias O(1/n), lies in [0, 1])

Confidence intervals: percentile bootstrap over examples (default), or normal approximation
(delta method for SNIPS: Var ≈ Σ w_i² (r_i − V)² / (Σ w_i)²). The release gate asks a narrower
question, whether the candidate would be accepted less than the serving version on the same logged
requests: the paired gain G = V − r̄ (r̄ the realised rate) and its standard error, from the same
bootstrap resamples (or the influence terms ψ_i = (w_i/w̄)(r_i − V) − (r_i − r̄)), which is far
tighter than V's own interval because both terms share the outcomes. The effective sample size
(Σ w)² / Σ w² is reported: when it is small the candidate moved far from μ and the estimate says
little, which the gate treats as it treats any other wide interval.

Which logged log-prob is μ: ``UpdateSettings.behaviour_logprobs``. ``raw`` (temperature-1 log-probs)
compares the candidate's and the serving version's own distributions; ``sampling`` uses what was
actually sampled from, and then the candidate is recomputed under the same temperature (read from the
row's sampling record; top-k/top-p truncation is not replayed, so use ``raw`` when they were on).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np
import torch

from policy.logprobs import pad_batch, sequence_logprobs
from realtime_rl.dataset import TrainingExample


@dataclass
class OPEResult:
    estimator: str
    estimate: float
    ci: tuple[float, float]
    snips: float
    clipped_ips: float
    ips: float
    n: int
    ess: float
    max_weight: float
    gain: float = float("nan")
    gain_se: float = float("nan")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ci"] = list(self.ci)
        return d


def ips(r: np.ndarray, w: np.ndarray) -> float:
    return float(np.mean(w * r)) if len(r) else float("nan")


def clipped_ips(r: np.ndarray, w: np.ndarray, cap: float) -> float:
    return float(np.mean(np.minimum(w, cap) * r)) if len(r) else float("nan")


def snips(r: np.ndarray, w: np.ndarray) -> float:
    s = float(np.sum(w))
    return float(np.sum(w * r) / s) if s > 0 else float("nan")


def effective_sample_size(w: np.ndarray) -> float:
    s2 = float(np.sum(w * w))
    return float(np.sum(w)) ** 2 / s2 if s2 > 0 else 0.0


def _z(level: float) -> float:
    return NormalDist().inv_cdf(0.5 + level / 2)


def normal_ci(r: np.ndarray, w: np.ndarray, estimator: str, cap: float, level: float) -> tuple[float, float]:
    n = len(r)
    if n < 2:
        return (float("nan"), float("nan"))
    if estimator == "snips":
        v = snips(r, w)
        se = math.sqrt(float(np.sum(w * w * (r - v) ** 2))) / float(np.sum(w))
    else:
        x = np.minimum(w, cap) * r
        v = float(np.mean(x))
        se = float(np.std(x, ddof=1)) / math.sqrt(n)
    z = _z(level)
    return (v - z * se, v + z * se)


def _bootstrap_draws(r: np.ndarray, w: np.ndarray, estimator: str, cap: float, samples: int,
                     seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The estimator and the realised mean on the same ``samples`` resamples of the examples."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(r), size=(samples, len(r)))
    rb, wb = r[idx], w[idx]
    if estimator == "snips":
        s = wb.sum(1)
        vals = np.where(s > 0, (wb * rb).sum(1) / np.where(s > 0, s, 1.0), np.nan)
    else:
        vals = (np.minimum(wb, cap) * rb).mean(1)
    return vals, rb.mean(1)


def bootstrap_ci(r: np.ndarray, w: np.ndarray, estimator: str, cap: float, level: float,
                 samples: int = 1000, seed: int = 0) -> tuple[float, float]:
    if len(r) < 2:
        return (float("nan"), float("nan"))
    vals, _ = _bootstrap_draws(r, w, estimator, cap, samples, seed)
    lo, hi = np.nanpercentile(vals, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return (float(lo), float(hi))


def paired_gain_se(r: np.ndarray, w: np.ndarray, estimator: str, cap: float, ci: str = "bootstrap",
                   samples: int = 1000, seed: int = 0) -> float:
    """Standard error of G = V − r̄, the estimate minus the realised rate on the same examples."""
    n = len(r)
    if n < 2:
        return float("nan")
    if ci == "bootstrap":
        vals, means = _bootstrap_draws(r, w, estimator, cap, samples, seed)
        return float(np.nanstd(vals - means, ddof=1))
    m = float(np.mean(r))
    if estimator == "snips":
        v = snips(r, w)
        psi = w / float(np.mean(w)) * (r - v) - (r - m)
        return math.sqrt(float(np.sum(psi * psi))) / n
    return float(np.std(np.minimum(w, cap) * r - r, ddof=1)) / math.sqrt(n)


def estimate(r: Sequence[float], log_w: Sequence[float], *, estimator: str = "snips", cap: float = 10.0,
             ci: str = "bootstrap", level: float = 0.95, samples: int = 1000, seed: int = 0) -> OPEResult:
    """All three estimates from outcomes and log importance weights; ``estimator`` picks the headline."""
    ra = np.asarray(r, dtype=np.float64)
    # Shift before exponentiating: SNIPS is invariant to it, IPS is not, so IPS uses the raw weights.
    lw = np.asarray(log_w, dtype=np.float64)
    w = np.exp(np.minimum(lw, 50.0))
    values = {"snips": snips(ra, w), "clipped_ips": clipped_ips(ra, w, cap), "ips": ips(ra, w)}
    if estimator not in ("snips", "clipped_ips"):
        raise ValueError(f"unknown estimator {estimator!r}")
    interval = (normal_ci(ra, w, estimator, cap, level) if ci == "normal"
                else bootstrap_ci(ra, w, estimator, cap, level, samples, seed))
    return OPEResult(estimator=estimator, estimate=values[estimator], ci=interval, snips=values["snips"],
                     clipped_ips=values["clipped_ips"], ips=values["ips"], n=len(ra),
                     ess=effective_sample_size(w), max_weight=float(w.max()) if len(w) else 0.0,
                     gain=values[estimator] - float(np.mean(ra)) if len(ra) else float("nan"),
                     gain_se=paired_gain_se(ra, w, estimator, cap, ci, samples, seed))


def accept_rate_ci(accepts: Sequence[bool], level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a realised accept rate."""
    n = len(accepts)
    if n == 0:
        return (float("nan"), float("nan"))
    p = sum(bool(a) for a in accepts) / n
    z = _z(level)
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    # At p = 0 or 1 the bound is exactly 0 or 1 (rounding would otherwise leave it a hair inside).
    return (0.0 if p == 0 else max(0.0, c - h), 1.0 if p == 1 else min(1.0, c + h))


def _tempered_logprobs(model, prompts, completions, temperatures, pad_token_id: int = 0):
    """Teacher-forced log-probs under softmax(logits / T_i) (T per row)."""

    ids, attn, pos, cmask, P = pad_batch(prompts, completions, pad_token_id)
    dev = next(model.parameters()).device
    ids, attn, pos, cmask = ids.to(dev), attn.to(dev), pos.to(dev), cmask.to(dev)
    C = cmask.shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits
        logits = logits[:, P - 1:P - 1 + C, :].float()
        t = torch.tensor(temperatures, dtype=torch.float32, device=dev).clamp_min(1e-6).view(-1, 1, 1)
        lp = (logits / t).log_softmax(-1).gather(-1, ids[:, P:P + C].unsqueeze(-1)).squeeze(-1)
    return lp.masked_fill(~cmask, 0.0)


def candidate_log_weights(model, examples: Sequence[TrainingExample], behaviour: str = "raw",
                          batch_size: int = 64, pad_token_id: int = 0) -> list[float]:
    """log w_i = log π(y_i|x_i) − log μ(y_i|x_i), summed over the completion's tokens."""

    out: list[float] = []
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        prompts = [e.example.prompt_token_ids for e in chunk]
        comps = [e.example.completion_token_ids for e in chunk]
        if behaviour == "sampling":
            temps = [float((e.example.sampling or {}).get("temperature", 1.0)) or 1.0 for e in chunk]
            lp = _tempered_logprobs(model, prompts, comps, temps, pad_token_id)
            mu = [sum(e.example.sampling_logprobs or e.example.logprobs) for e in chunk]
        else:
            lp = sequence_logprobs(model, prompts, comps, pad_token_id=pad_token_id).logprobs
            mu = [sum(e.example.logprobs) for e in chunk]
        target = lp.sum(1).tolist()
        out.extend(t - m for t, m in zip(target, mu, strict=True))
    return out


# --------------------------------------------------------------------------------------------------
# The canary's sequential test.


@dataclass
class CanaryTest:
    """One look at a running canary: ``decision`` is promote, rollback or continue."""

    decision: str
    reason: str
    delta: float
    se: float
    log_lr_worse: float
    log_lr_noninferior: float
    n_canary: int
    n_control: int
    threshold: float

    def as_dict(self) -> dict:
        return asdict(self)


def msprt_log_lr(delta: float, se: float, null: float, tau: float) -> float:
    """log Λ of the normal-mixture sequential probability ratio test (mSPRT) of H0: Δ = ``null``,
    for an estimate ``delta`` with standard error ``se`` and a N(null, τ²) mixture over alternatives:

        Λ = sqrt(σ² / (σ² + τ²)) · exp(τ² (Δ̂ − null)² / (2 σ² (σ² + τ²)))

    Rejecting H0 once Λ ≥ 1/α keeps the type-I error at most α however often one looks (an
    always-valid test); σ² is the plug-in variance, which is where it departs from the exact test."""
    v, t2 = se * se, tau * tau
    if v <= 0:
        return math.inf if delta != null else 0.0
    return 0.5 * math.log(v / (v + t2)) + t2 * (delta - null) ** 2 / (2 * v * (v + t2))


def _rate_var(k: int, n: int) -> float:
    p = (k + 0.5) / (n + 1.0)  # a half-count prior keeps the variance away from 0 at p = 0 or 1
    return p * (1 - p) / n


def canary_sequential_test(canary: tuple[int, int], control: tuple[int, int], *, before: tuple[int, int] | None = None,
                           control_before: tuple[int, int] | None = None, margin: float = 0.02,
                           tau: float = 0.05, alpha: float = 0.05, min_n: int = 1,
                           max_n: int | None = None) -> CanaryTest:
    """Promote, roll back or keep waiting, from (accepted, judged) counts.

    Δ̂ is the canary's accept rate minus the control's; with ``before`` / ``control_before`` (the same
    two cohorts on production before the canary began) it is the difference in differences, so a
    canary cohort whose users accept more, or less, than the others by habit does not bias it.
    Roll back once the mSPRT rejects Δ ≥ 0 with Δ̂ < 0 (the canary is worse); promote once it
    rejects Δ ≤ −margin with Δ̂ > −margin (the canary is not worse by more than the margin). At
    ``max_n`` canary judgements without a verdict, promote only if Δ̂ ≥ 0."""
    (kc, nc), (kp, np_) = canary, control
    if nc < max(min_n, 1) or np_ < 1:
        return CanaryTest("continue", f"{nc} canary / {np_} control judgements so far (need {min_n})",
                          math.nan, math.nan, 0.0, 0.0, nc, np_, math.log(1 / alpha))
    delta = kc / nc - kp / np_
    var = _rate_var(kc, nc) + _rate_var(kp, np_)
    if before is not None and control_before is not None and before[1] > 0 and control_before[1] > 0:
        delta -= before[0] / before[1] - control_before[0] / control_before[1]
        var += _rate_var(*before) + _rate_var(*control_before)
    se = math.sqrt(var)
    threshold = math.log(1 / alpha)
    worse = msprt_log_lr(delta, se, 0.0, tau)
    noninferior = msprt_log_lr(delta, se, -margin, tau)
    if delta < 0 and worse >= threshold:
        decision, why = "rollback", f"canary worse: Δ {delta:+.3f} (se {se:.3f}), log Λ {worse:.2f} ≥ {threshold:.2f}"
    elif delta > -margin and noninferior >= threshold:
        decision, why = "promote", (f"canary not worse than -{margin}: Δ {delta:+.3f} (se {se:.3f}), log Λ "
                                    f"{noninferior:.2f} ≥ {threshold:.2f}")
    elif max_n is not None and nc >= max_n:
        decision = "promote" if delta >= 0 else "rollback"
        why = f"no verdict after {nc} canary judgements: Δ {delta:+.3f} (se {se:.3f}), decided by its sign"
    else:
        decision, why = "continue", f"Δ {delta:+.3f} (se {se:.3f}) after {nc} canary judgements: no verdict yet"
    return CanaryTest(decision, why, delta, se, worse, noninferior, nc, np_, threshold)
