"""Run model-written programs against hidden tests, isolated, and score them in the parent.

The mechanism (network namespace, chroot, dropped uid, rlimits, process-group kill) lives in the
fork server :mod:`offline_rl.sandbox_zygote`; this module starts it, sends it a program with the test
*inputs* only, and compares the returned values with the expected outputs here, in the trusted
process. Values cross the boundary as JSON and are compared as canonical JSON, so ``1``, ``1.0`` and
``True`` are different answers and no object with a custom ``__eq__`` can reach the comparison.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import json.decoder
import json.scanner
import marshal
import os
import select
import struct
import subprocess
import sys
import threading
import warnings
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType
from typing import Any, Literal

from offline_rl.config import SandboxSettings
from offline_rl.tasks import TestCase

ZYGOTE = Path(__file__).with_name("sandbox_zygote.py")
# The zygote is imported by a one-line program, not run as a script: a script is compiled on every
# start and the compiler's leftovers stay in the heap, memory that every fork copies the page
# tables of and every child's exit unmaps; an import reads the cached bytecode.
# -I leaves the zygote's directory off sys.path; it is added for this import only.
_BOOT = "import sys; sys.path.insert(0, sys.argv.pop(1)); import sandbox_zygote; del sys.path[0]; sandbox_zygote.main()"
Status = Literal["passed", "failed", "error", "timeout"]

# The zygote's reply format (the zygote runs in a process of its own from its path alone, and its
# module is not imported here; a test checks that these match sandbox_zygote's own).
JSON_REPLY, RUN_REPLY = ord("J"), ord("R")
RUN_HEAD = struct.Struct(">??iiddd")
TRUNCATED_LINES = 1000  # report lines decoded from a run that exceeded the zygote's output limit
COMPILE_BEFORE_FORK_MAX = 16 << 10
"""Sources up to this many characters are compiled here and sent as code objects (the zygote's
COMPILE_IN_ZYGOTE_MAX); larger ones are compiled by the child, under its limits."""
PIPE_BYTES = 1 << 20  # asked-for size of each pipe to a zygote (fs.pipe-max-size allows 1 MiB by default)
READ_BYTES = 1 << 16
SETTLE_POLL_S = 0.05  # longest unlocked wait for a reply before the pipe is looked up again


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
# and a C encoder built per call, a dozen calls per program). No circular-reference check:
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


class _Run(Future):
    """A program sent to a zygote. It settles when its result is asked for (or a later run's of the
    same zygote is): the parent reads replies only then, so no thread waits on the zygotes."""

    def __init__(self, sandbox: Sandbox, frame: bytes, tests: Sequence[TestCase] | None):
        super().__init__()
        self.sandbox, self.frame, self.tests = sandbox, frame, tests
        self.retried = False

    def result(self, timeout: float | None = None):
        if not self.done():
            self.sandbox._settle(self)
        return super().result(timeout)

    def exception(self, timeout: float | None = None):
        if not self.done():
            self.sandbox._settle(self)
        return super().exception(timeout)


class Sandbox:
    """One fork server. Thread-safe; :class:`SandboxPool` runs several side by side.

    Requests are pipelined: :meth:`submit` writes the program to the zygote and returns at once, and
    the zygote works through its requests in order while the caller goes on (decoding the rest of a
    batch, say). Replies wait in the zygote's pipe until a result is asked for. Compared with a
    thread per zygote blocked on its reply, this spares the parent the thread hand-offs and the
    zygote an idle gap between programs."""

    def __init__(self, settings: SandboxSettings | None = None):
        self.settings = settings or SandboxSettings()
        self._lock = threading.RLock()
        self._proc: subprocess.Popen | None = None
        self._pending: deque[_Run] = deque()
        self._inbuf = bytearray()
        self._awaiting_greeting = False
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
        self._to, self._from = self._proc.stdin.fileno(), self._proc.stdout.fileno()
        for fd in (self._to, self._from):  # room for many small requests and replies in flight
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        # Writes never block (see _write); reads do, for replies the caller is waiting for.
        os.set_blocking(self._to, False)
        self._inbuf.clear()
        try:
            hello = self._next_reply()
        except _ZygoteDied:
            hello = None
        if hello is None or not hello.get("ready"):
            err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
            self._kill()
            raise SandboxError(f"sandbox did not start: {err.strip() or hello}")
        self.isolation = hello["isolation"]
        self.isolation_reason = hello["reason"]

    def _request(self, code: str, entry_point: str, inputs: Sequence[Sequence[Any]]) -> bytes | dict:
        """The request frame for the zygote, or the verdict itself when the program does not compile."""
        program: str | CodeType = code
        if len(code) <= COMPILE_BEFORE_FORK_MAX:
            # Compiled here rather than in the zygote, where the compiler's work lands on pages that
            # every fork write-protects again (page faults in every run, besides the compile itself).
            # Compiling runs nothing of the program. Warnings about it (SyntaxWarning...) are noise
            # here, and must not become errors under -W error.
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    program = compile(code, "<program>", "exec", dont_inherit=True)
            except (SyntaxError, ValueError, MemoryError, RecursionError, OverflowError) as err:
                return {"lines": [{"compile_error": f"{type(err).__name__}: {err}"}], "killed": False,
                        "truncated": False, "signal": None, "exit_code": None, "wall_s": 0.0, "cpu_s": 0.0}
        s = self.settings
        req = {"code": program, "entry": entry_point, "inputs": [list(a) for a in inputs], "cpu_s": s.cpu_s,
               "wall_s": s.wall_s, "per_test_s": s.per_test_s, "mem_mb": s.mem_mb, "nproc": s.nproc,
               "fsize_kb": s.fsize_kb}
        # marshal, not JSON: the zygote runs this interpreter, and one C call decodes it there, code
        # object included.
        data = marshal.dumps(req)
        return struct.pack(">I", len(data)) + data

    def submit(self, code: str, entry_point: str, tests: Sequence[TestCase]) -> Future[RunResult]:
        """Send ``code`` to be run and scored on ``tests``; the future's result is its RunResult."""
        return self._submit(self._request(code, entry_point, [t.args for t in tests]), tests)

    def _submit(self, request: bytes | dict, tests: Sequence[TestCase] | None) -> _Run:
        if isinstance(request, dict):  # a verdict already: nothing to run
            run = _Run(self, b"", tests)
            self._finish(run, request)
            return run
        run = _Run(self, request, tests)
        with self._lock:
            if self._proc is None:
                raise SandboxError("sandbox is closed")
            self._pending.append(run)
            try:
                self._write(request)
            except _ZygoteDied:
                self._recover()
        return run

    def execute(self, code: str, entry_point: str, inputs: Sequence[Sequence[Any]]) -> dict:
        """Raw run: the zygote's reply (per-input values/errors as reported by the child)."""
        return self._submit(self._request(code, entry_point, inputs), None).result()

    def run(self, code: str, entry_point: str, tests: Sequence[TestCase]) -> RunResult:
        """Run ``code`` and score its ``entry_point`` on ``tests``; hidden outputs stay in this process."""
        return self.submit(code, entry_point, tests).result()

    @property
    def in_flight(self) -> int:
        """Programs sent and not yet settled."""
        return len(self._pending)

    def _write(self, frame: bytes) -> None:
        view = memoryview(frame)
        while view:
            try:
                view = view[os.write(self._to, view):]
            except BlockingIOError:
                # The request pipe is full: the zygote may itself be blocked on a full reply pipe.
                # Take in its replies while waiting for room, or both sides would wait forever.
                readable, _, _ = select.select([self._from], [self._to], [])
                if readable:
                    self._read_some()
            except (BrokenPipeError, ConnectionResetError) as err:
                raise _ZygoteDied from err

    def _read_some(self) -> None:
        """Read what the zygote has sent (blocking until something comes) and settle every run whose
        reply is complete."""
        data = os.read(self._from, READ_BYTES)
        if not data:
            raise _ZygoteDied
        buf = self._inbuf
        buf += data
        while len(buf) >= 4:
            (n,) = struct.unpack_from(">I", buf)
            if len(buf) < 4 + n:
                break
            payload = bytes(buf[4:4 + n])
            del buf[:4 + n]
            self._deliver(payload)

    def _next_reply(self) -> dict:
        """The greeting, a fresh zygote's first reply (runs already waiting are sent after it)."""
        self._greeting: dict | None = None
        self._awaiting_greeting = True
        try:
            while self._greeting is None:
                self._read_some()
        finally:
            self._awaiting_greeting = False
        return self._greeting

    def _deliver(self, payload: bytes) -> None:
        if self._awaiting_greeting:
            self._greeting = decode_reply(payload)
            return
        if not self._pending:
            raise SandboxError("sandbox sent a reply nobody asked for")
        run = self._pending.popleft()
        try:
            reply = decode_reply(payload)
        except Exception as err:  # noqa: BLE001 - delivered to the run's caller
            if not run.done():
                run.set_exception(err)
            return
        self._finish(run, reply)

    @staticmethod
    def _finish(run: _Run, reply: dict) -> None:
        if run.done():  # cancelled by its caller
            return
        try:
            if "harness_error" in reply:
                raise SandboxError(f"sandbox harness fault: {reply['harness_error']}")
            run.set_result(reply if run.tests is None else score_reply(reply, run.tests))
        except Exception as err:  # noqa: BLE001 - delivered to the run's caller
            run.set_exception(err)

    def _settle(self, run: _Run) -> None:
        while not run.done():
            # Wait for the zygote's next bytes without the lock: a thread that waits here for one
            # batch's verdicts must not hold up another that is submitting the next batch's programs
            # to this zygote (a slow program keeps its reply away for up to wall_s). The read itself
            # is under the lock, only once data is there; the timeout bounds a wait on a pipe that a
            # recovery replaced meanwhile.
            with self._lock:
                if run.done():
                    return
                if self._proc is None:
                    run.set_exception(SandboxError("sandbox is closed"))
                    return
                fd = self._from
            # OSError / ValueError: a recovery or close() closed the fd meanwhile; look again under the lock.
            with contextlib.suppress(OSError, ValueError):
                select.select([fd], [], [], SETTLE_POLL_S)
            with self._lock:
                if run.done() or self._proc is None:
                    continue
                if fd != self._from or not select.select([fd], [], [], 0)[0]:
                    continue  # another thread took what arrived, nothing yet, or a new zygote's pipe
                try:
                    self._read_some()
                except _ZygoteDied:
                    self._recover()

    def _recover(self) -> None:
        """The fork server died (killed from outside): start a fresh one and send it every run still
        waiting. The run it was working on is tried once more; dying on it twice fails that run."""
        self._kill()
        if self._pending and self._pending[0].retried:
            self._pending.popleft().set_exception(SandboxError("sandbox fork server died twice in a row"))
        try:
            self._start()
        except SandboxError as err:
            while self._pending:
                self._pending.popleft().set_exception(err)
            raise
        if self._pending:
            self._pending[0].retried = True
        for run in list(self._pending):
            try:
                self._write(run.frame)
            except _ZygoteDied:
                return  # found out by the next read, which recovers again

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def close(self) -> None:
        with self._lock:
            if self._proc is None:
                return
            if self._proc.poll() is None:
                try:
                    if self._pending:  # nobody will read these replies: do not wait for the runs
                        self._kill()
                    else:
                        self._proc.stdin.close()
                        self._proc.wait(timeout=5)
                except (OSError, subprocess.TimeoutExpired):
                    self._kill()
            for stream in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
                if stream:
                    with contextlib.suppress(OSError):
                        stream.close()
            self._proc = None
            while self._pending:
                self._pending.popleft().set_exception(SandboxError("sandbox closed before the run finished"))

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # Not contextlib.suppress: at interpreter exit module globals may already be None, and the
        # lookup itself would raise ("Exception ignored in __del__" on every run's stderr).
        try:  # noqa: SIM105
            self.close()
        except Exception:  # noqa: BLE001 - nothing to report to at garbage collection
            pass


