"""Hugging Face model directories: read one to publish it, write one when materialising a version.

A published directory contributes its safetensors weights (one file, or shards listed in
``model.safetensors.index.json``) and every other top-level file (config, generation config,
tokenizer files, chat template) as *aux* files, stored byte for byte with the version. A
materialised directory is laid out the way ``save_pretrained`` lays it out, so transformers and
vLLM load it unchanged, plus a ``.rtrl-version.json`` marker naming the version and the SHA-256 of
every file, which is how a cached directory is recognised and checked before reuse.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from policy.registry.errors import CorruptVersion, PublishError
from policy.registry.manifest import seal, unseal
from policy.registry.shards import from_safetensors, plan_shards, read_file_writable, to_safetensors
from policy.registry.tensors import TensorBits

INDEX = "model.safetensors.index.json"
MARKER = ".rtrl-version.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


def read_hf_dir(path: str | Path) -> tuple[dict[str, TensorBits], dict[str, bytes]]:
    """Tensors (by name) and aux files (by file name) of an HF model directory."""
    root = Path(path)
    if not root.is_dir():
        raise PublishError(f"{root}: not a directory")
    if (root / INDEX).is_file():
        weight_map = json.loads((root / INDEX).read_text()).get("weight_map", {})
        files = sorted({root / name for name in weight_map.values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in root.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
        hint = f" (found {', '.join(other)}: re-save with safe_serialization)" if other else ""
        raise PublishError(f"{root}: no safetensors weights{hint}")
    tensors: dict[str, TensorBits] = {}
    for f in files:
        if not f.is_file():
            raise PublishError(f"{root}: {f.name} is listed in {INDEX} but missing")
        try:
            part = from_safetensors(read_file_writable(f), version=None, file=str(f))
        except CorruptVersion as err:
            raise PublishError(str(err)) from None
        for name, tb in part.items():
            if name in tensors:
                raise PublishError(f"{root}: tensor {name} appears in more than one file")
            tensors[name] = tb
    return tensors, read_aux(root)


def read_aux(path: str | Path) -> dict[str, bytes]:
    """Every top-level file of an HF directory other than weights and hidden files (config, tokenizer...)."""
    root = Path(path)
    if not root.is_dir():
        raise PublishError(f"{root}: not a directory")
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())
            if p.is_file() and not p.name.startswith(".") and p.suffix not in _WEIGHT_SUFFIXES
            and p.name != INDEX}


def _write(path: Path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def write_hf_dir(out: Path, version_id: str, version_sha: str, tensors: dict[str, TensorBits],
                 aux: dict[str, bytes], shard_bytes: int) -> None:
    """Write weights (save_pretrained layout), aux files and the marker into the empty directory ``out``."""
    groups = plan_shards(((n, tensors[n].nbytes) for n in tensors), shard_bytes)
    digests: dict[str, str] = {}
    if len(groups) == 1:
        digests["model.safetensors"] = _write(out / "model.safetensors",
                                              to_safetensors({n: tensors[n] for n in groups[0]}))
    else:
        weight_map = {}
        for i, group in enumerate(groups, start=1):
            fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            digests[fname] = _write(out / fname, to_safetensors({n: tensors[n] for n in group}))
            weight_map.update(dict.fromkeys(group, fname))
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                 "weight_map": weight_map}
        digests[INDEX] = _write(out / INDEX, json.dumps(index, indent=2, sort_keys=True).encode())
    for name, data in aux.items():
        digests[name] = _write(out / name, data)
    _write(out / MARKER, seal({"id": version_id, "sha256": version_sha, "files": digests}))


def read_marker(out: Path) -> dict | None:
    """The marker of a materialised directory, or None if absent or damaged."""
    try:
        return unseal((out / MARKER).read_bytes(), what="marker", file=str(out / MARKER))
    except (OSError, CorruptVersion):
        return None


def check_materialized(out: Path, version_id: str, version_sha: str) -> bool:
    """True if ``out`` is an intact materialisation of the version (every file's SHA-256 matches)."""
    marker = read_marker(out)
    if marker is None or marker.get("id") != version_id or marker.get("sha256") != version_sha:
        return False
    for name, digest in marker.get("files", {}).items():
        try:
            h = hashlib.sha256()
            with open(out / name, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
        except OSError:
            return False
        if h.hexdigest() != digest:
            return False
    return True
