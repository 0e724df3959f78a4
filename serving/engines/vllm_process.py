"""The vLLM engine with its engines in a child process (``serving.engine = "vllm"``,
``serving.engine_process = true``, the default): the event-loop batcher of
:mod:`serving.engines.process` driving :mod:`serving.engines.vllm_worker`, the layout of vLLM's own
API server (the engine core in its own process, the API process's event loop doing the I/O).

A swap is the child's work (:class:`serving.engines.process.ChildStep`): the new weights are read there
while it generates, then put into the running engine between two batches; ``load`` returns that
reload's time as the pause.
"""

from __future__ import annotations

from collections.abc import Callable

from serving.engines import vllm_worker
from serving.engines.process import ChildStep, ProcessEngine, SlotHandle
from serving.engines.vllm_engine import runner_options


class ProcessVLLMEngine(ProcessEngine):
    name = "vllm"

    def __init__(self, settings, metrics=None) -> None:
        self.supports_candidate = settings.serving.canary_share > 0
        super().__init__(settings, metrics)

    def _child(self) -> tuple[Callable[..., None], tuple]:
        return vllm_worker.main, (runner_options(self.settings),)

    def _finish_swap(self, handle: SlotHandle, pause: float) -> ChildStep:
        return ChildStep(("swap", handle.slot))
