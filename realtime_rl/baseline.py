"""Baselines b(x) for single-rollout REINFORCE: A_i = r_i − b(x_i).

* ``bucket_mean`` (default): the running mean reward of the task bucket, persisted in ``baselines``
  (sum and count over every update so far). The baseline of example i is the *leave-one-out* mean
  over the history plus this batch without i::

      b_i = (S_hist + S_batch(bucket_i) − r_i) / (N_hist + N_batch(bucket_i) − 1)

  so b_i never depends on r_i (the gradient stays unbiased) while still using the fresh batch, which
  matters after a release shifted the reward distribution. A bucket with no other observation gets
  ``baseline_prior``.
* ``value_head``: a linear value head V(x) = w·h(x) + c on the serving model's last-prompt-token hidden
  state, fitted by ridge regression on the batch rewards, cross-fitted over two folds so the head
  that scores example i never saw r_i. A departure from the usual jointly trained value network:
  a closed-form fit on frozen features is exact, fast, and cannot destabilise the policy update.

With the bucket mean, the **caller-centred** term (:func:`caller_centred`) adds each caller's own mean
residual: b_i += Σ_{j∈c(i), j≠i} (r_j − m_{b(j)}) / (n_c(i) − 1 + k). A caller who rejects (or accepts)
everything has residuals that are all alike, so its advantages shrink towards 0 as its count grows:
it cannot steer the update, and a strict or lenient honest user's bias is removed the same way. Like
the bucket mean it is leave-one-out, so b_i does not depend on r_i. Kept-text examples (not draws of
any version) neither enter these means nor are left out of them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import sqlalchemy as sa
import torch

from policy.logprobs import pad_batch
from realtime_rl.dataset import TrainingExample
from realtime_rl.release_tables import baselines


@dataclass
class BucketStats:
    reward_sum: float = 0.0
    count: float = 0.0


def load_bucket_stats(conn: sa.Connection) -> dict[str, BucketStats]:
    rows = conn.execute(sa.select(baselines.c.bucket, baselines.c.reward_sum, baselines.c.count))
    return {b: BucketStats(s, n) for b, s, n in rows}


def bucket_mean_advantages(examples: Sequence[TrainingExample], history: dict[str, BucketStats],
                           prior: float = 0.0) -> tuple[list[float], list[float]]:
    """(advantages, baselines) with the leave-one-out running mean per bucket (see module docstring)."""
    batch: dict[str, BucketStats] = defaultdict(BucketStats)
    for e in examples:
        if e.source == "served":
            batch[e.bucket].reward_sum += e.reward
            batch[e.bucket].count += 1
    adv, base = [], []
    for e in examples:
        h = history.get(e.bucket, BucketStats())
        own = e.source == "served"
        s = h.reward_sum + batch[e.bucket].reward_sum - (e.reward if own else 0.0)
        n = h.count + batch[e.bucket].count - own
        b = s / n if n > 0 else prior
        base.append(b)
        adv.append(e.reward - b)
    return adv, base


def caller_centred(examples: Sequence[TrainingExample], history: dict[str, BucketStats], prior: float,
                   prior_count: float) -> tuple[list[float], list[float]]:
    """(advantages, baselines): the bucket mean plus the caller's own mean residual, both leave-one-out.

    b_i = m_{b(i)}^{−i} + Σ_{j∈c(i), j≠i} (r_j − m_{b(j)}^{−i}) / (n_{c(i)} − 1 + k), where m_b^{−i} is
    bucket b's running mean without example i; so no part of b_i depends on r_i."""
    sums: dict[str, BucketStats] = {b: BucketStats(h.reward_sum, h.count) for b, h in history.items()}
    cells: dict[str, dict[str, BucketStats]] = defaultdict(lambda: defaultdict(BucketStats))
    for e in examples:
        if e.source == "served":
            sums.setdefault(e.bucket, BucketStats())
            sums[e.bucket].reward_sum += e.reward
            sums[e.bucket].count += 1
            cells[e.example.caller][e.bucket].reward_sum += e.reward
            cells[e.example.caller][e.bucket].count += 1

    def mean_without(bucket: str, r: float | None) -> float:
        st = sums.get(bucket, BucketStats())
        n = st.count - (r is not None)
        return (st.reward_sum - (r or 0.0)) / n if n > 0 else prior

    adv, base = [], []
    for e in examples:
        own = e.reward if e.source == "served" else None
        resid, n = 0.0, 0.0
        for bucket, st in cells[e.example.caller].items():
            same = own is not None and bucket == e.bucket
            k = st.count - same
            if k > 0:
                m = mean_without(bucket, own if bucket == e.bucket else None)
                resid += st.reward_sum - (own if same else 0.0) - k * m
                n += k
        b = mean_without(e.bucket, own) + (resid / (n + prior_count) if n > 0 and n + prior_count > 0 else 0.0)
        base.append(b)
        adv.append(e.reward - b)
    return adv, base


def merge_batch(history: dict[str, BucketStats], examples: Sequence[TrainingExample]) -> dict[str, BucketStats]:
    """The persisted bucket means plus this batch's served examples (kept texts are no draws)."""
    out = {k: BucketStats(v.reward_sum, v.count) for k, v in history.items()}
    for e in (e for e in examples if e.source == "served"):
        st = out.setdefault(e.bucket, BucketStats())
        st.reward_sum += e.reward
        st.count += 1
    return out


def save_bucket_stats(conn: sa.Connection, stats: dict[str, BucketStats]) -> None:
    """Replace the persisted baseline (called inside the run-record transaction, so a killed run
    never counts its batch twice or half)."""
    now = datetime.now(UTC)
    conn.execute(sa.delete(baselines))
    if stats:
        conn.execute(sa.insert(baselines), [
            {"bucket": b, "reward_sum": st.reward_sum, "count": st.count, "updated_at": now}
            for b, st in sorted(stats.items())])


def value_head_advantages(model, examples: Sequence[TrainingExample], l2: float = 1.0,
                          pad_token_id: int = 0) -> tuple[list[float], list[float]]:
    """Cross-fitted ridge value head on frozen last-prompt-token features (see module docstring)."""

    if len(examples) < 4:
        raise ValueError("the value-head baseline needs at least 4 examples")
    prompts = [e.example.prompt_token_ids for e in examples]
    feats = []
    dev = next(model.parameters()).device
    with torch.no_grad():
        for i in range(0, len(prompts), 64):
            chunk = prompts[i:i + 64]
            ids, attn, pos, _, _ = pad_batch(chunk, [[] for _ in chunk], pad_token_id)
            out = model(input_ids=ids.to(dev), attention_mask=attn.to(dev), position_ids=pos.to(dev),
                        output_hidden_states=True, use_cache=False)
            feats.append(out.hidden_states[-1][:, -1, :].float().cpu())  # prompts are left-padded
    x = torch.cat(feats)
    x = torch.cat([x, torch.ones(len(x), 1)], dim=1)
    r = torch.tensor([e.reward for e in examples], dtype=torch.float32)
    fold = torch.arange(len(examples)) % 2
    pred = torch.empty_like(r)
    for k in (0, 1):
        fit, use = fold != k, fold == k
        xf = x[fit]
        reg = l2 * torch.eye(x.shape[1])
        reg[-1, -1] = 0.0  # the intercept is not shrunk
        w = torch.linalg.solve(xf.T @ xf + reg, xf.T @ r[fit])
        pred[use] = x[use] @ w
    base = pred.tolist()
    return [e.reward - b for e, b in zip(examples, base, strict=True)], base
