"""The torch engine: transformers model + the shared batched sampler (:func:`policy.sampling.generate_ids`).

Micro-batching (see :mod:`serving.engines.base`): concurrent requests are merged into one
``generate_ids`` call with per-row sampling parameters, finished rows leave the batch early (and their
request is answered then); streaming requests get their tokens from ``generate_ids``' per-step hook. Each
version is its own model instance, loaded off the serving path, so a swap is a pointer switch
between batches and old weights stay alive exactly as long as a batch uses them. Cost: two copies
of the weights in memory during a swap (and one per extra channel, e.g. a candidate).

Where the models run (``serving.engine_process``): in a child process (default; see
:mod:`serving.engines.torch_worker`), so the Python sampler loop does not share the GIL with the HTTP
event loop, or in the batcher thread itself (``false``). Either way the batcher, its queue and the
swap ordering are the same code in this process; only the generate call crosses the pipe.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import struct
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from policy.sampling import Sample, SamplingParams
from serving.engines.base import Engine, EngineClosed
from serving.engines.torch_worker import generate_batch
from serving.versions import VersionRef


@dataclass
class TorchHandle:
    version: str
    model: Any  # the model (in-thread) or its slot number in the engine process


class _Inbox:
    """The child's messages on the gen pipe (``multiprocessing.Connection`` framing: a 4-byte big-endian
    length, then the pickle), read with one ``read`` per wake-up for everything already sent.
    ``Connection.recv`` reads twice per message, and each read gives up the GIL and takes it back,
    which waits for the HTTP thread when it is busy; a batch's rows often finish in the same step."""

    def __init__(self, conn) -> None:
        self._fd = conn.fileno()
        self._buf = bytearray()
        self._ready: deque = deque()

    def recv(self) -> Any:
        while not self._ready:
            chunk = os.read(self._fd, 1 << 20)
            if not chunk:
                raise EOFError("the engine process closed its pipe")
            buf = self._buf
            buf += chunk
            pos, end = 0, len(buf)
            while end - pos >= 4:
                (size,) = struct.unpack_from("!i", buf, pos)
                if size < 0:  # Connection's marker for a message over 2 GiB: never sent by the worker
                    raise OSError("oversized message from the engine process")
                if end - pos - 4 < size:
                    break
                self._ready.append(pickle.loads(buf[pos + 4:pos + 4 + size]))
                pos += 4 + size
            del buf[:pos]
        return self._ready.popleft()


class TorchEngine(Engine):
    name = "torch"

    def __init__(self, settings, metrics=None) -> None:
        import torch

        torch.set_num_threads(settings.model.threads)
        self._proc = None
        self._vocab_size: int | None = None
        if settings.serving.engine_process:
            self._start_process(settings)
        super().__init__(settings, metrics)

    # -- the engine process ----------------------------------------------------------------------------
    def _start_process(self, settings) -> None:
        import multiprocessing

        from serving.engines import torch_worker

        # spawn, not fork: this process runs threads (server, emitter, watcher) that fork would clone
        # mid-state.
        ctx = multiprocessing.get_context("spawn")
        self._gen, gen_child = ctx.Pipe()
        self._ctl, ctl_child = ctx.Pipe()
        m = settings.model
        self._proc = ctx.Process(target=torch_worker.main, args=(gen_child, ctl_child, m.threads, m.dtype, m.device),
                                 name="rtrl-torch-engine", daemon=True)
        self._proc.start()
        self._inbox = _Inbox(self._gen)
        gen_child.close()
        ctl_child.close()
        self._ctl_lock = threading.Lock()
        self._slots = itertools.count(1)

    @property
    def ready(self) -> bool:
        return super().ready and (self._proc is None or self._proc.is_alive())

    def _load_remote(self, model_dir) -> tuple[int, dict]:
        slot = next(self._slots)
        with self._ctl_lock:
            try:
                self._ctl.send(("load", slot, str(model_dir)))
                status, info = self._ctl.recv()
            except (EOFError, OSError) as err:
                raise EngineClosed(f"the torch engine process is gone ({err!r})") from None
        if status != "ok":
            raise info
        return slot, info

    # -- hooks -----------------------------------------------------------------------------------------
    def _prepare(self, ref: VersionRef, channel: str) -> Any:
        from policy.loading import load_model, load_tokenizer

        if self._proc is not None:
            slot, info = self._load_remote(ref.model_dir)
            vocab, ctx, prepared = info["vocab_size"], info["context_len"], slot
        else:
            m = self.settings.model
            model = load_model(ref.model_dir, m.dtype, m.device)
            vocab, prepared = model.config.vocab_size, model
            ctx = getattr(model.config, "max_position_embeddings", None)
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(ref.model_dir)
            self.context_len = ctx
        elif vocab != self._vocab_size:
            if self._proc is not None:
                with self._ctl_lock:  # never installed: no batch can be using it
                    self._ctl.send(("free", prepared, None))
            raise ValueError(f"version {ref.version} has vocabulary {vocab}, the served "
                             f"tokenizer {self._vocab_size}: a tokenizer change needs a restart")
        self._vocab_size = vocab
        return prepared

    def _install(self, channel: str, prepared: Any, ref: VersionRef) -> TorchHandle:
        return TorchHandle(ref.version, prepared)

    def _release(self, handle: TorchHandle) -> None:
        if self._proc is not None:
            with contextlib.suppress(EOFError, OSError):  # the process is gone, and its models with it
                self._gen.send(("free", handle.model))

    def _generate(self, handle: TorchHandle, rows: list[list[int]], params: list[SamplingParams], *,
                  on_step=None, on_finish=None) -> list[Sample]:
        if self._proc is None:
            return generate_batch(handle.model, self.tokenizer, rows, params, on_step=on_step, on_finish=on_finish)
        samples: list[Sample | None] = [None] * len(rows)
        try:
            self._gen.send(("gen", handle.model, rows, params, on_step is not None))
            recv = self._inbox.recv
            while True:
                msg = recv()
                kind = msg[0]
                if kind == "fin":
                    samples[msg[1]] = msg[2]
                    if on_finish is not None:
                        on_finish(msg[1], msg[2])
                elif kind == "step":
                    if on_step is not None:
                        on_step(msg[1], msg[2])
                else:  # "end"
                    error = msg[1]
                    break
        except (EOFError, OSError) as err:
            raise EngineClosed(f"the torch engine process is gone ({err!r})") from None
        if error is not None:
            raise error
        return samples

    def _shutdown(self) -> None:
        super()._shutdown()
        if self._proc is None:
            return
        with contextlib.suppress(EOFError, OSError):
            self._gen.send(("exit",))
        for conn in (self._gen, self._ctl):
            with contextlib.suppress(OSError):
                conn.close()
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout=5)
