"""`rtrl demo`: the whole lifecycle on one machine, on the configured (by default embedded) parts.

Stages, each resumable (a finished stage is recorded in ``var/demo/state.json`` and skipped on the
next run; an interrupted one starts again):

1. ``model``     build the tiny default model (``rtrl init-model``) unless ``model.dir`` holds one;
2. ``midtrain``  next-token training on the synthetic corpus: capable, usually still below the gate;
3. ``grpo``      offline GRPO in the sandboxed environment until held-out pass@1 passes
                 ``eval.gate_threshold``; that checkpoint is published to the registry and promoted
                 to ``production`` (version 1);
4. ``controls``  is the gain learning? The matched-compute control (mid-training continued for
                 GRPO's wall time), then the mid-trained model, the control and GRPO's final
                 checkpoint at every temperature of ``eval.temperatures``, each judged at its best;
5. ``online``    start the gateway (serving ``production``), the ingester and the update scheduler,
                 in background threads; simulated users send completions with the official
                 ``openai`` client and feedback through ``/v1/feedback``; the scheduler's cycles
                 train candidates, gate them, and promote the ones that pass; the gateway hot-swaps
                 them in. The stage ends after ``releases`` real-time releases (or its time budget);
6. ``report``    ``var/report/index.html`` with the plots, and a summary table in the terminal.

This module only orchestrates: every computation happens in the package that owns it.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from offline_rl.compare import compare_models
from offline_rl.corpus import build_default_model
from offline_rl.grpo import run_grpo
from offline_rl.midtrain import continue_midtrain, run_midtrain
from offline_rl.presets import apply_preset
from offline_rl.tasks import generate_tasks
from policy.registry import Registry
from realtime_rl.analytics import accept_rate_by_group, accept_rate_by_version
from realtime_rl.database import make_engine
from realtime_rl.ingest import Ingester
from realtime_rl.release import list_releases, list_runs
from realtime_rl.schedule import build_scheduler, scheduled_cycle
from realtime_rl.schema import ensure_schema
from realtime_rl.simusers import FeedbackBacklog, build_population, register_keys, run_traffic
from rtrl.config import Settings
from rtrl.report import (
    ReportData,
    VersionRow,
    gains_text,
    online_summary,
    print_summary,
    summarise_mismatch,
    write_report,
    write_summary,
)
from serving.auth import issue_key
from serving.server import GatewayServer

STAGES = ("model", "midtrain", "grpo", "controls", "online", "report")


class DemoError(RuntimeError):
    """A stage did not reach its outcome; the message says which and why."""


ENVS = ("functions", "agent")


@dataclass(frozen=True)
class DemoPlan:
    """Sizes of one demo run. ``fast`` is the CI path; the default is sized so that each real-time
    release is trained and judged on about a thousand users' judgements (fewer leave a release's step
    mostly noise), a short run on 2 cores."""

    offline_preset: str | None
    releases: int
    online_budget_s: float
    update_interval: str
    min_feedback: int
    traffic_chunk: int
    final_requests: int

    @staticmethod
    def for_mode(fast: bool, env: str = "functions") -> DemoPlan:
        """``env``: the offline stage's environment. ``functions`` (the ``functions`` preset: the
        single-turn tasks the simulated users ask for, so the online stage starts from a model trained
        for its users' requests) or ``agent`` (the default settings: multi-turn repository episodes,
        tens of minutes; the online users still ask for single functions)."""
        if env not in ENVS:
            raise DemoError(f"unknown demo environment {env!r}; choose from {', '.join(ENVS)}")
        preset = "functions" if env == "functions" else None
        if fast:
            # The realistic users judge about 6 of 10 completions: 160 fresh judgements per cycle take
            # about the requests 256 took when every completion was judged, so CI is not slowed down.
            return DemoPlan(offline_preset=preset, releases=2, online_budget_s=300, update_interval="10s",
                            min_feedback=160, traffic_chunk=64, final_requests=128)
        return DemoPlan(offline_preset=preset, releases=3, online_budget_s=1500, update_interval="15s",
                        min_feedback=1024, traffic_chunk=64, final_requests=1024)


class DemoState:
    """Which stages finished, with their outputs; written atomically after each stage."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"stages": {}}

    def done(self, stage: str) -> dict[str, Any] | None:
        return self.data["stages"].get(stage)

    def finish(self, stage: str, outputs: dict[str, Any]) -> None:
        self.data["stages"][stage] = outputs
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)

    def reset_from(self, stage: str) -> None:
        for later in STAGES[STAGES.index(stage):]:
            self.data["stages"].pop(later, None)

    def forget_online(self) -> None:
        """Drop what an online stage keeps outside its stage record (its start, swaps, users)."""
        for key in ("online_started_at", "online_swaps", "online_user_kinds"):
            self.data.pop(key, None)

    def select(self, env: str, fast: bool, log: Callable[[str], None]) -> None:
        """Record this run's mode; a different offline environment than the finished stages used
        trains from mid-training again; a switch of ``--fast`` (the online stage's sizes) redoes the
        online stage."""
        # A state from before the environment was recorded: its full path was the agent environment.
        previous = self.data.get("env") or (None if not self.data["stages"] else
                                            "functions" if self.data.get("fast") else "agent")
        if previous not in (None, env):
            log(f"demo: switching the offline environment from {previous} to {env}: mid-training again")
            self.reset_from("midtrain")
            self.forget_online()
        if self.data.get("fast") not in (None, fast):
            log("demo: switching between --fast and the full run: running the online stage again")
            self.reset_from("online")
            self.forget_online()
        self.data["env"], self.data["fast"] = env, fast
        self.save()


