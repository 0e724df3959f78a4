"""Self-summarisation (env.context_budget): the summary turn and the fresh context, a summary cut at its
cap or empty, a budget too small for the task, per-segment training rows credited with the episode's
advantage (summary tokens trained, observations not), segments over the remote wire, and
`rtrl bench summarise --quick` end to end."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from offline_rl.agent_env import TOOLS, RepoEnv, TrustedTests, header
from offline_rl.evaluate import GridResult, summary_metrics
from offline_rl.grpo import GRPOTrainer
from offline_rl.remote import decode_batch, encode_batch
from offline_rl.repo_tasks import generate_repo_tasks
from offline_rl.rollout import BudgetError, Segment, Trajectory, min_budget, play_episodes, summary_reserve
from offline_rl.workers import RolloutBatch
from policy.sampling import FINISH_STOP, Sample
from policy.summary import SUMMARY_REQUEST
from rtrl.config import load_settings


class Scripted:
    """A backend that types fixed command lines in turn and a fixed summary after the request."""

    name, version = "scripted", 0

    def __init__(self, tokenizer, commands: list[str], summary: str):
        self.tok, self.commands, self.summary = tokenizer, commands, summary

    def sample(self, prompt_ids, params, on_finish=None, caches=None):
        out = []
        for ids, p in zip(prompt_ids, params, strict=True):
            ctx = self.tok.decode(ids)
            if ctx.endswith(SUMMARY_REQUEST):
                text = self.summary
            else:
                text = self.commands[(ctx.count("\n$ ") - 1) % len(self.commands)]
            token_ids = self.tok(text + "\n", add_special_tokens=False)["input_ids"]
            finish = FINISH_STOP
            if len(token_ids) > p.max_new_tokens:
                token_ids, finish = token_ids[:p.max_new_tokens], "length"
            lps = [-0.5] * len(token_ids)
            out.append(Sample(list(ids), token_ids, self.tok.decode(token_ids).split("\n")[0], finish, lps, lps))
        return out

    def load_weights(self, state_dict, version):
        # A scripted engine: these tests never publish weights to it, and a call would be a bug.
        raise NotImplementedError("the scripted test engine takes no weights")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def task():
    return generate_repo_tasks(seed=0, families=("trace",), heldout_per_family=1).heldout[0]


def _env(tokenizer, task, summary_max_tokens: int = 24, slack: int = 40) -> RepoEnv:
    """A budget just above the smallest the task allows: a summary every few turns."""
    env = RepoEnv(TrustedTests(), max_turns=8, summary_max_tokens=summary_max_tokens)
    prompt = len(tokenizer(header(task), add_special_tokens=False)["input_ids"])
    env.context_budget = min_budget(tokenizer, env, prompt, 12) + slack
    return env


def _notes(task) -> str:
    return task.issue.rsplit(" ", 1)[1]


def test_summary_turn_opens_a_fresh_context(tokenizer, task):
    fact = task.metadata["fact"]
    env = _env(tokenizer, task)
    backend = Scripted(tokenizer, ["ls", "test"], f"rule {fact}")
    trajs, _ = play_episodes(backend, tokenizer, env, [task], 1, 1.0, 12)
    tr = trajs[0]
    assert tr.segments and len(tr.summaries) == len(tr.segments)
    rows = tr.rows()
    reserve, carries = summary_reserve(tokenizer, env), 0
    for k, seg in enumerate(tr.segments):
        n = len(seg.completion_ids)
        assert n == len(seg.action_mask) == len(seg.behaviour_logprobs) == len(seg.summary_mask)
        first = seg.summary_mask.index(True)
        assert all(seg.summary_mask[first:]) and all(seg.action_mask[first:])  # the summary ends the context
        request = tokenizer.decode(seg.completion_ids[:first])
        assert request.endswith(SUMMARY_REQUEST)
        r = len(tokenizer(SUMMARY_REQUEST, add_special_tokens=False)["input_ids"])
        assert not any(seg.action_mask[first - r:first])  # the request is the environment's: no gradient
        assert all(lp == 0.0 for lp, m in zip(seg.behaviour_logprobs, seg.action_mask, strict=True) if not m)
        assert tr.summaries[k].text == f"rule {fact}" and not tr.summaries[k].cut
        assert tr.summaries[k].replaced_tokens == len(seg.prompt_ids) + first - r
        fresh = tokenizer.decode(rows[k + 1].prompt_ids)
        # The task header, the summary, the last command with its output, the prompt; the carried output
        # is left out when it would not leave room for a turn and the next summary.
        bare = f"# issue: {task.issue}\n# tools: {TOOLS}\n# summary: rule {fact}\n$ "
        last = tokenizer.decode(seg.completion_ids[:first - r]).rsplit("\n$ ", 2)[-2]
        carried = f"{bare}{last}\n$ "
        fits = len(tokenizer(carried, add_special_tokens=False)["input_ids"]) + 12 + reserve <= env.context_budget
        assert fresh == (carried if fits else bare)
        carries += fits
    assert carries  # short outputs (ls, test) were carried
    assert not any(rows[-1].summary_mask)
    m = summary_metrics(trajs)
    assert m["segments_mean"] == len(rows) and m["fact_kept"] == 1.0 and m["summaries_cut"] == 0.0
    assert m["success_by_summaries"] == {str(len(tr.segments)): 0.0}


def test_summary_cut_at_its_cap_and_empty_summary(tokenizer, task):
    env = _env(tokenizer, task, summary_max_tokens=6)
    trajs, _ = play_episodes(Scripted(tokenizer, ["ls"], "x " * 60), tokenizer, env, [task], 1, 1.0, 12)
    tr = trajs[0]
    assert tr.summaries and all(s.cut and s.tokens == 6 for s in tr.summaries)
    assert not tr.well_formed  # flagged: a turn that overran its budget loses the format bonus
    assert summary_metrics(trajs)["summaries_cut"] == 1.0

    env = _env(tokenizer, task)
    trajs, _ = play_episodes(Scripted(tokenizer, ["ls"], ""), tokenizer, env, [task], 1, 1.0, 12)
    tr = trajs[0]
    assert tr.summaries and all(s.empty and s.text == "" for s in tr.summaries)
    for seg in tr.rows()[1:]:  # nothing carried over: the fresh context is the task header alone
        assert tokenizer.decode(seg.prompt_ids) == header(task)
    assert tr.turns == 8 + len(tr.summaries) and not tr.truncated  # the episode went on to max_turns
    assert summary_metrics(trajs)["summaries_empty"] == 1.0


def test_budget_smaller_than_the_task_is_refused(tokenizer, task):
    env = RepoEnv(TrustedTests(), context_budget=40, summary_max_tokens=24)
    prompt = len(tokenizer(header(task), add_special_tokens=False)["input_ids"])
    with pytest.raises(BudgetError, match=rf"context_budget=40 tokens .* prompt alone is {prompt} tokens"):
        play_episodes(Scripted(tokenizer, ["ls"], "s"), tokenizer, env, [task], 2, 1.0, 12)


def _segmented_batch(tokenizer):
    """Group of two: episode 0 (reward 1) in two contexts, the first ending in a summary; episode 1
    (reward 0) in one. Observation tokens are masked out."""
    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    task = generate_repo_tasks(seed=0, families=("trace",), heldout_per_family=1).heldout[0]
    act, obs, req, summ = ids("cat a.py\n"), ids("1 x = 3\n$ "), ids(SUMMARY_REQUEST), ids("x is 3\n")
    comp = act + obs + req + summ
    seg = Segment(ids(header(task)), comp, [True] * len(act) + [False] * (len(obs) + len(req)) + [True] * len(summ),
                  [0.0] * len(comp), [False] * (len(act) + len(obs) + len(req)) + [True] * len(summ))
    last = act + obs + ids("submit\n")
    mask = [True] * len(act) + [False] * len(obs) + [True] * (len(last) - len(act) - len(obs))
    a = Trajectory(task=task, prompt_ids=ids(header(task) + "# summary: x is 3\n$ "), completion_ids=list(last),
                   action_mask=list(mask), behaviour_logprobs=[0.0] * len(last), segments=[seg], reward=1.0)
    b = Trajectory(task=task, prompt_ids=ids(header(task)), completion_ids=list(last), action_mask=list(mask),
                   behaviour_logprobs=[0.0] * len(last), reward=0.0)
    return [a, b], (sum(seg.action_mask), sum(seg.summary_mask), sum(mask))


@pytest.mark.parametrize("weight", [1.0, 3.0])
def test_every_segment_gets_the_episode_advantage(tiny_model_dir, tmp_path, tokenizer, weight):
    from policy.logprobs import sequence_logprobs

    s = load_settings()
    s.grpo.out_dir, s.grpo.group_size, s.grpo.warmup_steps = str(tmp_path / "run"), 2, 0
    s.grpo.loss_level, s.grpo.summary_token_weight, s.grpo.lr = "token", weight, 1e-3
    trainer = GRPOTrainer(s, tiny_model_dir)
    trajs, (seg_policy, seg_summary, last_policy) = _segmented_batch(tokenizer)
    rows = [r for t in trajs for r in t.rows()]
    tl = sequence_logprobs(trainer.model, [r.prompt_ids for r in rows], [r.completion_ids for r in rows],
                           pad_token_id=trainer.tokenizer.pad_token_id)
    for i, r in enumerate(rows):  # behaviour = the trainer's recompute: ratio 1, importance weight 1
        r.behaviour_logprobs[:] = [float(tl.logprobs[i, j]) if m else 0.0 for j, m in enumerate(r.action_mask)]
    m = trainer.train_on(trajs)
    assert m["trained_completions"] == 3 and m["summary_tokens"] == seg_summary
    # A = (+0.5, -0.5); both of episode 0's contexts carry +0.5, summary tokens weighted, observation
    # tokens absent: loss = -(0.5·(seg + (w-1)·summary + last) - 0.5·last) / (seg + 2·last).
    n_tok = seg_policy + 2 * last_policy
    expected = -(0.5 * (seg_policy + (weight - 1) * seg_summary + last_policy) - 0.5 * last_policy) / n_tok
    assert m["policy_tokens"] == n_tok
    assert m["loss"] == pytest.approx(expected, abs=1e-5)


def test_segments_cross_the_remote_wire(tokenizer):
    trajs, _ = _segmented_batch(tokenizer)
    batch = RolloutBatch(version=3, trajectories=trajs, gen_s=0.1)
    _, _, back = decode_batch(encode_batch(batch, "abc", "w"), 1 << 24)
    assert back.trajectories[0].segments == trajs[0].segments
    assert [len(t.rows()) for t in back.trajectories] == [2, 1]


def test_bench_summarise_quick(tiny_model_dir, capsys):
    from benchmarks.summarise import run

    settings = load_settings()
    out = run(settings, quick=True, log=lambda msg: None, from_dir=str(tiny_model_dir))
    json.dumps(out)
    for key in ("budget_tokens", "trained", "untrained", "truncation", "no_budget", "summary_tokens_mean",
                "compression_ratio", "segments_mean"):
        assert key in out
    for key in ("trained", "untrained", "truncation", "no_budget"):
        assert 0.0 <= out[key] <= 1.0
    assert out["segments_mean"] > 1  # the budget made the episodes summarise
    assert out["truncated_share"]["truncation"] > 0  # and without summaries they were cut off
    assert set(out["gain_vs_control"]) == {"gain", "ci95", "tasks"}  # the matched-compute control ran
    assert out["start_midtrain_steps"] is None  # the start model given was not mid-trained by rtrl


def test_bench_summarise_start_model_is_mid_trained_on_the_bench_corpus(tmp_path, monkeypatch):
    import benchmarks.summarise as bench

    seen = []

    def spy(settings, **kw):
        seen.append((settings.midtrain.families, settings.midtrain.rule_drill, settings.midtrain.demo_habits))
        return real(settings, **kw)

    real = bench.run_midtrain
    monkeypatch.setattr(bench, "run_midtrain", spy)
    monkeypatch.setattr(bench, "run_grpo", lambda *a, **kw: pytest.fail("no RL before the budgeted run"))
    s = bench._configure(load_settings(), True, tmp_path)
    msgs: list[str] = []
    start = bench.start_model(s, tmp_path, True, msgs.append)
    assert (start / "config.json").is_file() and any(m.startswith("midtrain:") for m in msgs), msgs
    assert seen == [(bench.CORPUS_FAMILIES, bench.RULE_DRILL, bench.DIRECT_HABITS)]
    assert bench.midtrain_record(start)["steps"] == s.midtrain.steps  # what the result line records
    assert bench._configure(load_settings(), False, tmp_path).midtrain.steps == bench.MIDTRAIN_STEPS


def test_bench_summarise_stops_when_the_start_model_cannot_do_the_family(tiny_model_dir, tmp_path, monkeypatch):
    """A start model under START_FLOOR with its whole context: the bench stops before GRPO, with the reason."""
    import benchmarks.summarise as bench

    weak = GridResult({t: SimpleNamespace(pass_at_1=0.01, summaries={}) for t in (1.0, 0.0)})
    arms = []
    monkeypatch.setattr(bench, "_grid", lambda s, path, tasks, sandbox, temps, *, budget, summarise:
                        arms.append((budget, summarise)) or weak)
    monkeypatch.setattr(bench, "run_grpo", lambda *a, **kw: pytest.fail("GRPO ran on a start model under the floor"))
    settings = load_settings(var_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match=r"solves 0\.010 .* under 0\.2"):
        bench.run(settings, log=lambda msg: None, from_dir=str(tiny_model_dir))
    assert arms == [(0, False)]  # only the no-budget arm was measured


def test_moe_routes_per_segment_are_replayed(tiny_moe_dir, tmp_path):
    """Each context keeps the routes its sampler chose; the trainer replays them row by row."""
    from offline_rl.rollout import TorchBackend
    from policy.loading import load_policy

    policy = load_policy(tiny_moe_dir)
    tok = policy.tokenizer
    task = generate_repo_tasks(seed=0, families=("trace",), heldout_per_family=1).heldout[0]
    env = RepoEnv(TrustedTests(), max_turns=5, summary_max_tokens=8)
    env.context_budget = min_budget(tok, env, len(tok(header(task), add_special_tokens=False)["input_ids"]), 10) + 30
    trajs, _ = play_episodes(TorchBackend(policy.model, tok), tok, env, [task], 2, 1.0, 10, seed=3)
    assert all(t.segments for t in trajs)
    for t in trajs:
        for row in t.rows():  # every consumed position of the context, nothing of the one before
            assert row.routes.ids.shape[0] == len(row.prompt_ids) + len(row.completion_ids) - 1
    trajs[0].reward = 1.0
    s = load_settings()
    s.grpo.out_dir, s.grpo.group_size = str(tmp_path / "run"), 2
    m = GRPOTrainer(s, tiny_moe_dir).train_on(trajs)
    assert m["updated"] and m["trained_completions"] == sum(len(t.rows()) for t in trajs)
    assert m["tis_mean"] == pytest.approx(1.0, abs=1e-3)  # replayed: the trainer recomputes what was sampled
