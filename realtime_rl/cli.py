"""`rtrl` commands of the real-time stage, one section per area; ``register(app)`` adds them all.

Heavy imports (SQLAlchemy, Alembic, kafka-python) happen inside the commands so that ``rtrl --help``
stays instant. To add an area, write a ``_register_<area>(app)`` section and call it from
``register``.
"""

from __future__ import annotations

import json

import typer

from policy.cli_settings import settings_or_exit

ConfigOption = typer.Option(None, "--config", "-c", help="TOML settings file (default rtrl.toml).")


def register(app: typer.Typer) -> None:
    _register_ingest(app)
    _register_dlq(app)
    _register_db(app)


# -- ingest ---------------------------------------------------------------------------------------

def _register_ingest(app: typer.Typer) -> None:
    @app.command("ingest")
    def ingest(
        ctx: typer.Context,
        follow: bool = typer.Option(True, "--follow/--once", help="--follow: run until SIGTERM/Ctrl-C; "
                                    "--once: stop when caught up with the bus."),
        max_idle_s: float | None = typer.Option(None, "--max-idle-s", help="With --follow: stop after this "
                                                "many seconds without new records."),
        config: str | None = ConfigOption,
    ) -> None:
        """Consume completion, feedback and model-version events into the feedback tables (exactly-once)."""
        import signal
        import threading

        from tqdm import tqdm

        from realtime_rl.bus import BusUnavailable
        from realtime_rl.database import redacted_url
        from realtime_rl.ingest import Ingester
        from realtime_rl.schema import SchemaNotReady

        settings = settings_or_exit(ctx, config)
        log = lambda msg: typer.echo(msg, err=True)  # noqa: E731
        try:
            ingester = Ingester(settings, log_fn=log)
        except SchemaNotReady as err:
            log(str(err))
            raise typer.Exit(2) from None
        log(f"ingest: {settings.bus.backend} bus -> {redacted_url(settings.db)} (group {settings.ingest.group})")
        try:
            if follow:
                stop = threading.Event()
                for sig in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, lambda *_: stop.set())
                ingester.run(stop, max_idle_s=max_idle_s)
            else:
                try:
                    total = ingester.lag()
                except BusUnavailable as err:
                    log(f"ingest: bus unavailable: {err}")
                    raise typer.Exit(1) from None
                with tqdm(total=total or None, unit="rec", desc="ingest", disable=None) as bar:
                    ingester.drain(progress=bar.update)
        except BusUnavailable as err:
            log(f"ingest: bus unavailable: {err}")
            raise typer.Exit(1) from None
        finally:
            ingester.close()
        typer.echo(json.dumps(ingester.stats.as_dict()))


# -- dead letters ---------------------------------------------------------------------------------