def demo_settings(settings: Settings, plan: DemoPlan) -> Settings:
    """The user's settings with the demo's schedule (minutes, not hours) and the offline preset."""

    s = apply_preset(settings.model_copy(deep=True), plan.offline_preset)
    s.schedule = s.schedule.model_copy(update={"update_interval": plan.update_interval,
                                               "min_feedback": plan.min_feedback, "misfire_grace_s": 60})
    return s


def _has_model(path: str | Path) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


# --------------------------------------------------------------------------------------------------
# Stages 1-3: offline.


def stage_model(s: Settings, log: Callable[[str], None]) -> dict[str, Any]:
    if _has_model(s.model.dir):
        log(f"model: using {s.model.dir}")
    else:
        build_default_model(s.model.dir, s.tiny)
        log(f"model: built the tiny default model in {s.model.dir}")
    return {"model_dir": s.model.dir}


def stage_midtrain(s: Settings, log: Callable[[str], None]) -> dict[str, Any]:
    out = run_midtrain(s, init_dir=s.model.dir, progress=True, log=log)
    return {"dir": str(out)}


def stage_grpo(s: Settings, log: Callable[[str], None], init_dir: str) -> dict[str, Any]:
    result = run_grpo(s, init_dir, progress=True, log=log)
    summary = result.summary()
    summary["evals"] = result.evals
    if not result.published_version:
        raise DemoError(f"grpo: held-out pass@1 went from {summary['pass_at_1_before']} (mid-trained) to "
                        f"{summary['pass_at_1_after']} and never reached the gate {s.eval.gate_threshold} in "
                        f"{result.steps} steps; nothing was published. "
                        "Raise grpo.steps or lower eval.gate_threshold, then rerun (finished stages are kept).")
    serving = result.final_version or result.published_version
    log(f"grpo: version {result.published_version} passed the gate at step {result.published_step}"
        + (f"; the better final checkpoint {serving} superseded it" if result.final_version else "")
        + f"; {serving} serves as production")
    return summary


def stage_controls(s: Settings, log: Callable[[str], None], mid_dir: str, grpo: dict[str, Any]) -> dict[str, Any]:
    """The learning claim's controls: mid-training continued from the same checkpoint for GRPO's wall
    time (its evaluations included, which favours the control), then the mid-trained model, that
    control and GRPO's final checkpoint on the held-out tasks at every temperature of the grid."""
    if grpo.get("skipped"):
        return {"skipped": True}
    seconds = float(grpo["wall_s"])
    log(f"controls: mid-training on from {mid_dir} for GRPO's {seconds:.0f} s (the matched-compute control)")
    control = continue_midtrain(s, mid_dir, Path(s.var_dir) / "runs" / "control", seconds=seconds, log=log)
    cmp = compare_models(s, {"midtrain": mid_dir, "control": control, "grpo": grpo["final_dir"]}, "grpo",
                         log=lambda m: log(f"controls: {m}"))
    out = {**cmp.to_dict(), "control_dir": str(control), "control_seconds": round(seconds, 1)}
    log(f"controls: GRPO at its best temperature, paired per task: {gains_text(out['gains'])}")
    return out


