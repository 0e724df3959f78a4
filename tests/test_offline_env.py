"""The environment API in single-turn and tool mode, driven by scripted policies, and multi-turn
rollouts through the real sampler (token bookkeeping: observations masked out of the policy's tokens)."""

from __future__ import annotations

import pytest

from offline_rl.config import EnvSettings, RewardSettings, SandboxSettings
from offline_rl.env import OBS_PREFIX, TOOLS_LINE, TURN_PREFIX, CodingEnv
from offline_rl.rewards import RewardFunction
from offline_rl.rollout import TorchBackend, run_episodes
from offline_rl.sandbox import Sandbox
from offline_rl.splits import load_task_split
from offline_rl.tasks import Task, generate_tasks
from offline_rl.tasks import TestCase as Case
from rtrl.config import load_settings

TASK = Task(task_id="t", prompt="# f(0)=1 f(1)=4\ndef f(x): return ",
            tests=[Case([x], 3 * x + 1) for x in (-7, -3, 5)], examples=[Case([0], 1), Case([1], 4)])


@pytest.fixture(scope="module")
def sandbox():
    sb = Sandbox(SandboxSettings())
    yield sb
    sb.close()


def test_single_turn(sandbox):
    env = CodingEnv(sandbox, EnvSettings(mode="single"))
    st = env.reset(TASK)
    assert st.context == TASK.prompt
    assert env.step(st, "3*x+1") == ""
    assert st.done and st.submission == "3*x+1"
    assert env.score(st).all_passed
    with pytest.raises(RuntimeError):
        env.step(st, "x")


def test_tool_mode_run_examples_then_submit(sandbox):
    env = CodingEnv(sandbox, EnvSettings(mode="multi", max_turns=4))
    st = env.reset(TASK)
    assert st.context == "# f(0)=1 f(1)=4\n" + TOOLS_LINE + TURN_PREFIX
    obs = env.step(st, "run_examples x+1")
    # Visible examples only: the hidden inputs (-7, -3, 5) never appear in what the policy sees.
    assert obs.startswith(OBS_PREFIX) and "f(0)=1 ok" in obs and "f(1)=2 want 4" in obs
    assert "-7" not in obs and not st.done
    assert st.context.endswith(obs)
    obs = env.step(st, "run_examples 3*x+1")
    assert "f(0)=1 ok f(1)=4 ok" in obs
    env.step(st, "submit 3*x+1")
    assert st.done and st.submission == "3*x+1" and env.score(st).all_passed
    assert [t.tool for t in st.turns] == ["run_examples", "run_examples", "submit"]


def test_tool_mode_max_turns_without_submit_scores_zero(sandbox):
    env = CodingEnv(sandbox, EnvSettings(mode="multi", max_turns=2))
    st = env.reset(TASK)
    env.step(st, "run_examples 3*x+1")
    env.step(st, "run_examples 3*x+1")
    assert st.done and st.submission is None
    fn = RewardFunction(sandbox, RewardSettings())
    assert fn.score(TASK, st.submission).total == 0.0
    st = env.reset(TASK)
    assert "syntax error" in env.step(st, "run_examples 3*")
    env.step(st, "3*x+1")  # a bare expression is a submit
    assert st.done and st.submission == "3*x+1"


def test_generated_split_never_overlaps():
    split = generate_tasks(0)
    train = {t.reference for t in split.train}
    assert not train & {t.reference for t in split.heldout}
    assert load_task_split(load_settings().tasks).heldout[0].task_id == split.heldout[0].task_id


def test_multi_turn_rollout_masks_observations(tiny_model_dir, sandbox):
    from policy.loading import load_policy
    from policy.logprobs import sequence_logprobs

    policy = load_policy(tiny_model_dir)
    env = CodingEnv(sandbox, EnvSettings(mode="multi", max_turns=3))
    backend = TorchBackend(policy.model, policy.tokenizer)
    tasks = generate_tasks(0).train[:2]
    trajs = run_episodes(backend, policy.tokenizer, env, tasks, group_size=2, temperature=1.0, max_new_tokens=12,
                         seed=3, reward_fn=RewardFunction(sandbox, RewardSettings()))
    assert len(trajs) == 4
    for t in trajs:
        assert 1 <= t.turns <= 3
        assert len(t.completion_ids) == len(t.action_mask) == len(t.behaviour_logprobs)
        assert sum(t.action_mask) > 0
        if t.turns > 1:
            assert not all(t.action_mask)  # observation tokens are in the context, not the policy's
    # The sampler's per-token log-probs on the policy's own tokens match a teacher-forced recompute
    # over the whole multi-turn context.
    import torch

    tl = sequence_logprobs(policy.model, [t.prompt_ids for t in trajs], [t.completion_ids for t in trajs],
                           pad_token_id=policy.tokenizer.pad_token_id)
    for i, t in enumerate(trajs):
        m = torch.tensor(t.action_mask)
        rec = tl.logprobs[i, :len(t.action_mask)][m]
        beh = torch.tensor(t.behaviour_logprobs)[m]
        assert torch.allclose(rec, beh, atol=1e-4)
