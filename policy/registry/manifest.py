"""The manifest: what a version is, what it holds, and how to check every byte of it.

A manifest is written in one canonical JSON form (sorted keys, fixed indentation) and carries the
SHA-256 of that form (computed with ``manifest_sha256`` empty). Reading checks both that the bytes
are exactly the canonical form and that the hash matches, so a change to any byte of the manifest
file is detected, even one JSON would parse.

Identity: the whole-version SHA-256 hashes the sorted list of (tensor name, dtype, shape, tensor
SHA-256) and (aux file name, SHA-256); the version id is its first 12 hex digits. Parent, time,
stage, run and metrics are not part of the identity: publishing identical weights again returns
the existing version.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from policy.registry.errors import CorruptVersion
from policy.registry.tensors import WIDTH

FORMAT = "rtrl-registry/1"
ID_HEX = 12


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorEntry(_Model):
    name: str
    dtype: str
    shape: list[int]
    sha256: str
    file: str = Field(description="Shard or delta file holding this tensor.")
    coding: Literal["snapshot", "delta", "raw"] = Field(
        description="snapshot: plain safetensors; delta: frames against the parent's tensor of the same "
        "name; raw: compressed bits in a delta file (the parent had no matching tensor).")

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * WIDTH[self.dtype]


class FileEntry(_Model):
    name: str
    role: Literal["snapshot", "delta", "aux"]
    bytes: int
    sha256: str


class Manifest(_Model):
    format: str = FORMAT
    id: str
    sha256: str = Field(description="Whole-version SHA-256 (tensors and aux files).")
    parent: str | None
    created: float = Field(description="Unix time of publication.")
    stage: str | None = None
    run: str | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    kind: Literal["snapshot", "delta"]
    depth: int = Field(description="Deltas between this version and its nearest snapshot (0 for one).")
    tensors: list[TensorEntry]
    files: list[FileEntry]
    codec: dict[str, Any] = Field(default_factory=dict)
    stats: dict[str, float] = Field(default_factory=dict)
    manifest_sha256: str = ""

    @property
    def created_iso(self) -> str:
        return datetime.fromtimestamp(self.created, UTC).isoformat(timespec="seconds")

    @property
    def raw_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def stored_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def tensor(self, name: str) -> TensorEntry:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def aux_files(self) -> list[FileEntry]:
        return [f for f in self.files if f.role == "aux"]

    def weight_files(self) -> list[FileEntry]:
        return [f for f in self.files if f.role != "aux"]


def canonical(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, sort_keys=True, indent=1, ensure_ascii=True) + "\n").encode()


def seal(data: dict[str, Any]) -> bytes:
    """Canonical bytes of ``data`` with its own SHA-256 in ``manifest_sha256``."""
    body = dict(data, manifest_sha256="")
    digest = hashlib.sha256(canonical(body)).hexdigest()
    return canonical(dict(body, manifest_sha256=digest))


def unseal(raw: bytes, *, what: str, version: str | None = None, file: str | None = None) -> dict[str, Any]:
    """Parse bytes written by :func:`seal`, refusing any that were changed."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptVersion(f"{what} is not valid JSON ({err})", version=version, file=file) from None
    if not isinstance(data, dict) or canonical(data) != raw:
        raise CorruptVersion(f"{what} bytes are not in canonical form (edited or corrupted)",
                             version=version, file=file)
    claimed = data.get("manifest_sha256", "")
    actual = hashlib.sha256(canonical(dict(data, manifest_sha256=""))).hexdigest()
    if claimed != actual:
        raise CorruptVersion(f"{what} checksum mismatch", version=version, file=file)
    return data


def encode_manifest(manifest: Manifest) -> bytes:
    return seal(manifest.model_dump(mode="json"))


def decode_manifest(raw: bytes, version_id: str) -> Manifest:
    data = unseal(raw, what="manifest", version=version_id, file="manifest.json")
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as err:
        raise CorruptVersion(f"manifest does not validate: {err}", version=version_id,
                             file="manifest.json") from None
    if manifest.format != FORMAT:
        raise CorruptVersion(f"unknown manifest format {manifest.format!r}", version=version_id)
    if manifest.id != version_id:
        raise CorruptVersion(f"manifest names id {manifest.id}", version=version_id, file="manifest.json")
    return manifest


def version_sha256(tensors: list[tuple[str, str, list[int], str]], aux: list[tuple[str, str]]) -> str:
    """Whole-version SHA-256 over (name, dtype, shape, sha256) of tensors and (name, sha256) of aux files."""
    listing = {"tensors": sorted([list(t) for t in tensors]), "aux": sorted([list(a) for a in aux])}
    return hashlib.sha256(json.dumps(listing, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
