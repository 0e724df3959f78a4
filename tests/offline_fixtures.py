"""Fixtures for the offline-RL tests: a briefly mid-trained tiny model (rewards vary within groups)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def warm_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model after 120 mid-training steps: it writes one-line expressions, mostly wrong."""
    from offline_rl.midtrain import run_midtrain
    from rtrl.config import load_settings

    s = load_settings()
    s.midtrain.steps, s.midtrain.batch_tokens, s.midtrain.warmup_steps, s.midtrain.eval_at_end = 120, 1440, 5, False
    s.midtrain.agent_share = 0.0  # function documents only
    return run_midtrain(s, init_dir=tiny_model_dir, out_dir=tmp_path_factory.mktemp("warm_model"), progress=False)
