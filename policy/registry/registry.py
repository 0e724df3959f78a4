"""The :class:`Registry` facade: publish, resolve, load, materialise, channels, verify, diff, gc."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

import policy.registry.channels as channel_ops
from policy.registry.codec import DEFAULT_CHUNK_ELEMENTS, DEFAULT_DENSE_PROBE, encode_chunk
from policy.registry.core import State
from policy.registry.errors import ChannelError, PublishError, RegistryError, VersionNotFound
from policy.registry.gc import collect
from policy.registry.hf import read_aux, read_hf_dir
from policy.registry.manifest import Manifest, decode_manifest
from policy.registry.materialize import aux_files, decode_state, materialize_dir, read_file
from policy.registry.publish import commit, encode_delta, encode_snapshot, prepare
from policy.registry.store import MANIFEST, open_store
from policy.registry.tensors import from_torch, to_torch
from policy.registry.verify import VerifyReport, verify
from policy.registry.workers import resolve_workers

if TYPE_CHECKING:
    import torch

    from policy.config import RegistrySettings

DEFAULT_CHANNELS = ("candidate", "production")


@dataclass(frozen=True)
class VersionInfo:
    """A version's summary (the full manifest is ``Registry.show``)."""

    id: str
    sha256: str
    parent: str | None
    created: float
    stage: str | None
    run: str | None
    metrics: dict[str, float]
    kind: str
    depth: int
    tensors: int
    raw_bytes: int
    stored_bytes: int
    channels: tuple[str, ...] = ()

    @property
    def created_iso(self) -> str:
        return datetime.fromtimestamp(self.created, UTC).isoformat(timespec="seconds")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["channels"] = list(self.channels)
        d["created_iso"] = self.created_iso
        return d

    @classmethod
    def from_manifest(cls, m: Manifest, channels: Iterable[str] = ()) -> VersionInfo:
        return cls(id=m.id, sha256=m.sha256, parent=m.parent, created=m.created, stage=m.stage, run=m.run,
                   metrics=dict(m.metrics), kind=m.kind, depth=m.depth, tensors=len(m.tensors),
                   raw_bytes=m.raw_bytes, stored_bytes=m.stored_bytes, channels=tuple(channels))


@dataclass(frozen=True)
class RegistryEvent:
    """What a hook receives; the fields map one to one onto ``realtime_rl.events.ModelVersionEvent``
    (the caller adds the model name)."""

    action: str  # "published" | "promoted" | "rollback"
    version: str
    parent: str | None
    channel: str | None
    sha256: str
    metrics: dict[str, float]


Hook = Callable[[RegistryEvent], None]


