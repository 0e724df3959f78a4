"""Fixtures for the offline-RL tests: a briefly mid-trained tiny model (rewards vary within groups),
dense and mixture-of-experts."""

from __future__ import annotations

from pathlib import Path

import pytest


def _warm(init_dir: Path, out_dir: Path) -> Path:
    """``init_dir`` after 120 mid-training steps on function documents."""
    from offline_rl.midtrain import run_midtrain
    from rtrl.config import load_settings

    s = load_settings()
    s.midtrain.steps, s.midtrain.batch_tokens, s.midtrain.warmup_steps, s.midtrain.eval_at_end = 120, 1440, 5, False
    s.midtrain.agent_share = 0.0  # function documents only
    return run_midtrain(s, init_dir=init_dir, out_dir=out_dir, progress=False)


@pytest.fixture(scope="session")
def warm_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model after 120 mid-training steps: it writes one-line expressions, mostly wrong."""
    return _warm(tiny_model_dir, tmp_path_factory.mktemp("warm_model"))


@pytest.fixture(scope="session")
def warm_moe_dir(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny mixture-of-experts model after the same 120 mid-training steps."""
    return _warm(tiny_moe_dir, tmp_path_factory.mktemp("warm_moe"))


def imitate(s, init_dir: Path, tmp_path: Path, tasks: list, habits) -> Path:
    """``init_dir`` mid-trained for 150 steps on the demonstrator's transcripts of ``tasks`` played with
    ``habits`` (reduced-budget learning tests)."""
    from offline_rl.demos import task_transcripts
    from offline_rl.midtrain import run_midtrain

    s.midtrain.steps, s.midtrain.batch_tokens, s.midtrain.eval_at_end = 150, 2048, False
    docs = task_transcripts(tasks, habits, split_seed=s.tasks.seed, heldout_fraction=s.tasks.heldout_fraction)
    return run_midtrain(s, init_dir=init_dir, out_dir=tmp_path / "midtrain", progress=False, documents=docs)


def train_and_evaluate_on(s, tasks: list, tmp_path: Path) -> None:
    """Settings for a direction test: GRPO (10 sync steps of 4 x 8) draws its prompts from ``tasks``, and
    the evaluation sees the same tasks under other ids."""
    import dataclasses

    from offline_rl.repo_tasks import write_repo_tasks

    both = [dataclasses.replace(t, split="train") for t in tasks]
    both += [dataclasses.replace(t, task_id="eval-" + t.task_id, split="heldout") for t in tasks]
    write_repo_tasks(both, tmp_path / "tasks.jsonl")
    s.tasks.repo_path = str(tmp_path / "tasks.jsonl")
    g = s.grpo
    g.out_dir, g.mode, g.steps, g.prompts_per_step, g.group_size = str(tmp_path / "grpo"), "sync", 10, 4, 8
    g.lr, g.eval_every, g.warmup_steps, g.publish = 2e-4, 0, 0, False


def before_and_after(s, start: Path, final: Path, temperatures: list[float], samples: int = 32) -> dict:
    """Temperature grids of the start model and the trained one on the configured held-out tasks."""
    from offline_rl.evaluate import temperature_grid
    from policy.loading import load_policy

    grids = {}
    for name, path in (("before", start), ("after", final)):
        p = load_policy(path)
        grids[name] = temperature_grid(s, p.model, p.tokenizer, temperatures, samples=samples)
    return grids
