"""Drafters: one small protocol of two methods, three kinds.

`begin(max_len, session)` starts a request (a self drafter takes the verifier's KV cache, every
drafter its statistics); `propose(context, k) -> Draft` returns up to k next tokens for the
committed `context` (+ their draft probabilities q, or None for deterministic drafters). Drafters
keep whatever state they need (their own KV cache) and resynchronise with `context` at every call,
so a verification round needs no separate `update`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
import torch

from viasd.decoding.acceptance import SamplingParams, first_among, first_maxima
from viasd.decoding.grammar import FORCED_MAX, Constraint
from viasd.decoding.stats import DecodeStats
from viasd.decoding.session import CallKind, Session, pass_bytes
from viasd.execution.passes import Passes
from viasd.models.decoder import Decoder
from viasd.models.kvcache import KVCache, LayerMask
from viasd.models.layers import ReducedHead
from viasd.models.logits import PassOutput

if TYPE_CHECKING:
    from viasd.models.t5 import EncoderDecoder, Seq2SeqCache


@dataclass
class Draft:
    tokens: list[int]  # [k'] proposed token ids, k' <= k
    # [k', V] q of each proposal, None for deterministic drafters. When sampling, the distribution
    # the token was drawn from; when greedy, softmax(logits): the drafter's confidence.
    probs: torch.Tensor | None
    forced: int = 0  # the first `forced` tokens are the grammar's (`GrammarDrafter`), q one-hot
    looked_up: bool = False  # found by prompt lookup in front of a drafter model (`LookupDrafter`), not the model's

    def __len__(self) -> int:
        return len(self.tokens)

    def cut(self, n: int) -> Draft:
        """The first n proposals."""
        if n >= len(self.tokens):
            return self
        return Draft(self.tokens[:n], None if self.probs is None else self.probs[:n], min(self.forced, n), self.looked_up)


NO_DRAFT = Draft([], None)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # (the usual case, one comparison in C)
        return n
    return next(i for i in range(n) if a[i] != b[i])


class Drafter(Protocol):
    def begin(self, max_len: int, session: Session) -> None:
        """Start a new request of `session` whose sequences stay below `max_len` positions."""

    def propose(self, context: list[int], k: int) -> Draft:
        """Up to k draft tokens continuing `context` (every committed token, prompt included)."""


class _AutoregressiveDrafter:
    """Drafting by running a decoder token by token (shared by the model and self drafters).

    Subclasses say which decoder, cache and route, and where the cache stops being valid.
    Adaptive length: with `threshold`, drafting stops once the drafter's top probability falls
    below it (Draft&Verify; transformers' `assistant_confidence_threshold`). `probs` False (greedy
    only, for loops that never read q): drafts carry no q, and the softmax over the vocabulary is
    skipped (a sixth of a millisecond a drafted token on a 152k vocabulary).
    """

    def __init__(self, decoder: Decoder, params: SamplingParams, generator: torch.Generator | None, threshold: float | None,
                 probs: bool = True):
        if not probs and not params.greedy:
            raise ValueError("a sampling drafter draws from q: it keeps its probabilities")
        self.decoder = decoder
        self.params = params
        self.generator = generator
        self.threshold = threshold
        self.keep_probs = probs
        self.stats = DecodeStats()
        self.passes = Passes()
        self._singles = 0  # one-token drafting passes not yet in `stats`

    route: LayerMask | None = None
    head: ReducedHead | None = None  # a drafting route's reduced LM head
    # under a grammar (`GrammarDrafter`): the tokens allowed after the drafted ones, [V] bool
    grammar: Callable[[list[int]], torch.Tensor] | None = None
    verifier_share = 0.0
    owner = "drafter"  # whose passes these are (the cost model prices them by that model's pass times)

    def _sync(self, context: list[int]) -> tuple[KVCache, int]:
        raise NotImplementedError

    def begin(self, max_len: int, session: Session) -> None:
        self.stats, self.passes = session.stats, session.passes

    def propose(self, context: list[int], k: int) -> Draft:
        tokens, probs = self.draft_ids(context, k)
        return Draft(tokens, probs if tokens else None)

    def draft_ids(self, context: list[int], k: int, enough: Callable[[list[int]], bool] | None = None,
                  first: Sequence[int] | None = None, guess: int | None = None) -> tuple[list[int], torch.Tensor | None]:
        """Up to k tokens of the drafter's own vocabulary continuing `context` (its ids), and their
        q [k', V]; drafting stops early below `threshold`, or once `enough(tokens)` says so.
        `first`: the ids the first token is drawn from (token healing), None: any. `guess`: the
        first token as it will most likely be drawn (healing: the token re-drafted): read in the
        first pass with the context, so that when it is drawn its own pass is saved (a drafting pass
        of 1-2 rows more costs about what one row does)."""
        cache, start = self._sync(context)
        start = min(start, len(context) - 1)  # always recompute the last token to get its logits
        # greedy over a reduced head, nothing masked: the argmax among the head's own ids (and the top
        # probability among them: the expanded row's, whose other tokens have none)
        compact = self.head is not None and not self.keep_probs and first is None and self.grammar is None
        plain = not self.keep_probs and self.threshold is None and self.grammar is None  # greedy, nothing else read
        feed = context[start:] + ([] if guess is None else [guess])  # (ids, not a tensor: see `Decoder.forward`)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        ahead: PassOutput | None = None  # [1, V] the next token's logits, computed already (a right guess)
        for _ in range(k):
            if ahead is not None:
                out, ahead = ahead, None
            else:
                out = self._pass(feed, start, cache, rows=2 if guess is not None and not tokens else 1, expand=not compact)
                if guess is not None and not tokens:
                    out, ahead = out[:1], out[1:]  # [1, V] at the context's last token, [1, V] at the guess
                start += len(feed)
            token, top = self._choose(out, tokens, first if not tokens else None, plain, compact, probs)
            if token is None:  # (a reduced head holding no token the grammar allows)
                break
            tokens.append(token)
            if guess is not None and len(tokens) == 1 and token != guess:  # the guess' K/V and logits are of
                start -= 1  # another token: dropped
                cache.rollback(start)
                ahead = None
            if self.threshold is not None and top is not None and top < self.threshold or enough is not None and enough(tokens):
                break
            feed = [token]
        self._observe_singles()
        self._drafted(context, tokens)
        return tokens, torch.stack(probs) if probs else None

    def _choose(self, out: PassOutput, tokens: list[int], first: Sequence[int] | None, plain: bool, compact: bool,
                probs: list[torch.Tensor]) -> tuple[int | None, float | None]:
        """The next draft token from a pass' last row `out` [1, V] (`compact`: [1, N] over the reduced
        head's ids), and the drafter's top probability where a threshold reads it; `first`: the ids a
        healed token is drawn from; q appended to `probs` where kept. None: nothing the grammar allows."""
        if plain and first is None:  # greedy: the argmax, found by the LM head (no row taken)
            i = first_maxima(out.logits, out.argmax)[-1]  # (over a reduced head's ids ascending: the expanded row's first maximum)
            if compact:
                assert self.head is not None  # (compact: drafting over the reduced head's ids)
                return self.head.id_list[i], None
            return i, None
        row = out[-1]
        logits, known = row.logits, row.argmax  # [V] (or [N]); its argmax, [1], where the pass found it
        if first is not None and not plain:
            logits = torch.full_like(logits, float("-inf")).index_copy_(0, ids := torch.tensor(first), logits[ids])  # ids [n]
            known = None
        if self.grammar is not None:  # draft only what the grammar allows: a cut draft is a wasted pass
            allowed = self.grammar(tokens)[: logits.shape[-1]]
            allowed = torch.nn.functional.pad(allowed, (0, logits.shape[-1] - allowed.shape[0]))  # (a wider head's padding)
            logits, known = logits.masked_fill(~allowed, float("-inf")), None
            if not torch.isfinite(logits).any():
                return None, None
        if first is not None and plain:  # the masked row's first maximum, without the masked row
            return first_among(logits, first, known), None
        if compact:  # (ascending ids: the first maximum is the expanded row's first maximum)
            assert self.head is not None
            token = self.head.id_list[first_maxima(logits, known)[0]]
            return token, float(self.params.confidence(logits).max()) if self.threshold is not None else None
        if self.keep_probs or self.threshold is not None:
            q = self.params.confidence(logits)  # [V]
            if self.keep_probs:
                probs.append(q)
            return self.params.draw(q, self.generator), float(q.max())
        return first_maxima(logits, known)[0], None  # greedy: the logits' argmax (softmax keeps their order)

    def _pass(self, feed: list[int], start: int, cache: KVCache, rows: int = 1, expand: bool = True) -> PassOutput:
        """The logits of the last `rows` rows of a drafting pass over `feed` ([rows, V]; with `expand`
        False and a reduced head, over its ids: [rows, N])."""
        out = self.passes.forward(self.decoder, feed, start, cache, route=self.route, last_only=rows == 1, head=self.head,
                                     **({} if expand else {"expand": False}))  # (asked only of decoders with reduced heads)
        if len(feed) == 1 and rows == 1:
            self._singles += 1  # (counted when the draft ends: a stats call costs ~40 us right after a pass)
        else:
            self.stats.observe_call(CallKind.DRAFT, verifier_share=self.verifier_share, rows=len(feed), model=self.owner,
                                    bytes_read=self._bytes_read)
        return out if rows == 1 else out[-rows:]

    def _observe_singles(self) -> None:
        """Count the draft's one-token passes in the statistics."""
        if self._singles:
            self.stats.observe_call(CallKind.DRAFT, n=self._singles, verifier_share=self.verifier_share, rows=1,
                                    model=self.owner, bytes_read=self._bytes_read)
            self._singles = 0

    @functools.cached_property
    def _bytes_read(self) -> int:
        """Weight bytes of one drafting pass (its route and head are the drafter's for good)."""
        return pass_bytes(self.decoder, self.route, head=self.head)

    def _drafted(self, context: list[int], tokens: list[int]) -> None:
        pass


class ModelDrafter(_AutoregressiveDrafter):
    """A separate, smaller model with the verifier's vocabulary, and its own KV cache; `head`: a
    reduced LM head of the drafter (it then drafts only tokens inside that vocabulary: what it
    proposes is still a draft the verifier judges, so outputs stay lossless). `window`: the drafter
    reads only the prompt's last `window` tokens (0: all); its cache then starts at the first of them
    (`offset` tokens of every context unread)."""

    def __init__(self, decoder: Decoder, params: SamplingParams, generator: torch.Generator | None, threshold: float | None,
                 head: ReducedHead | None = None, probs: bool = True, window: int = 0):
        super().__init__(decoder, params, generator, threshold, probs)
        self.head, self.window, self.offset = head, window, 0

    def _window(self, prompt: list[int]) -> None:
        """Where the drafter's cache starts, for `prompt` (its own vocabulary's ids): the whole prompt
        where its prefix cache holds all but `window` tokens of it or less (a server's system prompt,
        a conversation's earlier turns: then that reads fewer and sees more)."""
        self.offset = max(0, len(prompt) - self.window) if self.window else 0
        if self.offset and len(prompt) - self.passes.cached(self.decoder, prompt[:-1]) <= self.window:
            self.offset = 0

    def draft_ids(self, context: list[int], k: int, *args, **kw) -> tuple[list[int], torch.Tensor | None]:
        return super().draft_ids(context[self.offset :], k, *args, **kw)  # (cache position 0: context[offset])

    def begin(self, max_len: int, session: Session) -> None:
        super().begin(max_len, session)
        self.cache = self.decoder.new_cache(max_len)
        self.cached_ids: list[int] = []  # token ids at cache positions 0 .. n_full-1 (context[offset:])
        self._window([] if self.decoder.is_encoder_decoder else session.tokens)
        if getattr(session, "source", None) is not None:  # an encoder-decoder drafter reads the verifier's source
            if not self.decoder.is_encoder_decoder:
                raise ValueError("an encoder-decoder session needs an encoder-decoder drafter model")
            cast("EncoderDecoder", self.decoder).encode(torch.tensor(session.source), cast("Seq2SeqCache", self.cache))
            self.stats.observe_call(CallKind.DRAFT, verifier_share=self.verifier_share)
        # the prompt but its last token (the first `propose` feeds that one, to get its logits), in one
        # pass before the verifier's prefill: reading the prompt is prefill work, which belongs to the
        # time to the first token. Left to the first draft it landed in decoding (seconds for a
        # 1000-token RAG prompt on qwen 0.5B) and made drafting look dear to the draft-length policy.
        prompt = session.tokens[self.offset : -1]
        if prompt:
            self.passes.forward(self.decoder, torch.tensor(prompt), 0, self.cache, logits=False)  # K/V only, no head
            self.stats.observe_call(CallKind.DRAFT, verifier_share=self.verifier_share,
                                    bytes_read=pass_bytes(self.decoder, None, head=False))
            self.cached_ids = list(prompt)

    def _sync(self, context: list[int]) -> tuple[KVCache, int]:
        n = min(len(self.cached_ids), self.cache.n_full, len(context))
        common = common_prefix(self.cached_ids[:n], context[:n])
        self.cache.rollback(common)
        return self.cache, common

    def _drafted(self, context: list[int], tokens: list[int]) -> None:
        # the cache now holds context + all drafts but the last (which was never fed)
        self.cached_ids = context + tokens[:-1]


class SelfDrafter(_AutoregressiveDrafter):
    """The verifier itself along a drafting route (Draft&Verify, LayerSkip), sharing its KV cache.

    Positions < n_full come from the full model; the route writes its own layers above that, and
    the verifier's next full pass overwrites them (the n_full invariant of the runtime).
    """

    def __init__(self, decoder: Decoder, route: LayerMask, params: SamplingParams, generator, threshold: float | None,
                 head: ReducedHead | None = None, probs: bool = True):
        super().__init__(decoder, params, generator, threshold, probs)
        self.route, self.head = route, head
        self.verifier_share = route.fraction
        self.owner = "verifier"
        self.cache: KVCache | None = None

    def begin(self, max_len: int, session: Session) -> None:
        super().begin(max_len, session)
        self.cache = session.cache  # shared for this request

    def _sync(self, context: list[int]) -> tuple[KVCache, int]:
        # routed entries past n_full belong to an earlier draft: restart drafting at n_full
        assert self.cache is not None, "propose before begin"
        return self.cache, self.cache.n_full


class NgramDrafter:
    """Prompt lookup decoding (Saxena 2023; vLLM `ngram`): copy what followed the latest earlier
    occurrence of the context's last n tokens, for n from `max_ngram` down to `min_ngram`.
    Model-free: no calls, deterministic proposals (q = None). With an encoder-decoder verifier the
    lookup runs over the source followed by the decoder's tokens."""

    free = True  # proposing costs no model call (`draft_length.DraftLength` may propose and not verify)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._reset()

    source: list[int] = []

    def begin(self, max_len: int, session: Session) -> None:
        self.source = getattr(session, "source", None) or []
        self._reset()

    def _reset(self) -> None:
        # what `ngram_lookup` finds, kept up to date as the sequence grows (a round adds a few tokens;
        # searching the whole context again each round cost ~5% of a native smollm2 step):
        # _ends[n][ngram] = the position after the latest occurrence of that n-gram that has a token after it
        self._seq: list[int] = []
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.max_ngram + 1)]

    def propose(self, context: list[int], k: int) -> Draft:
        seq = self.source + context if self.source else list(context)
        n_old = len(self._seq)
        if seq[:n_old] != self._seq:  # (a list comparison in C: microseconds)
            self._reset()  # not a continuation of the indexed sequence: another request
            n_old = 0
        for p in range(max(n_old, 1), len(seq)):  # seq[p] now follows the n-grams ending at p
            for n in range(1, min(self.max_ngram, p) + 1):
                self._ends[n][tuple(seq[p - n : p])] = p
        self._seq = seq
        size = len(seq)
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            begin = self._ends[n].get(tuple(seq[size - n :]))
            if begin is not None:
                return Draft(seq[begin : begin + k], None)
        return Draft([], None)