class _ZygoteDied(Exception):
    """End of file or a broken pipe on the zygote's pipes."""


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


# The C scanner under json.loads, called directly: json.loads runs three Python functions around it
# on every line, and every program reports several lines. It keeps no state between calls.
_SCAN = json.scanner.c_make_scanner(json.JSONDecoder())
_SPACE = json.decoder.WHITESPACE.match


def _loads(raw: bytes, _scan=_SCAN, _space=_SPACE, _loads=json.loads):
    """json.loads(raw), faster for a UTF-8 line: anything the direct path does not take (other
    encodings, a byte-order mark, not JSON at all) goes through json.loads itself."""
    try:
        text = raw.decode()
        value, end = _scan(text, _space(text, 0).end())
        if _space(text, end).end() == len(text):
            return value
    except (ValueError, StopIteration):
        pass
    return _loads(raw)


def decode_lines(output: bytes, truncated: bool = False) -> list:
    """A child's output, one JSON value per non-blank line (``{"garbage": True}`` where a line is not
    JSON). Of an output that went over the limit only the first TRUNCATED_LINES count: such a run
    has failed, and its head and first reports are all that scoring needs."""
    lines: list = []
    for raw in output.split(b"\n"):
        if truncated and len(lines) >= TRUNCATED_LINES:
            break
        if raw.strip():
            try:
                lines.append(_loads(raw))
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
    """A few fork servers used side by side (the work happens in their child processes)."""

    def __init__(self, settings: SandboxSettings | None = None, size: int | None = None):
        self.settings = settings or SandboxSettings()
        self.size = size or self.settings.pool_size
        self.sandboxes = [Sandbox(self.settings) for _ in range(self.size)]
        self._next, self._next_lock = 0, threading.Lock()
        self.isolation = self.sandboxes[0].isolation
        self.isolation_reason = self.sandboxes[0].isolation_reason

    def submit(self, code: str, entry_point: str, tests: Sequence[TestCase]) -> Future[RunResult]:
        """Send a run to the zygote with the fewest runs in flight and return at once."""
        with self._next_lock:
            start = self._next
            self._next += 1
        sandbox = min((self.sandboxes[(start + k) % self.size] for k in range(self.size)), key=lambda sb: sb.in_flight)
        return sandbox.submit(code, entry_point, tests)

    def run(self, code: str, entry_point: str, tests: Sequence[TestCase]) -> RunResult:
        return self.sandboxes[0].run(code, entry_point, tests)

    def close(self) -> None:
        for sb in self.sandboxes:
            sb.close()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
