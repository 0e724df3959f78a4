"""Capturing and replaying mixture-of-experts routes in a transformers model.

Each supported router (the softmax-then-top-k routers of Qwen3-MoE, Qwen2-MoE, OLMoE and Mixtral:
``mlp.gate``, returning ``(router_logits, router_scores, router_indices)``) gets one forward hook,
registered the first time a :class:`RouteSession` is opened on the model. The hook does nothing
unless a session of the calling thread covers that router, so a model can be shared between threads
and the cost without a session is one dictionary lookup per layer.

Inside a session, per forward pass:

* **capture**: the live top-k indices of every MoE layer are kept (:meth:`RouteSession.live`
  stacks them to ``[tokens, layers, top_k]``, rows in the flattened ``batch x sequence`` order of
  the forward's input);
* **compare**: given recorded routes for the forward's positions (:meth:`RouteSession.expect`), the
  hook counts the (position, layer) pairs whose live expert set differs from the recorded one;
* **replay**: with ``replay=True`` the recorded experts replace the live choice on every position
  the mask covers, and the gate weights are recomputed from the *live* router logits over the
  forced experts: w = softmax(logits)[forced], renormalised over the top-k where the router
  normalises (``norm_topk_prob``; Mixtral always). The router therefore still receives gradients,
  and where the forced experts equal the live ones the weights are bit-identical to the router's.
  Positions outside the mask (padding, the unrecorded last token) keep the live routing.

R3 (Ma et al., 2025, arXiv 2510.11370) computes the replayed gate weights as a softmax of the
training logits restricted to the recorded experts. For a router that renormalises over its top-k
that is the same number as the gather-then-renormalise above (the full softmax's denominator
cancels); for one that does not (Qwen3-MoE with ``norm_topk_prob`` off) this module keeps that
router's own, un-renormalised weights, so that replaying the live routes changes nothing.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

from policy.routes import RouteGeometry

SUPPORTED_ROUTERS = frozenset({"Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter", "MixtralTopKRouter"})
"""Router classes whose output is (logits, top-k softmax weights, top-k indices)."""


class RouteMismatch(ValueError):
    """Recorded routes that do not fit the model they are replayed on; the message names the layer."""


_ACTIVE = threading.local()
_HOOK_LOCK = threading.Lock()
_GEOMETRY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _active() -> dict:
    table = getattr(_ACTIVE, "routers", None)
    if table is None:
        table = _ACTIVE.routers = {}
    return table


def routers(model) -> list[tuple[str, torch.nn.Module]]:
    """The model's supported routers (name, module) in model order; an MoE router of another kind is
    an error (its output cannot be replayed by this module)."""
    found, unknown = [], []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in SUPPORTED_ROUTERS:
            found.append((name, module))
        elif kind.endswith("Router") and hasattr(module, "top_k"):
            unknown.append(f"{name} ({kind})")
    if unknown:
        raise RouteMismatch(f"router(s) {', '.join(unknown)} are not supported for route capture and replay "
                            f"(supported: {', '.join(sorted(SUPPORTED_ROUTERS))})")
    return found


def _described(model) -> tuple[RouteGeometry | None, list[tuple[str, torch.nn.Module]]]:
    if model in _GEOMETRY:
        return _GEOMETRY[model]
    found = routers(model)
    geometry = None
    if found:
        ks = {int(m.top_k) for _, m in found}
        es = {int(m.num_experts) for _, m in found}
        if len(ks) != 1 or len(es) != 1:
            raise RouteMismatch(f"MoE layers differ in top-k {sorted(ks)} or expert count {sorted(es)}: one "
                                "route record cannot describe them")
        geometry = RouteGeometry(len(found), es.pop(), ks.pop(), tuple(n for n, _ in found))
    _GEOMETRY[model] = geometry, found
    return geometry, found


def geometry_of(model) -> RouteGeometry | None:
    """The model's route geometry (None for a dense model); cached per model."""
    return _described(model)[0]


def _dispatch(module, _args, output):
    entry = _active().get(module)
    if entry is None:
        return None
    session, layer = entry
    return session._on_router(layer, module, output)


def _attach(found: list[tuple[str, torch.nn.Module]]) -> None:
    with _HOOK_LOCK:
        for _, module in found:
            if not getattr(module, "_rtrl_route_hook", False):
                module.register_forward_hook(_dispatch)
                module._rtrl_route_hook = True


