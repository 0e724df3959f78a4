"""`rtrl bench chaos`: the whole online loop under load and scheduled faults, then a reconciliation.

One bounded, loopback-only run per stack: the embedded defaults (embedded bus, SQLite) and Kafka +
PostgreSQL (a Tansu broker whose log is kept in an S3 store on loopback, and a PostgreSQL instance
the run initialises and starts itself under a temporary directory). Each stack runs, as separate
processes: the gateway (``rtrl serve``, its event spill directory on a small tmpfs of its own mount
namespace), the ingester (``rtrl ingest``) and the updater (``rtrl update``); the
simulated users (``realtime_rl.simusers``) call the gateway through the official ``openai`` client
and post their judgements to ``/v1/feedback``.

Faults, on a schedule (``--quick``: the embedded stack only, two ingester kills, the bus outage with
the full spill disk, one malformed burst and the forged tokens): kill -9 of the ingester (restarted
at once; >= 10 times in the full run); a restart of the bus (Kafka: the broker killed and started
again; embedded: its log held locked, so producers time out); a restart of the PostgreSQL instance
(immediate mode: no shutdown checkpoint); kill -9 of the updater while its candidate is being written
into the registry (seen by its staging directory); kill -9 of the gateway's engine process under
load; the spill tmpfs filled up while the bus is down; malformed events written straight onto the
bus, and forged, tampered, foreign and replayed feedback tokens sent to the gateway.

Reconciliation: every completion the gateway served (a 200 with a completion id) and every feedback
it accepted (a 200 with an event id) is in the tables exactly once (``lost``, ``duplicates``); no
registry version fails verification (``half_published_versions``); every malformed event is a dead
letter and none is a row; no forged token was accepted. ``recovery_s_max`` is the longest time from
the end of a fault (a kill, the bus or the database back) to the part working again.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
from openai import OpenAI

from offline_rl.corpus import build_default_model
from offline_rl.tasks import generate_tasks
from policy.registry import Registry
from realtime_rl import tables
from realtime_rl.bus import BusUnavailable, open_producer
from realtime_rl.database import make_engine
from realtime_rl.release import RegistryStore
from realtime_rl.simusers import make_population, register_keys
from rtrl import devservices
from rtrl.config import load_settings
from serving.auth import issue_key

STACKS = ("embedded", "kafka_postgres")
SPILL_TMPFS_BYTES = 4 << 20
MALFORMED_PREFIX = "chaos-bad-"


@dataclass
class Plan:
    """How long and how hard one stack is shaken."""

    duration_s: float
    ingester_kills: int
    bus_outage_s: float
    spill_full_s: float
    malformed_bursts: int
    engine_kill: bool
    updater_kill: bool
    complete_update: bool
    concurrency: int = 4


FULL = Plan(duration_s=120, ingester_kills=12, bus_outage_s=5, spill_full_s=2.5, malformed_bursts=3,
            engine_kill=True, updater_kill=True, complete_update=True)
QUICK = Plan(duration_s=12, ingester_kills=2, bus_outage_s=3, spill_full_s=1.5, malformed_bursts=1,
             engine_kill=False, updater_kill=False, complete_update=False, concurrency=3)
"""The test suite's form: the engine and updater kills are left to their own tests (each needs a model
process started anew, tens of seconds on a small machine)."""


@dataclass
class Ledger:
    """What the clients saw, and when (``time.monotonic()``)."""

    requests: list[tuple[float, float, bool, str]] = field(default_factory=list)  # start, end, ok, error
    served: set[str] = field(default_factory=set)
    feedback_accepted: set[str] = field(default_factory=set)
    feedback_failed: int = 0
    tokens: list[tuple[str, str, str]] = field(default_factory=list)  # (user key, completion id, token) spent
    forged_sent: dict[str, int] = field(default_factory=dict)
    forged_accepted: int = 0
    malformed_keys: set[str] = field(default_factory=set)
    engine_windows: list[tuple[float, float]] = field(default_factory=list)
    faults: dict[str, int] = field(default_factory=dict)
    recovery_s: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fault(self, name: str, recovery_s: float | None = None) -> None:
        with self.lock:
            self.faults[name] = self.faults.get(name, 0) + 1
            if recovery_s is not None:
                self.recovery_s[name] = max(self.recovery_s.get(name, 0.0), round(recovery_s, 2))


def run(settings, quick: bool = False, log: Callable[[str], None] = print,
        model_dir: Path | None = None) -> dict[str, Any]:
    """Both stacks (``--quick``: the embedded one, fewer faults); the top level sums them. ``model_dir``:
    a model to serve instead of a freshly built tiny one."""
    stacks = {name: run_stack(settings, name, QUICK if quick else FULL, log, model_dir)
              for name in (STACKS[:1] if quick else STACKS)}
    out: dict[str, Any] = {}
    for key in ("requests", "failed_requests", "failed_outside_engine_kills", "completions_served",
                "completions_in_db", "feedback_accepted", "feedback_in_db", "duplicates", "lost",
                "half_published_versions", "malformed_sent", "malformed_dead_lettered", "malformed_in_tables",
                "forged_sent", "forged_accepted"):
        out[key] = sum(s[key] for s in stacks.values())
    faults: dict[str, int] = {}
    for s in stacks.values():
        for name, n in s["faults_injected"].items():
            faults[name] = faults.get(name, 0) + n
    out["faults_injected"] = faults
    out["recovery_s_max"] = max(s["recovery_s_max"] for s in stacks.values())
    out["goal_met"] = all(s["goal_met"] for s in stacks.values())
    out["stacks"] = stacks
    return out


# -- the stack's services and processes -------------------------------------------------------------

class Stack:
    """One stack's services, settings (as ``RTRL_*`` variables for the child processes) and processes."""

    def __init__(self, settings, kind: str, root: Path, log) -> None:
        self.kind, self.root, self.log = kind, root, log
        self.s3 = self.broker = self.pg = None
        (root / "none.toml").write_text("# every setting of this run comes from RTRL_* variables\n")
        env = {"RTRL_VAR_DIR": str(root / "var"), "RTRL_CONFIG": str(root / "none.toml"),
               "RTRL_MODEL__THREADS": "1", "RTRL_SERVING__SOURCE": "registry", "RTRL_SERVING__POLL_INTERVAL_S": "1",
               "RTRL_SERVING__RATE_LIMIT_RPS": "1000", "RTRL_SERVING__RATE_LIMIT_BURST": "2000",
               "RTRL_SERVING__BUS_RETRY_S": "0.5", "RTRL_SERVING__REQUEST_TIMEOUT_S": "30",
               "RTRL_SERVING__FEEDBACK_SECRET": os.urandom(16).hex(), "RTRL_SERVING__SPILL_FSYNC": "false",
               "RTRL_BUS__SEND_TIMEOUT_S": "2", "RTRL_BUS__PARTITIONS": "2",
               "RTRL_INGEST__RETRY_BACKOFF_S": "0.3", "RTRL_INGEST__POLL_TIMEOUT_S": "0.2",
               "RTRL_SCHEDULE__MIN_FEEDBACK": "1", "RTRL_EVAL__SAMPLES": "1", "RTRL_EVAL__K": "[1]",
               "RTRL_SIMUSERS__EDIT_PROBABILITY": "0.3", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.gateway: subprocess.Popen | None = None
        self.ingester: subprocess.Popen | None = None
        if kind == "kafka_postgres":
            try:
                self.pg = devservices.start_postgres_instance(root / "pg")
                self.s3 = devservices.start_object_store(root / "s3")
                self.broker = devservices.start_tansu_broker(s3=self.s3)
            except BaseException:
                self.close()  # whatever did start
                raise
            # A producer gives up on the broker after 3 s (not 15), so that the gateway spills during the
            # broker's restart and the full spill disk is met on this stack too.
            env.update({"RTRL_DB__URL": self.pg.url, "RTRL_BUS__BACKEND": "kafka",
                        "RTRL_BUS__BOOTSTRAP_SERVERS": self.broker.bootstrap,
                        "RTRL_BUS__DELIVERY_TIMEOUT_MS": "3000", "RTRL_BUS__REQUEST_TIMEOUT_MS": "2000"})
        self.env = {**os.environ, **env}
        self.env.pop("RTRL_CONFIG_FILE", None)
        with _environ(env):
            self.settings = load_settings()
        self.port = devservices.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.spill = Path(self.settings.serving.spill_dir)

    def spawn(self, *args: str, name: str, prefix: list[str] | None = None) -> subprocess.Popen:
        out = (self.root / f"{name}.log").open("ab")
        return subprocess.Popen([*(prefix or []), sys.executable, *args], env=self.env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def start_gateway(self) -> None:
        """``rtrl serve`` in a mount namespace of its own with ``serving.spill_dir`` on a small tmpfs."""
        self.spill.mkdir(parents=True, exist_ok=True)
        ns = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-r", "-m"]
        script = f'mount -t tmpfs -o size={SPILL_TMPFS_BYTES} rtrl-spill "$0" && exec "$@"'
        self.gateway = self.spawn("-m", "rtrl", "serve", "--port", str(self.port), name="gateway",
                                  prefix=[*ns, "sh", "-c", script, str(self.spill)])
        self.wait_ready(180)

    def wait_ready(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.gateway is not None and self.gateway.poll() is not None:
                raise RuntimeError(f"the gateway exited ({self.gateway.returncode}); see {self.root / 'gateway.log'}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            time.sleep(0.05)
        raise RuntimeError(f"the gateway was not ready within {timeout_s} s")

    def readyz(self) -> dict:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            return httpx.get(self.url + "/readyz", timeout=5).json()
        return {}

    def spill_view(self) -> Path:
        """The gateway's spill tmpfs, seen from outside its mount namespace."""
        assert self.gateway is not None
        return Path(f"/proc/{self.gateway.pid}/root") / str(self.spill).lstrip("/")

    def engine_pid(self) -> int:
        """The gateway's engine process: its child started by multiprocessing (not the resource tracker)."""
        assert self.gateway is not None
        for pid in _children(self.gateway.pid):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"multiprocessing" in cmd and b"resource_tracker" not in cmd:
                return pid
        raise RuntimeError("no engine process under the gateway")

    def start_ingester(self) -> None:
        self.ingester = self.spawn("-m", "rtrl", "ingest", name="ingester")

    def close(self) -> None:
        for proc in (self.gateway, self.ingester):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (self.gateway, self.ingester):
            if proc is not None:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        for service in (self.broker, self.s3):
            if service is not None:
                service.stop()
        if self.pg is not None:
            with contextlib.suppress(Exception):
                self.pg.stop()


def _children(pid: int) -> list[int]:
    """Child processes of ``pid`` (Linux: ``/proc/PID/task/*/children``)."""
    out: list[int] = []
    with contextlib.suppress(FileNotFoundError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):
                out += [int(c) for c in (task / "children").read_text().split()]
    return out


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _prepare_model(stack: Stack, model_dir: Path | None) -> list:
    """The model (``model_dir``, else a new tiny one), published and promoted in the stack's registry;
    simulated users with keys."""

    s = stack.settings
    if model_dir is None:
        model_dir = build_default_model(stack.root / "model", s.tiny.model_copy(update={"corpus_examples": 2000}))
    store = RegistryStore(s)
    version = store.publish(model_dir, parent=None, metrics={})
    store.promote(version, "production")
    users = make_population(6, 7, 0.3, 0.9)
    register_keys(users, partial(issue_key, s))
    return users


# -- traffic -------------------------------------------------------------------------------------

def _traffic(stack: Stack, users, ledger: Ledger, stop: threading.Event, threads: int) -> list[threading.Thread]:
    s = stack.settings
    tasks = generate_tasks(s.tasks.seed, s.tasks.heldout_fraction).train

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        clients = {u.name: OpenAI(api_key=u.api_key, base_url=stack.url + "/v1", timeout=30, max_retries=0)
                   for u in users}
        http = httpx.Client(base_url=stack.url, timeout=30)
        try:
            while not stop.is_set():
                user, task = rng.choice(users), rng.choice(tasks)
                t0 = time.monotonic()
                try:
                    resp = clients[user.name].completions.create(
                        model=s.model.name, prompt=task.prompt, max_tokens=12, temperature=1.0, stop=["\n"],
                        extra_body={"metadata": {"task_bucket": task.bucket}})
                except Exception as err:  # noqa: BLE001 - every failure is counted and classified
                    with ledger.lock:
                        ledger.requests.append((t0, time.monotonic(), False, f"{type(err).__name__}: {err}"[:200]))
                    response = getattr(err, "response", None)
                    retry = response.headers.get("retry-after") if response is not None else None
                    time.sleep(min(2.0, float(retry)) if retry and retry.isdigit() else 0.2)  # as a client would
                    continue
                choice = resp.choices[0]
                extra = choice.model_extra or {}
                with ledger.lock:
                    ledger.requests.append((t0, time.monotonic(), True, ""))
                    ledger.served.add(extra["completion_id"])
                signal_, kept = user.judge(task, choice.text or "", rng, 0.3)
                body = {"completion_id": extra["completion_id"], "feedback_token": extra["feedback_token"],
                        "signal": signal_, **({"kept_text": kept} if kept is not None else {})}
                fb = http.post("/v1/feedback", json=body, headers={"Authorization": f"Bearer {user.api_key}"})
                with ledger.lock:
                    if fb.status_code == 200:
                        ledger.feedback_accepted.add(fb.json()["event_id"])
                        ledger.tokens.append((user.api_key, extra["completion_id"], extra["feedback_token"]))
                    else:
                        ledger.feedback_failed += 1
                        ledger.notes.append(f"feedback {fb.status_code}: {fb.text[:120]}")
        finally:
            http.close()
            for c in clients.values():
                c.close()

    out = [threading.Thread(target=worker, args=(i,), name=f"chaos-user-{i}", daemon=True) for i in range(threads)]
    out.append(threading.Thread(target=_forger, args=(stack, users, ledger, stop), name="chaos-forger", daemon=True))
    for t in out:
        t.start()
    return out


def _forger(stack: Stack, users, ledger: Ledger, stop: threading.Event) -> None:
    """Feedback that must be refused: made-up, tampered, another caller's, and replayed tokens."""

    rng = random.Random(11)
    http = httpx.Client(base_url=stack.url, timeout=30)
    try:
        while not stop.wait(0.25):
            with ledger.lock:
                spent = list(ledger.tokens[-50:])
            if not spent:
                continue
            key, cid, token = rng.choice(spent)
            other = next(u.api_key for u in users if u.api_key != key)
            kind = rng.choice(["forged", "tampered", "foreign", "replayed"])
            if kind == "forged":
                key, token = rng.choice(users).api_key, os.urandom(24).hex()
            elif kind == "tampered":
                token = token[:-3] + ("AAA" if token[-3:] != "AAA" else "BBB")
            elif kind == "foreign":
                key = other
            r = http.post("/v1/feedback", json={"completion_id": cid, "feedback_token": token, "signal": "accept"},
                          headers={"Authorization": f"Bearer {key}"})
            with ledger.lock:
                ledger.forged_sent[kind] = ledger.forged_sent.get(kind, 0) + 1
                ledger.forged_accepted += r.status_code == 200
    finally:
        http.close()


def _malformed(i: int) -> list[tuple[str, bytes]]:
    """Events the ingester must dead-letter (keyed ``chaos-bad-...``): the two of the issue and others."""
    good = {"type": "completion", "caller": "chaos", "model": "m", "version": "v", "prompt": "p", "completion": "c",
            "prompt_token_ids": [1, 2], "completion_token_ids": [5, 6, 7], "logprobs": [-0.5, -0.5, -0.5]}
    variants = {
        "negative-id": {"completion_token_ids": [-5, 6, 7]},
        "huge-id": {"completion_token_ids": [10**30, 1, 2]},
        "prompt-id-over-int32": {"prompt_token_ids": [2**31, 1]},
        "positive-logprob": {"logprobs": [-0.5, 0.7, -0.5]},
        "misaligned-logprobs": {"logprobs": [-0.5]},
        "sampling-logprob": {"sampling_logprobs": [-0.5, 3.0, -0.5]},
    }
    out = []
    for name, fields in variants.items():
        cid = f"{MALFORMED_PREFIX}{i}-{name}"
        out.append((cid, json.dumps({**good, **fields, "completion_id": cid, "event_id": cid}).encode()))
    cid = f"{MALFORMED_PREFIX}{i}-edit-without-text"
    out.append((cid, json.dumps({"type": "feedback", "completion_id": cid, "event_id": cid, "caller": "chaos",
                                 "version": "v", "signal": "edit"}).encode()))
    out.append((f"{MALFORMED_PREFIX}{i}-not-json", b"\xff{not json"))
    return out


def _send_malformed(stack: Stack, ledger: Ledger, burst: int) -> None:
    """Straight onto the bus; resent until flushed (a resend is the same key: counted once)."""

    items = _malformed(burst)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with open_producer(stack.settings.bus) as producer:
                for key, value in items:
                    producer.send(stack.settings.bus.events_topic, value, key=key.encode())
                producer.flush()
            break
        except BusUnavailable:
            time.sleep(0.5)
    else:
        ledger.notes.append(f"malformed burst {burst} not sent: the bus stayed down")
        return
    with ledger.lock:
        ledger.malformed_keys.update(k for k, _ in items)
    ledger.fault("malformed_events", None)


# -- faults --------------------------------------------------------------------------------------

def _last_commit(stack: Stack):
    """The newest commit time of the ingester (its offsets move in every transaction), UTC; None if the
    database cannot be read right now."""

    engine = make_engine(stack.settings.db)
    try:
        with engine.connect() as conn:
            ts = conn.execute(sa.select(sa.func.max(tables.consumer_offsets.c.updated_at))).scalar()
    except sa.exc.SQLAlchemyError:
        return None
    finally:
        engine.dispose()
    if isinstance(ts, str):
        ts = datetime.fromisoformat(ts)
    return None if ts is None else (ts if ts.tzinfo else ts.replace(tzinfo=UTC))


def _wait_commit(stack: Stack, after, t0: float, timeout_s: float = 90.0) -> float | None:
    """Seconds from ``t0`` until the ingester committed a transaction after ``after`` (wall clock)."""
    while time.monotonic() - t0 < timeout_s:
        last = _last_commit(stack)
        if last is not None and last > after:
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


def _now():
    return datetime.now(UTC)


def _kill_ingester(stack: Stack, ledger: Ledger) -> None:
    assert stack.ingester is not None
    wall, t0 = _now(), time.monotonic()
    stack.ingester.kill()
    stack.ingester.wait(30)
    stack.start_ingester()
    ledger.fault("ingester_kill9", _wait_commit(stack, wall, t0))


def _kill_engine(stack: Stack, ledger: Ledger) -> None:
    pid = stack.engine_pid()
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    deadline = t0 + 10
    while stack.readyz().get("status") == "ready" and time.monotonic() < deadline:
        time.sleep(0.01)  # until the gateway has noticed
    stack.wait_ready(180)
    recovered = time.monotonic()
    with ledger.lock:
        ledger.engine_windows.append((t0, recovered))
    ledger.fault("engine_kill9", recovered - t0)


def _fill(path: Path) -> None:
    """Write zeros into ``path`` until the file system says it is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    block = b"\0" * 65536
    try:
        while True:
            os.write(fd, block)
    except OSError:  # ENOSPC: the tmpfs is full
        pass
    finally:
        os.close(fd)


def _bus_outage(stack: Stack, ledger: Ledger, plan: Plan) -> None:
    """The bus goes away for ``plan.bus_outage_s``; meanwhile the spill tmpfs is full for ``spill_full_s``."""

    held = None
    if stack.broker is not None:
        stack.broker.kill()
    else:  # the embedded log, write-locked: producers time out as they would on a dead broker
        held = sqlite3.connect(stack.settings.bus.embedded_path, timeout=30, isolation_level=None)
        held.execute("BEGIN EXCLUSIVE")
    time.sleep(1.0)
    filler = stack.spill_view() / "filler"
    _fill(filler)
    ledger.fault("spill_disk_full")
    time.sleep(plan.spill_full_s)
    filler.unlink()
    time.sleep(max(0.0, plan.bus_outage_s - 1.0 - plan.spill_full_s))
    wall, t0 = _now(), time.monotonic()
    if held is not None:
        held.rollback()
        held.close()
    else:
        assert stack.broker is not None
        stack.broker.start()
    while not stack.readyz().get("bus_up") and time.monotonic() - t0 < 90:
        time.sleep(0.05)
    gateway_s = time.monotonic() - t0
    ingest_s = _wait_commit(stack, wall, t0)
    ledger.fault("bus_restart" if stack.broker is not None else "bus_outage",
                 None if ingest_s is None else max(gateway_s, ingest_s))


def _restart_postgres(stack: Stack, ledger: Ledger) -> None:
    assert stack.pg is not None
    stack.pg.stop("immediate")
    time.sleep(1.0)
    stack.pg.start()
    wall, t0 = _now(), time.monotonic()
    ledger.fault("postgres_restart", _wait_commit(stack, wall, t0))


def _updater(stack: Stack, ledger: Ledger, plan: Plan) -> None:
    """``rtrl update`` killed (-9) while its candidate's files are being written into the registry (its
    staging directory exists), up to four tries; then, in the full run, one cycle to its end."""
    staging = Path(stack.settings.registry.url) / "staging"
    for attempt in range(4):
        proc = stack.spawn("-m", "rtrl", "update", "--force", "--json", name="updater")
        hit = False
        while proc.poll() is None:
            with contextlib.suppress(FileNotFoundError):
                if any(f".{proc.pid}." in name for name in os.listdir(staging)):
                    os.kill(proc.pid, signal.SIGKILL)
                    hit = True
                    break
            time.sleep(0.002)
        proc.wait(60)
        if hit:
            ledger.fault("updater_kill9_mid_publish")
            break
        ledger.notes.append(f"updater try {attempt}: ended (status {proc.returncode}) before the kill point")
        time.sleep(2)
    if plan.complete_update:
        proc = stack.spawn("-m", "rtrl", "update", "--force", "--json", name="updater")
        ledger.notes.append(f"update cycle after the kill: exit status {proc.wait(600)}")


def _faults(stack: Stack, ledger: Ledger, plan: Plan, t_start: float) -> None:
    d = plan.duration_s
    events: list[tuple[float, Callable[[], None]]] = [
        (d * (i + 0.5) / plan.ingester_kills, lambda: _kill_ingester(stack, ledger))
        for i in range(plan.ingester_kills)]
    events.append((0.2 * d, lambda: _bus_outage(stack, ledger, plan)))
    if plan.engine_kill:
        events.append((0.62 * d, lambda: _kill_engine(stack, ledger)))
    if stack.pg is not None:
        events.append((0.45 * d, lambda: _restart_postgres(stack, ledger)))
    events += [(d * (0.08 + 0.35 * i), lambda i=i: _send_malformed(stack, ledger, i))
               for i in range(plan.malformed_bursts)]
    for at, action in sorted(events, key=lambda e: e[0]):
        time.sleep(max(0.0, t_start + at - time.monotonic()))
        action()


# -- one stack -------------------------------------------------------------------------------------

def run_stack(settings, kind: str, plan: Plan, log: Callable[[str], None] = print,
              model_dir: Path | None = None) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"rtrl-chaos-{kind}-"))
    os.chmod(root, 0o755)  # the PostgreSQL instance runs as its own user
    ledger = Ledger()
    keep = True
    log(f"chaos [{kind}]: services in {root}")
    stack = Stack(settings, kind, root, log)
    try:
        users = _prepare_model(stack, model_dir)
        stack.start_gateway()
        stack.start_ingester()
        log(f"chaos [{kind}]: gateway on {stack.url}; {plan.duration_s:.0f} s of traffic and faults")
        stop = threading.Event()
        t_start = time.monotonic()
        traffic = _traffic(stack, users, ledger, stop, plan.concurrency)
        updater = threading.Timer(0.3 * plan.duration_s, _updater, args=(stack, ledger, plan))
        if plan.updater_kill:
            updater.start()
        _faults(stack, ledger, plan, t_start)
        time.sleep(max(0.0, t_start + plan.duration_s - time.monotonic()))
        stop.set()
        for t in traffic:
            t.join(60)
        if plan.updater_kill:
            updater.join(900)
        log(f"chaos [{kind}]: traffic stopped after {time.monotonic() - t_start:.0f} s; reconciling")
        result = _reconcile(stack, ledger)
        result["traffic_s"] = round(plan.duration_s, 1)
        keep = not result["goal_met"]
        return result
    finally:
        stack.close()
        if keep:
            log(f"chaos [{kind}]: goal not met; logs and data kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def _settle(stack: Stack, ledger: Ledger, timeout_s: float = 180.0) -> None:
    """Until the gateway has no event left to send and the tables hold everything (or stop moving)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s and stack.readyz().get("events_pending", 1):
        time.sleep(0.2)
    last, since = None, time.monotonic()
    while time.monotonic() - t0 < timeout_s and time.monotonic() - since < 30:
        seen = _seen(stack)
        if seen is not None:
            if seen == (len(ledger.served), len(ledger.feedback_accepted), len(ledger.malformed_keys)):
                return
            if seen != last:
                last, since = seen, time.monotonic()
        time.sleep(0.5)


def _seen(stack: Stack) -> tuple[int, int, int] | None:
    engine = make_engine(stack.settings.db)
    try:
        with engine.connect() as conn:
            c = conn.execute(sa.text("SELECT count(*) FROM completions WHERE caller <> 'chaos'")).scalar()
            c += conn.execute(sa.text(f"SELECT count(DISTINCT key) FROM dead_letters WHERE reason <> 'undecodable' "
                                      f"AND raw_size > 0 AND key NOT LIKE '{MALFORMED_PREFIX}%'")).scalar()
            f = conn.execute(sa.text("SELECT count(*) FROM feedback WHERE caller <> 'chaos'")).scalar()
            d = conn.execute(sa.text("SELECT count(DISTINCT key) FROM dead_letters")).scalar()
        return c, f, d
    except sa.exc.SQLAlchemyError:
        return None
    finally:
        engine.dispose()


def _reconcile(stack: Stack, ledger: Ledger) -> dict[str, Any]:
    _settle(stack, ledger)
    metrics = httpx.get(stack.url + "/metrics", timeout=10).text
    engine = make_engine(stack.settings.db)
    try:
        with engine.connect() as conn:
            completions = [r[0] for r in conn.execute(sa.text("SELECT completion_id FROM completions"))]
            feedback = [r[0] for r in conn.execute(sa.text("SELECT event_id FROM feedback"))]
            letters = [(bytes(r[0]).decode(errors="replace"), r[1], bytes(r[2]))
                       for r in conn.execute(sa.text("SELECT key, detail, raw FROM dead_letters")) if r[0] is not None]
    finally:
        engine.dispose()
    report = Registry.from_settings(stack.settings.registry).verify()
    dead = {key for key, _, _ in letters}
    served, accepted = ledger.served, ledger.feedback_accepted
    in_db_c, in_db_f = served & set(completions), accepted & set(feedback)
    # Served completions the ingester refused (a dead letter, raw bytes kept, with its reason): accounted
    # for, not lost, but not training data either.
    refused = {key: detail for key, detail, raw in letters if key in served - in_db_c and b'"completion"' in raw}
    refused_fb = {}
    for _, detail, raw in letters:  # accepted feedback the ingester refused (e.g. kept text with a NUL)
        with contextlib.suppress(ValueError):
            event = json.loads(raw)
            if isinstance(event, dict) and event.get("event_id") in accepted - in_db_f:
                refused_fb[event["event_id"]] = detail
    failed = [(t0, t1, err) for t0, t1, ok, err in ledger.requests if not ok]
    windows = [(a - 0.5, b + 1.0) for a, b in ledger.engine_windows]
    outside = [f for f in failed if not any(f[0] <= b and f[1] >= a for a, b in windows)]
    result = {
        "stack": stack.kind,
        "requests": len(ledger.requests),
        "failed_requests": len(failed),
        "failed_outside_engine_kills": len(outside),
        "faults_injected": dict(ledger.faults),
        "completions_served": len(served),
        "completions_in_db": len(in_db_c),
        "feedback_accepted": len(accepted),
        "feedback_in_db": len(in_db_f),
        "duplicates": (len(completions) - len(set(completions))) + (len(feedback) - len(set(feedback))),
        "lost": (len(served) - len(in_db_c) - len(refused)) + (len(accepted) - len(in_db_f) - len(refused_fb)),
        "served_dead_lettered": len(refused),
        "feedback_dead_lettered": len(refused_fb),
        "served_dead_lettered_reasons": sorted(set(refused.values()) | set(refused_fb.values())),
        "unexpected_completions": len(set(completions) - served - {c for c in completions
                                                                   if c.startswith(MALFORMED_PREFIX)}),
        "half_published_versions": len(report.errors),
        "registry_versions": len(report.checked),
        "abandoned_staging": len(report.warnings),
        "malformed_sent": len(ledger.malformed_keys),
        "malformed_dead_lettered": len(ledger.malformed_keys & dead),
        "malformed_in_tables": sum(c.startswith(MALFORMED_PREFIX) for c in completions),
        "forged_sent": sum(ledger.forged_sent.values()),
        "forged_by_kind": dict(ledger.forged_sent),
        "forged_accepted": ledger.forged_accepted,
        "feedback_refused_legitimate": ledger.feedback_failed,
        "recovery_s": dict(ledger.recovery_s),
        "recovery_s_max": max(ledger.recovery_s.values(), default=0.0),
        "gateway_metrics": _metric_values(metrics, ("rtrl_engine_restarts_total", "rtrl_events_spill_errors_total",
                                                    "rtrl_events_dropped_total", "rtrl_events_replayed_total",
                                                    "rtrl_events_spilled_total")),
        "failure_samples": sorted({f[2] for f in failed})[:5],
        "lost_samples": sorted((served - in_db_c) | (accepted - in_db_f))[:10],
        "notes": ledger.notes[:10],
    }
    result["goal_met"] = bool(
        result["lost"] == 0 and result["duplicates"] == 0 and result["half_published_versions"] == 0
        and result["forged_accepted"] == 0 and result["malformed_dead_lettered"] == result["malformed_sent"]
        and result["malformed_in_tables"] == 0 and result["failed_outside_engine_kills"] == 0)
    return result


def _metric_values(text: str, names: tuple[str, ...]) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            out[name] = float(value)
    return out