def _register_dlq(app: typer.Typer) -> None:
    dlq = typer.Typer(help="Dead letters: events the ingester could not use (reason and raw bytes kept).",
                      no_args_is_help=True)
    app.add_typer(dlq, name="dlq")

    @dlq.command("list")
    def dlq_list(
        ctx: typer.Context,
        limit: int = typer.Option(50, "--limit", "-n", help="Most rows shown (newest first)."),
        reason: str | None = typer.Option(None, "--reason", help="Only this reason (oversized, undecodable, "
                                          "schema_invalid, conflict, db_rejected)."),
        include_replayed: bool = typer.Option(False, "--all", help="Include letters already replayed."),
        as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
        config: str | None = ConfigOption,
    ) -> None:
        """List dead letters (newest first)."""
        from realtime_rl.database import make_engine
        from realtime_rl.deadletters import list_dead_letters

        engine = make_engine(settings_or_exit(ctx, config).db, readonly=True)
        try:
            rows = list_dead_letters(engine, limit=limit, reason=reason, include_replayed=include_replayed)
        finally:
            engine.dispose()
        if as_json:
            for row in rows:
                typer.echo(json.dumps(row.as_dict()))
            return
        if not rows:
            typer.echo("no dead letters")
            return
        for r in rows:
            replayed = f" replayed {r.replayed_at:%Y-%m-%d %H:%M:%S}" if r.replayed_at else ""
            typer.echo(f"#{r.id} {r.topic}[{r.partition}]@{r.offset} {r.reason} ({r.raw_size} B){replayed}: "
                       f"{r.detail}\n    {r.preview}")

    @dlq.command("replay")
    def dlq_replay(
        ctx: typer.Context,
        ids: list[int] = typer.Argument(None, help="Dead-letter ids to replay (see `rtrl dlq list`)."),
        replay_all: bool = typer.Option(False, "--all", help="Replay every unreplayed letter (with --reason: "
                                        "every one with that reason)."),
        reason: str | None = typer.Option(None, "--reason", help="Only letters with this reason."),
        limit: int = typer.Option(1000, "--limit", help="Most letters replayed in one run."),
        config: str | None = ConfigOption,
    ) -> None:
        """Re-publish dead letters to their topic; the ingester then takes them again."""
        from realtime_rl.bus import BusUnavailable, open_producer
        from realtime_rl.database import make_engine
        from realtime_rl.deadletters import replay

        if not ids and not replay_all:
            typer.echo("name dead-letter ids, or pass --all", err=True)
            raise typer.Exit(2)
        settings = settings_or_exit(ctx, config)
        engine = make_engine(settings.db)
        producer = open_producer(settings.bus)
        try:
            result = replay(engine, producer, ids=ids or None, reason=reason, limit=limit)
        except BusUnavailable as err:
            typer.echo(f"bus unavailable, nothing marked as replayed: {err}", err=True)
            raise typer.Exit(1) from None
        finally:
            producer.close()
            engine.dispose()
        for letter_id, why in result.skipped.items():
            typer.echo(f"skipped #{letter_id}: {why}", err=True)
        typer.echo(json.dumps({"replayed": result.replayed, "skipped": sorted(result.skipped)}))


# -- database schema ------------------------------------------------------------------------------

def _register_db(app: typer.Typer) -> None:
    db = typer.Typer(help="Feedback-database schema (Alembic revisions shipped in the package).",
                     no_args_is_help=True)
    app.add_typer(db, name="db")

    @db.command("upgrade")
    def db_upgrade(
        ctx: typer.Context,
        revision: str = typer.Argument("head", help="Target revision."),
        config: str | None = ConfigOption,
    ) -> None:
        """Upgrade the feedback database (db.url) to REVISION (default: newest)."""
        from realtime_rl import schema
        from realtime_rl.database import redacted_url

        settings = settings_or_exit(ctx, config)
        schema.upgrade(settings.db, revision)
        typer.echo(f"{redacted_url(settings.db)}: at {_current(settings.db)}")

    @db.command("downgrade")
    def db_downgrade(
        ctx: typer.Context,
        revision: str = typer.Argument("-1", help="Target revision (`base` removes every table)."),
        config: str | None = ConfigOption,
    ) -> None:
        """Downgrade the feedback database to REVISION (default: one step back)."""
        from realtime_rl import schema
        from realtime_rl.database import redacted_url

        settings = settings_or_exit(ctx, config)
        schema.downgrade(settings.db, revision)
        typer.echo(f"{redacted_url(settings.db)}: at {_current(settings.db)}")

    @db.command("current")
    def db_current(ctx: typer.Context, config: str | None = ConfigOption) -> None:
        """Print the database's revision and the newest one available."""
        from realtime_rl import schema
        from realtime_rl.database import redacted_url

        settings = settings_or_exit(ctx, config)
        typer.echo(f"{redacted_url(settings.db)}: at {_current(settings.db)} (newest {schema.head_revision()})")


def _current(db) -> str:
    from realtime_rl import schema
    from realtime_rl.database import make_engine

    engine = make_engine(db)
    try:
        return schema.current_revision(engine) or "base"
    finally:
        engine.dispose()
