"""`rtrl update`, `rtrl scheduler`, `rtrl releases`: the real-time updater's commands."""

from __future__ import annotations

import json

import typer

from policy.cli_settings import settings_or_exit


def register(app: typer.Typer) -> None:
    @app.command("update")
    def update(
        ctx: typer.Context,
        once: bool = typer.Option(True, "--once", help="Run a single cycle and exit (what this command always "
                                  "does; `rtrl scheduler` runs cycles on a schedule)."),
        force: bool = typer.Option(False, "--force", help="Run even with fewer than schedule.min_feedback new "
                                   "examples or the same data as the last run."),
        as_json: bool = typer.Option(False, "--json", help="Print the cycle result as JSON."),
        config: str | None = typer.Option(None, "--config", "-c", help="TOML settings file."),
    ) -> None:
        """One update cycle: dataset -> REINFORCE update -> candidate -> release gate -> promote or refuse.

        The update step runs data-parallel over N ranks with `torchrun --nproc_per_node N -m rtrl update`
        (distributed.mode); rank 0 does the rest of the cycle."""
        from policy.distributed import DistributedError, is_main_process, shutdown
        from realtime_rl.cycle import run_update_cycle

        settings = settings_or_exit(ctx, config)
        try:
            result = run_update_cycle(settings, force=force, log=lambda m: typer.echo(m, err=True))
            main = is_main_process()
        except DistributedError as err:
            typer.echo(str(err), err=True)
            raise typer.Exit(2) from None
        finally:
            shutdown()
        if not main:
            if result.status in ("failed", "locked"):
                raise typer.Exit(1)
            return
        if as_json:
            typer.echo(json.dumps(result.as_dict(), default=str))
        else:
            typer.echo(f"{result.run_id}: {result.status}: {result.reason}")
            if result.candidate_version:
                typer.echo(f"candidate {result.candidate_version} (parent {result.production_version})")
        if result.status in ("failed", "locked"):
            raise typer.Exit(1)

    @app.command("scheduler")
    def scheduler(
        ctx: typer.Context,
        config: str | None = typer.Option(None, "--config", "-c", help="TOML settings file."),
    ) -> None:
        """Run update cycles every schedule.update_interval (interval or cron) until interrupted."""
        from realtime_rl.schedule import build_scheduler, parse_trigger, scheduled_cycle

        settings = settings_or_exit(ctx, config)
        try:
            parse_trigger(settings.schedule.update_interval)
        except ValueError as err:
            typer.echo(str(err), err=True)
            raise typer.Exit(2) from None
        log = lambda m: typer.echo(m, err=True)  # noqa: E731
        sched = build_scheduler(settings, scheduled_cycle(settings, log))
        log(f"scheduler: update every {settings.schedule.update_interval} (min_feedback "
            f"{settings.schedule.min_feedback}); Ctrl-C to stop")
        try:
            sched.start()
        except (KeyboardInterrupt, SystemExit):
            log("scheduler stopped")

    @app.command("releases")
    def releases_cmd(
        ctx: typer.Context,
        limit: int = typer.Option(20, help="Most recent N releases."),
        runs: bool = typer.Option(False, "--runs", help="List every update run (skipped ones too)."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON lines."),
        config: str | None = typer.Option(None, "--config", "-c", help="TOML settings file."),
    ) -> None:
        """Gate decisions: candidate, parent, decision, offline pass@1, OPE estimate with CI, reason."""
        from realtime_rl.database import make_engine
        from realtime_rl.release import list_releases, list_runs
        from realtime_rl.schema import ensure_schema

        settings = settings_or_exit(ctx, config)
        ensure_schema(settings.db)
        engine = make_engine(settings.db)
        try:
            rows = list_runs(engine, limit) if runs else list_releases(engine, limit)
        finally:
            engine.dispose()
        if as_json:
            for r in rows:
                typer.echo(json.dumps(r, default=str))
            return
        if not rows:
            typer.echo("no update runs yet" if runs else "no releases yet")
            return
        if runs:
            for r in rows:
                typer.echo(f"{r['finished_at']:%Y-%m-%d %H:%M} {r['run_id']} {r['status']:<8} "
                           f"train={r['n_train']} {r['candidate_version'] or '-'}: {r['reason']}")
            return

        def f(v):
            return "-" if v is None else f"{v:.3f}"

        for r in rows:
            ci = f"[{f(r['ope_ci_low'])}, {f(r['ope_ci_high'])}]"
            typer.echo(f"{r['created_at']:%Y-%m-%d %H:%M} {r['decision']:<8} {r['candidate_version']} "
                       f"<- {r['parent_version']}  pass@1 {f(r['offline_pass_at_1'])} (prod "
                       f"{f(r['production_pass_at_1'])})  OPE {f(r['ope_estimate'])} {ci} vs realised "
                       f"{f(r['production_accept_rate'])}  {r['reason']}")
