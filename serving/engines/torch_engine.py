"""The torch engine: transformers model + the shared batched sampler (:func:`policy.sampling.generate_ids`).

Micro-batching (see :mod:`serving.engines.base`): concurrent requests are merged into one
``generate_ids`` call with per-row sampling parameters, finished rows leave the batch early (and their
request is answered then); streaming requests get their tokens from ``generate_ids``' per-step hook. Each
version is its own model instance, loaded off the serving path, so a swap is a pointer switch
between batches and old weights stay alive exactly as long as a batch uses them. Cost: two copies
of the weights in memory during a swap (and one per extra channel, e.g. a candidate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policy.sampling import Sample, SamplingParams, generate_ids
from serving.engines.base import Engine
from serving.versions import VersionRef


@dataclass
class TorchHandle:
    version: str
    model: Any


class TorchEngine(Engine):
    name = "torch"

    def __init__(self, settings, metrics=None) -> None:
        import torch

        torch.set_num_threads(settings.model.threads)
        super().__init__(settings, metrics)

    def _prepare(self, ref: VersionRef, channel: str) -> Any:
        from policy.loading import load_model, load_tokenizer

        m = self.settings.model
        model = load_model(ref.model_dir, m.dtype, m.device)
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(ref.model_dir)
            self.context_len = getattr(model.config, "max_position_embeddings", None)
        elif model.config.vocab_size != self._vocab_size:
            raise ValueError(f"version {ref.version} has vocabulary {model.config.vocab_size}, the served "
                             f"tokenizer {self._vocab_size}: a tokenizer change needs a restart")
        self._vocab_size = model.config.vocab_size
        return model

    def _install(self, channel: str, prepared: Any, ref: VersionRef) -> TorchHandle:
        return TorchHandle(ref.version, prepared)

    def _generate(self, handle: TorchHandle, rows: list[list[int]], params: list[SamplingParams], *,
                  on_step=None, on_finish=None) -> list[Sample]:
        tok = self.tokenizer
        return generate_ids(handle.model, rows, params, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id,
                            decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                            on_step=on_step, on_finish=on_finish)
