"""Sandbox fork server: runs model-written programs in isolated, resource-limited children.

Started by :class:`offline_rl.sandbox.Sandbox` with ``python -I -S``, which imports this module by its
path and calls :func:`main` (``python -I -S sandbox_zygote.py MODE`` works too, at the cost of
compiling the script on every start); it imports only the standard library (no site-packages, no
project code), so it runs from its path alone.

Why a fork server: a fork of this small warm interpreter costs a small fraction of a fresh one's start,
and GRPO scores thousands of programs. The zygote itself never runs model code (it only compiles it,
as the parent's syntax pre-check already did); each program runs in a forked child that, before
running any of it:

* starts a new session (process group) and gets CPU-time, address-space, process-count, file-size,
  open-file and core-dump limits;
* ``namespace`` mode (root): the zygote sits in its own network namespace (no interfaces up, so
  nothing is reachable), has no supplementary groups and has ``no_new_privs`` set, all of which
  every child inherits; the child chroots into a fresh empty directory and drops to a uid of its
  own (``UID_BASE + zygote pid``, so concurrent sandboxes never share a process-count budget); it
  cannot see the host filesystem, the harness or the parent;
* ``inprocess`` mode (fallback without privileges): an audit hook, which Python code cannot remove,
  refuses sockets, process creation and any ``open`` outside the child's fresh directory.

In ``namespace`` mode the run directories live on a size-capped tmpfs (``SCRATCH_MB``) mounted in
the zygote's own mount namespace: the host never sees it, it vanishes with the zygote, a program
cannot fill the host's disk, and creating and removing a run directory there is much cheaper than
on the disk. A child costs one fork; the uid sweep (a second fork) runs only when something
outlived the program (see ``_has_children``).

The zygote receives only the program, the entry point and the test *inputs*; expected outputs never
leave the parent, which compares the values this child reports. So a program that patches a
comparison, exits early with status 0 or prints "all tests passed" gains nothing: a test passes only
if the parent sees the right value for it.

Wire format: frames of a 4-byte big-endian length and a payload. Requests are ``marshal`` data
(from the parent, which runs this same interpreter; never from a program); a reply
starts with a kind byte (``JSON_REPLY`` or ``RUN_REPLY``). A run's reply carries the child's output
as the child wrote it, not decoded here: the parent decodes the report lines, which it must do
anyway, and the zygote's own work per run (all of it on pages that each fork write-protects again,
so first writes are page faults) stays small.
"""

# Modules a program may use: imported here because a chrooted child cannot import anything new.
import bisect  # noqa: F401
import collections  # noqa: F401
import contextlib
import ctypes
import fcntl
import functools  # noqa: F401
import gc
import heapq  # noqa: F401
import itertools
import json
import marshal
import math  # noqa: F401
import operator  # noqa: F401
import os
import random  # noqa: F401
import re  # noqa: F401
import resource
import select
import signal
import socket  # noqa: F401  (so that the network test exercises the namespace, not an ImportError)
import string  # noqa: F401
import struct
import sys
import time
import types
import warnings

# shutil imports zlib, bz2 and lzma when it can (for archives, unused here): three extension modules
# and their shared libraries, whose memory mappings every fork copies and every child faults on.
# Hide them while it imports; programs never had them on purpose.
_ARCHIVERS = ("zlib", "bz2", "_bz2", "lzma", "_lzma")
for _name in _ARCHIVERS:
    sys.modules.setdefault(_name, None)  # type: ignore[assignment]
import shutil  # noqa: E402
import tempfile  # noqa: E402

for _name in _ARCHIVERS:
    if sys.modules.get(_name, 0) is None:
        del sys.modules[_name]

CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
MNT_DETACH = 0x2
SCRATCH_MB = 256
"""Size of the run directories' tmpfs: the files all runs of one zygote may hold at once (a program
exceeding it gets ENOSPC, like a full disk)."""
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
UID_BASE = 200_000
MAX_OUTPUT = 1 << 20
TRUNCATED_LINES = 1000  # report lines the parent decodes of a run that exceeded MAX_OUTPUT
RESULT_FD = 3
COMPILE_IN_ZYGOTE_MAX = 16 << 10
"""Sources up to this many characters are compiled before the fork (by the parent, which sends the
code object, or here); larger ones by the child, under its CPU and memory limits (compile time
grows with the source)."""

