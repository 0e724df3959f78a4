"""Publish a gate-passing checkpoint through the version registry and mark it serving-eligible.

Only a checkpoint whose held-out pass@1 reached ``eval.gate_threshold`` gets here (the trainer
checks; :func:`publish_model` checks again so no other caller can mark a failing model). It is
published with stage ``offline`` and its metrics, then promoted to ``production`` when that channel is
empty (the first model to serve users), otherwise to ``candidate`` (the release gate of the real-time
stage decides what replaces production).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from rtrl.config import Settings

STAGE = "offline"


class GateNotPassed(ValueError):
    """Refused: the metrics do not show the gate was reached."""


def publish_model(settings: Settings, hf_dir: str | Path, metrics: Mapping[str, float], *,
                  log: Callable[[str], None] | None = None, run: str | None = None) -> str:
    """Publish ``hf_dir``; returns the version id. Raises :class:`GateNotPassed` below the gate."""
    from policy.registry import Registry

    threshold = settings.eval.gate_threshold
    score = float(metrics.get("heldout_pass_at_1", -1.0))
    if score < threshold:
        raise GateNotPassed(f"held-out pass@1 {score:.3f} is below the gate {threshold:.3f}; not published")
    reg = Registry.from_settings(settings.registry)
    info = reg.publish(str(hf_dir), stage=STAGE, run=run or Path(settings.grpo.out_dir).name,
                       metrics={k: float(v) for k, v in metrics.items()})
    channel = "production" if reg.channel("production") is None else "candidate"
    reg.promote(info.id, channel, note=f"offline gate: pass@1 {score:.3f} >= {threshold:.3f}")
    if log:
        log(f"publish: version {info.id} (stage {STAGE}) promoted to {channel}")
    return info.id
