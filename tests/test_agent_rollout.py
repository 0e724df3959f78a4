"""Multi-turn agent rollouts through the real sampler: the KV cache kept between turns changes nothing,
the trajectory's mask covers the policy's own tokens only, and tool output gets no gradient."""

from __future__ import annotations

import pytest
import torch

from offline_rl.agent_env import RepoEnv, SandboxTests
from offline_rl.repo_tasks import generate_repo_tasks
from offline_rl.rollout import TorchBackend, play_episodes
from offline_rl.sandbox import SandboxPool
from policy.logprobs import sequence_logprobs
from policy.losses import grpo_policy_loss


class _NoCache(TorchBackend):
    """The same sampler re-running every earlier turn (the reference for the cached path)."""

    def sample(self, prompt_ids, params, on_finish=None, caches=None):
        return super().sample(prompt_ids, params, on_finish=on_finish, caches=None)


@pytest.fixture(scope="module")
def episodes(tiny_model_dir):
    from policy.loading import load_policy

    policy = load_policy(tiny_model_dir)
    tasks = generate_repo_tasks(seed=0, heldout_per_family=1).heldout
    with SandboxPool(size=2) as pool:
        env = RepoEnv(SandboxTests(pool), max_turns=4)
        cached, _ = play_episodes(TorchBackend(policy.model, policy.tokenizer), policy.tokenizer, env, tasks, 2,
                                  1.0, 10, seed=5)
        plain, _ = play_episodes(_NoCache(policy.model, policy.tokenizer), policy.tokenizer, env, tasks, 2,
                                 1.0, 10, seed=5)
    return policy, cached, plain


def test_kv_cache_across_turns_gives_the_same_episodes(episodes):
    _, cached, plain = episodes
    assert all(t.turns > 1 for t in cached)  # several turns each: the cache was used
    for a, b in zip(cached, plain, strict=True):
        assert a.completion_ids == b.completion_ids and a.action_mask == b.action_mask
        assert max(abs(x - y) for x, y in zip(a.behaviour_logprobs, b.behaviour_logprobs, strict=True)) < 1e-4


def test_trajectory_mask_and_versions(episodes):
    policy, cached, _ = episodes
    tok = policy.tokenizer
    for t in cached:
        assert len(t.completion_ids) == len(t.action_mask) == len(t.behaviour_logprobs)
        assert len(t.turn_versions) == t.turns
        obs = [tid for tid, m in zip(t.completion_ids, t.action_mask, strict=True) if not m]
        assert obs and all(lp == 0.0 for lp, m in zip(t.behaviour_logprobs, t.action_mask, strict=True) if not m)
        # The masked-out tokens are the environment's text: its prompts and tool output.
        assert "$ " in tok.decode(obs)


def test_tool_output_gets_no_gradient(episodes):
    policy, cached, _ = episodes
    model = policy.model.train()
    trajs = cached[:4]
    tl = sequence_logprobs(model, [t.prompt_ids for t in trajs], [t.completion_ids for t in trajs], grad=True,
                           pad_token_id=policy.tokenizer.pad_token_id)
    logp = tl.logprobs
    logp.retain_grad()
    width = logp.shape[1]
    mask = torch.zeros_like(logp, dtype=torch.bool)
    for i, t in enumerate(trajs):
        mask[i, :len(t.action_mask)] = torch.tensor(t.action_mask)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    loss, _ = grpo_policy_loss(logp, logp.detach(), adv, mask)
    loss.backward()
    grad = logp.grad
    assert grad.shape[1] == width
    assert torch.all(grad[~mask] == 0)  # tool output and padding: exactly zero
    assert torch.count_nonzero(grad[mask]) == int(mask.sum())  # every policy token gets a gradient
    model.zero_grad(set_to_none=True)
    model.eval()
