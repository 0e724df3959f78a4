"""`rtrl bench online`: the real-time RL loop end to end, on the real parts.

K cycles (3 with --quick, else 6) of: simulated users → gateway (openai client, real uvicorn) → event bus → ingest (feedback
tables) → REINFORCE update → release gate → registry promotion → the gateway hot-swaps. A final
round of traffic measures the last released version. Reported per version: the realised accept rate
with a Wilson CI, the gate's off-policy (SNIPS) estimate made *before* the version served (to be
compared with what it then realised), its offline held-out pass@1, and the time per cycle.

Everything lives in a fresh directory (``bench_dir`` or a temp dir): its own registry, feedback
database, bus log, API keys, so a benchmark never touches the user's production channel. The base
model is, in order: the user's registry ``production`` version, ``grpo.out_dir``/``midtrain.out_dir``
when they hold a model, else ``model.dir``; if its held-out pass@1 is below ``eval.gate_threshold`` it
is first mid-trained (``offline_rl.midtrain``) so the online stage starts from a usable model.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MIDTRAIN_STEPS_OVER_GATE = 600  # held-out pass@1 0.63-0.68 on the tiny model (offline_rl/presets.py)


def _bench_settings(settings, root: Path, quick: bool):
    s = settings.model_copy(deep=True)
    s.db = s.db.model_copy(update={"url": type(s.db.url)(f"sqlite:///{root / 'feedback.db'}")})
    s.bus = s.bus.model_copy(update={"backend": "embedded", "embedded_path": str(root / "bus.db")})
    s.registry = s.registry.model_copy(update={"url": str(root / "registry"), "cache_dir": str(root / "cache")})
    s.serving = s.serving.model_copy(update={
        "api_keys_file": str(root / "api_keys.json"), "source": "registry", "poll_interval_s": 0.5, "port": 0,
        "spill_dir": str(root / "spill"), "canary_share": 0.0, "rate_limit_rps": 1000.0,
        "rate_limit_burst": 2000})
    s.update = s.update.model_copy(update={"work_dir": str(root / "runs")})
    s.schedule = s.schedule.model_copy(update={"min_feedback": 1})
    # Enough concurrent callers that the gateway's micro-batches fill.
    s.simusers = s.simusers.model_copy(update={"concurrency": max(s.simusers.concurrency, 16)})
    if quick:
        s.simusers = s.simusers.model_copy(update={"requests_per_cycle": min(s.simusers.requests_per_cycle, 256)})
    return s


def _has_model(path: str | Path | None) -> bool:
    return bool(path) and (Path(path) / "config.json").is_file() and any(Path(path).glob("*.safetensors"))


def _base_model(settings, root: Path, log) -> tuple[Path, bool]:
    """(directory, trained): ``trained`` when it comes from the registry or an offline stage's output."""
    try:
        from policy.registry import Registry

        reg = Registry(settings.registry.url)
        prod = reg.channel("production")
        if prod:
            log(f"base model: production version {prod} of {settings.registry.url}")
            return Path(reg.materialize(prod, out_dir=root / "base")), True
    except Exception as err:  # no registry yet is normal on a fresh checkout
        log(f"base model: no registry production version ({type(err).__name__}: {err})")
    for cand in (Path(settings.grpo.out_dir) / "final", Path(settings.grpo.out_dir), Path(settings.midtrain.out_dir)):
        if _has_model(cand):
            log(f"base model: {cand}")
            return cand, True
    if not _has_model(settings.model.dir):
        from policy.tiny import build_tiny_model

        log(f"base model: building the tiny model in {root / 'tiny'}")
        return build_tiny_model(root / "tiny", settings.tiny), False
    log(f"base model: {settings.model.dir}")
    return Path(settings.model.dir), False


class _RegistryChannels:
    """The gateway's version source, on the bench's own registry (``Gateway(source=...)``)."""

    def __init__(self, store) -> None:
        self.store = store

    def current(self, channel: str):
        from serving.versions import VersionRef

        version = self.store.registry.channel(channel)
        if version is None:
            return None
        return VersionRef(str(version), self.store.materialize(str(version)), channel)


def _wait_for_version(base_url: str, key: str, model: str, version: str, timeout_s: float = 120.0) -> bool:
    from openai import OpenAI

    client = OpenAI(api_key=key, base_url=base_url + "/v1", timeout=30)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            resp = client.completions.create(model=model, prompt="# f(0)=1\ndef f(x): return ", max_tokens=1)
            if resp.model.endswith("@" + version):
                return True
            time.sleep(0.5)
    finally:
        client.close()
    return False


