"""Repository tasks: small code bases with failing tests, for multi-turn agent episodes.

A task is a tiny repository (a few Python modules and a visible test file), an issue text, the
visible tests the ``test`` tool runs, and *hidden* tests that only the reward sees. A test calls one
function of one module with JSON arguments and compares the JSON result::

    RepoTest(module="geom", function="area", args=[2], expected=11)

Four built-in families, each needing more than one step:

* ``implement``: a module lacks a function the tests call; the agent must add it (the wanted values
  are visible only in the test output or the test file);
* ``fix``: a function returns wrong values; the agent must find its line and rewrite it;
* ``rename``: an edit consistent across two files: a function is renamed in one module and every
  call site in another must follow (the test run after the first edit shows the second place);
* ``locate``: several modules; the failing function is in one of them, which the agent must find
  (``grep`` or reading files) before it can fix it.

A long-horizon family, ``trace``, is held out of that mix (``tasks.repo_families`` opts in): the rule
the fix needs is read first, in a notes module, and needed last, after the broken function has been
found among several modules; the visible test checks one input only. It is made for a context budget,
where only a summary that kept the rule can carry it to the fix (docs/agent.md, Self-summarisation).

The functions' bodies are one expression from :mod:`offline_rl.tasks`' families (affine, square,
abs, max, min, mod), so the expression skill the function-synthesis corpus teaches carries over.
The held-out split holds out a share of *each expression family* (``split_specs``): no held-out
function appears in a training task or in the mid-training corpus; instances differ further in names,
files and shown inputs.

Loading your own: :func:`load_repo_tasks` reads a JSONL file (one task object per line) or a
directory of task directories (``task.json`` + the source files); see docs/agent.md for the format.
A task without visible *and* hidden tests, or with a file path that leaves the task directory, is
refused with the reason.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from offline_rl.tasks import HIDDEN_INPUTS, FunctionSpec, split_specs, visible_inputs

FAMILIES = ("implement", "fix", "rename", "locate")
"""The standard mix (``tasks.repo_families`` by default)."""
LONG_FAMILIES = ("trace",)
"""Long-horizon families, held out of the standard mix: made for a context budget (self-summarisation)."""
ALL_FAMILIES = FAMILIES + LONG_FAMILIES
FUNCTION_NAMES = ("area", "scale", "cost", "total", "size", "score", "price", "level", "rate", "width",
                  "depth", "count", "speed", "grade", "limit", "offset", "weight", "bonus", "span", "tax")
MODULE_NAMES = ("geom", "calc", "util", "shapes", "money", "stats", "core", "units", "mathx", "rules",
                "table", "parts")
HELPER_BODIES = ("x+1", "x*2", "x-1", "x*x", "abs(x)", "max(x,0)", "min(x,9)", "x%3")
"""Bodies of the functions that are correct and stay so (context the agent must leave alone)."""
NAME_RE = re.compile(r"^[a-z_][a-z0-9_]{0,31}$")
TRACE_NOTE_LINES = 8
"""Lines of a ``trace`` task's notes module: the rule and correct helpers (``cat`` shows 8 at once)."""
def trace_rule(name: str, body: str) -> str:
    """A ``trace`` task's rule, a comment in its notes module: the fix's line after its ``def`` (which
    would make ``grep def NAME`` find the rule too), so that the fix copies it rather than rewrites it."""
    return f"rule: {name}(x): return {body}"
MAX_FILES = 16
MAX_FILE_CHARS = 4000


class TaskFormatError(ValueError):
    """A task definition that cannot be used; the message says which task and why."""


@dataclass(frozen=True)
class RepoTest:
    """``module.function(*args) == expected``, compared as canonical JSON in the trusted parent."""

    module: str
    function: str
    args: list[Any]
    expected: Any

    def call(self) -> str:
        return f"{self.function}({', '.join(json.dumps(a) for a in self.args)})"


@dataclass(frozen=True)
class RepoTask:
    """One repository task. ``hidden_tests`` never reach the policy: only the reward runs them."""

    task_id: str
    family: str
    issue: str
    files: dict[str, str]
    tests: list[RepoTest]
    hidden_tests: list[RepoTest]
    split: str = "train"
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def bucket(self) -> str:
        return self.family

    @property
    def test_files(self) -> list[str]:
        return sorted(p for p in self.files if is_test_file(p))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any], source: str = "") -> RepoTask:
        where = f"{source}: " if source else ""
        missing = {"task_id", "issue", "files", "tests", "hidden_tests"} - d.keys()
        if missing:
            raise TaskFormatError(f"{where}task is missing {sorted(missing)}")
        tid = str(d["task_id"])
        files = d["files"]
        if not isinstance(files, dict) or not files:
            raise TaskFormatError(f"{where}task {tid}: 'files' must be a non-empty object path -> text")
        task = RepoTask(task_id=tid, family=str(d.get("family", "custom")), issue=str(d["issue"]),
                        files={str(k): str(v) for k, v in files.items()},
                        tests=[_test_from(t, tid, where) for t in d["tests"]],
                        hidden_tests=[_test_from(t, tid, where) for t in d["hidden_tests"]],
                        split=str(d.get("split", "train")), metadata=dict(d.get("metadata", {})))
        validate_task(task, where)
        return task


