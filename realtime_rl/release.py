"""The release path of one update cycle: gate, publish/canary/promote, and the release record.

Gate (all must hold, every number is recorded):

1. offline: the candidate's held-out pass@1 >= ``eval.gate_threshold`` − τ (``release.gate_tolerance``,
   the evaluator's noise) and >= production's − ε (``release.offline_epsilon``), both measured by
   the same evaluator with the same seed;
2. off-policy: the SNIPS (or clipped-IPS) estimate of the candidate's accept rate on held-out logged
   feedback served by production (candidate log-probs recomputed, behaviour = logged) is not below
   production's realised accept rate on those same examples (minus ``ope_margin``; optionally the
   CI's lower bound is compared instead of the point estimate), with at least ``min_heldout`` examples,
   and an effective sample size (Σw)²/Σw² of at least ``min_ess_share`` of them.

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
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from realtime_rl.dataset import TrainingExample
from realtime_rl.release_tables import releases, update_runs

# --------------------------------------------------------------------------------------------------
# Versions: the registry is the only way weights move.


class RegistryStore:
    """The registry operations the updater needs, on ``policy.registry.Registry``."""

    def __init__(self, settings) -> None:
        from policy.registry import Registry

        self.settings = settings
        r = settings.registry
        self.registry = Registry(r.url, cache_dir=r.cache_dir, snapshot_every=r.snapshot_every, workers=r.workers)

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
    from realtime_rl.ope import accept_rate_ci, candidate_log_weights, estimate

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
        value = res.ci[0] if g.use_lower_bound else res.estimate
        checks["ope"] = value >= realised - g.ope_margin
        if not checks["ope"]:
            what = "CI lower bound" if g.use_lower_bound else "estimate"
            reasons.append(f"{g.estimator} {what} of the accept rate {value:.3f} < production's realised "
                           f"{realised:.3f} (margin {g.ope_margin})")
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


# --------------------------------------------------------------------------------------------------
# Run records.


def last_run(conn: sa.Connection, statuses: Sequence[str]) -> dict[str, Any] | None:
    q = (sa.select(update_runs).where(update_runs.c.status.in_(list(statuses)))
         .order_by(update_runs.c.finished_at.desc()).limit(1))
    row = conn.execute(q).mappings().first()
    return dict(row) if row else None


def write_record(engine: sa.Engine, run: dict[str, Any], release: dict[str, Any] | None,
                 baseline_stats=None) -> None:
    """The run row, its release row and the new baseline: one transaction."""
    from realtime_rl.baseline import save_bucket_stats

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


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d, default=str))


# --------------------------------------------------------------------------------------------------
# The cycle.


def _emit(producer, settings, *, version: str, parent: str | None, action: str, channel: str | None,
          metrics: dict[str, float], log) -> None:
    from realtime_rl.bus import BusUnavailable
    from realtime_rl.events import ModelVersionEvent

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
    from offline_rl.tasks import generate_tasks, load_tasks_jsonl

    if settings.tasks.jsonl:
        tasks = [t for t in load_tasks_jsonl(settings.tasks.jsonl) if t.task_id.startswith("heldout")]
    else:
        tasks = generate_tasks(settings.tasks.seed, settings.tasks.heldout_fraction).heldout
    n = settings.release.offline_tasks
    return tasks[:n] if n else tasks


def default_evaluator(settings, tokenizer) -> Callable[[Any], float]:
    """Held-out pass@1 by the offline stage's evaluator (hidden tests in its sandbox); candidate and
    production are scored on the same tasks with the same seed and sampling settings."""
    from offline_rl.evaluate import evaluate

    tasks = heldout_tasks(settings)
    g = settings.release

    def score(model) -> float:
        return evaluate(model, tokenizer, tasks, samples=g.offline_samples, k=(1,),
                        temperature=settings.eval.temperature, max_new_tokens=settings.simusers.max_tokens,
                        seed=settings.update.seed + 17).pass_at_1

    return score


def _canary_counts(rows, pending: str, production: str) -> tuple[tuple[int, int], tuple[int, int], set[str]]:
    """(accepted, judged) on the canary version and on production, and the canary cohort's callers."""
    cohort = {r.caller for r in rows if r.version == pending}
    canary = [r.signal == "accept" for r in rows if r.version == pending]
    control = [r.signal == "accept" for r in rows if r.version == production and r.caller not in cohort]
    if not control:  # no caller outside the cohort (a split by request, not by caller): all of production
        control = [r.signal == "accept" for r in rows if r.version == production]
    return (sum(canary), len(canary)), (sum(control), len(control)), cohort


