"""Publish a gate-passing checkpoint through the version registry and mark it serving-eligible.

Only a checkpoint whose held-out pass@1 reached ``eval.gate_threshold`` gets here (the trainer
checks; :func:`publish_model` checks again so no other caller can mark a failing model). It is
published with stage ``offline`` and its metrics, then promoted to ``production`` when that channel is
empty (the first model to serve users) or still holds the earlier checkpoint of the same run that
this one supersedes, otherwise to ``candidate`` (the release gate of the real-time stage decides what
replaces production).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from offline_rl.config import OfflineSettings
from policy.registry import Registry

STAGE = "offline"


class GateNotPassed(ValueError):
    """Refused: the metrics do not show the gate was reached."""


def publish_model(settings: OfflineSettings, hf_dir: str | Path, metrics: Mapping[str, float], *,
                  log: Callable[[str], None] | None = None, run: str | None = None,
                  supersede: str | None = None) -> str:
    """Publish ``hf_dir``; returns the version id. Raises :class:`GateNotPassed` below the gate.

    ``supersede``: an earlier version of the same run this one improves on; it takes ``production``
    only while that version is still there (a real-time release since then is not overridden)."""

    threshold = settings.eval.gate_threshold
    score = float(metrics.get("heldout_pass_at_1", -1.0))
    if score < threshold:
        raise GateNotPassed(f"held-out pass@1 {score:.3f} is below the gate {threshold:.3f}; not published")
    reg = Registry.from_settings(settings.registry)
    info = reg.publish(str(hf_dir), stage=STAGE, run=run or Path(settings.grpo.out_dir).name,
                       metrics={k: float(v) for k, v in metrics.items()})
    current = reg.channel("production")
    channel = "production" if current is None or (supersede is not None and current == supersede) else "candidate"
    note = f"offline gate: pass@1 {score:.3f} >= {threshold:.3f}"
    if supersede is not None and channel == "production":
        note += f"; supersedes {supersede} of the same run"
    reg.promote(info.id, channel, note=note)
    if log:
        log(f"publish: version {info.id} (stage {STAGE}) promoted to {channel}")
    return info.id
