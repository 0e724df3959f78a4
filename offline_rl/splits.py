"""Train / held-out task splits for the configured environment (built-in generators or your files).

Held-out tasks never share a function with training tasks or the mid-training corpus: the generators
hold out a share of each function family (:func:`offline_rl.tasks.split_specs`), and loaded files
say which tasks are held out.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from offline_rl.config import EnvSettings, TaskSettings
from offline_rl.repo_tasks import (
    RepoTask,
    RepoTaskSplit,
    TaskFormatError,
    generate_repo_tasks,
    load_repo_tasks,
)
from offline_rl.tasks import Task, TaskSplit, generate_tasks, load_tasks_jsonl, make_task, split_specs


def load_task_split(ts: TaskSettings) -> TaskSplit:
    """Function-synthesis tasks: the generator, or a JSONL file whose tasks say ``metadata.split``."""
    if ts.jsonl:
        tasks = load_tasks_jsonl(ts.jsonl)
        held = [t for t in tasks if t.metadata.get("split") == "heldout"]
        train = [t for t in tasks if t.metadata.get("split") != "heldout"]
        if not held or not train:
            raise ValueError(f"{ts.jsonl}: needs tasks with metadata.split == 'heldout' and others for training")
        return TaskSplit(train=train, heldout=held)
    split = generate_tasks(ts.seed, ts.heldout_fraction)
    if ts.train_instances == 1:
        return split
    # More training prompts per train function (fresh visible examples each), from the same split, so
    # the held-out set is exactly the generator's and no held-out function can leak in.
    train_specs, _ = split_specs(ts.seed, ts.heldout_fraction)
    rng = random.Random(ts.seed + 10_007)
    train = [make_task(spec, rng, f"train-{i}-{k}") for i, spec in enumerate(train_specs)
             for k in range(ts.train_instances)]
    return TaskSplit(train=train, heldout=split.heldout)


def load_repo_split(ts: TaskSettings) -> RepoTaskSplit:
    """Repository tasks: the generator, or ``tasks.repo_path`` (each task's ``split`` says which side)."""
    if ts.repo_path:
        tasks = load_repo_tasks(ts.repo_path)
        held = [t for t in tasks if t.split == "heldout"]
        train = [t for t in tasks if t.split != "heldout"]
        if not held or not train:
            raise TaskFormatError(f"{ts.repo_path}: needs tasks with split 'heldout' and others for training")
        return RepoTaskSplit(train=train, heldout=held)
    return generate_repo_tasks(ts.seed, ts.heldout_fraction, ts.repo_train_per_function, ts.repo_heldout_per_family,
                               tuple(ts.repo_families))


@dataclass(frozen=True)
class Split:
    train: list[Task] | list[RepoTask]
    heldout: list[Task] | list[RepoTask]


def load_split(tasks: TaskSettings, env: EnvSettings) -> Split:
    """The split the configured environment plays (``env.kind``)."""
    s = load_repo_split(tasks) if env.kind == "repo" else load_task_split(tasks)
    return Split(train=list(s.train), heldout=list(s.heldout))