def _resolve_canary(settings, engine, store, run_id: str, started: datetime, production: str, log,
                    producer) -> dict[str, Any] | None:
    """A canary from an earlier cycle: promote, roll back, or keep waiting, by the sequential test of
    :func:`realtime_rl.ope.canary_sequential_test` on the feedback since the canary began (difference
    in differences against the same cohorts' feedback on production in the canary run's window).
    Returns a run row or None."""
    from realtime_rl.dataset import load_logged
    from realtime_rl.ope import canary_sequential_test

    pending = store.candidate()
    with engine.connect() as conn:
        prev = last_run(conn, ["canary"])
    if not pending or pending == production or prev is None or prev["candidate_version"] != pending:
        return None
    rows = load_logged(engine, since=prev["data_until"], versions=[pending, production])
    canary, control, cohort = _canary_counts(rows, pending, production)
    earlier = load_logged(engine, since=prev["data_since"], until=prev["data_until"], versions=[production])
    before = [r.signal == "accept" for r in earlier if r.caller in cohort]
    others = [r.signal == "accept" for r in earlier if r.caller not in cohort]
    g = settings.release
    test = canary_sequential_test(canary, control, before=(sum(before), len(before)) if before else None,
                                  control_before=(sum(others), len(others)) if others else None,
                                  margin=g.canary_margin, tau=g.canary_tau, alpha=g.canary_alpha,
                                  min_n=g.canary_min_feedback, max_n=g.canary_max_feedback)
    base = {"run_id": run_id, "production_version": production, "candidate_version": pending,
            "fingerprint": None, "data_since": prev["data_until"], "data_until": None, "n_train": 0,
            "n_heldout": canary[1], "started_at": started}
    c_rate = canary[0] / canary[1] if canary[1] else None
    p_rate = control[0] / control[1] if control[1] else None
    metrics = {"canary_accept_rate": c_rate, "production_accept_rate": p_rate, "canary_n": canary[1],
               "control_n": control[1], "sequential_test": test.as_dict()}
    if test.decision == "continue":
        return {**base, "status": "skipped", "reason": f"canary {pending}: {test.reason}", "metrics": metrics}
    if test.decision == "promote":
        store.promote(pending, "production")  # `candidate` already points at it: the canary share stays on it
        _emit(producer, settings, version=pending, parent=production, action="promoted", channel="production",
              metrics={k: v for k, v in metrics.items() if isinstance(v, float)}, log=log)
        return {**base, "status": "released", "reason": test.reason, "metrics": metrics}
    store.retire_candidate()
    return {**base, "status": "refused", "reason": test.reason, "metrics": metrics}


