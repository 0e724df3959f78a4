"""Is it learning? A trained model against its controls, each at its own best sampling temperature.

A learning claim needs two controls (docs/agent.md, "Judging a learning result"):

* the starting model at *its* best temperature of the grid: a gain that a lower temperature gives as
  well is sharpening, not learning;
* a matched-compute control: the same wall time spent on more mid-training from the same checkpoint
  (:func:`offline_rl.midtrain.continue_midtrain`).

:func:`compare_models` evaluates every model on the same held-out tasks at every temperature of the
grid (same seeds); :meth:`Comparison.to_dict` reports each one's best temperature with its 95% interval
and the paired per-task gains of the subject over each control. ``rtrl bench learning`` and the
lifecycle demo's ``controls`` stage both use it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offline_rl.evaluate import GridResult, paired_gain, temperature_grid
from offline_rl.sandbox import SandboxPool
from offline_rl.splits import load_split
from policy.loading import load_policy


@dataclass
class Comparison:
    """Grids of several models on the same tasks; ``subject`` is the one judged against the others."""

    grids: dict[str, GridResult]
    temperatures: list[float]
    serving_t: float
    subject: str
    n_tasks: int
    samples: int

    def best(self, name: str) -> dict[str, Any]:
        grid = self.grids[name]
        r = grid.best
        return {"t": grid.best_t, "pass_at_1": round(r.pass_at_1, 4), "ci95": [round(x, 4) for x in r.ci95]}

    def gain(self, over: str) -> dict[str, Any]:
        """The subject minus ``over``, each at its own best temperature, paired per task."""
        g = paired_gain(self.grids[self.subject].best, self.grids[over].best)
        return {"gain": round(g["gain"], 4), "ci95": [round(x, 4) for x in g["ci95"]], "tasks": g["tasks"]}

    def to_dict(self) -> dict[str, Any]:
        controls = [name for name in self.grids if name != self.subject]
        subject = self.grids[self.subject]
        serving = subject.results.get(self.serving_t)
        return {
            "temperatures": self.temperatures,
            "serving_t": self.serving_t,
            "subject": self.subject,
            "heldout_tasks": self.n_tasks,
            "samples_per_task": self.samples,
            "best_t": {name: self.best(name) for name in self.grids},
            "pass_at_1_by_t": {name: {str(t): round(r.pass_at_1, 4) for t, r in g.results.items()}
                               for name, g in self.grids.items()},
            "subject_at_serving_t": round(serving.pass_at_1, 4) if serving else None,
            "gains": {name: self.gain(name) for name in controls},
            "behaviours": {name: g.best.behaviour for name, g in self.grids.items()},
            "behaviours_at_serving_t": {name: g.results[self.serving_t].behaviour
                                        for name, g in self.grids.items() if self.serving_t in g.results},
        }


def grid_temperatures(settings, temperatures: Sequence[float] | None = None) -> list[float]:
    """The grid (``eval.temperatures`` unless given) plus the serving temperature, highest first."""
    return sorted(set(temperatures or settings.eval.temperatures) | {settings.eval.temperature}, reverse=True)


def compare_models(settings, models: Mapping[str, str | Path], subject: str, *,
                   temperatures: Sequence[float] | None = None, log: Callable[[str], None] = print) -> Comparison:
    """Evaluate each of ``models`` (name -> model directory) on the held-out tasks at every temperature
    of :func:`grid_temperatures`; ``subject`` names the one the others are controls for."""
    if subject not in models:
        raise ValueError(f"the subject {subject!r} is not among the models {sorted(models)}")
    temps = grid_temperatures(settings, temperatures)
    heldout = load_split(settings.tasks, settings.env).heldout
    grids: dict[str, GridResult] = {}
    with SandboxPool(settings.sandbox) as sandbox:
        for name, path in models.items():
            policy = load_policy(path, "float32", settings.model.device)
            grids[name] = temperature_grid(settings, policy.model, policy.tokenizer, temps, tasks=heldout,
                                           sandbox=sandbox)
            log(f"{name}: " + ", ".join(f"T={t}: {r.pass_at_1:.3f}" for t, r in grids[name].results.items()))
    return Comparison(grids=grids, temperatures=temps, serving_t=settings.eval.temperature, subject=subject,
                      n_tasks=len(heldout), samples=settings.eval.samples)
