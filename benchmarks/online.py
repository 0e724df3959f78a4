"""`rtrl bench online`: the real-time RL loop end to end, on the real parts.

Each cell runs K cycles (3 with --quick, else 5) of: simulated users → gateway (openai client, real
uvicorn) → event bus → ingest (feedback tables) → single-rollout update → release gate → registry
promotion → the gateway hot-swaps. A final round of traffic (twice a cycle's) measures the last
released version. Reported per version: the realised accept rate with a Wilson CI (overall and per
user kind), the gate's off-policy (SNIPS) estimate made *before* the version served (to be compared
with what it then realised), its offline held-out pass@1, and the time per cycle.

Cells (each from the same base model, in a directory of its own):

* ``realistic``: the realistic population (``simusers.population``), no adversarial users;
* ``adversarial``: the same honest users and honest traffic, plus adversarial users who make up
  ``adversarial_share`` 0.1 of all users (loud users who reject or accept everything, whose requests
  come on top): the two cells differ only by the adversaries;
* ``sabotage``: the realistic population, but every other candidate is broken after training (its
  weights perturbed, or replaced by a regressed checkpoint) before the gate sees it: every broken
  candidate must be refused, and no release may serve worse than its parent;
* ``simple`` (only when asked for, ``run(cells=...)``): the simple population of earlier results.

The headline (``population`` = realistic) carries the realistic cell's gain and CI separation, the
adversarial cell's gain on its honest users (``relative_gain_adversarial``; the adversarial users'
verdicts do not depend on the model, so over all users, ``relative_gain_adversarial_all_users``, they
only dilute it), the sabotage counts, how often the gate refused and by which check (``refusals``),
and the OPE calibration: the mean absolute error between the gate's estimate and the realised accept
rate of each released version. The realistic cell's ``controls`` hold the last release against the
starting model and a matched-compute control, each at its best temperature, on the tasks users asked
during the run and on held-out tasks none of them ever sent (``controls.unseen``).

Everything lives in a fresh directory (``bench_dir`` or a temp dir): its own registry, feedback
database, bus log, API keys, so a benchmark never touches the user's production channel. The base
model is, in order: the user's registry ``production`` version, ``grpo.out_dir``/``midtrain.out_dir``
when they hold a model, else ``model.dir``; if its held-out pass@1 is below ``eval.gate_threshold`` it
is first mid-trained on the function corpus (``offline_rl.midtrain``, the ``functions`` preset's
documents) so the online stage starts from a model that can answer the users' requests.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import torch
from openai import OpenAI

from offline_rl.corpus import build_default_model
from offline_rl.evaluate import mean_ci
from offline_rl.midtrain import continue_midtrain, run_midtrain
from offline_rl.presets import FUNCTIONS
from offline_rl.tasks import generate_tasks
from policy.loading import load_model, load_policy
from realtime_rl import tables as t
from realtime_rl.cycle import run_update_cycle
from realtime_rl.ingest import Ingester
from realtime_rl.ope import accept_rate_ci
from realtime_rl.release import RegistryStore, default_evaluator
from realtime_rl.simusers import (
    ADVERSARIAL,
    FeedbackBacklog,
    adversarial_count,
    build_population,
    judge_in_process,
    register_keys,
    run_traffic,
)
from serving.auth import issue_key
from serving.gateway import Gateway
from serving.server import GatewayServer
from serving.versions import VersionRef

MIDTRAIN_STEPS_OVER_GATE = 600  # function-corpus steps that take the tiny model well over the gate


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
        s.simusers = s.simusers.model_copy(update={"requests_per_cycle": min(s.simusers.requests_per_cycle, 512)})
    return s


def _has_model(path: str | Path | None) -> bool:
    return bool(path) and (Path(path) / "config.json").is_file() and any(Path(path).glob("*.safetensors"))


def _base_model(settings, root: Path, log) -> tuple[Path, bool]:
    """(directory, trained): ``trained`` when it comes from the registry or an offline stage's output."""
    try:
        from policy.registry import Registry

        reg = Registry.from_settings(settings.registry)
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
        log(f"base model: building the tiny model in {root / 'tiny'}")
        return build_default_model(root / "tiny", settings.tiny), False
    log(f"base model: {settings.model.dir}")
    return Path(settings.model.dir), False


