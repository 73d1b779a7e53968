"""Decoding loops. One loop per kind of decoding; the drafter is what tells `sd`, `pld` and
`self-sd` apart, so they share `speculative_decode`.

Cache convention for every loop: the verifier's KV cache holds every committed token but the
last, whose logits the next verifier call computes together with the drafts after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from viasd.decoding.acceptance import (
    SamplingParams,
    cascade_defer,
    cascade_target,
    greedy_accept,
    logits_to_probs,
    sample,
    speculative_sampling,
)
from viasd.decoding.stats import DecodeStats
from viasd.decoding.drafters import Drafter, SelfDrafter
from viasd.models.runtime import Decoder, KVCache

OnTokens = Callable[[list[int]], None]


@dataclass
class DecodeRequest:
    """One request as every loop sees it."""

    prompt: list[int]  # [n] token ids
    max_new_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    eos: frozenset[int] = frozenset()
    stats: DecodeStats = field(default_factory=DecodeStats)
    generator: torch.Generator | None = None
    on_tokens: OnTokens | None = None  # called with each batch of newly committed ids

    def emit(self, out: list[int], new: list[int]) -> None:
        """Hand newly committed tokens to the output, the statistics and the stream."""
        out.extend(new)
        self.stats.observe_tokens(len(new))
        if self.on_tokens:
            self.on_tokens(new)


def _commit(new: list[int], tokens: list[int], budget: int, eos: frozenset[int]) -> tuple[list[int], bool]:
    """Cut `new` at the token budget and after the first EOS. Returns (kept, finished)."""
    new = new[:budget]
    finished = len(new) >= budget
    for i, t in enumerate(new):
        if t in eos:
            new, finished = new[: i + 1], True
            break
    tokens.extend(new)
    return new, finished


def _next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.greedy:
        return int(logits.argmax())
    return sample(logits_to_probs(logits, params), generator)


def _cascade_accept(draft, logits: torch.Tensor, params: SamplingParams, cascade: tuple[str, float], generator) -> tuple[int, int]:
    """Acceptance against the cascade target pi. logits: [k+1, V] full model; draft.probs: [k, V]."""
    if draft.probs is None:
        raise ValueError("speculative cascades need a drafter with probabilities (a model or a self route)")
    k = len(draft)
    tokens = torch.tensor(draft.tokens, dtype=torch.long)
    # the rule compares the models' own confidences; greedy uses raw softmax, sampling the processed p
    p = torch.softmax(logits.float(), -1) if params.greedy else logits_to_probs(logits, params)  # [k+1, V]
    pi = torch.cat([cascade_target(draft.probs, p[:k], cascade_defer(draft.probs, p[:k], *cascade)), p[k:]])
    if params.greedy:
        return greedy_accept(tokens, pi)
    return speculative_sampling(tokens, draft.probs, pi, generator)


def autoregressive_decode(decoder: Decoder, req: DecodeRequest) -> list[int]:
    """Plain decoding: one full-model call per token."""
    prompt, max_new_tokens, params, eos, stats = req.prompt, req.max_new_tokens, req.params, req.eos, req.stats
    out: list[int] = []
    if max_new_tokens <= 0:
        return out
    cache = decoder.new_cache(len(prompt) + max_new_tokens)
    # 1. prefill the prompt; the last row's logits give the first token
    logits = decoder.forward(torch.tensor(prompt), 0, cache, last_only=True)[0]
    stats.observe_call("full", verifier_share=1.0)
    while True:
        # 2. choose the next token and commit it
        token = _next_token(logits, params, req.generator)
        stats.observe_round(0, 0)
        req.emit(out, [token])
        if token in eos or len(out) >= max_new_tokens:
            return out
        # 3. one full call for the token just committed
        logits = decoder.forward(torch.tensor([token]), len(prompt) + len(out) - 1, cache)[0]
        stats.observe_call("full", verifier_share=1.0)


def speculative_decode(
    decoder: Decoder, drafter: Drafter, req: DecodeRequest, k: int, cascade: tuple[str, float] | None = None
) -> list[int]:
    """Speculative decoding (Leviathan et al. 2023; Chen et al. 2023) with any drafter, k drafts a round.

    Lossless: greedy output equals `autoregressive_decode`'s token for token, and sampled output
    follows the verifier's distribution exactly.

    `cascade=(rule, alpha)`: speculative cascades (Narasimhan et al. 2024) instead: the target at
    each draft position is pi = q where the deferral rule defers to the drafter, else p; then the
    same lossless rule runs against pi (lossy with respect to p by design).
    """
    prompt, max_new_tokens, params, eos, stats = req.prompt, req.max_new_tokens, req.params, req.eos, req.stats
    out: list[int] = []
    if max_new_tokens <= 0:
        return out
    tokens = list(prompt)
    max_len = len(prompt) + max_new_tokens + k + 1
    cache: KVCache = decoder.new_cache(max_len)
    if isinstance(drafter, SelfDrafter):
        drafter.attach(cache)
    drafter.begin(max_len)
    # 0. prefill all prompt tokens but the last (its logits come with the first block)
    if len(prompt) > 1:
        decoder.forward(torch.tensor(prompt[:-1]), 0, cache, last_only=True)
        stats.observe_call("full", verifier_share=1.0)
    while True:
        budget = max_new_tokens - len(out)
        # 1. draft up to k tokens; never more than the budget can use (the round adds one more)
        draft = drafter.propose(tokens, min(k, budget - 1), stats) if budget > 1 and k > 0 else None
        drafted = draft.tokens if draft is not None else []
        # 2. verify the last committed token and the drafts in one full pass: logits [k'+1, V]
        start = len(tokens) - 1
        logits = decoder.forward(torch.tensor([tokens[-1], *drafted]), start, cache)
        stats.observe_call("full", verifier_share=1.0)
        # 3. accept a prefix of the drafts, plus one recovered or bonus token
        if cascade is not None and drafted:
            n_acc, nxt = _cascade_accept(draft, logits, params, cascade, req.generator)
        elif params.greedy:
            n_acc, nxt = greedy_accept(torch.tensor(drafted, dtype=torch.long), logits)
        else:
            p = logits_to_probs(logits, params)  # [k'+1, V]
            n_acc, nxt = speculative_sampling(torch.tensor(drafted, dtype=torch.long), draft.probs if draft else None, p, req.generator)
        stats.observe_round(len(drafted), n_acc)
        stats.observe_full_check(len(drafted), n_acc)
        # 4. commit (cut at EOS and budget) and roll the cache back to "all committed but the last"
        new, finished = _commit(drafted[:n_acc] + [nxt], tokens, budget, eos)
        req.emit(out, new)
        if finished:
            return out
        cache.rollback(len(tokens) - 1)
