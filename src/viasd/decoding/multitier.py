"""VIA-SD multi-tier decoding: drafter -> slim verifier (a route of the verifier) -> full verifier.

Glossary (in addition to `acceptance`'s accepted / recovered / bonus tokens)
- slim verifier: the verifier run along a route R (a subset of its sub-layers), sharing every
  weight and the KV cache; its passes write only R's layers at positions >= n_full.
- tier: how a committed token was settled: 1 accepted draft, 2 settled by the slim verifier,
  3 decided by the full verifier.
- pending: committed tokens the full model has not processed yet (tiered mode); positions
  n_full .. len(tokens)-1.

Two loops:
- `viasd_lossless_decode`: drafter -> slim is speculative decoding against the slim distribution q',
  building a block distributed as q'; slim -> full is speculative decoding against p with q' as the
  proposal. Output distribution exactly the full model's; greedy output equals `ar`.
- `viasd_tiered_decode`: per draft position a tier from confidence signals; tiers 1 and 2 are
  committed without a full-model check; the full model is called only at a tier-3 position, and then
  processes every pending position in one pass (which also fills its KV cache).
"""

from __future__ import annotations

import torch

from viasd.decoding.acceptance import (
    SamplingParams,
    TierThresholds,
    assign_tiers,
    confidence_signals,
    greedy_accept,
    logits_to_probs,
    speculative_sampling,
)
from viasd.decoding.stats import DecodeStats
from viasd.decoding.strategies import DecodeRequest, _commit
from viasd.decoding.drafters import Draft, Drafter, SelfDrafter
from viasd.models.runtime import Decoder, KVCache, LayerMask

_NO_DRAFT = Draft([], None)


def _start(decoder: Decoder, drafter: Drafter, req: DecodeRequest, max_len: int) -> KVCache:
    """New cache, drafter attached, prompt prefilled by the full model (all tokens but the last)."""
    cache = decoder.new_cache(max_len)
    if isinstance(drafter, SelfDrafter):
        drafter.attach(cache)
    drafter.begin(max_len)
    if len(req.prompt) > 1:
        decoder.forward(torch.tensor(req.prompt[:-1]), 0, cache, last_only=True)
        req.stats.observe_call("full", verifier_share=1.0)
    return cache


def _slim_pass(decoder: Decoder, cache: KVCache, route: LayerMask, ctx: list[int], drafted: list[int], stats: DecodeStats) -> torch.Tensor:
    """Slim-verifier logits [len(drafted)+1, V] for the drafts after `ctx` and the bonus position.

    Starts where the route's K/V stops being valid (a self-drafting route sharing layers may have
    overwritten some), so it may recompute a few committed positions.
    """
    start = min(cache.length(route), len(ctx) - 1)
    logits = decoder.forward(torch.tensor(ctx[start:] + drafted), start, cache, route=route)
    stats.observe_call("slim", verifier_share=route.fraction)
    return logits[len(ctx) - 1 - start :]


def _verify(drafted: list[int], q: torch.Tensor | None, logits: torch.Tensor, params: SamplingParams, generator) -> tuple[int, int]:
    """Lossless acceptance of `drafted` (proposal q) against a target given as logits [k+1, V]."""
    tokens = torch.tensor(drafted, dtype=torch.long)
    if params.greedy:
        return greedy_accept(tokens, logits)
    return speculative_sampling(tokens, q, logits_to_probs(logits, params), generator)


def viasd_lossless_decode(decoder: Decoder, drafter: Drafter, route: LayerMask, req: DecodeRequest, k: int, full_block: int = 8) -> list[int]:
    """Lossless VIA-SD: blocks of up to `full_block` slim-verified tokens, each checked by one full pass.

    The slim stage drafts and verifies rounds until the block is full, an end token appears, or the
    slim verifier rejects a draft. Stopping at the first slim rejection matters: a block continued
    past it grows from the slim verifier's own token, which the full model rejects more often than a
    draft both agreed on, and each further round costs a drafting run and a slim pass. Measured on
    smollm2-135m (six Spec-Bench prompts, 64 tokens, self drafter): 4.2 tok/s and 5.3 verifier
    layer-passes per token when filling the block regardless, 13.6 tok/s and 1.66 when stopping.
    """
    params, stats = req.params, req.stats
    out: list[int] = []
    tokens = list(req.prompt)
    cache = _start(decoder, drafter, req, len(tokens) + req.max_new_tokens + k + full_block + 2)
    while True:
        budget = req.max_new_tokens - len(out)
        # 1. slim stage: speculative decoding drafter -> slim builds a block distributed as q'
        block: list[int] = []
        origin: list[int] = []  # 1 drafter token, 2 slim's recovered/bonus token
        block_q: list[torch.Tensor] = []  # [len(block), V] q' at each block position (sampling only)
        while len(block) < min(full_block, budget - 1):
            ctx = tokens + block
            k_eff = min(k, budget - 2 - len(block))
            draft = drafter.propose(ctx, k_eff, stats) if k_eff > 0 else _NO_DRAFT
            if not draft.tokens:
                break  # nothing to settle: a slim pass would only add one token at most of a full pass' cost
            slim_logits = _slim_pass(decoder, cache, route, ctx, draft.tokens, stats)  # [k'+1, V]
            q_probs = draft.probs if not params.greedy else None
            n, x = _verify(draft.tokens, q_probs, slim_logits, params, req.generator)
            stats.observe_round(len(draft), n, verification=False)
            block += draft.tokens[:n] + [x]
            origin += [1] * n + [2]
            if not params.greedy:
                block_q.append(logits_to_probs(slim_logits[: n + 1], params))
            cache.rollback_route(route, len(ctx) + n)  # slim K/V now covers ctx + accepted drafts
            if x in req.eos or any(t in req.eos for t in draft.tokens[:n]):
                break
            if n < len(draft):
                break  # the slim verifier rejected a draft: its own token closes the block (see below)
        # 2. full stage: one pass verifies the block, with q' as the proposal distribution
        logits = decoder.forward(torch.tensor([tokens[-1], *block]), len(tokens) - 1, cache)  # [len(block)+1, V]
        stats.observe_call("full", verifier_share=1.0)
        n, x = _verify(block, torch.cat(block_q) if block_q else None, logits, params, req.generator)
        stats.observe_round(0, 0)
        stats.observe_full_check(len(block), n)
        # 3. commit; drafter tokens the full model rejected no longer count as accepted
        new, finished = _commit(block[:n] + [x], tokens, budget, req.eos)
        tiers = (origin[:n] + [3])[: len(new)]
        stats.observe_tiers(tiers)
        stats.accepted -= origin.count(1) - tiers.count(1)
        req.emit(out, new)
        if finished:
            return out
        cache.rollback(len(tokens) - 1)


