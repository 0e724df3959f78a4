"""The sandbox: structured verdicts, and every adversary from the issue ends with reward 0 and the host
unharmed. Most tests run in both isolation modes: ``namespace`` (what runs here, as root) and the
``inprocess`` fallback for machines without privileges."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from offline_rl import sandbox_zygote as zygote
from offline_rl.config import RewardSettings, SandboxSettings
from offline_rl.rewards import RewardFunction
from offline_rl.sandbox import Sandbox
from offline_rl.sandbox_zygote import TRUNCATED_LINES, UID_BASE
from offline_rl.tasks import Task
from offline_rl.tasks import TestCase as Case

TESTS = [Case([x], 3 * x + 1) for x in (-7, -3, -1, 5, 11, 17)]
TASK = Task(task_id="t-affine", prompt="# f(0)=1 f(1)=4\ndef f(x): return ", tests=TESTS,
            examples=[Case([0], 1), Case([1], 4)])
FAST = SandboxSettings(wall_s=1.0, per_test_s=0.2, cpu_s=1)


@pytest.fixture(scope="module", params=["namespace", "inprocess"])
def sandbox(request):
    sb = Sandbox(FAST.model_copy(update={"isolation": request.param}))
    yield sb
    sb.close()


def reward_of(sandbox: Sandbox, code: str) -> float:
    """The full composite reward (with shaping weights on) of a raw program."""
    run = sandbox.run(code, "f", TESTS)
    fn = RewardFunction(sandbox, RewardSettings(compiles=0.2, format=0.2))
    return fn.score(TASK, "<program>", well_formed=True, run=run).total


def processes_of_uid(uid: int) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if d.stat().st_uid == uid:
                    pids.append(int(d.name))
            except FileNotFoundError:
                pass
    return pids


def test_isolation_mode_is_reported():
    with Sandbox(FAST) as sb:
        # We run as root here, so the strong mode must be the one in force, not the fallback.
        assert os.geteuid() == 0
        assert sb.isolation == "namespace", sb.isolation_reason


def test_correct_program_passes_every_test(sandbox):
    r = sandbox.run("def f(x):\n    return 3*x+1\n", "f", TESTS)
    assert [t.status for t in r.tests] == ["passed"] * 6
    assert r.all_passed and r.pass_fraction == 1.0 and r.compiled


def test_structured_results_per_test(sandbox):
    code = "def f(x):\n    if x == -7: raise ValueError('no')\n    if x == 5:\n        while True: pass\n" \
           "    if x == 11: return 0\n    return 3*x+1\n"
    r = sandbox.run(code, "f", TESTS)
    assert [t.status for t in r.tests] == ["error", "passed", "passed", "timeout", "failed", "passed"]
    assert "ValueError" in r.tests[0].detail
    assert r.pass_fraction == pytest.approx(3 / 6)


def test_compile_error_is_reported(sandbox):
    r = sandbox.run("def f(x) return x\n", "f", TESTS)
    assert not r.compiled and all(t.status == "error" for t in r.tests)


def test_strict_value_comparison(sandbox):
    # 1.0 == 1 and True == 1 in Python; the harness compares canonical JSON, so they are wrong answers.
    tests = [Case([1], 1), Case([2], 1)]
    r = sandbox.run("def f(x):\n    return 1.0 if x == 1 else True\n", "f", tests)
    assert [t.status for t in r.tests] == ["failed", "failed"]


# --- adversaries ---------------------------------------------------------------------------------

def test_infinite_loop(sandbox):
    t0 = time.monotonic()
    assert reward_of(sandbox, "def f(x):\n    while True:\n        pass\n") == 0.0
    assert time.monotonic() - t0 < 3.0
    assert reward_of(sandbox, "while True:\n    pass\n") == 0.0  # looping at import time


def test_fork_bomb(sandbox):
    code = ("import os\ndef f(x):\n    while True:\n        try:\n            os.fork()\n"
            "        except BaseException:\n            pass\n")
    assert reward_of(sandbox, code) == 0.0
    if sandbox.isolation == "namespace":
        # Nothing of the program's uid survives (descendants that left the process group included).
        time.sleep(0.2)
        zygote_pid = sandbox._proc.pid
        assert processes_of_uid(UID_BASE + zygote_pid) == []
    # The host still forks and the sandbox still works.
    assert sandbox.run("def f(x):\n    return 3*x+1\n", "f", TESTS).all_passed


def test_process_left_behind_by_a_clean_run_is_killed(sandbox):
    # Every answer right, a clean exit in time, but a detached process (own session: the process-group
    # kill misses it; result pipe closed: the zygote does not wait for it) is left running. The
    # zygote skips its uid sweep only when nothing outlived the program, so it must notice this one.
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    os.close(3)\n    time.sleep(30)\n"
            "    os._exit(0)\ndef f(x):\n    return 3*x+1\n")
    t0 = time.monotonic()
    r = sandbox.run(code, "f", TESTS)
    if sandbox.isolation == "namespace":
        assert r.all_passed and not r.killed
        assert time.monotonic() - t0 < 3.0  # it did not wait for the detached process (30 s); slack for a loaded host
        assert processes_of_uid(UID_BASE + sandbox._proc.pid) == []
    else:
        assert r.n_passed == 0  # the audit hook refuses the fork


def test_output_flood(sandbox):
    # Floods the result pipe (with lines shaped like reports) until the pipe is full.
    code = ("import os\ndef f(x):\n    while True:\n"
            "        os.write(3, b'{\"i\": 0, \"value\": 1}\\n' * 4096)\n")
    t0 = time.monotonic()
    r = sandbox.run(code, "f", TESTS)
    assert r.killed and r.n_passed == 0
    assert time.monotonic() - t0 < 3.0
    # The zygote stops reading at the output limit (the writer is still running until it is
    # killed) and decodes a bounded number of lines of an over-limit run.
    reply = sandbox.execute(code, "f", [t.args for t in TESTS])
    assert reply["killed"] and reply["truncated"] and 0 < len(reply["lines"]) <= TRUNCATED_LINES
    assert reward_of(sandbox, code) == 0.0
    assert sandbox.run("def f(x):\n    return 3*x+1\n", "f", TESTS).all_passed


@pytest.mark.parametrize("at_exit", [True, False])
def test_both_ways_of_collecting_reports_agree(at_exit):
    """The zygote sleeps until the child exits when the result pipe can hold all the output, and
    reads as lines arrive otherwise: the same reports either way, nothing killed."""
    r, w = os.pipe()
    if at_exit:
        assert zygote._make_roomy(r)
    lines = [f'{{"i": {i}, "value": {i}}}\n'.encode() for i in range(5)]
    pid = os.fork()
    if pid == 0:
        os.close(r)
        for line in lines:
            os.write(w, line)
            time.sleep(0.01)
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + 5.0
    if at_exit:
        chunks, killed, truncated = zygote._collect_at_exit(r, pid, deadline)
    else:
        chunks, killed, truncated = zygote._collect_streaming(r, deadline)
    os.close(r)
    os.waitpid(pid, 0)
    assert b"".join(chunks) == b"".join(lines)
    assert not killed and not truncated


def test_memory_hog(sandbox):
    code = "def f(x):\n    blocks = []\n    while True:\n        blocks.append(bytearray(50 * 2**20))\n"
    assert reward_of(sandbox, code) == 0.0
    code = "big = ' ' * (2**34)\ndef f(x):\n    return 3*x+1\n"
    assert reward_of(sandbox, code) == 0.0
    assert sandbox.run("def f(x):\n    return 3*x+1\n", "f", TESTS).all_passed


def test_socket_cannot_reach_the_host(sandbox):
    hits = []
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(5)
    server.settimeout(2.0)
    port = server.getsockname()[1]

    def accept():
        try:
            conn, _ = server.accept()
            hits.append(conn.recv(100))
            conn.close()
        except OSError:
            pass

    th = threading.Thread(target=accept)
    th.start()
    # Exfiltrate the inputs, or fetch the answers, from a server on the host's loopback.
    code = (f"import socket\ndef f(x):\n    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
            f"    s.settimeout(0.1)\n    s.connect(('127.0.0.1', {port}))\n    s.sendall(b'leak')\n"
            f"    return int(s.recv(100))\n")
    r = sandbox.run(code, "f", TESTS)
    th.join()
    server.close()
    assert hits == []
    assert all(t.status == "error" for t in r.tests)
    assert reward_of(sandbox, code) == 0.0


def test_read_outside_its_directory(sandbox, tmp_path):
    secret = tmp_path / "hidden_tests.json"
    secret.write_text('{"-7": -20}')
    secret.chmod(0o644)
    for path in (str(secret), "/etc/passwd", "../../etc/hostname", "/proc/1/environ"):
        code = f"def f(x):\n    data = open({path!r}).read()\n    return 3*x+1 if data else 0\n"
        r = sandbox.run(code, "f", TESTS)
        assert r.n_passed == 0, path
        assert reward_of(sandbox, code) == 0.0
    listing = "import os\ndef f(x):\n    return len(os.listdir('/work')) + 3*x+1 - len(os.listdir('/work'))\n"
    assert sandbox.run(listing, "f", TESTS).n_passed == 0


def test_write_outside_its_directory(sandbox, tmp_path):
    target = tmp_path / "pwned.txt"
    tmp_path.chmod(0o777)  # even a world-writable host directory must stay out of reach
    code = (f"def f(x):\n    open({str(target)!r}, 'w').write('owned')\n    return 3*x+1\n")
    assert reward_of(sandbox, code) == 0.0
    assert not target.exists()
    # A relative climb: under chroot '..' of the run directory is the run directory itself; in the
    # fallback the audit hook refuses it. Either way nothing lands next to the run directories.
    code = "def f(x):\n    open('../../escape.txt', 'w').write('x')\n    return 3*x+1\n"
    sandbox.run(code, "f", TESTS)
    # Seen from the host and from the zygote (in namespace mode its run directories are on a tmpfs
    # mounted in its own mount namespace, which only /proc/PID/root shows).
    tmp = tempfile.gettempdir()
    for view in (Path(tmp), Path(f"/proc/{sandbox._proc.pid}/root") / tmp.lstrip("/")):
        assert not list(view.glob("rtrl-sandbox-*/escape.txt"))
        assert not (view / "escape.txt").exists()
    # Writing inside its own fresh directory is allowed, and the directory is gone afterwards.
    inside = "def f(x):\n    open('scratch.txt', 'w').write(str(x))\n    return 3*x+1\n"
    assert sandbox.run(inside, "f", TESTS).all_passed


def test_harness_tampering_patch_comparison(sandbox):
    # An object that claims equality with anything, and an int subclass with a lying __eq__.
    always = "class A:\n    def __eq__(self, o): return True\n    def __ne__(self, o): return False\n" \
             "def f(x):\n    return A()\n"
    assert reward_of(sandbox, always) == 0.0
    lying_int = "class A(int):\n    def __eq__(self, o): return True\ndef f(x):\n    return A(0)\n"
    assert reward_of(sandbox, lying_int) == 0.0
    patch_json = ("import json, builtins\njson.dumps = lambda *a, **k: '{\"i\": 0, \"value\": 0}'\n"
                  "builtins.isinstance = lambda *a: True\ndef f(x):\n    return 0\n")
    assert reward_of(sandbox, patch_json) == 0.0
    harness = Path(__file__).resolve().parents[1] / "offline_rl" / "sandbox_zygote.py"
    before = harness.read_bytes()
    rewrite = (f"def f(x):\n    open({str(harness)!r}, 'w').write('PASS = True')\n    return 0\n")
    assert reward_of(sandbox, rewrite) == 0.0
    assert harness.read_bytes() == before


def test_harness_tampering_exit_early_with_success(sandbox):
    for code in ("import os\nos._exit(0)\ndef f(x):\n    return 0\n",
                 "import sys\nsys.exit(0)\n",
                 "import os\ndef f(x):\n    os._exit(0)\n",
                 "def f(x):\n    raise SystemExit(0)\n"):
        r = sandbox.run(code, "f", TESTS)
        assert r.n_passed == 0, code
        assert reward_of(sandbox, code) == 0.0


def test_harness_tampering_print_success_marker(sandbox):
    # Write fake verdict lines to stdout and straight onto the result pipe (fd 3), before any test runs.
    fake = "".join(f'{{"i": {i}, "status": "passed", "passed": true}}\\n' for i in range(6))
    code = (f"import os\nprint('ALL TESTS PASSED')\nprint('{{\"passed\": 6, \"total\": 6}}')\n"
            f"os.write(3, b'{fake}')\nos.write(1, b'OK 6/6\\n')\ndef f(x):\n    return 0\n")
    r = sandbox.run(code, "f", TESTS)
    assert r.n_passed == 0
    assert reward_of(sandbox, code) == 0.0
    # Guessing values on the pipe is just answering: only the right value for a hidden input passes.
    guess = ("import os, json\nfor i in range(6):\n    os.write(3, (json.dumps({'i': i, 'value': 0}) + '\\n')"
             ".encode())\ndef f(x):\n    return 0\n")
    assert reward_of(sandbox, guess) == 0.0


def test_killing_the_fork_server_recovers(sandbox):
    sandbox._proc.kill()
    sandbox._proc.wait()
    assert sandbox.run("def f(x):\n    return 3*x+1\n", "f", TESTS).all_passed
