"""Channels: named pointers (``candidate``, ``production``) to versions, with rollback and history.

A channel file holds the rollback stack (the versions promoted, newest last: the current version is
the top, ``rollback`` pops it) and the full event history, which is never trimmed. The stack is
trimmed to ``rollback_depth`` entries, which bounds what ``gc`` must keep for rollbacks. Updates are
read-modify-write under an exclusive lock, written atomically (temp file, fsync, rename).
"""

from __future__ import annotations

import re
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from policy.registry.errors import ChannelError, CorruptVersion
from policy.registry.manifest import seal, unseal
from policy.registry.store import Store

CHANNEL_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")


class ChannelEvent(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    action: Literal["promoted", "rollback"]
    version: str = Field(description="The version current after the event.")
    previous: str | None = Field(description="The version current before the event.")
    at: float
    note: str | None = None


class ChannelState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    stack: list[str] = Field(default_factory=list)
    history: list[ChannelEvent] = Field(default_factory=list)
    manifest_sha256: str = ""

    @property
    def current(self) -> str | None:
        return self.stack[-1] if self.stack else None


def channel_path(name: str) -> str:
    return f"channels/{name}.json"


def read_channel(store: Store, name: str) -> ChannelState:
    path = channel_path(name)
    if not store.exists(path):
        return ChannelState(name=name)
    data = unseal(store.read(path), what=f"channel {name}", file=path)
    try:
        state = ChannelState.model_validate(data)
    except ValidationError as err:
        raise CorruptVersion(f"channel {name} does not validate: {err}", file=path) from None
    if state.name != name:
        raise CorruptVersion(f"channel file names channel {state.name!r}", file=path)
    return state


def _write(store: Store, state: ChannelState) -> None:
    store.write_atomic(channel_path(state.name), seal(state.model_dump(mode="json")))


def promote(store: Store, name: str, version: str, *, rollback_depth: int,
            note: str | None = None) -> tuple[ChannelState, bool]:
    """Point ``name`` at ``version``. Returns (state, changed); promoting the current version is a no-op."""
    with store.lock(f"channel-{name}"):
        state = read_channel(store, name)
        if state.current == version:
            return state, False
        previous = state.current
        state.stack.append(version)
        del state.stack[:-rollback_depth]
        state.history.append(ChannelEvent(action="promoted", version=version, previous=previous,
                                          at=time.time(), note=note))
        _write(store, state)
        return state, True


def rollback(store: Store, name: str, *, note: str | None = None) -> ChannelState:
    """Point ``name`` back at the version current before the last promotion."""
    with store.lock(f"channel-{name}"):
        state = read_channel(store, name)
        if len(state.stack) < 2:
            raise ChannelError(f"channel {name}: nothing to roll back to "
                               f"(current {state.current or 'none'}, no earlier promotion kept)")
        previous = state.stack.pop()
        state.history.append(ChannelEvent(action="rollback", version=state.stack[-1], previous=previous,
                                          at=time.time(), note=note))
        _write(store, state)
        return state
