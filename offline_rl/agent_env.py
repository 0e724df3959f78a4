"""The agent environment: multi-turn tool use over a repository task.

The context opens with the issue and the tool list; every turn the policy writes one command line
after ``$ `` and the environment appends the tool's output and a fresh ``$ ``::

    # issue: area returns wrong values
    # tools: ls | cat FILE | grep TEXT | edit FILE LINE TEXT | test | submit
    $ grep def area
    geom.py:2:def area(x): return x*2+1
    $ test
    FAIL area: got 1 3 5 15 want area(0)=5 area(1)=8 area(2)=11 area(7)=26
    $ edit geom.py 2 def area(x): return x*3+5
    ok
    $ test
    PASS 4/4
    $ submit

The tools:

* ``ls``: the repository's files;
* ``cat FILE`` / ``cat FILE A-B``: numbered lines;
* ``grep TEXT``: ``file:line:text`` for every line containing TEXT (plain text, not a regex);
* ``edit FILE LINE TEXT``: replace line LINE with TEXT (LINE = last + 1 appends; a new file may be
  started at line 1); test files are read-only;
* ``test``: the *visible* tests, run in the sandbox on the working copy, summarised one line per
  failing function (wanted values, what came back);
* ``submit``: end the episode; the reward runs the *hidden* tests on the working copy.

With a context budget (``context_budget`` > 0), an episode that would outgrow it is asked to summarise
its work (:data:`policy.summary.SUMMARY_REQUEST`, written on the prompt line) and goes on from a fresh context
(:meth:`RepoEnv.restart`): the task header, the summary and (``summary_carry``) the last command
and its output; the working copy is kept. The token accounting is the rollout's
(:func:`offline_rl.rollout.play_episodes`).

A malformed command, a path that leaves the repository, a missing file or a tool that times out
gives an error observation and the episode goes on (the policy may recover); nothing but ``submit``
earns a reward, and an episode that reaches ``max_turns`` without submitting earns 0.

Model-written code runs only in the sandbox (:class:`SandboxTests`). :class:`TrustedTests` executes
in-process and exists for code this project generated itself (the demonstrations of the mid-training
corpus), never for a policy's edits.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from offline_rl.repo_tasks import RepoTask, RepoTest, is_test_file, module_of, safe_path
from offline_rl.sandbox import RunResult, Sandbox, SandboxPool, TestResult, canonical
from offline_rl.tasks import TestCase
from policy.summary import SUMMARY_PREFIX, clean_summary

TOOLS = "ls | cat FILE | grep TEXT | edit FILE LINE TEXT | test | submit"
PROMPT = "$ "
MAX_OBS_LINES = 8
MAX_LINE_CHARS = 120
MAX_EDIT_CHARS = 160
ENTRY = "check"
CARRY = ("last_observation", "none")

# The program the sandbox runs: the working copy's modules, each executed in a module object of its
# own whose ``import`` resolves the repository's other modules first (nothing is registered in
# ``sys.modules``), and ``check(module, function, *args)``, the entry point every test calls. A module
# that fails to load reports its error on each call that needs it instead of taking the run down.
_BOOT = '''import builtins, types
_SRC = {sources}
_MODS = {{_n: types.ModuleType(_n) for _n in _SRC}}
_ERR = {{}}
def _import(name, globals=None, locals=None, fromlist=(), level=0, _real=builtins.__import__):
    if level == 0 and name in _MODS:
        return _MODS[name]
    return _real(name, globals, locals, fromlist, level)
_BUILTINS = dict(vars(builtins), __import__=_import)
for _name, _text in _SRC.items():
    _MODS[_name].__dict__["__builtins__"] = _BUILTINS
    try:
        exec(compile(_text, _name + ".py", "exec"), _MODS[_name].__dict__)
    except BaseException as _e:
        _line = getattr(_e, "lineno", None)
        _ERR[_name] = type(_e).__name__ + " in " + _name + ".py" + (" line " + str(_line) if _line else "")
def check(module, function, *args):
    if module in _ERR:
        raise RuntimeError(_ERR[module])
    fn = getattr(_MODS.get(module), function, None)
    if fn is None:
        raise AttributeError(module + " has no " + function)
    return fn(*args)
'''


def _load_order(files: dict[str, str]) -> list[str]:
    """Source modules, those that import no other repository module first (test files excluded)."""
    mods = {module_of(p): text for p, text in sorted(files.items()) if not is_test_file(p) and p.endswith(".py")}

    def imports_others(text: str) -> bool:
        return any(line.startswith(("import ", "from ")) and line.split()[1].split(".")[0] in mods
                   for line in text.splitlines())

    return sorted(mods, key=lambda m: (imports_others(mods[m]), m))


def program(files: dict[str, str]) -> str:
    mods = {module_of(p): text for p, text in files.items() if not is_test_file(p) and p.endswith(".py")}
    ordered = {m: mods[m] for m in _load_order(files)}
    return _BOOT.format(sources=repr(ordered))


def as_cases(tests: Sequence[RepoTest]) -> list[TestCase]:
    return [TestCase([t.module, t.function, *t.args], t.expected) for t in tests]


class TestRunner(Protocol):
    def submit(self, files: dict[str, str], tests: Sequence[RepoTest]) -> Future[RunResult] | RunResult: ...


class SandboxTests:
    """Runs a working copy's tests in the sandbox (the only runner for model-written code)."""

    def __init__(self, sandbox: Sandbox | SandboxPool):
        self.sandbox = sandbox

    def submit(self, files: dict[str, str], tests: Sequence[RepoTest]) -> Future[RunResult]:
        return self.sandbox.submit(program(files), ENTRY, as_cases(tests))


