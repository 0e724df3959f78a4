"""One update cycle of the real-time stage, under the updater lock.

dataset (logged feedback since the last release) → single-rollout update of the production weights
(:mod:`realtime_rl.update`) → candidate published in the registry → release gate
(:mod:`realtime_rl.release`) → promote, start a canary, or refuse → run record. A canary started by an
earlier cycle is resolved first (promoted or rolled back by its sequential test, or left waiting).
Under torchrun rank 0 runs the cycle and the other ranks join only its training step.
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import torch

from policy.distributed import DataParallel, setup
from policy.loading import load_policy, save_policy
from realtime_rl.baseline import load_bucket_stats, merge_batch
from realtime_rl.bus import open_producer
from realtime_rl.database import make_engine
from realtime_rl.dataset import Dataset, TrainingExample, build_dataset, count_orphans, load_logged
from realtime_rl.locks import updater_lock
from realtime_rl.ope import canary_sequential_test
from realtime_rl.release import (
    RegistryStore,
    consecutive_refusals,
    default_evaluator,
    emit_version_event,
    evaluate_gate,
    jsonable,
    last_run,
    write_record,
)
from realtime_rl.release_tables import update_runs
from realtime_rl.schema import ensure_schema
from realtime_rl.update import compute_advantages, train_policy


@dataclass
class CycleResult:
    """What one update cycle did (also the row written to ``update_runs``)."""

    run_id: str
    status: str  # skipped | released | refused | canary | locked | failed
    reason: str
    production_version: str | None = None
    candidate_version: str | None = None
    n_train: int = 0
    n_heldout: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    gate: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def run_update_cycle(settings, *, force: bool = False, log: Callable[[str], None] = print, store=None,
                     evaluator=None, producer=None, should_stop: Callable[[], bool] = lambda: False,
                     now: datetime | None = None, tamper: Callable[[Any], str | None] | None = None) -> CycleResult:
    """One cycle under the updater lock; see :func:`cycle_body` for the steps.
    ``tamper`` (benchmarks only) may break the trained candidate before it is published and gated.

    Under torchrun (``distributed``) rank 0 runs the cycle; the other ranks only join its training
    step (:func:`train_candidate`) and return rank 0's result."""
    dp = setup(settings.distributed, settings.model.device)
    if not dp.enabled:
        return _cycle(settings, force=force, log=log, store=store, evaluator=evaluator, producer=producer,
                      should_stop=should_stop, now=now, tamper=tamper)
    if not dp.is_main:
        return _follow(dp, settings)
    result = None
    try:
        result = _cycle(settings, force=force, log=log, store=store, evaluator=evaluator, producer=producer,
                        should_stop=should_stop, now=now, tamper=tamper)
        return result
    finally:
        dp.broadcast((_DONE, result))


_TRAIN, _DONE = "train", "done"


def train_candidate(settings, policy, production: str, examples: Sequence[TrainingExample],
                    advantages: Sequence[float], *, pad_token_id: int, log: Callable[[str], None],
                    should_stop: Callable[[], bool]) -> dict[str, float]:
    """The update of ``policy.model`` (the production weights, loaded on this process): in this
    process, or under torchrun on every rank, each from ``production`` in the registry, with FSDP2;
    the trained weights come back into ``policy.model`` on rank 0."""
    dp = setup(settings.distributed, settings.model.device)
    if not dp.enabled:
        return train_policy(policy.model, examples, advantages, settings.update, pad_token_id=pad_token_id,
                            log=log, should_stop=should_stop)
    dp.broadcast((_TRAIN, {"production": production, "examples": list(examples), "advantages": list(advantages),
                           "pad_token_id": pad_token_id, "lr": settings.update.lr}))
    metrics, state = _train_sharded(dp, settings, production, examples, advantages, pad_token_id, log, should_stop)
    policy.model.load_state_dict(state)
    return metrics


