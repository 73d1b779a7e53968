"""Prompt prefix caching: the K/V of recent prompts, reused for the longest prefix a new prompt shares
with one of them (a chat template's system prompt, a conversation's earlier turns, the same prompt
again), as llama.cpp's server (`cache_prompt`) and vLLM (automatic prefix caching) do.

Reuse changes no result: every row of a pass is computed independently (row-exact products, each row
attending its own keys in order), so a position's K/V are the same whether it was computed in this
prompt's prefill, in another's, or in a pass of any size. Only a full-model prefill from position 0
of an empty cache takes part, and only when it asks for the last row's logits or none: the reused
positions' own logits are not kept. A cache that keeps residual streams for resumed passes
(`KVCache.enable_resume`, VIA-SD) reuses entries kept at the same layer, streams included.

Off by default (a benchmark's prompts would share their template's prefill, and their timings with
it): a request's passes go through the caches its `execution.passes.Passes` is given; `viasd serve`
gives every request its models' caches (`--prefix-cache-mb`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

MIN_REUSE = 4  # positions: shorter shared prefixes are computed again (the copy is not worth it)


class PrefixCache:
    """Up to `budget_bytes` of recent prompts' K/V (least recently used dropped first), thread-safe."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = int(budget_bytes)
        # (resume layer or None, tokens) -> (k, v, residual streams entering the resume layer or None)
        self._entries: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.reused_positions = self.lookups = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def lookup(self, tokens: list[int], layer: int | None = None) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """The longest cached prefix of `tokens` kept at resume layer `layer`, at most len(tokens) - 1
        positions (the last row is always computed: its logits are the pass' result): (n, k, v,
        hidden) with k, v [layers, kv_heads, >= n, head_dim] and hidden [>= n, hidden] (None without
        a layer), or None when it is shorter than MIN_REUSE."""
        with self._lock:
            self.lookups += 1
            best, found = self._longest(tokens, layer)
            if found is None:
                return None
            self._entries.move_to_end(found[0])
            self.hits += 1
            self.reused_positions += best
            return (best, *found[1])

    def shared(self, tokens: list[int], layer: int | None = None) -> int:
        """How many of `tokens`' positions `lookup` would reuse now (0: none; nothing counted or moved)."""
        with self._lock:
            return self._longest(tokens, layer)[0]

    def _longest(self, tokens: list[int], layer: int | None) -> tuple[int, tuple | None]:
        """(n, (key, kept)) of the entry sharing the longest prefix with `tokens` (at most
        len(tokens) - 1 positions), or (0, None) below MIN_REUSE; the caller holds the lock."""
        best, found = 0, None
        for key, kept in self._entries.items():
            n = _common_prefix(key[1], tokens, len(tokens) - 1) if key[0] == layer else 0
            if n > best:
                best, found = n, (key, kept)
        return (best, found) if best >= MIN_REUSE else (0, None)

    def store(self, tokens: list[int], k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None = None,
              layer: int | None = None) -> None:
        """Keep the K/V of `tokens` (k, v [layers, kv_heads, >= len(tokens), head_dim]; with `layer`,
        the residual streams entering it, hidden [>= len(tokens), hidden]; copied)."""
        n = len(tokens)
        size = _bytes(k[:, :, :n]) * 2 + (_bytes(hidden[:n]) if hidden is not None else 0)
        if n < MIN_REUSE or size > self.budget_bytes:
            return
        key = (layer, tuple(tokens))
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
        kept = (k[:, :, :n].clone(), v[:, :, :n].clone(), None if hidden is None else hidden[:n].clone())
        with self._lock:
            if key in self._entries:
                return
            # a prompt that extends a cached one replaces it (its K/V hold the shorter one's)
            for old in [old for old in self._entries if old[0] == layer and len(old[1]) < n and key[1][: len(old[1])] == old[1]]:
                self._drop(old)
            while self._entries and self._bytes + size > self.budget_bytes:
                self._drop(next(iter(self._entries)))
            self._entries[key] = kept
            self._bytes += size

    def _drop(self, key: tuple) -> None:
        self._bytes -= sum(_bytes(t) for t in self._entries.pop(key) if t is not None)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _common_prefix(a: tuple[int, ...], b: list[int], limit: int) -> int:
    n, m = 0, min(len(a), len(b), limit)
    while n < m and a[n] == b[n]:
        n += 1
    return n
