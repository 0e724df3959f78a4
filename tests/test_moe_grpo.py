"""GRPO on the tiny mixture-of-experts model: two-turn trajectories (the second turn continuing from the
first one's KV cache, as multi-turn rollouts do) carry their routes, each position with the routes of
the turn that computed it; the trainer replays them, and every batch logs the train/inference gap with
routers free and with routes replayed, as the lifecycle report shows."""

from __future__ import annotations

from offline_rl.grpo import GRPOTrainer
from offline_rl.rollout import TorchBackend, Trajectory
from policy.routes import extend
from policy.sampling import SamplingParams
from rtrl.report import MISMATCH_COLUMNS, ReportData, summarise_mismatch, write_report
from tests.test_grpo import TASK, make_settings


def _two_turn_batch(trainer: GRPOTrainer) -> list[Trajectory]:
    """Two groups of two episodes: a sampled turn, a tool observation, a second sampled turn."""
    tok = trainer.tokenizer
    backend = TorchBackend(trainer.model, tok)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in (TASK.prompt, "def f(x): return x")]
    trajs = [Trajectory(task=TASK, prompt_ids=list(p)) for p in prompts for _ in range(2)]
    obs = tok("\n>>> f(0)=1 ok\n", add_special_tokens=False)["input_ids"]
    caches: list = [None] * len(trajs)
    for turn in range(2):
        params = [SamplingParams(max_new_tokens=6, seed=10 * turn + i) for i in range(len(trajs))]
        rows = [t.prompt_ids + t.completion_ids for t in trajs]
        for t, s in zip(trajs, backend.sample(rows, params, caches=caches), strict=True):
            t.completion_ids += s.token_ids
            t.routes = extend(t.routes, s.routes)
            t.action_mask += [True] * len(s.token_ids)
            t.behaviour_logprobs += s.logprobs
            if turn == 0:
                t.completion_ids += obs
                t.action_mask += [False] * len(obs)
                t.behaviour_logprobs += [0.0] * len(obs)
    for t, r in zip(trajs, [1.0, 0.0, 0.2, 0.7], strict=True):
        t.reward = r
    return trajs


def test_grpo_on_moe_replays_the_sampled_routes_of_every_turn_and_the_report_shows_the_gap(tiny_moe_dir, tmp_path):
    trainer = GRPOTrainer(make_settings(tmp_path, lr=1e-3, trainable="."), tiny_moe_dir)
    trainer.model.eval()
    trajs = _two_turn_batch(trainer)
    for t in trajs:
        assert t.routes.positions == len(t.prompt_ids) + len(t.completion_ids) - 1
    trainer.model.train()
    m = trainer.train_on(trajs)
    # The trainer's weights sampled the batch: the replayed recompute is the sampler's, turn 2 included
    # (it re-read turn 1's positions; only a router at a near-tie could have chosen differently there).
    assert m["updated"] and m["router_replay"] == 1.0
    assert m["mismatch_abs_logp"] < 1e-4 and m["router_kl_k3_replay"] < 1e-6 and m["route_disagreement"] < 0.01
    assert {"router_kl_k3_off", "router_extreme_frac_off", "router_extreme_frac_replay"} <= set(m)
    data = ReportData(gate=0.5, mismatch={"offline GRPO": summarise_mismatch([m, {"mismatch_kl_k3": 0.5}])})
    assert set(data.mismatch["offline GRPO"]) == set(MISMATCH_COLUMNS)
    assert data.mismatch["offline GRPO"]["mismatch_kl_k3"] == (m["mismatch_kl_k3"] + 0.5) / 2
    page = write_report(data, tmp_path / "report").read_text()
    assert "k3 KL, routes replayed" in page and "routes differ" in page
