"""Pipelined runs: a zygote gets programs while earlier ones are still running, and the parent reads
the replies only when a result is asked for; order, recovery and back-pressure."""

from __future__ import annotations

import threading
import time

import pytest

from offline_rl.config import SandboxSettings
from offline_rl.sandbox import Sandbox, SandboxError, SandboxPool
from offline_rl.tasks import TestCase as Case

SETTINGS = SandboxSettings(wall_s=5.0, per_test_s=2.0, cpu_s=5)
TESTS = [Case([x], 3 * x + 1) for x in (-2, 0, 7)]


def program(k: int) -> str:
    """Passes TESTS only for k == 0; otherwise off by k (so each reply is told apart)."""
    return f"def f(x):\n    return 3*x+1+{k}\n"


def test_replies_settle_in_order_whatever_order_they_are_read_in():
    with Sandbox(SETTINGS) as sb:
        runs = [sb.submit(program(k), "f", TESTS) for k in range(40)]
        assert sb.in_flight == 40
        for k in reversed(range(40)):
            assert runs[k].result().values == [3 * x + 1 + k for x in (-2, 0, 7)]
        assert sb.in_flight == 0


def test_a_zygote_killed_with_runs_in_flight_gets_them_again():
    with Sandbox(SETTINGS) as sb:
        runs = [sb.submit(program(k), "f", TESTS) for k in range(5)]
        runs[0].result()
        sb._proc.kill()
        sb._proc.wait()
        runs += [sb.submit(program(k), "f", TESTS) for k in range(5, 8)]
        assert [r.result().values[0] for r in runs] == [-5 + k for k in range(8)]


def test_big_requests_and_big_replies_in_flight_do_not_deadlock():
    # Requests that fill the pipe to the zygote while its replies fill the pipe back: the parent
    # must take in replies while it waits to write, or both sides wait forever.
    pad = "#" + "x" * 199 + "\n"
    big_program = pad * 1500 + ("import os\nos.write(3, (b'{\"noise\": 1}' + b' ' * 400 + b'\\n') * 800)\n"
                                "def f(x):\n    return 3*x+1\n")
    results: list = []

    def go() -> None:
        with Sandbox(SETTINGS) as sb:
            runs = [sb.submit(big_program, "f", TESTS) for _ in range(12)]
            results.extend(r.result() for r in runs)

    worker = threading.Thread(target=go, daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "parent and zygote deadlocked on full pipes"
    assert len(results) == 12 and all(r.all_passed for r in results)


def test_closing_with_runs_in_flight_fails_them_instead_of_hanging():
    sb = Sandbox(SETTINGS)
    run = sb.submit("import time\ndef f(x):\n    time.sleep(3)\n    return 0\n", "f", TESTS)
    sb.close()
    with pytest.raises(SandboxError):
        run.result()
    with pytest.raises(SandboxError):
        sb.submit(program(0), "f", TESTS)


def test_the_pool_sends_each_run_to_the_least_busy_zygote():
    with SandboxPool(SETTINGS, size=3) as pool:
        runs = [pool.submit(program(k), "f", TESTS) for k in range(9)]
        assert [sb.in_flight for sb in pool.sandboxes] == [3, 3, 3]
        assert [r.result().values[1] for r in runs] == [1 + k for k in range(9)]


def test_a_thread_waiting_for_a_verdict_does_not_hold_up_submissions_to_the_same_zygote():
    # A rollout worker's delivery thread waits for one batch's verdicts while its main thread sends
    # the next batch's programs: the wait must not keep the zygote's lock. The slow program spins
    # until its per-test alarm (~1 s); before the fix a submission behind it waited just as long.
    slow = "def f(x):\n    while True:\n        pass\n"
    with Sandbox(SandboxSettings(wall_s=3.0, per_test_s=1.0, cpu_s=5)) as sb:
        waiting = sb.submit(slow, "f", TESTS[:1])
        verdicts: list = []
        waiter = threading.Thread(target=lambda: verdicts.append(waiting.result()))
        waiter.start()
        time.sleep(0.3)  # the waiter is in result() by now, its program still spinning
        assert not waiting.done()
        t = time.monotonic()
        quick = sb.submit(program(0), "f", TESTS)
        submit_s = time.monotonic() - t
        waiter.join(10)
        assert quick.result().all_passed
    assert submit_s < 0.5, submit_s
    assert verdicts and verdicts[0].tests[0].status == "timeout"
