"""Batched sampling with a KV cache, returning per-token log-probs.

For every sampled token two log-probs are returned:

* ``logprobs``: log softmax of the raw logits (temperature 1, no truncation): the policy's own
  probability, the quantity the trainer recomputes and the importance weights compare;
* ``sampling_logprobs``: log-prob under the distribution actually sampled from (temperature, top-k,
  top-p applied): the behaviour policy μ in the strict sense.

Rows may carry different sampling parameters (the serving engine batches concurrent requests), so
temperature / top-k / top-p / seed are applied per row. Finished rows are dropped from the batch and
the KV cache as they finish. Prompts are left-padded; position ids count real tokens only, which is
what makes the teacher-forced recompute in :mod:`policy.logprobs` agree with these numbers. Rows
that share a prompt share its prefill (one forward per distinct prompt, the KV cache copied).

Streaming hooks (both optional; nothing extra is computed when they are None):

* ``on_step(rows, tokens)`` is called once per decoding step with the original row indices that
  sampled a token in this step and those token ids (eos included), in the same order;
* ``on_finish(row, sample)`` is called as soon as a row finishes (eos, stop string, length) with its
  complete :class:`Sample`, while the other rows of the batch are still decoding.

Both run on the generating thread between steps: keep them short (hand the data to another thread).

Mixture-of-experts models (:mod:`policy.routing`): every sample also carries its route record
(:class:`policy.routes.Routes`, ``[P + C - 1, layers, top_k]``: the experts each MoE layer chose for
every prompt token and every sampled token that was fed back), taken from the very forward passes
that produced its log-probs; a row continued from a :class:`RowCache` keeps the routes its cached
positions were computed with. Dense models get ``routes=None`` at no cost.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from policy.routes import Routes
from policy.routing import RouteSession, route_session

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("n must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")


@dataclass
class Sample:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float]
    sampling_logprobs: list[float]
    routes: Routes | None = None
    """MoE models: the experts chosen at every consumed position (see the module docstring)."""


class ContextTooLong(ValueError):
    """Prompt plus completion budget exceeds the model's context."""


def _filtered_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor) -> torch.Tensor:
    """Logits of the sampling distribution: scaled by 1/T, then top-k and top-p truncation per row."""
    scaled = logits / temperature.clamp_min(1e-6).unsqueeze(1)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(scaled.shape[-1], device=scaled.device).unsqueeze(0)
        drop = (top_k.unsqueeze(1) > 0) & (rank >= top_k.unsqueeze(1))
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        mass_before = probs.cumsum(-1) - probs
        drop |= mass_before >= top_p.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(-1, order, sorted_logits)
    return scaled


@dataclass
class RowCache:
    """One sequence's KV cache between calls (multi-turn episodes): the keys and values of its first
    ``length`` tokens in every layer, without padding. A later call passes the sequence's full token
    ids and only the tokens after ``length`` are run."""

    keys: list[torch.Tensor]  # per layer: [kv_heads, length, head_dim]
    values: list[torch.Tensor]
    length: int
    routes: np.ndarray | None = None  # MoE models: [length, layers, top_k], the cached positions' routes


@dataclass
class _Batch:
    """What the decode loop starts from: the KV cache, the key mask, the last positions, the logits."""

    cache: object
    attn: torch.Tensor
    step_pos: torch.Tensor
    logits: torch.Tensor


