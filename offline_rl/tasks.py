"""Coding tasks: the format, a JSONL loader, and the built-in function-synthesis generator.

A task shows a few input/output examples of a hidden one-argument integer function and asks for
its body as one expression::

    # f(0)=7 f(1)=15 f(2)=23 f(8)=71
    def f(x): return x*8+7

The hidden tests use inputs the prompt does not show (including negatives, which separate e.g.
``abs(x-3)`` from ``x-3``). Functions come from six families; the train / held-out split holds out a
share of *each* family, because splitting by function alone left the held-out set mostly affine.
A split is by function, so no held-out function ever appears in training prompts or the corpus.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ENTRY_POINT = "f"
ANCHOR_INPUTS = (0, 1, 2)
"""Always shown: f(0) gives the constant, f(1) - f(0) the slope, so the task is inference, not guesswork."""
VISIBLE_INPUTS = range(3, 13)
HIDDEN_INPUTS = (-7, -3, -1, 5, 11, 17, 23, 31)
N_VISIBLE = 4
N_HIDDEN = 6


@dataclass(frozen=True)
class TestCase:
    args: list[Any]
    expected: Any


@dataclass(frozen=True)
class Task:
    """One coding task. ``tests`` are hidden from the policy; only the sandbox harness sees them."""

    task_id: str
    prompt: str
    tests: list[TestCase]
    examples: list[TestCase] = field(default_factory=list)
    entry_point: str = ENTRY_POINT
    bucket: str = "default"
    reference: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Task:
        missing = {"task_id", "prompt", "tests"} - d.keys()
        if missing:
            raise ValueError(f"task is missing {sorted(missing)}")
        tests = [TestCase(list(t["args"]), t["expected"]) for t in d["tests"]]
        if not tests:
            raise ValueError(f"task {d['task_id']} has no tests")
        examples = [TestCase(list(t["args"]), t["expected"]) for t in d.get("examples", [])]
        return Task(task_id=str(d["task_id"]), prompt=d["prompt"], tests=tests, examples=examples,
                    entry_point=d.get("entry_point", ENTRY_POINT), bucket=d.get("bucket", "default"),
                    reference=d.get("reference"), metadata=dict(d.get("metadata", {})))


@dataclass(frozen=True)
class TaskSplit:
    train: list[Task]
    heldout: list[Task]


@dataclass(frozen=True)
class FunctionSpec:
    """A hidden function: its family, the canonical expression and the minority 'spaced' style."""

    family: str
    expr: str
    spaced: str

    def __call__(self, x: int) -> int:
        return eval(self.expr, {"abs": abs, "max": max, "min": min}, {"x": x})  # trusted, generated here


TEMPLATES = {"affine": ("x*{a}+{b}", "x * {a} + {b}"), "square": ("x*x+{c}", "x * x + {c}"),
             "abs": ("abs(x-{c})", "abs(x - {c})"), "max": ("max(x,{c})", "max(x, {c})"),
             "min": ("min(x,{c})", "min(x, {c})"), "mod": ("x%{c}", "x % {c}")}
"""Each family's canonical expression and its 'spaced' style, with the constants as fields."""


def make_spec(family: str, **constants: int) -> FunctionSpec:
    """The function of ``family`` with these constants (``a``, ``b`` for affine, else ``c``)."""
    expr, spaced = TEMPLATES[family]
    return FunctionSpec(family, expr.format(**constants), spaced.format(**constants))


def function_specs() -> list[FunctionSpec]:
    """Every function a task may hide (the task grammar)."""
    specs = [make_spec("affine", a=a, b=b) for a in range(1, 10) for b in range(0, 25)]
    specs += [make_spec("square", c=c) for c in range(0, 20)]
    specs += [make_spec("abs", c=c) for c in range(1, 21)]
    specs += [make_spec(f, c=c) for c in range(0, 20) for f in ("max", "min")]
    specs += [make_spec("mod", c=c) for c in range(2, 10)]
    return specs


def outside_specs() -> list[FunctionSpec]:
    """Functions of the same families whose constants lie beyond :func:`function_specs`' ranges: no task
    is drawn from them, so none is ever held out, and a corpus may show any of them (``midtrain.rule_drill``)."""
    specs = [make_spec("affine", a=a, b=b) for a in range(10, 20) for b in range(0, 25)]
    specs += [make_spec("affine", a=a, b=b) for a in range(1, 10) for b in range(25, 40)]
    specs += [make_spec("square", c=c) for c in range(20, 40)]
    specs += [make_spec("abs", c=c) for c in range(21, 41)]
    specs += [make_spec(f, c=c) for f in ("max", "min") for c in range(20, 40)]
    specs += [make_spec("mod", c=c) for c in range(10, 20)]
    return specs


