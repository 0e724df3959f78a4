"""Named setting overrides for the offline stage, with what they measured on the shared 2-core machine.

Measurements (tiny model from `rtrl init-model`, 1.53M parameters, T=1, 63 held-out tasks x 8
samples; tasks always show f(0), f(1), f(2)). Held-out pass@1 after mid-training (lr 3e-3 cosine,
batch 64), at T=1 and greedy:

* 300 steps: 0.21-0.27 (greedy 0.49); 400 steps: 0.42-0.47 (greedy 0.75); 600 steps: 0.63-0.68.

GRPO (G = 8, token-level loss, async, one rollout worker, fresh training prompts every step):

* all parameters, 16 prompts/step: held-out pass@1 never rose. lr 1e-4: 0.26 -> 0.23 in 60 steps
  (training pass rate 0.26 -> 0.29); lr 3e-4: 0.26 -> 0.13-0.19 (KL 0.2 to the start: 0.19; std-scaled
  advantages: 0.12; frozen embeddings: 0.06); lr 1e-3 and 3e-3: collapse to 0. On 16 *fixed* prompts
  the same update took their pass rate 0.25 -> 0.53 in 12 steps while held-out fell 0.26 -> 0.16:
  full-parameter updates learn answers to the training functions, not the skill.
* only the RMSNorm gains (``trainable = "norm"``, 1,728 parameters), lr 3e-2, 48 prompts/step:
  from 300 steps 0.24 -> 0.32 in 40 steps; from 400 steps 0.42 -> 0.52 (step 20) -> 0.55 (step 40).
  The gains can rescale features and sharpen the output distribution, which is what GRPO's signal
  here supports (greedy decoding shows the headroom), but cannot memorise functions. lr 1e-1
  diverged; norms + o_proj/down_proj at 3e-4 rose to 0.28 from 0.24 only.

Defaults: 400 mid-training steps (below the 0.5 gate), then 40 GRPO steps with the norm-only update.

* ``fast`` (CI / ``demo --fast``): the offline defaults already fit CI (about 5 minutes on 2 idle
  cores), so it changes nothing here; ``demo --fast`` shortens the online stage.
"""

from __future__ import annotations

from typing import Any

from rtrl.config import Settings

# section -> field -> value
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "fast": {},
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
