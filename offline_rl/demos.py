"""Agent transcripts for mid-training: a scripted demonstrator of mixed care, run in the real environment.

Mid-training has to teach the tool protocol and the code idioms; it must not teach the best way to
use them, which is what RL is for. The transcripts therefore come from a demonstrator whose habits
vary from episode to episode, like logs collected from many people and agents: it runs the tests
first or starts by looking around, sometimes edits before it has seen what the tests want, verifies
its edit or submits at once, retries after a failing run or gives up, finds code with ``grep`` or by
opening files one by one, and sometimes writes a plausible wrong fix. Each habit is a probability in
:class:`DemoHabits` (``midtrain.demo_*`` settings).

A model that imitates these transcripts learns the protocol and the mixture of habits; continued
imitation cannot learn more than the mixture, and sampling it at a lower temperature only sharpens
the mixture's most common choices. Which habits pay off (test before editing, verify, retry after a
failure) is left for the reward to teach.

The transcripts run against :class:`~offline_rl.agent_env.RepoEnv` with the in-process
:class:`~offline_rl.agent_env.TrustedTests` runner: the demonstrator's code is generated here, so its
observations are exactly what the sandboxed environment would show, at a fraction of the cost.
Only training tasks are used, so no held-out function or its solution is in the corpus.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from offline_rl.agent_env import RepoEnv, RepoState, TrustedTests, header
from offline_rl.repo_tasks import (
    ALL_FAMILIES,
    FAMILIES,
    LONG_FAMILIES,
    RepoTask,
    define,
    is_test_file,
    make_repo_task,
    module_of,
    trace_rule,
)
from offline_rl.tasks import FunctionSpec, outside_specs, split_specs
from policy.summary import SUMMARY_REQUEST


@dataclass(frozen=True)
class DemoHabits:
    """How often the demonstrator does each thing (a probability per decision)."""

    test_first: float = 0.2
    """Run the tests before anything else (otherwise the tests run, if at all, right before an edit)."""
    look_around: float = 0.3
    """Start with ``ls``."""
    blind_edit: float = 0.5
    """About to change a body without having seen what the tests want: edit anyway (a guess)."""
    grep: float = 0.6
    """Find the code with ``grep`` (otherwise open files one by one)."""
    verify: float = 0.4
    """Run the tests after an edit (otherwise submit at once)."""
    retry: float = 0.4
    """After a failing run that followed an edit, edit again (otherwise submit anyway)."""
    correct: float = 0.8
    """An informed edit writes the right line (otherwise a plausible wrong one)."""
    read_notes: float = 0.8
    """``trace`` tasks: read the notes module the issue names first (its rule is what informs the
    fix; the one visible test does not)."""
    summarise: float = 0.5
    """``trace`` tasks: once the notes are read, the context is full (the notes are long, as a context
    budget would have it): answer the summary request and go on from a fresh context, a document of
    its own."""
    summary_keeps_rule: float = 0.4
    """A summary states the notes' rule (otherwise it restates the issue, and the fix after it is a
    guess). Imperfect on purpose: which summaries let an episode finish is for the reward to teach."""
    max_edits: int = 4


Segment = tuple[str, bool]
"""(text, written by the agent): environment text and agent lines are tokenized separately, as
the rollout loop sees them. A transcript is a list of segments: one context of an episode."""


@dataclass(frozen=True)
class _Edit:
    """One line to rewrite: the file, the function whose ``def`` line it is, the right and a wrong text."""

    path: str
    find: str
    right: str
    wrong: str
    needs_tests: bool  # the right text needs the wanted values (a body to infer), not only names


def _edits(task: RepoTask, wrong_body) -> list[_Edit]:
    ref = task.metadata["reference"]
    if task.family == "rename":
        new, caller = task.tests[0], task.tests[-1]
        old = task.issue.split()[1]
        src = next(p for p in task.files if module_of(p) == new.module and not is_test_file(p))
        use = next(p for p in task.files if module_of(p) == caller.module and not is_test_file(p))
        call = f"{new.module}.{new.function}(x)"
        return [_Edit(src, old, define(new.function, ref), define(new.function, wrong_body(ref)), False),
                _Edit(use, caller.function, define(caller.function, call + "+1"), define(caller.function, call),
                      False)]
    t = task.tests[0]
    path = next(p for p in task.files if module_of(p) == t.module and not is_test_file(p))
    return [_Edit(path, t.function, define(t.function, ref), define(t.function, wrong_body(ref)), True)]


class Demonstrator:
    """Plays one episode of a training task with its habits drawn per decision."""

    def __init__(self, habits: DemoHabits, specs: list[FunctionSpec], rng: random.Random):
        self.h, self.specs, self.rng = habits, specs, rng
        self.env = RepoEnv(TrustedTests(), max_turns=16)

    def _wrong(self, body: str) -> str:
        family = next((s.family for s in self.specs if s.expr == body), None)
        pool = [s.expr for s in self.specs if s.family == family and s.expr != body] or \
               [s.expr for s in self.specs if s.expr != body]
        return self.rng.choice(pool)

    def _do(self, st: RepoState, segs: list[Segment], action: str) -> None:
        segs.append((action + "\n", True))
        obs = self.env.step(st, action)
        if obs:
            segs.append((obs, False))

    @staticmethod
    def _line_of(st: RepoState, path: str, name: str) -> int:
        lines = st.files.get(path, "").splitlines()
        for n, line in enumerate(lines, 1):
            if line.startswith(f"def {name}("):
                return n
        return len(lines) + 1

    def _locate(self, st: RepoState, segs: list[Segment], edit: _Edit, seen: set[str]) -> None:
        """Look at the code before editing it: grep for the definition or open files in turn."""
        if edit.path in seen:
            return
        if self.rng.random() < self.h.grep and f"def {edit.find}(" in st.files.get(edit.path, ""):
            self._do(st, segs, f"grep def {edit.find}")
            seen.add(edit.path)
            return
        sources = [p for p in sorted(st.files) if not is_test_file(p) and p != edit.path]
        self.rng.shuffle(sources)
        for p in [*sources[:self.rng.randrange(len(sources) + 1)], edit.path]:
            if st.done:
                return
            if p not in seen:
                self._do(st, segs, f"cat {p}")
                seen.add(p)

    def _summarise(self, st: RepoState, segs: list[Segment], task: RepoTask, notes: str, keep: bool) -> list[Segment]:
        """Close the context with a summary turn (``keep``: the summary states the rule, otherwise it only
        restates the issue) and return the fresh one, as :meth:`RepoEnv.restart` opens it for the policy
        under a budget the notes filled: without the notes' output, which would leave no room for a turn."""
        name = task.tests[0].function
        summary = (trace_rule(name, task.metadata["reference"]) if keep
                   else f"{name} returns wrong values; rule in {notes}")
        segs += [(SUMMARY_REQUEST, False), (summary + "\n", True)]
        return [(self.env.restart(st, summary, carry=False), False)]

    def episode(self, task: RepoTask) -> list[list[Segment]]:
        """The episode's transcripts, one per context, oldest first (more than one after a summary)."""
        h, rng = self.h, self.rng
        st = self.env.reset(task)
        segs: list[Segment] = [(header(task), False)]
        contexts = [segs]
        todo = _edits(task, self._wrong)
        informed, seen, edits = False, set(), 0
        # A trace task's rule is in its notes module: reading it is what informs the fix (the single
        # visible test does not pin the function down), so running the tests informs nothing there.
        notes = task.issue.rsplit(" ", 1)[-1] if task.family == "trace" else None
        if notes is not None and rng.random() < h.read_notes:
            self._do(st, segs, f"cat {notes}")
            seen.add(notes)
            informed = True
            if rng.random() < h.summarise:
                informed = rng.random() < h.summary_keeps_rule
                segs = self._summarise(st, segs, task, notes, informed)
                contexts.append(segs)
        tests_inform = notes is None
        if rng.random() < h.test_first:
            self._do(st, segs, "test")
            informed = informed or tests_inform
        if rng.random() < h.look_around:
            self._do(st, segs, "ls")
        while todo and not st.done and edits < h.max_edits:
            edit = todo[0]
            self._locate(st, segs, edit, seen)
            if st.done:
                break
            if edit.needs_tests and not informed and tests_inform and rng.random() >= h.blind_edit:
                self._do(st, segs, "test")
                informed = True
            right = (informed or not edit.needs_tests) and rng.random() < h.correct
            line = self._line_of(st, edit.path, edit.find)
            self._do(st, segs, f"edit {edit.path} {line} {edit.right if right else edit.wrong}")
            edits += 1
            if right:
                todo.pop(0)
                if todo:
                    continue  # the second place of a rename
            if st.done or rng.random() >= h.verify:
                break
            self._do(st, segs, "test")
            informed = informed or tests_inform
            if st.turns[-1].tests_passed or rng.random() >= h.retry:
                break
            if not todo:  # the last edit was right but tests still fail (an earlier wrong one): redo all
                todo = _edits(task, self._wrong)
        if not st.done:
            self._do(st, segs, "submit")
        return contexts


