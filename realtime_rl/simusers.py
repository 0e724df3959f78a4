"""Simulated users: a population of callers with hidden preferences, talking to the real gateway.

Each user accepts a completion only when

* it is **correct**: the first line, parsed as an expression of ``x``, reproduces the task's hidden
  tests (evaluated by a whitelisting AST interpreter: integers, ``x``, + − * // % and abs/max/min;
  anything else is simply wrong, nothing is ever executed), and
* it is in the **spaced style** (``x * 8 + 7``, i.e. exactly how ``ast.unparse`` writes it), which the
  offline reward ignores and only a fifth of the pre-training corpus uses; each user insists on the
  style with its own probability ``strictness`` ~ U[style_strictness_min, style_strictness_max].

Otherwise the user rejects (or, with ``edit_probability``, edits: keeps the answer's text rewritten
to the spaced style if it was correct, else the part before the first mistake). Requests go through
the official ``openai`` client against the gateway with the user's own API key, with
``metadata.task_bucket`` = the task family; judgements go to ``POST /v1/feedback`` with the same key.
"""

from __future__ import annotations

import ast
import random
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from offline_rl.tasks import Task

MAX_NODES = 64
MAX_ABS = 10**12


class _Reject(Exception):
    pass


def _eval(node: ast.AST, x: int) -> int:
    if isinstance(node, ast.Expression):
        return _eval(node.body, x)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name) and node.id == "x":
        return x
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _eval(node.operand, x)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left, x), _eval(node.right, x)
        if isinstance(node.op, ast.Add):
            v = a + b
        elif isinstance(node.op, ast.Sub):
            v = a - b
        elif isinstance(node.op, ast.Mult):
            v = a * b
        elif isinstance(node.op, ast.FloorDiv | ast.Mod):
            if b == 0:
                raise _Reject
            v = a // b if isinstance(node.op, ast.FloorDiv) else a % b
        else:
            raise _Reject
        if abs(v) > MAX_ABS:
            raise _Reject
        return v
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("abs", "max", "min")
            and not node.keywords):
        args = [_eval(a, x) for a in node.args]
        if node.func.id == "abs" and len(args) == 1:
            return abs(args[0])
        if node.func.id in ("max", "min") and len(args) >= 2:
            return max(args) if node.func.id == "max" else min(args)
    raise _Reject


def parse_answer(text: str) -> ast.Expression | None:
    line = text.split("\n", 1)[0].strip()
    if not line or len(line) > 200:
        return None
    try:
        with warnings.catch_warnings():  # e.g. "1x" warns about an invalid decimal literal; it is just wrong
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(line, mode="eval")
    except (SyntaxError, ValueError):
        return None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        return None
    return tree


def is_correct(text: str, task: Task) -> bool:
    """Every hidden test of ``task`` passes for the completion's first line."""
    tree = parse_answer(text)
    if tree is None:
        return False
    try:
        return all(_eval(tree, int(t.args[0])) == t.expected for t in task.tests)
    except (_Reject, RecursionError, TypeError, ValueError):
        return False


def is_spaced(text: str) -> bool:
    """The spaced style: the line is exactly its canonical ``ast.unparse`` rendering."""
    tree = parse_answer(text)
    if tree is None:
        return False
    return ast.unparse(tree) == text.split("\n", 1)[0]


@dataclass
class SimUser:
    name: str
    strictness: float
    api_key: str = field(default="", repr=False)

    def judge(self, task: Task, text: str, rng: random.Random, edit_probability: float = 0.0) -> tuple[str, str | None]:
        """(signal, kept_text) for one completion."""
        correct = is_correct(text, task)
        styled = is_spaced(text)
        wants_style = rng.random() < self.strictness
        if correct and (styled or not wants_style):
            return "accept", None
        if rng.random() < edit_probability:
            if correct:
                tree = parse_answer(text)
                return "edit", ast.unparse(tree) if tree is not None else ""
            return "edit", text[: max(0, len(text) // 2)]
        return "reject", None


def make_population(n: int, seed: int, lo: float, hi: float) -> list[SimUser]:
    rng = random.Random(seed)
    return [SimUser(name=f"sim-{seed}-{i:03d}", strictness=rng.uniform(lo, hi)) for i in range(n)]


def register_keys(settings, users: Sequence[SimUser]) -> None:
    from serving.auth import create_api_key

    for u in users:
        u.api_key = create_api_key(settings, u.name)


@dataclass
class TrafficStats:
    requests: int = 0
    accepted: int = 0
    errors: int = 0
    feedback_errors: int = 0
    per_version: dict[str, list[int]] = field(default_factory=dict)  # version -> [n, accepted]
    spaced: int = 0
    correct: int = 0
    error_samples: list[str] = field(default_factory=list)

    def accept_rate(self, version: str | None = None) -> float:
        if version is None:
            return self.accepted / self.requests if self.requests else 0.0
        n, a = self.per_version.get(version, [0, 0])
        return a / n if n else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["accept_rate"] = self.accept_rate()
        return d


def run_traffic(base_url: str, users: Sequence[SimUser], tasks: Sequence[Task], *, n_requests: int,
                model: str, seed: int = 0, concurrency: int = 4, temperature: float = 1.0, max_tokens: int = 16,
                edit_probability: float = 0.0, timeout_s: float = 60.0) -> TrafficStats:
    """Send ``n_requests`` completions through the gateway and report each user's judgement."""
    import threading

    import httpx
    from openai import OpenAI

    rng = random.Random(seed)
    plan = [(rng.choice(users), rng.choice(tasks), rng.randrange(1 << 30)) for _ in range(n_requests)]
    stats = TrafficStats()
    lock = threading.Lock()
    clients = {u.name: OpenAI(api_key=u.api_key, base_url=base_url.rstrip("/") + "/v1", timeout=timeout_s,
                              max_retries=2) for u in users}
    http = httpx.Client(base_url=base_url, timeout=timeout_s)

    def one(item: tuple[SimUser, Task, int]) -> None:
        user, task, s = item
        r = random.Random(s)
        try:
            resp = clients[user.name].completions.create(
                model=model, prompt=task.prompt, max_tokens=max_tokens, temperature=temperature, stop=["\n"],
                extra_body={"metadata": {"task_bucket": task.bucket}})
            choice = resp.choices[0]
            extra = choice.model_extra or {}
            text = choice.text or ""
            version = resp.model.split("@", 1)[1] if "@" in resp.model else resp.model
            signal, kept = user.judge(task, text, r, edit_probability)
            body = {"completion_id": extra["completion_id"], "feedback_token": extra["feedback_token"],
                    "signal": signal}
            if kept is not None:
                body["kept_text"] = kept
            fb = http.post("/v1/feedback", json=body, headers={"Authorization": f"Bearer {user.api_key}"})
        except Exception as err:  # one failed request must not stop the simulation; it is counted
            with lock:
                stats.errors += 1
                if len(stats.error_samples) < 5:
                    stats.error_samples.append(f"{type(err).__name__}: {err}"[:300])
            return
        with lock:
            stats.requests += 1
            acc = signal == "accept"
            stats.accepted += acc
            stats.correct += is_correct(text, task)
            stats.spaced += is_spaced(text)
            pv = stats.per_version.setdefault(version, [0, 0])
            pv[0] += 1
            pv[1] += acc
            if fb.status_code >= 300:
                stats.feedback_errors += 1
                if len(stats.error_samples) < 5:
                    stats.error_samples.append(f"feedback {fb.status_code}: {fb.text[:200]}")

    try:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            list(pool.map(one, plan))
    finally:
        http.close()
        for c in clients.values():
            c.close()
    return stats
