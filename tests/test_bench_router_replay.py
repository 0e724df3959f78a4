"""`rtrl bench router-replay`'s measurement on the tiny MoE model (random weights; the bench itself
mid-trains first): a cell's numbers and the goals computed from them."""

from __future__ import annotations

import dataclasses

import torch

from benchmarks.router_replay import _sample_torch, flipped_tokens, goals, measure_cell, reduction_ci
from policy.loading import load_policy, load_tokenizer
from policy.routes import Routes


def test_a_cell_measures_both_router_modes_and_the_goals_read_them(tiny_moe_dir):
    tok = load_tokenizer(tiny_moe_dir)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("def f(x): return ", "# f(1)=3\ndef f(x): return ")]
    samples = _sample_torch(tiny_moe_dir, "float32", "cpu", prompts, samples=2, max_new=6, seed=1)
    same = {"engine": "torch", "staleness": 0, "sampler_dtype": "float32", "trainer_dtype": "float32",
            **measure_cell(samples, tiny_moe_dir, "float32", "cpu", repeats=1)}
    assert same["route_disagreement_off"] == 0.0 and same["max_abs_dlogp_replay"] <= 1e-5
    assert same["k3_kl_off"] < 1e-9 and same["tokens"] == sum(len(s.token_ids) for s in samples)
    assert 0 < same["bytes_per_token_routes"] <= 2.0
    # bf16 sampling against the fp32 trainer: the engines now differ (routes may or may not flip on
    # random weights), and the goals are computed from whatever cells there are.
    bf16 = {"engine": "torch", "staleness": 0, "sampler_dtype": "bfloat16", "trainer_dtype": "float32",
            **measure_cell(_sample_torch(tiny_moe_dir, "bfloat16", "cpu", prompts, 2, 6, 1), tiny_moe_dir, "float32",
                           "cpu", repeats=1)}
    assert bf16["k3_kl_off"] > same["k3_kl_off"]
    g = goals([same, bf16])
    assert g["exact_replay_met"] and g["route_bytes_met"]
    assert g["max_abs_dlogp_replay_staleness0_fp32"] == same["max_abs_dlogp_replay"]
    # In float64 the goal is read there: the sampler's and the trainer's rounding no longer hide what
    # replay itself would get wrong (the log-softmax stays float32, so its rounding is the floor).
    fp64 = {"engine": "torch", "staleness": 0, "sampler_dtype": "float64", "trainer_dtype": "float64",
            **measure_cell(_sample_torch(tiny_moe_dir, "float64", "cpu", prompts, 2, 6, 1), tiny_moe_dir, "float64",
                           "cpu", repeats=1)}
    assert fp64["max_abs_dlogp_replay"] <= same["max_abs_dlogp_replay"] + 1e-7
    worse = goals([same, {**fp64, "max_abs_dlogp_replay": 2e-5}])
    assert not worse["exact_replay_met"] and worse["max_abs_dlogp_replay_staleness0_fp64"] == 2e-5
    assert same["tokens_flipped"] == 0 and "kl_reduction_flipped" not in same


def test_flipped_tokens_are_the_positions_whose_recorded_experts_differ(tiny_moe_dir):
    policy = load_policy(tiny_moe_dir)
    prompt = policy.tokenizer("def f(x): return ", add_special_tokens=False)["input_ids"]
    samples = _sample_torch(tiny_moe_dir, "float32", "cpu", [prompt], samples=2, max_new=5, seed=3)
    pad = policy.tokenizer.pad_token_id
    assert not flipped_tokens(policy.model, samples, pad).any()
    # Record another expert set in the last MoE layer at the position that predicts completion token 1.
    ids = samples[1].routes.ids.copy()
    experts = samples[1].routes.experts
    at = len(prompt)
    ids[at, -1] = [(int(e) + 1) % experts for e in ids[at, -1]]
    if sorted(ids[at, -1]) == sorted(samples[1].routes.ids[at, -1]):  # the shift may land on the same set
        ids[at, -1] = [(int(e) + 2) % experts for e in samples[1].routes.ids[at, -1]]
    samples[1] = dataclasses.replace(samples[1], routes=Routes(ids, experts))
    flipped = flipped_tokens(policy.model, samples, pad)
    assert flipped.shape == (2, max(len(s.token_ids) for s in samples))
    assert flipped.nonzero().tolist() == [[1, 1]]


def test_reduction_interval_resamples_prompts_and_brackets_the_ratio():
    prompts = [[1], [1], [2], [2], [3], [3], [4], [4]]
    mask = torch.tensor([[True, True, False]] * 8)
    k3_replay = torch.full((8, 3), 0.01)
    k3_off = torch.full((8, 3), 0.02)
    k3_off[0, 0] = 1.0  # one flipped route carries most of the off-KL
    k3_off[0, 2] = 100.0  # padding: never counted
    lo, hi = reduction_ci(prompts, k3_off, k3_replay, mask)
    ratio = float(k3_off.masked_fill(~mask, 0).sum() / k3_replay.masked_fill(~mask, 0).sum())
    assert lo < ratio < hi and lo >= 2.0 - 1e-6  # every prompt's own ratio is at least 2
    assert hi - lo > 1.0  # the one heavy prompt makes the interval wide
    assert reduction_ci(prompts, k3_off, torch.zeros((8, 3)), mask) is None
