"""`rtrl bench registry`: delta compression of a simulated RL fine-tuning sequence.

Setup: a Llama built from a transformers config with random init (34M parameters; ``--quick``: 5M),
fp32 master weights, AdamW (weight decay 0.01), each version cast to bf16 as it would be served.
The update is a simulated policy-gradient step: ``-(A * log p(tokens))`` on random token sequences
with random per-sequence advantages A, which gives gradients of the shape and scale of an RL step
without needing a task. For each learning rate the optimizer first takes ``WARMUP`` steps (Adam's
first step moves every weight by exactly ``lr``, which is not what a run in progress looks like),
then versions are cut after 1, 5 and 20 further steps; each cell is the delta from the previous
version to the new one.

Per cell:

- ``ratio``: raw bf16 bytes / bytes of the delta files the registry writes (``ratio_with_manifest``
  also counts the manifest, which is a fixed ~200 bytes per tensor).
- ``entropy_bound_ratio``: raw bytes / the order-0 entropy of the delta, i.e. the sum over tensors of
  ``n * H(z)`` bits where ``z`` is the per-element zigzag difference of the bit patterns (0 for an
  unchanged element) and ``H`` its empirical entropy in that tensor. It is the size an ideal coder
  that codes each element independently with the tensor's own symbol statistics (and a free model)
  would reach; ``gap_to_bound`` = bound ratio / ratio.
- ``zstd_full_ratio``: raw bytes / zstd (level 3) of the full bf16 snapshot, the naive baseline.
- ``encode_MBps``: raw MB per second through the registry's delta encoder on ``threads`` threads
  (median of 3); ``publish_MBps`` adds SHA-256 of every tensor and the fsynced write.
- ``decode_MBps``: raw MB per second rebuilding the version from its parent's state through the
  registry's decode path (read files, CRCs, decode, SHA-256 check of every changed tensor; median
  of 3).
- ``*_MBps_per_cpu_s``: the same work per CPU-second summed over threads: what one core sustains,
  independent of other load on a shared machine (wall-clock MB/s on an idle machine with T free
  cores is about T times this, since chunks spread evenly over threads).
- ``bit_exact``: the rebuilt tensors equal the published bits, element for element.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import zstandard
from transformers import LlamaConfig, LlamaForCausalLM

from policy.registry import Registry
from policy.registry.codec import zigzag
from policy.registry.materialize import decode_state
from policy.registry.publish import encode_delta
from policy.registry.tensors import from_torch, to_torch
from policy.registry.workers import pmap

WARMUP = 3


def _model(quick: bool, seed: int):
    torch.manual_seed(seed)
    if quick:
        cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                          tie_word_embeddings=False)
    else:
        cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                          tie_word_embeddings=False)
    return LlamaForCausalLM(cfg), cfg


def _rl_step(model, opt, vocab_size: int, gen) -> None:
    """One simulated policy-gradient step: -(A * log p(tokens)) on random sequences, random advantages."""

    ids = torch.randint(0, vocab_size, (4, 64), generator=gen)
    logits = model(ids).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    advantages = torch.randn(4, 1, generator=gen)
    loss = -(advantages * logp).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _bf16_bits(model) -> dict[str, Any]:
    return {n: from_torch(n, p.detach().to(torch.bfloat16), copy=True) for n, p in model.named_parameters()}


def _entropy_bytes(new, old) -> float:
    z = zigzag(new.bits, old.bits)
    counts = np.bincount(z, minlength=1).astype(np.float64)
    counts = counts[counts > 0]
    p = counts / counts.sum()
    return float(-(counts * np.log2(p)).sum() / 8)


def _zstd_full(state, workers: int) -> int:
    def one(tb) -> int:
        return len(zstandard.ZstdCompressor(level=3).compress(memoryview(tb.bits).cast("B")))

    return sum(pmap(one, list(state.values()), workers))


def _median_time(fn: Callable[[], Any], repeats: int = 3) -> tuple[float, float, Any]:
    """Median wall seconds, median CPU seconds (all threads of this process), last result."""
    wall, cpu, out = [], [], None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu), out


def _cell(reg, prev_id: str, prev_state, cur_state, lr: float, steps: int, workers: int) -> dict[str, Any]:
    raw = sum(tb.nbytes for tb in cur_state.values())
    encode_s, encode_cpu_s, enc = _median_time(lambda: encode_delta(reg, cur_state, prev_state))
    t0 = time.perf_counter()
    sd = {n: to_torch(tb) for n, tb in cur_state.items()}
    info = reg.publish(sd, parent=prev_id, stage="bench", metrics={"lr": lr, "steps": steps})
    publish_s = time.perf_counter() - t0
    if info.kind != "delta":
        raise RuntimeError(f"bench version stored as {info.kind}, expected a delta")
    m = reg.manifest(info.id)
    delta_bytes = sum(f.bytes for f in m.weight_files())
    manifest_bytes = reg.store.size(f"versions/{info.id}/manifest.json")
    decode_s, decode_cpu_s, rebuilt = _median_time(
        lambda: decode_state(reg, info.id, known={prev_id: prev_state}, use_caches=False))
    bit_exact = set(rebuilt) == set(cur_state) and all(
        np.array_equal(rebuilt[n].bits, cur_state[n].bits) for n in cur_state)
    bound = sum(_entropy_bytes(cur_state[n], prev_state[n]) for n in cur_state)
    changed = sum(int(np.count_nonzero(cur_state[n].bits != prev_state[n].bits)) for n in cur_state)
    elements = sum(tb.bits.size for tb in cur_state.values())
    modes: dict[str, int] = {}
    for st in enc.chunk_stats:
        key = {0: "same", 1: "sparse", 2: "dense", 3: "raw"}[st.mode]
        modes[key] = modes.get(key, 0) + 1
    ratio = raw / delta_bytes
    bound_ratio = raw / bound if bound > 0 else float("inf")
    return {
        "lr": lr, "steps": steps, "version": info.id,
        "changed_fraction": round(changed / elements, 5),
        "ratio": round(ratio, 2),
        "ratio_with_manifest": round(raw / (delta_bytes + manifest_bytes), 2),
        "entropy_bound_ratio": round(bound_ratio, 2),
        "gap_to_bound": round(bound_ratio / ratio, 3),
        "zstd_full_ratio": round(raw / _zstd_full(cur_state, workers), 3),
        "encode_MBps": round(raw / encode_s / 1e6, 1),
        "encode_MBps_per_cpu_s": round(raw / encode_cpu_s / 1e6, 1),
        "publish_MBps": round(raw / publish_s / 1e6, 1),
        "decode_MBps": round(raw / decode_s / 1e6, 1),
        "decode_MBps_per_cpu_s": round(raw / decode_cpu_s / 1e6, 1),
        "delta_bytes": delta_bytes,
        "chunk_modes": modes,
        "bit_exact": bool(bit_exact),
    }


def run(settings, quick: bool, log: Callable[[str], None]) -> dict[str, Any]:
    torch.set_num_threads(settings.model.threads)
    lrs = [1e-6, 1e-5] if quick else [1e-6, 3e-6, 1e-5]
    step_counts = [1, 5] if quick else [1, 5, 20]
    model, cfg = _model(quick, seed=0)
    params = sum(p.numel() for p in model.parameters())
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    log(f"model: Llama {params / 1e6:.1f}M parameters, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers")
    cells: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-registry-") as tmp:
        reg = Registry.from_settings(settings.registry, url=f"{tmp}/registry", cache_dir=f"{tmp}/cache",
                                     snapshot_every=1000, shard_mb=settings.registry.shard_mb)
        workers = reg.workers
        gen = torch.Generator().manual_seed(1)
        for lr in lrs:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(base[n])
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

            def step(opt=opt) -> None:
                _rl_step(model, opt, cfg.vocab_size, gen)

            for _ in range(WARMUP):
                step()
            prev_state = _bf16_bits(model)
            prev = reg.publish({n: to_torch(tb) for n, tb in prev_state.items()}, stage="bench", snapshot=True)
            for steps in step_counts:
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                train_s = time.perf_counter() - t0
                cur_state = _bf16_bits(model)
                cell = _cell(reg, prev.id, prev_state, cur_state, lr, steps, workers)
                cell["train_s"] = round(train_s, 2)
                cells.append(cell)
                log(f"lr {lr:g} steps {steps:>2}: {cell['changed_fraction'] * 100:5.2f}% changed, ratio "
                    f"{cell['ratio']:6.1f}x (bound {cell['entropy_bound_ratio']:6.1f}x, gap "
                    f"{cell['gap_to_bound']:.2f}), zstd full {cell['zstd_full_ratio']:.2f}x, encode "
                    f"{cell['encode_MBps']:.0f} MB/s ({cell['encode_MBps_per_cpu_s']:.0f}/cpu-s), decode "
                    f"{cell['decode_MBps']:.0f} MB/s, "
                    f"bit_exact {cell['bit_exact']}")
                prev = reg.info(cell["version"])
                prev_state = cur_state
    by = {(c["lr"], c["steps"]): c for c in cells}
    goals: dict[str, bool] = {
        "bit_exact_everywhere": all(c["bit_exact"] for c in cells),
        "within_1.5x_of_bound_everywhere": all(c["gap_to_bound"] <= 1.5 for c in cells),
        "encode_300MBps_everywhere": all(c["encode_MBps"] >= 300 for c in cells),
    }
    if (3e-6, 1) in by:
        goals["ratio_30x_at_3e-6_1step"] = by[(3e-6, 1)]["ratio"] >= 30
    if (1e-6, 1) in by:
        goals["ratio_60x_at_1e-6_1step"] = by[(1e-6, 1)]["ratio"] >= 60
    return {
        "params": params,
        "threads": workers,
        "train_threads": settings.model.threads,
        "dtype": "bfloat16",
        "warmup_steps": WARMUP,
        "zstd_level": settings.registry.zstd_level,
        "quick": quick,
        "cells": cells,
        "goals": goals,
    }
