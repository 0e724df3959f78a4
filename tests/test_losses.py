"""Loss functions against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from policy.losses import (
    group_advantages,
    grpo_policy_loss,
    kl_k1,
    kl_k3,
    masked_mean,
    mismatch_metrics,
    reinforce_loss,
    truncated_importance_weight,
    zero_variance_groups,
)


def test_group_advantages_mean_and_std():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    a = group_advantages(r)
    assert a.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]
    s = group_advantages(r, scale_by_std=True, eps=0.0)
    assert s[0].tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0])
    assert zero_variance_groups(r).tolist() == [False, True]


def test_grpo_loss_token_vs_sequence_level():
    # Two completions: lengths 1 and 3, ratio 1 everywhere, A = [+1, -1].
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    A = torch.tensor([1.0, -1.0])
    tok, _ = grpo_policy_loss(logp, torch.zeros(2, 3), A, mask, level="token")
    seq, _ = grpo_policy_loss(logp, torch.zeros(2, 3), A, mask, level="sequence")
    # token: -(1*1 + 3*(-1)) / 4 = 0.5 ; sequence: -((1) + (-1)) / 2 = 0
    assert tok.item() == pytest.approx(0.5)
    assert seq.item() == pytest.approx(0.0)
    tok.backward()
    # d/dlogp of -ρA/N with ρ = 1: -A/N, masked positions get 0
    assert logp.grad.flatten().tolist() == pytest.approx([-0.25, 0, 0, 0.25, 0.25, 0.25])


def test_grpo_clipping_low_and_high():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[math.log(1.5), math.log(0.5)]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    # A > 0: ratio 1.5 clipped at 1+0.28 -> 1.28 ; ratio 0.5 not clipped (min picks 0.5)
    loss, m = grpo_policy_loss(logp, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-(1.28 + 0.5) / 2)
    assert m["clip_fraction"] == pytest.approx(0.5)
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0  # clipped token carries no gradient
    assert logp.grad[0, 1].item() == pytest.approx(-0.5 / 2)


def test_grpo_tis_weight_and_kl_term():
    logp = torch.zeros(1, 2)
    w = torch.tensor([[0.5, 2.0]])
    ref = torch.tensor([[math.log(2.0), 0.0]])
    loss, m = grpo_policy_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool),
                               tis_weight=w, ref_logp=ref, kl_coef=0.1)
    k3_first = 2.0 - math.log(2.0) - 1
    assert loss.item() == pytest.approx((-0.5 - 2.0 + 0.1 * k3_first) / 2)
    assert m["kl_ref"] == pytest.approx(k3_first / 2)


def test_truncated_importance_weight():
    w = truncated_importance_weight(torch.tensor([0.0, math.log(3.0), math.log(0.5)]), torch.zeros(3), cap=2.0)
    assert w.tolist() == pytest.approx([1.0, 2.0, 0.5])
    assert not w.requires_grad


def test_kl_estimators():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert kl_k1(logp, ref).item() == pytest.approx(math.log(2.0))
    assert kl_k3(logp, ref).item() == pytest.approx(0.5 - math.log(0.5) - 1)
    assert kl_k3(ref, ref).item() == 0.0


def test_reinforce_tis_mode_matches_hand_gradient():
    logp = torch.tensor([[math.log(0.6)]], requires_grad=True)
    beh = torch.tensor([[math.log(0.2)]])  # ratio 3 -> truncated to 2
    loss, m = reinforce_loss(logp, beh, torch.tensor([0.5]), torch.ones(1, 1, dtype=torch.bool), clip=None,
                             tis_cap=2.0)
    assert loss.item() == pytest.approx(-2.0 * 0.5 * math.log(0.6))
    loss.backward()
    assert logp.grad.item() == pytest.approx(-1.0)
    assert m["clip_fraction"] == 1.0


def test_reinforce_clip_mode_dual_clip_for_negative_advantage():
    mask = torch.ones(1, 1, dtype=torch.bool)
    beh = torch.zeros(1, 1)
    # ratio 5 with A = -1: plain PPO would give -(-5) = 5; dual clip caps the penalty at C*|A| = 3.
    big = torch.tensor([[math.log(5.0)]], requires_grad=True)
    loss, _ = reinforce_loss(big, beh, torch.tensor([-1.0]), mask, clip=0.2, tis_cap=3.0)
    assert loss.item() == pytest.approx(3.0)
    # ratio 1.5 with A = +1: clipped to 1.2
    up = torch.tensor([[math.log(1.5)]])
    loss, m = reinforce_loss(up, beh, torch.tensor([1.0]), mask, clip=0.2, tis_cap=3.0)
    assert loss.item() == pytest.approx(-1.2) and m["clip_fraction"] == 1.0


def test_reinforce_sequence_level_uses_product_of_ratios():
    logp = torch.tensor([[math.log(0.5), math.log(0.5)]])
    beh = torch.tensor([[math.log(0.5), math.log(0.25)]])  # sequence ratio = 1 * 2 = 2
    loss, m = reinforce_loss(logp, beh, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool), clip=None,
                             tis_cap=10.0, level="sequence")
    assert m["ratio_mean"] == pytest.approx(2.0)
    assert loss.item() == pytest.approx(-2.0 * (math.log(0.5) + math.log(0.5)) / 2)


def test_masked_mean_and_mismatch():
    x = torch.tensor([[1.0, 5.0], [3.0, 7.0]])
    mask = torch.tensor([[True, False], [True, True]])
    assert masked_mean(x, mask).item() == pytest.approx(11.0 / 3)
    assert masked_mean(x, mask, dim=1).tolist() == pytest.approx([1.0, 5.0])
    m = mismatch_metrics(torch.tensor([[0.0, -1.0]]), torch.tensor([[-0.1, -1.0]]), torch.ones(1, 2, dtype=torch.bool))
    assert m["mismatch_abs_logp"] == pytest.approx(0.05)