# --------------------------------------------------------------------------------------------------
# Stage 4: online.


class _Traffic(threading.Thread):
    """Simulated users sending requests in chunks until stopped; per-version tallies accumulate."""

    def __init__(self, url: str, users, tasks, s: Settings, chunk: int) -> None:
        super().__init__(name="demo-traffic", daemon=True)
        self.url, self.users, self.tasks, self.s, self.chunk = url, users, tasks, s, chunk
        self.stop_event = threading.Event()
        self.per_version: dict[str, list[int]] = {}
        self.requests = 0
        self.errors = 0
        self.error_samples: list[str] = []

    def run(self) -> None:
        k = 0
        su = self.s.simusers
        backlog = FeedbackBacklog(max_delay_chunks=su.max_delay_chunks)
        while not self.stop_event.is_set():
            stats = run_traffic(self.url, self.users, self.tasks, n_requests=self.chunk, model=self.s.model.name,
                                seed=su.seed * 7919 + k, concurrency=su.concurrency, temperature=su.temperature,
                                max_tokens=su.max_tokens, edit_probability=su.edit_probability, backlog=backlog,
                                chunk=k, start=k * self.chunk, **su.traffic_options())
            k += 1
            self.requests += stats.requests
            self.errors += stats.errors
            self.error_samples = (self.error_samples + stats.error_samples)[:5]
            for version, (n, accepted) in stats.per_version.items():
                tally = self.per_version.setdefault(version, [0, 0])
                tally[0] += n
                tally[1] += accepted

    def served(self, version: str) -> int:
        return self.per_version.get(version, [0, 0])[0]


def _as_utc(value) -> datetime:
    """Timestamps come back aware from PostgreSQL, naive (but UTC) from SQLite."""
    t = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def _released_since(engine, since_iso: str) -> list[dict[str, Any]]:
    since = _as_utc(since_iso)
    return [r for r in reversed(list_releases(engine, limit=500))
            if r["decision"] == "released" and _as_utc(r["created_at"]) >= since]


