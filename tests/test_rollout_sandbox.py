"""The sandbox paths rollouts take since programs are compiled before the fork (by the parent): a
syntax error is a verdict without a child, a large program is compiled by the child under its
limits, and compiler warnings cannot block the zygote."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from offline_rl.config import SandboxSettings
from offline_rl.sandbox import COMPILE_BEFORE_FORK_MAX, Sandbox
from offline_rl.sandbox_zygote import COMPILE_IN_ZYGOTE_MAX
from offline_rl.tasks import TestCase as Case

TESTS = [Case([x], 3 * x + 1) for x in (-7, 0, 5)]
SETTINGS = SandboxSettings(wall_s=5.0, per_test_s=2.0, cpu_s=5)
# Padding that is still a valid program, to push a source over the zygote's compile limit.
PAD = "".join(f"_unused_{i} = {i}\n" for i in range(COMPILE_IN_ZYGOTE_MAX // 10))


@pytest.fixture(scope="module", params=["namespace", "inprocess"])
def sandbox(request):
    with Sandbox(SETTINGS.model_copy(update={"isolation": request.param})) as sb:
        yield sb


def test_a_syntax_error_is_a_verdict_without_a_child(sandbox):
    run = sandbox.run("def f(x):\n    return 3*x+\n", "f", TESTS)
    assert not run.compiled and run.error.startswith("compile_error: SyntaxError")
    assert [t.status for t in run.tests] == ["error"] * 3
    assert run.cpu_s == 0.0  # compiled in the parent: neither a child nor the zygote did anything


def test_a_large_program_is_compiled_by_the_child(sandbox):
    big = PAD + "def f(x):\n    return 3*x+1\n"
    assert len(big) > COMPILE_IN_ZYGOTE_MAX == COMPILE_BEFORE_FORK_MAX
    assert sandbox.run(big, "f", TESTS).all_passed
    broken = sandbox.run(PAD + "def f(x):\n    return 3*x+\n", "f", TESTS)
    assert not broken.compiled and broken.error.startswith("compile_error: SyntaxError")
    # Small or large, the same program gets the same verdict.
    assert sandbox.run("def f(x):\n    return 3*x+1\n", "f", TESTS).all_passed


@pytest.mark.parametrize("isolation", ["namespace", "inprocess"])
def test_compiler_warnings_cannot_block_the_zygote(isolation):
    # Each line draws a SyntaxWarning ("is" with a literal): ~70 KB of warnings per compile, more
    # than a pipe holds, which would stall a zygote writing them to a stderr nobody reads. Run in a
    # process of its own, so that a stalled zygote fails the test instead of hanging it.
    lines = "".join(f"    _ = x is {i}\n" for i in range(900))
    code = "def f(x):\n" + lines + "    return 3*x+1\n"
    assert len(code) <= COMPILE_IN_ZYGOTE_MAX
    script = f"""
from offline_rl.config import SandboxSettings
from offline_rl.sandbox import Sandbox
from offline_rl.tasks import TestCase
with Sandbox(SandboxSettings(isolation={isolation!r}, wall_s=5.0, per_test_s=2.0, cpu_s=5)) as sb:
    print(all(sb.run({code!r}, "f", [TestCase([x], 3 * x + 1) for x in (-7, 0, 5)]).all_passed for _ in range(3)))
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the zygote stalled on compiler warnings")
    assert proc.returncode == 0, err[-2000:]
    assert out.strip() == "True"