def _train_sharded(dp: DataParallel, settings, production: str, examples, advantages, pad_token_id: int,
                   log: Callable[[str], None], should_stop: Callable[[], bool]) -> tuple[dict, dict | None]:
    model = load_policy(RegistryStore(settings).materialize(production), settings.model.dtype, dp.device).model
    model = dp.shard(model)
    metrics = train_policy(model, examples, advantages, settings.update, pad_token_id=pad_token_id, log=log,
                           should_stop=should_stop, dp=dp)
    return metrics, dp.full_state_dict(model)


def _follow(dp: DataParallel, settings) -> CycleResult:
    """A rank other than 0: train when rank 0 says so, until it says the cycle is over."""
    while True:
        kind, payload = dp.broadcast(None)
        if kind == _DONE:
            if payload is None:
                raise RuntimeError("rank 0's update cycle failed; see its log")
            return payload
        # Rank 0's learning rate (the backtracking after refusals is decided there).
        update = settings.update.model_copy(update={"lr": payload["lr"]})
        _train_sharded(dp, settings.model_copy(update={"update": update}), payload["production"],
                       payload["examples"], payload["advantages"], payload["pad_token_id"], lambda _m: None,
                       lambda: False)


def _cycle(settings, *, force: bool, log: Callable[[str], None], store, evaluator, producer,
           should_stop: Callable[[], bool], now: datetime | None, tamper) -> CycleResult:
    t0 = time.perf_counter()
    run_id = f"run-{datetime.now(UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
    ensure_schema(settings.db)
    engine = make_engine(settings.db)
    try:
        with updater_lock(engine, settings.schedule.lock_name, stale_s=settings.schedule.lock_stale_s) as held:
            if not held:
                return CycleResult(run_id, "locked", "another updater holds the lock",
                                   seconds=time.perf_counter() - t0)
            result = cycle_body(settings, engine, run_id, force=force, log=log, store=store, evaluator=evaluator,
                                producer=producer, should_stop=should_stop, now=now, tamper=tamper)
    finally:
        engine.dispose()
    result.seconds = time.perf_counter() - t0
    return result


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
        emit_version_event(producer, settings, version=pending, parent=production, action="promoted", channel="production",
              metrics={k: v for k, v in metrics.items() if isinstance(v, float)}, log=log)
        return {**base, "status": "released", "reason": test.reason, "metrics": metrics}
    store.retire_candidate()
    return {**base, "status": "refused", "reason": test.reason, "metrics": metrics}


def cycle_body(settings, engine: sa.Engine, run_id: str, *, force: bool, log, store, evaluator, producer,
               should_stop, now: datetime | None, tamper=None) -> CycleResult:
    """dataset → update → publish candidate → gate → promote/refuse → record (caller holds the lock)."""
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
            return _finish(engine, row, None, None)
        canary_row = _resolve_canary(settings, engine, store, run_id, started, production, log, producer)
        if canary_row is not None:
            return _finish(engine, canary_row, _canary_release(run_id, production, canary_row), None)
        policy = load_policy(store.materialize(production), settings.model.dtype, settings.model.device)
        data = _gather(settings, engine, run_id, production, policy, now, started, log)
        reason = _skip_reason(settings, data, force)
        if reason is not None:
            row = {**data.base, "status": "skipped", "reason": reason, "metrics": {"dataset": data.ds.stats.as_dict()}}
            return _finish(engine, row, None, None)
        return _train_and_release(settings, engine, run_id, data, policy, store=store, evaluator=evaluator,
                                  producer=producer, log=log, should_stop=should_stop, tamper=tamper)
    finally:
        if own_producer:
            producer.close()


