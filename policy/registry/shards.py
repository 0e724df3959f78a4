"""Safetensors shards: how tensors are grouped into files, and the file format itself, on numpy bits.

Tensors are grouped in name order into shards of at most ``shard_bytes`` (a larger tensor gets a
shard of its own), so that a version is many files of similar size that transfer in parallel.

The safetensors format is written and read here directly rather than through ``safetensors.torch``
so that the registry needs no torch (its CLI starts in a fraction of a second) and so that reading
a shard is one ``readinto`` with writable zero-copy views. The layout follows the published spec:
an 8-byte little-endian header length, a JSON header mapping each name to dtype, shape and
``data_offsets`` (relative to the byte buffer after the header, padded with spaces to 8 bytes),
an optional ``__metadata__`` map of strings, then the tensors' bytes, contiguous, without holes.
Tests check that files written here load with the ``safetensors`` library and transformers.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable

from policy.registry.errors import CorruptVersion
from policy.registry.tensors import WIDTH, TensorBits, from_buffer

MAX_HEADER = 100 * 2**20


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
    """Safetensors bytes. Wider elements first, so every tensor starts aligned to its element width."""
    order = sorted(tensors, key=lambda n: (-tensors[n].width, n))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}  # what transformers checks for
    offset = 0
    for name in order:
        tb = tensors[name]
        header[name] = {"dtype": tb.dtype, "shape": list(tb.shape), "data_offsets": [offset, offset + tb.nbytes]}
        offset += tb.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    parts = [struct.pack("<Q", len(head)), head]
    parts.extend(memoryview(tensors[n].bits).cast("B") for n in order)
    return b"".join(parts)


def from_safetensors(data: bytes | bytearray | memoryview, *, version: str | None, file: str) -> dict[str, TensorBits]:
    """Parse safetensors bytes into bit views over ``data`` (writable when ``data`` is a bytearray).

    A malformed file raises :class:`CorruptVersion` naming it.
    """

    def bad(why: str) -> CorruptVersion:
        return CorruptVersion(f"unreadable safetensors ({why})", version=version, file=file)

    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise bad("shorter than its header length")
    (n,) = struct.unpack_from("<Q", view, 0)
    if n > MAX_HEADER or 8 + n > len(view):
        raise bad("header length out of range")
    try:
        header = json.loads(bytes(view[8:8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise bad(f"header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise bad("header is not an object")
    header.pop("__metadata__", None)
    body = len(view) - 8 - n
    spans = []
    out: dict[str, TensorBits] = {}
    for name, spec in header.items():
        try:
            dtype, shape, (begin, end) = spec["dtype"], [int(s) for s in spec["shape"]], spec["data_offsets"]
            if dtype not in WIDTH or any(s < 0 for s in shape) or not 0 <= begin <= end <= body:
                raise ValueError
            count = 1
            for s in shape:
                count *= s
            if end - begin != count * WIDTH[dtype]:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise bad(f"bad entry for tensor {name}") from None
        spans.append((begin, end))
        out[name] = from_buffer(dtype, tuple(shape), view, 8 + n + begin, tensor=name)
    pos = 0
    for begin, end in sorted(spans):
        if begin != pos:
            raise bad("tensor data overlaps or leaves holes")
        pos = end
    if pos != body:
        raise bad("trailing bytes after the tensor data")
    return out


def read_file_writable(path) -> bytearray:
    """A whole file in a bytearray (so parsed tensors are writable views, decoded in place)."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        buf = bytearray(size)
        if f.readinto(buf) != size:
            raise OSError(f"{path}: short read")
    return buf
