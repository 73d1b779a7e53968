"""Decoding loops of the two-tier strategies. The drafter is what tells `sd`, `pld` and `self-sd`
apart, so they share `speculative_decode`; `cascade` is the same loop with another target.

Every loop goes through a `Session` (passes, commits, the cache invariant) and `acceptance.accept`.
"""

from __future__ import annotations

from viasd.decoding.acceptance import DeferralRule, accept, cascade_target_probs
from viasd.decoding.draft_length import draft_policy, propose
from viasd.execution.timing import PassTimer
from viasd.decoding.drafters import Drafter
from viasd.decoding.stats import drafted_sources
from viasd.decoding.session import DecodeRequest, Session
from viasd.models.decoder import Decoder


def autoregressive_decode(decoder: Decoder, req: DecodeRequest) -> list[int]:
    """Plain decoding: one full-model call per token."""
    v = Session.start(decoder, None, req, len(req.prompt) + req.max_new_tokens + 1)
    while not v.done:
        out = v.full([])  # [1, V] the position after the last committed token
        req.stats.observe_round(0, 0)
        v.commit([req.params.next_token(out.logits[0], req.generator, out.argmax)], logits=out.logits)
    return v.out


def speculative_decode(
    decoder: Decoder, drafter: Drafter, req: DecodeRequest, k: int, cascade: tuple[DeferralRule | str, float] | None = None,
    adaptive: bool = False,
) -> list[int]:
    """Speculative decoding (Leviathan et al. 2023; Chen et al. 2023) with any drafter, k drafts a round.

    Lossless: greedy output equals `autoregressive_decode`'s token for token, and sampled output
    follows the verifier's distribution exactly.

    `cascade=(rule, alpha)`: speculative cascades (Narasimhan et al. 2024) instead: the target at
    each draft position is pi = q where the deferral rule defers to the drafter, else p; then the
    same lossless rule runs against pi (lossy with respect to p by design).

    `adaptive`: k is the most; each round verifies the number of drafts that commits the most tokens
    per measured second (`draft_length.DraftLength`), down to none.
    """
    params, stats = req.params, req.stats
    policy = draft_policy(decoder, drafter, k, passes=req.passes) if adaptive else None
    v = Session.start(decoder, drafter, req, len(req.prompt) + req.max_new_tokens + k + 1)
    while not v.done:
        # 1. draft up to k tokens (as many as the policy chooses); never more than the budget can use
        # (the round adds one more); a free drafter's first token past them is scored too (`peek`)
        draft, peek = propose(drafter, v.tokens, min(k, v.budget - 1), policy)
        # 2. verify the last committed token and the drafts in one full pass
        with PassTimer(decoder) as timer:
            out = v.full(draft.tokens)  # [k'+1, V]
        if policy is not None:
            policy.observe_pass(len(draft) + 1, timer.seconds)
        # 3. accept a prefix of the drafts, plus one recovered or bonus token
        pi = cascade_target_probs(draft.probs, out.logits, params, *cascade) if cascade and draft.tokens else None
        n, x = accept(draft.tokens, draft.probs, out.logits, params, req.generator, target_probs=pi, known=out.argmax)
        stats.observe_round(len(draft), n)
        stats.observe_full_check(len(draft), n)
        stats.observe_grammar(draft.forced, min(n, draft.forced))
        if draft.looked_up:  # prompt lookup's, not the drafter's: the policy learns nothing of them
            stats.observe_lookup(len(draft), n)
        elif policy is not None:  # the drafter's own drafts (a grammar's forced ones are not its)
            policy.observe(len(draft) - draft.forced, max(0, n - draft.forced))
            if peek is not None and n == len(draft):  # the token after the verified drafts: was it proposed?
                policy.observe(1, int(x == peek))
        # 4. commit (cut at the end token and the budget)
        v.commit(draft.tokens[:n] + [x], sources=drafted_sources(n, draft.forced), logits=out.logits)
    return v.out
