"""Inference engines behind one interface (:class:`serving.engines.base.Engine`), chosen by
``serving.engine``: ``torch`` (transformers + the shared sampler, micro-batched) or ``vllm``; with
``serving.engine_process`` (the default) either runs its models in a child process."""

from __future__ import annotations

from serving.engines.torch_engine import TorchEngine
from serving.engines.torch_process import ProcessTorchEngine
from serving.engines.vllm_engine import VLLMEngine
from serving.engines.vllm_process import ProcessVLLMEngine


def create_engine(settings, metrics=None):
    vllm = settings.serving.engine == "vllm"
    if settings.serving.engine_process:
        return ProcessVLLMEngine(settings, metrics) if vllm else ProcessTorchEngine(settings, metrics)
    return VLLMEngine(settings, metrics) if vllm else TorchEngine(settings, metrics)
