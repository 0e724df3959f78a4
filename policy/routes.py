"""Mixture-of-experts routes: which experts each position of a sequence went to, and their wire form.

A *route record* is an integer array ``[positions, layers, top_k]``. ``positions`` are the tokens the
model consumed while it produced a completion: the prompt's P tokens and every sampled token but the
last (the last one is never fed back), P + C − 1 in all, in order. ``layers`` are the model's MoE
layers in model order (dense layers have no router and no entry). Each entry holds the top-k
expert ids that layer's router chose for that position, in the router's order (descending gate
probability). This is the layout of vLLM's ``routed_experts`` and of the replay in R3 (Ma et al.,
2025, arXiv 2510.11370): replaying the prompt's routes as well as the completion's is what makes the
trainer's forward pass see the same hidden states the sampler saw.

Wire form (completion events, the feedback tables), a JSON object::

    {"shape": [T, L, K], "experts": E, "data": "<base64>"}

``data`` is the ids bit-packed at ``b = ceil(log2 E)`` bits each (MSB first, row-major over
[T, L, K], zero-padded to whole bytes), then base64. A top-2 route of a 4-expert layer costs
4 bits per token per layer, 0.67 bytes after base64; a top-8 of 64 costs 8 bytes. Bit-packing
rather than one byte per id is what keeps the tiny model under 2 bytes per token per layer after
base64's 4/3.

Pure functions over numpy (and the pydantic schema of the wire form): no torch here, so the ingester can check routes without loading it.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import GetCoreSchemaHandler
from pydantic_core import core_schema

MAX_EXPERTS = 1 << 16
"""Expert ids are stored as uint8 (up to 256 experts) or uint16."""


class RouteFormatError(ValueError):
    """A route record that cannot be decoded, or does not fit the model or the sequence it belongs to."""


def id_bits(experts: int) -> int:
    """Bits per expert id on the wire: ceil(log2 experts), at least 1."""
    return max(1, (experts - 1).bit_length())


def _dtype(experts: int) -> np.dtype:
    return np.dtype(np.uint8 if experts <= 256 else np.uint16)


@dataclass(frozen=True, eq=False)
class Routes:
    """One sequence's route record: ``ids`` [positions, layers, top_k] of a model with ``experts``
    experts per MoE layer."""

    ids: np.ndarray
    experts: int

    def __post_init__(self) -> None:
        if not 1 <= self.experts <= MAX_EXPERTS:
            raise RouteFormatError(f"experts must be in [1, {MAX_EXPERTS}], got {self.experts}")
        if self.ids.ndim != 3:
            raise RouteFormatError(f"routes must be [positions, layers, top_k], got shape {list(self.ids.shape)}")
        if self.ids.dtype != _dtype(self.experts):
            object.__setattr__(self, "ids", self.ids.astype(_dtype(self.experts)))

    @property
    def positions(self) -> int:
        return int(self.ids.shape[0])

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(int(n) for n in self.ids.shape)  # type: ignore[return-value]

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        """In a pydantic model (the rollout wire batches) a record travels in its wire form."""
        from_wire = core_schema.no_info_plain_validator_function(
            lambda v: v if isinstance(v, cls) else cls.from_wire(v))
        return core_schema.json_or_python_schema(
            json_schema=from_wire, python_schema=from_wire,
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda r: r.to_wire(), when_used="json"))

    def same_as(self, other: Routes) -> bool:
        return self.experts == other.experts and np.array_equal(self.ids, other.ids)

    def to_wire(self) -> dict[str, Any]:
        """The JSON object described in the module docstring."""
        if self.ids.size and int(self.ids.max()) >= self.experts:
            raise RouteFormatError(f"expert id {int(self.ids.max())} does not fit a record of {self.experts} experts")
        bits = id_bits(self.experts)
        flat = self.ids.reshape(-1).astype(np.uint32)
        planes = (flat[:, None] >> np.arange(bits - 1, -1, -1, dtype=np.uint32)) & 1
        packed = np.packbits(planes.astype(np.uint8).reshape(-1))
        return {"shape": list(self.shape), "experts": self.experts, "data": base64.b64encode(packed.tobytes()).decode()}

    @classmethod
    def from_wire(cls, record: Mapping[str, Any]) -> Routes:
        """Decode :meth:`to_wire`'s object; a malformed one raises :class:`RouteFormatError` saying why."""
        try:
            shape = [int(n) for n in record["shape"]]
            experts = int(record["experts"])
            raw = base64.b64decode(record["data"], validate=True)
        except (KeyError, TypeError, ValueError, binascii.Error) as err:
            raise RouteFormatError(f"routes: not a route record ({type(err).__name__}: {err})") from None
        if len(shape) != 3 or min(shape) < 0:
            raise RouteFormatError(f"routes: shape must be [positions, layers, top_k], got {shape}")
        if not 1 <= experts <= MAX_EXPERTS:
            raise RouteFormatError(f"routes: experts must be in [1, {MAX_EXPERTS}], got {experts}")
        n, bits = shape[0] * shape[1] * shape[2], id_bits(experts)
        if len(raw) != (n * bits + 7) // 8:
            raise RouteFormatError(f"routes: {len(raw)} bytes of data for shape {shape} at {bits} bits an id "
                                   f"(expected {(n * bits + 7) // 8})")
        planes = np.unpackbits(np.frombuffer(raw, dtype=np.uint8))[:n * bits].reshape(n, bits).astype(np.uint32)
        ids = (planes << np.arange(bits - 1, -1, -1, dtype=np.uint32)).sum(axis=1)
        return cls(ids.astype(_dtype(experts)).reshape(shape), experts)


