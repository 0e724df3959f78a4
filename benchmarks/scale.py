"""`rtrl bench scale`: the trainer at 1 and 2 ranks (torchrun, FSDP2) and rollout workers at 1 and 2
processes, in one run, with the CPU bound of the machine they ran on.

Trainer: mid-training steps of the tiny model (or ``model.dir``), the same global batches
(``midtrain.batch_tokens`` tokens of documents each) at 1 rank and at 2 ranks, one torch thread per
rank; samples/s is documents per second in the steady state (the first ``WARMUP`` steps excluded).
The two runs' loss curves are compared (``fsdp_loss_max_rel_diff``: max over the first ``CURVE_STEPS`` steps of |a - b| / max(|a|, |b|);
``..._all_steps`` over the whole run) and each rank reports the share of the parameters it holds.
Over tens of steps the curves part by ~1e-2: training amplifies the ~1e-7 differences of summation
order, and one process that accumulates each batch in two halves parts from the whole-batch run
just as much (docs/algorithms.md). Every run is a fresh process (``python -m benchmarks.scale
trainer ...``, under ``torchrun --standalone`` for 2 ranks) so that both pay the same start-up,
which is not timed.

Rollouts: ``rtrl rollout-worker`` processes (function-synthesis tasks, 4 prompts x 8 samples x
<= 32 tokens per batch, the shared-directory transport) sampling from a version in the registry's
rollout channel; tokens/s is the policy tokens of the batches that arrived within a timed window that starts
once every worker has delivered a first batch.

CPU bound (``cpu_floor``). On a machine with C cores, N processes can run at most min(N, C) times
as fast as one, and less when each needs more CPU per unit of work (communication, the other ranks'
share of the collectives). The bound reported for 2 processes is min(2, C) x (CPU seconds per
sample or token at 1) / (CPU seconds per sample or token at 2), from each run's own CPU
accounting: the speed-up the machine allows if nothing else ran on it. The load average at the start
and end of the run (recorded by rtrl/bench.py) says how far from that the machine was.

``model.device`` (e.g. ``RTRL_MODEL__DEVICE=cuda``) moves both to GPUs: torchrun's ranks then use one
GPU each (NCCL), so 2 ranks need 2 GPUs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from offline_rl.corpus import midtrain_batches
from offline_rl.midtrain import run_midtrain
from offline_rl.remote import BATCH_SUFFIX, decode_batch, rollout_registry
from policy.distributed import setup, shutdown
from policy.loading import ModelLoadError, check_model_dir, load_tokenizer
from rtrl.config import Settings, load_settings

WARMUP = 2
CURVE_STEPS = 5
"""The loss curves of 1 and 2 ranks are held to 1e-4 relative over this many steps (tests do the same)."""
PROMPTS, GROUP, MAX_TOKENS = 4, 8, 32
GOAL = 1.6


def _trainer_main(model_dir: str, out_json: str, steps: int) -> None:
    """One trainer run (this process, or each rank under torchrun); rank 0 writes ``out_json``."""

    work = Path(out_json).parent
    settings = load_settings(model={"dir": model_dir}, midtrain={
        "steps": steps, "warmup_steps": 2, "eval_at_end": False, "threads": 1,
        "out_dir": str(work / f"mid-{Path(out_json).stem}")})
    dp = setup(settings.distributed)
    # The documents of the timed steps: the corpus stream is seeded, so replaying it counts them.
    stream = midtrain_batches(load_tokenizer(model_dir), settings.midtrain, settings.tasks)
    sizes = [len(next(stream)) for _ in range(steps)]
    marks: list[tuple[float, float]] = []
    fraction: list[float] = []

    def on_step(step: int, model) -> None:
        marks.append((time.perf_counter(), time.process_time()))
        if not fraction:
            fraction.append(dp.param_fraction(model))

    run_midtrain(settings, progress=False, on_step=on_step)
    (t0, c0), (t1, c1) = marks[WARMUP - 1], marks[-1]
    samples = sum(sizes[WARMUP:])
    per_rank = dp.sum_dict({f"cpu{dp.rank}": c1 - c0, f"frac{dp.rank}": fraction[0]})
    if dp.is_main:
        losses = json.loads((work / f"mid-{Path(out_json).stem}" / "midtrain.json").read_text())["losses"]
        Path(out_json).write_text(json.dumps({
            "ranks": dp.world, "samples_per_s": samples / (t1 - t0), "losses": losses,
            "batch_tokens": settings.midtrain.batch_tokens, "samples_per_step": samples / (steps - WARMUP),
            "cpu_s_per_sample": sum(per_rank[f"cpu{r}"] for r in range(dp.world)) / samples,
            "param_fraction_per_rank": [round(per_rank[f"frac{r}"], 4) for r in range(dp.world)]}))
    shutdown()


def _trainer(model_dir: Path, work: Path, ranks: int, steps: int, log) -> dict[str, Any]:
    out = work / f"trainer-{ranks}.json"
    cmd = [sys.executable, "-m", "benchmarks.scale", "trainer", str(model_dir), str(out), str(steps)]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               "-m", "benchmarks.scale", *cmd[3:]]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "RTRL_VAR_DIR": str(work)}
    env.pop("RTRL_CONFIG", None)
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"trainer at {ranks} rank(s) failed: {proc.stderr[-2000:]}")
    result = json.loads(out.read_text())
    log(f"scale: trainer {ranks} rank(s): {result['samples_per_s']:.1f} samples/s, "
        f"{result['cpu_s_per_sample'] * 1000:.1f} ms CPU/sample")
    return result


def _rollouts(model_dir: Path, work: Path, workers: int, window_s: float, log) -> dict[str, Any]:
    """``workers`` rollout-worker processes; tokens/s over a window once each has sent a batch."""

    out = work / f"rollouts-{workers}"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
           "RTRL_REGISTRY__URL": str(work / "registry"), "RTRL_REGISTRY__CACHE_DIR": str(work / "cache"),
           "RTRL_ROLLOUT__DIR": str(out), "RTRL_ROLLOUT__TRANSPORT": "dir", "RTRL_ROLLOUT__BATCHES_PER_VERSION": "0",
           "RTRL_GRPO__PROMPTS_PER_STEP": str(PROMPTS), "RTRL_GRPO__GROUP_SIZE": str(GROUP),
           "RTRL_GRPO__MAX_NEW_TOKENS": str(MAX_TOKENS), "RTRL_REWARDS__REQUIRE_PASS": "false",
           "RTRL_ENV__KIND": "functions", "RTRL_VAR_DIR": str(work)}
    env.pop("RTRL_CONFIG", None)
    procs = [subprocess.Popen([sys.executable, "-m", "rtrl", "rollout-worker", "--worker-id", f"bench-{i}", "--json"],
                              env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for i in range(workers)]
    try:
        seen: set[str] = set()
        deadline = time.monotonic() + 600
        while len(seen) < workers:  # every worker has loaded the model and delivered a batch
            for f in out.glob(f"*{BATCH_SUFFIX}"):
                seen.add(f.name.split("-")[2])
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("rollout workers did not start")
            time.sleep(0.05)
        for f in out.glob(f"*{BATCH_SUFFIX}"):
            f.unlink()
        t0 = time.perf_counter()
        time.sleep(window_s)
        arrived = list(out.glob(f"*{BATCH_SUFFIX}"))
        elapsed = time.perf_counter() - t0
        tokens = sum(decode_batch(f.read_bytes(), 1 << 30)[2].tokens for f in arrived)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        stats = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    result = {"workers": workers, "tokens_per_s": tokens / elapsed, "batches": len(arrived),
              "cpu_s_per_token": sum(s["cpu_s"] for s in stats) / max(sum(s["tokens"] for s in stats), 1)}
    log(f"scale: {workers} rollout worker(s): {result['tokens_per_s']:.0f} tokens/s over {elapsed:.1f} s "
        f"({len(arrived)} batches), {result['cpu_s_per_token'] * 1000:.2f} ms CPU/token")
    return result


def _model_dir(settings: Settings, work: Path) -> Path:
    try:
        return check_model_dir(settings.model.dir)
    except ModelLoadError:
        from offline_rl.corpus import build_default_model

        return build_default_model(work / "tiny", settings.tiny.model_copy(update={"corpus_examples": 2000}))


def _bound(cores: int, cpu_one: float, cpu_two: float) -> float:
    return round(min(2, cores) * cpu_one / cpu_two, 3)


def run(settings: Settings, quick: bool, log) -> dict[str, Any]:
    steps, window_s = (6, 6.0) if quick else (30, 30.0)
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-scale-") as tmp:
        work = Path(tmp)
        model_dir = _model_dir(settings, work)
        trainer = [_trainer(model_dir, work, r, steps + WARMUP, log) for r in (1, 2)]
        s = settings.model_copy(deep=True)
        s.registry.url, s.registry.cache_dir = str(work / "registry"), str(work / "cache")
        registry = rollout_registry(s)
        registry.promote(registry.publish(str(model_dir), stage="rollout").id, s.rollout.channel)
        rollout = [_rollouts(model_dir, work, w, window_s, log) for w in (1, 2)]
    one, two = trainer
    diffs = [abs(a - b) / max(abs(a), abs(b)) for a, b in zip(one["losses"], two["losses"], strict=True)]
    t_speedup = two["samples_per_s"] / one["samples_per_s"]
    r_speedup = rollout[1]["tokens_per_s"] / rollout[0]["tokens_per_s"]
    return {
        "trainer": {"ranks": [1, 2], "samples_per_s": [round(t["samples_per_s"], 2) for t in trainer],
                    "speedup": round(t_speedup, 3), "batch_tokens": one["batch_tokens"],
                    "samples_per_step": round(one["samples_per_step"], 1), "timed_steps": steps,
                    "what": "mid-training steps, one torch thread per rank"},
        "rollout": {"workers": [1, 2], "tokens_per_s": [round(r["tokens_per_s"], 1) for r in rollout],
                    "speedup": round(r_speedup, 3), "window_s": window_s,
                    "shape": f"{PROMPTS} prompts x {GROUP} samples x <= {MAX_TOKENS} tokens"},
        "fsdp_loss_max_rel_diff": max(diffs[:CURVE_STEPS]),
        "fsdp_loss_max_rel_diff_all_steps": max(diffs),
        "param_fraction_per_rank": two["param_fraction_per_rank"],
        "cpu_floor": {
            "cores": cores,
            "trainer_cpu_ms_per_sample": [round(t["cpu_s_per_sample"] * 1000, 3) for t in trainer],
            "rollout_cpu_ms_per_token": [round(r["cpu_s_per_token"] * 1000, 4) for r in rollout],
            "trainer_speedup_bound": _bound(cores, one["cpu_s_per_sample"], two["cpu_s_per_sample"]),
            "rollout_speedup_bound": _bound(cores, rollout[0]["cpu_s_per_token"], rollout[1]["cpu_s_per_token"]),
        },
        "goal_speedup": GOAL,
        "goal_met": {"trainer": t_speedup >= GOAL, "rollout": r_speedup >= GOAL},
        "device": settings.model.device,
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["trainer"]:
        _trainer_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit("usage: python -m benchmarks.scale trainer MODEL_DIR OUT_JSON STEPS (see `rtrl bench scale`)")