class _SwapLag:
    """Notices a gateway that keeps serving an old version after the registry's production moved on.

    The watcher polls every few seconds, so a lag of ``limit_s`` means it is failing or stuck: the
    watcher's last error and every thread's stack go to the log once, so the cause is on record."""

    def __init__(self, gateway, log: Callable[[str], None], limit_s: float = 45.0) -> None:
        self.gateway, self.log, self.limit_s = gateway, log, limit_s
        self.since: float | None = None
        self.reported: set[str] = set()

    def check(self, production: str | None) -> None:
        live = self.gateway.engine.versions().get("production")
        if production is None or production == live:
            self.since = None
            return
        now = time.monotonic()
        self.since = self.since or now
        if now - self.since < self.limit_s or production in self.reported:
            return

        self.reported.add(production)
        watcher = self.gateway.watcher
        self.log(f"online: registry production is {production} but the gateway still serves {live} after "
                 f"{now - self.since:.0f} s (watcher alive={watcher.alive}, last error: "
                 f"{watcher.last_error}); thread stacks follow on stderr")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def stage_online(s: Settings, plan: DemoPlan, log: Callable[[str], None], started: str,
                 state: DemoState) -> dict[str, Any]:
    ensure_schema(s.db)
    engine = make_engine(s.db)
    registry = Registry.from_settings(s.registry)
    first_production = registry.channel("production")
    if first_production is None:
        raise DemoError("online: the registry has no production version (the grpo stage publishes it)")

    su = s.simusers
    users = build_population(su)
    register_keys(users, partial(issue_key, s))
    state.data["online_user_kinds"] = {u.caller: u.kind for u in users}
    state.save()
    tasks = generate_tasks(s.tasks.seed, s.tasks.heldout_fraction).train
    stop = threading.Event()
    server = GatewayServer(s).start()
    live = server.gateway.engine.versions().get("production")
    log(f"online: gateway on {server.url} serving {s.model.name}@{live} "
        f"(source {type(server.gateway.source).__name__})")
    if live != first_production:
        server.stop()
        raise DemoError(f"online: the gateway serves {live}, not the registry's production {first_production}")
    ingester = Ingester(s)
    ingest_thread = threading.Thread(target=ingester.run, kwargs={"stop_event": stop}, name="demo-ingest",
                                     daemon=True)
    ingest_thread.start()
    scheduler = build_scheduler(s, scheduled_cycle(s, log=log), blocking=False)
    scheduler.start()
    traffic = _Traffic(server.url, users, tasks, s, plan.traffic_chunk)
    traffic.start()
    log(f"online: ingester and scheduler (every {plan.update_interval}, min_feedback {plan.min_feedback}) "
        f"running; {len(users)} simulated users ({su.population} population: "
        f"{', '.join(sorted({u.kind for u in users}))}) sending traffic")

    # Swaps are saved as they happen, so that an interrupted and resumed stage still reports them.
    swaps: list[dict[str, Any]] = state.data.setdefault("online_swaps", [])

    def record_swaps() -> None:
        history = list(getattr(server.gateway.watcher, "history", []))
        seen = {(w["version"], w["channel"]) for w in swaps}
        new = [{"channel": c, "version": v, "pause_ms": round(p * 1000, 3)} for c, v, p in history
               if (v, c) not in seen]
        if new:
            swaps.extend(new)
            state.save()

    deadline = time.monotonic() + plan.online_budget_s
    bar = tqdm(total=plan.releases, desc="online releases", dynamic_ncols=True)
    released: list[dict[str, Any]] = []
    lag = _SwapLag(server.gateway, log)
    try:
        while time.monotonic() < deadline:
            released = _released_since(engine, started)
            production = registry.channel("production")
            bar.n = min(len(released), plan.releases)
            bar.set_postfix(requests=traffic.requests, production=(production or "")[:10])
            bar.refresh()
            record_swaps()
            lag.check(production)
            if len(released) >= plan.releases:
                break
            if not traffic.is_alive():
                raise DemoError("online: the simulated-user traffic thread died")
            time.sleep(2.0)
        # Let the newest production version serve enough traffic to measure its accept rate.
        newest = registry.channel("production")
        scheduler.pause()
        wait_until = time.monotonic() + 120
        while traffic.served(newest) < plan.final_requests and time.monotonic() < wait_until:
            time.sleep(1.0)
        record_swaps()
    finally:
        bar.close()
        traffic.stop_event.set()
        traffic.join(timeout=120)
        scheduler.shutdown(wait=True)
        # Drain what the gateway has emitted before stopping the ingester.
        server.stop()
        ingester_deadline = time.monotonic() + 60
        while ingester.lag() > 0 and time.monotonic() < ingester_deadline:
            time.sleep(0.5)
        stop.set()
        ingest_thread.join(timeout=60)
        ingester.close()
    log(f"online: {len(released)} release(s), {traffic.requests} requests, {traffic.errors} failed requests")
    if traffic.errors:
        log("online: failed request samples: " + " | ".join(traffic.error_samples))
    return {"started_at": started, "first_production": first_production,
            "releases": [r["candidate_version"] for r in released], "requests": traffic.requests,
            "failed_requests": traffic.errors, "swaps": swaps,
            "user_kinds": state.data.get("online_user_kinds", {})}


# --------------------------------------------------------------------------------------------------
# Stage 5: report.


