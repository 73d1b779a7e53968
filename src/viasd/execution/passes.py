"""How one request runs its model passes: directly (`viasd generate`), or parked in a server's batch
session beside other requests' passes, through the prefix caches of its models, timed.

The model layer only computes (`Decoder.forward`); what serving adds wraps it from here and is handed
to the decoding loops explicitly, as `DecodeRequest.passes`: the verifier and the drafters call
`passes.forward(decoder, ...)`, and the draft-length policy asks it whether the request's passes are
its own (`alone`, `others`) and measures pass costs through it (`exclusive`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from viasd.execution.batching import BatchSession
from viasd.execution.prefix import PrefixCache
from viasd.models.decoder import token_ids

if TYPE_CHECKING:
    import torch

    from viasd.models.kvcache import KVCache
    from viasd.models.logits import PassOutput

T = TypeVar("T")


class Passes:
    """One request's way to its models' passes. `session`: a batch session the request is a member of
    (None: its passes run on the calling thread); `prefix`: (decoder, PrefixCache) pairs, the caches
    its prompt passes go through. `seconds`: time spent in passes so far, waiting for a batch's pass
    included (what a decode spends outside them is host time: `DecodeStats.decode_pass_s`)."""

    def __init__(self, session: BatchSession | None = None, prefix: Iterable[tuple[object, PrefixCache]] = ()):
        self.session = session
        self._prefix = {id(d): c for d, c in prefix}
        self.seconds = 0.0

    @overload
    def forward(self, decoder, tokens: torch.Tensor | list[int], start: int, cache: KVCache, *, logits: Literal[False],
                **kw: Any) -> None: ...
    @overload
    def forward(self, decoder, tokens: torch.Tensor | list[int], start: int, cache: KVCache, **kw: Any) -> PassOutput: ...

    def forward(self, decoder, tokens: torch.Tensor | list[int], start: int, cache: KVCache, **kw: Any) -> PassOutput | None:
        """`decoder.forward(tokens, start, cache, scored=True, **kw)`, run as this request runs its passes:
        the logits with the rows' maxima the pass found (None: a pass without logits)."""
        kw["scored"] = True
        t0 = time.perf_counter()
        try:
            kept = self._prefix.get(id(decoder))
            if kept is not None and start == 0 and cache.is_empty and kw.get("route") is None and not kw.get("resume") \
                    and (kw.get("last_only") or not kw.get("logits", True)):
                return self._prefill(kept, decoder, tokens, cache, **kw)
            return self._pass(decoder, tokens, start, cache, **kw)
        finally:
            self.seconds += time.perf_counter() - t0

    def cached(self, decoder, tokens: list[int]) -> int:
        """Positions of a prompt pass over `tokens` that `decoder`'s prefix cache would supply (0: none)."""
        kept = self._prefix.get(id(decoder))
        return kept.shared(tokens) if kept is not None else 0

    def _pass(self, decoder, *args, **kw):
        if self.session is not None:  # the compute thread runs it with the other members' calls
            return self.session.forward(decoder, *args, **kw)
        return decoder.forward(*args, **kw)

    def _prefill(self, kept: PrefixCache, decoder, tokens: torch.Tensor | list[int], cache: KVCache, **kw) -> PassOutput | None:
        """A prompt's pass from position 0 through the prefix cache: the longest cached prefix's K/V
        copied in, the rest computed, the whole prompt's K/V kept for the next one. Rows are computed
        independently, so the result is what the whole pass gives."""
        ids = token_ids(tokens)
        n = 0
        if (hit := kept.lookup(ids, cache.resume_layer)) is not None:
            n, k, v, hidden = hit
            cache.load_prefix(n, k, v, hidden)
        out = self._pass(decoder, tokens[n:], n, cache, **kw)
        kept.store(ids, cache.k, cache.v, cache.hidden, cache.resume_layer)
        return out

    def alone(self) -> bool:
        """Whether this request's passes are its own: no batch session, or its only request (a server's
        requests waiting, starting or finishing beside it count: their work shares the cores)."""
        return self.session is None or self.session.alone()

    def others(self) -> int:
        """Other requests in the batch session, whose rows share this one's passes (0 outside one)."""
        return max(0, self.session.members - 1) if self.session is not None else 0

    def exclusive(self, fn: Callable[[], T]) -> T:
        """`fn()` with no other request's pass beside it or between its passes (measuring pass costs)."""
        return self.session.exclusive(fn) if self.session is not None else fn()