class LookupDrafter:
    """A drafter model behind prompt lookup (`sd`'s `lookup`): where the context's last n tokens
    occurred before, the tokens that followed them are proposed (`lookup`: free, no pass); elsewhere
    the model drafts (`propose`). A passage the output copies (a summary quoting its source, code
    repeating a name) then costs no drafting passes; the model catches up on what it did not draft in
    its next pass. What the draft-length policy reads of it is the model drafter's (it prices its
    passes, and learns only its drafts' acceptance: `Draft.looked_up`)."""

    def __init__(self, inner: ModelDrafter, n: int):
        self.inner, self.ngram = inner, NgramDrafter(n, n)

    @property
    def decoder(self) -> Decoder:
        return self.inner.decoder

    @property
    def stats(self) -> DecodeStats:
        return self.inner.stats

    @property
    def head(self) -> ReducedHead | None:
        return self.inner.head

    @property
    def verifier_share(self) -> float:
        return self.inner.verifier_share

    def propose(self, context: list[int], k: int) -> Draft:
        return self.inner.propose(context, k)

    def begin(self, max_len: int, session: Session) -> None:
        self.inner.begin(max_len, session)
        self.ngram.begin(max_len, session)

    def lookup(self, context: list[int], k: int) -> Draft:
        """Up to k tokens that followed the latest earlier occurrence of the context's last n tokens."""
        found = self.ngram.propose(context, k).tokens
        return Draft(found, None, looked_up=True) if found else NO_DRAFT


