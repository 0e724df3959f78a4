"""Direction of learning on a reduced budget: GRPO raises the share of hidden tests passed.

Four max/min tasks (dense partial credit: ``max(x,4)`` and ``max(x,5)`` agree on most inputs),
evaluated before and after on the same prompts. Held-out pass@1 over the gate with the default
settings is shown by the demo test (`rtrl demo --fast`: mid-training stops below the gate, GRPO
publishes the first evaluation at or over it) and by `rtrl midtrain` then `rtrl grpo`.

The same run on the mixture-of-experts variant (same mid-training, same assertions) replays the
sampler's routes in every training pass.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from offline_rl.grpo import run_grpo
from offline_rl.presets import apply_preset
from offline_rl.tasks import generate_tasks, write_tasks_jsonl
from rtrl.config import load_settings
from tests.offline_fixtures import warm_model_dir, warm_moe_dir  # noqa: F401

# Peak lr per model. The MoE model needs half the dense one: at 5e-4 a step flips ~4.5% of its
# (position, layer) expert choices and moves the policy ~14x as far as a dense step (median k3 KL on the
# batch 1.25 against 0.09, seed 0); 3 of 8 seeds fell for several steps to programs that pass no test
# and 2 failed the assertions below (seed 4 never recovered). At 2.5e-4 its steps are as small as the
# dense model's at that lr (median KL 0.015 and 0.016) and 8 of 8 seeds passed.
LR = {"dense": 5e-4, "moe": 2.5e-4}


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_grpo_raises_the_hidden_test_pass_rate(model, request, tmp_path):
    model_dir = request.getfixturevalue("warm_model_dir" if model == "dense" else "warm_moe_dir")
    pick = [t for t in generate_tasks(0).train if t.bucket in ("max", "min")][:4]
    tasks = [dataclasses.replace(t, metadata={**t.metadata, "split": "train"}) for t in pick]
    tasks += [dataclasses.replace(t, task_id="eval-" + t.task_id, metadata={**t.metadata, "split": "heldout"})
              for t in pick]
    write_tasks_jsonl(tasks, tmp_path / "tasks.jsonl")
    s = apply_preset(load_settings(), "functions")
    s.tasks.jsonl = str(tmp_path / "tasks.jsonl")
    g = s.grpo
    g.out_dir, g.mode, g.steps, g.prompts_per_step, g.group_size = str(tmp_path / "run"), "sync", 24, 4, 8
    g.lr, g.eval_every, g.warmup_steps, g.max_new_tokens, g.publish = LR[model], 0, 0, 10, False
    # All parameters: on fixed prompts they learn fastest (the default is tuned for fresh ones). At 2e-3
    # the run was at the edge of collapse and passed or failed with the thread count; 5e-4 measured
    # hidden-test share 0.10 -> 0.49 over the run and 0.03 -> 0.55 on the evaluation.
    g.trainable = "."
    s.eval.samples, s.eval.k = 16, [1]
    res = run_grpo(s, model_dir, progress=False, resume=False)
    recs = [json.loads(line) for line in res.metrics_path.read_text().splitlines()]
    first = sum(r["reward_tests"] for r in recs[:4]) / 4
    last = sum(r["reward_tests"] for r in recs[-4:]) / 4
    assert last > first + 0.1, (first, last)
    assert res.after.mean_test_fraction > res.before.mean_test_fraction + 0.1, (res.before, res.after)
    # Partial credit rises far more than full passes on these tasks; full passes must not fall by more
    # than one sample of the 64 (4 tasks x 16): 1/64 either way is sampling noise at this size.
    assert res.after.pass_at_1 >= res.before.pass_at_1 - 1 / 64, (res.before.pass_at_1, res.after.pass_at_1)
    if model == "moe":
        # Every update replayed the sampler's routes (the route metrics are logged only for batches that
        # carry routes), and they were the routes of the positions trained on: with the sampler's own
        # weights (sync mode, staleness 0) the trainer's free routers agree with them but for near-ties.
        updated = [r for r in recs if r["updated"]]
        assert updated and all(r.get("router_replay") == 1.0 for r in updated), updated[0]
        assert max(r["route_disagreement"] for r in updated) < 0.01
