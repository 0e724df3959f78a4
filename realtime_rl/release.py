"""The release path of one update cycle: gate, publish/canary/promote, and the release record.

Gate (all must hold, every number is recorded):

1. offline: the candidate's held-out pass@1 >= ``eval.gate_threshold`` − τ (``release.gate_tolerance``,
   the evaluator's noise) and >= production's − ε (``release.offline_epsilon``), both measured by
   the same evaluator with the same seed;
2. off-policy: the SNIPS (or clipped-IPS) estimate of the candidate's accept rate on held-out logged
   feedback served by production (candidate log-probs recomputed, behaviour = logged) is not below
   production's realised accept rate on those same examples: by default (``ope_test = "paired"``) the
   candidate is refused when the paired gain (estimate − realised, both on the same requests) is
   below −``ope_margin`` with one-sided confidence ``ope_confidence``; with at least ``min_heldout``
   examples, and an effective sample size (Σw)²/Σw² of at least ``min_ess_share`` of them.

Pass: the candidate goes to the ``production`` channel, or with ``canary_share`` > 0 to ``candidate``
(the gateway routes that share of callers to it) and a later cycle promotes it once
``canary_min_feedback`` canary feedbacks show an accept rate not below production's. Fail: production
stays, the reason is stored in ``releases`` and shown by ``rtrl releases``.

Atomicity: the registry publish is atomic (a version is complete or absent); promotion is one
channel write; the run record, the release row and the baseline update are then written in one
database transaction. A run killed anywhere before the record leaves at most an unreferenced
candidate version, never a half-written one, and the next cycle simply runs again.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

import sqlalchemy as sa

from offline_rl.evaluate import evaluate
from offline_rl.tasks import generate_tasks, load_tasks_jsonl
from policy.registry import Registry
from realtime_rl.baseline import save_bucket_stats
from realtime_rl.bus import BusUnavailable
from realtime_rl.dataset import TrainingExample
from realtime_rl.events import ModelVersionEvent
from realtime_rl.ope import OPEResult, accept_rate_ci, candidate_log_weights, estimate
from realtime_rl.release_tables import releases, update_runs

# --------------------------------------------------------------------------------------------------
# Versions: the registry is the only way weights move.


class RegistryStore:
    """The registry operations the updater needs, on ``policy.registry.Registry``."""

    def __init__(self, settings) -> None:
        self.settings = settings
        self.registry = Registry.from_settings(settings.registry)

    def production(self) -> str | None:
        return self.registry.channel("production")

    def candidate(self) -> str | None:
        return self.registry.channel("candidate")

    def materialize(self, version: str) -> Path:
        return Path(self.registry.materialize(version))

    def publish(self, model_dir: Path, *, parent: str | None, metrics: dict[str, float],
                run: str | None = None) -> str:
        """Atomic and content-addressed: publishing identical weights again returns the same id."""
        info = self.registry.publish(model_dir, parent=parent, stage="realtime" if parent else "base",
                                     run=run, metrics=metrics)
        return info.id

    def promote(self, version: str, channel: str) -> None:
        self.registry.promote(version, channel, note="rtrl update: release gate passed")

    def retire_candidate(self) -> None:
        """End a canary: point ``candidate`` at production, so the canary share is served production."""
        prod = self.production()
        if prod is not None and self.candidate() not in (None, prod):
            self.registry.promote(prod, "candidate", note="rtrl update: canary ended")


# --------------------------------------------------------------------------------------------------
# The gate.


@dataclass
class GateReport:
    passed: bool
    reason: str
    candidate_pass_at_1: float | None = None
    production_pass_at_1: float | None = None
    ope: dict[str, Any] = field(default_factory=dict)
    production_accept_rate: float | None = None
    production_accept_ci: tuple[float, float] | None = None
    checks: dict[str, bool] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        if self.production_accept_ci is not None:
            d["production_accept_ci"] = list(self.production_accept_ci)
        return d


def evaluate_gate(settings, *, candidate_model, production_model, heldout: Sequence[TrainingExample],
                  production: str, evaluator: Callable[[Any], float], pad_token_id: int = 0) -> GateReport:
    """Run both gate checks; never raises on a failing candidate, only reports."""

    g = settings.release
    reasons: list[str] = []
    checks: dict[str, bool] = {}
    cand_pass = evaluator(candidate_model)
    prod_pass = evaluator(production_model)
    # The offline stage admitted production with a precise evaluation just over the gate; this one
    # (fewer samples, another seed) measures the same weights a few hundredths lower or higher, so the
    # floor allows for that noise and the paired ε check below guards against real regressions.
    floor = settings.eval.gate_threshold - g.gate_tolerance
    checks["offline_gate"] = cand_pass >= floor
    if not checks["offline_gate"]:
        reasons.append(f"offline pass@1 {cand_pass:.3f} < gate {settings.eval.gate_threshold:.3f} "
                       f"- tolerance {g.gate_tolerance:.3f}")
    checks["offline_regression"] = cand_pass >= prod_pass - g.offline_epsilon
    if not checks["offline_regression"]:
        reasons.append(f"offline pass@1 {cand_pass:.3f} is more than ε={g.offline_epsilon} below "
                       f"production's {prod_pass:.3f}")
    logged = [e for e in heldout if e.example.version == production]
    report = GateReport(passed=False, reason="", candidate_pass_at_1=cand_pass, production_pass_at_1=prod_pass,
                        checks=checks)
    if len(logged) < g.min_heldout:
        checks["ope"] = False
        reasons.append(f"only {len(logged)} held-out logged examples from {production} (< {g.min_heldout})")
    else:
        accepts = [e.accepted for e in logged]
        realised = sum(accepts) / len(accepts)
        log_w = candidate_log_weights(candidate_model, logged, settings.update.behaviour_logprobs,
                                      pad_token_id=pad_token_id)
        res = estimate([float(a) for a in accepts], log_w, estimator=g.estimator, cap=g.ips_clip, ci=g.ci,
                       level=g.ci_level, samples=g.bootstrap_samples, seed=settings.update.seed)
        checks["ope"], why = ope_verdict(res, realised, g)
        if not checks["ope"]:
            reasons.append(why)
        # A handful of huge weights carry the estimate: it says nothing about this candidate.
        checks["ope_support"] = res.ess >= g.min_ess_share * res.n
        if not checks["ope_support"]:
            reasons.append(f"off-policy estimate rests on an effective sample of {res.ess:.1f} of {res.n} "
                           f"(< {g.min_ess_share:.0%}): the candidate moved too far from production to judge")
        report.ope = res.as_dict()
        report.production_accept_rate = realised
        report.production_accept_ci = accept_rate_ci(accepts, g.ci_level)
    report.passed = all(checks.values())
    report.reason = "; ".join(reasons) if reasons else "all gate checks passed"
    return report


def ope_verdict(res: OPEResult, realised: float, g) -> tuple[bool, str]:
    """Hold the off-policy estimate against production's realised accept rate (``g.ope_test``)."""
    if g.ope_test == "paired":
        upper = res.gain + NormalDist().inv_cdf(g.ope_confidence) * res.gain_se
        return upper >= -g.ope_margin, (
            f"{res.estimator} estimate {res.estimate:.3f} is below production's realised {realised:.3f} on the same "
            f"requests with {g.ope_confidence:.0%} confidence: paired gain {res.gain:+.3f} (se {res.gain_se:.3f}), "
            f"upper bound {upper:+.3f} < -{g.ope_margin}")
    value, what = (res.ci[0], "CI lower bound") if g.ope_test == "lower_bound" else (res.estimate, "estimate")
    return value >= realised - g.ope_margin, (f"{res.estimator} {what} of the accept rate {value:.3f} < production's "
                                              f"realised {realised:.3f} (margin {g.ope_margin})")


