"""Safetensors shards: how tensors are grouped into files and turned into bytes and back.

Tensors are grouped in name order into shards of at most ``shard_bytes`` (a larger tensor gets a
shard of its own), so that a version is many files of similar size that transfer in parallel.
"""

from __future__ import annotations

from collections.abc import Iterable

import safetensors
import safetensors.torch

from policy.registry.errors import CorruptVersion
from policy.registry.tensors import TensorBits, from_torch, to_torch


def plan_shards(sizes: Iterable[tuple[str, int]], shard_bytes: int) -> list[list[str]]:
    """Consecutive groups of names whose sizes add up to at most ``shard_bytes`` (never empty groups)."""
    groups: list[list[str]] = []
    current: list[str] = []
    total = 0
    for name, size in sizes:
        if current and total + size > shard_bytes:
            groups.append(current)
            current, total = [], 0
        current.append(name)
        total += size
    if current:
        groups.append(current)
    return groups


def to_safetensors(tensors: dict[str, TensorBits]) -> bytes:
    # {"format": "pt"} is what transformers checks for before it trusts a safetensors file.
    return safetensors.torch.save({name: to_torch(tb) for name, tb in tensors.items()}, metadata={"format": "pt"})


def from_safetensors(data: bytes, *, version: str | None, file: str) -> dict[str, TensorBits]:
    """Parse safetensors bytes; a malformed file raises :class:`CorruptVersion` naming it."""
    try:
        loaded = safetensors.torch.load(data)
    except (safetensors.SafetensorError, ValueError, RuntimeError) as err:
        raise CorruptVersion(f"unreadable safetensors ({err})", version=version, file=file) from None
    return {name: from_torch(name, t, copy=False) for name, t in loaded.items()}
