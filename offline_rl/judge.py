"""Judges for what tests cannot verify, scored per rubric dimension in [0, 1].

* :class:`RuleJudge` (default): deterministic checks, free to run on every rollout. It is neutral to
  spacing on purpose: the spaced style (``x * 8 + 7``) is a minority habit the offline reward must
  not push either way (the real-time stage's simulated users prefer it).
* :class:`LLMJudge`: any OpenAI-compatible chat endpoint, a rubric prompt and a JSON schema for the
  scores (``response_format={"type": "json_schema", ...}``); the reply is validated, scores are
  integers 0–10 mapped to [0, 1]. Results are cached per (task, code) since GRPO groups repeat.
"""

from __future__ import annotations

import ast
import json
import threading
import warnings
from typing import Protocol

import openai
from openai import OpenAI

from offline_rl.config import JudgeSettings
from offline_rl.tasks import Task

DIMENSIONS = ("style", "structure")
SAFE_CALLS = {"abs", "max", "min"}

RUBRIC = """You grade a one-line Python function body written for a task. Score each dimension from 0 to 10.
style: idiomatic and minimal (no redundant parentheses, no no-op terms like +0 or *1, no dead code).
  Spacing conventions are NOT part of style: `x*8+7` and `x * 8 + 7` score the same.
structure: a single pure expression of the argument, no imports, no I/O, no side effects, no calls
  beyond builtins needed for arithmetic (abs, max, min).
Do not judge correctness; tests do that. Answer only with JSON matching the schema."""


class JudgeError(RuntimeError):
    """The judge could not produce a valid score (endpoint down, bad JSON, out-of-range values)."""


class Judge(Protocol):
    dimensions: tuple[str, ...]

    def score(self, task: Task, expression: str) -> dict[str, float]: ...


class RuleJudge:
    """Deterministic rubric: style and structure from the expression's syntax tree."""

    dimensions = DIMENSIONS

    def score(self, task: Task, expression: str) -> dict[str, float]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            try:
                tree = ast.parse(expression.strip(), mode="eval")
            except (SyntaxError, ValueError, MemoryError, RecursionError):
                return {"style": 0.0, "structure": 0.0}
        nodes = list(ast.walk(tree))
        structure = 1.0
        if any(isinstance(n, ast.Call) and not (isinstance(n.func, ast.Name) and n.func.id in SAFE_CALLS)
               for n in nodes):
            structure -= 0.5
        if any(isinstance(n, ast.Attribute | ast.Lambda | ast.NamedExpr | ast.comprehension) for n in nodes):
            structure -= 0.5
        if not any(isinstance(n, ast.Name) and n.id == "x" for n in nodes):
            structure -= 0.5  # a constant ignores its argument
        style = 1.0
        for n in nodes:
            no_op = isinstance(n, ast.BinOp) and isinstance(n.right, ast.Constant) and (
                (isinstance(n.op, ast.Add | ast.Sub) and n.right.value == 0)
                or (isinstance(n.op, ast.Mult | ast.FloorDiv) and n.right.value == 1))
            if no_op:
                style -= 0.5
        compact = "".join(expression.split())
        if compact.startswith("(") and compact.endswith(")"):
            style -= 0.25  # parentheses around the whole expression
        if len(nodes) > 25:
            style -= 0.25
        return {"style": max(0.0, style), "structure": max(0.0, structure)}


def score_schema(dimensions: tuple[str, ...]) -> dict:
    return {
        "name": "rubric_scores",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {d: {"type": "integer", "minimum": 0, "maximum": 10} for d in dimensions},
            "required": list(dimensions),
            "additionalProperties": False,
        },
    }


class LLMJudge:
    """Rubric scores from an OpenAI-compatible chat-completions endpoint (official ``openai`` client)."""

    def __init__(self, settings: JudgeSettings, dimensions: tuple[str, ...] = DIMENSIONS, rubric: str = RUBRIC):
        self.settings = settings
        self.dimensions = tuple(dimensions)
        self.rubric = rubric
        self.client = OpenAI(base_url=settings.endpoint, api_key=settings.api_key.get_secret_value(),
                             timeout=settings.timeout_s, max_retries=settings.max_retries)
        self._cache: dict[tuple[str, str], dict[str, float]] = {}
        self._lock = threading.Lock()
        self.calls = 0

    def score(self, task: Task, expression: str) -> dict[str, float]:
        key = (task.task_id, expression.strip())
        with self._lock:
            if key in self._cache:
                return self._cache[key]

        messages = [
            {"role": "system", "content": self.rubric},
            {"role": "user", "content": f"Task:\n{task.prompt}\n\nAnswer (the expression after `return`):\n"
                                        f"{expression.strip()}"},
        ]
        try:
            reply = self.client.chat.completions.create(
                model=self.settings.model, messages=messages, temperature=0,
                response_format={"type": "json_schema", "json_schema": score_schema(self.dimensions)},
            )
        except openai.OpenAIError as err:
            raise JudgeError(f"judge endpoint failed: {type(err).__name__}: {err}") from None
        self.calls += 1
        scores = parse_scores(reply.choices[0].message.content if reply.choices else None, self.dimensions)
        with self._lock:
            self._cache[key] = scores
        return scores


def parse_scores(content: str | None, dimensions: tuple[str, ...]) -> dict[str, float]:
    """Validate the judge's JSON: every dimension present, an integer in 0..10; mapped to [0, 1]."""
    if not content:
        raise JudgeError("judge returned no content")
    try:
        data = json.loads(content)
    except ValueError:
        raise JudgeError(f"judge reply is not JSON: {content[:120]!r}") from None
    if not isinstance(data, dict):
        raise JudgeError("judge reply is not a JSON object")
    out = {}
    for d in dimensions:
        v = data.get(d)
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 10:
            raise JudgeError(f"judge score for {d!r} missing or out of range: {v!r}")
        out[d] = float(v) / 10.0
    return out


def make_judge(settings: JudgeSettings, dimensions: tuple[str, ...] = DIMENSIONS) -> Judge:
    if settings.kind == "llm":
        return LLMJudge(settings, dimensions)
    return RuleJudge()
