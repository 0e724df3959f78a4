"""`rtrl serve` and `rtrl keys add|list|revoke`."""

from __future__ import annotations

import typer

from policy.cli_settings import settings_or_exit

keys_app = typer.Typer(help="API keys for the gateway (stored hashed in serving.api_keys_file).",
                       no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(keys_app, name="keys")

    @app.command("serve")
    def serve(
        ctx: typer.Context,
        config: str | None = typer.Option(None, "--config", "-c", help="TOML settings file."),
        host: str | None = typer.Option(None, help="Bind address (default serving.host)."),
        port: int | None = typer.Option(None, help="Bind port (default serving.port; 0 = a free one)."),
        engine: str | None = typer.Option(None, help="torch or vllm (default serving.engine)."),
    ) -> None:
        """Serve the production model version over an OpenAI-compatible API, hot-swapping new versions."""
        import logging

        from serving.server import serve_forever

        settings = settings_or_exit(ctx, config)
        updates = {k: v for k, v in {"host": host, "port": port, "engine": engine}.items() if v is not None}
        if updates:
            try:
                settings.serving = settings.serving.model_copy(update=updates)
                type(settings.serving).model_validate(settings.serving.model_dump())
            except ValueError as err:
                typer.echo(f"invalid option: {err}", err=True)
                raise typer.Exit(2) from None
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        from policy.loading import ModelLoadError
        from serving.gateway import NothingToServe

        try:
            serve_forever(settings)
        except (NothingToServe, ModelLoadError, ValueError) as err:
            typer.echo(f"cannot serve: {err}", err=True)
            raise typer.Exit(1) from None

    @keys_app.command("add")
    def keys_add(
        ctx: typer.Context,
        name: str = typer.Argument(..., help="A name for the key's owner (unique among active keys)."),
        config: str | None = typer.Option(None, "--config", "-c", help="TOML settings file."),
    ) -> None:
        """Create an API key; the plaintext is printed once and never stored."""
        from serving.auth import KeyStoreError, create_api_key

        settings = settings_or_exit(ctx, config)
        try:
            typer.echo(create_api_key(settings, name))
        except KeyStoreError as err:
            typer.echo(str(err), err=True)
            raise typer.Exit(1) from None

    @keys_app.command("list")
    def keys_list(ctx: typer.Context, config: str | None = typer.Option(None, "--config", "-c", help="TOML settings file.")) -> None:
        """List keys (ids and names only; secrets are not stored)."""
        import datetime

        from serving.auth import KeyStore

        settings = settings_or_exit(ctx, config)
        for k in KeyStore(settings.serving.api_keys_file).list():
            when = datetime.datetime.fromtimestamp(k.created, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
            typer.echo(f"{k.key_id}  {k.name:<24} {when}  {'revoked' if k.revoked else 'active'}")

    @keys_app.command("revoke")
    def keys_revoke(
        ctx: typer.Context,
        name_or_id: str = typer.Argument(..., help="Key id or name."),
        config: str | None = typer.Option(None, "--config", "-c", help="TOML settings file."),
    ) -> None:
        """Revoke a key; a running gateway refuses it from its next request on."""
        from serving.auth import KeyStore, KeyStoreError

        settings = settings_or_exit(ctx, config)
        try:
            k = KeyStore(settings.serving.api_keys_file).revoke(name_or_id)
        except KeyStoreError as err:
            typer.echo(str(err), err=True)
            raise typer.Exit(1) from None
        typer.echo(f"revoked {k.key_id} ({k.name})")
