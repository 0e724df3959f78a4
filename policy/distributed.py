"""Data parallelism under ``torchrun``: one process per rank, FSDP2 on a one-dimensional device mesh.

Launch: ``torchrun --nproc_per_node N -m rtrl midtrain|grpo|update ...`` (several machines: the same
command on each, with ``--nnodes``, ``--node_rank``, ``--master_addr`` and ``--master_port``). torchrun
sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; :func:`setup` reads
them (``distributed.mode``) and returns this process's :class:`DataParallel`. Without torchrun it
returns the one-process value, whose methods are identities, so every trainer runs one code path.

What every rank does. Each rank holds the same global batch (the data pipelines are seeded and
deterministic, or rank 0 broadcasts what it sampled) and runs the forward and backward passes of its
share of the rows: row ``i`` of every micro-batch belongs to rank ``i mod N`` (:meth:`DataParallel.rows`).
Each rank's loss is its part of the global loss (normalised by the global token or row count, not by
its own), and gradients are *summed* across ranks, so the gradient is the one-process gradient of the
same global batch up to floating-point summation order.

How FSDP2 is used, and where the schedule departs from the usual one. ``fully_shard`` wraps every
transformer block (the model's ``_no_split_modules``) and then the root; at rest each rank holds 1/N
of every parameter, gradient and optimizer state. An optimizer step gathers the parameters once
(``reshard_after_forward=False``, :meth:`DataParallel.begin_backward`), runs this rank's micro-batches
without communication (gradient sync off), then runs one identical one-token forward and backward on
every rank with sync on, which reduce-scatters the accumulated gradients (:meth:`DataParallel.end_backward`).
Why: how many forward passes a rank makes depends on its rows (how many micro-batches it got, whether
its rows share a prompt, see :func:`policy.logprobs.sequence_logprobs`); FSDP's usual all-gather per
forward would then not pair up between ranks and the job would hang. The price: during a step every
rank holds one full copy of the parameters (like ZeRO-2), not 1/N. No-grad passes run on gathered
parameters too (:meth:`DataParallel.gather`), for the same reason. While gathered, ``model.parameters()``
are the unsharded tensors: an optimizer must be built while the model is sharded, or it updates
copies that the next gather overwrites.

Rank 0 alone samples, evaluates, publishes and writes run records (:attr:`DataParallel.is_main`); the
other ranks wait in a collective meanwhile (:meth:`DataParallel.gathered` gives rank 0 the full
parameters with no communication per forward). Checkpoints use ``torch.distributed.checkpoint``: one
file per rank plus metadata in the run directory (shared storage when ranks are on several machines);
a checkpoint saved by N ranks loads on any number of ranks.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from policy.config import DistributedSettings
from policy.loading import save_policy

T = TypeVar("T")

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class DistributedError(RuntimeError):
    """The distributed settings and how the process was launched disagree."""


class RendezvousError(DistributedError):
    """A rank could not reach the others within ``distributed.rendezvous_timeout_s``."""


@dataclass
class DataParallel:
    """This process's place in a data-parallel group; ``world == 1`` is a plain single process."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: str = "cpu"
    mesh: Any = field(default=None, repr=False)

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def local_world(self) -> int:
        """Ranks on this machine (they share its cores)."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if self.enabled else 1

    # -- the model ------------------------------------------------------------------------------

    def shard(self, model):
        """Wrap ``model`` in FSDP2 (each transformer block, then the root), in place; returns it."""
        if not self.enabled:
            return model

        block_types = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in block_types:
                fully_shard(module, mesh=self.mesh, reshard_after_forward=False)
        fully_shard(model, mesh=self.mesh, reshard_after_forward=False)
        # Each rank's loss is already its share of the global loss: gradients are summed, not averaged
        # (divide factor 1), with plain SUM collectives (gloo has no pre-multiplied sum). Per unit:
        # these setters are not recursive.
        for unit in _fsdp_units(model):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
        return model

    def param_fraction(self, model) -> float:
        """Share of the model's parameter elements this rank holds (1.0 without sharding)."""
        total = local = 0
        for p in model.parameters():
            total += p.numel()
            local += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
        return local / max(total, 1)

    def rows(self, items: Sequence[T]) -> list[T]:
        """This rank's share of a micro-batch: items ``rank, rank + N, ...`` (all of them for N = 1)."""
        return list(items) if not self.enabled else list(items[self.rank::self.world])

    def begin_backward(self, model) -> None:
        """Before an optimizer step's backward passes: gather the parameters, defer gradient sync."""
        if not self.enabled:
            return
        for unit in _fsdp_units(model):
            unit.unshard()
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)

    def end_backward(self, model) -> None:
        """After this rank's backward passes: one identical zero-weight forward/backward on every rank
        with sync on reduce-scatters the accumulated gradients (and reshards the parameters)."""
        if not self.enabled:
            return

        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        (model(input_ids=ids, use_cache=False).logits.sum() * 0.0).backward()

    def gather(self, model) -> None:
        """Every rank holds the full parameters until the next :meth:`begin_backward` (or
        :meth:`release`), so forwards need no communication: a collective."""
        if self.enabled:
            for unit in _fsdp_units(model):
                unit.unshard()

    def release(self, model) -> None:
        """Back to 1/N of the parameters per rank (after :meth:`gather`)."""
        if self.enabled:
            for unit in _fsdp_units(model):
                unit.reshard()

    @contextlib.contextmanager
    def gathered(self, model) -> Iterator[None]:
        """Inside, every rank holds the full parameters, so rank 0 may run forwards alone (sampling,
        evaluation); every rank must enter and leave together."""
        self.gather(model)
        try:
            yield
        finally:
            self.release(model)

    def full_state_dict(self, model) -> dict | None:
        """The unsharded state dict on rank 0 (CPU tensors), None on the others; a collective."""
        if not self.enabled:
            return model.state_dict()

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.is_main else None

    def save_pretrained(self, model, tokenizer, out: Path) -> Path:
        """An HF directory of the full model, written by rank 0; a collective."""
        state = self.full_state_dict(model) if self.enabled else None
        if self.is_main:
            save_policy(model, tokenizer, out, state_dict=state)
        self.barrier()
        return Path(out)

    def clip_grad_norm(self, parameters, max_norm: float) -> float:
        """Global gradient-norm clip (across every rank's shards); returns the norm before clipping."""

        return float(torch.nn.utils.clip_grad_norm_(list(parameters), max_norm))

    # -- sharded checkpoints ---------------------------------------------------------------------

    def save_state(self, path: Path, model, optimizer) -> None:
        """Model and optimizer shards of every rank into the directory ``path`` (a collective)."""

        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))

    def load_state(self, path: Path, model, optimizer) -> None:
        """Load what :meth:`save_state` wrote (by any number of ranks) into this rank's shards."""

        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    # -- collectives on plain values -------------------------------------------------------------

    def sum(self, value: float) -> float:
        """``value`` summed over ranks (float64 on the wire)."""
        if not self.enabled:
            return value

        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item())

    def sum_dict(self, values: dict[str, float]) -> dict[str, float]:
        """Per key, the sum over ranks; a key missing on a rank counts 0 there."""
        if not self.enabled:
            return dict(values)

        gathered: list[dict[str, float] | None] = [None] * self.world
        dist.all_gather_object(gathered, dict(values))
        out: dict[str, float] = {}
        for part in gathered:
            for key, value in (part or {}).items():
                out[key] = out.get(key, 0.0) + value
        return out

    def assemble(self, tensor):
        """Rows that each rank filled (zeros elsewhere, no row filled twice) into the full tensor on
        every rank."""
        if not self.enabled:
            return tensor

        dist.all_reduce(tensor)
        return tensor

    def broadcast(self, obj: T, src: int = 0) -> T:
        """Rank ``src``'s ``obj`` on every rank (pickled: only between the ranks of one job)."""
        if not self.enabled:
            return obj

        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def _fsdp_units(model) -> list:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


