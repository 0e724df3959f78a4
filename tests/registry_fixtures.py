"""Helpers for the registry tests: small multi-dtype state dicts and RL-like updates of them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from policy.registry import Registry
from policy.registry.tensors import from_torch


def state_dict(seed: int = 0, scale: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": (0.02 * torch.randn(64 * scale, 32, generator=g)).to(torch.bfloat16),
        "layers.0.mlp.weight": (0.02 * torch.randn(48, 32 * scale, generator=g)).to(torch.bfloat16),
        "layers.0.norm.weight": torch.ones(32, dtype=torch.bfloat16),
        "layers.1.attn.weight": (0.02 * torch.randn(32, 32, generator=g)).to(torch.float16),
        "head.weight": 0.02 * torch.randn(40, 32, generator=g),
        "head.bias": torch.zeros(40),
        "scalar": torch.tensor(3.5),
        "steps": torch.arange(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


def rl_step(sd: dict[str, torch.Tensor], seed: int, lr: float = 1e-4) -> dict[str, torch.Tensor]:
    """A sign-like (Adam-ish) update of every float tensor in fp32, cast back to its dtype."""
    g = torch.Generator().manual_seed(10_000 + seed)
    out = {}
    for name, t in sd.items():
        if t.is_floating_point():
            upd = lr * torch.sign(torch.randn(t.shape, generator=g))
            out[name] = (t.float() + upd).to(t.dtype)
        else:
            out[name] = t.clone()
    return out


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name in want:
        a, b = from_torch(name, got[name], copy=False), from_torch(name, want[name], copy=False)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert np.array_equal(a.bits, b.bits), name


def fresh(reg: Registry) -> Registry:
    """A second handle on the same store with no memory cache: everything is rebuilt from disk."""
    return Registry(reg.url, cache_dir=reg.cache_dir, snapshot_every=reg.snapshot_every, memory_cache=0,
                    workers=2, chunk_elements=reg.chunk_elements)


def make(tmp_path: Path, **kw) -> Registry:
    kw.setdefault("snapshot_every", 5)
    kw.setdefault("chunk_elements", 500)  # several frames per tensor
    kw.setdefault("shard_mb", 0.004)  # several shard / delta files per version
    kw.setdefault("workers", 2)
    return Registry(tmp_path / "registry", cache_dir=tmp_path / "cache", **kw)
