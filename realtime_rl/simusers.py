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
import math
import random
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
from openai import OpenAI

from offline_rl.tasks import Task
from policy.sampling import SamplingParams, generate

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


KINDS = ("style", "brevity", "correctness", "reject_all", "accept_all")
"""User kinds. ``style``: correct and in the spaced style (insisting with probability ``strictness``);
``brevity``: correct with no redundant characters (spaces are free); ``correctness``: any correct
answer; ``reject_all`` / ``accept_all``: adversarial, the same verdict whatever the answer."""
ADVERSARIAL = ("reject_all", "accept_all")


def spaced_form(text: str) -> str | None:
    """The canonical spaced rendering of an answer's first line (None: not an expression)."""
    tree = parse_answer(text)
    return ast.unparse(tree) if tree is not None else None


def is_brief(text: str, task: Task) -> bool:
    """No redundant characters: the first line without spaces is no longer than the reference."""
    reference = task.reference or ""
    return len(text.split("\n", 1)[0].replace(" ", "")) <= len(reference.replace(" ", ""))


@dataclass
class SimUser:
    """One simulated caller. The simple preset uses only ``strictness`` (kind ``style``, no noise,
    feedback on every completion at once); the realistic population sets the other fields."""

    name: str
    strictness: float
    kind: str = "style"
    noise: float = 0.0
    feedback_rate: float = 1.0
    delay_probability: float = 0.0
    edit_probability: float | None = None
    activity: float = 1.0
    edits_fix: bool = False
    api_key: str = field(default="", repr=False)
    caller: str = ""

    def prefers(self, task: Task, text: str, rng: random.Random) -> bool:
        """This user's verdict before noise (``style`` draws its insistence from ``rng``)."""
        if self.kind == "accept_all":
            return True
        if self.kind == "reject_all":
            return False
        correct = is_correct(text, task)
        if self.kind == "style":
            wants_style = rng.random() < self.strictness
            return correct and (is_spaced(text) or not wants_style)
        if self.kind == "brevity":
            return correct and is_brief(text, task)
        if self.kind == "correctness":
            return correct
        raise ValueError(f"unknown user kind {self.kind!r}")

    def kept_text(self, task: Task, text: str) -> str:
        """What this user keeps when editing: the answer in their own style when it was right; when it
        was wrong, the right answer (``edits_fix``) or the part before the mistake (simple preset)."""
        correct = is_correct(text, task)
        if correct and self.kind != "brevity":
            spaced = spaced_form(text) or ""
            return spaced if self.kind == "style" else text.split("\n", 1)[0]
        if correct or self.edits_fix:
            reference = task.reference or ""
            if self.kind == "style":
                return task.metadata.get("spaced_reference") or spaced_form(reference) or reference
            return reference
        return text[: max(0, len(text) // 2)]

    def judge(self, task: Task, text: str, rng: random.Random, edit_probability: float = 0.0) -> tuple[str, str | None]:
        """(signal, kept_text) for one completion."""
        ok = self.prefers(task, text, rng)
        if self.kind in ADVERSARIAL:
            return ("accept" if ok else "reject"), None
        if self.noise and rng.random() < self.noise:
            ok = not ok
        if ok:
            return "accept", None
        p_edit = edit_probability if self.edit_probability is None else self.edit_probability
        if rng.random() < p_edit:
            return "edit", self.kept_text(task, text)
        return "reject", None


def make_population(n: int, seed: int, lo: float, hi: float) -> list[SimUser]:
    """The simple preset: ``n`` style users with strictness ~ U[lo, hi], nothing else."""
    rng = random.Random(seed)
    return [SimUser(name=f"sim-{seed}-{i:03d}", strictness=rng.uniform(lo, hi)) for i in range(n)]


def kind_counts(n: int, shares: dict[str, float]) -> dict[str, int]:
    """Split ``n`` users by ``shares`` (largest remainder, so the counts add up to ``n``)."""
    total = sum(shares.values())
    if total <= 0:
        raise ValueError("the user-kind shares must not all be zero")
    exact = {k: n * v / total for k, v in shares.items()}
    counts = {k: int(x) for k, x in exact.items()}
    for k in sorted(exact, key=lambda k: (counts[k] - exact[k], k))[: n - sum(counts.values())]:
        counts[k] += 1
    return counts


def adversarial_count(n_honest: int, share: float) -> int:
    """Adversarial users to add to ``n_honest`` honest ones so that they are ``share`` of all users."""
    return round(n_honest * share / (1.0 - share))


def make_realistic_population(cfg, seed: int | None = None) -> list[SimUser]:
    """``n_users`` honest users of several kinds (``SimUsersSettings``' shares), each with its own noise,
    feedback rate, delay, edit habit and activity; then adversarial users who reject or accept everything,
    added so that they are ``adversarial_share`` of all users. The honest users do not depend on
    ``adversarial_share``: a population with adversaries is the one without them plus the adversaries."""
    seed = cfg.seed if seed is None else seed
    rng = random.Random(seed)
    n_adv = adversarial_count(cfg.n_users, cfg.adversarial_share)
    honest = kind_counts(cfg.n_users, {"style": cfg.style_share, "brevity": cfg.brevity_share,
                                       "correctness": cfg.correctness_share})
    kinds = [k for k in ("style", "brevity", "correctness") for _ in range(honest[k])]
    kinds += [ADVERSARIAL[i % 2] for i in range(n_adv)]
    users = []
    for i, kind in enumerate(kinds):
        adversarial = kind in ADVERSARIAL
        users.append(SimUser(
            name=f"sim-{seed}-{i:03d}", kind=kind,
            strictness=rng.uniform(cfg.style_strictness_min, cfg.style_strictness_max),
            noise=0.0 if adversarial else rng.uniform(0.0, cfg.noise_max),
            feedback_rate=1.0 if adversarial else rng.uniform(cfg.feedback_rate_min, cfg.feedback_rate_max),
            delay_probability=0.0 if adversarial else cfg.delay_probability,
            edit_probability=0.0 if adversarial else (cfg.style_edit_probability if kind == "style"
                                                      else cfg.edit_probability),
            activity=(cfg.adversarial_activity if adversarial else rng.lognormvariate(0.0, cfg.activity_sigma)),
            edits_fix=True))
    return users


def build_population(cfg, seed: int | None = None) -> list[SimUser]:
    """The configured population (``simusers.population``)."""
    if cfg.population == "simple":
        return make_population(cfg.n_users, cfg.seed if seed is None else seed, cfg.style_strictness_min,
                               cfg.style_strictness_max)
    return make_realistic_population(cfg, seed)


def register_keys(users: Sequence[SimUser], issue: Callable[[str], tuple[str, str]]) -> None:
    """Give every user an API key of its own: ``issue(name)`` returns (plaintext key, caller id), e.g.
    ``functools.partial(serving.auth.issue_key, settings)``."""
    for u in users:
        u.api_key, u.caller = issue(u.name)


def task_weights(tasks: Sequence[Task], t: int, day_length: int, shift: float) -> list[float]:
    """Traffic mix at request ``t``: each task bucket's weight follows its own phase of a cosine with
    period ``day_length`` requests (amplitude ``shift``), so the mix of task kinds moves over the day."""
    buckets = sorted({task.bucket for task in tasks})
    phase = {b: i / len(buckets) for i, b in enumerate(buckets)}
    return [1.0 + shift * math.cos(2 * math.pi * (t / day_length - phase[task.bucket])) for task in tasks]


def plan_traffic(users: Sequence[SimUser], tasks: Sequence[Task], n: int, seed: int, *, start: int = 0,
                 day_length: int = 0, shift: float = 0.0) -> list[tuple[SimUser, Task, int]]:
    """(user, task, per-request seed) for ``n`` honest requests plus the adversarial users' own.

    Honest users are drawn in proportion to ``activity``, tasks uniformly or, with ``day_length``, by the
    moving mix of :func:`task_weights`. Adversarial users (if any) send requests *on top*, as many as
    their share of the activity implies (an adversarial user with activity 2 sends twice as many as an
    honest user of activity 1), interleaved at random points of the day from a second random stream;
    so the honest part of the plan is the same request for request with or without them."""
    honest = [u for u in users if u.kind not in ADVERSARIAL]
    hostile = [u for u in users if u.kind in ADVERSARIAL]
    if not honest:
        raise ValueError("a traffic plan needs at least one honest user")

    def draw(rng: random.Random, pool: Sequence[SimUser], at: int) -> tuple[SimUser, Task, int]:
        user = rng.choice(pool) if all(u.activity == 1.0 for u in pool) else \
            rng.choices(pool, [u.activity for u in pool])[0]
        if day_length > 0 and shift:
            task = rng.choices(tasks, task_weights(tasks, start + at, day_length, shift))[0]
        else:
            task = rng.choice(tasks)
        return user, task, rng.randrange(1 << 30)

    rng = random.Random(seed)
    plan = [draw(rng, honest, i) for i in range(n)]
    if not hostile:
        return plan
    extra = round(n * sum(u.activity for u in hostile) / sum(u.activity for u in honest))
    rng = random.Random(f"adversarial-{seed}")
    slots = sorted(rng.randrange(n + 1) for _ in range(extra))
    # An adversarial request at slot i goes just before honest request i (the sort is stable).
    merged = [(i, 1, r) for i, r in enumerate(plan)] + [(at, 0, draw(rng, hostile, at)) for at in slots]
    return [r for *_, r in sorted(merged, key=lambda x: x[:2])]


@dataclass
class FeedbackBacklog:
    """Feedback that users send late: (due chunk, api key, body), carried from one chunk of traffic
    to a later one. Whatever is still here when the traffic ends was never sent."""

    items: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    max_delay_chunks: int = 3

    def due(self, chunk: int) -> list[tuple[str, dict[str, Any]]]:
        ready = [(key, body) for c, key, body in self.items if c <= chunk]
        self.items = [it for it in self.items if it[0] > chunk]
        return ready


@dataclass
class TrafficStats:
    requests: int = 0
    accepted: int = 0
    errors: int = 0
    feedback_errors: int = 0
    per_version: dict[str, list[int]] = field(default_factory=dict)  # version -> [judged, accepted]
    per_kind: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # version -> kind -> [n, accepted]
    spaced: int = 0
    correct: int = 0
    judged: int = 0
    no_feedback: int = 0
    delayed: int = 0
    feedback_sent: int = 0
    error_samples: list[str] = field(default_factory=list)

    def accept_rate(self, version: str | None = None) -> float:
        if version is None:
            return self.accepted / self.judged if self.judged else 0.0
        n, a = self.per_version.get(version, [0, 0])
        return a / n if n else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["accept_rate"] = self.accept_rate()
        return d


def _feedback_fate(user: SimUser, rng: random.Random) -> str:
    """``now``, ``late`` or ``never`` (the simple preset always answers at once, drawing nothing)."""
    if user.feedback_rate < 1.0 and rng.random() >= user.feedback_rate:
        return "never"
    if user.delay_probability > 0.0 and rng.random() < user.delay_probability:
        return "late"
    return "now"


def run_traffic(base_url: str, users: Sequence[SimUser], tasks: Sequence[Task], *, n_requests: int,
                model: str, seed: int = 0, concurrency: int = 4, temperature: float = 1.0, max_tokens: int = 16,
                edit_probability: float = 0.0, timeout_s: float = 60.0, backlog: FeedbackBacklog | None = None,
                chunk: int = 0, start: int = 0, day_length: int = 0, shift: float = 0.0) -> TrafficStats:
    """Send ``n_requests`` honest completions (and the adversarial users' on top, see
    :func:`plan_traffic`) through the gateway and report each user's judgement.

    Feedback owed from earlier chunks (``backlog``) goes out first; a user's late feedback is put in
    ``backlog`` for a later chunk (without a backlog it is sent at once). ``start`` is this chunk's
    first request number on the day (see :func:`plan_traffic`)."""

    plan = plan_traffic(users, tasks, n_requests, seed, start=start, day_length=day_length, shift=shift)
    stats = TrafficStats()
    lock = threading.Lock()
    clients = {u.name: OpenAI(api_key=u.api_key, base_url=base_url.rstrip("/") + "/v1", timeout=timeout_s,
                              max_retries=2) for u in users}
    http = httpx.Client(base_url=base_url, timeout=timeout_s)
    jitter = random.Random(seed + 1)

    def send(key: str, body: dict[str, Any]) -> None:
        try:
            fb = http.post("/v1/feedback", json=body, headers={"Authorization": f"Bearer {key}"})
            problem = f"feedback {fb.status_code}: {fb.text[:200]}" if fb.status_code >= 300 else None
        except httpx.HTTPError as err:  # counted like a refused feedback; the simulation goes on
            problem = f"feedback {type(err).__name__}: {err}"[:300]
        with lock:
            stats.feedback_sent += 1
            if problem is not None:
                stats.feedback_errors += 1
                if len(stats.error_samples) < 5:
                    stats.error_samples.append(problem)

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
            fate = _feedback_fate(user, r)
            body = {"completion_id": extra["completion_id"], "feedback_token": extra["feedback_token"],
                    "signal": signal}
            if kept is not None:
                body["kept_text"] = kept
            if fate == "now" or (fate == "late" and backlog is None):
                send(user.api_key, body)
            elif fate == "late":
                with lock:
                    due = chunk + 1 + jitter.randrange(max(1, backlog.max_delay_chunks))
                    backlog.items.append((due, user.api_key, body))
        except Exception as err:  # one failed request must not stop the simulation; it is counted
            with lock:
                stats.errors += 1
                if len(stats.error_samples) < 5:
                    stats.error_samples.append(f"{type(err).__name__}: {err}"[:300])
            return
        with lock:
            stats.requests += 1
            stats.correct += is_correct(text, task)
            stats.spaced += is_spaced(text)
            if fate == "never":
                stats.no_feedback += 1
                return
            stats.delayed += fate == "late"
            acc = signal == "accept"
            stats.judged += 1
            stats.accepted += acc
            for tally in (stats.per_version.setdefault(version, [0, 0]),
                          stats.per_kind.setdefault(version, {}).setdefault(user.kind, [0, 0])):
                tally[0] += 1
                tally[1] += acc

    try:
        owed = backlog.due(chunk) if backlog is not None else []
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            list(pool.map(lambda kb: send(*kb), owed))
            list(pool.map(one, plan))
    finally:
        http.close()
        for c in clients.values():
            c.close()
    return stats


def judge_in_process(model, tokenizer, users: Sequence[SimUser], tasks: Sequence[Task], *, n_requests: int,
                     temperature: float, max_tokens: int, seed: int, day_length: int = 0, shift: float = 0.0,
                     batch: int = 256) -> list[tuple[str, bool]]:
    """(user kind, accepted) for each request of the plan for ``n_requests`` (:func:`plan_traffic`),
    sampled in-process with the torch sampler and judged by the same users as :func:`run_traffic` (no
    gateway, every completion judged: the feedback rate only decides what reaches training, not what a
    user thinks). The same ``seed`` gives every model the same users, tasks and per-request judging draws, so two models'
    outcomes can be compared request by request (e.g. at different temperatures)."""

    plan = plan_traffic(users, tasks, n_requests, seed, day_length=day_length, shift=shift)
    out: list[tuple[str, bool]] = []
    for i in range(0, len(plan), batch):
        part = plan[i:i + batch]
        samples = generate(model, tokenizer, [task.prompt for _, task, _ in part],
                           SamplingParams(temperature=temperature, max_new_tokens=max_tokens, stop=["\n"],
                                          seed=seed + i))
        for (user, task, s), (sample,) in zip(part, samples, strict=True):
            signal, _ = user.judge(task, sample.text, random.Random(s))
            out.append((user.kind, signal == "accept"))
    return out
