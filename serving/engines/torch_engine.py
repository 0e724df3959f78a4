"""The torch engine: transformers model + the shared batched sampler (:func:`policy.sampling.generate_ids`).

Micro-batching (see :mod:`serving.engines.base`): concurrent requests are merged into one
``generate_ids`` call with per-row sampling parameters, finished rows leave the batch early (and their
request is answered then); streaming requests get their tokens from ``generate_ids``' per-step hook. Each
version is its own model instance, loaded off the serving path, so a swap is a pointer switch
between batches and old weights stay alive exactly as long as a batch uses them. Cost: two copies
of the weights in memory during a swap (and one per extra channel, e.g. a candidate).

Where the models run (``serving.engine_process``): this class generates in the batcher thread of the
gateway's own process (``false``: one process, for tests and debugging); the default runs them in a
child process driven from an event loop, :class:`serving.engines.torch_process.ProcessTorchEngine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from policy.loading import load_model
from policy.sampling import Sample, SamplingParams
from serving.engines.base import Engine
from serving.engines.torch_worker import generate_batch
from serving.versions import VersionRef


@dataclass
class TorchHandle:
    version: str
    model: Any  # the model (in-thread) or its slot number in the engine process


class TorchEngine(Engine):
    name = "torch"

    def __init__(self, settings, metrics=None) -> None:
        torch.set_num_threads(settings.model.threads)
        super().__init__(settings, metrics)

    # -- hooks -----------------------------------------------------------------------------------------
    def _prepare(self, ref: VersionRef, channel: str) -> Any:
        m = self.settings.model
        model = load_model(ref.model_dir, m.dtype, m.device)
        self._adopt(ref, model.config.vocab_size, getattr(model.config, "max_position_embeddings", None))
        return model

    def _install(self, channel: str, prepared: Any, ref: VersionRef) -> TorchHandle:
        return TorchHandle(ref.version, prepared)

    def _generate(self, handle: TorchHandle, rows: list[list[int]], params: list[SamplingParams], *,
                  on_step=None, on_finish=None) -> list[Sample]:
        return generate_batch(handle.model, self.tokenizer, rows, params, on_step=on_step, on_finish=on_finish)