def split_specs(seed: int = 0, heldout_fraction: float = 0.2) -> tuple[list[FunctionSpec], list[FunctionSpec]]:
    """Hold out ``heldout_fraction`` of each family (at least one function per family)."""
    rng = random.Random(seed)
    train: list[FunctionSpec] = []
    heldout: list[FunctionSpec] = []
    by_family: dict[str, list[FunctionSpec]] = {}
    for spec in function_specs():
        by_family.setdefault(spec.family, []).append(spec)
    for family in sorted(by_family):
        specs = by_family[family][:]
        rng.shuffle(specs)
        n_held = max(1, round(len(specs) * heldout_fraction))
        heldout += specs[:n_held]
        train += specs[n_held:]
    return train, heldout


def render_prompt(examples: list[TestCase]) -> str:
    shown = " ".join(f"{ENTRY_POINT}({t.args[0]})={t.expected}" for t in examples)
    return f"# {shown}\ndef {ENTRY_POINT}(x): return "


def visible_inputs(rng: random.Random) -> list[int]:
    """The anchors 0, 1, 2 plus random inputs from 3..12 (which may reveal a kink: abs, max, min, mod)."""
    return list(ANCHOR_INPUTS) + sorted(rng.sample(list(VISIBLE_INPUTS), N_VISIBLE - len(ANCHOR_INPUTS)))


def make_task(spec: FunctionSpec, rng: random.Random, task_id: str) -> Task:
    visible = visible_inputs(rng)
    hidden = rng.sample(HIDDEN_INPUTS, N_HIDDEN)
    examples = [TestCase([x], spec(x)) for x in visible]
    tests = [TestCase([x], spec(x)) for x in hidden]
    return Task(task_id=task_id, prompt=render_prompt(examples), tests=tests, examples=examples,
                bucket=spec.family, reference=spec.expr,
                metadata={"family": spec.family, "spaced_reference": spec.spaced})


def generate_tasks(seed: int = 0, heldout_fraction: float = 0.2, instances_per_function: int = 1) -> TaskSplit:
    """Deterministic train / held-out tasks; held-out functions never appear in training."""
    train_specs, held_specs = split_specs(seed, heldout_fraction)
    rng = random.Random(seed + 1)
    train = [make_task(s, rng, f"train-{i}-{k}") for i, s in enumerate(train_specs)
             for k in range(instances_per_function)]
    heldout = [make_task(s, rng, f"heldout-{i}") for i, s in enumerate(held_specs)]
    return TaskSplit(train=train, heldout=heldout)


def corpus(n_examples: int, seed: int = 0, heldout_fraction: float = 0.2,
           spaced_share: float = 0.2, split_seed: int | None = None) -> Iterator[str]:
    """Mid-training documents: train-split functions only, fresh visible examples each time.

    ``seed`` draws the documents; ``split_seed`` (default: ``seed``) is the seed of the split whose
    held-out functions must stay out: the task generator's (``tasks.seed``) for a corpus the model
    is later evaluated against.

    ``spaced_share`` of the answers use the spaced style (``x * 8 + 7``): a minority habit the
    offline reward ignores but the simulated users of the real-time stage prefer.
    """
    train_specs, _ = split_specs(seed if split_seed is None else split_seed, heldout_fraction)
    rng = random.Random(seed + 2)
    for _ in range(n_examples):
        spec = rng.choice(train_specs)
        visible = visible_inputs(rng)
        answer = spec.spaced if rng.random() < spaced_share else spec.expr
        yield render_prompt([TestCase([x], spec(x)) for x in visible]) + answer + "\n"


def load_tasks_jsonl(path: str | Path) -> list[Task]:
    """Read one task per line; a bad line is an error naming the file and line number."""
    tasks = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                tasks.append(Task.from_dict(json.loads(line)))
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{lineno}: invalid task: {err}") from None
    return tasks


def write_tasks_jsonl(tasks: list[Task], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for task in tasks:
            fh.write(task.to_json() + "\n")
