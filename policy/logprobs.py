"""Teacher-forced log-prob recompute for padded batches of (prompt, completion).

Layout per row: ``[pad … pad, prompt, completion, pad … pad]`` (prompt left-padded, completion
right-padded), position ids counting real tokens only, exactly as the sampler builds them, so that
on the same fp32 weights the recomputed log-probs agree with the sampler's raw log-probs to ~1e-6.

Shared prompts. A GRPO batch holds G completions of each prompt. When prompts repeat,
:func:`sequence_logprobs` runs each distinct prompt once, copies its KV cache to the rows that share
it, and runs only the completions against it: the work falls from B·(P+C) to U·P + B·C tokens (U
distinct prompts; about 3x less on the bench shape, 4 prompts x 8 samples). Gradients flow back
through the copies into the one prompt pass, so values and gradients equal the plain layout's
(tested to 1e-5).

Router replay (mixture-of-experts models). Given each row's recorded route record
(:class:`policy.routes.Routes`, from the sampler or the gateway's logs), the forward passes compare
the live routing with it at every recorded position and, with ``replay=True``, force it
(:mod:`policy.routing`); the result's ``route_stats`` says how often the two disagreed. Rows whose
prompts repeat share one prompt pass only if their prompts' routes are identical too. A record that
does not fit the model or its row raises :class:`policy.routing.RouteMismatch` naming the row and
the layer; nothing falls back to live routing silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from policy.routes import RouteGeometry, Routes, route_problem
from policy.routing import RouteMismatch, RouteSession, RouteStats, route_session


@dataclass
class TokenLogprobs:
    logprobs: torch.Tensor  # [B, Tc] log π(token) at temperature 1; 0 where mask is False
    mask: torch.Tensor  # [B, Tc] True on real completion tokens
    entropy: torch.Tensor | None = None  # [B, Tc] entropy of π at each completion position
    route_stats: RouteStats | None = None  # recorded vs live routing, when routes were given


def pad_rows(rows: Sequence[Sequence[float]] | Sequence[Sequence[bool]], width: int,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Ragged per-token rows as one ``[len(rows), width]`` tensor, zero (False) past each row's end and
    cut at ``width``."""
    out = torch.zeros((len(rows), width), dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, :min(len(r), width)] = torch.tensor(list(r[:width]), dtype=dtype)
    return out