def _drain(ingester, expected_feedback: int, timeout_s: float = 60.0) -> int:
    """Ingest until the bus is idle and every judgement sent so far is accounted for: a ``feedback``
    row, or a dead letter (the ingester refuses e.g. text with a NUL character, which a random model
    can write and a simulated user can keep in an edit)."""
    import sqlalchemy as sa

    from realtime_rl import tables as t

    def accounted(conn) -> int:
        n = conn.execute(sa.select(sa.func.count()).select_from(t.feedback)).scalar()
        raws = conn.execute(sa.select(t.dead_letters.c.raw)).scalars()
        return n + sum(b'"type":"feedback"' in bytes(r) for r in raws)

    total, idle = 0, 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = ingester.run_once()
        total += n
        idle = idle + 1 if n == 0 else 0
        if idle >= 2:
            with ingester.engine.connect() as conn:
                if accounted(conn) >= expected_feedback:
                    return total
    with ingester.engine.connect() as conn:
        counts = {tb.name: conn.execute(sa.select(sa.func.count()).select_from(tb)).scalar()
                  for tb in (t.completions, t.feedback, t.pending_feedback, t.training_examples, t.dead_letters)}
    raise RuntimeError(f"ingest did not catch up within {timeout_s} s ({expected_feedback} judgements "
                       f"expected; rows {counts})")