JSON_REPLY, RUN_REPLY = b"J", b"R"
"""A reply's first byte: a JSON object follows (the greeting, a verdict without a child, a harness
fault), or a run: RUN_HEAD, then the child's output as it wrote it (decoded by the parent)."""
RUN_HEAD = struct.Struct(">??iiddd")
"""killed, truncated, terminating signal (-1: none), exit status (-1: none), wall seconds, the
child's CPU seconds, the zygote's CPU seconds for the run."""

_libc = ctypes.CDLL(None, use_errno=True)
# PyDLL, not CDLL: the call keeps the GIL, so the child comes back from fork() holding it, as after
# os.fork(). See _fork for why the zygote does not use os.fork() for the programs' children.
_libc_fork = ctypes.PyDLL(None, use_errno=True).fork
_libc_fork.argtypes = []
_libc_fork.restype = ctypes.c_int


def _read_frame(stream):
    head = stream.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    return marshal.loads(stream.read(n))


def _write_frame(fd: int, *parts: bytes) -> None:
    data = b"".join(parts)
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def _write_json(fd: int, obj) -> None:
    _write_frame(fd, JSON_REPLY, json.dumps(obj).encode("utf-8"))


def _write_run(fd: int, result, zygote_cpu_s: float) -> None:
    *head, output = result
    _write_frame(fd, RUN_REPLY, RUN_HEAD.pack(*head, zygote_cpu_s), output)


def _setup_isolation(requested: str) -> tuple[str, str]:
    """Enter a new network namespace when possible; returns (mode, reason)."""
    if requested == "inprocess":
        return "inprocess", "requested"
    if os.geteuid() != 0:
        reason = "not root: namespaces, chroot and setuid are unavailable"
    elif _libc.unshare(CLONE_NEWNET) != 0:
        reason = f"unshare(CLONE_NEWNET) failed: {os.strerror(ctypes.get_errno())}"
    else:
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        return "namespace", "own network namespace, chroot, dropped uid"
    if requested == "namespace":
        raise SystemExit(f"namespace isolation requested but unavailable: {reason}")
    return "inprocess", reason


def _private_scratch() -> str | None:
    """A tmpfs for the run directories, mounted in a mount namespace of the zygote's own; None
    (the caller uses the host's temp directory) when that is unavailable."""
    _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    _libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    if _libc.unshare(CLONE_NEWNS) != 0:
        return None
    # Without private propagation the mount below would appear in the host's namespace too.
    if _libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return None
    base = tempfile.mkdtemp(prefix="rtrl-sandbox-")
    opts = f"size={SCRATCH_MB}m,mode=0711".encode()
    if _libc.mount(b"tmpfs", base.encode(), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts) != 0:
        os.rmdir(base)
        return None
    return base


def _audit_guard(root: str):
    """In-process fallback: refuse network, new processes and files outside ``root``."""
    root = os.path.realpath(root)
    blocked_prefixes = ("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
                        "os.fork", "os.forkpty", "pty.", "ctypes.", "os.kill", "os.killpg", "signal.")

    def hook(event, args):
        if event.startswith(blocked_prefixes):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path = args[0]
            if isinstance(path, int):
                return
            full = os.path.realpath(os.path.join(root, os.fsdecode(path)))
            if full != root and not full.startswith(root + os.sep):
                raise PermissionError(f"sandbox: open outside the working directory: {path!r}")
        if event in ("os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
                     "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "os.listdir", "os.scandir"):
            for path in args[:2]:
                if isinstance(path, str | bytes):
                    full = os.path.realpath(os.path.join(root, os.fsdecode(path)))
                    if full != root and not full.startswith(root + os.sep):
                        raise PermissionError(f"sandbox: {event} outside the working directory")

    return hook


class _TestTimeout(BaseException):
    """Raised by SIGALRM inside the child when one test exceeds its time (BaseException: a bare
    ``except Exception`` in the program does not swallow it)."""


def _limits(req) -> tuple[tuple[int, tuple[int, int]], ...]:
    """The rlimits a child sets on itself, built by the zygote before the fork."""
    cpu, mem, nproc = int(req["cpu_s"]), int(req["mem_mb"]) << 20, int(req["nproc"])
    fsize = int(req["fsize_kb"]) << 10
    return ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (mem, mem)),
            (resource.RLIMIT_FSIZE, (fsize, fsize)), (resource.RLIMIT_NOFILE, (32, 32)),
            (resource.RLIMIT_CORE, (0, 0)), (resource.RLIMIT_NPROC, (nproc, nproc)))


