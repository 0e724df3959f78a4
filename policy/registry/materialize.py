"""Rebuild a version's exact bits: nearest starting point, then the delta chain, verified at every step.

The starting point is the first of these found walking from the version towards its snapshot: the
in-memory copy of a recently published or loaded version, an intact materialised directory in the
cache, or the snapshot itself. Each delta is then applied in place, frame by frame, on the worker
threads; after every step each changed tensor's SHA-256 is checked against that version's
manifest, so a bad byte is reported against the version, file and tensor where it is, and no
corrupted tensor ever leaves this module.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections import defaultdict
from pathlib import Path

import numpy as np

from policy.registry.codec import SAME, FrameError, FrameRef, decode_frame, parse_frames
from policy.registry.core import RegistryCore, State
from policy.registry.errors import BrokenChain, CorruptVersion, RegistryError, VersionNotFound
from policy.registry.hf import check_materialized, read_hf_dir, write_hf_dir
from policy.registry.manifest import Manifest, TensorEntry
from policy.registry.shards import from_safetensors
from policy.registry.tensors import UINT, WIDTH, TensorBits
from policy.registry.workers import pmap


def read_file(reg: RegistryCore, m: Manifest, name: str, *, writable: bool = False) -> bytes | bytearray:
    """A version's file, its SHA-256 checked against the manifest (a bytearray if ``writable``)."""
    entry = next((f for f in m.files if f.name == name), None)
    if entry is None:
        raise CorruptVersion("file is not listed in the manifest", version=m.id, file=name)
    tensors = [t.name for t in m.tensors if t.file == name]
    holds = f" (holds tensor {', '.join(tensors[:3])}{', ...' if len(tensors) > 3 else ''})" if tensors else ""
    try:
        data = reg.store.read(f"versions/{m.id}/{name}", writable=writable)
    except FileNotFoundError:
        raise CorruptVersion(f"file is missing{holds}", version=m.id, file=name,
                             tensor=tensors[0] if len(tensors) == 1 else None) from None
    if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
        raise CorruptVersion(f"SHA-256 mismatch{holds}", version=m.id, file=name,
                             tensor=tensors[0] if len(tensors) == 1 else None)
    return data


def verify_tensors(reg: RegistryCore, m: Manifest, state: State, names: list[str] | None = None) -> None:
    entries = {t.name: t for t in m.tensors}
    todo = names if names is not None else list(entries)

    def check(name: str) -> None:
        entry = entries[name]
        tb = state.get(name)
        if tb is None:
            raise CorruptVersion("tensor missing after decode", version=m.id, tensor=name, file=entry.file)
        if tb.dtype != entry.dtype or list(tb.shape) != entry.shape:
            raise CorruptVersion(f"decoded as {tb.dtype}{list(tb.shape)}, manifest says "
                                 f"{entry.dtype}{entry.shape}", version=m.id, tensor=name, file=entry.file)
        if tb.sha256() != entry.sha256:
            raise CorruptVersion("SHA-256 mismatch after decode", version=m.id, tensor=name, file=entry.file)

    pmap(check, todo, reg.workers)


def read_snapshot(reg: RegistryCore, m: Manifest) -> State:
    by_file: dict[str, list[TensorEntry]] = defaultdict(list)
    for t in m.tensors:
        by_file[t.file].append(t)

    def load(fname: str) -> State:
        data = read_file(reg, m, fname, writable=True)  # decoded in place by the deltas that follow
        tensors = from_safetensors(data, version=m.id, file=fname)
        expected = {t.name for t in by_file[fname]}
        if set(tensors) != expected:
            missing = sorted(expected - set(tensors))
            raise CorruptVersion(f"shard holds {sorted(set(tensors) - expected)[:3]} extra, "
                                 f"{missing[:3]} missing", version=m.id, file=fname,
                                 tensor=missing[0] if missing else None)
        return tensors

    state: State = {}
    for part in pmap(load, sorted(by_file), reg.workers, desc=f"read {m.id}", progress=reg.progress):
        state.update(part)
    verify_tensors(reg, m, state)
    return {t.name: state[t.name] for t in m.tensors}