def pad_batch(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_token_id: int = 0):
    """Build (input_ids, attention_mask, position_ids, completion_mask, prompt_width)."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError("prompt_ids and completion_ids must have the same length")
    B = len(prompt_ids)
    P = max(len(p) for p in prompt_ids)
    C = max((len(c) for c in completion_ids), default=0)
    input_ids = torch.full((B, P + C), pad_token_id, dtype=torch.long)
    attn = torch.zeros((B, P + C), dtype=torch.long)
    cmask = torch.zeros((B, C), dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        if not p:
            raise ValueError(f"row {i}: empty prompt")
        input_ids[i, P - len(p):P] = torch.tensor(p)
        attn[i, P - len(p):P] = 1
        if c:
            input_ids[i, P:P + len(c)] = torch.tensor(c)
            attn[i, P:P + len(c)] = 1
            cmask[i, :len(c)] = True
    position_ids = (attn.cumsum(-1) - 1).clamp_min(0)
    return input_ids, attn, position_ids, cmask, P


def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor, cmask: torch.Tensor,
                    with_entropy: bool) -> TokenLogprobs:
    logp_all = logits.float().log_softmax(-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1).masked_fill(~cmask, 0.0)
    entropy = None
    if with_entropy:
        entropy = -(logp_all.exp() * logp_all).sum(-1).masked_fill(~cmask, 0.0)
    return TokenLogprobs(logprobs=logp, mask=cmask, entropy=entropy)


def sequence_logprobs(model, prompt_ids: list[list[int]], completion_ids: list[list[int]], *,
                      with_entropy: bool = False, grad: bool = False, pad_token_id: int = 0,
                      share_prompts: bool | None = None, routes: Sequence[Routes | None] | None = None,
                      replay: bool = True) -> TokenLogprobs:
    """Per-token log-probs (and optionally entropy) of each completion given its prompt.

    ``share_prompts``: run each distinct prompt once (see the module docstring); ``None`` does so
    whenever some prompt occurs more than once. ``routes``: each row's recorded route record (or
    None), compared with the live routing and, with ``replay``, forced."""
    session = _route_session(model, prompt_ids, completion_ids, routes)
    keys = [tuple(p) for p in prompt_ids]
    if session is not None:  # a prompt pass is shared only by rows whose prompts were routed alike
        keys = [(k, None if r is None else r.ids[:len(k)].tobytes()) for k, r in zip(keys, routes, strict=True)]
    if share_prompts is None:
        share_prompts = len(set(keys)) < len(keys)
    with session if session is not None else nullcontext(), nullcontext() if grad else torch.no_grad():
        if share_prompts and completion_ids and max(len(c) for c in completion_ids) > 0:
            out = _shared_prompt_logprobs(model, keys, prompt_ids, completion_ids, with_entropy, pad_token_id,
                                          session, routes, replay)
        else:
            out = _plain_logprobs(model, prompt_ids, completion_ids, with_entropy, pad_token_id, session, routes,
                                  replay)
    if session is not None:
        out.route_stats = session.stats
    return out


def _route_session(model, prompt_ids, completion_ids, routes) -> RouteSession | None:
    """A compare/replay session when some row has routes, after checking every record against the
    model and its row (positions = prompt + completion - 1)."""
    if routes is None or all(r is None for r in routes):
        return None
    if len(routes) != len(prompt_ids):
        raise ValueError(f"{len(routes)} route records for {len(prompt_ids)} rows")
    session = route_session(model)
    geometry = None if session is None else session.geometry
    for i, (r, p, c) in enumerate(zip(routes, prompt_ids, completion_ids, strict=True)):
        problem = None if r is None else route_problem(r, geometry, len(p) + len(c) - 1)
        if problem is not None:
            raise RouteMismatch(f"row {i}: {problem}")
    return session


def _forced(geometry: RouteGeometry, width: int, placed: list[tuple[np.ndarray | None, int]],
            device) -> tuple[torch.Tensor, torch.Tensor]:
    """Routes laid out like a [rows, width] forward input: row b gets ``placed[b] = (ids, slot)``'s
    ids from column ``slot`` on; (routes [rows·width, layers, top_k], mask [rows·width])."""
    forced = np.zeros((len(placed), width, geometry.layers, geometry.top_k), dtype=np.int64)
    mask = np.zeros((len(placed), width), dtype=bool)
    for b, (ids, slot) in enumerate(placed):
        if ids is not None and len(ids):
            forced[b, slot:slot + len(ids)] = ids
            mask[b, slot:slot + len(ids)] = True
    return (torch.from_numpy(forced.reshape(-1, geometry.layers, geometry.top_k)).to(device),
            torch.from_numpy(mask.reshape(-1)).to(device))


def _plain_logprobs(model, prompt_ids, completion_ids, with_entropy, pad_token_id, session, routes,
                    replay) -> TokenLogprobs:
    device = next(model.parameters()).device
    input_ids, attn, pos, cmask, P = pad_batch(prompt_ids, completion_ids, pad_token_id)
    input_ids, attn, pos, cmask = input_ids.to(device), attn.to(device), pos.to(device), cmask.to(device)
    C = cmask.shape[1]
    if session is not None:
        session.expect(*_forced(session.geometry, P + C, [(None if r is None else r.ids, P - len(p))
                                                          for r, p in zip(routes, prompt_ids, strict=True)],
                                device), replay=replay)
    # Only positions P-1 … P+C-2 predict completion tokens; slice before the softmax to save memory.
    logits = model(input_ids=input_ids, attention_mask=attn, position_ids=pos, use_cache=False).logits
    return _token_logprobs(logits[:, P - 1:P - 1 + C, :], input_ids[:, P:P + C], cmask, with_entropy)


def _shared_prompt_logprobs(model, keys: list, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                            with_entropy: bool, pad_token_id: int, session, routes, replay) -> TokenLogprobs:
    device = next(model.parameters()).device
    unique: dict = {}
    first: list[int] = []  # a row holding each distinct prompt
    for i, k in enumerate(keys):
        if k not in unique:
            unique[k] = len(first)
            first.append(i)
    row_prompt = torch.tensor([unique[k] for k in keys], device=device)
    distinct = [prompt_ids[i] for i in first]
    p_ids, p_attn, p_pos, _, P = pad_batch(distinct, [[] for _ in distinct], pad_token_id)
    B, C = len(keys), max(len(c) for c in completion_ids)
    c_ids = torch.full((B, C), pad_token_id, dtype=torch.long)
    cmask = torch.zeros((B, C), dtype=torch.bool)
    for i, c in enumerate(completion_ids):
        if c:
            c_ids[i, :len(c)] = torch.tensor(c)
            cmask[i, :len(c)] = True
    p_ids, p_attn, p_pos, c_ids, cmask = (t.to(device) for t in (p_ids, p_attn, p_pos, c_ids, cmask))
    if session is not None:
        session.expect(*_forced(session.geometry, P, [
            (None if routes[i] is None else routes[i].ids[:len(prompt_ids[i])], P - len(prompt_ids[i]))
            for i in first], device), replay=replay)
    out = model(input_ids=p_ids, attention_mask=p_attn, position_ids=p_pos, use_cache=True)
    cache = out.past_key_values
    cache.batch_select_indices(row_prompt)  # indexing copies: differentiable, the prompt pass gets every row's gradient
    attn = torch.cat([p_attn[row_prompt], cmask.long()], dim=1)
    c_pos = p_attn.sum(-1)[row_prompt].unsqueeze(1) + torch.arange(C, device=device).unsqueeze(0)
    if session is not None:  # completion token t was fed at position P + t; the last one has no record
        session.expect(*_forced(session.geometry, C, [
            (None if r is None else r.ids[len(p):], 0) for r, p in zip(routes, prompt_ids, strict=True)],
            device), replay=replay)
    c_logits = model(input_ids=c_ids, attention_mask=attn, position_ids=c_pos, past_key_values=cache,
                     use_cache=True).logits
    # The prompt's last position predicts the first completion token; completion position t the t+1-th.
    logits = torch.cat([out.logits[row_prompt, -1:, :], c_logits[:, :C - 1, :]], dim=1)
    return _token_logprobs(logits, c_ids, cmask, with_entropy)
