"""GRPO trainer: advantages and loss values on a hand-made batch, zero-variance groups, the truncated
importance-weight correction, and the async pipeline's staleness bound and live weight pickup."""

from __future__ import annotations

import json
import math

import pytest
import torch

from offline_rl.grpo import GRPOTrainer, run_grpo
from offline_rl.presets import apply_preset
from offline_rl.rollout import Trajectory
from offline_rl.tasks import Task
from offline_rl.tasks import TestCase as Case
from policy.logprobs import sequence_logprobs
from rtrl.config import load_settings

TASK = Task(task_id="t", prompt="# f(0)=1\ndef f(x): return ", tests=[Case([1], 4)])


def make_settings(tmp_path, **grpo):
    s = apply_preset(load_settings(), "functions")
    s.grpo.out_dir = str(tmp_path / "run")
    s.grpo.group_size = 2
    s.grpo.prompts_per_step = 2
    s.grpo.warmup_steps = 0
    for k, v in grpo.items():
        setattr(s.grpo, k, v)
    return s


def batch(tokenizer, rewards, shift=None):
    """Two groups of two completions; behaviour log-probs = trainer recompute + ``shift`` per token."""
    prompt = tokenizer(TASK.prompt, add_special_tokens=False)["input_ids"]
    comps = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in ("x*3+1\n", "x+3\n", "x*2\n", "4\n")]
    return [Trajectory(task=TASK, prompt_ids=list(prompt), completion_ids=c, action_mask=[True] * len(c),
                       behaviour_logprobs=[0.0] * len(c), reward=r) for c, r in zip(comps, rewards, strict=True)]


def fill_behaviour(trainer, trajs, shift):
    tl = sequence_logprobs(trainer.model, [t.prompt_ids for t in trajs], [t.completion_ids for t in trajs],
                           pad_token_id=trainer.tokenizer.pad_token_id)
    for i, t in enumerate(trajs):
        t.behaviour_logprobs = [float(tl.logprobs[i, j]) + shift(i, j) for j in range(len(t.completion_ids))]
    return tl


def test_advantages_loss_value_and_zero_variance_groups(tiny_model_dir, tmp_path):
    s = make_settings(tmp_path, loss_level="token", lr=1e-3)
    trainer = GRPOTrainer(s, tiny_model_dir)
    trajs = batch(trainer.tokenizer, [1.0, 0.0, 0.5, 0.5])  # group 2 has zero variance
    fill_behaviour(trainer, trajs, lambda i, j: 0.0)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    m = trainer.train_on(trajs)
    assert m["zero_variance_groups"] == 1 and m["trained_completions"] == 2
    # A = r - mean = (+0.5, -0.5); ratio = 1 on the first pass, so the token-level loss is
    # -(Σ_t A_i) / N = -(0.5·n0 - 0.5·n1) / (n0 + n1).
    n0, n1 = len(trajs[0].completion_ids), len(trajs[1].completion_ids)
    assert m["loss"] == pytest.approx(-(0.5 * n0 - 0.5 * n1) / (n0 + n1), abs=1e-5)
    assert m["clip_fraction"] == 0.0 and m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["mismatch_abs_logp"] < 1e-5 and m["tis_mean"] == pytest.approx(1.0, abs=1e-4)
    assert trainer.version == 1 and m["updated"]
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())

    # Sequence level: mean over each completion, then over completions: -(0.5 - 0.5)/2 = 0.
    s2 = make_settings(tmp_path, loss_level="sequence")
    t2 = GRPOTrainer(s2, tiny_model_dir)
    trajs = batch(t2.tokenizer, [1.0, 0.0, 0.5, 0.5])
    fill_behaviour(t2, trajs, lambda i, j: 0.0)
    assert t2.train_on(trajs)["loss"] == pytest.approx(0.0, abs=1e-6)

    # Std scaling: A = ±1 whatever the spread of the group.
    s3 = make_settings(tmp_path, loss_level="sequence", scale_by_std=True)
    t3 = GRPOTrainer(s3, tiny_model_dir)
    trajs = batch(t3.tokenizer, [0.2, 0.1, 0.5, 0.5])
    fill_behaviour(t3, trajs, lambda i, j: 0.0)
    m3 = t3.train_on(trajs)
    assert m3["loss"] == pytest.approx(0.0, abs=1e-5)

    # Only zero-variance groups: no update, the version does not move.
    t4 = GRPOTrainer(make_settings(tmp_path), tiny_model_dir)
    trajs = batch(t4.tokenizer, [1.0, 1.0, 0.0, 0.0])
    m4 = t4.train_on(trajs)
    assert not m4["updated"] and m4["zero_variance_groups"] == 2 and t4.version == 0 and t4.step == 1


