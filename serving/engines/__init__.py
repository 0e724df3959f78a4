"""Inference engines behind one interface (:class:`serving.engines.base.Engine`), chosen by
``serving.engine``: ``torch`` (transformers + the shared sampler, micro-batched) or ``vllm``."""

from __future__ import annotations

from serving.engines.torch_engine import TorchEngine
from serving.engines.torch_process import ProcessTorchEngine
from serving.engines.vllm_engine import VLLMEngine


def create_engine(settings, metrics=None):
    if settings.serving.engine == "vllm":
        return VLLMEngine(settings, metrics)
    if settings.serving.engine_process:
        return ProcessTorchEngine(settings, metrics)

    return TorchEngine(settings, metrics)
