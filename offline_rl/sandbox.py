"""Run model-written programs against hidden tests, isolated, and score them in the parent.

The mechanism (network namespace, chroot, dropped uid, rlimits, process-group kill) lives in the
fork server :mod:`offline_rl.sandbox_zygote`; this module starts it, sends it a program with the test
*inputs* only, and compares the returned values with the expected outputs here, in the trusted
process. Values cross the boundary as JSON and are compared as canonical JSON, so ``1``, ``1.0`` and
``True`` are different answers and no object with a custom ``__eq__`` can reach the comparison.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from offline_rl.config import SandboxSettings
from offline_rl.tasks import TestCase

ZYGOTE = Path(__file__).with_name("sandbox_zygote.py")
# The zygote is imported by a one-line program, not run as a script: a script is compiled on every
# start and the compiler's leftovers stay in the heap, ~0.9 MiB (~230 pages) more that every fork
# copies the page tables of and every child's exit unmaps; an import reads the cached bytecode.
# -I leaves the zygote's directory off sys.path; it is added for this import only.
_BOOT = "import sys; sys.path.insert(0, sys.argv.pop(1)); import sandbox_zygote; del sys.path[0]; sandbox_zygote.main()"
Status = Literal["passed", "failed", "error", "timeout"]

# The zygote's reply format (its module runs as a script and is not imported here; a test checks
# that these match sandbox_zygote's own).
JSON_REPLY, RUN_REPLY = ord("J"), ord("R")
RUN_HEAD = struct.Struct(">??iiddd")
TRUNCATED_LINES = 1000  # report lines decoded from a run that exceeded the zygote's output limit


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, harness fault); not a verdict on the program."""


@dataclass(frozen=True)
class TestResult:
    index: int
    status: Status
    detail: str | None = None


@dataclass
class RunResult:
    """Verdict on one program: one entry per hidden test, plus what happened to the process."""

    tests: list[TestResult]
    compiled: bool
    error: str | None = None
    killed: bool = False
    wall_s: float = 0.0
    values: list[Any] = field(default_factory=list)
    cpu_s: float = 0.0
    """CPU seconds of the program's process and of the fork server's work for it: the cost that the
    caller's own CPU clock does not include (0 when nothing ran)."""

    @property
    def n_passed(self) -> int:
        return sum(t.status == "passed" for t in self.tests)

    @property
    def pass_fraction(self) -> float:
        return self.n_passed / len(self.tests) if self.tests else 0.0

    @property
    def all_passed(self) -> bool:
        return bool(self.tests) and self.n_passed == len(self.tests)


