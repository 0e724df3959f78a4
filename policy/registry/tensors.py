"""Tensors as raw bit patterns: the registry stores and diffs the exact bits, never float values.

A tensor is held as a flat numpy array of unsigned integers of the element's width (``uint16`` for
bf16/fp16, ``uint32`` for fp32, ...), so that arithmetic on it is exact and wrap-around, and hashing
it hashes exactly the bytes a safetensors file holds (little-endian).
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from policy.registry.errors import PublishError

if TYPE_CHECKING:
    import torch

if sys.byteorder != "little":  # safetensors is little-endian; the bit views below assume the same
    raise ImportError("policy.registry needs a little-endian machine")

# safetensors dtype name -> (torch dtype attribute, element width in bytes). torch is imported only
# where tensors cross the API (publish from / load into a state dict): listing, verifying and
# materialising work on numpy bits alone and start fast.
DTYPE_SPECS: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}
WIDTH: dict[str, int] = {name: width for name, (_, width) in DTYPE_SPECS.items()}
UINT: dict[int, np.dtype] = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32),
                             8: np.dtype(np.uint64)}
INT: dict[int, np.dtype] = {1: np.dtype(np.int8), 2: np.dtype(np.int16), 4: np.dtype(np.int32),
                            8: np.dtype(np.int64)}


def _torch_tables():
    to_name = {getattr(torch, attr): name for name, (attr, _) in DTYPE_SPECS.items() if hasattr(torch, attr)}
    # torch lacks unsigned 16/32/64 views on some versions: view through the signed type instead
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return torch, to_name, ints


@dataclass
class TensorBits:
    """One tensor as its bits: ``bits`` is flat, C-contiguous, unsigned, of the dtype's width."""

    dtype: str
    shape: tuple[int, ...]
    bits: np.ndarray

    @property
    def width(self) -> int:
        return WIDTH[self.dtype]

    @property
    def nbytes(self) -> int:
        return int(self.bits.nbytes)

    def sha256(self) -> str:
        return hashlib.sha256(memoryview(self.bits).cast("B")).hexdigest()

    def copy(self) -> TensorBits:
        return TensorBits(self.dtype, self.shape, self.bits.copy())


def from_torch(name: str, tensor: torch.Tensor, *, copy: bool) -> TensorBits:
    """The bits of ``tensor`` (on CPU). ``copy=False`` may share memory with the caller's tensor."""
    _, to_name, ints = _torch_tables()
    if tensor.dtype not in to_name:
        raise PublishError(f"tensor {name}: dtype {tensor.dtype} is not supported by the registry")
    dtype = to_name[tensor.dtype]
    width = WIDTH[dtype]
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
        copy = False  # already a fresh buffer
    t = t.contiguous().reshape(-1)
    bits = t.view(ints[width]).numpy().view(UINT[width])
    if copy:
        bits = bits.copy()
    return TensorBits(dtype, tuple(int(s) for s in tensor.shape), bits)


def to_torch(tb: TensorBits) -> torch.Tensor:
    """A torch tensor of the stored dtype sharing ``tb.bits``' memory."""
    torch, _, _ = _torch_tables()
    attr, width = DTYPE_SPECS[tb.dtype]
    flat = torch.from_numpy(tb.bits.view(INT[width]) if width > 1 else tb.bits)
    return flat.view(getattr(torch, attr)).reshape(tb.shape)


def from_buffer(dtype: str, shape: tuple[int, ...], buffer, offset: int = 0, *, tensor: str = "?") -> TensorBits:
    """Bits over a bytes-like buffer: no copy; writable if the buffer is (a bytearray)."""
    if dtype not in WIDTH:
        raise PublishError(f"tensor {tensor}: dtype {dtype} is not supported by the registry")
    width = WIDTH[dtype]
    count = 1
    for s in shape:
        count *= int(s)
    bits = np.frombuffer(buffer, dtype=UINT[width], count=count, offset=offset)
    return TensorBits(dtype, tuple(int(s) for s in shape), bits)
