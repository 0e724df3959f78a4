"""The `rtrl` command line.

Each package contributes its own commands through a ``register(app)`` function in its ``cli``
module; heavy imports (torch, transformers, the web stack) happen inside the commands, so that
``rtrl --help`` is instant and each command loads only the room it works in.
"""

from __future__ import annotations

import importlib
import json
import sys

import typer

from policy.cli_settings import CommandContext
from rtrl.config import ConfigError, load_settings, redacted


def load_settings_or_exit(config: str | None = None):
    """Load settings, turning a bad key or value into a clean exit with the message."""
    try:
        return load_settings(config)
    except ConfigError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None


app = typer.Typer(
    name="rtrl",
    help="Train your own code model from your own product: offline GRPO to a quality gate, then "
    "real-time RL from users' accept/reject feedback.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    # every package's commands find their settings loader here (policy.cli_settings)
    context_settings={"obj": CommandContext(load_settings_or_exit)},
)
config_app = typer.Typer(help="Inspect the effective settings (rtrl.toml + RTRL_* env + defaults).",
                         no_args_is_help=True)
app.add_typer(config_app, name="config")

# Packages whose `cli.register(app)` adds commands; a package not yet present is simply absent.
COMMAND_MODULES = ["policy.model_cli", "policy.cli", "offline_rl.cli", "serving.cli", "realtime_rl.cli", "realtime_rl.release_cli", "rtrl.bench", "rtrl.demo_cli"]


@config_app.command("show")
def config_show(
    config: str | None = typer.Option(None, "--config", "-c", help="TOML file (default rtrl.toml)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of TOML-like text."),
) -> None:
    """Print the effective settings, secrets masked."""
    data = redacted(load_settings_or_exit(config))
    if as_json:
        typer.echo(json.dumps(data, indent=2, default=str))
        return
    for section, values in data.items():
        if isinstance(values, dict):
            typer.echo(f"[{section}]")
            for key, value in values.items():
                typer.echo(f"{key} = {json.dumps(value, default=str)}")
            typer.echo("")
        else:
            typer.echo(f"{section} = {json.dumps(values, default=str)}")


def _register_all() -> None:
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name:
                continue
            raise
        module.register(app)


_register_all()


def main() -> None:
    try:
        app()
    except ConfigError as err:
        typer.echo(str(err), err=True)
        sys.exit(2)