def _test_from(t: Any, tid: str, where: str) -> RepoTest:
    try:
        return RepoTest(module=str(t["module"]), function=str(t["function"]), args=list(t["args"]),
                        expected=t["expected"])
    except (KeyError, TypeError) as err:
        raise TaskFormatError(f"{where}task {tid}: a test needs module, function, args, expected ({err})") from None


def is_test_file(path: str) -> bool:
    name = PurePosixPath(path).name
    return name.startswith("test_") or name.endswith("_test.py")


def module_of(path: str) -> str:
    return PurePosixPath(path).stem


def safe_path(path: str) -> str | None:
    """The normalised repository-relative path, or None when it is absolute or leaves the repository."""
    if not path or "\\" in path or "\x00" in path:
        return None
    p = PurePosixPath(path)
    if p.is_absolute() or any(part in ("..", "") for part in p.parts) or p.parts[0].startswith("~"):
        return None
    return str(p)


def validate_task(task: RepoTask, where: str = "") -> None:
    """Refuse what the environment cannot run safely or score meaningfully (message names the reason)."""
    tid = task.task_id
    if not task.tests and not task.hidden_tests:
        raise TaskFormatError(f"{where}task {tid} has no tests: a task needs visible and hidden tests")
    if not task.hidden_tests:
        raise TaskFormatError(f"{where}task {tid} has no hidden tests: the reward would have nothing to run")
    if not task.tests:
        raise TaskFormatError(f"{where}task {tid} has no visible tests: the `test` tool would show nothing")
    if len(task.files) > MAX_FILES:
        raise TaskFormatError(f"{where}task {tid}: {len(task.files)} files (at most {MAX_FILES})")
    for path, text in task.files.items():
        if safe_path(path) != path:
            raise TaskFormatError(f"{where}task {tid}: file path {path!r} escapes the repository "
                                  "(absolute, '..', or not normalised)")
        if not path.endswith(".py") or not NAME_RE.match(module_of(path)):
            raise TaskFormatError(f"{where}task {tid}: {path!r} is not a Python module with a plain name")
        if len(text) > MAX_FILE_CHARS:
            raise TaskFormatError(f"{where}task {tid}: {path} has {len(text)} characters (at most {MAX_FILE_CHARS})")
    modules = {module_of(p) for p in task.files if not is_test_file(p)}
    for t in task.tests + task.hidden_tests:
        if t.module not in modules:
            raise TaskFormatError(f"{where}task {tid}: a test calls module {t.module!r}, which no source file defines")
        if not NAME_RE.match(t.function):
            raise TaskFormatError(f"{where}task {tid}: test function name {t.function!r} is not a plain name")


# --------------------------------------------------------------------------------------------------
# The built-in generator.


def define(name: str, body: str) -> str:
    return f"def {name}(x): return {body}"


def render_test_file(module: str, tests: list[RepoTest], imports: list[str] | None = None) -> str:
    mods = imports or sorted({t.module for t in tests})
    lines = [f"import {m}" for m in mods]
    lines += [f"assert {t.module}.{t.call()} == {json.dumps(t.expected)}" for t in tests]
    return "\n".join(lines) + "\n"


def _tests_for(module: str, name: str, spec: FunctionSpec, inputs: list[int]) -> list[RepoTest]:
    return [RepoTest(module, name, [x], spec(x)) for x in inputs]


def _other_family(spec: FunctionSpec, pool: list[FunctionSpec], rng: random.Random) -> FunctionSpec:
    """A wrong function of another family: a bug that shares little text with the right body."""
    return rng.choice([s for s in pool if s.family != spec.family] or [s for s in pool if s.expr != spec.expr])


def _near_miss(spec: FunctionSpec, pool: list[FunctionSpec], rng: random.Random) -> FunctionSpec:
    """A wrong function of the same family (the bug, or a plausible wrong fix)."""
    same = [s for s in pool if s.family == spec.family and s.expr != spec.expr]
    return rng.choice(same) if same else rng.choice([s for s in pool if s.expr != spec.expr])


