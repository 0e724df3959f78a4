"""Retention: delete the versions nothing needs, never one a kept version needs to be rebuilt.

Kept: the versions named by the caller, the ``keep_last`` newest, and every version on a channel's
rollback stack; then, closing over the chain, every ancestor a kept delta needs back to its
snapshot. The rest are deleted children first (each deletion is one rename, so a crash mid-gc
leaves a consistent registry with some garbage left), along with their cached materialisations and
abandoned staging directories. Runs under the registry lock, so no publish commits a delta against
a parent that is being deleted.
"""

from __future__ import annotations

import shutil
from typing import Any

from policy.registry.channels import read_channel
from policy.registry.core import RegistryCore


def collect(reg: RegistryCore, keep: list[str], *, keep_last: int, dry_run: bool,
            staging_min_age_s: float) -> dict[str, Any]:
    with reg.store.lock("registry"):
        ids = reg.store.list_versions()
        ms = {v: reg.manifest(v) for v in ids}
        protected = set(keep)
        if keep_last > 0:
            protected.update(m.id for m in sorted(ms.values(), key=lambda m: (m.created, m.id))[-keep_last:])
        for name in reg.channel_names:
            protected.update(read_channel(reg.store, name).stack)
        needed: set[str] = set()
        for v in protected:
            cur: str | None = v
            while cur is not None and cur not in needed and cur in ms:
                needed.add(cur)
                cur = ms[cur].parent if ms[cur].kind == "delta" else None

        def generation(v: str) -> int:
            n, cur, seen = 0, ms[v].parent, {v}
            while cur in ms and cur not in seen:
                seen.add(cur)
                n, cur = n + 1, ms[cur].parent
            return n

        doomed = sorted((v for v in ids if v not in needed), key=lambda v: (-generation(v), v))
        freed = sum(ms[v].stored_bytes for v in doomed)
        removed_staging: list[str] = []
        if not dry_run:
            for v in doomed:
                reg.store.delete_version(v)
                reg.memory_drop(v)
                if reg.cache_dir is not None and (reg.cache_dir / v).is_dir():
                    shutil.rmtree(reg.cache_dir / v, ignore_errors=True)
            removed_staging = reg.store.clean_staging(staging_min_age_s)
    return {"deleted": doomed, "kept": sorted(needed), "freed_bytes": freed,
            "staging_removed": removed_staging, "dry_run": dry_run}
