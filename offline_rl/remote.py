"""Rollout workers on other machines: weights through the registry, batches over a transport.

The trainer (``grpo.mode = "remote"``, :class:`RemoteRollouts`) publishes every weight version it
trains to the registry (``registry.url``: a shared directory or any fsspec URL) and points the
``rollout.channel`` channel at it; deltas between consecutive versions are small. A worker
(``rtrl rollout-worker``, :func:`run_rollout_worker`) follows that channel, materialises each new
version it sees, samples and scores a batch in its own sandbox, and sends it stamped with the
registry version id it sampled with. The trainer maps that id back to its own version counter, so
``grpo.max_staleness`` and the truncated importance weight apply exactly as for local workers; a
batch stamped with an id this trainer never published (another run, a version lost with a killed
trainer, a forgery) is refused and logged, never trained on.

Transports (``rollout.transport``):

* ``dir``: a shared directory (``rollout.dir``; NFS, SMB, a mounted bucket). A worker writes each batch
  to a hidden temporary file and renames it into place, so the trainer never reads half a batch; the
  trainer reads batches oldest first and deletes them.
* ``bus``: the event bus (``bus.backend``: Kafka, or the embedded log for workers on this machine),
  topic ``rollout.topic``, keyed by worker. The trainer reads from the end of the topic as it was when
  it started: older batches belong to an earlier run.

Wire format: zstd-compressed JSON of the ``RolloutBatch`` dataclass (trajectories and their tasks
included), converted field by field by pydantic from the dataclasses' own type hints, inside an
envelope with the format number, the version id and the worker id. No pickle: a batch from another
machine is data, never code.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import zstandard
from pydantic import TypeAdapter, ValidationError

from offline_rl.judge import make_judge
from offline_rl.rewards import RewardFunction
from offline_rl.rollout import TorchBackend, VLLMBackend, make_env, run_episodes
from offline_rl.sandbox import SandboxPool
from offline_rl.splits import load_split
from offline_rl.workers import RolloutBatch, sample_tasks
from policy.loading import load_policy, load_tokenizer
from policy.registry import Registry
from realtime_rl.bus import open_consumer, open_producer

WIRE_FORMAT = 1
BATCH_SUFFIX = ".rtb"
_BATCH = TypeAdapter(RolloutBatch)


class BadBatch(ValueError):
    """A received batch that cannot be used: undecodable, of another format, or of an unknown version."""


def encode_batch(batch: RolloutBatch, version_id: str, worker_id: str) -> bytes:
    """The bytes a worker sends: the envelope around the batch, compressed."""
    body = {"format": WIRE_FORMAT, "version_id": version_id, "worker_id": worker_id,
            "batch": _BATCH.dump_python(batch, mode="json")}
    return zstandard.ZstdCompressor(level=3).compress(json.dumps(body, separators=(",", ":")).encode())


def decode_batch(payload: bytes, max_bytes: int) -> tuple[str, str, RolloutBatch]:
    """``(version_id, worker_id, batch)``; :class:`BadBatch` for anything else."""
    try:
        declared = zstandard.frame_content_size(payload)  # -1: not in the header, then max_output_size bounds it
        if declared > max_bytes:
            raise BadBatch(f"rollout batch of {declared} bytes is larger than rollout.max_batch_bytes={max_bytes}")
        raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=max_bytes)
        body = json.loads(raw)
        if not isinstance(body, dict) or body.get("format") != WIRE_FORMAT:
            raise BadBatch(f"not a rollout batch of format {WIRE_FORMAT}")
        return str(body["version_id"]), str(body["worker_id"]), _BATCH.validate_python(body["batch"])
    except (zstandard.ZstdError, ValueError, KeyError, TypeError, ValidationError) as err:
        if isinstance(err, BadBatch):
            raise
        if isinstance(err, ValidationError):
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise BadBatch(f"invalid rollout batch: {where}: {first['msg'][:200]}") from None
        raise BadBatch(f"undecodable rollout batch ({type(err).__name__}: {str(err).splitlines()[0][:200]})") from None


# -- transports -------------------------------------------------------------------------------------


class Transport(Protocol):
    def send(self, payload: bytes, key: str) -> None: ...

    def receive(self, timeout_s: float) -> list[bytes]: ...

    def close(self) -> None: ...


class DirTransport:
    """Batches as files in a shared directory: written aside then renamed in, read oldest first, deleted."""

    def __init__(self, path: str | Path, poll_interval_s: float = 0.2) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.poll_interval_s = poll_interval_s
        self._seq = 0

    def send(self, payload: bytes, key: str) -> None:
        self._seq += 1
        name = f"{time.time_ns():020d}-{key}-{self._seq:06d}{BATCH_SUFFIX}"
        tmp = self.path / f".{name}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / name)

    def pending(self) -> int:
        return sum(1 for _ in self.path.glob(f"*{BATCH_SUFFIX}"))

    def receive(self, timeout_s: float) -> list[bytes]:
        deadline = time.monotonic() + timeout_s
        while True:
            names = sorted(p for p in self.path.glob(f"*{BATCH_SUFFIX}") if not p.name.startswith("."))
            if names:
                out = []
                for p in names:
                    out.append(p.read_bytes())
                    p.unlink()
                return out
            if time.monotonic() >= deadline:
                return []
            time.sleep(min(self.poll_interval_s, max(0.0, deadline - time.monotonic())))

    def close(self) -> None:
        pass


class BusTransport:
    """Batches as messages on ``topic`` of the configured bus (Kafka, or the embedded log on one machine)."""

    def __init__(self, bus_settings, topic: str, *, receiver: bool) -> None:
        self.topic = topic
        self._producer = None if receiver else open_producer(bus_settings)
        self._consumer = None
        if receiver:
            self._consumer = open_consumer(bus_settings, f"rtrl-rollouts-{uuid.uuid4().hex[:8]}")
            self._consumer.partitions(topic)  # creates the topic if it is missing
            self._consumer.assign({(topic, p): end for p, end in self._consumer.end_offsets(topic).items()})

    def send(self, payload: bytes, key: str) -> None:
        assert self._producer is not None, "a receiving transport does not send"
        self._producer.send(self.topic, payload, key=key.encode())
        self._producer.flush()

    def receive(self, timeout_s: float) -> list[bytes]:
        assert self._consumer is not None, "a sending transport does not receive"
        return [r.value for r in self._consumer.poll(timeout_s=timeout_s, max_records=64)]

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close()
        if self._consumer is not None:
            self._consumer.close()


def open_transport(settings, *, receiver: bool) -> Transport:
    r = settings.rollout
    if r.transport == "bus":
        return BusTransport(settings.bus, r.topic, receiver=receiver)
    return DirTransport(r.dir, r.poll_interval_s)


def rollout_registry(settings):
    """The registry, with ``rollout.channel`` among the channels it accepts."""

    channels = list(dict.fromkeys([*settings.registry.channels, settings.rollout.channel]))
    return Registry.from_settings(settings.registry, channels=channels)


# -- the trainer's side ------------------------------------------------------------------------------


class RemoteRollouts:
    """What the GRPO trainer reads in ``remote`` mode; the same interface as ``AsyncRollouts``.

    ``known`` maps registry version ids to trainer versions; it is the trainer's checkpointed record of
    what it published (a resumed trainer still accepts batches for the versions before its checkpoint)
    and is updated in place."""

    def __init__(self, settings, model_dir: str | Path, version: int, known: dict[str, int],
                 log: Callable[[str], None] = lambda _m: None) -> None:
        self.settings = settings
        self.cfg = settings.rollout
        self.known = known
        self.log = log
        self.refused = 0
        self.received_at = 0.0
        self.registry = rollout_registry(settings)
        self.transport = open_transport(settings, receiver=True)
        self._pending: deque[RolloutBatch] = deque()
        self._names: list[str] | None = None
        self._current: str | None = None
        self._publish(str(model_dir), version)

    def _publish(self, source, version: int) -> str:
        info = self.registry.publish(source, parent=self._current, stage="rollout",
                                     run=Path(self.settings.grpo.out_dir).name, metrics={"grpo_version": version})
        if self._names is None:
            self._names = [t.name for t in self.registry.manifest(info.id).tensors]
        self.registry.promote(info.id, self.cfg.channel, note=f"grpo version {version}")
        self.known[info.id] = version
        self._current = info.id
        return info.id

    def publish(self, model_or_state, version: int) -> None:
        """Publish the weights as ``version`` and point the rollout channel at them."""
        state = model_or_state if isinstance(model_or_state, Mapping) else model_or_state.state_dict()
        names = set(self._names or state)
        # Only the tensors the first version had: a tied head appears in state_dict() under two names.
        self._publish({k: v.detach() for k, v in state.items() if k in names}, version)

    def get(self, timeout: float = 600.0) -> RolloutBatch:
        deadline = time.monotonic() + timeout
        while not self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no rollout batch arrived in time (are the rollout workers running?)")
            for payload in self.transport.receive(min(left, 1.0)):
                self._admit(payload)
        self.received_at = time.monotonic()
        return self._pending.popleft()

    def _admit(self, payload: bytes) -> None:
        try:
            version_id, worker_id, batch = decode_batch(payload, self.cfg.max_batch_bytes)
            if version_id not in self.known:
                raise BadBatch(f"batch from worker {worker_id!r} for version {version_id}, which this trainer "
                               "never published")
        except BadBatch as err:
            self.refused += 1
            self.log(f"grpo: refused a rollout batch: {err}")
            return
        batch.version = self.known[version_id]
        batch.info.update(worker_id=worker_id, version_id=version_id)
        self._pending.append(batch)

    def close(self) -> None:
        self.transport.close()


# -- the worker's side ------------------------------------------------------------------------------


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def run_rollout_worker(settings, *, worker_id: str | None = None, max_batches: int | None = None,
                       stop: threading.Event | None = None, log: Callable[[str], None] = lambda _m: None) -> dict:
    """Sample, score and send batches until ``stop`` is set or ``max_batches`` were sent; returns counts.

    Follows ``rollout.channel``; sends at most ``rollout.batches_per_version`` batches for one version,
    then waits up to ``rollout.version_wait_s`` for a newer one before sampling on the same weights
    again (a trainer that dropped a batch as stale publishes nothing until it gets another)."""

    stop = stop or threading.Event()
    worker_id = worker_id or default_worker_id()
    cfg = settings.grpo
    torch.set_num_threads(settings.model.threads)
    registry = rollout_registry(settings)
    transport = open_transport(settings, receiver=False)
    split = load_split(settings.tasks, settings.env)
    sandbox = SandboxPool(settings.sandbox)
    env = make_env(settings.env, sandbox)
    reward_fn = RewardFunction(sandbox, settings.rewards, make_judge(settings.judge))
    rng = random.Random(f"{cfg.seed}-{worker_id}")
    follower = _VersionFollower(registry, settings, worker_id)
    stats = {"worker_id": worker_id, "batches": 0, "tokens": 0, "sample_s": 0.0, "versions": 0, "cpu_s": 0.0}
    try:
        while not stop.is_set() and (max_batches is None or stats["batches"] < max_batches):
            if not follower.ready(stop, log):
                continue
            t0, c0, sandbox_cpu_s = time.perf_counter(), time.process_time(), reward_fn.sandbox_cpu_s
            tasks = sample_tasks(split.train, cfg.prompts_per_step, rng)
            trajs = run_episodes(follower.backend, follower.tokenizer, env, tasks, cfg.group_size, cfg.temperature,
                                 cfg.max_new_tokens, seed=rng.randrange(1 << 30), reward_fn=reward_fn)
            gen_s = time.perf_counter() - t0
            batch = RolloutBatch(version=follower.version, trajectories=trajs, gen_s=gen_s,
                                 tokens=sum(t.n_policy_tokens for t in trajs),
                                 info={"sandbox_cpu_s": reward_fn.sandbox_cpu_s - sandbox_cpu_s})
            transport.send(encode_batch(batch, follower.version_id, worker_id), worker_id)
            follower.sent += 1
            stats["batches"] += 1
            stats["tokens"] += batch.tokens
            stats["sample_s"] += gen_s
            # This process's CPU and its sandbox children's: what a batch costs the machine.
            stats["cpu_s"] += time.process_time() - c0 + reward_fn.sandbox_cpu_s - sandbox_cpu_s
        stats["versions"] = follower.loaded
    finally:
        transport.close()
        sandbox.close()
    stats["tokens_per_s"] = stats["tokens"] / stats["sample_s"] if stats["sample_s"] else 0.0
    return stats


class _VersionFollower:
    """A worker's weights: the version ``rollout.channel`` points at, loaded in place when it moves."""

    def __init__(self, registry, settings, worker_id: str) -> None:
        self.registry, self.settings, self.worker_id = registry, settings, worker_id
        self.cfg = settings.rollout
        self.backend: Any = None
        self.tokenizer: Any = None
        self.version_id: str | None = None
        self.version = -1
        self.sent = 0
        self.loaded = 0
        self._since = time.monotonic()

    def ready(self, stop: threading.Event, log: Callable[[str], None]) -> bool:
        """True when a batch may be sampled now; otherwise waits one poll interval and returns False."""
        current = self.registry.channel(self.cfg.channel)
        if current is not None and current != self.version_id:
            self._load(current, log)
            return True
        limit = self.cfg.batches_per_version
        waited = time.monotonic() - self._since
        if current is not None and (not limit or self.sent < limit or waited >= self.cfg.version_wait_s):
            return True
        stop.wait(self.cfg.poll_interval_s)
        return False

    def _load(self, version_id: str, log: Callable[[str], None]) -> None:
        info = self.registry.info(version_id)
        version = int(info.metrics.get("grpo_version", -1))
        if self.backend is None:
            path = self.registry.materialize(version_id)
            if self.settings.grpo.rollout_engine == "vllm":
                self.tokenizer = load_tokenizer(path)
                self.backend = VLLMBackend(str(path), self.tokenizer, seed=self.settings.grpo.seed, version=version)
            else:
                policy = load_policy(path, "float32", self.settings.model.device)
                self.tokenizer = policy.tokenizer
                self.backend = TorchBackend(policy.model, self.tokenizer, version=version)
        else:
            self.backend.load_weights(self.registry.load_state_dict(version_id), version)
        self.version_id, self.version = version_id, version
        self.sent, self._since = 0, time.monotonic()
        self.loaded += 1
        log(f"rollout-worker {self.worker_id}: sampling with {version_id} (trainer version {version})")