def _canary_release(run_id: str, production: str, canary_row: dict[str, Any]) -> dict[str, Any] | None:
    """The release row of a canary that was decided (promoted or rolled back); None while it waits."""
    if canary_row["status"] not in ("released", "refused"):
        return None
    m = canary_row["metrics"]
    return {"run_id": run_id, "candidate_version": canary_row["candidate_version"], "parent_version": production,
            "decision": canary_row["status"], "reason": "canary: " + canary_row["reason"],
            "offline_pass_at_1": None, "production_pass_at_1": None, "ope_estimate": None, "ope_ci_low": None,
            "ope_ci_high": None, "production_accept_rate": m.get("production_accept_rate"), "gate": jsonable(m),
            "created_at": datetime.now(UTC)}


@dataclass
class CycleData:
    """The logged feedback one cycle trains and gates on, and where it sits among earlier runs."""

    ds: Dataset
    history: Any  # the bucket baseline's running statistics
    base: dict[str, Any]  # the run row's fields known before training
    prev: dict[str, Any] | None  # the last run that trained (released, refused or canary)
    prev_until: datetime | None
    refusals: int = 0  # candidates of this production refused in a row (the step backtracks)

    def fresh(self, examples: Sequence[TrainingExample]) -> list[TrainingExample]:
        """The examples whose feedback arrived after the last run that trained."""
        return [e for e in examples if self.prev_until is None or _after(e.example.feedback_at, self.prev_until)]


def _gather(settings, engine: sa.Engine, run_id: str, production: str, policy, now: datetime | None,
            started: datetime, log) -> CycleData:
    with engine.connect() as conn:
        last_release = last_run(conn, ["released", "canary"])
        prev = last_run(conn, ["released", "refused", "canary"])
        history = load_bucket_stats(conn)
        refusals = consecutive_refusals(conn, production)
    since = last_release["data_until"] if last_release else None
    ds = build_dataset(load_logged(engine, since=since), settings.update, production=production,
                       admitted_versions=_previous_productions(engine, production), now=now,
                       decode=policy.tokenizer.decode, vocab_size=policy.model.get_input_embeddings().num_embeddings,
                       encode=lambda text: policy.tokenizer.encode(text, add_special_tokens=False))
    ds.stats.orphaned = count_orphans(
        engine, (now or datetime.now(UTC)) - timedelta(hours=settings.update.feedback_horizon_hours))
    if ds.stats.out_of_vocab or ds.stats.malformed:
        log(f"dataset: excluded {ds.stats.out_of_vocab} out-of-vocabulary and {ds.stats.malformed} malformed "
            f"examples ({ds.stats.excluded})")
    base = {"run_id": run_id, "production_version": production, "fingerprint": ds.fingerprint,
            "data_since": since, "data_until": ds.data_until, "n_train": len(ds.train),
            "n_heldout": len(ds.heldout), "started_at": started}
    return CycleData(ds, history, base, prev, prev["data_until"] if prev else None, refusals)


def _skip_reason(settings, data: CycleData, force: bool) -> str | None:
    """Why this cycle should not train (None: it should)."""
    ds, prev = data.ds, data.prev
    if prev is not None and prev["fingerprint"] == ds.fingerprint \
            and prev["production_version"] == data.base["production_version"] and not force:
        return f"same data as {prev['run_id']} ({prev['status']})"
    n_fresh = len(data.fresh(ds.train + ds.heldout))
    if n_fresh < settings.schedule.min_feedback and not force:
        return f"{n_fresh} new examples < min_feedback {settings.schedule.min_feedback}"
    production = data.base["production_version"]
    logged = sum(e.example.version == production for e in ds.heldout)
    if logged < settings.release.min_heldout and not force:
        # The gate's off-policy check needs them: training now would only make a candidate it refuses.
        return f"{logged} held-out examples logged from {production} < release.min_heldout " \
               f"{settings.release.min_heldout}"
    if not ds.train:
        return "no training examples after filtering"
    if max(abs(e.reward - ds.train[0].reward) for e in ds.train) == 0:
        return f"no learning signal: every training example has the same reward {ds.train[0].reward}"
    return None


