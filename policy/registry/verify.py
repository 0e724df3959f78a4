"""``verify``: re-read and re-check every byte a version (or the whole registry) depends on.

For each version: the manifest's own checksum, every file's SHA-256, a full rebuild from the store
alone (no memory or disk caches) with each tensor's SHA-256 checked at every step of the chain,
and the aux files. Then every channel file and the versions its rollback stack names. Problems are
collected, not raised, so one report lists all of them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from policy.registry.channels import read_channel
from policy.registry.core import RegistryCore, State
from policy.registry.errors import RegistryError
from policy.registry.manifest import Manifest
from policy.registry.materialize import aux_files, decode_state
from policy.registry.store import LocalStore


@dataclass
class VerifyReport:
    ok: bool
    checked: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def verify(reg: RegistryCore, version: str | None) -> VerifyReport:
    report = VerifyReport(ok=True)
    targets = [reg.resolve(version)] if version is not None else reg.store.list_versions()
    manifests: dict[str, Manifest] = {}
    for v in targets:
        try:
            manifests[v] = reg.manifest(v, fresh=True)
        except RegistryError as err:
            report.errors.append(str(err))
    # Parents before children, so a linear chain is rebuilt once, not once per version.
    order = sorted(manifests.values(), key=lambda m: (m.created, m.id))
    pending_children: dict[str, int] = {}
    for m in order:
        if m.kind == "delta" and m.parent:
            pending_children[m.parent] = pending_children.get(m.parent, 0) + 1
    known: dict[str, State] = {}
    for m in order:
        try:
            state = decode_state(reg, m.id, known=known, use_caches=False)
            aux_files(reg, m)
            report.checked.append(m.id)
            if pending_children.get(m.id):
                known[m.id] = state
        except RegistryError as err:
            report.errors.append(str(err))
        if m.kind == "delta" and m.parent and m.parent in pending_children:
            pending_children[m.parent] -= 1
            if pending_children[m.parent] <= 0:
                known.pop(m.parent, None)
    for name in reg.channel_names:
        try:
            state = read_channel(reg.store, name)
        except RegistryError as err:
            report.errors.append(str(err))
            continue
        for v in state.stack:
            try:
                reg.manifest(v)
            except RegistryError as err:
                report.errors.append(f"channel {name} names version {v}: {err}")
    if isinstance(reg.store, LocalStore):
        leftovers = [p.name for p in reg.store.path("staging").iterdir()]
        if leftovers:
            report.warnings.append(f"{len(leftovers)} unfinished publish(es) in staging/ (invisible; "
                                   "`gc` removes abandoned ones)")
    report.ok = not report.errors
    return report