_CURRENT: DataParallel | None = None


def launched_by_torchrun(env: dict[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return all(name in env for name in TORCHRUN_ENV)


def setup(settings: DistributedSettings, device: str = "cpu") -> DataParallel:
    """This process's :class:`DataParallel`, joining the process group on the first call.

    Raises :class:`DistributedError` when ``distributed.mode`` and the launch disagree, and
    :class:`RendezvousError` when the other ranks cannot be reached in time."""
    global _CURRENT
    if _CURRENT is not None:
        return _CURRENT
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launched = launched_by_torchrun() and world > 1
    if settings.mode == "on" and not launched:
        raise DistributedError("distributed.mode = 'on' needs a launch by torchrun with more than one rank "
                               "(e.g. `torchrun --nproc_per_node 2 -m rtrl grpo`)")
    if settings.mode == "off" and launched:
        raise DistributedError(f"distributed.mode = 'off' but torchrun started {world} ranks: each would train "
                               "alone into the same run directory; use --nproc_per_node 1 or mode 'auto'")
    if not launched or settings.mode == "off":
        _CURRENT = DataParallel(device=device)
        return _CURRENT
    _CURRENT = _join(settings, device, world)
    return _CURRENT


def _join(settings: DistributedSettings, device: str, world: int) -> DataParallel:
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    cuda = device.startswith("cuda")
    backend = settings.backend if settings.backend != "auto" else ("nccl" if cuda else "gloo")
    where = f"rank {rank} of {world}: rendezvous at {addr}:{port}"
    if rank != 0:
        wait_for_listener(addr, port, settings.rendezvous_timeout_s, where)
    try:
        store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=settings.rendezvous_timeout_s)))
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=settings.collective_timeout_s))
        mesh = init_device_mesh("cuda" if cuda else "cpu", (world,))
    except (dist.DistError, RuntimeError, TimeoutError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RendezvousError(f"{where} failed within distributed.rendezvous_timeout_s="
                              f"{settings.rendezvous_timeout_s:g}: {first}") from None
    return DataParallel(rank=rank, world=world, local_rank=local_rank,
                        device=f"cuda:{local_rank}" if cuda else device, mesh=mesh)


def wait_for_listener(addr: str, port: int, timeout_s: float, where: str) -> None:
    """Connect to the rendezvous store until it answers, at most ``timeout_s``; else :class:`RendezvousError`.

    torch's own store client retries with long back-off and logs a C++ stack per try; checking the
    address first gives one clear error, on time."""
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousError(f"{where}: nothing answered within distributed.rendezvous_timeout_s="
                                  f"{timeout_s:g} ({last}); is rank 0 running, and is the address reachable "
                                  "from this machine?")
        try:
            with socket.create_connection((addr, port), timeout=min(1.0, left)):
                return
        except OSError as err:
            last = err
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def is_main_process() -> bool:
    """False only on the ranks other than 0 of a joined group (what prints a command's result)."""
    return _CURRENT is None or _CURRENT.is_main


def shutdown() -> None:
    """Leave the process group (if one was joined); the next :func:`setup` starts afresh."""
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.close()
    _CURRENT = None
