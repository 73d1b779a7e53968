"""The verifier of one request: every model call and every commit of a decoding loop goes through it.

The cache invariant, stated once and kept here: after each `commit`, the verifier's KV cache holds
every committed token but the last (whose logits the next pass computes together with whatever
comes after it). In tiered VIA-SD the full model may lag further behind: positions n_full ..
len(tokens)-1 are then *pending* and the next full pass processes them first.
`models.kvcache.KVCache` enforces which positions a routed pass may write (never below n_full).

An encoder-decoder verifier (T5) reads the prompt as its *source*: `prefill` encodes it once (the
cross-attention K/V go into the cache) and the committed tokens start with the decoder's start
token; everything after that is the decoder-only loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, cast

import torch

from viasd.decoding.acceptance import SamplingParams
from viasd.decoding.grammar import FORCED_MAX, Constraint
from viasd.decoding.processors import LogitProcessors, ProcessorState
from viasd.decoding.stats import DecodeStats, Source, TokenLogprob, token_logprobs
from viasd.decoding.tiers import Tier
from viasd.execution.passes import Passes
from viasd.models.decoder import Decoder
from viasd.models.kvcache import KVCache, LayerMask
from viasd.models.layers import ReducedHead
from viasd.models.logits import PassOutput

if TYPE_CHECKING:
    from viasd.decoding.drafters import Drafter
    from viasd.models.t5 import EncoderDecoder, Seq2SeqCache


class CallKind(StrEnum):
    """What a forward call was, as `DecodeStats.calls` counts it."""

    FULL = "full"  # the verifier, every layer (or resumed: every layer from the resume layer on)
    LOWER = "lower"  # the verifier's layers below the resume layer, for positions no slim pass processed
    SLIM = "slim"  # the verifier along the slim route
    DRAFT = "draft"  # a drafter: a separate model or a drafting route of the verifier


@dataclass(kw_only=True)
class DecodeRequest:
    """One request as every loop sees it."""

    prompt: list[int]  # [n] token ids
    max_new_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    eos: frozenset[int] = frozenset()
    stats: DecodeStats = field(default_factory=DecodeStats)
    generator: torch.Generator | None = None
    # called with each batch of newly committed ids, who settled each, and their logprobs (with `logprobs`)
    on_tokens: Callable[[list[int], list[Source], list[TokenLogprob] | None], None] | None = None
    passes: Passes = field(default_factory=Passes)  # how its model passes run (a server's batch, prefix caches)
    constraint: Constraint | None = None  # its grammar (`response_format`): every pass' logits are masked by it
    logprobs: int | None = None  # record each token's full-model logprob and this many alternatives (None: none)
    processors: LogitProcessors | None = None  # logit_bias and penalties: every pass' logits go through them first

    def __post_init__(self) -> None:
        if self.stats.pass_seconds is None:
            self.stats.pass_seconds = lambda: self.passes.seconds


def pass_bytes(decoder, route: LayerMask | None, from_layer: int = 0, head: bool | ReducedHead | None = True) -> int:
    """Weight bytes a pass of `decoder` along `route` reads, from layer `from_layer` on, with the full
    LM head (True or None), a reduced one, or none (False) (0 where the model does not say: T5)."""
    head = True if head is None else head
    weight_bytes = getattr(decoder, "weight_bytes", None)
    return weight_bytes(route, from_layer, head) if weight_bytes is not None else 0


class Session:
    """Decoder, KV cache, committed tokens and statistics of one request."""

    def __init__(self, decoder: Decoder, req: DecodeRequest, max_len: int, resume_layer: int | None = None):
        self.decoder, self.req, self.stats, self.passes = decoder, req, req.stats, req.passes
        self.constraint = req.constraint
        # (None at the neutral values: the default path does no extra work)
        self.processors = ProcessorState(req.processors, req.prompt) if req.processors is not None and req.processors.active else None
        self.full_bytes = self.stats.full_pass_bytes = pass_bytes(decoder, None)  # (a full pass' bytes: every round reads them)
        self.cache: KVCache = decoder.new_cache(max_len)
        if resume_layer is not None and not decoder.is_encoder_decoder:
            self.cache.enable_resume(resume_layer)
        # encoder-decoder: the prompt is the encoder's source; the decoder starts from its start token
        self.source: list[int] | None = list(req.prompt) if decoder.is_encoder_decoder else None
        # every committed token, prompt included (decoder-only) or the start token (encoder-decoder)
        self.tokens: list[int] = [cast("EncoderDecoder", decoder).start_token] if self.source is not None else list(req.prompt)
        self.out: list[int] = []  # the new tokens
        self.origins: list[int] = []  # each new token's `Tier`, where the loop records tiers
        self.sources: list[Source] = []  # who settled each new token
        self.logprobs: list[TokenLogprob] | None = [] if req.logprobs is not None else None
        self.done = req.max_new_tokens <= 0
        # tiered VIA-SD's correction mode: tokens settled without the full model are streamed only
        # once a full pass has checked them (`commit(checked=...)`), so that a correction can still
        # take them back (`retract`)
        self.hold = False
        self.streamed = 0  # new tokens passed to `req.on_tokens`

    @classmethod
    def start(cls, decoder: Decoder, drafter: Drafter | None, req: DecodeRequest, max_len: int,
              tiers: bool = False, resume_layer: int | None = None) -> Session:
        """A verifier with the whole prompt prefilled, the first new token committed from the prefill's
        last row (a round of its own; `tiers`: counted as decided by the full model), and `drafter`
        begun on it. `resume_layer`: full passes start there for positions a slim pass along a route
        keeping every layer below it already processed (`full`).

        Every strategy starts the same way, so every lossless one runs the prompt through exactly the
        passes `ar` runs: with batch-invariant passes (see `models.decoder`) their outputs are then equal
        token for token, not merely equal up to rounding."""
        if req.constraint is not None:  # room for the grammar's forced drafts (`drafters.GrammarDrafter`)
            max_len += FORCED_MAX
        verifier = cls(decoder, req, max_len, resume_layer)
        if drafter is not None:
            drafter.begin(max_len, verifier)
        if verifier.done:
            return verifier
        first = verifier.prefill()  # [1, V] the position after the prompt
        if first is not None:
            req.stats.observe_round(0, 0)
            verifier.commit([req.params.next_token(first.logits[0], req.generator, first.argmax)], [Tier.FULL] if tiers else None,
                            logits=first.logits)
        return verifier

    @property
    def budget(self) -> int:
        """New tokens the request may still commit."""
        return self.req.max_new_tokens - len(self.out)

    def prefill(self) -> PassOutput | None:
        """The whole prompt through the full model; returns the last row's logits [1, V] (the first commit
        then restores the invariant), None for an empty prompt. For an encoder-decoder, the source first
        goes through the encoder (counted as one full call)."""
        if self.source is not None:
            cast("EncoderDecoder", self.decoder).encode(torch.tensor(self.source), cast("Seq2SeqCache", self.cache))
            self.stats.observe_call(CallKind.FULL, verifier_share=1.0)
        if not self.tokens:
            return None
        out = self.passes.forward(self.decoder, list(self.tokens), 0, self.cache, last_only=True)
        self.stats.observe_call(CallKind.FULL, verifier_share=1.0, bytes_read=pass_bytes(self.decoder, None))
        return self._masked(out[:1], [])

    def full(self, ahead: list[int], n_rows: int | None = None) -> PassOutput:
        """One full pass over the pending positions, the last committed token and `ahead` (tokens past
        the committed ones: drafts, a slim-settled block). Returns the logits of the last `n_rows`
        positions (default len(ahead) + 1: the last committed token's and each of `ahead`'s), [n_rows, V].

        With a resume layer m, the pass starts at layer m from the streams slim passes stored (the same
        logits, bit for bit: the same operations on the same values); positions no slim pass processed
        first go through layers 0 .. m-1 alone (a `LOWER` call)."""
        n_rows = len(ahead) + 1 if n_rows is None else n_rows
        # (a "slim" route that keeps every layer counts as full, so n_full may be ahead: recompute)
        start, end = min(self.cache.n_full, len(self.tokens) - 1), len(self.tokens) + len(ahead)
        m, cache = self.cache.resume_layer, self.cache
        if m is None or start >= cache.n_exact:  # no position of the pass has a stored state
            return self._pass(None, start, ahead, n_rows, CallKind.FULL)
        if cache.n_exact < end:
            lower = LayerMask.lower(self.decoder.config.n_layers, m)
            seq = self.tokens + ahead
            self.passes.forward(self.decoder, seq[cache.n_exact :], cache.n_exact, cache, route=lower, logits=False)
            self.stats.observe_call(CallKind.LOWER, verifier_share=lower.fraction, bytes_read=pass_bytes(self.decoder, lower, head=False),
                                    rows=end - cache.n_exact)
        return self._pass(None, start, ahead, n_rows, CallKind.FULL, resume=True)

    def slim(self, route: LayerMask, ahead: list[int], n_rows: int | None = None, head: ReducedHead | None = None) -> PassOutput:
        """Like `full`, along `route`: it starts where the route's K/V stops being valid (a drafting
        route sharing layers may have overwritten some), at the latest at the first row asked for.
        `head`: logits over that reduced vocabulary only (-inf elsewhere)."""
        n_rows = len(ahead) + 1 if n_rows is None else n_rows
        start = min(self.cache.length(route), len(self.tokens) + len(ahead) - n_rows)
        return self._pass(route, start, ahead, n_rows, CallKind.SLIM, head=head)

    def keep_slim(self, route: LayerMask, n_ahead: int) -> None:
        """Keep the route's K/V for the committed tokens and the first `n_ahead` tokens past them only."""
        self.cache.rollback_route(route, len(self.tokens) + n_ahead)

    def _pass(self, route: LayerMask | None, start: int, ahead: list[int], n_rows: int, kind: CallKind,
              resume: bool = False, head: ReducedHead | None = None) -> PassOutput:
        n = len(self.tokens)
        rows = n + len(ahead) - start
        feed = self.tokens[start:] + ahead if start <= n else ahead[start - n :]  # (a slim pass may start inside `ahead`)
        out = self.passes.forward(self.decoder, feed, start, self.cache, route=route, resume=resume, head=head)  # [rows, V]
        first = (self.cache.resume_layer or 0) if resume else 0  # (a resumed pass has a resume layer)
        share = (1.0 if route is None else route.fraction) - (first / self.decoder.config.n_layers)
        full = route is None and not first and head is None  # (its bytes, known since the request began)
        self.stats.observe_call(kind, verifier_share=share,
                                bytes_read=self.full_bytes if full else pass_bytes(self.decoder, route, first, head), rows=rows)
        return self._masked(out if n_rows == rows else out[rows - n_rows :], ahead)  # (a slice costs ~20 us right after a pass)

    def _masked(self, out: PassOutput, ahead: list[int]) -> PassOutput:
        """out [n, V]: the logits of the last n positions of tokens + ahead, through the request's
        logit processors (bias, penalties: `processors.py`), then with what its grammar forbids at each
        set to -inf (unchanged without either: then with the maxima the pass found). So the target
        distribution every rule uses is the processed one."""
        if self.processors is None and self.constraint is None:
            return out
        rows = out.logits
        if self.processors is not None:
            rows = self.processors.process(rows, self.out, ahead)
        if self.constraint is not None:
            with self.stats.grammar_clock(rows.shape[0]):
                rows = self.constraint.mask(rows, ahead)
        return PassOutput(rows)

    def commit(self, new: list[int], tiers: Sequence[int] | None = None, checked: bool = True,
               sources: list[Source] | None = None, logits: torch.Tensor | None = None) -> int:
        """Commit `new`, cut at the token budget and after the first end token; record the kept
        tokens' tiers and `sources` (default: the full model's) and, with the request's `logprobs`,
        their log-probabilities under `logits` [>= len(new), V] (the full model's rows for them, as the
        acceptance rule saw them); stream them (with `hold`, only once `checked`: then every committed
        token goes out); restore the cache invariant. Returns how many were kept."""
        new = new[: self.budget]
        end = next((i + 1 for i, t in enumerate(new) if t in self.req.eos), None)
        self.done = end is not None or len(new) >= self.budget
        new = new[:end]
        if self.constraint is not None:
            self.constraint.commit(new)
        if self.processors is not None:
            self.processors.commit(new)
        self.tokens += new
        self.out += new
        if tiers is not None:
            self.stats.observe_tiers(tiers[: len(new)])
            self.origins += tiers[: len(new)]
        sources = (sources or [])[: len(new)]
        sources += [Source.FULL] * (len(new) - len(sources))
        self.sources += sources
        counts = self.stats.sources
        for source in sources:  # (not Counter.update: its Mapping check alone costs ~40 us right after a pass)
            counts[source] += 1
        if self.logprobs is not None and self.req.logprobs is not None and new:
            if logits is None:  # (tiered VIA-SD settles tokens without the full model: refused in settings)
                raise RuntimeError("logprobs asked for, but this loop committed tokens without the full model's logits")
            self.logprobs += token_logprobs(logits[: len(new)], new, self.req.logprobs)
        self.stats.observe_tokens(len(new))
        if checked or not self.hold:
            self.release()
        self.cache.rollback(len(self.tokens) - 1)
        return len(new)

    def release(self) -> None:
        """Stream every committed token not streamed yet (correction mode: a full pass checked them)."""
        if self.req.on_tokens and self.streamed < len(self.out):
            n = self.streamed
            self.req.on_tokens(self.out[n:], self.sources[n:], None if self.logprobs is None else self.logprobs[n:])
        self.streamed = len(self.out)

    def retract(self, n: int) -> list[int]:
        """Take back the last `n` committed tokens (correction mode: a full pass disagreed with the
        first of them), which must not have been streamed; their counts are taken back too. Returns
        their tiers."""
        if not 0 < n <= len(self.out) - self.streamed or len(self.origins) != len(self.out):
            raise RuntimeError(f"cannot retract {n} tokens: {len(self.out) - self.streamed} unstreamed, tiers of "
                               f"{len(self.origins)} of {len(self.out)} recorded")
        removed = self.origins[-n:]
        if self.processors is not None:
            self.processors.retract(self.out[-n:])
        self.stats.sources.subtract(self.sources[-n:])
        del self.tokens[-n:], self.out[-n:], self.origins[-n:], self.sources[-n:]
        if self.logprobs is not None:
            del self.logprobs[-n:]
        if self.constraint is not None:
            self.constraint.retract(n)
        self.stats.tiers.subtract(removed)
        self.stats.new_tokens -= n
        self.done = False
        self.cache.rollback(len(self.tokens) - 1)
        return removed
