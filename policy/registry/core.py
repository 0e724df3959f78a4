"""What the registry's operation modules (publish, materialize, verify, gc) need of a registry.

:class:`policy.registry.registry.Registry` is the one implementation; the modules that do its work
type their argument with this protocol instead of importing it, so the registry depends on them and
never the other way round.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from policy.registry.manifest import Manifest
from policy.registry.store import FsspecStore, LocalStore
from policy.registry.tensors import TensorBits

State = dict[str, TensorBits]


class RegistryCore(Protocol):
    """The settings and lookups a registry offers its operation modules."""

    store: LocalStore | FsspecStore
    cache_dir: Path | None
    channel_names: tuple[str, ...]
    shard_bytes: int
    workers: int
    zstd_level: int
    chunk_elements: int
    dense_probe: float
    progress: bool

    def manifest(self, version: str, *, fresh: bool = False) -> Manifest: ...

    def resolve(self, ref: str) -> str: ...

    def state(self, version: str) -> State: ...

    def memory_get(self, version: str) -> State | None: ...

    def memory_drop(self, version: str) -> None: ...

    def require_cache_dir(self) -> Path: ...