def _unserialisable(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# json.dumps(value, sort_keys=True) without the Python layers it runs on every call (a JSONEncoder
# and a C encoder built per call: ~2.6 us, twelve calls per program). No circular-reference check:
# the values compared are JSON-decoded reports and task outputs, which cannot contain cycles; one
# that did would fail with RecursionError instead of ValueError. Holds no state, so threads share it.
_CANONICAL = json.encoder.c_make_encoder(
    None, _unserialisable, json.encoder.encode_basestring_ascii, None, ": ", ", ", True, False,
    True) if json.encoder.c_make_encoder is not None else None


def canonical(value: Any) -> str:
    """The one text of a JSON value that comparisons use: sorted keys, ``1``, ``1.0`` and ``True``
    all different. The same text as ``json.dumps(value, sort_keys=True)``."""
    if _CANONICAL is None:  # no C accelerator in this build
        return json.dumps(value, sort_keys=True, allow_nan=True)
    return "".join(_CANONICAL(value, 0))


class Sandbox:
    """One fork server. Thread-safe (calls are serialised); use :class:`SandboxPool` for parallelism."""

    def __init__(self, settings: SandboxSettings | None = None):
        self.settings = settings or SandboxSettings()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self.isolation = ""
        self.isolation_reason = ""
        self._start()

    def _start(self) -> None:
        # LD_BIND_NOW: the dynamic linker resolves every symbol once in the zygote, instead of each
        # forked child resolving (and copying the pages of) the ones it calls first.
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _BOOT, str(ZYGOTE.parent), self.settings.isolation],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True,
            env={**os.environ, "LD_BIND_NOW": "1"},
        )
        hello = self._recv()
        if hello is None or not hello.get("ready"):
            err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
            raise SandboxError(f"sandbox did not start: {err.strip() or hello}")
        self.isolation = hello["isolation"]
        self.isolation_reason = hello["reason"]

    def _send(self, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self._proc.stdin.write(struct.pack(">I", len(data)) + data)
        self._proc.stdin.flush()

    def _recv(self) -> dict | None:
        head = self._proc.stdout.read(4)
        if len(head) < 4:
            return None
        (n,) = struct.unpack(">I", head)
        payload = self._proc.stdout.read(n)
        if len(payload) < n:
            return None
        return decode_reply(payload)

    def execute(self, code: str, entry_point: str, inputs: Sequence[Sequence[Any]]) -> dict:
        """Raw run: the zygote's reply (per-input values/errors as reported by the child)."""
        s = self.settings
        req = {"code": code, "entry": entry_point, "inputs": [list(a) for a in inputs], "cpu_s": s.cpu_s,
               "wall_s": s.wall_s, "per_test_s": s.per_test_s, "mem_mb": s.mem_mb, "nproc": s.nproc,
               "fsize_kb": s.fsize_kb}
        with self._lock:
            for attempt in range(2):
                try:
                    self._send(req)
                    reply = self._recv()
                except (BrokenPipeError, OSError):
                    reply = None
                if reply is not None:
                    break
                # The fork server died (killed from outside): start a fresh one and retry once.
                self._kill()
                if attempt == 0:
                    self._start()
            else:
                raise SandboxError("sandbox fork server died twice in a row")
        if "harness_error" in reply:
            raise SandboxError(f"sandbox harness fault: {reply['harness_error']}")
        return reply

    def run(self, code: str, entry_point: str, tests: Sequence[TestCase]) -> RunResult:
        """Run ``code`` and score its ``entry_point`` on ``tests``; hidden outputs stay in this process."""
        reply = self.execute(code, entry_point, [t.args for t in tests])
        return score_reply(reply, tests)

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def close(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self._kill()
        for stream in (self._proc.stdout, self._proc.stderr):
            if stream:
                stream.close()
        self._proc = None

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def decode_reply(payload: bytes) -> dict:
    """A zygote reply as a dict; a run's output becomes its report lines (``lines``)."""
    if payload[0] == JSON_REPLY:
        return json.loads(payload[1:])
    if payload[0] != RUN_REPLY:
        raise SandboxError(f"sandbox reply of unknown kind {payload[:1]!r}")
    killed, truncated, sig, exit_code, wall_s, cpu_s, zygote_cpu_s = RUN_HEAD.unpack_from(payload, 1)
    return {"lines": decode_lines(payload[1 + RUN_HEAD.size:], truncated), "killed": killed,
            "truncated": truncated, "signal": None if sig < 0 else sig, "exit_code": None if exit_code < 0 else exit_code,
            "wall_s": wall_s, "cpu_s": cpu_s, "zygote_cpu_s": zygote_cpu_s}


def decode_lines(output: bytes, truncated: bool = False) -> list:
    """A child's output, one JSON value per non-blank line (``{"garbage": True}`` where a line is not
    JSON). Of an output that went over the limit only the first TRUNCATED_LINES count: such a run
    has failed, and its head and first reports are all that scoring needs."""
    lines: list = []
    loads = json.loads
    for raw in output.split(b"\n"):
        if truncated and len(lines) >= TRUNCATED_LINES:
            break
        if raw.strip():
            try:
                lines.append(loads(raw))
            except (ValueError, RecursionError):  # a program may nest brackets past the decoder's depth
                lines.append({"garbage": True})
    return lines


def score_reply(reply: dict, tests: Sequence[TestCase]) -> RunResult:
    lines = reply["lines"]
    killed = bool(reply.get("killed"))
    wall = float(reply.get("wall_s", 0.0))
    cpu = float(reply.get("cpu_s", 0.0)) + float(reply.get("zygote_cpu_s", 0.0))
    head = lines[0] if lines else {}
    for key in ("setup_error", "compile_error", "load_error"):
        if key in head:
            status: Status = "timeout" if "timeout" in str(head[key]) else "error"
            return RunResult(tests=[TestResult(i, status, head[key]) for i in range(len(tests))],
                             compiled=key != "compile_error", error=f"{key}: {head[key]}", killed=killed,
                             wall_s=wall, cpu_s=cpu)
    # The first report for each index counts; anything the program wrote itself (extra or garbage
    # lines) cannot add a pass, because a pass needs the right value.
    first: dict[int, dict] = {}
    for line in lines:
        i = line.get("i") if isinstance(line, dict) else None
        if isinstance(i, int) and 0 <= i < len(tests) and i not in first:
            first[i] = line
    results, values = [], []
    for i, test in enumerate(tests):
        line = first.get(i)
        if line is None:
            results.append(TestResult(i, "timeout" if killed else "error",
                                      "killed at the wall-clock limit" if killed else "no result reported"))
            values.append(None)
        elif line.get("timeout"):
            results.append(TestResult(i, "timeout", "per-test time limit"))
            values.append(None)
        elif "error" in line:
            results.append(TestResult(i, "error", str(line["error"])))
            values.append(None)
        elif "value" in line:
            got = canonical(line["value"])
            ok = got == canonical(test.expected)
            results.append(TestResult(i, "passed" if ok else "failed", None if ok else f"got {got[:80]}"))
            values.append(line["value"])
        else:
            results.append(TestResult(i, "error", "malformed result"))
            values.append(None)
    err = None
    if killed:
        err = "killed: wall-clock limit or output limit"
    elif reply.get("signal"):
        err = f"terminated by signal {reply['signal']}"
    return RunResult(tests=results, compiled=True, error=err, killed=killed, wall_s=wall, values=values,
                     cpu_s=cpu)


class SandboxPool:
    """A few fork servers used in parallel (thread pool: the work happens in the child processes)."""

    def __init__(self, settings: SandboxSettings | None = None, size: int | None = None):
        self.settings = settings or SandboxSettings()
        self.size = size or self.settings.pool_size
        self.sandboxes = [Sandbox(self.settings) for _ in range(self.size)]
        self._executor = ThreadPoolExecutor(self.size) if self.size > 1 else None
        self._next, self._next_lock = 0, threading.Lock()
        self.isolation = self.sandboxes[0].isolation
        self.isolation_reason = self.sandboxes[0].isolation_reason

    def run_many(self, jobs: Sequence[tuple[str, str, Sequence[TestCase]]]) -> list[RunResult]:
        return [f.result() for f in [self.submit(*job) for job in jobs]]

    def submit(self, code: str, entry_point: str, tests: Sequence[TestCase]) -> Future[RunResult]:
        """Start a run in the pool's threads and return at once (a pool of one runs it here)."""
        if self._executor is None:
            done: Future[RunResult] = Future()
            try:
                done.set_result(self.sandboxes[0].run(code, entry_point, tests))
            except BaseException as err:  # noqa: BLE001 - delivered through the future, as a thread would
                done.set_exception(err)
            return done
        with self._next_lock:
            sandbox = self.sandboxes[self._next % self.size]
            self._next += 1
        return self._executor.submit(sandbox.run, code, entry_point, tests)

    def run(self, code: str, entry_point: str, tests: Sequence[TestCase]) -> RunResult:
        return self.sandboxes[0].run(code, entry_point, tests)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()
        for sb in self.sandboxes:
            sb.close()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