def gather_report(s: Settings, state: DemoState):
    grpo = state.done("grpo") or {}
    online = state.done("online") or {}
    data = ReportData(gate=s.eval.gate_threshold, pass_before=grpo.get("pass_at_1_before"),
                      pass_after=grpo.get("pass_at_1_after"))
    data.grpo_curve = [(e["step"], e["pass_at_1"]) for e in grpo.get("evals", [])]
    controls = state.done("controls") or {}
    data.controls = None if controls.get("skipped") or "gains" not in controls else controls
    data.swap_pauses_ms = [w["pause_ms"] for w in online.get("swaps", []) if w.get("pause_ms") is not None]
    data.stage_seconds = {k: v.get("seconds", 0.0) for k, v in state.data["stages"].items()}

    engine = make_engine(s.db)
    metrics_path = Path(grpo["metrics"]) if grpo.get("metrics") else None
    if metrics_path is not None and metrics_path.is_file():
        steps = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
        data.mismatch["offline GRPO"] = summarise_mismatch(steps)
    runs = [r["metrics"].get("train", {}) for r in list_runs(engine, limit=500) if isinstance(r.get("metrics"), dict)]
    if runs:
        data.mismatch["real-time updates"] = summarise_mismatch(runs)
    accept = {r["version"]: r for r in accept_rate_by_version(engine).to_dict("records")}
    by_kind: dict[str, dict[str, tuple[float, float, float, int]]] = {}
    for r in accept_rate_by_group(engine, online.get("user_kinds") or state.data.get("online_user_kinds", {})
                                  ).to_dict("records"):
        by_kind.setdefault(r["version"], {})[r["group"]] = (r["accept_rate"], r["accept_ci_low"],
                                                            r["accept_ci_high"], int(r["n_feedback"]))
    releases = {r["candidate_version"]: r for r in list_releases(engine, limit=500)}
    registry = Registry.from_settings(s.registry)
    infos = {v.id: v for v in registry.list()}
    first = grpo.get("published_version") or online.get("first_production")
    since = _as_utc(online["started_at"]) if online.get("started_at") else None
    # The run's first gate-passing version, then its final checkpoint when that superseded it before
    # serving, then the real-time releases.
    chain = [first, grpo.get("final_version")] + [r["candidate_version"] for r in sorted(releases.values(), key=lambda r: _as_utc(r["created_at"]))
                       if since is None or _as_utc(r["created_at"]) >= since]
    for version in dict.fromkeys(v for v in chain if v):
        info = infos.get(version)
        rel = releases.get(version)
        acc = accept.get(version, {})
        n = int(acc.get("n_feedback", 0) or 0)
        row = VersionRow(
            version=version, stage=(info.stage if info else None) or ("offline" if version in chain[:2] else "realtime"),
            accept_rate=acc.get("accept_rate") if n else None,
            ci=(acc["accept_ci_low"], acc["accept_ci_high"]) if n else None, n_feedback=n,
            offline_pass_at_1=(rel or {}).get("offline_pass_at_1") if rel else
            (info.metrics.get("heldout_pass_at_1") if info else None),
            ope_estimate=(rel or {}).get("ope_estimate"),
            delta_bytes=info.stored_bytes if info else None, raw_bytes=info.raw_bytes if info else None,
            kind=info.kind if info else "", released=(rel is None or rel["decision"] == "released"),
            note=((rel or {}).get("reason") or "")[:80], per_kind=by_kind.get(version, {}),
            decision=(rel or {}).get("decision") or "offline")
        data.versions.append(row)
    # Every gate decision of this run, refusals with their reasons (canary verdicts included).
    data.gate_decisions = [{"version": r["candidate_version"], "decision": r["decision"], "reason": r["reason"]}
                           for r in sorted(releases.values(), key=lambda r: _as_utc(r["created_at"]))
                           if since is None or _as_utc(r["created_at"]) >= since]
    return data


# --------------------------------------------------------------------------------------------------
# The job.


@contextmanager
def _timed(state: DemoState, stage: str, outputs: dict[str, Any]):
    t0 = time.perf_counter()
    yield
    outputs["seconds"] = round(time.perf_counter() - t0, 1)
    state.finish(stage, outputs)


