"""Composite reward: weighted deterministic parts plus judge scores per rubric dimension.

    r = w_tests·(hidden tests passed / total) + w_compiles·[compiles] + w_format·[one line, in budget]
        + Σ_d w_d·judge_d

With ``require_pass`` (default) the shaping terms count only when at least one hidden test passes,
so a wrong, crashing or hostile program earns exactly 0 and a judge cannot be farmed by a program
that does nothing. Every part is returned separately so the trainer logs each one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from offline_rl.config import RewardSettings
from offline_rl.env import score_expression
from offline_rl.judge import Judge, JudgeError
from offline_rl.sandbox import RunResult, Sandbox, SandboxPool
from offline_rl.tasks import Task


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
                self.judge_errors += 1
                err = str(e)
                judge_scores = {d: 0.0 for d in self.judge.dimensions}
        total, parts = self.combine(run, well_formed and expression is not None, judge_scores)
        return Reward(total=total, parts=parts, run=run, passed=run.all_passed, judge_error=err)

    def score_many(self, items: Sequence[tuple[Task, str | None, bool]]) -> list[Reward]:
        """Score a batch; identical (task, expression) pairs are run once (GRPO groups repeat a lot)."""
        runs: dict[tuple[str, str | None], RunResult] = {}
        unique = []
        for task, expr, _ in items:
            key = (task.task_id, None if expr is None else expr.strip())
            if key not in runs:
                runs[key] = None  # type: ignore[assignment]
                unique.append((key, task, expr))
        if isinstance(self.sandbox, SandboxPool) and self.sandbox.size > 1:
            from offline_rl.env import compiles, program_for

            jobs, keys = [], []
            for key, task, expr in unique:
                if expr is not None and expr.strip() and compiles(program_for(task, expr)):
                    jobs.append((program_for(task, expr), task.entry_point, task.tests))
                    keys.append(key)
                else:
                    runs[key] = score_expression(self.sandbox, task, expr)
            for key, res in zip(keys, self.sandbox.run_many(jobs), strict=True):
                runs[key] = res
        else:
            for key, task, expr in unique:
                runs[key] = score_expression(self.sandbox, task, expr)
        return [self.score(task, expr, wf, run=runs[(task.task_id, None if expr is None else expr.strip())])
                for task, expr, wf in items]
