"""How every package's commands get their settings without importing the CLI that assembles them.

The settings root (one section per stage) sits above the stages, so a stage's command cannot import
it. The assembling CLI (``rtrl``) puts a :class:`CommandContext` on the root context
(``typer.Typer(context_settings={"obj": ...})``); a command takes ``ctx: typer.Context`` and asks for
its settings with :func:`settings_or_exit`, which finds that object on the context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import typer


@dataclass(frozen=True)
class CommandContext:
    """What the assembling CLI hands down to every command."""

    load_settings: Callable[[str | None], Any]
    """Load the settings from a TOML file (``None``: the default sources), exiting cleanly on a bad key or
    value."""


def settings_or_exit(ctx: typer.Context, config: str | None = None) -> Any:
    """The effective settings for the running command (``--config`` file, ``RTRL_*`` env, defaults)."""
    state = ctx.find_object(CommandContext)
    if state is None:
        raise RuntimeError("this command runs under a CLI that provides a CommandContext (the `rtrl` command)")
    return state.load_settings(config)