class _RouteLog:
    """The route records of one :func:`generate_ids` call, built from each forward pass's live routes."""

    def __init__(self, session: RouteSession, rows: int):
        self.session = session
        self.experts = session.geometry.experts
        self.dtype = torch.uint8 if self.experts <= 256 else torch.int16
        self.prompt: list[np.ndarray | None] = [None] * rows
        self.steps: list[list[np.ndarray]] = [[] for _ in range(rows)]

    def _live(self) -> np.ndarray:
        return self.session.live().to(self.dtype).cpu().numpy()

    def prefill(self, prompt_ids: list[list[int]], batch_row: list[int], width: int,
                cached: list[np.ndarray | None] | None = None) -> None:
        """After the prompt pass: row r's new tokens are the last ones of batch row ``batch_row[r]`` of
        the pass (left-padded to ``width``), after the ``cached[r]`` routes of its cached prefix."""
        live = self._live()
        live = live.reshape(live.shape[0] // width, width, *live.shape[1:])
        for r, ids in enumerate(prompt_ids):
            before = None if cached is None else cached[r]
            n = len(ids) - (0 if before is None else len(before))
            new = live[batch_row[r], width - n:]
            self.prompt[r] = new if before is None else np.concatenate([before, new])

    def decode(self, active: list[int]) -> None:
        """After a decoding step that fed one token to each of ``active``'s rows."""
        live = self._live()
        for j, row in enumerate(active):
            self.steps[row].append(live[j])

    def routes(self, row: int) -> Routes:
        parts = self.prompt[row]
        if self.steps[row]:
            parts = np.concatenate([parts, np.stack(self.steps[row])])
        return Routes(parts, self.experts)


def _prefill_fresh(model, prompt_ids: list[list[int]], pad_token_id: int, device,
                   route_log: _RouteLog | None = None) -> _Batch:
    """Left-padded prompts; rows with the same prompt share one prefill (its KV cache is copied)."""
    B = len(prompt_ids)
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((B, width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((B, width), dtype=torch.long)
    for i, ids in enumerate(prompt_ids):
        input_ids[i, width - len(ids):] = torch.tensor(ids)
        attn[i, width - len(ids):] = 1
    input_ids, attn = input_ids.to(device), attn.to(device)
    position_ids = (attn.cumsum(-1) - 1).clamp_min(0)
    distinct: dict[tuple[int, ...], int] = {}
    row_prompt: list[int] = []
    first_rows: list[int] = []  # a row holding each distinct prompt, in order of appearance
    for r, ids in enumerate(prompt_ids):
        if tuple(ids) not in distinct:
            distinct[tuple(ids)] = len(first_rows)
            first_rows.append(r)
        row_prompt.append(distinct[tuple(ids)])
    if len(first_rows) < B:
        rep = torch.tensor(first_rows, device=device)
        out = model(input_ids=input_ids[rep], attention_mask=attn[rep], position_ids=position_ids[rep], use_cache=True)
        copy = torch.tensor(row_prompt, device=device)
        cache = out.past_key_values
        cache.batch_select_indices(copy)
        logits = out.logits[copy, -1, :].float()
    else:
        out = model(input_ids=input_ids, attention_mask=attn, position_ids=position_ids, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1, :].float()
    if route_log is not None:
        route_log.prefill(prompt_ids, row_prompt, width)
    return _Batch(cache=cache, attn=attn, step_pos=position_ids[:, -1:], logits=logits)


def _prefill_cached(model, prompt_ids: list[list[int]], caches: list[RowCache | None], pad_token_id: int,
                    device, route_log: _RouteLog | None = None) -> _Batch:
    """Each row's cached prefix (left-padded to a common width) plus its new tokens (left-padded too,
    so every row's last token is in the last column); padding inside a row is masked out."""

    n_layers = next(c for c in caches if c is not None).keys.__len__()
    lens = [c.length if c is not None else 0 for c in caches]
    for i, (ids, n) in enumerate(zip(prompt_ids, lens, strict=True)):
        if len(ids) <= n:
            raise ValueError(f"row {i}: no new tokens after its {n} cached ones")
    W, L = max(lens), max(len(ids) - n for ids, n in zip(prompt_ids, lens, strict=True))
    B = len(prompt_ids)
    ref = next(c for c in caches if c is not None)
    layers = []
    for layer in range(n_layers):
        kshape, vshape = ref.keys[layer].shape, ref.values[layer].shape
        k = torch.zeros((B, kshape[0], W, kshape[2]), dtype=ref.keys[layer].dtype, device=device)
        v = torch.zeros((B, vshape[0], W, vshape[2]), dtype=ref.values[layer].dtype, device=device)
        for i, c in enumerate(caches):
            if c is not None and c.length:
                k[i, :, W - c.length:] = c.keys[layer]
                v[i, :, W - c.length:] = c.values[layer]
        layers.append((k, v))
    cache = DynamicCache(ddp_cache_data=layers)
    input_ids = torch.full((B, L), pad_token_id, dtype=torch.long)
    attn = torch.zeros((B, W + L), dtype=torch.long)
    pos = torch.zeros((B, L), dtype=torch.long)
    for i, (ids, n) in enumerate(zip(prompt_ids, lens, strict=True)):
        new = ids[n:]
        input_ids[i, L - len(new):] = torch.tensor(new)
        attn[i, W - n:W] = 1
        attn[i, W + L - len(new):] = 1
        pos[i, L - len(new):] = torch.arange(n, n + len(new))
    input_ids, attn, pos = input_ids.to(device), attn.to(device), pos.to(device)
    out = model(input_ids=input_ids, attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True)
    if route_log is not None:
        cached = [c.routes if c is not None else None for c in caches]
        if any(c is not None and c.length and r is None for c, r in zip(caches, cached, strict=True)):
            raise ValueError("a row's cache was made without routes: it cannot continue on an MoE model")
        route_log.prefill(prompt_ids, list(range(B)), L, cached)
    return _Batch(cache=out.past_key_values, attn=attn, step_pos=pos[:, -1:], logits=out.logits[:, -1, :].float())


def _row_cache(cache, attn: torch.Tensor, j: int, routes: Routes | None = None) -> RowCache:
    """Batch row ``j`` of ``cache`` without its padding columns (with the row's routes: they cover
    exactly the cached positions)."""
    keep = attn[j].bool()
    keys = [layer.keys[j][:, keep[-layer.keys.shape[2]:]].clone() for layer in cache.layers]
    values = [layer.values[j][:, keep[-layer.values.shape[2]:]].clone() for layer in cache.layers]
    return RowCache(keys=keys, values=values, length=int(keep.sum()),
                    routes=None if routes is None else routes.ids)


@torch.no_grad()
def generate_ids(model, prompt_ids: list[list[int]], params: list[SamplingParams], *, eos_token_id: int | None,
                 pad_token_id: int, decode=None,
                 on_step: Callable[[list[int], list[int]], None] | None = None,
                 on_finish: Callable[[int, Sample], None] | None = None,
                 caches: list[RowCache | None] | None = None) -> list[Sample]:
    """Sample one completion per row. ``params[i]`` applies to row i (its ``n`` is ignored here).

    ``on_step`` / ``on_finish``: see the module docstring (per-step tokens, per-row completion).

    ``caches`` (multi-turn episodes): a list with one entry per row, None or the row's
    :class:`RowCache` from an earlier call. The row's ``prompt_ids`` are then its *full* token ids and
    only those after the cached ones are run; on return the list holds each row's new cache (every
    token of the row but the last sampled one, which the next call runs). Results are those of the
    same call without caches, up to floating-point summation order."""
    session = route_session(model, capture=True)
    with session if session is not None else nullcontext():
        return _generate_ids(model, prompt_ids, params, eos_token_id, pad_token_id, decode, on_step, on_finish,
                             caches, None if session is None else _RouteLog(session, len(prompt_ids)))


def _check_rows(model, prompt_ids: list[list[int]], params: list[SamplingParams],
                caches: list[RowCache | None] | None) -> None:
    if len(prompt_ids) != len(params):
        raise ValueError("one SamplingParams per prompt row")
    if caches is not None and len(caches) != len(prompt_ids):
        raise ValueError("one cache entry per prompt row")
    max_ctx = getattr(model.config, "max_position_embeddings", None)
    for ids, p in zip(prompt_ids, params, strict=True):
        if not ids:
            raise ValueError("empty prompt")
        if max_ctx is not None and len(ids) + p.max_new_tokens > max_ctx:
            raise ContextTooLong(f"prompt of {len(ids)} tokens + max_tokens {p.max_new_tokens} exceeds the "
                                 f"model context of {max_ctx}")


def _sample_step(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 greedy: torch.Tensor, generators: list[torch.Generator | None],
                 ) -> tuple[torch.Tensor, list[float], list[float]]:
    """One token per live row: (chosen ids, raw log-probs at T=1, log-probs under the sampling
    distribution, 0 for greedy rows). Exponential-race sampling (argmax of log p - log E, E ~ Exp(1))
    lets each row use its own generator without a Python loop over multinomial calls."""
    raw_logp = logits.log_softmax(-1)
    samp_logp = _filtered_logits(logits, temperature, top_k, top_p).log_softmax(-1)
    noise = torch.empty_like(samp_logp)
    shared = [j for j, g in enumerate(generators) if g is None]
    if shared:
        noise[shared] = torch.empty((len(shared), noise.shape[1]), device=noise.device).exponential_()
    for j, g in enumerate(generators):
        if g is not None:
            noise[j] = torch.empty(noise.shape[1], device=noise.device).exponential_(generator=g)
    choice = (samp_logp - noise.log()).argmax(-1)
    choice = torch.where(greedy, logits.argmax(-1), choice)
    lp = raw_logp.gather(1, choice.unsqueeze(1)).squeeze(1).tolist()
    slp = samp_logp.gather(1, choice.unsqueeze(1)).squeeze(1)
    return choice, lp, torch.where(greedy, torch.zeros_like(slp), slp).tolist()


def _generate_ids(model, prompt_ids: list[list[int]], params: list[SamplingParams], eos_token_id: int | None,
                  pad_token_id: int, decode, on_step: Callable[[list[int], list[int]], None] | None,
                  on_finish: Callable[[int, Sample], None] | None, caches: list[RowCache | None] | None,
                  route_log: _RouteLog | None) -> list[Sample]:
    _check_rows(model, prompt_ids, params, caches)
    if not prompt_ids:
        return []
    device = next(model.parameters()).device
    B = len(prompt_ids)
    if caches is not None and any(c is not None for c in caches):
        batch = _prefill_cached(model, prompt_ids, caches, pad_token_id, device, route_log)
    else:
        batch = _prefill_fresh(model, prompt_ids, pad_token_id, device, route_log)
    cache, attn, step_pos, logits = batch.cache, batch.attn, batch.step_pos, batch.logits

    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    greedy = temperature == 0
    top_k = torch.tensor([p.top_k for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    generators = [torch.Generator(device=device).manual_seed(p.seed) if p.seed is not None else None
                  for p in params]
    budget = max(p.max_new_tokens for p in params)

    out_tokens: list[list[int]] = [[] for _ in range(B)]
    out_lp: list[list[float]] = [[] for _ in range(B)]
    out_slp: list[list[float]] = [[] for _ in range(B)]
    finish: list[str | None] = [None] * B
    texts: list[str] = [""] * B
    active = list(range(B))  # original row index of each live batch row
    samples: list[Sample | None] = [None] * B

    def finished(row: int, routes: Routes | None) -> None:
        ids = out_tokens[row]
        if finish[row] is None:
            finish[row] = FINISH_LENGTH
        if not texts[row] and decode is not None:
            body = ids[:-1] if (finish[row] == FINISH_STOP and eos_token_id is not None and ids
                                and ids[-1] == eos_token_id) else ids
            texts[row] = decode(body)
        samples[row] = Sample(prompt_token_ids=list(prompt_ids[row]), token_ids=ids, text=texts[row],
                              finish_reason=finish[row], logprobs=out_lp[row], sampling_logprobs=out_slp[row],
                              routes=routes)
        if on_finish is not None:
            on_finish(row, samples[row])

    step_ids = None  # the tokens sampled in the previous step, fed in the next
    for step in range(budget):
        if step > 0:
            out = model(input_ids=step_ids, attention_mask=attn, position_ids=step_pos,
                        past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()
            if route_log is not None:
                route_log.decode(active)
        idx = torch.tensor(active, device=device)
        choice, lp, slp = _sample_step(logits, temperature[idx], top_k[idx], top_p[idx], greedy[idx],
                                       [generators[row] for row in active])
        tokens = choice.tolist()
        if on_step is not None:
            on_step(list(active), tokens)

        keep: list[int] = []
        for j, row in enumerate(active):
            tok = tokens[j]
            out_tokens[row].append(tok)
            out_lp[row].append(lp[j])
            out_slp[row].append(slp[j])
            if eos_token_id is not None and tok == eos_token_id:
                finish[row] = FINISH_STOP
            else:
                stops = params[row].stop
                if stops and decode is not None:
                    text = decode(out_tokens[row])
                    hit = min((text.find(s) for s in stops if s and s in text), default=-1)
                    if hit >= 0:
                        texts[row] = text[:hit]
                        finish[row] = FINISH_STOP
                if finish[row] is None and len(out_tokens[row]) >= params[row].max_new_tokens:
                    finish[row] = FINISH_LENGTH
            if finish[row] is None:
                keep.append(j)
                continue
            routes = None if route_log is None else route_log.routes(row)
            if caches is not None:
                caches[row] = _row_cache(cache, attn, j, routes)
            finished(row, routes)
        if not keep:
            break
        if len(keep) < len(active):
            sel = torch.tensor(keep, device=device)
            cache.batch_select_indices(sel)
            attn = attn[sel]
            choice = choice[sel]
            step_pos = step_pos[sel]
            active = [active[j] for j in keep]
        step_ids = choice.unsqueeze(1)
        step_pos = step_pos[:, -1:] + 1
        attn = torch.cat([attn, torch.ones((len(active), 1), dtype=attn.dtype, device=device)], dim=1)

    for row in range(B):
        if samples[row] is None:  # every row finishes inside the loop; kept as a guard
            finished(row, None if route_log is None else route_log.routes(row))
    return samples


def encode_prompts(tokenizer, prompts: list[str] | list[list[int]]) -> list[list[int]]:
    if prompts and isinstance(prompts[0], str):
        return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    return [list(p) for p in prompts]


def generate(model, tokenizer, prompts: list[str] | list[list[int]], params: SamplingParams) -> list[list[Sample]]:
    """``params.n`` samples for each prompt, in one batch. A seed makes the whole call reproducible."""
    ids = encode_prompts(tokenizer, prompts)
    rows, row_params = [], []
    for i, prompt in enumerate(ids):
        for k in range(params.n):
            rows.append(prompt)
            seed = None if params.seed is None else params.seed + 1_000_003 * i + k
            row_params.append(SamplingParams(temperature=params.temperature, top_p=params.top_p,
                                             top_k=params.top_k, max_new_tokens=params.max_new_tokens,
                                             stop=list(params.stop), seed=seed))
    flat = generate_ids(model, rows, row_params, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id, decode=lambda t: tokenizer.decode(t))
    return [flat[i * params.n:(i + 1) * params.n] for i in range(len(ids))]
