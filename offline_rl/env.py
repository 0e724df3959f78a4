"""The coding environment: one API for single-turn and multi-turn tool use.

Single-turn: the context is the task prompt (``# f(0)=7 ...\\ndef f(x): return ``); the policy writes
one line, the expression, and the episode ends.

Tool mode: the context shows the visible examples and the tools; each turn the policy writes one
line after ``> ``::

    # f(0)=7 f(1)=15 f(2)=23 f(8)=71
    # tools: run_examples <expr> | submit <expr>
    > run_examples x*8+7
    < f(0)=7 ok f(1)=15 ok f(2)=23 ok f(8)=71 ok
    > submit x*8+7

``run_examples`` runs the expression in the sandbox on the *visible* examples only and appends the
result line to the context; ``submit`` ends the episode; a bare expression counts as a submit. An
episode that reaches ``max_turns`` without a submission earns nothing. The hidden tests are scored
only on the submission, by :meth:`CodingEnv.score`.
"""

from __future__ import annotations

import ast
import warnings
from dataclasses import dataclass, field

from offline_rl.config import EnvSettings
from offline_rl.sandbox import RunResult, Sandbox, SandboxPool, TestResult
from offline_rl.tasks import Task, TestCase

TOOLS_LINE = "# tools: run_examples <expr> | submit <expr>\n"
TURN_PREFIX = "> "
OBS_PREFIX = "< "


def program_for(task: Task, expression: str) -> str:
    """The program a completion stands for: the prompt (comments + ``def f(x): return ``) + the line."""
    return task.prompt + expression.strip() + "\n"


def compiles(source: str) -> bool:
    """Parse only (nothing runs): cheap pre-check that spares the sandbox a call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)  # e.g. "1x": noise from model output, not ours
        try:
            ast.parse(source)
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return False
    return True


def tool_prompt(task: Task) -> str:
    header = task.prompt.split("\n", 1)[0] + "\n" if task.prompt.startswith("#") else ""
    return header + TOOLS_LINE + TURN_PREFIX


@dataclass
class Turn:
    action: str
    tool: str  # run_examples | submit
    expression: str
    observation: str = ""


@dataclass
class EpisodeState:
    task: Task
    context: str
    turns: list[Turn] = field(default_factory=list)
    done: bool = False
    submission: str | None = None


class CodingEnv:
    """``reset(task) -> state``; ``step(state, action_line) -> observation``; ``score(state) -> RunResult``."""

    def __init__(self, sandbox: Sandbox | SandboxPool, settings: EnvSettings | None = None):
        self.sandbox = sandbox
        self.settings = settings or EnvSettings()

    @property
    def multi_turn(self) -> bool:
        return self.settings.mode == "multi"

    def reset(self, task: Task) -> EpisodeState:
        return EpisodeState(task=task, context=tool_prompt(task) if self.multi_turn else task.prompt)

    def parse_action(self, line: str) -> tuple[str, str]:
        text = line.strip()
        for tool in ("run_examples", "submit"):
            if text == tool or text.startswith(tool + " "):
                return tool, text[len(tool):].strip()
        return "submit", text

    def final_submission(self, state: EpisodeState, action: str) -> str | None:
        """The expression :meth:`step` would submit for ``action`` if it ends the episode by submitting,
        else None; nothing changes (lets a rollout loop start scoring before it steps the env)."""
        if state.done:
            return None
        line = action.split("\n", 1)[0]
        if not self.multi_turn:
            return line.strip()
        tool, expr = self.parse_action(line)
        return expr if tool == "submit" else None

    def step_many(self, states: list[EpisodeState], actions: list[str]) -> list[str]:
        """:meth:`step` for each episode (the rollout loop's batched call)."""
        return [self.step(st, a) for st, a in zip(states, actions, strict=True)]

    def submission(self, state: EpisodeState) -> str | None:
        """What the reward scores: the submitted expression (None: nothing submitted)."""
        return state.submission

    def step(self, state: EpisodeState, action: str) -> str:
        """Apply one policy line; returns the observation appended to the context ('' when done)."""
        if state.done:
            raise RuntimeError("episode is over")
        line = action.split("\n", 1)[0]
        if not self.multi_turn:
            state.turns.append(Turn(line, "submit", line.strip()))
            state.submission = line.strip()
            state.done = True
            return ""
        tool, expr = self.parse_action(line)
        turn = Turn(line, tool, expr)
        state.turns.append(turn)
        if tool == "submit":
            state.submission = expr
            state.done = True
            state.context += line + "\n"
            return ""
        turn.observation = OBS_PREFIX + self.run_examples(state.task, expr) + "\n"
        state.context += line + "\n" + turn.observation + TURN_PREFIX
        if len(state.turns) >= self.settings.max_turns:
            state.done = True
        return turn.observation + (TURN_PREFIX if not state.done else "")

    def run_examples(self, task: Task, expression: str) -> str:
        """The run_examples tool: visible examples only, one compact line."""
        if not task.examples:
            return "no examples"
        source = program_for(task, expression)
        if not compiles(source):
            return "syntax error"
        result = self.sandbox.run(source, task.entry_point, task.examples)
        parts = []
        for ex, tr, value in zip(task.examples, result.tests, result.values or [None] * len(task.examples),
                                 strict=False):
            call = f"{task.entry_point}({', '.join(map(repr, ex.args))})"
            if tr.status == "passed":
                parts.append(f"{call}={ex.expected} ok")
            elif tr.status == "failed":
                parts.append(f"{call}={value!r} want {ex.expected}")
            else:
                parts.append(f"{call} {tr.status}")
        return " ".join(parts)

    def score(self, state: EpisodeState) -> RunResult:
        """Hidden tests on the submission; no submission or no parse = every test an error."""
        return score_expression(self.sandbox, state.task, state.submission)


def score_expression(sandbox: Sandbox | SandboxPool, task: Task, expression: str | None) -> RunResult:
    if expression is None or not expression.strip():
        return _all(task.tests, "error", "no submission", compiled=False)
    source = program_for(task, expression)
    if not compiles(source):
        return _all(task.tests, "error", "syntax error", compiled=False)
    return sandbox.run(source, task.entry_point, task.tests)


def _all(tests: list[TestCase], status, detail: str, compiled: bool) -> RunResult:
    return RunResult(tests=[TestResult(i, status, detail) for i in range(len(tests))], compiled=compiled,
                     error=detail)