# The module functions the child calls are its default arguments: looking them up on their modules
# in each child misses the interpreter's type-attribute cache and writes to it (and to the bytecode's
# warm-up counters), copying those pages in every child. Bound here, they are local variables.
def _child(req, code, workdir: str, mode: str, uid: int, write_fd: int, limits, devnull: int,
           _setsid=os.setsid, _dup2=os.dup2, _closerange=os.closerange, _setrlimit=resource.setrlimit,
           _chroot=os.chroot, _chdir=os.chdir, _setgid=os.setgid, _setuid=os.setuid, _setitimer=signal.setitimer,
           _real=signal.ITIMER_REAL, _exit=os._exit) -> None:
    """Runs in the forked child; never returns.

    In ``namespace`` mode the zygote has already dropped its supplementary groups and set
    ``no_new_privs`` on itself (see main), so every child starts with both."""
    try:
        _setsid()
        _dup2(devnull, 0)  # before fd 3 is taken over below: the zygote's devnull may be fd 3
        _dup2(devnull, 1)
        _dup2(devnull, 2)
        if write_fd != RESULT_FD:
            _dup2(write_fd, RESULT_FD)
        _closerange(RESULT_FD + 1, 1 << 16)  # the zygote's descriptors, devnull's own included
        for which, limit in limits:
            _setrlimit(which, limit)
        if mode == "namespace":
            _chroot(workdir)
            _chdir("/")
            _setgid(uid)
            _setuid(uid)
        else:
            _chdir(workdir)
            sys.addaudithook(_audit_guard(workdir))
    except BaseException as err:  # a setup failure must never run the program unconfined
        os.write(RESULT_FD, (json.dumps({"setup_error": repr(err)}) + "\n").encode())
        os._exit(3)

    if code is None:  # too large to compile in the zygote: compile here, under the limits
        try:
            code = compile(req["code"], "<program>", "exec", dont_inherit=True)
        except (SyntaxError, ValueError, MemoryError, RecursionError, OverflowError) as err:
            _emit({"compile_error": f"{type(err).__name__}: {err}"})
            _exit(0)
    per_test = float(req["per_test_s"])
    namespace = {"__name__": "__sandbox__", "__builtins__": __builtins__}
    try:
        _setitimer(_real, per_test)
        exec(code, namespace)
        _setitimer(_real, 0)
        fn = namespace[req["entry"]]
    except _TestTimeout:
        _emit({"load_error": "timeout while loading the program"})
        _exit(0)
    except BaseException as err:
        _emit({"load_error": f"{type(err).__name__}: {err}"[:300]})
        _exit(0)
    _run_tests(fn, req["inputs"], per_test)
    _exit(0)  # bound before the program ran: rebinding os._exit cannot keep this child going


# The child's reporting code lives at module level, not in closures made by each child, so that
# the zygote can run it first (_warm_up): a child then inherits it already specialised instead of
# rewriting (copying) those pages itself. Default arguments are its own references: the program
# may rebind globals and builtins.
#
# A report is encoded by one C encoder made here, with json.dumps' defaults (so the same text): the
# json.dumps path builds a JSONEncoder and a C encoder in Python code on every call, copying pages
# in every child. The encoder's circular-reference markers are emptied before each report, as a
# fresh dumps call would have them (an encoding that failed half-way may leave some behind).
_MARKERS: dict = {}
_ENCODE = json.encoder.c_make_encoder(
    _MARKERS, json.JSONEncoder().default, json.encoder.encode_basestring_ascii, None, ": ", ", ", False, False,
    True) if json.encoder.c_make_encoder is not None else None


def _emit(obj, fd: int = RESULT_FD, _write=os.write, _encode=_ENCODE, _clear=_MARKERS.clear, _join="".join,
          _dumps=json.dumps) -> None:
    if _encode is not None:
        _clear()
        data = (_join(_encode(obj, 0)) + "\n").encode()
    else:  # no C accelerator in this build
        data = (_dumps(obj) + "\n").encode()
    while data:
        data = data[_write(fd, data):]