class TrustedTests:
    """In-process runner for code generated by this project (corpus demonstrations), never for a policy's.

    Same program, same comparison as the sandbox path, so the observations are identical."""

    def submit(self, files: dict[str, str], tests: Sequence[RepoTest]) -> RunResult:
        namespace: dict[str, Any] = {"__name__": "__demo__"}
        exec(compile(program(files), "<demo>", "exec"), namespace)  # trusted: generated by this project
        results, values = [], []
        for i, case in enumerate(as_cases(tests)):
            try:
                value = json.loads(json.dumps(namespace[ENTRY](*case.args)))
            except Exception as err:  # noqa: BLE001 - reported the way the sandbox reports it
                results.append(TestResult(i, "error", f"{type(err).__name__}: {err}"))
                values.append(None)
                continue
            ok = canonical(value) == canonical(case.expected)
            results.append(TestResult(i, "passed" if ok else "failed", None if ok else f"got {value}"))
            values.append(value)
        return RunResult(tests=results, compiled=True, values=values)


def summarise(tests: Sequence[RepoTest], run: RunResult) -> str:
    """The ``test`` tool's output: ``PASS n/n``, or one line per failing function."""
    if run.error and not run.tests:
        return f"error: {run.error}"[:MAX_LINE_CHARS]
    if run.all_passed:
        return f"PASS {len(tests)}/{len(tests)}"
    by_fn: dict[tuple[str, str], list[int]] = {}
    for i, t in enumerate(tests):
        by_fn.setdefault((t.module, t.function), []).append(i)
    lines = []
    for (_, fn), idx in by_fn.items():
        if all(run.tests[i].status == "passed" for i in idx):
            continue
        want = " ".join(f"{tests[i].call()}={json.dumps(tests[i].expected)}" for i in idx)
        got = []
        for i in idx:
            r = run.tests[i]
            if r.status in ("passed", "failed"):
                got.append(json.dumps(run.values[i]) if i < len(run.values) else "?")
            else:
                detail = (r.detail or r.status).split(": ", 1)[-1] if r.status == "error" else r.status
                got = [f"error {detail}"]
                break
        # What came back first, what is wanted last: the wanted values end the line, next to the edit
        # that has to produce them.
        lines.append(f"FAIL {fn}: got {' '.join(got)} want {want}"[:MAX_LINE_CHARS])
    return "\n".join(lines[:MAX_OBS_LINES])


@dataclass
class Action:
    """One parsed command line (``error`` set when it could not be parsed)."""

    tool: str
    args: list[str] = field(default_factory=list)
    text: str = ""
    error: str | None = None


