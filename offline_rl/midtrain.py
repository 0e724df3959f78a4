"""Mid-training: continued next-token (causal LM) training on the domain corpus.

Standard maximum-likelihood language modelling over whole documents (prompt and answer), AdamW with
linear warm-up and cosine decay to ``min_lr_ratio`` of the peak. Departure from large-scale practice:
documents are not packed into fixed-length sequences (they are ~40 tokens; right-padding a batch of
them wastes little and keeps positions identical to what the sampler sees at inference).
Held-out functions never appear in the corpus (:func:`offline_rl.tasks.corpus` draws train-split
functions only).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from rtrl.config import Settings


def lr_factor(step: int, total: int, warmup: int, min_ratio: float, schedule: str = "cosine") -> float:
    """Multiplier of the peak LR at ``step`` (0-based): linear warm-up, then the schedule."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


ANSWER_MARK = "return "


def doc_ids(tokenizer, doc: str) -> list[int]:
    """Token ids of a document, with the prompt and the answer tokenized *separately*.

    At inference the prompt ends with ``return `` and the answer is generated after it; tokenized as
    one string, `` x`` would merge into one token and the model would never learn to continue a
    prompt that ends in a bare space token."""
    cut = doc.rfind(ANSWER_MARK)
    if cut < 0:
        return tokenizer(doc, add_special_tokens=False)["input_ids"]
    cut += len(ANSWER_MARK)
    return (tokenizer(doc[:cut], add_special_tokens=False)["input_ids"]
            + tokenizer(doc[cut:], add_special_tokens=False)["input_ids"])


def lm_batch(tokenizer, docs: list[str]):
    import torch

    ids = [doc_ids(tokenizer, d) for d in docs]
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.bool)
    for i, x in enumerate(ids):
        input_ids[i, :len(x)] = torch.tensor(x)
        mask[i, :len(x)] = True
    return input_ids, mask


def lm_loss(model, input_ids, mask):
    import torch.nn.functional as F

    logits = model(input_ids=input_ids, attention_mask=mask.long(), use_cache=False).logits[:, :-1].float()
    target = input_ids[:, 1:]
    tmask = mask[:, 1:]
    return F.cross_entropy(logits[tmask], target[tmask])


def run_midtrain(settings: Settings, init_dir: str | Path | None = None, out_dir: str | Path | None = None,
                 progress: bool = True, log: Callable[[str], None] | None = None,
                 on_step: Callable[[int, object], None] | None = None) -> Path:
    """Train from ``init_dir`` (default ``model.dir``) and save an HF directory; returns its path.

    Writes ``midtrain.json`` beside the weights (loss curve summary and, with ``eval_at_end``, the
    held-out pass@1). ``on_step(step, model)`` is called after every optimizer step (calibration runs
    evaluate intermediate points with it).

    The training loop runs on ``midtrain.threads``; the caller's torch thread count is restored on
    return or error."""
    import torch

    caller_threads = torch.get_num_threads()
    try:
        return _midtrain(settings, init_dir, out_dir, progress, log, on_step)
    finally:
        torch.set_num_threads(caller_threads)


def _midtrain(settings: Settings, init_dir: str | Path | None, out_dir: str | Path | None, progress: bool,
              log: Callable[[str], None] | None, on_step: Callable[[int, object], None] | None) -> Path:
    import torch
    from tqdm import tqdm

    from offline_rl.tasks import corpus
    from policy.loading import load_policy

    cfg = settings.midtrain
    threads = cfg.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    policy = load_policy(init_dir or settings.model.dir, "float32", settings.model.device)
    model, tok = policy.model, policy.tokenizer
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    docs = corpus(cfg.steps * cfg.batch_size, seed=cfg.seed, heldout_fraction=settings.tasks.heldout_fraction)
    t0 = time.perf_counter()
    losses = []
    bar = tqdm(range(cfg.steps), desc="midtrain", disable=not progress, dynamic_ncols=True)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_factor(step, cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio)
        batch = [next(docs) for _ in range(cfg.batch_size)]
        input_ids, mask = lm_batch(tok, batch)
        loss = lm_loss(model, input_ids.to(policy.device), mask.to(policy.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step + 1, model)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{opt.param_groups[0]['lr']:.2e}")
    # Evaluation samples in small batches next to the sandbox's processes: model.threads, as everywhere else.
    torch.set_num_threads(settings.model.threads)
    model.eval()
    out = Path(out_dir or cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    summary = {"steps": cfg.steps, "batch_size": cfg.batch_size, "lr": cfg.lr, "train_s": time.perf_counter() - t0,
               "threads": threads,
               "loss_first": losses[0], "loss_last": sum(losses[-10:]) / len(losses[-10:]), "init_dir": str(policy.model_dir)}
    if cfg.eval_at_end:
        from offline_rl.evaluate import evaluate
        from offline_rl.grpo import load_task_split

        split = load_task_split(settings)
        ev = evaluate(model, tok, split.heldout, samples=settings.eval.samples, k=settings.eval.k,
                      temperature=settings.eval.temperature, seed=settings.grpo.seed)
        summary["heldout_pass_at_1"] = ev.pass_at_1
        summary["heldout_pass_at_k"] = {str(k): v for k, v in ev.pass_at_k.items()}
        if log:
            log(f"midtrain: held-out pass@1 {ev.pass_at_1:.3f} ({ev.n_tasks} tasks x {ev.samples})")
    (out / "midtrain.json").write_text(json.dumps(summary, indent=2))
    if log:
        log(f"midtrain: {cfg.steps} steps in {summary['train_s']:.0f}s, loss {summary['loss_first']:.3f} -> "
            f"{summary['loss_last']:.3f}; saved {out}")
    return out
