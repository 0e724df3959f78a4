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