class _RegistryChannels:
    """The gateway's version source, on the bench's own registry (``Gateway(source=...)``)."""

    def __init__(self, store) -> None:
        self.store = store

    def current(self, channel: str):
        version = self.store.registry.channel(channel)
        if version is None:
            return None
        return VersionRef(str(version), self.store.materialize(str(version)), channel)


def _wait_for_version(base_url: str, key: str, model: str, version: str, timeout_s: float = 120.0) -> bool:
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


def _ci(n: int, a: int) -> list[float] | None:
    return list(accept_rate_ci([True] * a + [False] * (n - a))) if n else None


def _sabotage(regressed_dir: Path | None, seed: int, scale: float = 1 / 3) -> Callable[[int, Any], str | None]:
    """Breaks the candidates of even cycles: cycle 0, 4, ... adds noise of ``scale`` times each weight
    tensor's spread; cycle 2, 6, ... loads a regressed checkpoint (an earlier stage's output, or a fresh
    untrained model) into the candidate. Returns the tamper hook and records what it did."""

    def tamper(cycle: int, model) -> str | None:
        if cycle % 2:
            return None
        if cycle % 4 == 0 or regressed_dir is None:
            gen = torch.Generator().manual_seed(seed + cycle)
            with torch.no_grad():
                for p in model.parameters():
                    spread = float(p.float().std()) if p.numel() > 1 else 0.0
                    p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * spread * scale)
            return "perturbed"

        regressed = load_model(regressed_dir)
        model.load_state_dict(regressed.state_dict())
        return "regressed checkpoint"

    return tamper


def _regressed_checkpoint(settings, root: Path, log) -> Path:
    """An earlier stage's output to pose as a regressed candidate, else a freshly initialised model."""
    for cand in (Path(settings.midtrain.out_dir), Path(settings.model.dir)):
        if _has_model(cand):
            return cand

    log(f"sabotage: no earlier checkpoint; a fresh tiny model in {root / 'regressed'} stands in")
    return build_default_model(root / "regressed", settings.tiny)


def _cell_settings(s, root: Path, name: str):
    c = s.model_copy(deep=True)
    c.db = c.db.model_copy(update={"url": type(c.db.url)(f"sqlite:///{root / 'feedback.db'}")})
    c.bus = c.bus.model_copy(update={"embedded_path": str(root / "bus.db")})
    c.registry = c.registry.model_copy(update={"url": str(root / "registry"), "cache_dir": str(root / "cache")})
    c.serving = c.serving.model_copy(update={"api_keys_file": str(root / "api_keys.json"),
                                             "spill_dir": str(root / "spill")})
    c.update = c.update.model_copy(update={"work_dir": str(root / "runs")})
    if name == "simple":
        c.simusers = c.simusers.model_copy(update={"population": "simple"})
    elif name == "adversarial":
        c.simusers = c.simusers.model_copy(update={"population": "realistic", "adversarial_share": 0.1})
    else:
        c.simusers = c.simusers.model_copy(update={"population": "realistic", "adversarial_share": 0.0})
    return c


