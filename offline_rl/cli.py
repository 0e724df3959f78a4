"""`rtrl midtrain`, `rtrl grpo`, `rtrl rollout-worker`, `rtrl eval`, `rtrl tasks export`: the offline stage's commands."""

from __future__ import annotations

import json

import typer

from policy.cli_settings import settings_or_exit

PRESET_HELP = "Settings preset applied on top of the config: 'fast' (CI, offline stage in a few minutes)."

tasks_app = typer.Typer(help="Tasks: export the built-in generators' splits as JSONL.",
                        no_args_is_help=True)


def init_model(
    ctx: typer.Context,
    out: str | None = typer.Option(None, "--out", "-o", help="Output directory (default: model.dir)."),
    seed: int | None = typer.Option(None, help="Seed (default: tiny.seed). Same seed, same model."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing model directory."),
    moe: bool = typer.Option(False, "--moe", help="Build the mixture-of-experts variant (Qwen3-MoE: "
                             "tiny.moe_experts experts per layer, tiny.moe_top_k per token); its sampled "
                             "completions carry their routes and every trainer can replay them."),
    config: str | None = typer.Option(None, "--config", "-c", help="TOML settings file."),
) -> None:
    """Build the tiny default model: a Llama config (with --moe a Qwen3-MoE config) and a byte-level BPE
    tokenizer trained on the code corpus. Nothing is downloaded; the same seed gives the same model."""
    from pathlib import Path

    from offline_rl.corpus import build_default_model
    from policy.tiny import parameter_count

    settings = settings_or_exit(ctx, config)
    cfg = settings.tiny if seed is None else settings.tiny.model_copy(update={"seed": seed})
    target = Path(out or settings.model.dir)
    if (target / "config.json").exists() and not force:
        typer.echo(f"{target} already holds a model; pass --force to rebuild it", err=True)
        raise typer.Exit(1)
    try:
        build_default_model(target, cfg, moe=moe)
    except ValueError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None
    from policy.loading import load_policy
    from policy.routing import geometry_of

    policy = load_policy(target)
    g = geometry_of(policy.model)
    kind = f", {g.layers} MoE layers of {g.experts} experts (top-{g.top_k})" if g is not None else ""
    typer.echo(f"built {target}: {parameter_count(policy.model):,} parameters{kind}, "
               f"vocabulary {len(policy.tokenizer)}")


@tasks_app.command("export")
def tasks_export(
    ctx: typer.Context,
    out: str = typer.Argument(..., help="Output JSONL file (metadata.split = train | heldout)."),
    config: str | None = typer.Option(None, "--config", "-c", help="TOML settings file."),
) -> None:
    """Write the configured environment's train and held-out tasks as JSONL (loadable with
    tasks.repo_path = ... for repository tasks, tasks.jsonl = ... for function tasks)."""
    from dataclasses import replace

    from offline_rl.repo_tasks import write_repo_tasks
    from offline_rl.splits import load_repo_split, load_task_split
    from offline_rl.tasks import write_tasks_jsonl

    settings = settings_or_exit(ctx, config)
    if settings.env.kind == "repo":
        rsplit = load_repo_split(settings.tasks)
        write_repo_tasks(rsplit.train + rsplit.heldout, out)
        n_train, n_held = len(rsplit.train), len(rsplit.heldout)
    else:
        split = load_task_split(settings.tasks)
        tasks = [replace(t, metadata={**t.metadata, "split": "train"}) for t in split.train]
        tasks += [replace(t, metadata={**t.metadata, "split": "heldout"}) for t in split.heldout]
        write_tasks_jsonl(tasks, out)
        n_train, n_held = len(split.train), len(split.heldout)
    typer.echo(f"wrote {n_train} train + {n_held} held-out tasks to {out}")

def midtrain(
    ctx: typer.Context,
    init: str | None = typer.Option(None, "--init", help="Start from this HF dir (default: model.dir)."),
    out: str | None = typer.Option(None, "--out", "-o", help="Output HF dir (default: midtrain.out_dir)."),
    steps: int | None = typer.Option(None, help="Override midtrain.steps."),
    preset: str | None = typer.Option(None, help=PRESET_HELP),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
    config: str | None = typer.Option(None, "--config", "-c", help="TOML settings file."),
) -> None:
    """Mid-train (next-token, cosine LR) on the synthetic code corpus; saves an HF directory.

    Data-parallel over N ranks with `torchrun --nproc_per_node N -m rtrl midtrain` (distributed.mode)."""
    from offline_rl.midtrain import run_midtrain
    from offline_rl.presets import apply_preset
    from policy.distributed import DistributedError, is_main_process, shutdown
    from policy.loading import ModelLoadError

    settings = apply_preset(settings_or_exit(ctx, config), preset)
    if steps is not None:
        settings.midtrain.steps = steps
    try:
        path = run_midtrain(settings, init_dir=init, out_dir=out, progress=not no_progress,
                            log=lambda m: typer.echo(m, err=True))
        main = is_main_process()
    except (ModelLoadError, DistributedError) as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None
    finally:
        shutdown()
    if main:
        typer.echo(str(path))

def grpo(
    ctx: typer.Context,
    init: str | None = typer.Option(None, "--init", help="Start from this HF dir (default: midtrain.out_dir)."),
    steps: int | None = typer.Option(None, help="Override grpo.steps."),
    mode: str | None = typer.Option(None, help="sync | async | remote (override grpo.mode)."),
    engine: str | None = typer.Option(None, help="torch | vllm (override grpo.rollout_engine)."),
    out: str | None = typer.Option(None, "--out", "-o", help="Run directory (default: grpo.out_dir)."),
    no_resume: bool = typer.Option(False, "--no-resume", help="Start over even if a checkpoint exists."),
    no_publish: bool = typer.Option(False, "--no-publish", help="Never publish, even past the gate."),
    preset: str | None = typer.Option(None, help=PRESET_HELP),
    as_json: bool = typer.Option(False, "--json", help="End with one JSON line: the run summary."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
    config: str | None = typer.Option(None, "--config", "-c", help="TOML settings file."),
) -> None:
    """GRPO on the sandboxed coding environment; resumes from the last checkpoint after a kill.

    Data-parallel over N ranks with `torchrun --nproc_per_node N -m rtrl grpo` (distributed.mode);
    rollouts from `rtrl rollout-worker` processes anywhere with --mode remote."""
    from pydantic import ValidationError

    from offline_rl.grpo import run_grpo
    from offline_rl.presets import apply_preset
    from offline_rl.rollout import BudgetError
    from policy.distributed import DistributedError, is_main_process, shutdown
    from policy.loading import ModelLoadError

    settings = apply_preset(settings_or_exit(ctx, config), preset)
    try:
        for key, value in (("steps", steps), ("mode", mode), ("rollout_engine", engine), ("out_dir", out)):
            if value is not None:
                setattr(settings.grpo, key, value)
        if no_publish:
            settings.grpo.publish = False
    except ValidationError as err:
        typer.echo(f"invalid option: {err.errors()[0]['msg']}", err=True)
        raise typer.Exit(2) from None
    try:
        result = run_grpo(settings, init, progress=not no_progress, resume=not no_resume,
                          log=lambda m: typer.echo(m, err=True))
        main = is_main_process()
    except (ModelLoadError, DistributedError, BudgetError) as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None
    finally:
        shutdown()
    if not main:
        return
    summary = result.summary()
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        for k, v in summary.items():
            typer.echo(f"{k:>22}: {v}")

def rollout_worker(
    ctx: typer.Context,
    worker_id: str | None = typer.Option(None, "--worker-id", help="This worker's name in the trainer's "
                                         "logs and metrics (default: host-pid)."),
    max_batches: int | None = typer.Option(None, "--max-batches", help="Stop after sending this many batches "
                                           "(default: run until SIGTERM or Ctrl-C)."),
    transport: str | None = typer.Option(None, help="dir | bus (override rollout.transport)."),
    directory: str | None = typer.Option(None, "--dir", help="Shared directory of the dir transport "
                                         "(override rollout.dir)."),
    as_json: bool = typer.Option(False, "--json", help="End with one JSON line: batches, tokens, tokens/s."),
    config: str | None = typer.Option(None, "--config", "-c", help="TOML settings file."),
) -> None:
    """Sample and score GRPO batches for a trainer running elsewhere (grpo.mode = remote).

    Needs the registry (registry.url: a shared directory or an fsspec URL), the tasks and a sandbox
    of its own: it loads the version the registry's rollout.channel names, reloads in place when
    the trainer moves it, and sends each batch stamped with that version over rollout.transport."""
    import signal
    import threading

    from pydantic import ValidationError

    from offline_rl.remote import run_rollout_worker
    from policy.registry import RegistryError

    settings = settings_or_exit(ctx, config)
    try:
        for key, value in (("transport", transport), ("dir", directory)):
            if value is not None:
                setattr(settings.rollout, key, value)
    except ValidationError as err:
        typer.echo(f"invalid option: {err.errors()[0]['msg']}", err=True)
        raise typer.Exit(2) from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stats = run_rollout_worker(settings, worker_id=worker_id, max_batches=max_batches, stop=stop,
                                   log=lambda m: typer.echo(m, err=True))
    except RegistryError as err:
        typer.echo(f"rollout-worker: {err}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(stats))
    else:
        typer.echo(f"rollout-worker {stats['worker_id']}: {stats['batches']} batches, {stats['tokens']} tokens "
                   f"({stats['tokens_per_s']:.0f} tokens/s sampling and scoring)")

def eval_cmd(
    ctx: typer.Context,
    model: str | None = typer.Option(None, "--model", "-m", help="HF dir (default: grpo final, else model.dir)."),
    against: list[str] = typer.Option(None, "--against", "-a", help="Another HF dir to compare with, each "
                                      "at its own best temperature (repeatable): the mid-trained model, the "
                                      "matched-compute control, ..."),
    temperatures: list[float] = typer.Option(None, "--temperature", "-t", help="Grid of temperatures "
                                             "(repeatable; default eval.temperatures plus eval.temperature)."),
    samples: int | None = typer.Option(None, help="Samples per task (override eval.samples)."),
    k: list[int] = typer.Option(None, "-k", help="k for pass@k (repeatable; override eval.k)."),
    split: str = typer.Option("heldout", help="heldout | train."),
    limit: int | None = typer.Option(None, help="Evaluate only the first N tasks."),
    preset: str | None = typer.Option(None, help=PRESET_HELP),
    as_json: bool = typer.Option(False, "--json", help="End with one JSON line: the grid, the best "
                                 "temperature, the comparisons and the gate verdict."),
    config: str | None = typer.Option(None, "--config", "-c", help="TOML settings file."),
) -> None:
    """Held-out success (pass@1) over a temperature grid, the agent's behaviour, and paired comparisons.

    A model is compared with others at each one's best temperature: a gain that a lower temperature
    alone gives is not a learning result. The gate verdict is at the serving temperature
    (eval.temperature)."""
    from pathlib import Path

    import torch

    from offline_rl.compare import grid_temperatures
    from offline_rl.evaluate import paired_gain, temperature_grid
    from offline_rl.presets import apply_preset
    from offline_rl.sandbox import SandboxPool
    from offline_rl.splits import load_split
    from policy.loading import ModelLoadError, load_policy

    settings = apply_preset(settings_or_exit(ctx, config), preset)
    torch.set_num_threads(settings.model.threads)
    if samples:
        settings.eval.samples = samples
    if k:
        settings.eval.k = list(k)
    if model is None:
        final = Path(settings.grpo.out_dir) / "final"
        model = str(final) if final.is_dir() else settings.model.dir
    grid_t = grid_temperatures(settings, temperatures)
    tsplit = load_split(settings.tasks, settings.env)
    tasks = tsplit.heldout if split == "heldout" else tsplit.train
    if limit:
        tasks = tasks[:limit]
    grids = {}
    try:
        with SandboxPool(settings.sandbox) as sandbox:
            for path in [model, *(against or [])]:
                policy = load_policy(path, settings.model.dtype, settings.model.device)
                grids[path] = temperature_grid(settings, policy.model, policy.tokenizer, grid_t, tasks=tasks,
                                               sandbox=sandbox)
    except (ModelLoadError, ValueError) as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None
    main = grids[model]
    serving = main.results[settings.eval.temperature]
    gate = settings.eval.gate_threshold
    for path, g in grids.items():
        typer.echo(f"{path}: " + "  ".join(f"T={t}: {r.pass_at_1:.3f} [{r.ci95[0]:.3f}, {r.ci95[1]:.3f}]"
                                          for t, r in g.results.items()) + f"  (best T={g.best_t})", err=as_json)
    comparisons = {}
    for path in against or []:
        gain = paired_gain(main.best, grids[path].best)
        comparisons[path] = {"best_t": grids[path].best_t, "pass_at_1": grids[path].best.pass_at_1, **gain}
        typer.echo(f"gain over {path} (each at its best T): {gain['gain']:+.3f} "
                   f"[{gain['ci95'][0]:+.3f}, {gain['ci95'][1]:+.3f}] over {gain['tasks']} tasks", err=as_json)
    if serving.summaries:
        sm = serving.summaries
        typer.echo(f"summaries at T={settings.eval.temperature}: {sm['segments_mean']:.2f} segments per episode, "
                   f"{sm['summary_tokens_mean']:.1f} tokens each ({sm['compression_ratio']:.2f} of the context), "
                   f"success by summaries {sm['success_by_summaries']}, fact kept {sm['fact_kept']}", err=as_json)
    verdict = "PASS" if serving.pass_at_1 >= gate else "below"
    typer.echo(f"gate {gate:.2f} at T={settings.eval.temperature}: {serving.pass_at_1:.3f} {verdict}; "
               f"{serving.n_tasks} {split} tasks x {serving.samples}", err=as_json)
    if as_json:
        typer.echo(json.dumps({
            "model": model, "env": settings.env.kind, "serving_t": settings.eval.temperature,
            "pass_at_1": serving.pass_at_1, "pass_at_k": {str(kk): v for kk, v in serving.pass_at_k.items()},
            "ci95": list(serving.ci95), "n_tasks": serving.n_tasks, "samples": serving.samples,
            "per_bucket": serving.per_bucket, "behaviour": serving.behaviour,
            "summaries": serving.summaries, "grid": main.to_dict(),
            "best_t": {"t": main.best_t, "pass_at_1": main.best.pass_at_1, "ci95": list(main.best.ci95)},
            "comparisons": comparisons, "gate_threshold": gate, "passes_gate": serving.pass_at_1 >= gate}))


def register(app: typer.Typer) -> None:
    """Add the offline stage's commands to ``app``."""
    app.command("init-model")(init_model)
    app.command("midtrain")(midtrain)
    app.command("grpo")(grpo)
    app.command("rollout-worker")(rollout_worker)
    app.command("eval")(eval_cmd)
    app.add_typer(tasks_app, name="tasks")
