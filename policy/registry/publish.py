"""Turn a set of tensors into a committed version: hash, choose snapshot or delta, write, commit.

Storage choice: a full snapshot when there is no parent, when the parent is ``snapshot_every - 1``
deltas from its snapshot (so rebuilding never applies more than ``snapshot_every - 1`` deltas), when
the caller asks for one, or when the delta would not be smaller than the snapshot; otherwise a delta
against the parent. Chunks of every tensor are hashed and encoded on the worker threads.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

from policy.registry.codec import MODE_NAMES, ChunkStats, encode_chunk, encode_raw
from policy.registry.core import RegistryCore, State
from policy.registry.errors import BrokenChain, PublishError
from policy.registry.manifest import (
    FORMAT,
    ID_HEX,
    FileEntry,
    Manifest,
    TensorEntry,
    encode_manifest,
    version_sha256,
)
from policy.registry.shards import plan_shards, to_safetensors
from policy.registry.workers import pmap


@dataclass
class Prepared:
    """Hashed input: identity known, nothing written yet."""

    tensors: State
    aux: dict[str, bytes]
    entries: dict[str, tuple[str, list[int], str]]  # name -> (dtype, shape, sha256)
    sha256: str
    id: str
    hash_s: float


@dataclass
class Encoded:
    """One version's weight files, ready to write."""

    kind: str
    files: list[tuple[str, str, bytes]]  # (name without prefix, role, data)
    tensor_files: dict[str, str]
    coding: dict[str, str]
    chunk_stats: list[ChunkStats] = field(default_factory=list)
    encode_s: float = 0.0
    reason: str = ""


def prepare(reg: RegistryCore, tensors: State, aux: dict[str, bytes]) -> Prepared:
    if not tensors:
        raise PublishError("no tensors to publish")
    for name in tensors:
        if not name or name != name.strip() or "\n" in name:
            raise PublishError(f"bad tensor name {name!r}")
    for name in aux:
        if "/" in name or name.startswith("."):
            raise PublishError(f"bad aux file name {name!r}")
    t0 = time.perf_counter()
    names = sorted(tensors)
    digests = pmap(lambda n: tensors[n].sha256(), names, reg.workers, desc="hash", progress=reg.progress)
    entries = {n: (tensors[n].dtype, list(tensors[n].shape), d) for n, d in zip(names, digests, strict=True)}
    aux_sha = {n: hashlib.sha256(b).hexdigest() for n, b in aux.items()}
    vsha = version_sha256([(n, *entries[n]) for n in names], sorted(aux_sha.items()))
    return Prepared({n: tensors[n] for n in names}, aux, entries, vsha, vsha[:ID_HEX], time.perf_counter() - t0)


def encode_snapshot(reg: RegistryCore, tensors: State, reason: str) -> Encoded:
    groups = plan_shards(((n, tb.nbytes) for n, tb in tensors.items()), reg.shard_bytes)
    files = []
    tensor_files = {}
    for i, group in enumerate(groups):
        fname = f"shard-{i:05d}.safetensors"
        files.append((fname, "snapshot", to_safetensors({n: tensors[n] for n in group})))
        tensor_files.update(dict.fromkeys(group, fname))
    return Encoded("snapshot", files, tensor_files, dict.fromkeys(tensors, "snapshot"), reason=reason)