def run_cell(s, root: Path, base_dir: Path, base_pass: float, evaluator, K: int, log: Callable[[str], None],
             tamper: Callable[[int, Any], str | None] | None = None) -> dict[str, Any]:
    """K cycles of the loop on one population (see the module docstring); returns the cell's record."""

    root.mkdir(parents=True, exist_ok=True)
    store = RegistryStore(s)
    base_version = store.publish(base_dir, parent=None, metrics={"offline_pass_at_1": base_pass})
    store.promote(base_version, "production")
    su = s.simusers
    users = build_population(su)
    register_keys(users, partial(issue_key, s))
    train_tasks = generate_tasks(s.tasks.seed, s.tasks.heldout_fraction).train
    versions: dict[str, dict[str, Any]] = {base_version: {"version": base_version, "parent": None, "n": 0,
                                                          "accepted": 0, "kinds": {}, "offline_pass_at_1": base_pass,
                                                          "decision": "base"}}
    order = [base_version]
    cycles_out: list[dict[str, Any]] = []
    backlog = FeedbackBacklog(max_delay_chunks=su.max_delay_chunks)
    sent, broken = 0, []
    ingester = Ingester(s, log_fn=lambda m: None)
    server = GatewayServer(s, gateway=Gateway(s, source=_RegistryChannels(store))).start()
    try:
        for k in range(K + 1):
            tc = time.perf_counter()
            prod = store.production()
            n_req = su.requests_per_cycle * (2 if k == K else 1)
            stats = run_traffic(server.url, users, train_tasks, n_requests=n_req, model=s.model.name,
                                seed=su.seed * 1000 + k, concurrency=su.concurrency, temperature=su.temperature,
                                max_tokens=su.max_tokens, edit_probability=su.edit_probability,
                                backlog=backlog, chunk=k, start=k * su.requests_per_cycle, **su.traffic_options())
            t_traffic = time.perf_counter() - tc
            for v, (n, a) in stats.per_version.items():
                rec = versions.setdefault(v, {"version": v, "n": 0, "accepted": 0, "kinds": {}})
                rec["n"] += n
                rec["accepted"] += a
                for kind, (kn, ka) in stats.per_kind.get(v, {}).items():
                    tally = rec.setdefault("kinds", {}).setdefault(kind, [0, 0])
                    tally[0] += kn
                    tally[1] += ka
            log(f"cycle {k}: {stats.requests} requests on {prod}: accept {stats.accept_rate():.3f} of "
                f"{stats.judged} judged ({stats.no_feedback} without feedback, {stats.delayed} late; "
                f"errors {stats.errors})")
            if stats.error_samples:
                log("  errors: " + " | ".join(stats.error_samples[:3]))
            row: dict[str, Any] = {"cycle": k, "served": prod, "accept_rate": stats.accept_rate(),
                                   "requests": stats.requests, "judged": stats.judged,
                                   "request_errors": stats.errors, "feedback_errors": stats.feedback_errors,
                                   "traffic_s": round(t_traffic, 1)}
            if k == K:
                cycles_out.append(row)
                break
            t1 = time.perf_counter()
            sent += stats.feedback_sent - stats.feedback_errors
            row["ingested"] = _drain(ingester, sent)
            t2 = time.perf_counter()
            hook = (lambda model, k=k: tamper(k, model)) if tamper is not None else None
            result = run_update_cycle(s, force=True, log=log, store=store, evaluator=evaluator, tamper=hook)
            note = result.metrics.get("tampered")
            gate = result.gate or {}
            ope = gate.get("ope") or {}
            log(f"cycle {k}: update {result.status}{' (' + note + ')' if note else ''}: {result.reason}")
            if result.candidate_version:
                if note:
                    broken.append({"cycle": k, "how": note, "version": result.candidate_version,
                                   "decision": result.status, "reason": result.reason})
                rec = versions.setdefault(result.candidate_version, {"version": result.candidate_version,
                                                                     "n": 0, "accepted": 0, "kinds": {}})
                rec.update(parent=prod, decision=result.status, offline_pass_at_1=gate.get("candidate_pass_at_1"),
                           ope_estimate=ope.get("estimate"), ope_ci=ope.get("ci"), ope_ess=ope.get("ess"),
                           production_realised_on_heldout=gate.get("production_accept_rate"), broken=bool(note))
                if result.status == "released":
                    order.append(result.candidate_version)
                    if not _wait_for_version(server.url, users[0].api_key, s.model.name, result.candidate_version):
                        raise RuntimeError(f"the gateway did not switch to {result.candidate_version}")
            train = result.metrics.get("train", {})
            row.update(status=result.status, candidate=result.candidate_version, tampered=note,
                       failed_checks=[c for c, ok in (gate.get("checks") or {}).items() if not ok],
                       ingest_s=round(t2 - t1, 1), update_s=round(time.perf_counter() - t2, 1),
                       cycle_s=round(time.perf_counter() - tc, 1),
                       dataset={k2: result.metrics.get("dataset", {}).get(k2) for k2 in
                                ("train", "heldout", "kept", "kept_unusable", "late", "off_policy", "refeedback",
                                 "orphaned", "capped")},
                       train={k2: train.get(k2) for k2 in ("loss", "ratio_mean", "clip_fraction", "kl_to_serving_k3",
                                                           "mismatch_abs_logp", "reward_mean", "steps")})
            cycles_out.append(row)
    finally:
        server.stop()
        ingester.engine.dispose()
    return _summarise_cell(versions, order, cycles_out, broken, s, len(backlog.items))


