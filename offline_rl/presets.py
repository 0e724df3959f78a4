"""Named setting overrides for the offline stage.

* ``functions`` (alias ``fast``): the single-turn function-synthesis environment instead of agent
  episodes: a model writes one expression from a few input/output examples. A few minutes on two
  cores from a fresh model to the gate, so CI and ``rtrl demo --fast`` use it. Mid-training reads
  function documents only; GRPO updates only the normalisation gains (``trainable = "norm"``), which
  on this task sharpen the output distribution: ``rtrl eval`` shows how much of its gain a lower
  temperature gives as well (docs/results.md).

The defaults (no preset) are the agent environment: repository tasks, multi-turn tool use, a corpus
of agent transcripts, full-parameter GRPO.
"""

from __future__ import annotations

from typing import Any

FUNCTIONS: dict[str, dict[str, Any]] = {
    "env": {"kind": "functions", "mode": "single", "max_turns": 3},
    "midtrain": {"steps": 400, "agent_share": 0.0, "batch_tokens": 2880},
    "grpo": {"steps": 40, "prompts_per_step": 48, "lr": 3e-2, "warmup_steps": 5, "trainable": "norm",
             "max_new_tokens": 32, "eval_every": 10, "micro_batch": 64},
    "eval": {"gate_threshold": 0.3, "gate_min_gain": None, "samples": 8, "k": [1, 4, 8]},
}

# section -> field -> value
PRESETS: dict[str, dict[str, dict[str, Any]]] = {"functions": FUNCTIONS, "fast": FUNCTIONS}


def apply_preset(settings, name: str | None):
    """Return ``settings`` with the preset's fields set (validated); ``None`` leaves them as they are."""
    if not name:
        return settings
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(sorted(PRESETS))}")
    return apply_overrides(settings, PRESETS[name])


def apply_overrides(settings, overrides: dict[str, dict[str, Any]]):
    """Set ``overrides`` (section -> field -> value) on ``settings`` in place (validated) and return it."""
    for section, values in overrides.items():
        target = getattr(settings, section)
        for key, value in values.items():
            setattr(target, key, value)
    return settings