def _train_and_release(settings, engine: sa.Engine, run_id: str, data: CycleData, policy, *, store, evaluator,
                       producer, log, should_stop, tamper) -> CycleResult:
    """Train the candidate from production, publish it, gate it, promote or refuse, and record the run."""
    ds, production = data.ds, data.base["production_version"]
    log(f"update {run_id}: {len(ds.train)} train / {len(ds.heldout)} held-out examples from {production}")
    pad = policy.tokenizer.pad_token_id or 0
    adv, baseline = compute_advantages(ds.train, settings.update, data.history, policy.model, pad)
    u = settings.update
    lr_scale = max(u.backtrack ** data.refusals, u.min_lr_scale)
    if lr_scale < 1:
        log(f"update {run_id}: {data.refusals} candidate(s) of {production} refused in a row: "
            f"learning rate x {lr_scale:g}")
        settings = settings.model_copy(update={"update": u.model_copy(update={"lr": u.lr * lr_scale})})
    train_metrics = train_candidate(settings, policy, production, ds.train, adv, pad_token_id=pad, log=log,
                                    should_stop=should_stop)
    train_metrics["lr_scale"] = lr_scale
    if tamper is not None:  # a benchmark's sabotage: the gate below must catch what it did
        note = tamper(policy.model)
        if note:
            train_metrics["tampered"] = note
    rewards = [e.reward for e in ds.train]
    train_metrics.update(reward_mean=sum(rewards) / len(rewards),
                         accept_rate_train=sum(e.accepted for e in ds.train) / len(ds.train),
                         advantage_mean=sum(adv) / len(adv), baseline_mean=sum(baseline) / len(baseline))
    work = Path(settings.update.work_dir) / run_id
    save_policy(policy.model, policy.tokenizer, work)
    candidate = store.publish(work, parent=production, run=run_id,
                              metrics={k: v for k, v in train_metrics.items() if isinstance(v, float)})
    shutil.rmtree(work, ignore_errors=True)
    emit_version_event(producer, settings, version=candidate, parent=production, action="published", channel=None,
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
        emit_version_event(producer, settings, version=candidate, parent=production, action="promoted",
                           channel=channel, metrics={"offline_pass_at_1": report.candidate_pass_at_1 or 0.0}, log=log)
    log(f"gate: {status}: {report.reason}")
    new_baseline = merge_batch(data.history, data.fresh(ds.train)) if settings.update.baseline == "bucket_mean" \
        else None
    metrics = jsonable({"train": train_metrics, "dataset": ds.stats.as_dict(), "gate": report.as_dict(),
                        "tampered": train_metrics.get("tampered")})
    row = {**data.base, "status": status, "candidate_version": candidate, "reason": report.reason, "metrics": metrics}
    ope = report.ope or {}
    ci = ope.get("ci") or [None, None]
    rel = {"run_id": run_id, "candidate_version": candidate, "parent_version": production,
           "decision": status, "reason": report.reason, "offline_pass_at_1": report.candidate_pass_at_1,
           "production_pass_at_1": report.production_pass_at_1, "ope_estimate": ope.get("estimate"),
           "ope_ci_low": ci[0], "ope_ci_high": ci[1],
           "production_accept_rate": report.production_accept_rate, "gate": metrics["gate"],
           "created_at": datetime.now(UTC)}
    return _finish(engine, row, rel, new_baseline, gate=metrics["gate"])


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


def _finish(engine, row: dict[str, Any], rel, baseline_stats, gate=None) -> CycleResult:
    row = {"production_version": None, "candidate_version": None, "fingerprint": None, "data_since": None,
           "data_until": None, "n_train": 0, "n_heldout": 0, **row, "finished_at": datetime.now(UTC)}
    row["metrics"] = jsonable(row.get("metrics") or {})
    write_record(engine, row, rel, baseline_stats)
    return CycleResult(run_id=row["run_id"], status=row["status"], reason=row["reason"],
                      production_version=row["production_version"], candidate_version=row["candidate_version"],
                      n_train=row["n_train"], n_heldout=row["n_heldout"], metrics=row["metrics"],
                      gate=gate or {})