def test_truncated_importance_weight_corrects_the_mismatch(tiny_model_dir, tmp_path):
    cap = 2.0
    s = make_settings(tmp_path, loss_level="token", tis_cap=cap)
    trainer = GRPOTrainer(s, tiny_model_dir)
    trajs = batch(trainer.tokenizer, [1.0, 0.0, 0.3, 0.9])
    # The inference engine reported μ lower than the trainer's π_old by 0.1 on completion 0 (w = e^0.1)
    # and by 3 on completion 2 (w = e^3, truncated to C), higher by 0.2 on completion 1 (w = e^-0.2).
    offsets = {0: -0.1, 1: 0.2, 2: -3.0, 3: 0.0}
    tl = fill_behaviour(trainer, trajs, lambda i, j: offsets[i])
    m = trainer.train_on(trajs)
    mask = tl.mask
    n = [int(mask[i].sum()) for i in range(4)]
    expected_w = [math.exp(0.1), math.exp(-0.2), cap, 1.0]
    tot = sum(n)
    assert m["tis_mean"] == pytest.approx(sum(w * k for w, k in zip(expected_w, n, strict=True)) / tot, rel=1e-4)
    assert m["tis_truncated_frac"] == pytest.approx(n[2] / tot, rel=1e-4)
    assert m["mismatch_abs_logp"] == pytest.approx((0.1 * n[0] + 0.2 * n[1] + 3.0 * n[2]) / tot, rel=1e-4)
    # The weighted loss: A = (+.5, -.5, -.3, +.3), each token's term scaled by its weight.
    adv = [0.5, -0.5, -0.3, 0.3]
    want = -sum(a * w * k for a, w, k in zip(adv, expected_w, n, strict=True)) / tot
    assert m["loss"] == pytest.approx(want, rel=1e-4)


def test_async_staleness_bound_and_live_weight_pickup(tiny_model_dir, tmp_path):
    s = make_settings(tmp_path, mode="async", workers=1, steps=6, max_staleness=0, queue_size=2,
                      eval_every=0, checkpoint_every=100, max_new_tokens=8, lr=1e-3)
    s.grpo.group_size = 4
    s.grpo.prompts_per_step = 4
    s.rewards.require_pass = False  # random init model: shaping rewards give groups some variance
    s.eval.samples = 1
    s.eval.k = [1]
    res = run_grpo(s, tiny_model_dir, progress=False, evaluate_before=False, evaluate_after=False)
    recs = [json.loads(line) for line in res.metrics_path.read_text().splitlines()]
    assert len(recs) == 6
    assert all(r["staleness"] == 0 for r in recs)  # max_staleness = 0: nothing older was trained on
    # The worker ran ahead with a queue of two, so some batches were too old and were dropped (counted).
    assert res.dropped_stale > 0 and recs[-1]["dropped_stale"] == res.dropped_stale
    # Workers took new weights without restarting: later batches carry later versions, and each batch's
    # behaviour log-probs are the trainer's own under that version (only the trained tensors are
    # re-sent each step, so a missed one would show here as a mismatch).
    assert max(r["batch_version"] for r in recs) >= 2
    assert all(r["mismatch_abs_logp"] < 1e-4 for r in recs if r.get("updated"))
    for r in recs:
        assert {"reward_mean", "pass_rate", "entropy", "mismatch_abs_logp", "mismatch_kl_k3", "clip_fraction",
                "staleness", "reward_tests", "reward_format"} <= r.keys() or not r["updated"]
        # Where the step's wall time went, worker side included (the hand-off crosses processes on one
        # monotonic clock, so it cannot be negative).
        assert {"wait_s", "train_s", "sandbox_cpu_s", "slot_wait_s", "sync_s", "handoff_s", "step_cpu_s"} <= r.keys()
        assert r["handoff_s"] >= 0 and r["sandbox_cpu_s"] >= 0 and ("publish_s" in r) == bool(r["updated"])