def run(settings, quick: bool = False, log: Callable[[str], None] = print, cycles: int | None = None,
        bench_dir: str | Path | None = None) -> dict[str, Any]:
    import torch

    from offline_rl.tasks import generate_tasks
    from policy.loading import load_policy
    from realtime_rl.ingest import Ingester
    from realtime_rl.ope import accept_rate_ci
    from realtime_rl.release import RegistryStore, default_evaluator
    from realtime_rl.simusers import make_population, register_keys, run_traffic
    from realtime_rl.update import run_update_cycle
    from serving.gateway import Gateway
    from serving.server import GatewayServer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(settings.model.threads)
    root = Path(bench_dir or tempfile.mkdtemp(prefix="rtrl-online-"))
    root.mkdir(parents=True, exist_ok=True)
    s = _bench_settings(settings, root, quick)
    K = cycles or (3 if quick else 6)
    t_start = time.perf_counter()

    base_dir, trained = _base_model(settings, root, log)
    base = load_policy(base_dir, s.model.dtype, s.model.device)
    evaluator = default_evaluator(s, base.tokenizer)
    base_pass = evaluator(base.model)
    log(f"base held-out pass@1 {base_pass:.3f} (gate {s.eval.gate_threshold})")
    warmup: dict[str, Any] = {}
    if base_pass < s.eval.gate_threshold and not trained:
        from offline_rl.midtrain import run_midtrain

        # The default mid-training stops *below* the gate on purpose (GRPO's job is to cross it); the
        # online bench needs a production-grade start without running GRPO, so it trains longer.
        steps = 200 if quick else max(MIDTRAIN_STEPS_OVER_GATE, s.midtrain.steps)
        log(f"below the gate: mid-training {steps} steps first")
        mt = s.model_copy(update={"midtrain": s.midtrain.model_copy(update={"steps": steps, "eval_at_end": False})})
        t0 = time.perf_counter()
        base_dir = run_midtrain(mt, init_dir=base_dir, out_dir=root / "midtrain", progress=False, log=log)
        base = load_policy(base_dir, s.model.dtype, s.model.device)
        base_pass = evaluator(base.model)
        warmup = {"midtrain_steps": steps, "midtrain_s": round(time.perf_counter() - t0, 1), "pass_at_1": base_pass}
        log(f"after mid-training: held-out pass@1 {base_pass:.3f}")

    if base_pass < s.eval.gate_threshold:
        log(f"warning: the base model's pass@1 {base_pass:.3f} is below the gate {s.eval.gate_threshold}: the "
            "offline check will refuse every candidate (run the offline stage further, or lower eval.gate_threshold)")
    store = RegistryStore(s)
    base_version = store.publish(base_dir, parent=None, metrics={"offline_pass_at_1": base_pass})
    store.promote(base_version, "production")
    del base

    users = make_population(s.simusers.n_users, s.simusers.seed, s.simusers.style_strictness_min,
                            s.simusers.style_strictness_max)
    register_keys(s, users)
    train_tasks = generate_tasks(s.tasks.seed, s.tasks.heldout_fraction).train
    versions: dict[str, dict[str, Any]] = {base_version: {"version": base_version, "parent": None, "n": 0,
                                                          "accepted": 0, "offline_pass_at_1": base_pass,
                                                          "ope_estimate": None, "ope_ci": None,
                                                          "decision": "base"}}
    order = [base_version]
    cycles_out = []
    sent = 0
    ingester = Ingester(s, log_fn=lambda m: None)
    server = GatewayServer(s, gateway=Gateway(s, source=_RegistryChannels(store))).start()
    try:
        for k in range(K + 1):
            tc = time.perf_counter()
            prod = store.production()
            stats = run_traffic(server.url, users, train_tasks, n_requests=s.simusers.requests_per_cycle,
                                model=s.model.name, seed=s.simusers.seed * 1000 + k,
                                concurrency=s.simusers.concurrency, temperature=s.simusers.temperature,
                                max_tokens=s.simusers.max_tokens, edit_probability=s.simusers.edit_probability)
            t_traffic = time.perf_counter() - tc
            for v, (n, a) in stats.per_version.items():
                rec = versions.setdefault(v, {"version": v, "n": 0, "accepted": 0})
                rec["n"] += n
                rec["accepted"] += a
            log(f"cycle {k}: {stats.requests} requests on {prod}: accept {stats.accept_rate():.3f} "
                f"(correct {stats.correct}, spaced {stats.spaced}, errors {stats.errors})")
            if stats.error_samples:
                log("  errors: " + " | ".join(stats.error_samples[:3]))
            if k == K:
                cycles_out.append({"cycle": k, "served": prod, "accept_rate": stats.accept_rate(),
                                   "traffic_s": round(t_traffic, 1)})
                break
            t1 = time.perf_counter()
            sent += stats.requests - stats.feedback_errors
            n_ingested = _drain(ingester, sent)
            t_ingest = time.perf_counter() - t1
            t2 = time.perf_counter()
            result = run_update_cycle(s, force=True, log=log, store=store, evaluator=evaluator)
            t_update = time.perf_counter() - t2
            gate = result.gate or {}
            ope = gate.get("ope") or {}
            log(f"cycle {k}: update {result.status}: {result.reason}")
            if result.candidate_version:
                rec = versions.setdefault(result.candidate_version, {"version": result.candidate_version,
                                                                     "n": 0, "accepted": 0})
                rec.update(parent=prod, decision=result.status, offline_pass_at_1=gate.get("candidate_pass_at_1"),
                           ope_estimate=ope.get("estimate"), ope_ci=ope.get("ci"),
                           ope_clipped_ips=ope.get("clipped_ips"), ope_ess=ope.get("ess"),
                           production_realised_on_heldout=gate.get("production_accept_rate"))
                if result.status == "released":
                    order.append(result.candidate_version)
                    if not _wait_for_version(server.url, users[0].api_key, s.model.name, result.candidate_version):
                        raise RuntimeError(f"the gateway did not switch to {result.candidate_version}")
            cycles_out.append({"cycle": k, "served": prod, "accept_rate": stats.accept_rate(),
                               "requests": stats.requests, "request_errors": stats.errors,
                               "feedback_errors": stats.feedback_errors, "ingested": n_ingested, "status": result.status,
                               "candidate": result.candidate_version, "traffic_s": round(t_traffic, 1),
                               "ingest_s": round(t_ingest, 1), "update_s": round(t_update, 1),
                               "cycle_s": round(time.perf_counter() - tc, 1),
                               "train": {k2: result.metrics.get("train", {}).get(k2) for k2 in
                                         ("loss", "ratio_mean", "clip_fraction", "kl_to_serving_k3",
                                          "mismatch_abs_logp", "reward_mean", "steps")}})
    finally:
        server.stop()
        ingester.engine.dispose()

    out_versions = []
    for v in order + [v for v in versions if v not in order]:
        rec = versions[v]
        n, a = rec.get("n", 0), rec.get("accepted", 0)
        rate = a / n if n else None
        ci = list(accept_rate_ci([True] * a + [False] * (n - a))) if n else None
        out_versions.append({"version": v, "parent": rec.get("parent"), "decision": rec.get("decision"),
                             "served_requests": n, "accept_rate": rate, "ci": ci,
                             "offline_pass_at_1": rec.get("offline_pass_at_1"),
                             "ope_estimate": rec.get("ope_estimate"), "ope_ci": rec.get("ope_ci"),
                             "ope_clipped_ips": rec.get("ope_clipped_ips"), "ope_ess": rec.get("ope_ess")})
    first = versions[order[0]]
    last = versions[order[-1]]
    r0 = first["accepted"] / first["n"] if first.get("n") else None
    r1 = last["accepted"] / last["n"] if last.get("n") else None
    gain = (r1 - r0) / r0 if r0 and r1 is not None else None
    released_pass = [versions[v].get("offline_pass_at_1") for v in order]
    return {
        "gate": s.eval.gate_threshold,
        "relative_gain": gain,
        "releases": len(order) - 1,
        "cycles": K,
        "requests_per_cycle": s.simusers.requests_per_cycle,
        "users": s.simusers.n_users,
        "goal": "accept rate +20% relative over >= 3 releases, every released version at or above the gate",
        "goal_met": bool(gain is not None and gain >= 0.2 and len(order) - 1 >= 3
                         and all(p is not None and p >= s.eval.gate_threshold for p in released_pass)),
        "offline_pass_min_released": min((p for p in released_pass if p is not None), default=None),
        "versions": out_versions,
        "per_cycle": cycles_out,
        "warmup": warmup,
        "base_pass_at_1": base_pass,
        "base_below_gate": base_pass < s.eval.gate_threshold,
        "bench_dir": str(root),
        "total_s": round(time.perf_counter() - t_start, 1),
    }
