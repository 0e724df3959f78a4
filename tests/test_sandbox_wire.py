"""What the sandbox's cheaper runs rest on: the zygote's reply format as the parent reads it, the
children's report encoding, privileges dropped once in the zygote, and children forked without the
interpreter's fork hooks."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

from offline_rl import sandbox as parent
from offline_rl import sandbox_zygote as zygote
from offline_rl.config import SandboxSettings
from offline_rl.sandbox import Sandbox, decode_lines
from offline_rl.sandbox_zygote import UID_BASE
from offline_rl.tasks import TestCase as Case

SETTINGS = SandboxSettings(wall_s=5.0, per_test_s=2.0, cpu_s=5)


@pytest.fixture(scope="module", params=["namespace", "inprocess"])
def sandbox(request):
    with Sandbox(SETTINGS.model_copy(update={"isolation": request.param})) as sb:
        yield sb


def test_parent_and_zygote_agree_on_the_reply_format():
    # The zygote runs as a script from its path alone, so the parent keeps its own copy of these.
    assert parent.RUN_HEAD.format == zygote.RUN_HEAD.format
    assert (zygote.JSON_REPLY[0], zygote.RUN_REPLY[0]) == (parent.JSON_REPLY, parent.RUN_REPLY)
    assert parent.TRUNCATED_LINES == zygote.TRUNCATED_LINES


def test_a_run_reply_carries_the_childs_output_for_the_parent_to_decode():
    output = b'{"i": 0, "value": 1}\n\n  \nnot json\n{"i": 1, "error": "E"}\n\xff\xfe\n'
    payload = zygote.RUN_REPLY + zygote.RUN_HEAD.pack(True, False, 9, -1, 0.5, 0.25, 0.125) + output
    reply = parent.decode_reply(payload)
    assert reply["lines"] == [{"i": 0, "value": 1}, {"garbage": True}, {"i": 1, "error": "E"}, {"garbage": True}]
    assert (reply["killed"], reply["truncated"], reply["signal"], reply["exit_code"]) == (True, False, 9, None)
    assert (reply["wall_s"], reply["cpu_s"], reply["zygote_cpu_s"]) == (0.5, 0.25, 0.125)
    assert parent.decode_reply(zygote.JSON_REPLY + b'{"harness_error": "x"}') == {"harness_error": "x"}


def test_only_the_head_of_an_over_limit_output_is_decoded():
    output = b'{"i": 0, "value": 1}\n' * (parent.TRUNCATED_LINES + 50)
    assert len(decode_lines(output, truncated=True)) == parent.TRUNCATED_LINES
    assert len(decode_lines(output, truncated=False)) == parent.TRUNCATED_LINES + 50


@pytest.mark.parametrize("value", [1, 1.0, True, None, -2**70, float("inf"), float("nan"), "é\n\"x\"", [1, [2.5, {}]],
                                   {"b": 1, "a": [None]}, {1: "int key"}, (1, 2), []])
def test_reports_are_encoded_as_json_dumps_would(value):
    r, w = os.pipe()
    try:
        zygote._emit({"i": 3, "value": value}, w)
        os.close(w)
        assert os.read(r, 1 << 16) == (json.dumps({"i": 3, "value": value}) + "\n").encode()
    finally:
        os.close(r)


def test_a_failed_report_leaves_nothing_behind_for_the_next():
    # The prebuilt encoder tracks the containers it is inside (circular-reference check); a report
    # that fails half-way must not make a later, valid one fail.
    r, w = os.pipe()
    try:
        shared = [1]
        for bad, err in (([shared, object()], TypeError), (_circular(), ValueError)):
            with pytest.raises(err):
                zygote._emit({"i": 0, "value": bad}, w)
        zygote._emit({"i": 1, "value": [shared, shared]}, w)
        os.close(w)
        assert os.read(r, 1 << 16) == b'{"i": 1, "value": [[1], [1]]}\n'
    finally:
        os.close(r)


def _circular() -> list:
    loop: list = []
    loop.append(loop)
    return loop


def test_circular_and_unserialisable_results_are_errors(sandbox):
    code = "def f(x):\n    if x == 0:\n        a = []\n        a.append(a)\n        return a\n" \
           "    return object() if x == 1 else [x]\n"
    lines = sandbox.execute(code, "f", [[0], [1], [2]])["lines"]
    assert lines == [{"i": 0, "error": "unserialisable result: ValueError"},
                     {"i": 1, "error": "unserialisable result: TypeError"}, {"i": 2, "value": [2]}]


def test_children_inherit_the_zygotes_dropped_privileges():
    with Sandbox(SETTINGS.model_copy(update={"isolation": "namespace"})) as sb:
        status = Path(f"/proc/{sb._proc.pid}/status").read_text()
        assert "NoNewPrivs:\t1" in status
        groups = [line.split(":", 1)[1].split() for line in status.splitlines() if line.startswith("Groups:")]
        assert groups == [[]]
        # PR_GET_NO_NEW_PRIVS is 39; ctypes is loaded in the zygote, so a program may call prctl.
        code = ("import ctypes, os\ndef f(x):\n    return [os.getuid(), os.getgid(), os.getgroups(),"
                " ctypes.CDLL(None).prctl(39, 0, 0, 0, 0)]\n")
        lines = sb.execute(code, "f", [[0]])["lines"]
        uid = UID_BASE + sb._proc.pid
        assert lines == [{"i": 0, "value": [uid, uid, [], 1]}]


def test_children_start_from_the_zygotes_random_state(sandbox):
    # Forked without the interpreter's fork hooks, so random's reseed does not run in the child:
    # every run of a program draws the same numbers, and its reward does not depend on the draw.
    code = "import random\ndef f(x):\n    return [random.random() for _ in range(3)]\n"
    first, second = (sandbox.execute(code, "f", [[0]])["lines"] for _ in range(2))
    assert first == second and "value" in first[0]


@pytest.mark.parametrize("value", [1, 1.0, True, None, "é", [1, {"b": 2, "a": [None, 1.5]}], {"x": float("-inf")},
                                   -2**80, {2: "b", 1: "a"}, []])
def test_canonical_is_json_dumps_with_sorted_keys(value):
    assert parent.canonical(value) == json.dumps(value, sort_keys=True)


def test_canonical_refuses_what_json_cannot_hold():
    for bad in (object(), {1, 2}, [b"bytes"]):
        with pytest.raises(TypeError):
            parent.canonical(bad)


def test_a_line_nested_past_the_decoders_depth_is_garbage(sandbox):
    # Written by the program straight onto the result pipe: the parent's decoder gives up on it with
    # RecursionError, which must make it garbage, not a harness fault that stops the caller.
    code = ("import os\nos.write(3, b'[' * 100000 + b']' * 100000 + b'\\n')\n"
            "def f(x):\n    return 3*x+1\n")
    reply = sandbox.execute(code, "f", [[0], [1]])
    assert reply["lines"] == [{"garbage": True}, {"i": 0, "value": 1}, {"i": 1, "value": 4}]


def test_the_zygotes_directory_is_not_left_on_the_programs_path(sandbox):
    # The zygote is imported from its directory at start; a program must not find the project's
    # other modules next to it.
    lines = sandbox.execute("import sys\ndef f(x):\n    return sys.path\n", "f", [[0]])["lines"]
    assert str(parent.ZYGOTE.parent) not in lines[0]["value"]


def test_the_zygote_takes_a_code_object_or_a_source():
    code = compile("x = 1", "<program>", "exec")
    assert zygote._compile(code) is code  # compiled by the parent
    assert zygote._compile("x = 1").co_names == ("x",)  # a small source: compiled before the fork
    assert zygote._compile("#" * (zygote.COMPILE_IN_ZYGOTE_MAX + 1)) is None  # a large one: by the child


def test_a_compiler_warning_is_not_an_error_in_the_parent(sandbox):
    # The parent compiles programs; a program the compiler warns about ("is" with a literal) must
    # get the same verdict when the parent runs with warnings as errors.
    tests = [Case([x], 3 * x + 1) for x in (0, 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run = sandbox.run("def f(x):\n    return 4 if x is 1 else 3*x+1\n", "f", tests)
    assert run.compiled and run.all_passed


@pytest.mark.parametrize("line", [b'{"i": 0, "value": [1, 2.5, "x"]}', b'  {"a": null}  ', b"\t7\r", b'"\\ud800"',
                                  b"\xef\xbb\xbf[1]", b"1 2", b"[1", b"{} {}", b"NaN", b"-Infinity", b"\xff",
                                  b'"\xed\xa0\x80"', '"é"'.encode("utf-16"), b"\x00", b"[" * 5000 + b"]" * 5000])
def test_lines_decode_as_json_loads_would(line):
    try:
        expected = json.loads(line)
    except (ValueError, RecursionError):
        expected = {"garbage": True}
    assert decode_lines(line + b"\n") == [expected]
