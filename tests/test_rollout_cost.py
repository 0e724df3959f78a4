"""Rollout cost accounting: the CPU a program costs in the sandbox (its own process and the fork
server's work for it) is reported with its verdict and summed by the reward function, because the
rollout loop's own CPU clock cannot see it and on a shared machine it competes with that loop."""

from __future__ import annotations

import pytest

from offline_rl.config import RewardSettings, SandboxSettings
from offline_rl.rewards import RewardFunction
from offline_rl.sandbox import Sandbox, SandboxPool
from offline_rl.tasks import Task
from offline_rl.tasks import TestCase as Case

# The program measures its own CPU clock, so what it burns does not depend on the machine's load.
BURN = """import time
def f(x):
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    return 3 * x + 1
"""
TASK = Task(task_id="t-cost", prompt="# f(0)=1 f(1)=4\ndef f(x): return ",
            tests=[Case([x], 3 * x + 1) for x in (-2, 5)])
ROOMY = SandboxSettings(wall_s=10.0, per_test_s=5.0, cpu_s=5)


@pytest.mark.parametrize("isolation", ["namespace", "inprocess"])
def test_a_run_reports_the_cpu_its_program_used(isolation):
    with Sandbox(ROOMY.model_copy(update={"isolation": isolation})) as sb:
        burn = sb.run(BURN, "f", TASK.tests)
        quick = sb.run("def f(x):\n    return 3 * x + 1\n", "f", TASK.tests)
    assert burn.all_passed and quick.all_passed
    assert burn.cpu_s >= 0.1  # two tests of 0.05 s each, in the child
    assert 0 < quick.cpu_s < burn.cpu_s


def test_the_reward_function_sums_sandbox_cpu_over_distinct_runs():
    with SandboxPool(ROOMY, size=2) as pool:
        fn = RewardFunction(pool, RewardSettings(judge={}))
        pending = fn.pending()
        pending.add(TASK, "x*3+1")
        rewards = pending.rewards([(TASK, "3*x+1", True), (TASK, "3*x+1", True), (TASK, "x+", True),
                                   (TASK, None, True)])
        assert [r.passed for r in rewards] == [True, True, False, False]
        ran = [r for r in pending.runs.values() if r.cpu_s > 0]
        # Two programs ran (the repeated one once); the syntax error and the empty one never reach it.
        assert len(ran) == 2
        assert fn.sandbox_cpu_s == pytest.approx(sum(r.cpu_s for r in ran))
        before = fn.sandbox_cpu_s
        fn.score_many([(TASK, "2*x+1", True)])
        assert fn.sandbox_cpu_s > before
