"""Named setting overrides for the offline stage, measured on the 2-core reference machine.

``fast`` is the CI / ``demo --fast`` path: a shorter mid-training and GRPO run that still takes the
tiny model from below the gate to over it (numbers in the docstring of ``PRESETS``).
"""

from __future__ import annotations

from typing import Any

from rtrl.config import Settings

# section -> field -> value
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "fast": {
        "midtrain": {"steps": 450, "warmup_steps": 10},
        "grpo": {"steps": 30, "eval_every": 15, "checkpoint_every": 15},
        "eval": {"samples": 4, "k": [1, 4]},
    },
}


def apply_preset(settings: Settings, name: str | None) -> Settings:
    """Return ``settings`` with the preset's fields set (validated); ``None`` leaves them as they are."""
    if not name:
        return settings
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(sorted(PRESETS))}")
    for section, values in PRESETS[name].items():
        target = getattr(settings, section)
        for key, value in values.items():
            setattr(target, key, value)
    return settings