def encode_delta(reg: RegistryCore, tensors: State, base: State) -> Encoded:
    """Frames of every tensor against ``base`` (read only), grouped into delta files by raw size."""
    t0 = time.perf_counter()
    names = list(tensors)
    index = {n: i for i, n in enumerate(names)}
    coding = {}
    jobs: list[tuple[str, int, int]] = []
    for name in names:
        new, old = tensors[name], base.get(name)
        coding[name] = "delta" if old is not None and old.dtype == new.dtype and old.shape == new.shape else "raw"
        n = new.bits.size
        step = reg.chunk_elements
        jobs.extend((name, s, min(s + step, n)) for s in range(0, max(n, 1), step))

    def run(job: tuple[str, int, int]) -> tuple[bytes, ChunkStats]:
        name, s, e = job
        new = tensors[name].bits[s:e]
        if coding[name] == "raw":
            return encode_raw(index[name], s, new, reg.zstd_level)
        return encode_chunk(index[name], s, new, base[name].bits[s:e], level=reg.zstd_level,
                            dense_probe=reg.dense_probe)

    results = pmap(run, jobs, reg.workers, desc="encode", progress=reg.progress)
    frames: dict[str, list[bytes]] = {n: [] for n in names}
    stats = []
    for (name, _, _), (frame, st) in zip(jobs, results, strict=True):
        frames[name].append(frame)
        stats.append(st)
    groups = plan_shards(((n, tensors[n].nbytes) for n in names), reg.shard_bytes)
    files = []
    tensor_files = {}
    for i, group in enumerate(groups):
        fname = f"delta-{i:05d}.rtd"
        files.append((fname, "delta", b"".join(f for n in group for f in frames[n])))
        tensor_files.update(dict.fromkeys(group, fname))
    return Encoded("delta", files, tensor_files, coding, stats, time.perf_counter() - t0)


def commit(reg: RegistryCore, prep: Prepared, enc: Encoded, *, parent: str | None, depth: int, stage: str | None,
           run: str | None, metrics: dict[str, float]) -> tuple[Manifest, bool]:
    """Write the files aside and commit. Returns (manifest, created); created is False when a version with
    the same content was committed first (by a concurrent publisher)."""
    t0 = time.perf_counter()
    staging = reg.store.stage(prep.id)
    try:
        to_write = [(staging.prefix + name, role, data) for name, role, data in enc.files]
        to_write += [(f"aux/{name}", "aux", data) for name, data in prep.aux.items()]

        def write(item: tuple[str, str, bytes]) -> FileEntry:
            name, role, data = item
            staging.write(name, data)
            return FileEntry(name=name, role=role, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())

        file_entries = pmap(write, to_write, reg.workers, desc="write", progress=reg.progress)
        tensors = [TensorEntry(name=n, dtype=dt, shape=shape, sha256=sha, file=staging.prefix + enc.tensor_files[n],
                               coding=enc.coding[n]) for n, (dt, shape, sha) in prep.entries.items()]
        raw = sum(tb.nbytes for tb in prep.tensors.values())
        weight_bytes = sum(f.bytes for f in file_entries if f.role != "aux")
        modes: dict[str, int] = {}
        for st in enc.chunk_stats:
            modes[MODE_NAMES[st.mode]] = modes.get(MODE_NAMES[st.mode], 0) + 1
        stats = {"raw_bytes": raw, "weight_bytes": weight_bytes, "ratio": round(raw / max(weight_bytes, 1), 3),
                 "hash_s": round(prep.hash_s, 4), "encode_s": round(enc.encode_s, 4),
                 **{f"chunks_{k}": v for k, v in modes.items()}}
        if enc.chunk_stats:
            total = sum(st.elements for st in enc.chunk_stats)
            stats["changed_fraction"] = round(sum(st.changed for st in enc.chunk_stats) / max(total, 1), 6)
        codec: dict[str, object] = {"zstd_level": reg.zstd_level, "chunk_elements": reg.chunk_elements}
        if enc.reason:
            codec["snapshot_reason"] = enc.reason
        manifest = Manifest(format=FORMAT, id=prep.id, sha256=prep.sha256, parent=parent, created=time.time(),
                            stage=stage, run=run, metrics=metrics, kind=enc.kind, depth=depth, tensors=tensors,
                            files=file_entries,
                            codec=codec, stats=stats)
        with reg.store.lock("registry", shared=True):
            # gc holds this lock exclusively: a parent checked here cannot vanish before the rename.
            if enc.kind == "delta" and parent is not None and not reg.store.exists(f"versions/{parent}/manifest.json"):
                raise BrokenChain(f"parent {parent} was deleted while this version was being published",
                                  version=prep.id)
            manifest = manifest.model_copy(update={"stats": {**stats, "write_s": round(time.perf_counter() - t0, 4)}})
            created = staging.commit(encode_manifest(manifest))
        return manifest, created
    except BaseException:
        staging.abort()
        raise