def apply_delta(reg: RegistryCore, m: Manifest, base: State) -> State:
    """The state of delta version ``m`` from its parent's state ``base`` (consumed: decoded in place)."""
    assert m.parent is not None
    parent = reg.manifest(m.parent)
    parent_sha = {t.name: t.sha256 for t in parent.tensors}
    out: State = {}
    for t in m.tensors:
        if t.coding == "delta":
            b = base.get(t.name)
            if b is None or b.dtype != t.dtype or list(b.shape) != t.shape:
                raise BrokenChain(f"parent {m.parent} has no {t.dtype}{t.shape} tensor of this name",
                                  version=m.id, tensor=t.name)
            out[t.name] = b
        else:
            width = WIDTH[t.dtype]
            n = int(np.prod(t.shape, dtype=np.int64)) if t.shape else 1
            out[t.name] = TensorBits(t.dtype, tuple(t.shape), np.empty(n, dtype=UINT[width]))

    delta_files = [f.name for f in m.files if f.role == "delta"]

    def parse(fname: str) -> list[tuple[str, FrameRef]]:
        data = read_file(reg, m, fname)
        try:
            refs = parse_frames(data)
        except FrameError as err:
            raise CorruptVersion(str(err), version=m.id, file=fname) from None
        return [(fname, r) for r in refs]

    frames: dict[str, list[FrameRef]] = defaultdict(list)
    for part in pmap(parse, delta_files, reg.workers):
        for fname, ref in part:
            if ref.tensor_index >= len(m.tensors):
                raise CorruptVersion(f"frame for tensor index {ref.tensor_index}", version=m.id, file=fname)
            entry = m.tensors[ref.tensor_index]
            if entry.file != fname:
                raise CorruptVersion("frame found in the wrong file", version=m.id, file=fname,
                                     tensor=entry.name)
            frames[entry.name].append(ref)
    jobs: list[tuple[TensorEntry, FrameRef]] = []
    for t in m.tensors:
        refs = sorted(frames.get(t.name, []), key=lambda r: r.start)
        pos = 0
        for r in refs:
            if r.start != pos:
                raise CorruptVersion(f"frames leave a gap or overlap at element {pos}", version=m.id,
                                     file=t.file, tensor=t.name)
            pos += r.count
        if not refs or pos != out[t.name].bits.size:
            raise CorruptVersion("frames do not cover the tensor", version=m.id, file=t.file, tensor=t.name)
        jobs.extend((t, r) for r in refs)

    def decode(job: tuple[TensorEntry, FrameRef]) -> None:
        t, r = job
        target = out[t.name].bits[r.start:r.start + r.count]
        try:
            decode_frame(r, target)
        except FrameError as err:
            raise CorruptVersion(f"{err} (elements {r.start}..{r.start + r.count})", version=m.id,
                                 file=t.file, tensor=t.name) from None

    pmap(decode, jobs, reg.workers, desc=f"decode {m.id}", progress=reg.progress)
    # Unchanged tensors (every frame SAME, same hash as the parent) were verified at the parent.
    changed = [t.name for t in m.tensors
               if not (t.coding == "delta" and parent_sha.get(t.name) == t.sha256
                       and all(r.mode == SAME for r in frames[t.name]))]
    verify_tensors(reg, m, out, changed)
    return out


def read_cached_dir(reg: RegistryCore, m: Manifest) -> State | None:
    """The state from an intact materialised directory of ``m`` in the cache, else None."""
    if reg.cache_dir is None:
        return None
    d = reg.cache_dir / m.id
    if not (d / ".rtrl-version.json").is_file():
        return None
    try:
        tensors, _ = read_hf_dir(d)
        state = {t.name: tensors[t.name] for t in m.tensors}
        verify_tensors(reg, m, state)
    except (RegistryError, KeyError, OSError):
        return None  # damaged cache entries are ignored, then rebuilt by materialize
    return state


def decode_state(reg: RegistryCore, version_id: str, *, known: dict[str, State] | None = None,
                 use_caches: bool = True) -> State:
    """A fresh, owned state of the version. ``known`` maps version ids to states that may be used as a
    starting point (they are copied, not consumed)."""
    chain: list[Manifest] = []
    v = version_id
    base: State | None = None
    while True:
        try:
            m = reg.manifest(v)
        except VersionNotFound:
            child = chain[-1].id if chain else version_id
            raise BrokenChain(f"parent {v} is missing", version=child) from None
        start = (known or {}).get(v)
        if start is None and use_caches:
            start = reg.memory_get(v)
        if start is not None:
            base = {n: tb.copy() for n, tb in start.items()}
            break
        if m.kind == "snapshot":
            base = read_snapshot(reg, m)
            break
        if use_caches:
            base = read_cached_dir(reg, m)
            if base is not None:
                break
        if m.parent is None:
            raise BrokenChain("delta version without a parent", version=m.id)
        chain.append(m)
        v = m.parent
    for m in reversed(chain):
        base = apply_delta(reg, m, base)
    return base


def aux_files(reg: RegistryCore, m: Manifest) -> dict[str, bytes]:
    return {f.name.removeprefix("aux/"): read_file(reg, m, f.name) for f in m.aux_files()}


def materialize_dir(reg: RegistryCore, m: Manifest, out_dir: Path | None) -> Path:
    target = Path(out_dir) if out_dir is not None else reg.require_cache_dir() / m.id
    if target.exists():
        if check_materialized(target, m.id, m.sha256):
            return target
        if out_dir is not None and any(target.iterdir()):
            raise RegistryError(f"{target} exists and is not an intact materialisation of version {m.id}")
        shutil.rmtree(target)  # an empty directory, or a damaged cache entry that is rebuilt
    state = reg.state(m.id)
    aux = aux_files(reg, m)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{m.id}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write_hf_dir(tmp, m.id, m.sha256, state, aux, reg.shard_bytes)
        fd = os.open(tmp, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        try:
            os.rename(tmp, target)
        except OSError:
            if not check_materialized(target, m.id, m.sha256):  # a concurrent materialiser won
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
