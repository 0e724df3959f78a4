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
rule, checked before each step, so the step that would carry the weights further is not taken): the
clip only stops the gradient of tokens already outside [1−ε, 1+ε], while shared parameters keep
moving, so without a KL bound the drift grows with the batch size.

Which logged log-prob is μ. The gateway logs ``logprobs`` (raw softmax at temperature 1) and
``sampling_logprobs`` (the temperature/top-k/top-p distribution the token was drawn from). The
default μ is ``logprobs``: it is the same function of the weights that the trainer recomputes, so at
θ = θ_prod the ratio is exactly 1 (up to train/inference numerics, logged as the mismatch) and the
clip bounds how far π_θ moves from the serving version; the sampling transform is then treated as
part of the environment. ``behaviour_logprobs = "sampling"`` uses the strict behaviour density instead;
with temperature 1 and no truncation (the default gateway request) the two are identical.

Robustness (see docs/algorithms.md): each example's advantage is multiplied by its balance weight
(:func:`realtime_rl.dataset.balance_weights`: callers and task buckets with many examples count less
per example) and, when negative, by ``negative_advantage_scale``; the baseline is the bucket mean plus
the caller's own mean residual (:func:`realtime_rl.baseline.caller_centred`), which silences users
who judge everything alike. Kept texts of edits are extra examples whose μ is the serving weights'
recomputed log-prob, trained with the truncated-IS form instead of the clip; an edited completion is
penalised only from the first token its user changed. Late feedback on an older production's
completion keeps that version's logged log-probs as μ.

Router replay (mixture-of-experts models, ``router_replay = "replay"``). The gateway logs, with every
completion, the experts each MoE layer chose at each position (``routes``). Every forward pass of the
update (the reference pass and each training step) forces those experts and recomputes the gate
weights from the live router logits over them (:mod:`policy.routing`), so the update differentiates
the same expert mixture that produced the logged tokens, and the router still learns through its
weights. A logged record that does not fit the model is an error naming the layer. The reference
pass also recomputes once without replay, so the returned metrics hold the train/inference k3 KL
and |Δlogp| > ln 2 share both ways and the share of routes the trainer's routers would have chosen
differently (``route_disagreement``). With ``"off"`` the routes are compared but never forced. A
kept text was not sampled, so it has no routes and its routers choose freely.

Departures from textbook REINFORCE: the importance ratio against μ instead of on-policy sampling
(the data was produced before the update, and with ``on_policy_only`` off by older versions); the
PPO-style clip with μ as the old policy (single rollout, several epochs); a leave-one-out bucket
baseline rather than a learned critic by default.

One full cycle around this update (dataset, candidate, gate, release) is :mod:`realtime_rl.cycle`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from policy.distributed import DataParallel
from policy.logprobs import pad_rows, sequence_logprobs
from policy.losses import kl_k3, masked_mean, mismatch_metrics, reinforce_loss, replay_metrics
from policy.routes import Routes
from policy.routing import RouteStats
from realtime_rl.baseline import bucket_mean_advantages, caller_centred, value_head_advantages
from realtime_rl.config import UpdateSettings
from realtime_rl.dataset import TrainingExample


def behaviour_logprobs(e: TrainingExample, which: str) -> list[float]:
    if which == "sampling" and e.example.sampling_logprobs is not None:
        return e.example.sampling_logprobs
    return e.example.logprobs


def _reference_pass(model, prompts, comps, routes, examples, served: list[bool], cfg: UpdateSettings,
                    pad_token_id: int) -> tuple[list[list[float]], dict[str, float]]:
    """The serving version's log-probs of every example (before any step), and the train/inference
    mismatch metrics over the served completions' tokens (kept texts have no logged log-probs; router
    replay's both ways when routes were logged)."""

    replay = cfg.router_replay == "replay"
    ref_all: list[list[float]] = []
    other: list[list[float]] = []
    stats = RouteStats()
    for i in range(0, len(examples), cfg.minibatch_size):
        sl = slice(i, i + cfg.minibatch_size)
        tl = sequence_logprobs(model, prompts[sl], comps[sl], pad_token_id=pad_token_id,
                               routes=None if routes is None else routes[sl], replay=replay)
        n = tl.mask.sum(1).tolist()
        ref_all += [row[:k] for row, k in zip(tl.logprobs.tolist(), n, strict=True)]
        if routes is not None:  # the other router mode, for the comparison only
            cf = sequence_logprobs(model, prompts[sl], comps[sl], pad_token_id=pad_token_id, routes=routes[sl],
                                   replay=not replay)
            other += [row[:k] for row, k in zip(cf.logprobs.tolist(), n, strict=True)]
            stats = stats + (cf.route_stats if replay else tl.route_stats)
    width = max(len(c) for c in comps)
    mask = torch.zeros((len(comps), width), dtype=torch.bool)
    for i, c in enumerate(comps):
        mask[i, :len(c)] = served[i]
    logged, ref = pad_rows([e.example.logprobs for e in examples], width), pad_rows(ref_all, width)
    metrics = mismatch_metrics(ref, logged, mask)
    if routes is not None:
        off, rep = (pad_rows(other, width), ref) if replay else (ref, pad_rows(other, width))
        metrics.update(replay_metrics(off, rep, logged, mask), route_disagreement=stats.rate,
                       route_disagreement_tokens=stats.token_rate, router_replay=float(replay))
    return ref_all, metrics