@dataclass(frozen=True)
class _Draw:
    """The random choices one instance is made of."""

    spec: FunctionSpec
    name: str
    modules: list[str]
    visible: list[int]
    hidden: list[int]


def _draw(spec: FunctionSpec, rng: random.Random, n_modules: int) -> _Draw:
    return _Draw(spec=spec, name=rng.choice(FUNCTION_NAMES), modules=rng.sample(MODULE_NAMES, n_modules),
                 visible=visible_inputs(rng), hidden=rng.sample(HIDDEN_INPUTS, 4))


def _helpers(rng: random.Random, avoid: set[str], n: int) -> list[tuple[str, str]]:
    names = [f for f in FUNCTION_NAMES if f not in avoid]
    return list(zip(rng.sample(names, n), rng.sample(HELPER_BODIES, n), strict=True))


def make_repo_task(family: str, spec: FunctionSpec, pool: list[FunctionSpec], rng: random.Random,
                   task_id: str, split: str) -> RepoTask:
    """One instance of ``family`` around the hidden function ``spec`` (``pool``: same-split specs)."""
    d = _draw(spec, rng, 4 if family == "trace" else 3)
    mod = d.modules[0]
    helpers = _helpers(rng, {d.name}, 3)
    visible = _tests_for(mod, d.name, spec, d.visible)
    hidden = _tests_for(mod, d.name, spec, d.hidden)
    if family == "implement":
        files = {f"{mod}.py": define(*helpers[0]) + "\n"}
        issue = f"implement {d.name} in {mod}.py"
    elif family == "fix":
        bug = _near_miss(spec, pool, rng)
        lines = [define(*helpers[0]), define(d.name, bug.expr)]
        rng.shuffle(lines)
        files = {f"{mod}.py": "\n".join(lines) + "\n"}
        issue = f"{d.name} returns wrong values"
    elif family == "locate":
        where = rng.randrange(3)
        bug = _near_miss(spec, pool, rng)
        files = {}
        for k, m in enumerate(d.modules):
            lines = [define(*helpers[k])] + ([define(d.name, bug.expr)] if k == where else [])
            rng.shuffle(lines)
            files[f"{m}.py"] = "\n".join(lines) + "\n"
        mod = d.modules[where]
        visible = _tests_for(mod, d.name, spec, d.visible)
        hidden = _tests_for(mod, d.name, spec, d.hidden)
        issue = f"{d.name} returns wrong values"
    elif family == "rename":
        old = rng.choice([f for f in FUNCTION_NAMES if f not in {d.name, *(h[0] for h in helpers)}])
        user_mod, caller = d.modules[1], helpers[1][0]
        files = {f"{mod}.py": define(old, spec.expr) + "\n",
                 f"{user_mod}.py": f"import {mod}\n" + define(caller, f"{mod}.{old}(x)+1") + "\n"}
        plus_one = FunctionSpec(spec.family, f"({spec.expr})+1", f"({spec.spaced}) + 1")
        visible = (_tests_for(mod, d.name, spec, d.visible[:2])
                   + _tests_for(user_mod, caller, plus_one, d.visible[2:]))
        hidden = (_tests_for(mod, d.name, spec, d.hidden[:2])
                  + _tests_for(user_mod, caller, plus_one, d.hidden[2:]))
        issue = f"rename {old} to {d.name} everywhere"
        return _finish(task_id, family, issue, files, visible, hidden, split, spec)
    elif family == "trace":
        return _trace(task_id, spec, pool, rng, d, split)
    else:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(ALL_FAMILIES)}")
    return _finish(task_id, family, issue, files, visible, hidden, split, spec)


def _trace(task_id: str, spec: FunctionSpec, pool: list[FunctionSpec], rng: random.Random, d: _Draw,
           split: str) -> RepoTask:
    """The long-horizon family: the issue points at a notes module whose rule line states the function
    (the fact, read first) among :data:`TRACE_NOTE_LINES` - 1 other lines, so that reading it fills most
    of a small context; the broken function (another family's body: the fix is the rule's body, not an
    edit of the bug's) sits in one of three other modules among correct ones, and the visible test
    checks a single input, which does not pin the function down. The fix needs
    the rule, read many turns earlier: across a context budget, only a summary that kept it."""
    notes, code = d.modules[0], d.modules[1:]
    helpers = _helpers(rng, {d.name}, 6)
    rule = f"# {trace_rule(d.name, spec.expr)}"
    note_lines = [define(*h) for h in _helpers(rng, {d.name}, TRACE_NOTE_LINES - 1)] + [rule]
    rng.shuffle(note_lines)
    where = rng.randrange(len(code))
    bug = _other_family(spec, pool, rng)
    files = {f"{notes}.py": "\n".join(note_lines) + "\n"}
    for k, m in enumerate(code):
        lines = [define(*h) for h in helpers[2 * k:2 + 2 * k]] + (
            [define(d.name, bug.expr)] if k == where else [])
        rng.shuffle(lines)
        files[f"{m}.py"] = "\n".join(lines) + "\n"
    mod = code[where]
    visible = _tests_for(mod, d.name, spec, d.visible[:1])
    hidden = _tests_for(mod, d.name, spec, d.hidden)
    issue = f"{d.name} returns wrong values; its rule is in {notes}.py"
    return _finish(task_id, "trace", issue, files, visible, hidden, split, spec, {"fact": spec.expr})