def cycle_body(settings, engine: sa.Engine, run_id: str, *, force: bool, log, store, evaluator, producer,
               should_stop, now: datetime | None, tamper=None):
    """dataset → update → publish candidate → gate → promote/refuse → record (caller holds the lock)."""
    import torch

    from policy.loading import load_policy
    from realtime_rl.baseline import load_bucket_stats, merge_batch
    from realtime_rl.bus import open_producer
    from realtime_rl.dataset import build_dataset, count_orphans, load_logged
    from realtime_rl.update import CycleResult, compute_advantages, save_candidate, train_candidate

    started = now or datetime.now(UTC)
    torch.set_num_threads(settings.model.threads)
    store = store or RegistryStore(settings)
    own_producer = producer is None
    producer = producer or open_producer(settings.bus)
    try:
        production = store.production()
        if production is None:
            row = {"run_id": run_id, "status": "skipped", "reason": "no production version in the registry",
                   "metrics": {}, "started_at": started}
            return _finish(engine, row, None, None, CycleResult)
        canary_row = _resolve_canary(settings, engine, store, run_id, started, production, log, producer)
        if canary_row is not None:
            rel = None
            if canary_row["status"] in ("released", "refused"):
                m = canary_row["metrics"]
                rel = {"run_id": run_id, "candidate_version": canary_row["candidate_version"],
                       "parent_version": production, "decision": canary_row["status"],
                       "reason": "canary: " + canary_row["reason"], "offline_pass_at_1": None,
                       "production_pass_at_1": None, "ope_estimate": None, "ope_ci_low": None, "ope_ci_high": None,
                       "production_accept_rate": m.get("production_accept_rate"), "gate": _jsonable(m),
                       "created_at": datetime.now(UTC)}
            return _finish(engine, canary_row, rel, None, CycleResult)

        with engine.connect() as conn:
            last_release = last_run(conn, ["released", "canary"])
            prev = last_run(conn, ["released", "refused", "canary"])
            history = load_bucket_stats(conn)
        since = last_release["data_until"] if last_release else None
        admitted = _previous_productions(engine, production)
        policy = load_policy(store.materialize(production), settings.model.dtype, settings.model.device)
        decode = policy.tokenizer.decode
        rows = load_logged(engine, since=since)
        ds = build_dataset(rows, settings.update, production=production, admitted_versions=admitted,
                           now=now, decode=decode, vocab_size=policy.model.get_input_embeddings().num_embeddings,
                           encode=lambda text: policy.tokenizer.encode(text, add_special_tokens=False))
        ds.stats.orphaned = count_orphans(
            engine, (now or datetime.now(UTC)) - timedelta(hours=settings.update.feedback_horizon_hours))
        if ds.stats.out_of_vocab or ds.stats.malformed:
            log(f"dataset: excluded {ds.stats.out_of_vocab} out-of-vocabulary and {ds.stats.malformed} malformed "
                f"examples ({ds.stats.excluded})")
        prev_until = prev["data_until"] if prev else None
        fresh = [e for e in ds.train + ds.heldout if prev_until is None or _after(e.example.feedback_at, prev_until)]
        base = {"run_id": run_id, "production_version": production, "fingerprint": ds.fingerprint,
                "data_since": since, "data_until": ds.data_until, "n_train": len(ds.train),
                "n_heldout": len(ds.heldout), "started_at": started}
        if prev is not None and prev["fingerprint"] == ds.fingerprint and prev["production_version"] == production \
                and not force:
            row = {**base, "status": "skipped", "reason": f"same data as {prev['run_id']} ({prev['status']})",
                   "metrics": {"dataset": ds.stats.as_dict()}}
            return _finish(engine, row, None, None, CycleResult)
        if len(fresh) < settings.schedule.min_feedback and not force:
            row = {**base, "status": "skipped", "reason": f"{len(fresh)} new examples < min_feedback "
                   f"{settings.schedule.min_feedback}", "metrics": {"dataset": ds.stats.as_dict()}}
            return _finish(engine, row, None, None, CycleResult)
        if not ds.train:
            row = {**base, "status": "skipped", "reason": "no training examples after filtering",
                   "metrics": {"dataset": ds.stats.as_dict()}}
            return _finish(engine, row, None, None, CycleResult)

        if max(abs(e.reward - ds.train[0].reward) for e in ds.train) == 0:
            row = {**base, "status": "skipped", "reason": "no learning signal: every training example has the "
                   f"same reward {ds.train[0].reward}", "metrics": {"dataset": ds.stats.as_dict()}}
            return _finish(engine, row, None, None, CycleResult)

        log(f"update {run_id}: {len(ds.train)} train / {len(ds.heldout)} held-out examples from {production}")
        pad = policy.tokenizer.pad_token_id or 0
        adv, baseline = compute_advantages(ds.train, settings.update, history, policy.model, pad)
        train_metrics = train_candidate(settings, policy, production, ds.train, adv, pad_token_id=pad, log=log,
                                        should_stop=should_stop)
        if tamper is not None:  # a benchmark's sabotage: the gate below must catch what it did
            note = tamper(policy.model)
            if note:
                train_metrics["tampered"] = note
        rewards = [e.reward for e in ds.train]
        train_metrics.update(reward_mean=sum(rewards) / len(rewards),
                             accept_rate_train=sum(e.accepted for e in ds.train) / len(ds.train),
                             advantage_mean=sum(adv) / len(adv), baseline_mean=sum(baseline) / len(baseline))
        work = Path(settings.update.work_dir) / run_id
        save_candidate(policy, work)
        candidate = store.publish(work, parent=production, run=run_id,
                                  metrics={k: v for k, v in train_metrics.items() if isinstance(v, float)})
        shutil.rmtree(work, ignore_errors=True)
        _emit(producer, settings, version=candidate, parent=production, action="published", channel=None,
              metrics=train_metrics, log=log)
        log(f"published candidate {candidate}; gating")

        prod_policy = load_policy(store.materialize(production), settings.model.dtype, settings.model.device)
        ev = evaluator or default_evaluator(settings, policy.tokenizer)
        report = evaluate_gate(settings, candidate_model=policy.model, production_model=prod_policy.model,
                               heldout=ds.heldout, production=production, evaluator=ev, pad_token_id=pad)
        status = "refused"
        if report.passed:
            channel = "candidate" if settings.release.canary_share > 0 else "production"
            store.promote(candidate, channel)
            status = "canary" if channel == "candidate" else "released"
            _emit(producer, settings, version=candidate, parent=production, action="promoted", channel=channel,
                  metrics={"offline_pass_at_1": report.candidate_pass_at_1 or 0.0}, log=log)
        log(f"gate: {status}: {report.reason}")
        fresh_train = [e for e in ds.train if prev_until is None or _after(e.example.feedback_at, prev_until)]
        new_baseline = merge_batch(history, fresh_train) if settings.update.baseline == "bucket_mean" else None
        metrics = _jsonable({"train": train_metrics, "dataset": ds.stats.as_dict(), "gate": report.as_dict(),
                             "tampered": train_metrics.get("tampered")})
        row = {**base, "status": status, "candidate_version": candidate, "reason": report.reason,
               "metrics": metrics}
        ope = report.ope or {}
        ci = ope.get("ci") or [None, None]
        rel = {"run_id": run_id, "candidate_version": candidate, "parent_version": production,
               "decision": status, "reason": report.reason, "offline_pass_at_1": report.candidate_pass_at_1,
               "production_pass_at_1": report.production_pass_at_1, "ope_estimate": ope.get("estimate"),
               "ope_ci_low": ci[0], "ope_ci_high": ci[1],
               "production_accept_rate": report.production_accept_rate, "gate": metrics["gate"],
               "created_at": datetime.now(UTC)}
        return _finish(engine, row, rel, new_baseline, CycleResult, gate=metrics["gate"])
    finally:
        if own_producer:
            producer.close()


