"""Tensors as raw bit patterns: the registry stores and diffs the exact bits, never float values.

A tensor is held as a flat numpy array of unsigned integers of the element's width (``uint16`` for
bf16/fp16, ``uint32`` for fp32, ...), so that arithmetic on it is exact and wrap-around, and hashing
it hashes exactly the bytes a safetensors file holds (little-endian).
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass

import numpy as np
import torch

from policy.registry.errors import PublishError

if sys.byteorder != "little":  # safetensors is little-endian; the bit views below assume the same
    raise ImportError("policy.registry needs a little-endian machine")

# safetensors dtype name -> (torch dtype, element width in bytes)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        DTYPES[_name] = (getattr(torch, _attr), 1)

TORCH_TO_NAME: dict[torch.dtype, str] = {dt: name for name, (dt, _) in DTYPES.items()}
UINT: dict[int, np.dtype] = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32),
                             8: np.dtype(np.uint64)}
INT: dict[int, np.dtype] = {1: np.dtype(np.int8), 2: np.dtype(np.int16), 4: np.dtype(np.int32),
                            8: np.dtype(np.int64)}
# torch has no unsigned 16/32/64 views everywhere; view through the signed type, then numpy-view as unsigned
_TORCH_INT: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class TensorBits:
    """One tensor as its bits: ``bits`` is flat, C-contiguous, unsigned, of the dtype's width."""

    dtype: str
    shape: tuple[int, ...]
    bits: np.ndarray

    @property
    def width(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def nbytes(self) -> int:
        return int(self.bits.nbytes)

    def sha256(self) -> str:
        return hashlib.sha256(memoryview(self.bits).cast("B")).hexdigest()

    def copy(self) -> TensorBits:
        return TensorBits(self.dtype, self.shape, self.bits.copy())


def from_torch(name: str, tensor: torch.Tensor, *, copy: bool) -> TensorBits:
    """The bits of ``tensor`` (on CPU). ``copy=False`` may share memory with the caller's tensor."""
    if tensor.dtype not in TORCH_TO_NAME:
        raise PublishError(f"tensor {name}: dtype {tensor.dtype} is not supported by the registry")
    dtype = TORCH_TO_NAME[tensor.dtype]
    width = DTYPES[dtype][1]
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
        copy = False  # already a fresh buffer
    t = t.contiguous().reshape(-1)
    bits = t.view(_TORCH_INT[width]).numpy().view(UINT[width])
    if copy:
        bits = bits.copy()
    return TensorBits(dtype, tuple(int(s) for s in tensor.shape), bits)


def to_torch(tb: TensorBits) -> torch.Tensor:
    """A torch tensor of the stored dtype sharing ``tb.bits``' memory."""
    torch_dtype, width = DTYPES[tb.dtype]
    flat = torch.from_numpy(tb.bits.view(INT[width]) if width > 1 else tb.bits)
    return flat.view(torch_dtype).reshape(tb.shape)


def from_buffer(dtype: str, shape: tuple[int, ...], buffer, *, tensor: str = "?") -> TensorBits:
    """Bits over a bytes-like buffer (read-only view; no copy)."""
    if dtype not in DTYPES:
        raise PublishError(f"tensor {tensor}: dtype {dtype} is not supported by the registry")
    width = DTYPES[dtype][1]
    bits = np.frombuffer(buffer, dtype=UINT[width])
    expected = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if bits.size != expected:
        raise ValueError(f"tensor {tensor}: {bits.size} elements where shape {list(shape)} needs {expected}")
    return TensorBits(dtype, tuple(shape), bits)
