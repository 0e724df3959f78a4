"""The vLLM engine: one in-process ``vllm.LLM`` with in-place weight updates.

vLLM does its own continuous batching inside ``LLM.generate``; the shared micro-batcher feeds it the
requests that arrived together. A swap loads the new version's tensors off the serving path, then,
between batches, calls ``collective_rpc("reload_weights", weights_iterator=...)``, re-ties a tied LM
head (:func:`retie_lm_head`; vLLM's reload misses it) and the mandatory ``reset_prefix_cache()`` (without it, prompts sharing a cached prefix reuse KV computed with the old
weights). One weight set is live at a time, so there is no candidate channel on this engine.

Log-probs: ``SamplingParams(logprobs=0)`` returns the sampled token's log-prob; with the default
``logprobs_mode="raw_logprobs"`` that is the temperature-1 softmax of the model's logits, the same
quantity as :func:`policy.logprobs.sequence_logprobs` (checked by tests/test_engines_vllm.py).
``sampling_logprobs`` (the processed distribution) is not returned by this engine (None in events).

Process notes (see PLATFORM.md): vLLM is run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
which replaces ``torch.set_num_threads`` and seeds globally; run this engine in its own process
(`rtrl serve`), never beside training.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from policy.sampling import FINISH_LENGTH, FINISH_STOP, Sample, SamplingParams
from serving.engines.base import Engine
from serving.versions import VersionRef


def retie_lm_head(worker) -> bool:
    """Runs inside the vLLM worker after ``reload_weights`` (via ``collective_rpc``).

    With tied embeddings the checkpoint has no ``lm_head`` tensor, so the in-place reload refills
    ``embed_tokens`` but leaves the LM head on its old tensor, and on CPU also on its old prepacked
    GEMM (``cpu_linear``): logits would come from the previous version (seen as ~0.02 log-prob
    errors). Point the head at the new embedding and redo its post-load processing.
    """
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or not getattr(model.config, "tie_word_embeddings", False):
        return False
    head.weight = embed.weight
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
    return True


@dataclass
class VLLMHandle:
    version: str


def read_state_dict(model_dir) -> dict:
    from pathlib import Path

    from safetensors.torch import load_file

    tensors: dict = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(f))
    if not tensors:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights")
    return tensors


class VLLMEngine(Engine):
    name = "vllm"
    supports_candidate = False

    def __init__(self, settings, metrics=None) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.llm = None
        super().__init__(settings, metrics)

    def _prepare(self, ref: VersionRef) -> Any:
        if self.llm is None:
            return None  # the first version is loaded by the LLM constructor, in the worker thread
        return read_state_dict(ref.model_dir)

    def _install(self, channel: str, prepared: Any, ref: VersionRef) -> VLLMHandle:
        if self.llm is None:
            self._start_llm(ref)
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(prepared.items())})
            self.llm.collective_rpc(retie_lm_head)
            self.llm.reset_prefix_cache()
        return VLLMHandle(ref.version)

    def _start_llm(self, ref: VersionRef) -> None:
        import json

        from vllm import LLM

        from policy.loading import load_tokenizer

        s, m = self.settings.serving, self.settings.model
        cfg = json.loads((ref.model_dir / "config.json").read_text())
        self.context_len = cfg.get("max_position_embeddings")
        kwargs: dict[str, Any] = dict(
            model=str(ref.model_dir), tokenizer=str(ref.model_dir), dtype=m.dtype, enforce_eager=True,
            kv_cache_memory_bytes=s.vllm_kv_cache_bytes, max_num_seqs=s.vllm_max_num_seqs,
            logprobs_mode=s.vllm_logprobs_mode, seed=0,
        )
        if self.context_len:
            kwargs["max_model_len"] = self.context_len
        if m.device.startswith("cuda"):
            kwargs["gpu_memory_utilization"] = s.vllm_gpu_memory_utilization
        self.llm = LLM(**kwargs)
        self.tokenizer = load_tokenizer(ref.model_dir)

    def _generate(self, handle: VLLMHandle, rows: list[list[int]], params: list[SamplingParams]) -> list[Sample]:
        from vllm import SamplingParams as VParams
        from vllm import TokensPrompt

        vparams = [VParams(n=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                           max_tokens=p.max_new_tokens, stop=list(p.stop) or None, seed=p.seed, logprobs=0,
                           skip_special_tokens=True)
                   for p in params]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], vparams, use_tqdm=False)
        samples = []
        for row, out in zip(rows, outs, strict=True):
            o = out.outputs[0]
            ids = list(o.token_ids)
            lps = [float(o.logprobs[i][t].logprob) for i, t in enumerate(ids)]
            finish = FINISH_LENGTH if o.finish_reason == "length" else FINISH_STOP
            samples.append(Sample(prompt_token_ids=list(row), token_ids=ids, text=o.text, finish_reason=finish,
                                  logprobs=lps, sampling_logprobs=None))
        return samples

    def _shutdown(self) -> None:
        super()._shutdown()
        self.llm = None
