"""Composite reward: weighted deterministic parts plus judge scores per rubric dimension.

    r = w_tests·(hidden tests passed / total) + w_compiles·[compiles] + w_format·[one line, in budget]
        + Σ_d w_d·judge_d

With ``require_pass`` (default) the shaping terms count only when at least one hidden test passes,
so a wrong, crashing or hostile program earns exactly 0 and a judge cannot be farmed by a program
that does nothing. Every part is returned separately so the trainer logs each one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from offline_rl.agent_env import Submission
from offline_rl.config import RewardSettings
from offline_rl.env import compiles, program_for, score_expression
from offline_rl.judge import Judge, JudgeError
from offline_rl.repo_tasks import RepoTask
from offline_rl.sandbox import RunResult, Sandbox, SandboxPool, TestResult
from offline_rl.tasks import Task

Answer = str | Submission | None
"""What an episode submitted: an expression (function tasks) or a working copy to test (repository
tasks); None when nothing was submitted."""


@dataclass
class Reward:
    total: float
    parts: dict[str, float]
    run: RunResult
    passed: bool  # all hidden tests passed (the pass@1 event)
    judge_error: str | None = None


@dataclass
class RewardFunction:
    sandbox: Sandbox | SandboxPool
    settings: RewardSettings = field(default_factory=RewardSettings)
    judge: Judge | None = None
    judge_errors: int = 0
    sandbox_cpu_s: float = 0.0
    """CPU seconds the sandbox spent on this function's runs so far (see RunResult.cpu_s): a rollout
    loop's own CPU clock misses them, and on a shared machine they compete with it."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    """Guards the counters: a rollout worker scores one batch in a thread while the next is sampled."""

    def count_run(self, run: RunResult) -> None:
        with self._lock:
            self.sandbox_cpu_s += run.cpu_s

    def combine(self, run: RunResult, well_formed: bool, judge_scores: dict[str, float]) -> tuple[float, dict]:
        parts = {"tests": run.pass_fraction, "compiles": float(run.compiled), "format": float(well_formed)}
        parts.update({f"judge_{d}": v for d, v in judge_scores.items()})
        s = self.settings
        total = s.tests * parts["tests"]
        shaping = s.compiles * parts["compiles"] + s.format * parts["format"]
        shaping += sum(s.judge.get(d, 0.0) * v for d, v in judge_scores.items())
        if not s.require_pass or run.n_passed > 0:
            total += shaping
        return total, parts

    def score(self, task: Task, expression: str | None, well_formed: bool = True,
              run: RunResult | None = None) -> Reward:
        if run is None:
            run = score_expression(self.sandbox, task, expression)
        judge_scores: dict[str, float] = {}
        err = None
        if self.judge is not None and any(self.settings.judge.values()):
            try:
                judge_scores = self.judge.score(task, expression or "")
            except JudgeError as e:
                # A judge outage must not stop training: its parts score 0 and the error is counted.
                with self._lock:
                    self.judge_errors += 1
                err = str(e)
                judge_scores = {d: 0.0 for d in self.judge.dimensions}
        total, parts = self.combine(run, well_formed and expression is not None, judge_scores)
        return Reward(total=total, parts=parts, run=run, passed=run.all_passed, judge_error=err)

    def score_submission(self, sub: Submission | None, well_formed: bool, run: RunResult | None = None) -> Reward:
        """A repository episode's reward: ``tests`` if every hidden test passes on the submitted working
        copy (plus ``format`` when, in addition, every command line ended within its token budget), else 0.

        The pass event rather than the fraction of hidden tests: a repository's unchanged code already
        passes some hidden tests by coincidence (e.g. ``max(x,3)`` and ``max(x,7)`` agree on large
        inputs), so partial credit pays for submitting without changing anything. No judge: it rates
        one expression, not a change to a code base. No submission scores 0."""
        if sub is None:
            run = RunResult(tests=[TestResult(0, "error", "no submission")], compiled=False, error="no submission")
        elif run is None:
            run = self.sandbox.run(sub.code, sub.entry_point, sub.tests)
        solved = sub is not None and run.all_passed
        parts = {"solved": float(solved), "tests": run.pass_fraction, "format": float(well_formed and sub is not None)}
        total = self.settings.tests * parts["solved"]
        if solved:
            total += self.settings.format * parts["format"]
        return Reward(total=total, parts=parts, run=run, passed=solved)

    def score_many(self, items: Sequence[tuple[Task, str | None, bool]]) -> list[Reward]:
        """Score a batch; identical (task, expression) pairs are run once (GRPO groups repeat a lot)."""
        return self.pending().rewards(items)

    def pending(self) -> PendingRewards:
        """A batch whose sandbox runs start as submissions arrive (see :class:`PendingRewards`)."""
        return PendingRewards(self)


class PendingRewards:
    """Submissions scored while the rest of the batch is still being generated.

    :meth:`add` sends the hidden-test run at once to one of the pool's fork servers (the work happens
    in their children, i.e. on another core), so a rollout loop that adds each completion as
    it finishes overlaps scoring with decoding. Identical (task, expression) pairs run once.
    :meth:`rewards` waits for the runs and combines them with the judge scores."""

    def __init__(self, fn: RewardFunction):
        self.fn = fn
        self.runs: dict[tuple[str, str | None], Future[RunResult] | RunResult] = {}
        self.sandbox_cpu_s = 0.0
        """This batch's share of ``fn.sandbox_cpu_s`` (batches may be scored while others sample)."""

    def _count(self, run: RunResult) -> None:
        self.sandbox_cpu_s += run.cpu_s
        self.fn.count_run(run)

    @staticmethod
    def _key(task: Task | RepoTask, answer: Answer) -> tuple[str, str | None]:
        if isinstance(answer, Submission):
            return task.task_id, answer.key
        return task.task_id, None if answer is None else answer.strip()

    def add(self, task: Task | RepoTask, expr: Answer) -> None:
        """Start scoring an answer (identical answers to one task run once)."""
        key = self._key(task, expr)
        if key in self.runs:
            return
        if isinstance(task, RepoTask):
            if isinstance(expr, Submission):
                self.runs[key] = self.fn.sandbox.submit(expr.code, expr.entry_point, expr.tests)
            return
        sandbox = self.fn.sandbox
        if (isinstance(sandbox, SandboxPool) and expr is not None and expr.strip()
                and compiles(program_for(task, expr))):
            self.runs[key] = sandbox.submit(program_for(task, expr), task.entry_point, task.tests)
        else:
            run = self.runs[key] = score_expression(sandbox, task, expr)
            self._count(run)

    def rewards(self, items: Sequence[tuple[Task | RepoTask, Answer, bool]]) -> list[Reward]:
        for task, expr, _ in items:
            self.add(task, expr)
        for key, run in self.runs.items():
            if isinstance(run, Future):
                self.runs[key] = run = run.result()
                self._count(run)
        out = []
        for task, expr, well_formed in items:
            run = self.runs.get(self._key(task, expr))
            if isinstance(task, RepoTask):
                out.append(self.fn.score_submission(expr if isinstance(expr, Submission) else None, well_formed,
                                                    run=run))
            else:
                out.append(self.fn.score(task, expr, well_formed, run=run))
        return out