def _refusals(cycles_out: list[dict[str, Any]]) -> dict[str, Any]:
    """How often the gate refused a candidate, and which checks failed (a refusal can fail several)."""
    done = [c for c in cycles_out if c.get("candidate")]
    refused = [c for c in done if c.get("status") == "refused"]
    return {"candidates": len(done), "refused": len(refused),
            "by_check": dict(Counter(check for c in refused for check in c.get("failed_checks", [])))}


def _summarise_cell(versions, order, cycles_out, broken, s, never_sent: int) -> dict[str, Any]:
    out_versions = []
    for v in order + [v for v in versions if v not in order]:
        rec = versions[v]
        n, a = rec.get("n", 0), rec.get("accepted", 0)
        out_versions.append({"version": v, "parent": rec.get("parent"), "decision": rec.get("decision"),
                             "broken": rec.get("broken", False), "judged": n, "accept_rate": a / n if n else None,
                             "ci": _ci(n, a), "per_kind": {kind: {"n": kn, "accept_rate": ka / kn if kn else None,
                                                                  "ci": _ci(kn, ka)}
                                                           for kind, (kn, ka) in sorted(rec.get("kinds", {}).items())},
                             "offline_pass_at_1": rec.get("offline_pass_at_1"),
                             "ope_estimate": rec.get("ope_estimate"), "ope_ci": rec.get("ope_ci"),
                             "ope_ess": rec.get("ope_ess")})
    for v in out_versions:  # the adversarial users' verdicts do not depend on the model
        honest = [tally for kind, tally in versions[v["version"]].get("kinds", {}).items() if kind not in ADVERSARIAL]
        n, a = sum(kn for kn, _ in honest), sum(ka for _, ka in honest)
        v["honest"] = {"n": n, "accept_rate": a / n if n else None, "ci": _ci(n, a)}
    by_id = {v["version"]: v for v in out_versions}
    first, last = by_id[order[0]], by_id[order[-1]]

    def rel_gain(a: float | None, b: float | None) -> float:
        return (b - a) / a if a and b is not None and len(order) > 1 else 0.0

    gain = rel_gain(first["accept_rate"], last["accept_rate"])
    separated = bool(len(order) > 1 and first["ci"] and last["ci"] and last["ci"][0] > first["ci"][1])
    regressions = [v["version"] for v in out_versions[1:len(order)]
                   if v["broken"] or (v["ci"] and by_id[v["parent"]]["accept_rate"] is not None
                                      and v["ci"][1] < by_id[v["parent"]]["accept_rate"])]
    ope_pairs = [(v["ope_estimate"], v["accept_rate"]) for v in out_versions[1:len(order)]
                 if v["ope_estimate"] is not None and v["accept_rate"] is not None]
    released_pass = [by_id[v]["offline_pass_at_1"] for v in order]
    return {
        "population": s.simusers.population, "adversarial_share": s.simusers.adversarial_share,
        "adversarial_users": adversarial_count(s.simusers.n_users, s.simusers.adversarial_share),
        "relative_gain": gain, "ci_separated": separated, "releases": len(order) - 1,
        "relative_gain_honest": rel_gain(first["honest"]["accept_rate"], last["honest"]["accept_rate"]),
        "first_accept": first["accept_rate"], "first_ci": first["ci"], "last_accept": last["accept_rate"],
        "last_ci": last["ci"],
        "offline_pass_min_released": min((p for p in released_pass if p is not None), default=None),
        "all_released_at_gate": all(p is not None and p >= s.eval.gate_threshold - s.release.gate_tolerance
                                    for p in released_pass),
        "regressions": regressions, "broken": broken, "refusals": _refusals(cycles_out),
        "ope_pairs": ope_pairs, "late_feedback_never_sent": never_sent,
        "versions": out_versions, "per_cycle": cycles_out,
    }