def run_demo(settings: Settings, *, fast: bool = False, env: str = "functions", restart: bool = False,
             from_production: bool = False, releases: int | None = None, log: Callable[[str], None] = print,
             summary_to_stderr: bool = False) -> dict[str, Any]:
    """Run (or resume) the lifecycle; returns the summary that ``--json`` prints. ``env``: the offline
    stage's environment (:meth:`DemoPlan.for_mode`). ``releases``: end the online stage after this
    many real-time releases instead of the plan's."""

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    plan = DemoPlan.for_mode(fast, env)
    if releases is not None:
        if releases < 1:
            raise DemoError(f"--releases must be at least 1, got {releases}")
        plan = dataclasses.replace(plan, releases=releases)
    s = demo_settings(settings, plan)
    torch.set_num_threads(s.model.threads)
    state = DemoState(Path(s.var_dir) / "demo" / "state.json")
    if restart:
        state.reset_from("model")
        state.forget_online()
    state.select(env, fast, log)
    if from_production and state.done("grpo") is None:
        production = Registry.from_settings(s.registry).channel("production")
        if production is None:
            raise DemoError(f"--from-production: the registry {s.registry.url} has no production version")
        log(f"demo: starting from production version {production}; the offline stages are skipped")
        for stage in ("model", "midtrain"):
            state.finish(stage, {"skipped": True, "seconds": 0.0})
        state.finish("grpo", {"skipped": True, "seconds": 0.0, "published_version": production})
    t_all = time.perf_counter()

    for stage in STAGES:
        done = state.done(stage)
        if done is not None:
            log(f"[{stage}] already done ({done.get('seconds', 0):.0f} s), skipping")
            continue
        log(f"[{stage}] starting")
        outputs: dict[str, Any] = {}
        with _timed(state, stage, outputs):
            if stage == "model":
                outputs.update(stage_model(s, log))
            elif stage == "midtrain":
                outputs.update(stage_midtrain(s, log))
            elif stage == "grpo":
                outputs.update(stage_grpo(s, log, (state.done("midtrain") or {})["dir"]))
            elif stage == "controls":
                outputs.update(stage_controls(s, log, (state.done("midtrain") or {}).get("dir", ""),
                                              state.done("grpo") or {}))
            elif stage == "online":
                # Kept outside the stage record so that an interrupted online stage, rerun, still
                # counts the releases it already made.
                if "online_started_at" not in state.data:
                    state.data["online_started_at"] = datetime.now(UTC).isoformat()
                    state.save()
                outputs.update(stage_online(s, plan, log, state.data["online_started_at"], state))
            elif stage == "report":
                data = gather_report(s, state)
                outputs["index"] = str(write_report(data, Path(s.var_dir) / "report"))
    data = gather_report(s, state)
    index = write_report(data, Path(s.var_dir) / "report")
    write_summary(data, Path(s.var_dir) / "report")
    print_summary(data, stderr=summary_to_stderr)
    grpo, online = state.done("grpo") or {}, state.done("online") or {}
    summary = {
        "env": s.env.kind,
        "gate": s.eval.gate_threshold,
        "gate_passed": bool(grpo.get("published_version")) and not grpo.get("skipped"),
        "pass_at_1_before": grpo.get("pass_at_1_before"),
        "pass_at_1_after": grpo.get("pass_at_1_after"),
        "published_version": grpo.get("published_version"),
        "published_step": grpo.get("published_step"),
        "published_pass_at_1": next((e["pass_at_1"] for e in grpo.get("evals", [])
                                     if e["step"] == grpo.get("published_step")), None),
        "controls": {k: data.controls[k] for k in ("temperatures", "best_t", "pass_at_1_by_t", "gains",
                                                    "control_seconds")} if data.controls else None,
        "realtime_releases": len(online.get("releases", [])),
        "failed_requests": online.get("failed_requests"),
        "report": str(Path(index).resolve()),
        "stage_seconds": {k: v.get("seconds") for k, v in state.data["stages"].items()},
        "this_run_s": round(time.perf_counter() - t_all, 1),
        "versions": [{"version": v.version, "stage": v.stage, "released": v.released, "accept_rate": v.accept_rate,
                      "ci": v.ci, "offline_pass_at_1": v.offline_pass_at_1, "ope_estimate": v.ope_estimate,
                      "n_feedback": v.n_feedback, "per_kind": v.per_kind} for v in data.versions],
        "online": online_summary(data),
    }
    log(f"report: {index}")
    return summary