def _run_tests(fn, inputs, per_test: float, fd: int = RESULT_FD, _emit=_emit, _setitimer=signal.setitimer,
               _real=signal.ITIMER_REAL, _enumerate=enumerate, _type=type) -> None:
    for i, args in _enumerate(inputs):
        try:
            _setitimer(_real, per_test)
            value = fn(*args)
            _setitimer(_real, 0)
            try:
                _emit({"i": i, "value": value}, fd)
            except (TypeError, ValueError, OverflowError) as err:
                _emit({"i": i, "error": f"unserialisable result: {_type(err).__name__}"}, fd)
        except _TestTimeout:
            _emit({"i": i, "timeout": True}, fd)
        except BaseException as err:
            _setitimer(_real, 0)
            _emit({"i": i, "error": f"{_type(err).__name__}: {err}"[:300]}, fd)


def _sweep(uid: int) -> None:
    """Kill every process of the child's uid (descendants that escaped the process group with
    setsid): a helper drops to that uid and signals everything it may signal."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            # kill(-1) reports success even when it finds nothing (EPERM on others' processes is
            # not an error), so it cannot tell us when we are done. A SIGKILLed process cannot fork
            # again, so a few passes catch children created while the first pass ran.
            for _ in range(3):
                os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _has_children() -> bool:
    """Whether any process outlived the program's main process.

    The zygote is the child subreaper, so when a process of the program dies its children are
    re-parented to the nearest living ancestor, and that chain always ends at the zygote: every
    surviving descendant (one that left the process group with setsid included) is, or descends
    from, a child of the zygote. The program's uid is the zygote's own (``UID_BASE + pid``) and
    only the program's tree ever runs under it, so "the zygote has no child" means "no process of
    that uid exists", and the sweep (a second fork per program) can be skipped. Any child,
    live or zombie, means something was left: the caller sweeps as before."""
    try:
        os.waitpid(-1, os.WNOHANG)  # reaps one zombie if there is one: it still counts as left over
    except ChildProcessError:
        return False
    return True


def _reap_orphans(deadline_s: float = 1.0) -> None:
    """As child subreaper the zygote adopts orphaned grandchildren. After the sweep they are all
    dying; wait for them (bounded) so that no zombie of the program's uid outlives the run."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if time.monotonic() > end:
                return
            time.sleep(0.001)


def _make_roomy(fd: int) -> bool:
    """Let the result pipe hold MAX_OUTPUT (fs.pipe-max-size allows 1 MiB by default), so a child
    never blocks on it before it has written too much anyway."""
    try:
        return fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, MAX_OUTPUT) >= MAX_OUTPUT
    except OSError:
        return False


def _collect_streaming(r: int, deadline: float) -> tuple[list[bytes], bool, bool]:
    """Read reports as they arrive until every writer closed the pipe, the deadline passes, or the
    output exceeds MAX_OUTPUT. Returns (chunks, killed, truncated)."""
    chunks, size = [], 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return chunks, True, False
        ready, _, _ = select.select([r], [], [], left)
        if not ready:
            continue
        data = os.read(r, 65536)
        if not data:
            return chunks, False, False
        size += len(data)
        if size > MAX_OUTPUT:
            return chunks, True, True
        chunks.append(data)


def _collect_at_exit(r: int, pid: int, deadline: float) -> tuple[list[bytes], bool, bool]:
    """:func:`_collect_until_exit` for a child known by its pid: (chunks, killed, truncated)."""
    pidfd = os.pidfd_open(pid)
    try:
        return _collect_until_exit(r, pidfd, deadline)[:3]
    finally:
        os.close(pidfd)