@dataclass
class RouteStats:
    """Recorded-versus-live routing over the positions a session compared."""

    pairs_differ: int = 0
    pairs: int = 0
    tokens_differ: int = 0
    tokens: int = 0

    def __add__(self, other: RouteStats) -> RouteStats:
        return RouteStats(self.pairs_differ + other.pairs_differ, self.pairs + other.pairs,
                          self.tokens_differ + other.tokens_differ, self.tokens + other.tokens)

    @property
    def rate(self) -> float:
        """Share of (position, layer) pairs whose live expert set differs from the recorded one."""
        return self.pairs_differ / self.pairs if self.pairs else 0.0

    @property
    def token_rate(self) -> float:
        """Share of positions that differ in at least one layer."""
        return self.tokens_differ / self.tokens if self.tokens else 0.0


class RouteSession:
    """Capture / compare / replay on one model, for the calling thread (see the module docstring).
    Use as a context manager; :func:`route_session` opens one."""

    def __init__(self, model, geometry: RouteGeometry, found: list[tuple[str, torch.nn.Module]], capture: bool):
        self.model, self.geometry, self._found, self.capture = model, geometry, found, capture
        self._live: list[torch.Tensor | None] = [None] * geometry.layers
        self._forced: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._replay = False
        self._any: torch.Tensor | None = None
        self._counts: list[torch.Tensor | int] = [0, 0, 0, 0]

    def __enter__(self) -> RouteSession:
        _attach(self._found)
        table = _active()
        for layer, (name, module) in enumerate(self._found):
            if module in table:
                raise RuntimeError(f"{name}: a route session is already open on this thread")
            table[module] = (self, layer)
        return self

    def __exit__(self, *exc) -> None:
        table = _active()
        for _, module in self._found:
            table.pop(module, None)

    def expect(self, routes: torch.Tensor | None, mask: torch.Tensor | None = None, *, replay: bool) -> None:
        """Recorded routes for the next forward passes: ``routes`` [tokens, layers, top_k] in the
        flattened order of the forward's input, ``mask`` [tokens] True where they were recorded.
        ``replay``: force them; else only compare. None stops comparing."""
        if routes is None:
            self._forced = self._mask = None
            return
        if routes.dim() != 3 or routes.shape[1] != self.geometry.layers:
            raise RouteMismatch(f"routes carry {routes.shape[1] if routes.dim() == 3 else '?'} MoE layers, the model "
                                f"has {self.geometry.layers} ({', '.join(self.geometry.names)})")
        self._forced = routes.long()
        self._mask = torch.ones(routes.shape[0], dtype=torch.bool, device=routes.device) if mask is None else mask
        self._replay = replay

    def live(self) -> torch.Tensor:
        """The last forward's live routes, [tokens, layers, top_k] (sessions opened with ``capture``)."""
        if any(t is None for t in self._live):
            raise RuntimeError("no forward pass captured every MoE layer")
        return torch.stack(self._live, dim=1)  # type: ignore[arg-type]

    @property
    def stats(self) -> RouteStats:
        return RouteStats(*(int(c) for c in self._counts))

    def _on_router(self, layer: int, module, output):
        logits, scores, live = output
        if self.capture:
            self._live[layer] = live.detach()
        forced = self._forced
        if forced is None:
            return None
        name = self.geometry.layer_name(layer)
        if forced.shape[0] != live.shape[0]:
            raise RouteMismatch(f"{name}: routes for {forced.shape[0]} positions, the forward pass has "
                                f"{live.shape[0]}")
        want = forced[:, layer].to(live.device)
        if want.shape[1] != live.shape[1]:
            raise RouteMismatch(f"{name}: routes give {want.shape[1]} experts per token, its router picks "
                                f"{live.shape[1]}")
        mask = self._mask.to(live.device)
        with torch.no_grad():
            differ = (want.sort(-1).values != live.sort(-1).values).any(-1) & mask
            self._any = differ if layer == 0 or self._any is None else self._any | differ
            self._counts[0] += differ.sum()
            self._counts[1] += mask.sum()
            if layer == self.geometry.layers - 1:
                self._counts[2] += self._any.sum()
                self._counts[3] += mask.sum()
                self._any = None
        if not self._replay:
            return None
        chosen = torch.where(mask.unsqueeze(1), want, live)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, chosen)
        if getattr(module, "norm_topk_prob", True):  # Mixtral's router has no switch: it always renormalises
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(scores.dtype), chosen


def route_session(model, *, capture: bool = False) -> RouteSession | None:
    """A session on ``model``'s routers, or None for a dense model."""
    geometry, found = _described(model)
    if geometry is None:
        return None
    return RouteSession(model, geometry, found, capture)