def _settle(draft_token: int | None, q_row: torch.Tensor | None, target: torch.Tensor, params: SamplingParams, generator) -> int:
    """One position settled against `target` probabilities [V]: greedy takes its argmax; sampling
    keeps the draft with probability min(1, target/q), else samples the residual (lossless for that
    position)."""
    if params.greedy:
        return int(target.argmax())
    if draft_token is None:
        return int(torch.multinomial(target, 1, generator=generator))
    n, x = speculative_sampling(torch.tensor([draft_token]), None if q_row is None else q_row[None], torch.stack([target, target]), generator)
    return draft_token if n == 1 else x


def viasd_tiered_decode(decoder: Decoder, drafter: Drafter, route: LayerMask, req: DecodeRequest, k: int,
                        thresholds: TierThresholds) -> list[int]:
    """Tiered VIA-SD (lossy): tier 1 accepts, tier 2 the slim verifier settles, tier 3 the full model decides."""
    params, stats = req.params, req.stats
    out: list[int] = []
    tokens = list(req.prompt)
    cache = _start(decoder, drafter, req, len(tokens) + req.max_new_tokens + k + 2)
    while True:
        budget = req.max_new_tokens - len(out)
        # 1. draft, and score the drafts (and the bonus position) with one slim pass
        k_eff = min(k, budget - 1)
        draft = drafter.propose(tokens, k_eff, stats) if k_eff > 0 else _NO_DRAFT
        kd = len(draft)
        d = torch.tensor(draft.tokens, dtype=torch.long)
        slim_logits = _slim_pass(decoder, cache, route, tokens, draft.tokens, stats)  # [k'+1, V]
        slim = torch.softmax(slim_logits.float(), -1) if params.greedy else logits_to_probs(slim_logits, params)
        # 2. a tier per position; the bonus position has no draft: slim (2) or full (3)
        tiers = assign_tiers(confidence_signals(d, draft.probs, slim[:kd]), thresholds).tolist() if kd else []
        bonus_ok = slim[kd].max() >= thresholds.slim and -(slim[kd] * slim[kd].clamp_min(1e-12).log()).sum() <= thresholds.slim_entropy
        tiers.append(2 if bonus_ok else 3)
        new: list[int] = []
        origin: list[int] = []
        i = 0
        while tiers[i] != 3:
            if tiers[i] == 1:  # tier 1 (i < kd): keep the draft, no check
                new.append(draft.tokens[i])
                origin.append(1)
                i += 1
                continue
            # tier 2: the slim verifier keeps the draft or regenerates the token
            q_row = draft.probs[i] if draft.probs is not None and i < kd else None
            token = _settle(draft.tokens[i] if i < kd else None, q_row, slim[i], params, req.generator)
            new.append(token)
            origin.append(2)
            if i == kd or token != draft.tokens[i]:
                break
            i += 1
        if tiers[i] == 3:
            # 3. tier 3: the full model processes every pending position plus the remaining drafts in
            #    one pass, and decides the remaining drafts (lossless from here)
            seq = tokens + new
            start = cache.n_full
            logits = decoder.forward(torch.tensor(seq[start:] + draft.tokens[i:]), start, cache)
            stats.observe_call("full", verifier_share=1.0)
            rows = logits[len(seq) - 1 - start :]  # [kd - i + 1, V]
            q_rest = draft.probs[i:] if draft.probs is not None and not params.greedy else None
            n, x = _verify(draft.tokens[i:], q_rest, rows, params, req.generator)
            stats.observe_full_check(kd - i, n)
            new += draft.tokens[i : i + n] + [x]
            origin += [3] * (n + 1)
        n_kept = next((j for j in range(min(kd, len(new))) if new[j] != draft.tokens[j]), min(kd, len(new)))
        stats.observe_round(kd, n_kept)  # a round settled by the slim or the full verifier
        # 4. commit; roll both the full and the slim views back to "all committed but the last"
        new, finished = _commit(new, tokens, budget, req.eos)
        stats.observe_tiers(origin[: len(new)])
        stats.unchecked += sum(1 for t in origin[: len(new)] if t != 3)
        req.emit(out, new)
        if finished:
            return out
        cache.rollback(len(tokens) - 1)
        cache.rollback_route(route, len(tokens) - 1)
