"""The torch engine with its models in a child process (``serving.engine = "torch"``,
``serving.engine_process = true``): the event-loop batcher of :mod:`serving.engines.process` driving
:mod:`serving.engines.torch_worker`."""

from __future__ import annotations

from collections.abc import Callable

from serving.engines import torch_worker
from serving.engines.process import ProcessEngine


class ProcessTorchEngine(ProcessEngine):
    name = "torch"

    def _child(self) -> tuple[Callable[..., None], tuple]:
        m = self.settings.model
        return torch_worker.main, (m.threads, m.dtype, m.device)