def test_frozen_recompute_with_several_epochs_gives_the_same_weights(tiny_model_dir, tmp_path):
    # epochs_per_batch > 1 recomputes π_old up front (frozen); its weights must equal the fused path's.
    out = []
    for epochs in (1, 2):
        trainer = GRPOTrainer(make_settings(tmp_path, tis_cap=2.0, epochs_per_batch=epochs), tiny_model_dir)
        trajs = batch(trainer.tokenizer, [1.0, 0.0, 0.3, 0.9])
        fill_behaviour(trainer, trajs, lambda i, j: -0.5 if i == 0 else 0.1)
        out.append(trainer.train_on(trajs))
    assert out[0]["tis_mean"] == pytest.approx(out[1]["tis_mean"], rel=1e-5)
    assert out[0]["mismatch_abs_logp"] == pytest.approx(out[1]["mismatch_abs_logp"], rel=1e-5)
    assert out[1]["ratio_mean"] != pytest.approx(1.0, abs=1e-7)  # the second pass moved away from π_old


@pytest.mark.parametrize("kind", ["functions", "repo"])
def test_multi_turn_grpo_trains_on_policy_tokens_only(tiny_model_dir, tmp_path, kind):
    s = make_settings(tmp_path, mode="sync", steps=2, eval_every=0, max_new_tokens=8, lr=1e-3)
    s.env.kind, s.env.mode, s.env.max_turns = kind, "multi", 2
    s.rewards.require_pass = False
    res = run_grpo(s, tiny_model_dir, progress=False, evaluate_before=False, evaluate_after=False)
    recs = [json.loads(line) for line in res.metrics_path.read_text().splitlines()]
    assert len(recs) == 2 and all(1.0 <= r["mean_turns"] <= 2.0 for r in recs)
    if kind == "repo":  # what the agent did is logged with every step
        assert all({"behaviour_turns", "behaviour_malformed", "truncated"} <= r.keys() for r in recs)
    assert (res.final_dir / "config.json").is_file()


def test_first_checkpoint_over_the_gate_is_published_and_a_failing_one_never(tiny_model_dir, tmp_path):
    from policy.registry import Registry

    def settings(gate, run):
        s = make_settings(tmp_path, mode="sync", steps=1, eval_every=0, max_new_tokens=8, out_dir=str(tmp_path / run))
        s.registry.url, s.registry.cache_dir = str(tmp_path / "registry"), str(tmp_path / "cache")
        s.eval.samples, s.eval.k, s.eval.gate_threshold = 1, [1], gate
        s.tasks.heldout_fraction = 0.02  # one held-out task per family: a quick evaluation
        return s

    failing = run_grpo(settings(1.0, "fail"), tiny_model_dir, progress=False)
    reg = Registry.from_settings(settings(1.0, "x").registry)
    assert failing.published_version is None and reg.list() == []
    passing = run_grpo(settings(0.0, "pass"), tiny_model_dir, progress=False)
    assert passing.published_step == 0  # the first evaluation (before any update) already passed
    info = reg.info(passing.published_version)
    assert info.stage == "offline" and "heldout_pass_at_1" in info.metrics
    assert reg.channel("production") == passing.published_version


def test_trainable_subset_is_the_only_thing_that_moves(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(make_settings(tmp_path, trainable="norm", lr=1e-2), tiny_model_dir)
    trajs = batch(trainer.tokenizer, [1.0, 0.0, 0.2, 0.9])
    fill_behaviour(trainer, trajs, lambda i, j: 0.0)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    assert trainer.train_on(trajs)["updated"]
    after = trainer.model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all("norm" in k for k in moved)
    assert trainer.n_trainable == sum(v.numel() for k, v in before.items() if "norm" in k)
    with pytest.raises(ValueError, match="matches no parameter"):
        GRPOTrainer(make_settings(tmp_path, trainable="no_such_weight"), tiny_model_dir)