def _function_midtrain(s, **fields):
    """``s`` with the functions preset's mid-training corpus (the documents the users' requests are like)."""
    return s.model_copy(update={"midtrain": s.midtrain.model_copy(update={**FUNCTIONS["midtrain"], **fields})})


def _paired(a: list[tuple[str, bool]], b: list[tuple[str, bool]]) -> dict[str, Any]:
    """b − a over the same planned requests: mean difference with a normal 95% interval."""
    gain, lo, hi = mean_ci([float(y) - float(x) for (_, x), (_, y) in zip(a, b, strict=True)])
    return {"gain": gain, "ci95": [lo, hi]}


def _compare(policies: dict[str, Any], users, tasks, su, temperatures, n: int) -> dict[str, Any]:
    """Every policy judged by the same users on the same ``n`` planned requests at each temperature;
    each at its best temperature, and the last release's paired gains over the two controls."""
    outcomes = {name: {t: judge_in_process(p.model, p.tokenizer, users, tasks, n_requests=n, temperature=t,
                                           max_tokens=su.max_tokens, seed=su.seed + 7919, **su.traffic_options())
                       for t in temperatures}
                for name, p in policies.items()}
    rates = {name: {t: sum(a for _, a in o) / len(o) for t, o in grid.items()} for name, grid in outcomes.items()}
    best_t = {name: max(grid, key=lambda t, g=grid: (g[t], -abs(t - su.temperature))) for name, grid in rates.items()}
    best = {name: {"accept": rates[name][t], "t": t, "ci95": _ci(n, sum(a for _, a in outcomes[name][t]))}
            for name, t in best_t.items()}
    return {"requests": n, "tasks": len(tasks),
            "accept": {name: {str(t): r for t, r in grid.items()} for name, grid in rates.items()}, "best": best,
            "last_at_serving_t": rates["last"][su.temperature],
            "gain_vs_base_best": _paired(outcomes["base"][best_t["base"]], outcomes["last"][best_t["last"]]),
            "gain_vs_control_best": _paired(outcomes["control"][best_t["control"]], outcomes["last"][best_t["last"]])}