# --------------------------------------------------------------------------------------------------
# Run records.


def last_run(conn: sa.Connection, statuses: Sequence[str]) -> dict[str, Any] | None:
    q = (sa.select(update_runs).where(update_runs.c.status.in_(list(statuses)))
         .order_by(update_runs.c.finished_at.desc()).limit(1))
    row = conn.execute(q).mappings().first()
    return dict(row) if row else None


def consecutive_refusals(conn: sa.Connection, production: str, limit: int = 64) -> int:
    """Candidates of ``production`` the gate refused since the last run that released (or canaried)
    one: the newest trained runs, counted while they are refusals of this production."""
    q = (sa.select(update_runs.c.status, update_runs.c.production_version)
         .where(update_runs.c.status.in_(["released", "refused", "canary"]))
         .order_by(update_runs.c.finished_at.desc()).limit(limit))
    n = 0
    for status, parent in conn.execute(q):
        if status != "refused" or parent != production:
            break
        n += 1
    return n


def write_record(engine: sa.Engine, run: dict[str, Any], release: dict[str, Any] | None,
                 baseline_stats=None) -> None:
    """The run row, its release row and the new baseline: one transaction."""

    with engine.begin() as conn:
        conn.execute(sa.insert(update_runs).values(**run))
        if release is not None:
            conn.execute(sa.insert(releases).values(**release))
        if baseline_stats is not None:
            save_bucket_stats(conn, baseline_stats)


def list_releases(engine: sa.Engine, limit: int = 50) -> list[dict[str, Any]]:
    q = sa.select(releases).order_by(releases.c.created_at.desc(), releases.c.id.desc()).limit(limit)
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(q).mappings()]


def list_runs(engine: sa.Engine, limit: int = 50) -> list[dict[str, Any]]:
    q = sa.select(update_runs).order_by(update_runs.c.finished_at.desc()).limit(limit)
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(q).mappings()]


def jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d, default=str))


# --------------------------------------------------------------------------------------------------
# Model-version events.


def emit_version_event(producer, settings, *, version: str, parent: str | None, action: str, channel: str | None,
          metrics: dict[str, float], log) -> None:
    ev = ModelVersionEvent(model=settings.model.name, version=version, parent=parent, action=action,
                           channel=channel, metrics={k: float(v) for k, v in metrics.items()
                                                     if isinstance(v, int | float)})
    try:
        producer.send(settings.bus.versions_topic, ev.to_bytes(), key=version.encode())
        producer.flush(settings.bus.send_timeout_s)
    except BusUnavailable as err:
        # The registry is the source of truth; the event is a notification. Say so and go on.
        log(f"warning: model_version event for {version} not delivered: {err}")


def heldout_tasks(settings) -> list:
    if settings.tasks.jsonl:
        tasks = [t for t in load_tasks_jsonl(settings.tasks.jsonl) if t.task_id.startswith("heldout")]
    else:
        tasks = generate_tasks(settings.tasks.seed, settings.tasks.heldout_fraction).heldout
    n = settings.release.offline_tasks
    return tasks[:n] if n else tasks


def default_evaluator(settings, tokenizer) -> Callable[[Any], float]:
    """Held-out pass@1 by the offline stage's evaluator (hidden tests in its sandbox); candidate and
    production are scored on the same tasks with the same seed and sampling settings."""

    tasks = heldout_tasks(settings)
    g = settings.release

    def score(model) -> float:
        return evaluate(model, tokenizer, tasks, samples=g.offline_samples, k=(1,),
                        temperature=settings.eval.temperature, max_new_tokens=settings.simusers.max_tokens,
                        seed=settings.update.seed + 17).pass_at_1

    return score
