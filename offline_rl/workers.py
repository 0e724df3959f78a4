"""Rollout producers for the GRPO trainer: in-process (sync) and worker processes (async).

Async: each worker process holds its own copy of the policy (torch sampler or vLLM), its own sandbox,
and loops *sample tasks → play episodes → score → send the batch* while the trainer trains.
Batches travel over one pipe per worker, pickled and written by the worker's main thread. Weights
travel through shared memory: the trainer owns a set of shared tensors, a version counter and
a lock; after every optimizer step it copies its parameters in and bumps the version. A worker checks
the counter before each batch and, when it moved, copies the tensors out under the lock (a consistent
snapshot) and loads them in place (``load_state_dict`` / vLLM ``reload_weights``): it never stops or
restarts. Only the tensors the trainer updates are copied each step (``grpo.trainable``: with the
norm-only default 7 KB instead of 6 MB). Every batch carries the version that produced it; the trainer bounds staleness.

Admission control: a worker takes one of ``queue_size`` slots *before* it samples a batch, and the
trainer frees the slot when it takes the batch. Without it a worker finishes a batch, then waits
for the trainer holding data that ages while it waits, and the trainer drops it as
stale (with a queue of two, a sizeable share of the batches). With one slot the worker samples batch k+1
while the trainer trains on batch k, so staleness is exactly 1 and no rollout compute is wasted.

Scoring beside sampling: a batch's last completions finish together, and their sandbox verdicts
take a little longer (a small but steady share of every step), during which the worker would only
wait. When the trainer is already waiting for that batch (``trainer_waiting``), it has published
every version it can before the batch arrives, so the worker starts sampling batch k+1 at once, on
the weights it would have picked up after delivering k, and a second thread of the worker collects
batch k's verdicts and sends it. Batch k+1 takes its slot before it is sent instead of before it
is sampled, so at most ``queue_size`` batches still wait for the trainer, and none is staler than
without the overlap. When the trainer is busy the worker scores and sends as before.
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp

from offline_rl.rollout import Trajectory


@dataclass
class RolloutBatch:
    version: int
    trajectories: list[Trajectory]
    gen_s: float
    worker: int = -1
    tokens: int = 0
    info: dict = field(default_factory=dict)


@dataclass
class WorkerConfig:
    worker_id: int
    model_dir: str
    engine: str
    env_settings: dict
    sandbox_settings: dict
    reward_settings: dict
    judge_settings: dict
    prompts_per_batch: int
    group_size: int
    temperature: float
    max_new_tokens: int
    seed: int
    threads: int = 1


def _state(model_or_state) -> Mapping:
    return model_or_state if isinstance(model_or_state, Mapping) else model_or_state.state_dict()


def sample_tasks(tasks, n: int, rng: random.Random):
    return [tasks[rng.randrange(len(tasks))] for _ in range(n)]


class _Deliveries:
    """A rollout worker's second thread: finishes batches (waits for their sandbox verdicts) and
    sends them, in the order they were handed over. A failure is kept and raised by :meth:`check`."""

    def __init__(self, out) -> None:
        self.out = out
        self.jobs: queue.Queue[Callable[[], RolloutBatch] | None] = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="rollout-delivery", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                if job is None:
                    return
                if self.error is None:
                    # Pickled and written here, not by a queue's feeder thread: that extra hop sits on
                    # the critical path and waits for a core when all of them are busy (handoff_s).
                    # The write cannot block for long: the batch holds a slot, so the trainer reads
                    # it; if the trainer dies the pipe breaks and the write fails.
                    self.out.send(job())
            except BaseException as err:  # noqa: BLE001 - raised in the worker's main thread by check()
                self.error = err
            finally:
                self.jobs.task_done()

    def put(self, job: Callable[[], RolloutBatch]) -> None:
        self.jobs.put(job)

    def drain(self) -> None:
        """Wait until every batch handed over has been sent (or failed)."""
        self.jobs.join()
        self.check()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self, timeout: float = 10.0) -> None:
        self.jobs.put(None)
        self.thread.join(timeout)


def _worker_main(cfg: WorkerConfig, tasks, shared: dict, live: list[str], version, lock, out, stop,
                 slots, trainer_waiting) -> None:
    """Entry point of a rollout worker process."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from offline_rl.config import EnvSettings, JudgeSettings, RewardSettings, SandboxSettings
    from offline_rl.judge import make_judge
    from offline_rl.rewards import RewardFunction
    from offline_rl.rollout import TorchBackend, VLLMBackend, assign_rewards, make_env, play_episodes
    from offline_rl.sandbox import SandboxPool
    from policy.loading import load_policy, load_tokenizer

    torch.set_num_threads(cfg.threads)
    sandbox = SandboxPool(SandboxSettings(**cfg.sandbox_settings))
    env = make_env(EnvSettings(**cfg.env_settings), sandbox)
    reward_fn = RewardFunction(sandbox, RewardSettings(**cfg.reward_settings),
                               make_judge(JudgeSettings(**cfg.judge_settings)))
    if cfg.engine == "vllm":
        tok = load_tokenizer(cfg.model_dir)
        backend = VLLMBackend(cfg.model_dir, tok, seed=cfg.seed + cfg.worker_id)
    else:
        policy = load_policy(cfg.model_dir)
        tok = policy.tokenizer
        backend = TorchBackend(policy.model, tok)
    local = -1
    rng = random.Random(cfg.seed * 1_000_003 + cfg.worker_id)
    parent = os.getppid()

    def orphaned() -> bool:
        # The trainer was killed (SIGKILL runs no cleanup): do not outlive it.
        return os.getppid() != parent

    def take_slot() -> bool:
        while not slots.acquire(timeout=0.2):
            if stop.is_set() or orphaned():
                return False
        return True

    deliveries = _Deliveries(out)
    early = False  # the batch about to be sampled starts before it holds a slot (module docstring)
    try:
        waiting_since = time.monotonic()
        while not stop.is_set() and not orphaned():
            deliveries.check()
            if not early and not take_slot():
                break
            # Per-phase times travel with the batch so the trainer's metrics show where a step went:
            # slot_wait_s is this worker idle (the trainer is the bottleneck), sync_s the weight pickup.
            t_slot = time.monotonic()
            if version.value != local:
                with lock:
                    v = version.value
                    # Frozen tensors never change: after the first sync only the trained ones move
                    # (vLLM's reload_weights expects every weight, so it always gets them all).
                    names = list(shared) if local == -1 or cfg.engine == "vllm" else live
                    snapshot = {k: shared[k].clone() for k in names}
                backend.load_weights(snapshot, v)
                local = v
            t_synced = time.monotonic()
            # Thread CPU, not process CPU: the delivery thread's work for the previous batch runs
            # meanwhile and is counted with that batch.
            t0, c0 = time.perf_counter(), time.thread_time()
            batch_tasks = sample_tasks(tasks, cfg.prompts_per_batch, rng)
            trajs, pending = play_episodes(backend, tok, env, batch_tasks, cfg.group_size, cfg.temperature,
                                           cfg.max_new_tokens, seed=rng.randrange(1 << 30), reward_fn=reward_fn)
            sample_cpu_s = time.thread_time() - c0
            slot_wait_s, started_early = t_slot - waiting_since, early
            if early:
                t_wait = time.monotonic()
                if not take_slot():
                    break
                slot_wait_s += time.monotonic() - t_wait
            info = {"slot_wait_s": slot_wait_s, "sync_s": t_synced - t_slot, "started_early": started_early}

            def finish(trajs=trajs, pending=pending, v=local, t0=t0, sample_cpu_s=sample_cpu_s,
                       info=info) -> RolloutBatch:
                c = time.thread_time()
                assign_rewards(trajs, pending)
                info.update(cpu_s=sample_cpu_s + time.thread_time() - c, sandbox_cpu_s=pending.sandbox_cpu_s,
                            ready_at=time.monotonic())
                return RolloutBatch(version=v, trajectories=trajs, gen_s=time.perf_counter() - t0,
                                    worker=cfg.worker_id, tokens=sum(t.n_policy_tokens for t in trajs), info=info)

            deliveries.put(finish)
            early = bool(trainer_waiting.value)
            if not early:
                deliveries.drain()
            waiting_since = time.monotonic()
        deliveries.drain()
    except (BrokenPipeError, EOFError):
        pass  # the trainer went away: nothing left to deliver to
    finally:
        deliveries.close()
        sandbox.close()
        out.close()