def _finish(task_id: str, family: str, issue: str, files: dict[str, str], visible: list[RepoTest],
            hidden: list[RepoTest], split: str, spec: FunctionSpec,
            extra: dict[str, Any] | None = None) -> RepoTask:
    test_module = sorted({t.module for t in visible})[0]
    files = {**files, f"test_{test_module}.py": render_test_file(test_module, visible)}
    task = RepoTask(task_id=task_id, family=family, issue=issue, files=dict(sorted(files.items())),
                    tests=visible, hidden_tests=hidden, split=split,
                    metadata={"expr_family": spec.family, "reference": spec.expr, **(extra or {})})
    validate_task(task)
    return task


@dataclass(frozen=True)
class RepoTaskSplit:
    train: list[RepoTask]
    heldout: list[RepoTask]


def generate_repo_tasks(seed: int = 0, heldout_fraction: float = 0.2, train_per_spec: int = 2,
                        heldout_per_family: int = 16, families: tuple[str, ...] = FAMILIES) -> RepoTaskSplit:
    """Deterministic train / held-out repository tasks; held-out functions never appear in training.

    Training tasks: ``train_per_spec`` instances per train function, families in turn. Held-out:
    ``heldout_per_family`` instances per family over the held-out functions."""
    train_specs, held_specs = split_specs(seed, heldout_fraction)
    rng = random.Random(seed + 30_011)
    train = [make_repo_task(families[(i * train_per_spec + k) % len(families)], spec, train_specs, rng,
                            f"repo-train-{i}-{k}", "train")
             for i, spec in enumerate(train_specs) for k in range(train_per_spec)]
    held_rng = random.Random(seed + 40_009)
    heldout = []
    for fam in families:
        for k in range(heldout_per_family):
            spec = held_specs[held_rng.randrange(len(held_specs))]
            heldout.append(make_repo_task(fam, spec, held_specs, held_rng, f"repo-heldout-{fam}-{k}", "heldout"))
    return RepoTaskSplit(train=train, heldout=heldout)


# --------------------------------------------------------------------------------------------------
# Bring your own: JSONL or a directory of task directories.


def load_repo_tasks(path: str | Path) -> list[RepoTask]:
    """Tasks from a JSONL file (one task object per line) or a directory of task directories."""
    p = Path(path)
    if p.is_dir():
        dirs = sorted(d for d in p.iterdir() if d.is_dir())
        if not dirs:
            raise TaskFormatError(f"{p}: no task directories inside")
        return [load_task_dir(d) for d in dirs]
    tasks = []
    with open(p, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                tasks.append(RepoTask.from_dict(json.loads(line), f"{p}:{lineno}"))
            except json.JSONDecodeError as err:
                raise TaskFormatError(f"{p}:{lineno}: not JSON ({err})") from None
    return tasks


def load_task_dir(d: Path) -> RepoTask:
    """``task.json`` (issue, tests, hidden_tests, optional family/split) + the ``*.py`` files beside it.

    Symbolic links, and files whose real path is outside ``d``, are refused."""
    meta_path = d / "task.json"
    if not meta_path.is_file():
        raise TaskFormatError(f"{d}: no task.json")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    root = d.resolve()
    files: dict[str, str] = {}
    for f in sorted(d.rglob("*.py")):
        rel = f.relative_to(d).as_posix()
        if f.is_symlink() or not f.resolve().is_relative_to(root):
            raise TaskFormatError(f"{d}: {rel} is a link or leaves the task directory")
        files[rel] = f.read_text(encoding="utf-8")
    return RepoTask.from_dict({"task_id": meta.get("task_id", d.name), **meta, "files": files}, str(d))


def write_repo_tasks(tasks: list[RepoTask], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for t in tasks:
            fh.write(json.dumps(t.to_dict()) + "\n")