def transcripts(n: int, seed: int = 0, heldout_fraction: float = 0.2, habits: DemoHabits | None = None,
                split_seed: int | None = None, families: Sequence[str] = FAMILIES,
                rule_drill: float = 0.0) -> Iterator[list[Segment]]:
    """The transcripts of ``n`` episodes (one per context) over freshly drawn *training* tasks of
    ``families`` in turn: held-out functions of the split with ``split_seed`` (default: ``seed``) never
    appear. ``rule_drill``: the share of long-horizon tasks whose function (the rule the fix copies) is
    one of :func:`~offline_rl.tasks.outside_specs`, which no task is drawn from."""
    habits = habits or DemoHabits()
    train_specs, _ = split_specs(seed if split_seed is None else split_seed, heldout_fraction)
    drill = outside_specs()
    rng = random.Random(seed + 50_021)
    demo = Demonstrator(habits, train_specs, rng)
    for i in range(n):
        family = families[i % len(families)]
        spec = train_specs[rng.randrange(len(train_specs))]
        if rule_drill and family in LONG_FAMILIES and rng.random() < rule_drill:
            spec = drill[rng.randrange(len(drill))]
        task = make_repo_task(family, spec, train_specs, rng, f"demo-{i}", "train")
        yield from demo.episode(task)