def ngram_lookup(context: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """context: [n] token ids -> up to k tokens following the latest earlier match of its suffix.
    The rule, searched over the whole context; `NgramDrafter` keeps an index that gives the same."""
    n_ctx = context.shape[0]
    for n in range(min(max_ngram, n_ctx - 1), min_ngram - 1, -1):
        pattern = context[n_ctx - n :]
        # windows[i] = context[i : i+n] for i + n < n_ctx (a continuation exists, suffix excluded)
        windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            begin = int(hits[-1]) + n
            return context[begin : begin + k].tolist()
    return []


class GrammarDrafter:
    """Constrained decoding's drafts: the tokens the grammar alone determines after the context (at
    most `FORCED_MAX`, free: no model proposes them), then `inner`'s proposal after those, cut to its
    longest grammar-valid prefix. `inner` None: the forced tokens only (`ar` under a grammar).

    `forces`: `draft_length.propose` takes the forced tokens whatever draft length it chooses.
    The forced tokens are the grammar's tokenization of its forced bytes: where the model would choose
    another one, the verifier rejects them as it rejects any draft, so the output is unchanged."""

    def __init__(self, inner: Drafter | None, constraint: Constraint, force: bool = True):
        self.inner, self.constraint = inner, constraint
        self.forces = force  # False: the drafter's drafts cut to the grammar, no forced ones
        self.free = inner is None or getattr(inner, "free", False)

    # what the draft-length policy reads of a drafter is the inner one's (None, or 0, without it)
    @property
    def decoder(self) -> Decoder | None:
        return getattr(self.inner, "decoder", None)

    @property
    def stats(self) -> DecodeStats | None:
        return getattr(self.inner, "stats", None)

    @property
    def head(self) -> ReducedHead | None:
        return getattr(self.inner, "head", None)

    @property
    def verifier_share(self) -> float:
        return getattr(self.inner, "verifier_share", 0.0)

    @property
    def lookup(self) -> Callable[[list[int], int], Draft] | None:
        return getattr(self.inner, "lookup", None)

    def begin(self, max_len: int, session: Session) -> None:
        self.session = session
        if self.inner is not None:
            self.inner.begin(max_len, session)

    def propose(self, context: list[int], k: int) -> Draft:
        """The forced tokens, then up to k of `inner`'s (k = 0: the forced ones only)."""
        ahead = context[len(self.session.tokens) :]  # past the committed tokens (lossless VIA-SD's block)
        masks = type(self.inner) in (ModelDrafter, SelfDrafter)  # the verifier's vocabulary: masked as it drafts
        # the forced bytes' last token a masked drafter model tokenizes as the model would; else a guess
        forced = self.constraint.forced(ahead, tail=not masks or k <= 0)[:FORCED_MAX] if self.forces else []
        if self.inner is None or k <= 0:
            return Draft(forced, None, len(forced))
        if masks:
            cast(_AutoregressiveDrafter, self.inner).grammar = lambda drafted: self.constraint.allowed_after(ahead + forced + drafted)
        try:
            own = self.inner.propose(context + forced, k)
        finally:
            if masks:
                cast(_AutoregressiveDrafter, self.inner).grammar = None
        own = own.cut(self.constraint.valid(own.tokens, ahead + forced))
        if own.tokens and own.probs is None:  # a deterministic drafter: so is the whole draft
            return Draft(forced + own.tokens, None, len(forced))
        # the forced tokens' q: one-hot (a drafter with probabilities keeps them for every token)
        one_hot = torch.nn.functional.one_hot(torch.tensor(forced, dtype=torch.long), self.constraint.vocab_size).float()
        probs = torch.cat([one_hot, own.probs.float()]) if own.tokens and own.probs is not None else one_hot
        return Draft(forced + own.tokens, probs if forced or own.tokens else None, len(forced))