def parse_command(line: str) -> Action:
    text = line.strip()
    if not text:
        return Action("error", error="empty command")
    head, _, rest = text.partition(" ")
    rest = rest.strip()
    if head in ("ls", "test", "submit"):
        return Action(head) if not rest else Action("error", error=f"{head} takes no arguments")
    if head == "cat":
        parts = rest.split()
        if len(parts) not in (1, 2):
            return Action("error", error="usage: cat FILE [A-B]")
        return Action("cat", parts)
    if head == "grep":
        return Action("grep", text=rest) if rest else Action("error", error="usage: grep TEXT")
    if head == "edit":
        parts = rest.split(" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            return Action("error", error="usage: edit FILE LINE TEXT")
        return Action("edit", parts[:2], text=parts[2] if len(parts) == 3 else "")
    return Action("error", error=f"unknown command {head[:20]!r}")


@dataclass
class Turn:
    action: str
    tool: str
    observation: str = ""
    ok: bool = True
    tests_passed: bool | None = None  # for `test` turns


@dataclass
class RepoState:
    task: RepoTask
    context: str
    files: dict[str, str]
    turns: list[Turn] = field(default_factory=list)
    done: bool = False
    submitted: bool = False
    truncated: bool = False
    segment_turns: int = 0
    """Tool turns since the current context began (a fresh context with none cannot be summarised)."""

    @property
    def submission(self) -> str | None:
        """A key for the submitted working copy (episodes with identical copies are scored once)."""
        return json.dumps(self.files, sort_keys=True) if self.submitted else None


@dataclass(frozen=True)
class Submission:
    key: str
    code: str
    entry_point: str
    tests: list[TestCase]


def header(task: RepoTask) -> str:
    return f"# issue: {task.issue}\n# tools: {TOOLS}\n{PROMPT}"


class RepoEnv:
    """``reset(task) -> state``; ``step_many(states, actions) -> observations``; ``submission(state)``."""

    multi_turn = True

    def __init__(self, tests: TestRunner, max_turns: int = 16, context_budget: int = 0,
                 summary_max_tokens: int = 48, summary_carry: str = "last_observation"):
        if summary_carry not in CARRY:
            raise ValueError(f"summary_carry={summary_carry!r}; choose from {', '.join(CARRY)}")
        self.tests = tests
        self.max_turns = max_turns
        self.context_budget = context_budget
        """Tokens one context may hold (0: no budget; see :func:`offline_rl.rollout.play_episodes`)."""
        self.summary_max_tokens = summary_max_tokens
        self.summary_carry = summary_carry

    @classmethod
    def from_settings(cls, tests: TestRunner, env_settings) -> RepoEnv:
        es = env_settings
        return cls(tests, max_turns=es.max_turns, context_budget=es.context_budget,
                   summary_max_tokens=es.summary_max_tokens, summary_carry=es.summary_carry)

    def restart(self, state: RepoState, summary: str, carry: bool = True) -> str:
        """Begin a fresh context after the summary turn and return it: the task header, the summary and
        (``summary_carry``, unless ``carry`` is False) the last command with its output, then the prompt.
        An empty summary carries nothing over: the policy starts again from the header (the working
        copy keeps its edits)."""
        text = clean_summary(summary)
        state.segment_turns = 0
        ctx = header(state.task)[:-len(PROMPT)]
        if text:
            ctx += f"{SUMMARY_PREFIX}{text}\n"
            if carry and self.summary_carry == "last_observation" and state.turns:
                last = state.turns[-1]
                ctx += f"{PROMPT}{last.action}\n{last.observation}\n"
        state.context = ctx + PROMPT
        return state.context

    def reset(self, task: RepoTask) -> RepoState:
        return RepoState(task=task, context=header(task), files=dict(task.files))

    def step(self, state: RepoState, action: str) -> str:
        return self.step_many([state], [action])[0]

    def step_many(self, states: Sequence[RepoState], actions: Sequence[str]) -> list[str]:
        """Apply one command per episode; test runs of the whole batch go to the sandbox together."""
        pending: dict[int, Future[RunResult] | RunResult] = {}
        turns: list[Turn] = []
        for i, (st, line) in enumerate(zip(states, actions, strict=True)):
            if st.done:
                raise RuntimeError("episode is over")
            line = line.split("\n", 1)[0]
            act = parse_command(line)
            turn = Turn(action=line, tool=act.tool)
            turns.append(turn)
            if act.tool == "test":
                pending[i] = self.tests.submit(st.files, st.task.tests)
            else:
                turn.observation = self._apply(st, act, turn)
        for i, fut in pending.items():
            run = fut.result() if isinstance(fut, Future) else fut
            turns[i].tests_passed = run.all_passed
            turns[i].observation = summarise(states[i].task.tests, run)
        out = []
        for st, turn in zip(states, turns, strict=True):
            st.turns.append(turn)
            st.segment_turns += 1
            st.context += turn.action + "\n"
            if turn.tool == "submit":
                st.done = st.submitted = True
                out.append("")
                continue
            if len(st.turns) >= self.max_turns:
                st.done = True
            obs = turn.observation + "\n" + ("" if st.done else PROMPT)
            st.context += obs
            out.append(obs)
        return out

    def _apply(self, st: RepoState, act: Action, turn: Turn) -> str:
        if act.tool == "error":
            turn.ok = False
            return f"error: {act.error}"
        if act.tool == "submit":
            return ""
        if act.tool == "ls":
            return " ".join(sorted(st.files))
        if act.tool == "grep":
            hits = [f"{p}:{n}:{line}" for p, text in sorted(st.files.items())
                    for n, line in enumerate(text.splitlines(), 1) if act.text in line]
            return "\n".join(h[:MAX_LINE_CHARS] for h in hits[:MAX_OBS_LINES]) or "no match"
        path = safe_path(act.args[0])
        if path is None:
            turn.ok = False
            return f"error: {act.args[0][:40]} is outside the repository"
        if act.tool == "cat":
            return self._cat(st, path, act.args[1:], turn)
        return self._edit(st, path, int(act.args[1]), act.text, turn)

    @staticmethod
    def _cat(st: RepoState, path: str, span: list[str], turn: Turn) -> str:
        if path not in st.files:
            turn.ok = False
            return f"error: no file {path}"
        lines = st.files[path].splitlines()
        lo, hi = 1, len(lines)
        if span:
            a, _, b = span[0].partition("-")
            if not (a.isdigit() and b.isdigit()):
                turn.ok = False
                return "error: usage: cat FILE [A-B]"
            lo, hi = max(1, int(a)), min(len(lines), int(b))
        shown = [f"{n} {lines[n - 1]}"[:MAX_LINE_CHARS] for n in range(lo, hi + 1)]
        return "\n".join(shown[:MAX_OBS_LINES]) or "(empty)"

    @staticmethod
    def _edit(st: RepoState, path: str, n: int, text: str, turn: Turn) -> str:
        if is_test_file(path):
            turn.ok = False
            return "error: test files are read-only"
        if not path.endswith(".py"):
            turn.ok = False
            return "error: only .py files can be edited"
        if len(text) > MAX_EDIT_CHARS:
            turn.ok = False
            return f"error: line longer than {MAX_EDIT_CHARS} characters"
        lines = st.files.get(path, "").splitlines()
        if not 1 <= n <= len(lines) + 1:
            turn.ok = False
            return f"error: {path} has {len(lines)} lines"
        if n == len(lines) + 1:
            lines.append(text)
        else:
            lines[n - 1] = text
        st.files[path] = "\n".join(lines) + "\n"
        return "ok"

    def submission(self, state: RepoState) -> Submission | None:
        """What the reward runs: the hidden tests on the submitted working copy (None: no submission)."""
        if not state.submitted:
            return None
        return Submission(key=f"{state.task.task_id}:{state.submission}", code=program(state.files),
                          entry_point=ENTRY, tests=as_cases(state.task.hidden_tests))


# --------------------------------------------------------------------------------------------------
# What an episode shows about the agent's behaviour (reported before and after RL).


def behaviour(state: RepoState) -> dict[str, float]:
    """Per episode: whether tests ran before the first edit and after the last, retries after a
    failing run, malformed commands, turns."""
    tools = [t.tool for t in state.turns]
    edits = [i for i, t in enumerate(tools) if t == "edit"]
    tests = [i for i, t in enumerate(tools) if t == "test"]
    retries = 0
    for k, i in enumerate(tests):
        failed = state.turns[i].tests_passed is False
        after_edit = any(e < i for e in edits)
        if failed and after_edit and any(e > i for e in edits[:]) and (k + 1 == len(tests) or
                                                                       any(i < e < tests[k + 1] for e in edits)):
            retries += 1
    return {
        "turns": float(len(tools)),
        "submitted": float(state.submitted),
        "test_before_edit": float(bool(edits) and bool(tests) and tests[0] < edits[0]),
        "test_before_submit": float(state.submitted and bool(edits) and bool(tests) and tests[-1] > edits[-1]),
        "retries": float(retries),
        "edits": float(len(edits)),
        "greps": float(tools.count("grep")),
        "malformed": float(sum(not t.ok for t in state.turns)),
    }
