"""Teacher-forced log-prob recompute for padded batches of (prompt, completion).

Layout per row: ``[pad … pad, prompt, completion, pad … pad]`` (prompt left-padded, completion
right-padded), position ids counting real tokens only, exactly as the sampler builds them, so that
on the same fp32 weights the recomputed log-probs agree with the sampler's raw log-probs to ~1e-6.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch


@dataclass
class TokenLogprobs:
    logprobs: torch.Tensor  # [B, Tc] log π(token) at temperature 1; 0 where mask is False
    mask: torch.Tensor  # [B, Tc] True on real completion tokens
    entropy: torch.Tensor | None = None  # [B, Tc] entropy of π at each completion position


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


def sequence_logprobs(model, prompt_ids: list[list[int]], completion_ids: list[list[int]], *,
                      with_entropy: bool = False, grad: bool = False, pad_token_id: int = 0) -> TokenLogprobs:
    """Per-token log-probs (and optionally entropy) of each completion given its prompt."""
    device = next(model.parameters()).device
    input_ids, attn, pos, cmask, P = pad_batch(prompt_ids, completion_ids, pad_token_id)
    input_ids, attn, pos, cmask = input_ids.to(device), attn.to(device), pos.to(device), cmask.to(device)
    C = cmask.shape[1]
    with nullcontext() if grad else torch.no_grad():
        # Only positions P-1 … P+C-2 predict completion tokens; slice before the softmax to save memory.
        logits = model(input_ids=input_ids, attention_mask=attn, position_ids=pos, use_cache=False).logits
        logits = logits[:, P - 1:P - 1 + C, :].float()
        logp_all = logits.log_softmax(-1)
        targets = input_ids[:, P:P + C]
        logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1).masked_fill(~cmask, 0.0)
        entropy = None
        if with_entropy:
            entropy = -(logp_all.exp() * logp_all).sum(-1).masked_fill(~cmask, 0.0)
    return TokenLogprobs(logprobs=logp, mask=cmask, entropy=entropy)
