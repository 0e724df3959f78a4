"""Mid-training: continued next-token (causal LM) training on the domain corpus.

Standard maximum-likelihood language modelling over whole documents (function documents and agent
transcripts, :mod:`offline_rl.corpus`), AdamW with linear warm-up and cosine decay to
``min_lr_ratio`` of the peak. Departures from large-scale practice: documents are not packed into
fixed-length rows (a batch is filled to a token budget with documents of similar length, so little
is padding and positions start at 0 as they do at inference), and every token of a transcript is
trained on, the environment's text included, as in ordinary language modelling of logs.

:func:`continue_midtrain` is the matched-compute control of the learning benchmark: the same
corpus and loss for a given number of seconds, from a mid-trained checkpoint, with a warm restart
(cosine from ``control_lr_ratio`` of the peak down to ``min_lr_ratio``, over the time budget).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from offline_rl.config import OfflineSettings
from offline_rl.corpus import Row, midtrain_batches, token_batches
from offline_rl.demos import Segment
from offline_rl.evaluate import evaluate_settings
from policy.distributed import DataParallel, setup
from policy.loading import load_policy
from policy.routing import geometry_of


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


def pad_rows(rows: list[Row], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, mask, trained)`` for a batch of documents: ``mask`` marks real tokens,
    ``trained`` the real tokens whose prediction is trained."""
    width = max(len(x) for x in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    trained = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, x in enumerate(rows):
        input_ids[i, :len(x)] = torch.tensor(x.ids)
        mask[i, :len(x)] = True
        trained[i, :len(x)] = torch.tensor(x.trained)
    return input_ids, mask, trained


def lm_loss(model, input_ids: torch.Tensor, mask: torch.Tensor, trained: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy over the real (unpadded) positions, or those of them ``trained``
    marks; a mixture-of-experts model adds its configured load-balancing loss
    (``router_aux_loss_coef`` x the Switch Transformer loss over real tokens)."""
    coef = getattr(model.config, "router_aux_loss_coef", 0.0) if geometry_of(model) is not None else 0.0
    out = model(input_ids=input_ids, attention_mask=mask.long(), use_cache=False,
                **({"output_router_logits": True} if coef else {}))
    logits = out.logits[:, :-1].float()
    target = input_ids[:, 1:]
    tmask = (mask if trained is None else trained)[:, 1:]
    loss = F.cross_entropy(logits[tmask], target[tmask])
    return loss + coef * out.aux_loss if coef else loss


def _loop(model, opt, batches: Iterator[list[Row]], pad_id: int, device: str, lr_at: Callable[[int, float], float],
          done: Callable[[int, float], bool], bar, on_step: Callable[[int, object], None] | None,
          dp: DataParallel) -> list[float]:
    """Train until ``done(step, elapsed_s)``; ``lr_at(step, elapsed_s)`` gives each step's LR.

    With several ranks every rank reads the same global batch and trains on its rows
    (policy/distributed.py); rank 0's clock decides the LR and the end, for every rank."""
    losses: list[float] = []
    step, t0 = 0, time.perf_counter()
    while True:
        stop, lr = dp.broadcast((done(step, time.perf_counter() - t0), lr_at(step, time.perf_counter() - t0)))
        if stop:
            break
        for group in opt.param_groups:
            group["lr"] = lr
        batch = next(batches, None)
        if batch is None:
            raise ValueError(f"the mid-training documents ran out after {step} steps")
        rows = dp.rows(batch)
        opt.zero_grad(set_to_none=True)
        dp.begin_backward(model)
        loss_value = 0.0
        if rows:
            input_ids, mask, trained = pad_rows(rows, pad_id)
            # This rank's part of the global token mean (1 in one process).
            share = trained[:, 1:].sum().item() / sum(sum(r.trained[1:]) for r in batch) if dp.enabled else 1.0
            loss = lm_loss(model, input_ids.to(device), mask.to(device), trained.to(device)) * share
            loss.backward()
            loss_value = loss.item()
        dp.end_backward(model)
        dp.clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        losses.append(dp.sum(loss_value))
        step += 1
        if on_step is not None:
            on_step(step, model)
        bar.update(1)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr:.2e}")
    return losses


def run_midtrain(settings: OfflineSettings, init_dir: str | Path | None = None, out_dir: str | Path | None = None,
                 progress: bool = True, log: Callable[[str], None] | None = None,
                 on_step: Callable[[int, object], None] | None = None, *, seconds: float | None = None,
                 documents: Iterable[list[Segment]] | None = None) -> Path:
    """Train from ``init_dir`` (default ``model.dir``) and save an HF directory; returns its path.

    ``midtrain.steps`` steps on the configured schedule, or, with ``seconds``, the control's warm
    restart for that long (see the module docstring). Writes ``midtrain.json`` beside the weights
    (loss summary, steps, seconds and, with ``eval_at_end``, held-out success). ``on_step(step,
    model)`` is called after every optimizer step. The loop runs on ``midtrain.threads``; the
    caller's torch thread count is restored on return or error. ``documents``: train on these
    instead of the configured corpus (e.g. :func:`offline_rl.demos.task_transcripts` of one task
    set); they must last for every step.

    Under torchrun (``distributed``) every rank trains on its rows of each global batch with FSDP2
    (policy/distributed.py); rank 0 writes the directory and ``midtrain.json`` and evaluates, the
    other ranks return once the weights are saved."""
    caller_threads = torch.get_num_threads()
    try:
        return _midtrain(settings, init_dir, out_dir, progress, log, on_step, seconds, documents)
    finally:
        torch.set_num_threads(caller_threads)


def _midtrain(settings: OfflineSettings, init_dir: str | Path | None, out_dir: str | Path | None, progress: bool,
              log: Callable[[str], None] | None, on_step: Callable[[int, object], None] | None,
              seconds: float | None, documents: Iterable[list[Segment]] | None) -> Path:
    cfg = settings.midtrain
    dp = setup(settings.distributed, settings.model.device)
    threads = cfg.threads or max(1, len(os.sched_getaffinity(0)) // dp.local_world)
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    policy = load_policy(init_dir or settings.model.dir, "float32", dp.device)
    model, tok = dp.shard(policy.model), policy.tokenizer
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    batches = (midtrain_batches(tok, cfg, settings.tasks) if documents is None
               else token_batches(tok, documents, cfg.batch_tokens))
    if seconds is None:
        def lr_at(step: int, _elapsed: float) -> float:
            return cfg.lr * lr_factor(step, cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio)

        def done(step: int, _elapsed: float) -> bool:
            return step >= cfg.steps
        bar = tqdm(total=cfg.steps, desc="midtrain", disable=not progress or not dp.is_main, dynamic_ncols=True)
    else:
        peak = cfg.lr * cfg.control_lr_ratio

        def lr_at(_step: int, elapsed: float) -> float:
            p = min(1.0, elapsed / seconds)
            return cfg.lr * cfg.min_lr_ratio + (peak - cfg.lr * cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))

        def done(_step: int, elapsed: float) -> bool:
            return elapsed >= seconds
        bar = tqdm(desc="midtrain (control)", disable=not progress or not dp.is_main, dynamic_ncols=True)
    t0 = time.perf_counter()
    with bar:
        losses = _loop(model, opt, batches, tok.pad_token_id, policy.device, lr_at, done, bar, on_step, dp)
    train_s = time.perf_counter() - t0
    # Evaluation samples in small batches next to the sandbox's processes: model.threads, as everywhere else.
    torch.set_num_threads(settings.model.threads)
    model.eval()
    out = dp.save_pretrained(model, tok, Path(out_dir or cfg.out_dir))
    if not dp.is_main:
        return out
    summary = {"steps": len(losses), "batch_tokens": cfg.batch_tokens, "lr": cfg.lr, "train_s": train_s,
               "threads": threads, "ranks": dp.world, "losses": losses, "control_seconds": seconds,
               "loss_first": losses[0] if losses else None,
               "loss_last": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
               "init_dir": str(policy.model_dir)}
    if cfg.eval_at_end:
        # Rank 0 alone evaluates, the other ranks have left: on a plain copy of what it saved.
        model = load_policy(out, "float32", policy.device).model if dp.enabled else model
        ev = evaluate_settings(settings, model, tok, temperature=settings.eval.temperature)
        summary["heldout_pass_at_1"] = ev.pass_at_1
        summary["heldout_pass_at_k"] = {str(k): v for k, v in ev.pass_at_k.items()}
        if log:
            log(f"midtrain: held-out success {ev.pass_at_1:.3f} ({ev.n_tasks} tasks x {ev.samples})")
    (out / "midtrain.json").write_text(json.dumps(summary, indent=2))
    if log and losses:
        log(f"midtrain: {len(losses)} steps in {train_s:.0f}s, loss {losses[0]:.3f} -> "
            f"{summary['loss_last']:.3f}; saved {out}")
    return out


def midtrain_record(model_dir: str | Path) -> dict:
    """The ``midtrain.json`` that :func:`run_midtrain` wrote beside ``model_dir``'s weights; empty for a
    model it did not make."""
    path = Path(model_dir) / "midtrain.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def continue_midtrain(settings: OfflineSettings, init_dir: str | Path, out_dir: str | Path, seconds: float,
                      progress: bool = True, log: Callable[[str], None] | None = None) -> Path:
    """The matched-compute control: ``seconds`` more mid-training from ``init_dir`` (module docstring)."""
    return run_midtrain(settings, init_dir=init_dir, out_dir=out_dir, progress=progress, log=log, seconds=seconds)
