"""Errors the registry raises. Each message names the version (and tensor or file) at fault."""

from __future__ import annotations


class RegistryError(Exception):
    """Base class for every registry failure."""


class VersionNotFound(RegistryError, KeyError):
    """No committed version (or channel, or unique id prefix) matches the reference."""

    def __str__(self) -> str:  # KeyError would otherwise print the message in quotes
        return str(self.args[0]) if self.args else "version not found"


class CorruptVersion(RegistryError):
    """Stored bytes do not match their checksums, or a file is missing or malformed.

    ``version``, ``tensor`` and ``file`` say where; corrupted weights are never returned.
    """

    def __init__(self, message: str, *, version: str | None = None, tensor: str | None = None,
                 file: str | None = None) -> None:
        where = []
        if version:
            where.append(f"version {version}")
        if file:
            where.append(f"file {file}")
        if tensor:
            where.append(f"tensor {tensor}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)
        self.version = version
        self.tensor = tensor
        self.file = file


class BrokenChain(CorruptVersion):
    """A delta's parent (or an ancestor it needs) is missing, so the version cannot be rebuilt."""


class ChannelError(RegistryError):
    """A promote or rollback that cannot be done (unknown channel, nothing to roll back to)."""


class PublishError(RegistryError):
    """The input to ``publish`` is unusable (no weights found, unsupported dtype, bad name)."""
