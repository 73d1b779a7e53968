"""Routes and the KV cache: which sub-layers a pass runs (`LayerMask`) and the preallocated K/V it
reads and writes (`KVCache`), with the invariant every pass keeps (`begin_pass`).

- route: which sub-layers of the verifier run. `LayerMask(attn, mlp)`, one bool per layer each; a
  skipped sub-layer leaves the residual stream unchanged. `None` means the full model.
- KV cache: one preallocated buffer per model, `[n_layers, n_kv_heads, max_len, head_dim]`, written
  by position. Rollback sets lengths; it never copies.
- n_full: the number of positions whose K/V is valid in *every* layer (written by a full pass).
  A routed pass writes only its kept attention layers, only at positions >= n_full, and reads
  positions < n_full from the full model's entries. A full pass starts at or before n_full and
  recomputes every layer, overwriting routed entries. `KVCache` enforces this: a pass that would
  read entries its route did not write raises.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from viasd.models.config import ModelConfig


@dataclass(frozen=True)
class LayerMask:
    """Which sub-layers run: `attn[i]` / `mlp[i]` for layer i. Hashable, so it keys cache lengths."""

    attn: tuple[bool, ...]
    mlp: tuple[bool, ...]

    @classmethod
    def from_layers(cls, n_layers: int, kept: Iterable[int]) -> LayerMask:
        keep = tuple(i in set(kept) for i in range(n_layers))
        return cls(attn=keep, mlp=keep)

    @property
    def n_layers(self) -> int:
        return len(self.attn)

    @property
    def fraction(self) -> float:
        """Share of sub-layer work kept (attention and MLP counted alike)."""
        return (sum(self.attn) + sum(self.mlp)) / (2 * len(self.attn))

    @property
    def is_full(self) -> bool:
        return all(self.attn) and all(self.mlp)

    @functools.cached_property
    def prefix(self) -> int:
        """How many leading layers the route keeps whole (attention and MLP). A pass along it computes,
        exactly as the full model does, the residual stream entering layer `prefix` and the K/V of
        every layer below it: what a full pass can resume from (see `KVCache.enable_resume`)."""
        return next((i for i, (a, m) in enumerate(zip(self.attn, self.mlp)) if not (a and m)), self.n_layers)

    @classmethod
    def lower(cls, n_layers: int, m: int) -> LayerMask:
        """The route of layers 0 .. m-1 only."""
        return cls.from_layers(n_layers, range(m))


class KVCache:
    """Preallocated K/V buffers written by position, with per-route valid lengths.

    k, v: [n_layers, n_kv_heads, max_len, head_dim]
    """

    def __init__(self, config: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device | str):
        shape = (config.n_layers, config.n_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.n_full = 0
        # route -> number of leading positions valid for that route (always >= n_full when read)
        self._routed: dict[LayerMask, int] = {}
        self._hidden_size, self._dtype, self._device = config.hidden, dtype, device
        # resumable full passes (off until `enable_resume`): the residual stream entering layer
        # `resume_layer`, per position, [max_len, hidden]; positions < n_exact hold it and the full
        # model's own K/V in every layer below it (n_exact >= n_full)
        self.resume_layer: int | None = None
        self.hidden: torch.Tensor | None = None
        self.n_exact = 0

    def enable_resume(self, layer: int) -> None:
        """Keep, from now on, what a full pass needs to start at `layer` (0 < layer < n_layers) for
        positions a routed pass already processed: a pass along a route with `prefix >= layer` (or a
        full pass) stores the residual stream entering `layer`; its K/V below `layer` are then the full
        model's own. Only on an empty cache."""
        n_layers = self.k.shape[0]
        if not 0 < layer < n_layers:
            raise ValueError(f"resume layer must be in 1 .. {n_layers - 1}, got {layer}")
        if self.n_full or self._routed:
            raise ValueError("resuming is enabled on an empty cache only")
        self.resume_layer = layer
        self.hidden = torch.zeros(self.max_len, self._hidden_size, dtype=self._dtype, device=self._device)
        self.n_exact = 0

    def saves_hidden(self, route: LayerMask | None) -> bool:
        """Whether a pass along `route` (None: full) computes the residual stream entering the resume layer."""
        return self.resume_layer is not None and (route is None or route.prefix >= self.resume_layer)

    def length(self, route: LayerMask | None = None) -> int:
        """Positions a pass along `route` may read: a new pass must start at or before this."""
        if route is None:
            return self.n_full
        length = max(self.n_full, self._routed.get(route, 0))
        if self.resume_layer is not None and not any(route.attn[self.resume_layer :]):
            length = max(length, self.n_exact)  # every layer it reads is the full model's up to n_exact
        return length

    def rollback(self, n: int) -> None:
        """Forget every position >= n (for every route). Rejected slots are overwritten later."""
        self.n_full = min(self.n_full, n)
        self.n_exact = min(self.n_exact, n)
        self._routed = {r: min(length, n) for r, length in self._routed.items() if min(length, n) > self.n_full}

    def rollback_route(self, route: LayerMask, n: int) -> None:
        """Forget positions >= n for one route only (its rejected drafts); n_full is untouched."""
        if route in self._routed:
            self._routed[route] = min(self._routed[route], n)
            if self._routed[route] <= self.n_full:
                del self._routed[route]
        if self.resume_layer is not None and route.prefix >= self.resume_layer:  # its stored states went with them
            self.n_exact = max(self.n_full, min(self.n_exact, n))

    @property
    def is_empty(self) -> bool:
        """Whether no position is valid for any route."""
        return self.n_full == 0 and not self._routed

    def load_prefix(self, n: int, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """Positions 0 .. n-1 of an empty cache copied from another cache's K/V (and streams entering the
        resume layer), as a full pass over them leaves it (`execution.prefix`)."""
        self.k[:, :, :n].copy_(k[:, :, :n])
        self.v[:, :, :n].copy_(v[:, :, :n])
        if hidden is not None:
            assert self.hidden is not None, "streams copied into a cache that keeps none"
            self.hidden[:n].copy_(hidden[:n])
        self._commit(None, 0, n)

    def resumable(self, start: int, end: int) -> bool:
        """Whether a full pass over positions start .. end-1 may start at the resume layer."""
        return self.resume_layer is not None and start <= self.n_full and end <= self.n_exact

    def _begin(self, route: LayerMask | None, start: int, n_tokens: int, resume: bool = False) -> None:
        if resume and (route is not None or not self.resumable(start, start + n_tokens)):
            raise ValueError(f"a full pass over positions {start} .. {start + n_tokens - 1} cannot resume at layer "
                             f"{self.resume_layer}: stored states reach {self.n_exact} (n_full={self.n_full})")
        if start + n_tokens > self.max_len:
            raise ValueError(f"KV cache overflow: positions up to {start + n_tokens} > max_len {self.max_len}")
        if start > self.length(route):
            raise ValueError(
                f"pass along {'full model' if route is None else 'route'} starts at {start} but only "
                f"{self.length(route)} positions are valid for it (n_full={self.n_full})"
            )
        if route is not None and start < self.n_full:
            raise ValueError(f"a routed pass must start at or after n_full={self.n_full} (got {start}): "
                             "it would overwrite the full model's K/V")

    def _commit(self, route: LayerMask | None, start: int, end: int) -> None:
        if self.resume_layer is not None:
            if self.saves_hidden(route):  # [start, end) now hold exact lower layers and stored states
                if start <= self.n_exact:
                    self.n_exact = end
            elif route is not None and any(route.attn[: self.resume_layer]):  # it wrote lower layers' K/V from a routed stream
                self.n_exact = min(self.n_exact, start)
        if route is None:
            # A full pass makes [start, end) valid in every layer; routed entries past it were
            # computed on routed prefixes and are dropped.
            self.n_full = end
            self._routed = {}
        else:
            # Other routes may share the layers just overwritten: they lose positions >= start.
            self._routed = {r: min(length, start) for r, length in self._routed.items() if r != route}
            self._routed[route] = end
            self._routed = {r: length for r, length in self._routed.items() if length > self.n_full}


ROW_ATTENTION_MAX = 64  # passes of up to this many rows attend row by row (batch-invariant; see Decoder.forward)


def begin_pass(config: ModelConfig, cache: KVCache, route: LayerMask | None, start: int, n_tokens: int,
               resume: bool = False) -> tuple[LayerMask | None, int]:
    """Checks shared by every decoder forward: a route keeping every layer is the full pass, a route
    must fit the model, and the cache must allow a pass along it at `start` (`resume`: a full pass
    starting at the cache's resume layer). Returns (route, end)."""
    if route is not None and route.is_full:
        route = None
    if route is not None and route.n_layers != config.n_layers:
        raise ValueError(f"route has {route.n_layers} layers, model has {config.n_layers}")
    cache._begin(route, start, n_tokens, resume)
    return route, start + n_tokens