def task_transcripts(tasks: Sequence[RepoTask], habits: DemoHabits | None = None, seed: int = 0,
                     split_seed: int = 0, heldout_fraction: float = 0.2) -> Iterator[list[Segment]]:
    """Endless transcripts of the given training tasks, in turn, habits drawn afresh per episode
    (``seed``): to teach the protocol on one chosen task set instead of freshly drawn tasks. Only
    generated tasks of the built-in families can be demonstrated (the demonstrator needs the
    reference body); its wrong fixes come from the training functions of the tasks' split
    (``split_seed``, ``heldout_fraction``)."""
    tasks = list(tasks)
    if not tasks:
        raise ValueError("no tasks to demonstrate")
    for t in tasks:
        if t.family not in ALL_FAMILIES or "reference" not in t.metadata:
            raise ValueError(f"task {t.task_id}: only generated tasks of the families {', '.join(ALL_FAMILIES)} "
                             "can be demonstrated")
        if t.split == "heldout":
            raise ValueError(f"task {t.task_id} is held out: transcripts would show its solution")
    train_specs, _ = split_specs(split_seed, heldout_fraction)
    demo = Demonstrator(habits or DemoHabits(), train_specs, random.Random(seed + 50_021))
    for task in itertools.cycle(tasks):
        yield from demo.episode(task)


def transcript_text(segs: list[Segment]) -> str:
    return "".join(text for text, _ in segs)
