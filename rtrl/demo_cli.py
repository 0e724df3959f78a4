"""`rtrl demo`: the whole lifecycle in one command (the job itself is :mod:`rtrl.demo`)."""

from __future__ import annotations

import json

import typer

from policy.cli_settings import settings_or_exit


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        ctx: typer.Context,
        fast: bool = typer.Option(False, "--fast", help="The reduced CI path: 2 real-time releases instead of 3, "
                                  "each trained on about 160 users' judgements instead of about 1,000."),
        env: str = typer.Option("functions", "--env", help="The offline stage's environment: 'functions' (the "
                                "single-turn tasks the simulated users ask for; minutes) or 'agent' (multi-turn "
                                "repository episodes with tools; tens of minutes; the online users still ask "
                                "for single functions)."),
        restart: bool = typer.Option(False, "--restart", help="Forget finished stages and start over "
                                     "(var/ contents are reused where they are valid)."),
        from_production: bool = typer.Option(False, "--from-production", help="Skip the offline stages: start "
                                             "the online stage from the registry's production version."),
        releases: int | None = typer.Option(None, "--releases", min=1, help="End the online stage after this "
                                            "many real-time releases (default: 2 with --fast, else 3)."),
        as_json: bool = typer.Option(False, "--json", help="End with one JSON line summarising the run."),
        config: str | None = typer.Option(None, "--config", "-c", help="TOML settings file."),
    ) -> None:
        """Run the whole lifecycle: tiny model → mid-train → GRPO to the gate → controls (the mid-trained
        model and a matched-compute control beside GRPO, each at its best temperature; about GRPO's time
        again) → serve → simulated users → real-time releases → report (var/report/index.html).
        Interrupt and rerun to resume."""
        from rtrl.demo import DemoError, run_demo

        settings = settings_or_exit(ctx, config)
        try:
            summary = run_demo(settings, fast=fast, env=env, restart=restart, from_production=from_production,
                               releases=releases, log=lambda m: typer.echo(m, err=as_json), summary_to_stderr=as_json)
        except DemoError as err:
            typer.echo(f"demo stopped: {err}", err=True)
            raise typer.Exit(1) from None
        if as_json:
            typer.echo(json.dumps(summary, default=str))