def train_policy(model, examples: Sequence[TrainingExample], advantages: Sequence[float], cfg: UpdateSettings,
                 *, pad_token_id: int = 0, log: Callable[[str], None] = lambda _m: None,
                 should_stop: Callable[[], bool] = lambda: False, dp: DataParallel | None = None) -> dict[str, float]:
    """A few epochs of AdamW on the objective in the module docstring; returns averaged metrics.

    With ``dp`` (several ranks, ``model`` sharded by ``dp.shard``) every rank holds every example and
    computes the gradient of its rows of each minibatch (policy/distributed.py); the minibatches,
    the metrics and the early stop are those of one process."""

    dp = dp or DataParallel()
    if len(examples) != len(advantages):
        raise ValueError("one advantage per example")
    if not examples:
        raise ValueError("no training examples")
    model.train()
    prompts = [e.example.prompt_token_ids for e in examples]
    comps = [e.example.completion_token_ids for e in examples]
    served = [e.source == "served" for e in examples]
    # Routes belong to served completions only: a kept text was not sampled, its routers choose freely.
    routes: list | None = [Routes.from_wire(e.example.routes) if ok and e.example.routes is not None else None
                           for e, ok in zip(examples, served, strict=True)]
    if all(r is None for r in routes):
        routes = None
    # Reference = the serving (production) weights we start from; computed before the first step.
    dp.gather(model)  # every rank makes these no-grad passes over every example
    ref_all, mismatch = _reference_pass(model, prompts, comps, routes, examples, served, cfg, pad_token_id)
    dp.release(model)  # the optimizer must hold the sharded parameters
    # μ: the logged log-probs of the version that served each completion (an older production's for
    # late feedback); a kept text was sampled from nothing, so its μ is the serving weights' own.
    mu_all = [behaviour_logprobs(e, cfg.behaviour_logprobs) if e.source == "served" else ref_all[j]
              for j, e in enumerate(examples)]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    order = list(range(len(examples)))
    sums: dict[str, float] = {}
    losses: list[float] = []
    steps = 0
    stopped = False
    for epoch in range(cfg.epochs):
        rng.shuffle(order)
        for i in range(0, len(order), cfg.minibatch_size):
            if dp.broadcast(should_stop()):
                raise InterruptedError("update interrupted")
            idx = dp.rows(order[i:i + cfg.minibatch_size])  # this rank's rows (all of them in one process)
            opt.zero_grad(set_to_none=True)
            dp.begin_backward(model)
            loss, m, counts = None, {}, {"tokens": 0, "own": 0}
            if idx:
                tl = sequence_logprobs(model, [prompts[j] for j in idx], [comps[j] for j in idx], grad=True,
                                       pad_token_id=pad_token_id,
                                       routes=None if routes is None else [routes[j] for j in idx],
                                       replay=cfg.router_replay == "replay")
                width, dev = tl.mask.shape[1], tl.logprobs.device
                mu = pad_rows([mu_all[j] for j in idx], width).to(dev)
                ref = pad_rows([ref_all[j] for j in idx], width).to(dev) if cfg.kl_coef else None
                # Balance weights scale the advantage: the loss is linear in A, so this weights example j's
                # loss by w_j (the dual-clip bound C·A scales with it).
                # Negative advantages are scaled by negative_advantage_scale (see the module docstring).
                adv = torch.tensor([advantages[j] * examples[j].weight * (cfg.negative_advantage_scale
                                                                         if advantages[j] < 0 else 1.0) for j in idx],
                                   dtype=torch.float32, device=dev)
                loss, m, counts["tokens"] = _mixed_loss(tl, mu, adv, ref, [served[j] for j in idx], cfg,
                                                        [examples[j].kept_prefix if advantages[j] < 0 else 0
                                                         for j in idx])
                with torch.no_grad():
                    # The trust region is measured on the policy's own samples: a kept text the serving
                    # weights found unlikely would otherwise read as a large KL after a small step.
                    refk = pad_rows([ref_all[j] for j in idx], width).to(dev)
                    own = tl.mask & torch.tensor([served[j] for j in idx], device=dev).unsqueeze(1)
                    counts["own"] = int(own.sum())
                    # KL(π_serving ‖ π_θ) on completions the serving version sampled.
                    m["kl_to_serving_k3"] = masked_mean(kl_k3(refk, tl.logprobs), own).item() if counts["own"] else 0.0
            # Every rank's loss and metrics are its part of the one-process values: token means, weighted
            # by this rank's share of the minibatch's tokens (the normaliser of the token-level loss).
            total = dp.sum_dict(counts)
            share = {k: counts[k] / total[k] if dp.enabled and total[k] else 1.0 for k in counts}
            loss_value = 0.0
            if loss is not None and counts["tokens"]:
                (loss * share["tokens"]).backward()
                loss_value = float(loss.item()) * share["tokens"]
            m = {k: v * share["own" if k == "kl_to_serving_k3" else "tokens"] for k, v in m.items()}
            dp.end_backward(model)
            m = dp.sum_dict({**m, "loss": loss_value})
            if cfg.target_kl is not None and m["kl_to_serving_k3"] > cfg.target_kl:
                # The weights are already outside the trust region on this minibatch: stop, without
                # the step that would carry them further.
                stopped = True
                break
            m["grad_norm"] = dp.clip_grad_norm(model.parameters(), cfg.max_grad_norm)
            opt.step()
            steps += 1
            losses.append(m["loss"])
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
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
    out["loss_curve"] = losses
    out["early_stopped"] = float(stopped)
    return out


