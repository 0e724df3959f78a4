"""The vLLM engine's process (``serving.engine = "vllm"``, ``serving.engine_process = true``; the parent's
side and the pipe protocol: :mod:`serving.engines.process`).

vLLM runs in this process's main thread (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no further engine-core
process), one ``vllm.LLM`` per channel as in the in-process engine (:class:`serving.engines.vllm_engine.VLLMRunner`).
A new version of a channel that already runs is read on the loader thread (its state dict, staged under
its slot) while batches go on; the parent then sends ``("swap", slot)`` between batches and the main
thread reloads the weights in place, so the swap pause is the reload alone. A channel's first version
builds its engine, on the main thread between batches (vLLM's forward context is process-global: an
engine built beside a running one breaks it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from policy.sampling import Sample, SamplingParams
from policy.vllm_runtime import read_state_dict
from serving.engines import child
from serving.engines.vllm_engine import VLLMRunner, model_info


class VLLMBackend:
    def __init__(self, runner: VLLMRunner, loop: child.ChildLoop) -> None:
        self.runner, self.loop = runner, loop
        self.channel_of: dict[int, str] = {}  # slot -> its channel
        self.staged: dict[int, tuple[dict, str]] = {}  # slot -> (state dict, model dir), not live yet
        self.live: dict[str, int] = {}  # channel -> the slot its engine holds

    def load(self, slot: int, model_dir: str, channel: str) -> dict:
        if channel in self.runner.llms:
            self.staged[slot] = (read_state_dict(model_dir), model_dir)
        else:
            def build() -> None:
                self.runner.start(channel, model_dir)
                self.live[channel] = slot

            self.loop.on_main(build)
        self.channel_of[slot] = channel
        return model_info(model_dir, self.runner.both)

    def free(self, slot: int) -> None:
        self.staged.pop(slot, None)
        self.channel_of.pop(slot, None)

    def swap(self, slot: int) -> None:
        channel = self.channel_of[slot]
        if self.live.get(channel) == slot:
            return
        state_dict, model_dir = self.staged.pop(slot)
        self.runner.reload(channel, state_dict, model_dir)
        self.live[channel] = slot

    def generate(self, slot: int, rows: list[list[int]], params: list[SamplingParams], *,
                 on_step: Callable[[list[int], list[int]], None] | None,
                 on_finish: Callable[[int, Sample], None]) -> Any:
        self.swap(slot)  # a channel served again after a drop: its staged version goes live here
        return self.runner.generate(self.runner.llms[self.channel_of[slot]], rows, params, on_step=on_step,
                                    on_finish=on_finish)


def main(gen_conn, ctl_conn, options: dict[str, Any]) -> None:
    # On CPU, vLLM runs its torch ops on the OpenMP team of the thread that steps it. With OMP_NUM_THREADS
    # unset it takes every core (and then blocks torch.set_num_threads), so generation would contend with
    # the gateway process for the same cores; here it gets `model.threads`, as the torch engine does.
    os.environ["OMP_NUM_THREADS"] = str(options["threads"])
    torch.set_num_threads(options["threads"])
    loop = child.ChildLoop(gen_conn, ctl_conn)
    child.run(loop, VLLMBackend(VLLMRunner(options), loop))
