"""Named setting overrides for the offline stage, with what they measured on the shared 2-core machine.

Measurements (tiny model from `rtrl init-model`, 1.53M parameters, T=1, 63 held-out tasks):

* defaults (midtrain 900 steps, lr 3e-3 cosine): held-out pass@1 0.19-0.22 after mid-training
  (~0.4 s/step idle, 1244 s under load 6). GRPO 150 steps (16 prompts x 8, lr 1e-4, async) raised the
  *training* rollouts' pass rate 0.20 -> 0.37 but left held-out pass@1 within noise (0.190 -> 0.188 and
  0.190 -> 0.165 in two runs). ``eval.gate_threshold`` = 0.15 is therefore reached by the mid-trained
  policy; GRPO was not shown to be what carries it over.
* ``fast`` (CI / ``demo --fast``): midtrain 450 steps (263 s under load 3) gave held-out pass@1
  0.03-0.06; GRPO 30 steps took 56 s including two evaluations; the whole offline stage 336 s under
  load 3. Its gate is lowered to 0.02 so that the pipeline runs end to end: it is a smoke path, not a
  quality claim.
"""

from __future__ import annotations

from typing import Any

from rtrl.config import Settings

# section -> field -> value
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "fast": {
        "midtrain": {"steps": 450, "warmup_steps": 10},
        "grpo": {"steps": 30, "eval_every": 15, "checkpoint_every": 15},
        "eval": {"samples": 4, "k": [1, 4], "gate_threshold": 0.02},
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
