"""Direction of learning on agent episodes, on a reduced budget: GRPO teaches a habit that imitation
and a lower sampling temperature do not give.

The tiny model imitates a demonstrator on four repository ``fix`` tasks. The demonstrator's most
common habit is the bad one: it edits before running the tests (a blind edit, which on these tasks
writes a wrong line) more often than not, and seldom verifies. Imitation learns that mixture, and a
lower temperature sharpens it towards the common choice. GRPO on the same four tasks must lift
success at its best temperature over the start's best temperature, and the agent must run the tests
before its first edit more often: the behaviour that explains the gain.

Training and evaluation use the same four tasks (a direction test, as test_grpo_direction): whether
the gain carries to held-out repositories, against a matched-compute control, is `rtrl bench
learning`'s question, which does not fit a CI budget.
"""

from __future__ import annotations

from offline_rl.demos import DemoHabits
from offline_rl.grpo import run_grpo
from offline_rl.splits import load_split
from rtrl.config import load_settings
from tests.offline_fixtures import before_and_after, imitate, train_and_evaluate_on

TEMPERATURES = [1.0, 0.5, 0.25]
BAD_HABITS = DemoHabits(blind_edit=0.7, verify=0.3, retry=0.3)


def test_grpo_lifts_agent_success_beyond_the_best_temperature(tiny_model_dir, tmp_path):
    s = load_settings()
    s.var_dir, s.env.kind = str(tmp_path / "var"), "repo"
    tasks = [t for t in load_split(s.tasks, s.env).train if t.family == "fix"][:4]
    start = imitate(s, tiny_model_dir, tmp_path, tasks, BAD_HABITS)
    train_and_evaluate_on(s, tasks, tmp_path)
    res = run_grpo(s, start, progress=False, resume=False, evaluate_before=False, evaluate_after=False)
    grids = before_and_after(s, start, res.final_dir, TEMPERATURES)
    before, after = grids["before"].best, grids["after"].best
    report = {n: (g.best_t, g.to_dict()["pass_at_1"]) for n, g in grids.items()}
    assert after.pass_at_1 >= before.pass_at_1 + 0.15, report
    assert after.behaviour["test_before_edit"] >= before.behaviour["test_before_edit"] + 0.2, \
        (before.behaviour, after.behaviour)
