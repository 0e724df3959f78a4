"""`rtrl midtrain`, `rtrl grpo`, `rtrl eval`, `rtrl tasks export`: the offline stage's commands."""

from __future__ import annotations

import json

import typer

PRESET_HELP = "Settings preset applied on top of the config: 'fast' (CI, offline stage in a few minutes)."


def register(app: typer.Typer) -> None:
    tasks_app = typer.Typer(help="Coding tasks: export the built-in generator's split as JSONL.",
                            no_args_is_help=True)
    app.add_typer(tasks_app, name="tasks")

    @tasks_app.command("export")
    def tasks_export(
        out: str = typer.Argument(..., help="Output JSONL file (metadata.split = train | heldout)."),
        config: str | None = typer.Option(None, "--config", "-c", help="TOML settings file."),
    ) -> None:
        """Write the train and held-out tasks as JSONL (loadable with tasks.jsonl = ...)."""
        from dataclasses import replace

        from offline_rl.grpo import load_task_split
        from offline_rl.tasks import write_tasks_jsonl
        from rtrl.cli import settings_or_exit

        split = load_task_split(settings_or_exit(config))
        tasks = [replace(t, metadata={**t.metadata, "split": "train"}) for t in split.train]
        tasks += [replace(t, metadata={**t.metadata, "split": "heldout"}) for t in split.heldout]
        write_tasks_jsonl(tasks, out)
        typer.echo(f"wrote {len(split.train)} train + {len(split.heldout)} held-out tasks to {out}")

    @app.command("midtrain")
    def midtrain(
        init: str | None = typer.Option(None, "--init", help="Start from this HF dir (default: model.dir)."),
        out: str | None = typer.Option(None, "--out", "-o", help="Output HF dir (default: midtrain.out_dir)."),
        steps: int | None = typer.Option(None, help="Override midtrain.steps."),
        preset: str | None = typer.Option(None, help=PRESET_HELP),
        no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
        config: str | None = typer.Option(None, "--config", "-c", help="TOML settings file."),
    ) -> None:
        """Mid-train (next-token, cosine LR) on the synthetic code corpus; saves an HF directory."""
        from offline_rl.midtrain import run_midtrain
        from offline_rl.presets import apply_preset
        from policy.loading import ModelLoadError
        from rtrl.cli import settings_or_exit

        settings = apply_preset(settings_or_exit(config), preset)
        if steps is not None:
            settings.midtrain.steps = steps
        try:
            path = run_midtrain(settings, init_dir=init, out_dir=out, progress=not no_progress,
                                log=lambda m: typer.echo(m, err=True))
        except ModelLoadError as err:
            typer.echo(str(err), err=True)
            raise typer.Exit(2) from None
        typer.echo(str(path))

    @app.command("grpo")
    def grpo(
        init: str | None = typer.Option(None, "--init", help="Start from this HF dir (default: midtrain.out_dir)."),
        steps: int | None = typer.Option(None, help="Override grpo.steps."),
        mode: str | None = typer.Option(None, help="sync | async (override grpo.mode)."),
        engine: str | None = typer.Option(None, help="torch | vllm (override grpo.rollout_engine)."),
        out: str | None = typer.Option(None, "--out", "-o", help="Run directory (default: grpo.out_dir)."),
        no_resume: bool = typer.Option(False, "--no-resume", help="Start over even if a checkpoint exists."),
        no_publish: bool = typer.Option(False, "--no-publish", help="Never publish, even past the gate."),
        preset: str | None = typer.Option(None, help=PRESET_HELP),
        as_json: bool = typer.Option(False, "--json", help="End with one JSON line: the run summary."),
        no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
        config: str | None = typer.Option(None, "--config", "-c", help="TOML settings file."),
    ) -> None:
        """GRPO on the sandboxed coding environment; resumes from the last checkpoint after a kill."""
        from pydantic import ValidationError

        from offline_rl.grpo import run_grpo
        from offline_rl.presets import apply_preset
        from policy.loading import ModelLoadError
        from rtrl.cli import settings_or_exit

        settings = apply_preset(settings_or_exit(config), preset)
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
        except ModelLoadError as err:
            typer.echo(str(err), err=True)
            raise typer.Exit(2) from None
        summary = result.summary()
        if as_json:
            typer.echo(json.dumps(summary))
        else:
            for k, v in summary.items():
                typer.echo(f"{k:>22}: {v}")

    @app.command("eval")
    def eval_cmd(
        model: str | None = typer.Option(None, "--model", "-m", help="HF dir (default: grpo final, else model.dir)."),
        samples: int | None = typer.Option(None, help="Samples per task (override eval.samples)."),
        k: list[int] = typer.Option(None, "-k", help="k for pass@k (repeatable; override eval.k)."),
        split: str = typer.Option("heldout", help="heldout | train."),
        limit: int | None = typer.Option(None, help="Evaluate only the first N tasks."),
        as_json: bool = typer.Option(False, "--json", help="End with one JSON line {pass_at_1, pass_at_k, n_tasks}."),
        config: str | None = typer.Option(None, "--config", "-c", help="TOML settings file."),
    ) -> None:
        """pass@1 and pass@k (unbiased estimator) on the held-out tasks; reports the gate verdict."""
        from pathlib import Path

        import torch

        from offline_rl.evaluate import evaluate
        from offline_rl.grpo import load_task_split
        from offline_rl.sandbox import SandboxPool
        from policy.loading import ModelLoadError, load_policy
        from rtrl.cli import settings_or_exit

        settings = settings_or_exit(config)
        torch.set_num_threads(settings.model.threads)
        if model is None:
            final = Path(settings.grpo.out_dir) / "final"
            model = str(final) if final.is_dir() else settings.model.dir
        try:
            policy = load_policy(model, settings.model.dtype, settings.model.device)
        except ModelLoadError as err:
            typer.echo(str(err), err=True)
            raise typer.Exit(2) from None
        tsplit = load_task_split(settings)
        tasks = tsplit.heldout if split == "heldout" else tsplit.train
        if limit:
            tasks = tasks[:limit]
        n = samples or settings.eval.samples
        ks = list(k) if k else settings.eval.k
        try:
            with SandboxPool(settings.sandbox) as sandbox:
                r = evaluate(policy.model, policy.tokenizer, tasks, samples=n, k=ks,
                             temperature=settings.eval.temperature, max_new_tokens=settings.grpo.max_new_tokens,
                             sandbox=sandbox, env_settings=settings.env)
        except ValueError as err:
            typer.echo(str(err), err=True)
            raise typer.Exit(2) from None
        gate = settings.eval.gate_threshold
        typer.echo(f"{model}: pass@1 {r.pass_at_1:.3f} "
                   + " ".join(f"pass@{kk} {v:.3f}" for kk, v in r.pass_at_k.items() if kk != 1)
                   + f" on {r.n_tasks} {split} tasks x {r.samples}; gate {gate:.2f}: "
                   + ("PASS" if r.pass_at_1 >= gate else "below"), err=as_json)
        if as_json:
            typer.echo(json.dumps({"pass_at_1": r.pass_at_1, "pass_at_k": {str(kk): v for kk, v in r.pass_at_k.items()},
                                   "n_tasks": r.n_tasks, "samples": r.samples, "gate_threshold": gate,
                                   "passes_gate": r.pass_at_1 >= gate, "per_bucket": r.per_bucket}))