def _collect_until_exit(r: int, pidfd: int, deadline: float) -> tuple[list[bytes], bool, bool, bool]:
    """With room for all the output it may send, sleep until the child exits (or the deadline) and
    then take what it wrote. A zygote woken by every line costs the child more CPU (by the child's
    own CPU clock) than all its tests, where a zygote that waits for the exit costs it next to
    nothing. A child that fills the pipe blocks and is killed at the deadline; a descendant still
    holding the write end is not waited for (the sweep kills it). Returns (chunks, killed, truncated,
    exited); the caller's pidfd serves the exit wait after this one too."""
    exited = bool(select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))[0])
    os.set_blocking(r, False)
    chunks, size = [], 0
    # Bounded: a child that has not exited may still be writing as fast as this loop reads.
    while size < MAX_OUTPUT:
        try:
            data = os.read(r, 65536)
        except BlockingIOError:  # drained while a descendant holds the write end
            break
        if not data:
            break
        chunks.append(data)
        size += len(data)
    if size >= MAX_OUTPUT:  # the pipe was full: the child was blocked on it
        return chunks, True, True, exited
    return chunks, not exited, False, exited


_runs = itertools.count()


def _compile(program):
    """The program's code object before the fork, so that the child neither builds nor copies the
    compiler's pages (a noticeable share of a run): as the parent sends it (it compiles sources up to
    COMPILE_IN_ZYGOTE_MAX itself), or compiled here from a small source. None for a source too
    large to compile quickly: the child compiles it, under its limits. Compiling runs nothing of
    the program."""
    if isinstance(program, types.CodeType):
        return program
    if len(program) > COMPILE_IN_ZYGOTE_MAX:
        return None
    return compile(program, "<program>", "exec", dont_inherit=True)


def _fork() -> int:
    """fork(2) without the interpreter's fork hooks: the programs' children are made by this.

    ``os.fork()`` runs the at-fork callbacks registered in the zygote (``random`` reseeds its
    generator in every child, in Python code) and re-initialises the interpreter's locks and thread
    state in the child, which costs every child CPU time and copied pages. None of that has
    anything to do here. The zygote is single-threaded (``threading`` is never imported, no thread
    is started), so no lock can be held by another thread at the fork; the fork happens in plain
    code, not while importing; and the forking thread keeps the GIL across the call (PyDLL), so the
    child resumes holding it, as after ``os.fork()``. The one visible difference: without the
    reseed every child starts from the zygote's ``random`` state, so a program that uses ``random``
    draws the same numbers on every run (its reward does not depend on the draw)."""
    pid = _libc_fork()
    if pid < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return pid


def _run(req, base: str, mode: str, uid: int, devnull: int):
    """Run one program. Returns a dict (a verdict without a child: a compile error) or the tuple
    (killed, truncated, signal or -1, exit status or -1, wall seconds, child CPU seconds, output):
    the output is the child's report lines as it wrote them; the parent decodes them."""
    try:
        code = _compile(req["code"])
    except (SyntaxError, ValueError, MemoryError, RecursionError, OverflowError) as err:
        return {"lines": [{"compile_error": f"{type(err).__name__}: {err}"}], "killed": False, "truncated": False,
                "signal": None, "exit_code": None, "wall_s": 0.0, "cpu_s": 0.0}
    limits = _limits(req)
    # A counter, not mkdtemp: the base directory is ours alone (private tmpfs, or mode 0711), so
    # names need not be unguessable, and one mkdir replaces mkdtemp's name search and chmod.
    while True:
        workdir = f"{base}/run-{next(_runs)}"
        try:
            os.mkdir(workdir, 0o700)
            break
        except FileExistsError:  # left behind by a program whose files could not be removed
            continue
    if mode == "namespace":
        os.chown(workdir, uid, uid)
    r, w = os.pipe()
    roomy = _make_roomy(r)
    t0 = time.monotonic()
    pid = _fork()
    if pid == 0:
        os.close(r)
        _child(req, code, workdir, mode, uid, w, limits, devnull)
    os.close(w)
    pidfd = os.pidfd_open(pid)
    try:
        deadline = t0 + float(req["wall_s"])
        if roomy:
            chunks, killed, truncated, exited = _collect_until_exit(r, pidfd, deadline)
        else:
            (chunks, killed, truncated), exited = _collect_streaming(r, deadline), False
        os.close(r)
        if killed:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        # The result pipe is closed: the program is done or we stop waiting for it. Give a finished
        # child a moment to exit, then kill whatever remains.
        if not exited:
            select.select([pidfd], [], [], 0 if killed else max(0.0, min(0.1, deadline - time.monotonic())))
    finally:
        os.close(pidfd)
    # wait4, not waitpid: the same reaping, plus the program's CPU time for the caller's accounting.
    done, status, usage = os.wait4(pid, os.WNOHANG)
    if not done:
        killed = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        _, status, usage = os.wait4(pid, 0)
    if mode != "namespace":
        _reap_orphans()
    elif _has_children():
        _sweep(uid)
        _reap_orphans()
    try:
        os.rmdir(workdir)  # most programs write nothing: one syscall instead of rmtree's walk
    except OSError:
        shutil.rmtree(workdir, ignore_errors=True)
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1
    exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1
    return (killed, truncated, sig, exit_code, time.monotonic() - t0, usage.ru_utime + usage.ru_stime,
            b"".join(chunks))


