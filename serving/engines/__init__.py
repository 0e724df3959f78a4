"""Inference engines behind one interface (:class:`serving.engines.base.Engine`), chosen by
``serving.engine``: ``torch`` (transformers + the shared sampler, micro-batched) or ``vllm``."""

from __future__ import annotations


def create_engine(settings, metrics=None):
    if settings.serving.engine == "vllm":
        from serving.engines.vllm_engine import VLLMEngine

        return VLLMEngine(settings, metrics)
    if settings.serving.engine_process:
        from serving.engines.torch_process import ProcessTorchEngine

        return ProcessTorchEngine(settings, metrics)
    from serving.engines.torch_engine import TorchEngine

    return TorchEngine(settings, metrics)