class AsyncRollouts:
    """Worker processes, each with a pipe to the trainer and at most ``queue_size`` batches in flight
    among them (the slots); the trainer publishes weights with :meth:`publish`."""

    def __init__(self, model, worker_cfgs: list[WorkerConfig], tasks, queue_size: int, version: int = 0,
                 live: list[str] | None = None):
        """``model``: the policy or its full state dict (a data-parallel trainer gathers one on rank 0).
        ``live``: the state-dict names the trainer updates (default all); only they are re-sent."""

        ctx = mp.get_context("spawn")
        self.shared = {k: v.detach().clone().contiguous().share_memory_() for k, v in _state(model).items()}
        self.live = list(live) if live is not None else list(self.shared)
        self.version = ctx.Value("l", version)
        self.lock = ctx.Lock()
        self.slots = ctx.Semaphore(queue_size)
        # Set while get() waits: a worker that sees it may sample its next batch while it scores this
        # one (module docstring). One byte, written only here: no lock needed.
        self.trainer_waiting = ctx.RawValue("b", 0)
        self.stop_event = ctx.Event()
        self.procs = []
        self.conns: list = []  # read ends, one per worker, in the order get() serves them
        self.received_at = 0.0  # time.monotonic() when get() last took a batch (for hand-off latency)
        self._torch = torch
        for cfg in worker_cfgs:
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker_main, args=(cfg, tasks, self.shared, self.live, self.version, self.lock,
                                                       writer, self.stop_event, self.slots, self.trainer_waiting),
                          daemon=True)
            p.start()
            # Only the worker may hold the write end, so that its exit reads as end-of-file here.
            writer.close()
            self.procs.append(p)
            self.conns.append(reader)

    def publish(self, model, version: int) -> None:
        with self._torch.no_grad(), self.lock:
            state = _state(model)
            for k in self.live:
                self.shared[k].copy_(state[k])
            self.version.value = version

    def _dead(self, i: int) -> RuntimeError:
        self.procs[i].join(timeout=5)
        return RuntimeError(f"rollout worker exited with code {self.procs[i].exitcode}")

    def get(self, timeout: float = 600.0) -> RolloutBatch:
        deadline = time.monotonic() + timeout
        self.trainer_waiting.value = 1
        try:
            return self._get(deadline)
        finally:
            self.trainer_waiting.value = 0

    def _get(self, deadline: float) -> RolloutBatch:
        while True:
            ready = wait(self.conns, timeout=1.0)
            if ready:
                conn = ready[0]
                i = self.conns.index(conn)
                try:
                    batch = conn.recv()
                except EOFError:
                    raise self._dead(i) from None
                self.received_at = time.monotonic()
                self.slots.release()
                # The worker just served goes last, so that with several workers ready none waits
                # behind another's every batch.
                self.conns.append(self.conns.pop(i))
                self.procs.append(self.procs.pop(i))
                return batch
            dead = [i for i, p in enumerate(self.procs) if not p.is_alive()]
            if dead:
                raise self._dead(dead[0])
            if time.monotonic() > deadline:
                raise TimeoutError("no rollout batch arrived in time")

    def close(self) -> None:
        self.stop_event.set()
        # Drain so that a worker blocked writing a batch (larger than the pipe holds) can finish the
        # write, see the stop flag and exit.
        open_conns = list(self.conns)
        t_end = time.monotonic() + 10
        while open_conns and any(p.is_alive() for p in self.procs) and time.monotonic() < t_end:
            for conn in wait(open_conns, timeout=0.1):
                try:
                    conn.recv_bytes()
                except (EOFError, OSError):
                    open_conns.remove(conn)
        for p in self.procs:
            p.join(timeout=1)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()