class Registry:
    """A model version registry at ``url`` (a directory, or an fsspec URL such as ``s3://bucket/reg``).

    ``cache_dir`` (a local directory; None disables it) holds materialised HF directories. The other
    arguments mirror ``RegistrySettings``. See the package docstring (``policy.registry``) for the
    full API and guarantees.
    """

    def __init__(self, url: str | os.PathLike[str] = "var/registry", *,
                 cache_dir: str | os.PathLike[str] | None = "var/cache/materialized",
                 snapshot_every: int = 10, shard_mb: float = 256, workers: int = 0, zstd_level: int = 1,
                 chunk_elements: int = DEFAULT_CHUNK_ELEMENTS, dense_probe: float = DEFAULT_DENSE_PROBE,
                 channels: Iterable[str] = DEFAULT_CHANNELS, rollback_depth: int = 10, keep_last: int = 5,
                 memory_cache: int = 1, on_event: Hook | None = None, progress: bool = False) -> None:
        if snapshot_every < 1 or rollback_depth < 2 or chunk_elements < 1 or memory_cache < 0:
            raise ValueError("snapshot_every >= 1, rollback_depth >= 2, chunk_elements >= 1, memory_cache >= 0")
        self.store = open_store(url)
        self.url = self.store.url
        self.cache_dir = Path(cache_dir).expanduser().resolve() if cache_dir is not None else None
        self.snapshot_every = snapshot_every
        self.shard_bytes = max(1, int(shard_mb * 2**20))
        self.workers = resolve_workers(workers)
        self.zstd_level = zstd_level
        self.chunk_elements = min(chunk_elements, 2**32 - 1)  # gaps must fit in 4 bytes
        self.dense_probe = dense_probe
        self.channel_names = tuple(channels)
        for name in self.channel_names:
            if not channel_ops.CHANNEL_NAME.match(name) or name == "latest":
                raise ValueError(f"bad channel name {name!r}")
        self.rollback_depth = rollback_depth
        self.keep_last = keep_last
        self.on_event = on_event
        self.progress = progress  # tqdm bars (on stderr) for hashing, encoding, decoding, writing
        self._memory_size = memory_cache
        self._memory: OrderedDict[str, State] = OrderedDict()
        self._manifests: dict[str, Manifest] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: RegistrySettings, **overrides: Any) -> Registry:
        kw: dict[str, Any] = {
            "cache_dir": settings.cache_dir, "snapshot_every": settings.snapshot_every,
            "workers": settings.workers, "shard_mb": settings.shard_mb, "zstd_level": settings.zstd_level,
            "rollback_depth": settings.rollback_depth, "keep_last": settings.keep_last,
            "channels": settings.channels,
        }
        kw.update(overrides)
        return cls(kw.pop("url", settings.url), **kw)

    # ---------------------------------------------------------------- lookup

    def manifest(self, version: str, *, fresh: bool = False) -> Manifest:
        """The verified manifest of a version id (not an alias; see :meth:`resolve`).

        Manifests are immutable, so they are cached; ``fresh`` re-reads and re-checks the stored bytes.
        """
        with self._lock:
            m = None if fresh else self._manifests.get(version)
        if m is not None:
            return m
        try:
            raw = self.store.read(f"versions/{version}/{MANIFEST}")
        except (FileNotFoundError, NotADirectoryError):
            raise VersionNotFound(f"version {version} not found in {self.url}") from None
        m = decode_manifest(raw, version)
        with self._lock:
            self._manifests[version] = m
        return m

    def resolve(self, ref: str) -> str:
        """A version id from an id, a unique id prefix (4+ hex digits), a channel name, or ``latest``."""
        ref = ref.strip()
        if ref in self.channel_names:
            current = self.channel(ref)
            if current is None:
                raise VersionNotFound(f"channel {ref} points at no version yet")
            return current
        ids = self.store.list_versions()
        if ref == "latest":
            if not ids:
                raise VersionNotFound(f"registry {self.url} has no versions")
            return max((self.manifest(v) for v in ids), key=lambda m: (m.created, m.id)).id
        if ref in ids:
            return ref
        matches = [v for v in ids if v.startswith(ref)] if len(ref) >= 4 else []
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise VersionNotFound(f"version prefix {ref} is ambiguous: {', '.join(matches[:5])}")
        raise VersionNotFound(f"version {ref} not found in {self.url}")

    def exists(self, ref: str) -> bool:
        try:
            self.resolve(ref)
        except VersionNotFound:
            return False
        return True

    def _channels_of(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name in self.channel_names:
            current = self.channel(name)
            if current:
                out.setdefault(current, []).append(name)
        return out

    def list(self) -> list[VersionInfo]:
        """Every committed version, oldest first, with the channels pointing at it."""
        tags = self._channels_of()
        ms = sorted((self.manifest(v) for v in self.store.list_versions()), key=lambda m: (m.created, m.id))
        return [VersionInfo.from_manifest(m, tags.get(m.id, ())) for m in ms]

    def info(self, ref: str) -> VersionInfo:
        vid = self.resolve(ref)
        return VersionInfo.from_manifest(self.manifest(vid), self._channels_of().get(vid, ()))

    def show(self, ref: str) -> dict[str, Any]:
        """The full manifest as plain data, plus the channels pointing at the version."""
        vid = self.resolve(ref)
        data = self.manifest(vid).model_dump(mode="json")
        data["channels"] = self._channels_of().get(vid, [])
        data["created_iso"] = self.manifest(vid).created_iso
        return data

    # ---------------------------------------------------------------- memory cache

    def memory_get(self, version: str) -> State | None:
        with self._lock:
            state = self._memory.get(version)
            if state is not None:
                self._memory.move_to_end(version)
            return state

    def _memory_put(self, version: str, state: State) -> None:
        if self._memory_size == 0:
            return
        with self._lock:
            self._memory[version] = state
            self._memory.move_to_end(version)
            while len(self._memory) > self._memory_size:
                self._memory.popitem(last=False)

    def memory_drop(self, version: str) -> None:
        with self._lock:
            self._memory.pop(version, None)
            self._manifests.pop(version, None)

    # ---------------------------------------------------------------- publish

    def publish(self, source: str | os.PathLike[str] | Mapping[str, torch.Tensor], *, parent: str | None = None,
                source_dir: str | os.PathLike[str] | None = None, stage: str | None = None,
                run: str | None = None, metrics: Mapping[str, float] | None = None,
                snapshot: bool = False, on_event: Hook | None = None) -> VersionInfo:
        """Publish an HF directory, or a state dict (aux files from ``source_dir``, else the parent's).

        Returns the new version, or the existing one if identical content was published before.
        """
        metrics_d = {str(k): float(v) for k, v in (metrics or {}).items()}
        if isinstance(source, str | os.PathLike):
            tensors, aux = read_hf_dir(source)
            owned = True
        elif isinstance(source, Mapping):
            tensors = {str(n): from_torch(str(n), t, copy=False) for n, t in source.items()}
            aux = None
            owned = False
            if source_dir is not None:
                aux = read_aux(source_dir)
        else:
            raise PublishError(f"publish needs an HF directory or a state dict, got {type(source).__name__}")
        parent_id = self.resolve(parent) if parent is not None else None
        parent_m = self.manifest(parent_id) if parent_id else None
        if aux is None:
            aux = aux_files(self, parent_m) if parent_m is not None else {}
        prep = prepare(self, tensors, aux)
        if self.store.exists(f"versions/{prep.id}/{MANIFEST}"):
            return self.info(prep.id)
        if not owned:
            # The memory cache must not alias the caller's parameters, which keep training in place.
            prep.tensors = {n: tb.copy() for n, tb in prep.tensors.items()}
        snapshot_size = sum(tb.nbytes for tb in prep.tensors.values())
        if parent_m is None:
            enc, depth = encode_snapshot(self, prep.tensors, "no parent"), 0
        elif snapshot:
            enc, depth = encode_snapshot(self, prep.tensors, "requested"), 0
        elif parent_m.depth + 1 >= self.snapshot_every:
            enc, depth = encode_snapshot(self, prep.tensors, f"every {self.snapshot_every} versions"), 0
        else:
            base = self.state(parent_m.id)
            enc, depth = encode_delta(self, prep.tensors, base), parent_m.depth + 1
            if sum(len(d) for _, _, d in enc.files) >= snapshot_size:
                enc, depth = encode_snapshot(self, prep.tensors, "delta not smaller"), 0
        manifest, created = commit(self, prep, enc, parent=parent_id, depth=depth, stage=stage, run=run,
                                   metrics=metrics_d)
        if not created:
            return self.info(prep.id)
        with self._lock:
            self._manifests[manifest.id] = manifest
        self._memory_put(manifest.id, prep.tensors)
        self._emit(RegistryEvent("published", manifest.id, parent_id, None, manifest.sha256, metrics_d), on_event)
        return VersionInfo.from_manifest(manifest)

    def _emit(self, event: RegistryEvent, extra: Hook | None = None) -> None:
        # Called after the change is committed: a failing hook cannot undo it, and its error propagates.
        for hook in (self.on_event, extra):
            if hook is not None:
                hook(event)

    # ---------------------------------------------------------------- read

    def state(self, version: str) -> State:
        """Internal: the version's bits, shared with the memory cache (read only!)."""
        vid = self.resolve(version)
        cached = self.memory_get(vid)
        if cached is not None:
            return cached
        state = decode_state(self, vid)
        self._memory_put(vid, state)
        return state

    def load_state_dict(self, version: str) -> dict[str, torch.Tensor]:
        """The version's tensors (stored dtype, CPU), bit-exact and verified; the caller owns them."""
        state = self.state(version)
        return {name: to_torch(tb.copy()) for name, tb in state.items()}

    def materialize(self, version: str, out_dir: str | os.PathLike[str] | None = None) -> Path:
        """An HF directory of the version (in the cache unless ``out_dir``); reused when intact."""
        vid = self.resolve(version)
        return materialize_dir(self, self.manifest(vid), Path(out_dir) if out_dir is not None else None)

    def require_cache_dir(self) -> Path:
        if self.cache_dir is None:
            raise RegistryError("this registry has no cache_dir: pass out_dir to materialize")
        return self.cache_dir

    # ---------------------------------------------------------------- channels

    def channel(self, name: str) -> str | None:
        """The version a channel points at, or None."""
        self._check_channel(name)
        return channel_ops.read_channel(self.store, name).current

    def history(self, name: str) -> list[dict[str, Any]]:
        """Every promote and rollback of the channel, oldest first."""
        self._check_channel(name)
        return [e.model_dump(mode="json") for e in channel_ops.read_channel(self.store, name).history]

    def promote(self, version: str, channel: str = "candidate", *, note: str | None = None,
                on_event: Hook | None = None) -> VersionInfo:
        """Point ``channel`` at ``version`` atomically (the previous one stays reachable by rollback)."""
        self._check_channel(channel)
        vid = self.resolve(version)
        m = self.manifest(vid)
        _, changed = channel_ops.promote(self.store, channel, vid, rollback_depth=self.rollback_depth, note=note)
        if changed:
            self._emit(RegistryEvent("promoted", vid, m.parent, channel, m.sha256, dict(m.metrics)), on_event)
        return self.info(vid)

    def rollback(self, channel: str = "production", *, note: str | None = None,
                 on_event: Hook | None = None) -> VersionInfo:
        """Point ``channel`` back at the version it had before the last promotion."""
        self._check_channel(channel)
        state = channel_ops.rollback(self.store, channel, note=note)
        m = self.manifest(state.current)  # type: ignore[arg-type]
        self._emit(RegistryEvent("rollback", m.id, m.parent, channel, m.sha256, dict(m.metrics)), on_event)
        return self.info(m.id)

    def _check_channel(self, name: str) -> None:
        if name not in self.channel_names:
            raise ChannelError(f"unknown channel {name!r}; channels are {', '.join(self.channel_names)}")

    # ---------------------------------------------------------------- verify, diff, gc

    def verify(self, version: str | None = None) -> VerifyReport:
        """Check every byte of one version (and the chain it needs) or of the whole registry."""

        return verify(self, version)

    def diff(self, a: str, b: str) -> dict[str, Any]:
        """Per-tensor change from version ``a`` to ``b``: elements changed, max |value change|, and the size
        the delta codec would store."""
        ida, idb = self.resolve(a), self.resolve(b)
        sa, sb = self.state(ida), self.state(idb)
        tensors = []
        total_changed = total_elems = delta_bytes = 0
        for name in sorted(set(sa) | set(sb)):
            ta, tb = sa.get(name), sb.get(name)
            if ta is None or tb is None or ta.dtype != tb.dtype or ta.shape != tb.shape:
                tensors.append({"name": name, "status": "added" if ta is None else "removed" if tb is None
                                else "retyped"})
                continue
            changed = int(np.count_nonzero(ta.bits != tb.bits))
            row = {"name": name, "status": "changed" if changed else "same", "dtype": tb.dtype,
                   "elements": int(tb.bits.size), "changed": changed,
                   "changed_fraction": round(changed / max(tb.bits.size, 1), 6)}
            if changed and tb.dtype.startswith(("F", "BF")):
                row["max_abs_change"] = float((to_torch(tb).double() - to_torch(ta).double()).abs().max())
            if changed:
                size = 0
                for s in range(0, tb.bits.size, self.chunk_elements):
                    e = s + self.chunk_elements
                    frame, _ = encode_chunk(0, s, tb.bits[s:e], ta.bits[s:e], level=self.zstd_level,
                                            dense_probe=self.dense_probe)
                    size += len(frame)
                row["delta_bytes"] = size
                delta_bytes += size
            total_changed += changed
            total_elems += int(tb.bits.size)
            tensors.append(row)
        raw = sum(t.nbytes for t in sb.values())
        return {"a": ida, "b": idb, "elements": total_elems, "changed": total_changed,
                "changed_fraction": round(total_changed / max(total_elems, 1), 6), "raw_bytes": raw,
                "delta_bytes": delta_bytes, "ratio": round(raw / max(delta_bytes, 1), 2), "tensors": tensors}

    def gc(self, keep: Iterable[str] = (), *, keep_last: int | None = None, dry_run: bool = False,
           staging_min_age_s: float = 60.0) -> dict[str, Any]:
        """Delete versions nothing needs; see :func:`policy.registry.gc.collect`."""

        return collect(self, [self.resolve(k) for k in keep],
                       keep_last=self.keep_last if keep_last is None else keep_last, dry_run=dry_run,
                       staging_min_age_s=staging_min_age_s)

    def read_file(self, version: str, name: str) -> bytes:
        """One stored file of a version, checksum verified."""
        return read_file(self, self.manifest(self.resolve(version)), name)