def extend(previous: Routes | None, latest: Routes) -> Routes:
    """The routes of a sequence sampled in several calls (a multi-turn episode re-sends its history as
    the next prompt): the positions ``previous`` already covers keep the routes they were sampled
    with, and ``latest`` adds the rest."""
    if previous is None:
        return latest
    if previous.experts != latest.experts or previous.ids.shape[1:] != latest.ids.shape[1:]:
        raise RouteFormatError(f"routes of shape {list(latest.shape)} cannot extend {list(previous.shape)}")
    if latest.positions < previous.positions:
        raise RouteFormatError(f"routes of {latest.positions} positions cannot extend {previous.positions}")
    return Routes(np.concatenate([previous.ids, latest.ids[previous.positions:]]), latest.experts)


@dataclass(frozen=True)
class RouteGeometry:
    """What a model's routes look like: MoE ``layers``, ``experts`` per layer, ``top_k`` per token."""

    layers: int
    experts: int
    top_k: int
    names: tuple[str, ...] = ()
    """The routers' module names in model order, when known (messages name the layer by them)."""

    def layer_name(self, layer: int) -> str:
        if layer < len(self.names):
            return f"MoE layer {layer} ({self.names[layer]})"
        return f"MoE layer {layer}"


def moe_layers(config: Mapping[str, Any]) -> list[int]:
    """Indices (among all decoder layers) of the MoE layers of a Hugging Face ``config.json``
    (Qwen2/3-MoE, Mixtral, OLMoE style); empty for a dense model. Qwen-style configs may keep some
    layers dense (``mlp_only_layers``, ``decoder_sparse_step``): those have no router."""
    experts = config.get("num_experts", config.get("num_local_experts")) or 0
    if experts <= 0 or (config.get("num_experts_per_tok") or 0) <= 0:
        return []
    dense = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step") or 1)
    return [i for i in range(int(config.get("num_hidden_layers", 0))) if i not in dense and (i + 1) % step == 0]


def geometry_from_config(config: Mapping[str, Any]) -> RouteGeometry | None:
    """The route geometry of a Hugging Face ``config.json`` (see :func:`moe_layers`), or None for a
    dense model."""
    layers = moe_layers(config)
    if not layers:
        return None
    experts = config.get("num_experts", config.get("num_local_experts"))
    return RouteGeometry(len(layers), int(experts), int(config["num_experts_per_tok"]))


def route_problem(routes: Routes, geometry: RouteGeometry | None, positions: int | None = None) -> str | None:
    """Why ``routes`` cannot be replayed on a model of ``geometry`` for a sequence of ``positions``
    consumed tokens (P + C − 1), or None. Layer-specific problems name the layer. The record's own
    ``experts`` is only its encoding width: ids are checked against the model's expert count."""
    n_pos, n_layers, k = routes.shape
    if positions is not None and n_pos != positions:
        return f"routes cover {n_pos} positions, the sequence has {positions} (prompt + completion - 1)"
    if geometry is None:
        return "routes given for a model without MoE layers"
    if n_layers != geometry.layers:
        return f"routes carry {n_layers} MoE layers, the model has {geometry.layers}"
    if k != geometry.top_k:
        return f"{geometry.layer_name(0)}: routes give {k} experts per token, its router picks {geometry.top_k}"
    if n_pos == 0:
        return None
    for layer in range(n_layers):
        ids = routes.ids[:, layer, :]
        top = int(ids.max())
        if top >= geometry.experts:
            t = int(np.argwhere(ids >= geometry.experts)[0][0])
            return (f"{geometry.layer_name(layer)}: expert id {top} at position {t} is out of range "
                    f"({geometry.experts} experts)")
        if k > 1:
            srt = np.sort(ids, axis=1)
            dup = np.flatnonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))
            if dup.size:
                return f"{geometry.layer_name(layer)}: position {int(dup[0])} names an expert twice"
    return None


def disagreement(a: np.ndarray, b: np.ndarray) -> tuple[int, int, int]:
    """How two route arrays of one shape [T, L, K] differ, comparing each (position, layer)'s expert
    *set*: (pairs that differ, positions with a difference in some layer, positions)."""
    if a.shape != b.shape:
        raise RouteFormatError(f"cannot compare routes of shapes {list(a.shape)} and {list(b.shape)}")
    diff = (np.sort(a, axis=2) != np.sort(b, axis=2)).any(axis=2)
    return int(diff.sum()), int(diff.any(axis=1).sum()), int(a.shape[0])