def _previous_productions(engine, production: str) -> list[str]:
    """Versions that were production before the current one, newest first (from the run records)."""
    q = (sa.select(update_runs.c.production_version).where(update_runs.c.status == "released")
         .order_by(update_runs.c.finished_at.desc()))
    with engine.connect() as conn:
        seen = [v for (v,) in conn.execute(q) if v and v != production]
    return list(dict.fromkeys(seen))


def _after(t: datetime | None, ref: datetime) -> bool:
    if t is None:
        return False
    a = t if t.tzinfo else t.replace(tzinfo=UTC)
    b = ref if ref.tzinfo else ref.replace(tzinfo=UTC)
    return a > b


def _finish(engine, row: dict[str, Any], rel, baseline_stats, result_cls, gate=None):
    row = {"production_version": None, "candidate_version": None, "fingerprint": None, "data_since": None,
           "data_until": None, "n_train": 0, "n_heldout": 0, **row, "finished_at": datetime.now(UTC)}
    row["metrics"] = _jsonable(row.get("metrics") or {})
    write_record(engine, row, rel, baseline_stats)
    return result_cls(run_id=row["run_id"], status=row["status"], reason=row["reason"],
                      production_version=row["production_version"], candidate_version=row["candidate_version"],
                      n_train=row["n_train"], n_heldout=row["n_heldout"], metrics=row["metrics"],
                      gate=gate or {})