def _controls(s, root: Path, base_dir: Path, cell_s, cell: dict[str, Any], log, n: int) -> dict[str, Any]:
    """Is the realistic cell's gain learning? The last released version against two controls, each
    at its own best temperature of ``eval.temperatures``: the base model (a gain that a lower
    temperature gives as well is not learning) and a matched-compute control, the base mid-trained
    on (the function corpus) for as long as the cell's updates took. Every model is judged by the same
    users on the same planned requests in-process (:func:`realtime_rl.simusers.judge_in_process`):
    on the tasks the users asked during the run (what they will ask again), and under ``unseen`` on
    the held-out tasks no user ever sent (does the gain carry over to new requests)."""
    if cell["releases"] == 0:
        return {"skipped": "no release"}
    last = cell["versions"][cell["releases"]]["version"]
    seconds = sum(c.get("update_s", 0.0) for c in cell["per_cycle"])
    log(f"controls: mid-training the base for the updates' {seconds:.0f} s (matched compute)")
    control = continue_midtrain(_function_midtrain(s, eval_at_end=False), base_dir, root / "control",
                                seconds=seconds, progress=False, log=log)
    models = {"base": base_dir, "control": control, "last": RegistryStore(cell_s).materialize(last)}
    policies = {name: load_policy(path, s.model.dtype, s.model.device) for name, path in models.items()}
    su = cell_s.simusers
    users = build_population(su)
    split = generate_tasks(s.tasks.seed, s.tasks.heldout_fraction)
    out = {"temperatures": list(s.eval.temperatures), "control_seconds": round(seconds, 1),
           **_compare(policies, users, split.train, su, s.eval.temperatures, n),
           "unseen": _compare(policies, users, split.heldout, su, s.eval.temperatures, max(n // 4, 64))}
    for where, res in (("asked", out), ("unseen", out["unseen"])):
        b = res["best"]
        log(f"controls ({where} tasks): best accept rate, last release {b['last']['accept']:.3f} "
            f"(T={b['last']['t']}), base {b['base']['accept']:.3f} (T={b['base']['t']}), control "
            f"{b['control']['accept']:.3f} (T={b['control']['t']})")
    return out


def run(settings, quick: bool = False, log: Callable[[str], None] = print, cycles: int | None = None,
        bench_dir: str | Path | None = None, cells: tuple[str, ...] | None = None) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(settings.model.threads)
    root = Path(bench_dir or tempfile.mkdtemp(prefix="rtrl-online-"))
    root.mkdir(parents=True, exist_ok=True)
    s = _bench_settings(settings, root, quick)
    K = cycles or (3 if quick else 5)
    cells = cells or ("realistic", "adversarial", "sabotage")
    t_start = time.perf_counter()

    base_dir, trained = _base_model(settings, root, log)
    base = load_policy(base_dir, s.model.dtype, s.model.device)
    evaluator = default_evaluator(s, base.tokenizer)
    base_pass = evaluator(base.model)
    log(f"base held-out pass@1 {base_pass:.3f} (gate {s.eval.gate_threshold})")
    warmup: dict[str, Any] = {}
    if base_pass < s.eval.gate_threshold and not trained:
        # The default mid-training stops *below* the gate on purpose (GRPO's job is to cross it); the
        # online bench needs a production-grade start without running GRPO, so it trains longer.
        steps = 200 if quick else MIDTRAIN_STEPS_OVER_GATE
        log(f"below the gate: mid-training {steps} steps on the function corpus first")
        # The simulated users ask for single functions, so the warm-up reads function documents only
        # (the functions preset's corpus), whatever environment the offline stage is set to.
        mt = _function_midtrain(s, steps=steps, eval_at_end=False)
        t0 = time.perf_counter()
        base_dir = run_midtrain(mt, init_dir=base_dir, out_dir=root / "midtrain", progress=False, log=log)
        base = load_policy(base_dir, s.model.dtype, s.model.device)
        base_pass = evaluator(base.model)
        warmup = {"midtrain_steps": steps, "midtrain_s": round(time.perf_counter() - t0, 1), "pass_at_1": base_pass}
        log(f"after mid-training: held-out pass@1 {base_pass:.3f}")
    if base_pass < s.eval.gate_threshold:
        log(f"warning: the base model's pass@1 {base_pass:.3f} is below the gate {s.eval.gate_threshold}: the "
            "offline check will refuse every candidate (run the offline stage further, or lower eval.gate_threshold)")
    del base

    results: dict[str, dict[str, Any]] = {}
    for name in cells:
        log(f"--- cell {name}")
        tc = time.perf_counter()
        cell_root = root / name
        tamper = _sabotage(_regressed_checkpoint(s, cell_root, log), s.update.seed) if name == "sabotage" else None
        cell_s = _cell_settings(s, cell_root, name)
        results[name] = run_cell(cell_s, cell_root, base_dir, base_pass, evaluator, K, log, tamper=tamper)
        if name == "realistic":
            results[name]["controls"] = _controls(s, cell_root, base_dir, cell_s, results[name], log,
                                                  n=256 if quick else 4096)
        results[name]["cell_s"] = round(time.perf_counter() - tc, 1)
        log(f"--- cell {name}: gain {results[name]['relative_gain']:+.3f}, {results[name]['releases']} releases, "
            f"{results[name]['cell_s']} s")
    return _headline(results, s, K, base_pass, warmup, root, t_start)


def _beats(compared: dict[str, Any]) -> bool:
    """The last release's paired gain over both controls has a 95% interval above zero."""
    return compared["gain_vs_base_best"]["ci95"][0] > 0 and compared["gain_vs_control_best"]["ci95"][0] > 0


def _headline(results, s, K, base_pass, warmup, root, t_start) -> dict[str, Any]:
    real = results.get("realistic", {})
    adv = results.get("adversarial", {})
    controls = real.get("controls") or {}
    sab = results.get("sabotage")
    pairs = [p for name in ("realistic", "adversarial") for p in results.get(name, {}).get("ope_pairs", [])]
    # With adversarial users in the traffic, the gain is that of the honest users' accept rate: the
    # adversarial verdicts are the same whatever the model, so they only dilute the measured rate.
    gain, gain_adv = real.get("relative_gain"), adv.get("relative_gain_honest")
    sabotage = None
    if sab is not None:
        sabotage = {"candidates": sum(1 for c in sab["per_cycle"] if c.get("candidate")),
                    "broken": len(sab["broken"]),
                    "refused_broken": sum(b["decision"] != "released" for b in sab["broken"]),
                    "refused": sum(1 for c in sab["per_cycle"] if c.get("status") == "refused"),
                    "shipped": sab["releases"], "regressions_shipped": len(sab["regressions"])}
    return {
        "population": "realistic",
        "relative_gain": gain,
        "ci_separated": real.get("ci_separated"),
        "relative_gain_adversarial": gain_adv,
        "adversarial_gain_over": "honest users",
        "controls": real.get("controls"),
        "beats_controls": _beats(controls) if "best" in controls else None,
        "beats_controls_unseen": _beats(controls["unseen"]) if "unseen" in controls else None,
        "relative_gain_adversarial_all_users": adv.get("relative_gain"),
        "adversarial_gain_ratio": (gain_adv / gain) if gain and gain_adv is not None else None,
        "sabotage": sabotage,
        "refusals": {name: cell["refusals"] for name, cell in results.items()},
        "ope_mae": sum(abs(e - r) for e, r in pairs) / len(pairs) if pairs else None,
        "ope_pairs": len(pairs),
        "gate": s.eval.gate_threshold,
        "cycles": K,
        "requests_per_cycle": s.simusers.requests_per_cycle,
        "users": s.simusers.n_users,
        "goal": "realistic: accept rate +20% relative over >= 3 releases with separated CIs; adversarial gain within "
                "25% of it; sabotage: 0 regressions shipped",
        "goal_met": bool(gain is not None and gain >= 0.2 and real.get("releases", 0) >= 3 and real.get("ci_separated")
                         and gain_adv is not None and abs(gain_adv - gain) <= 0.25 * abs(gain)
                         and (sabotage is None or sabotage["regressions_shipped"] == 0)),
        "cells": results,
        "base_pass_at_1": base_pass,
        "warmup": warmup,
        "bench_dir": str(root),
        "total_s": round(time.perf_counter() - t_start, 1),
    }
