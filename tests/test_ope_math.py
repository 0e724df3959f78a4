"""Hand-computed checks: OPE estimators and CIs, bucket baselines / advantages, importance weights."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from realtime_rl.baseline import BucketStats, bucket_mean_advantages, merge_batch
from realtime_rl.config import ReleaseGateSettings
from realtime_rl.dataset import LoggedExample, TrainingExample
from realtime_rl.ope import accept_rate_ci, bootstrap_ci, estimate, normal_ci
from realtime_rl.release import ope_verdict


def te(reward: float, bucket: str) -> TrainingExample:
    e = LoggedExample("c", "v", "a", bucket, [1], [2], [-1.0], None, "accept")
    return TrainingExample(e, reward, reward > 0)


def test_snips_clipped_ips_by_hand():
    r = [1, 0, 1, 0]
    log_w = [math.log(2.0), math.log(0.5), math.log(20.0), 0.0]
    res = estimate(r, log_w, estimator="snips", cap=10.0, ci="normal")
    assert res.snips == pytest.approx((2 + 20) / (2 + 0.5 + 20 + 1))
    assert res.ips == pytest.approx((2 + 20) / 4)
    assert res.clipped_ips == pytest.approx((2 + 10) / 4)
    assert res.ess == pytest.approx(23.5**2 / (4 + 0.25 + 400 + 1))
    assert res.max_weight == pytest.approx(20.0)
    # On-policy (all weights 1) SNIPS is the realised rate exactly.
    assert estimate([1, 0, 0, 1, 1], [0.0] * 5).estimate == pytest.approx(0.6)


def test_confidence_intervals_cover_and_agree():
    rng = np.random.default_rng(0)
    r = (rng.random(2000) < 0.3).astype(float)
    w = np.ones_like(r)
    lo, hi = normal_ci(r, w, "snips", 10.0, 0.95)
    blo, bhi = bootstrap_ci(r, w, "snips", 10.0, 0.95, samples=500)
    p = r.mean()
    se = math.sqrt(p * (1 - p) / len(r))
    assert lo == pytest.approx(p - 1.959964 * se, abs=1e-4) and hi == pytest.approx(p + 1.959964 * se, abs=1e-4)
    assert blo == pytest.approx(lo, abs=0.01) and bhi == pytest.approx(hi, abs=0.01)
    wl, wh = accept_rate_ci([True] * 30 + [False] * 70)
    assert wl < 0.3 < wh and wl == pytest.approx(0.2189, abs=1e-3)  # Wilson interval for 30/100


def test_paired_gain_is_tighter_than_the_estimate_and_the_gate_refuses_only_a_worse_candidate():
    rng = np.random.default_rng(1)
    r = (rng.random(400) < 0.55).astype(float)
    noise = rng.normal(0.0, 0.5, size=len(r))  # a candidate as good as production, differently spread
    same = estimate(r, noise, ci="bootstrap", samples=800)
    assert same.gain == pytest.approx(same.estimate - r.mean())
    # Both terms share the outcomes: the paired gain's spread is well under the estimate's own.
    assert same.gain_se < 0.6 * (same.ci[1] - same.ci[0]) / (2 * 1.959964)
    assert estimate(r, noise, ci="normal").gain_se == pytest.approx(same.gain_se, rel=0.25)
    worse = estimate(r, noise - 1.5 * r)  # down-weights every accepted completion
    g = ReleaseGateSettings()
    assert ope_verdict(same, float(r.mean()), g)[0]
    ok, why = ope_verdict(worse, float(r.mean()), g)
    assert not ok and "paired gain" in why
    # The point-estimate rule refuses any candidate estimated a hair below production.
    assert not ope_verdict(replace(same, estimate=r.mean() - 1e-3), float(r.mean()),
                           ReleaseGateSettings(ope_test="estimate"))[0]


def test_leave_one_out_bucket_baseline_by_hand():
    batch = [te(0.75, "a"), te(-0.25, "a"), te(-0.25, "a"), te(0.75, "b")]
    history = {"a": BucketStats(reward_sum=1.0, count=4.0)}
    adv, base = bucket_mean_advantages(batch, history, prior=0.1)
    # bucket a: S = 1 + 0.25 = 1.25 over N = 7; leave-one-out
    assert base[0] == pytest.approx((1.25 - 0.75) / 6)
    assert base[1] == pytest.approx((1.25 + 0.25) / 6)
    assert adv[0] == pytest.approx(0.75 - (0.5 / 6))
    assert base[3] == pytest.approx(0.1)  # a lone example in a new bucket: the prior
    merged = merge_batch(history, batch)
    assert merged["a"].reward_sum == pytest.approx(1.25) and merged["a"].count == 7
    assert merged["b"].count == 1 and history["a"].count == 4  # the input is not mutated


def test_reinforce_importance_weights_by_hand():
    from policy.losses import reinforce_loss, truncated_importance_weight

    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mu = torch.tensor([[-1.5, -1.0]])
    mask = torch.tensor([[True, True]])
    w = truncated_importance_weight(logp, mu, cap=2.0)
    assert w.tolist()[0] == pytest.approx([math.exp(0.5), math.exp(-1.0)])
    # Pure truncated-IS REINFORCE: loss = -mean_t min(rho_t, C) * A * logp_t
    A = torch.tensor([0.5])
    loss, _ = reinforce_loss(logp, mu, A, mask, clip=None, tis_cap=1.5)
    expect = -(min(math.exp(0.5), 1.5) * 0.5 * -1.0 + math.exp(-1.0) * 0.5 * -2.0) / 2
    assert loss.item() == pytest.approx(expect)
    # Sequence level: rho = exp(sum) for every token, clipped at 1 +- eps.
    loss_s, m = reinforce_loss(logp, mu, A, mask, clip=0.2, level="sequence")
    rho = math.exp(0.5 - 1.0)
    assert m["ratio_mean"] == pytest.approx(rho)
    assert loss_s.item() == pytest.approx(-min(rho * 0.5, max(rho, 0.8) * 0.5))


def test_canary_sequential_test_verdicts_and_error_rate():
    import random

    from realtime_rl.ope import canary_sequential_test, msprt_log_lr

    assert msprt_log_lr(0.0, 0.05, 0.0, 0.05) < 0 < msprt_log_lr(0.2, 0.05, 0.0, 0.05)
    worse = canary_sequential_test((120, 400), (240, 400), min_n=50)
    assert worse.decision == "rollback" and worse.delta < 0
    better = canary_sequential_test((260, 400), (200, 400), min_n=50)
    assert better.decision == "promote"
    assert canary_sequential_test((10, 20), (10, 20), min_n=50).decision == "continue"  # too few yet
    same = canary_sequential_test((200, 400), (200, 400), min_n=50)
    assert same.decision == "continue"
    assert canary_sequential_test((200, 400), (200, 400), min_n=50, max_n=400).decision == "promote"
    assert canary_sequential_test((199, 400), (200, 400), min_n=50, max_n=400).decision == "rollback"
    # Difference in differences: a cohort that always accepted more is not mistaken for a better canary.
    habit = canary_sequential_test((300, 400), (200, 400), before=(300, 400), control_before=(200, 400), min_n=50)
    assert habit.decision == "continue" and abs(habit.delta) < 1e-9
    # Always valid: a canary exactly as good as production, looked at every 50 judgements up to 1,000,
    # is rolled back in at most about α of the runs.
    rng = random.Random(0)
    wrong = 0
    for _ in range(200):
        kc = kp = nc = 0
        for _ in range(20):
            kc += sum(rng.random() < 0.4 for _ in range(50))
            kp += sum(rng.random() < 0.4 for _ in range(150))
            nc += 50
            if canary_sequential_test((kc, nc), (kp, 3 * nc), min_n=50).decision == "rollback":
                wrong += 1
                break
    assert wrong <= 0.05 * 200