def _on_alarm(signum, frame):
    raise _TestTimeout()


def _warm_up() -> None:
    """Do once here what every forked child would otherwise redo on its own copy-on-write pages.

    The first ``compile()`` in an interpreter builds all the AST node types (PyAST_Check runs on
    every call): a large share of a child's CPU. The SIGALRM handler a child needs is set here too
    (the zygote arms a timer only in the warm-up below, around calls that return at once).
    ``gc.freeze()`` then moves everything the zygote holds to the permanent generation, so a
    collection in a child does not walk (and write, hence copy) the zygote's objects."""
    compile("pass", "<warm-up>", "exec")
    signal.signal(signal.SIGALRM, _on_alarm)
    # Compiler warnings about a program (SyntaxWarning...) would go to our stderr, a pipe nobody
    # reads while we run: enough of them would block the zygote.
    warnings.simplefilter("ignore")
    # Run the children's reporting path here until the interpreter has specialised it (a few
    # dozen calls), so that each child inherits that instead of redoing it (less work and fewer copied
    # pages per child). Nothing of any program runs here.
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for _ in range(20):
            _run_tests(lambda x: x, [[1], [2.5], [[1, 2]], [None], ["a"], [{"k": 1}]], 1.0, devnull)
    finally:
        os.close(devnull)
    gc.collect()
    gc.freeze()


def main() -> None:
    requested = sys.argv[1] if len(sys.argv) > 1 else "auto"
    mode, reason = _setup_isolation(requested)
    uid = UID_BASE + os.getpid()
    if mode == "namespace":
        # Once here, before the first child, instead of in every child (each inherits both): the
        # zygote itself never executes a file and needs no group but its own.
        os.setgroups([])
        if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise SystemExit(f"prctl(PR_SET_NO_NEW_PRIVS) failed: {os.strerror(ctypes.get_errno())}")
    _warm_up()
    scratch = _private_scratch() if mode == "namespace" else None
    base = scratch or tempfile.mkdtemp(prefix="rtrl-sandbox-")
    if scratch is not None:
        reason += f", run directories on a private {SCRATCH_MB} MiB tmpfs"
    os.chmod(base, 0o711)  # the dropped uid may enter its own run directory, not list others
    devnull = os.open(os.devnull, os.O_RDWR)  # the children's stdin, stdout and stderr
    stdin, stdout = sys.stdin.buffer, sys.stdout.fileno()
    # Nothing but frames may reach stdout.
    sys.stdout = sys.stderr
    _write_json(stdout, {"ready": True, "isolation": mode, "reason": reason, "uid": uid})
    try:
        while True:
            req = _read_frame(stdin)
            if req is None:
                break
            c0 = time.process_time()
            try:
                result = _run(req, base, mode, uid, devnull)
            except Exception as err:  # report the harness fault instead of dying silently
                result = {"harness_error": repr(err)}
            # The fork server's own share of a run (fork, directory, pipe, reaping): with cpu_s it is
            # what a program costs the machine, which rollout CPU accounting cannot see otherwise.
            zygote_cpu_s = time.process_time() - c0
            if isinstance(result, dict):
                _write_json(stdout, {**result, "zygote_cpu_s": zygote_cpu_s})
            else:
                _write_run(stdout, result, zygote_cpu_s)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if scratch is not None:  # the host side is an empty mount point: remove it too
            _libc.umount2(scratch.encode(), MNT_DETACH)
            with contextlib.suppress(OSError):
                os.rmdir(scratch)


if __name__ == "__main__":
    main()