def _mixed_loss(tl, mu, adv, ref, served_rows: list[bool], cfg: UpdateSettings, kept_prefix: list[int]):
    """The clipped objective on served completions and the truncated-IS form (clip = None, weight
    capped at ``tis_cap``) on kept texts, averaged over both sets' tokens.

    A kept text is no sample of the serving version, and the ones users write are often ones it finds
    unlikely; under the ratio clip each of its tokens could gain only ε of probability per update, so
    the form users asked for would take many releases to appear. The KL early stop (measured on served
    completions) still bounds how far the update moves the policy. ``kept_prefix[i]`` leading tokens
    of row i are left out (an edit's unchanged beginning). Returns ``(loss, metrics, tokens)``, tokens
    being the count both parts average over (a data-parallel rank weights its loss by its share)."""

    rows = torch.tensor(served_rows, device=tl.mask.device).unsqueeze(1)
    # An edited completion is penalised from the first token its user changed on (credit assignment).
    positions = torch.arange(tl.mask.shape[1], device=tl.mask.device).unsqueeze(0)
    changed = positions >= torch.tensor(kept_prefix, device=tl.mask.device).unsqueeze(1)
    parts, metrics = [], {}
    for mask, clip in ((tl.mask & rows & changed, cfg.clip), (tl.mask & ~rows, None)):
        tokens = int(mask.sum())
        if tokens == 0:
            continue
        loss, m = reinforce_loss(tl.logprobs, mu, adv, mask, clip=clip, tis_cap=cfg.tis_cap, level=cfg.is_level,
                                 ref_logp=ref, kl_coef=cfg.kl_coef)
        parts.append((loss, tokens))
        metrics = metrics or m
    total = sum(t for _, t in parts)
    return sum(loss * (t / total) for loss, t in parts), metrics, total


def compute_advantages(examples: Sequence[TrainingExample], cfg: UpdateSettings, history, model=None,
                       pad_token_id: int = 0) -> tuple[list[float], list[float]]:
    """(advantages, baselines): the value head, or the bucket mean with the caller-centred term
    (:func:`realtime_rl.baseline.caller_centred`; without it when ``caller_baseline_prior`` is 0). The
    balance weights are applied in the loss."""

    if cfg.baseline == "value_head":
        if model is None:
            raise ValueError("the value-head baseline needs the model")
        return value_head_advantages(model, examples, pad_token_id=pad_token_id)
    if cfg.caller_baseline_prior > 0:
        return caller_centred(examples, history, cfg.baseline_prior, cfg.caller_baseline_prior)
    return bucket_mean_advantages(examples, history, cfg.baseline_prior)

