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
  processes every pending position in one pass (which also fills its KV cache). A round with no
  draft (prompt lookup found nothing, or one token of budget is left) makes no slim pass: the full
  model decides its token; nor does any round when thresholds above 1 switch tiers 1 and 2 off.
  With `correct` (greedy), that pass also corrects the first token settled without it where the full
  model's choice differs (`_recheck`), and tokens go out only once checked: the output equals `ar`'s.
"""

from __future__ import annotations

import time

import torch

from viasd.decoding.acceptance import SamplingParams, accept, settle
from viasd.decoding.draft_length import DraftLength, pass_times
from viasd.decoding.drafters import NO_DRAFT, Draft, Drafter
from viasd.decoding.tiers import Tier, TierThresholds, confident_round, round_tiers
from viasd.decoding.verifier import DecodeRequest, Verifier
from viasd.models.runtime import Decoder, LayerMask, ReducedHead


def resume_layer(route: LayerMask, resume: bool = True) -> int | None:
    """Where full passes resume after slim passes along `route`: the first layer it does not keep whole
    (None: resuming off, or a route that keeps no whole layer at the bottom)."""
    m = route.prefix
    return m if resume and 0 < m < route.n_layers else None


def viasd_lossless_decode(decoder: Decoder, drafter: Drafter, route: LayerMask, req: DecodeRequest, k: int, full_block: int = 8,
                          resume: bool = True, head: ReducedHead | None = None) -> list[int]:
    """Lossless VIA-SD: blocks of up to `full_block` slim-verified tokens, each checked by one full pass
    (`resume`: which starts at the route's first incomplete layer, see `resume_layer`; `head`: the
    slim verifier's reduced LM head, drafts cut before the first token outside it)."""
    v = Verifier.start(decoder, drafter, req, len(req.prompt) + req.max_new_tokens + k + full_block + 2, tiers=True,
                       resume_layer=resume_layer(route, resume))
    while not v.done:
        # 1. slim stage: speculative decoding drafter -> slim builds a block distributed as q'
        block, origin, block_q = _slim_stage(v, drafter, route, k, full_block, head)
        # 2. full stage: one pass verifies the block, with q' as the proposal distribution
        logits = v.full(block)  # [len(block)+1, V]
        n, x = accept(block, block_q, logits, req.params, req.generator)
        req.stats.observe_round(0, 0)
        req.stats.observe_full_check(len(block), n)
        # 3. commit; drafter tokens the full model rejected (or the budget cut) no longer count as accepted
        kept = v.commit(block[:n] + [x], origin[:n] + [Tier.FULL])
        req.stats.accepted -= origin.count(Tier.ACCEPT) - origin[: min(n, kept)].count(Tier.ACCEPT)
    return v.out


def _slim_stage(v: Verifier, drafter: Drafter, route: LayerMask, k: int, full_block: int,
                head: ReducedHead | None = None) -> tuple[list[int], list[Tier], torch.Tensor | None]:
    """Draft and slim-verify rounds until the block is full, an end token appears, or the slim
    verifier rejects a draft. Returns the block, each token's origin (ACCEPT: a drafter token, SLIM:
    the slim verifier's recovered/bonus token) and q' at each block position ([len(block), V];
    sampling only).

    Stopping at the first slim rejection matters: a block continued past it grows from the slim
    verifier's own token, which the full model rejects more often than a draft both agreed on, and
    each further round costs a drafting run and a slim pass. Measured on smollm2-135m (six Spec-Bench
    prompts, 64 tokens, self drafter): 4.2 tok/s and 5.3 verifier layer-passes per token when filling
    the block regardless, 13.6 tok/s and 1.66 when stopping. An empty draft ends the stage too: a
    slim pass would only add one token, at most of a full pass' cost.
    """
    params = v.req.params
    block: list[int] = []
    origin: list[Tier] = []
    block_q: list[torch.Tensor] = []
    while len(block) < min(full_block, v.budget - 1):
        k_eff = min(k, v.budget - 2 - len(block))
        draft = drafter.propose(v.tokens + block, k_eff) if k_eff > 0 else NO_DRAFT
        if head is not None:  # the slim verifier judges no draft outside its head's vocabulary
            draft = draft.cut(next((i for i, ok in enumerate(head.contains(draft.tokens)) if not ok), len(draft)))
        if not draft.tokens:
            break
        slim_logits = v.slim(route, block + draft.tokens, n_rows=len(draft) + 1, head=head)  # [k'+1, V]
        n, x = accept(draft.tokens, draft.probs, slim_logits, params, v.req.generator)
        v.stats.observe_round(len(draft), n, verification=False)
        v.keep_slim(route, len(block) + n)  # slim K/V now covers the block and the accepted drafts
        block += draft.tokens[:n] + [x]
        origin += [Tier.ACCEPT] * n + [Tier.SLIM]
        if not params.greedy:
            block_q.append(params.probs(slim_logits[: n + 1]))
        if n < len(draft) or any(t in v.req.eos for t in block[-n - 1 :]):
            break
    return block, origin, torch.cat(block_q) if block_q else None


def viasd_tiered_decode(decoder: Decoder, drafter: Drafter, route: LayerMask, req: DecodeRequest, k: int,
                        thresholds: TierThresholds, resume: bool = True, head: ReducedHead | None = None,
                        adaptive: bool = False, correct: bool = False) -> list[int]:
    """Tiered VIA-SD (lossy): tier 1 accepts, tier 2 the slim verifier settles, tier 3 the full model
    decides (`resume`: its pass starts at the route's first incomplete layer, see `resume_layer`;
    `head`: the slim verifier's reduced LM head, a draft outside it is tier 3; `adaptive`: each
    round drafts the number that commits the most tokens per full pass' measured cost, as `sd`
    chooses it (`draft_length.DraftLength`, its acceptance counting drafts kept by any tier), down to
    none: then the full model decides one token, with no slim pass).

    `correct` (greedy only): every full pass computes the full model's logits before each token
    settled without it since the last one (pending tokens and the round's tiers 1-2); the first token
    where its greedy choice differs is replaced by that choice and everything after it is dropped
    (`_recheck`). Such tokens are streamed only once a full pass has checked them, and the budget's
    last ones get a full pass of their own, so every emitted token is the full model's greedy choice
    after its prefix: the output equals `ar`'s (at batch-invariant passes), and tiers 1-2 only defer
    the full model's work into larger passes."""
    params, stats = req.params, req.stats
    if correct and not params.greedy:
        raise ValueError("correction needs greedy decoding: it replaces a token by the full model's greedy choice")
    # thresholds above 1 switch tiers 1 and 2 off: then every position is the full model's, and a slim
    # pass could change nothing (with both off this is plain SD, at SD's cost)
    slim_tiers = thresholds.accept <= 1.0 or thresholds.slim <= 1.0
    policy = None  # (first: measuring the pass costs belongs to the time to the first token, not to decoding)
    if adaptive and k > 0 and not decoder.is_encoder_decoder:
        policy = DraftLength(k, pass_times(decoder, k + 1), free_drafts=getattr(drafter, "free", False))
    v = Verifier.start(decoder, drafter, req, len(req.prompt) + req.max_new_tokens + k + 2, tiers=True,
                       resume_layer=resume_layer(route, resume and slim_tiers))
    v.hold = correct
    drafted = [False] * len(v.out)  # [len(v.out)] whether each new token is a kept draft (correction takes some back)
    while not v.done or (correct and v.cache.n_full < len(v.tokens) - 1):
        if v.done:  # correction: the budget is spent, and tokens the full model has not checked remain
            unchecked = v.tokens[v.cache.n_full + 1 :]
            rows = v.full([], n_rows=len(unchecked) + 1)[:-1]  # [u, V]: the logits before each of them
            new, origin, corrected = _recheck(v, rows, unchecked, [], [], correct, drafted)
            if not corrected:  # all checked: they go out, and the decode ends (at its budget or end token)
                v.release()
                break
            drafted += [False] * v.commit(new, origin)  # decoding goes on from the corrected token
            continue
        # 1. draft, and score the drafts and the bonus position with one slim pass
        k_eff = min(k, v.budget - 1)
        draft, peek = _propose(drafter, v.tokens, k_eff, policy)
        if confident_round(draft.tokens, draft.probs, thresholds):  # tier 1 by the drafter alone: no slim pass
            stats.observe_round(len(draft), len(draft))
            kept = v.commit(list(draft.tokens), [Tier.ACCEPT] * len(draft), checked=False)
            stats.unchecked += kept
            drafted += [True] * kept
            continue
        if draft.tokens and slim_tiers:
            slim = params.confidence(v.slim(route, draft.tokens, head=head))  # [k'+1, V]
            tiers = round_tiers(draft.tokens, draft.probs, slim, thresholds, head and head.contains(draft.tokens))  # k'+1
            # 2. tiers 1 and 2, in order, up to the first tier-3 position
            new, i = _settle_without_full(draft, slim, tiers, params, req.generator)
        else:  # no draft (or no tier but the full one): the full model decides, with no slim pass
            new, i, tiers = [], 0, []
        origin = tiers[: len(new)]
        if i is not None:
            # 3. the full model processes every pending position and the remaining drafts in one
            #    pass, and decides the remaining drafts (lossless from here)
            # the pass also computes the full model's logits before each token settled without it
            # (pending ones and this round's tiers 1-2): greedy, count where it would have chosen otherwise
            unchecked = v.tokens[min(v.cache.n_full, len(v.tokens) - 1) + 1 :] + new
            n_rows = len(unchecked) + len(draft) - i + 1
            t0 = time.perf_counter()
            rows = v.full(new + draft.tokens[i:], n_rows=n_rows)  # [u + k'-i+1, V]
            if policy is not None:  # the costs it chooses by follow the measured passes, as in `sd`
                policy.observe_pass(n_rows, time.perf_counter() - t0)
            corrected = False
            if params.greedy and unchecked:
                new, origin, corrected = _recheck(v, rows[: len(unchecked)], unchecked, new, origin, correct, drafted)
            if not corrected:  # the full model decides the remaining drafts
                rows = rows[len(unchecked) :]  # [k'-i+1, V]
                n, x = accept(draft.tokens[i:], None if draft.probs is None else draft.probs[i:], rows, params, req.generator)
                stats.observe_full_check(len(draft) - i, n)
                new += draft.tokens[i : i + n] + [x]
                origin += [Tier.FULL] * (n + 1)
        kept_drafts = _common_prefix(new, draft.tokens)
        stats.observe_round(len(draft), kept_drafts)  # settled by the slim or the full verifier
        if policy is not None:
            policy.observe(len(draft), kept_drafts)
            if peek is not None and kept_drafts == len(draft) and len(new) > len(draft):
                policy.observe(1, int(new[len(draft)] == peek))  # the proposed token after the verified drafts
        kept = v.commit(new, origin, checked=i is not None)
        stats.unchecked += sum(t != Tier.FULL for t in origin[:kept])
        drafted += [j < kept_drafts for j in range(kept)]
    return v.out


def _recheck(v: Verifier, rows: torch.Tensor, unchecked: list[int], new: list[int], origin: list[Tier],
             correct: bool, drafted: list[bool]) -> tuple[list[int], list[Tier], bool]:
    """Greedy, after a full pass: rows [u, V] are the full model's logits before each of `unchecked`
    (the committed tokens it had not processed, then the round's `new` ones); count where its choice
    differs (`observe_recheck`). With `correct`, at the first such token that choice replaces it and
    everything after it is dropped: committed ones are taken back (`Verifier.retract`, never
    streamed; the drafts among them, `drafted`'s flags of the new tokens, no longer count as
    accepted), the round's are cut. Returns the round's tokens and tiers to commit (unchanged when
    nothing is corrected; otherwise ending with the corrected token, tier 3) and whether it corrected one."""
    choice = rows.argmax(-1).tolist()
    differs = [c != t for c, t in zip(choice, unchecked)]
    v.stats.observe_recheck(len(unchecked), sum(differs))
    j = differs.index(True) if correct and any(differs) else None
    if j is None:
        return new, origin, False
    v.stats.corrected += 1
    n_pending = len(unchecked) - len(new)
    if j < n_pending:
        removed = v.retract(n_pending - j)
        v.stats.unchecked -= sum(t != Tier.FULL for t in removed)
        v.stats.accepted -= sum(drafted[len(drafted) - len(removed) :])
        del drafted[len(drafted) - len(removed) :]
        new, origin = [], []
    else:
        new, origin = new[: j - n_pending], origin[: j - n_pending]
    v.stats.discarded += len(unchecked) - j
    return new + [choice[j]], origin + [Tier.FULL], True


def _propose(drafter: Drafter, tokens: list[int], k: int, policy: DraftLength | None) -> tuple[Draft, int | None]:
    """Up to k drafts; with a policy, as many as it chooses. A free drafter proposes k and is cut; the
    first token cut off comes back too (`peek`), so that the policy scores the drafter on it even in
    rounds that verify no draft (as `sd` does: else an acceptance estimate that chose no draft could
    never learn otherwise)."""
    if k <= 0:
        return NO_DRAFT, None
    if policy is None:
        return drafter.propose(tokens, k), None
    if policy.free_drafts:
        proposal = drafter.propose(tokens, k)
        j = min(policy.choose(), len(proposal))
        return proposal.cut(j), proposal.tokens[j] if j < len(proposal) else None
    j = min(policy.choose(), k)
    if j == 0:
        return NO_DRAFT, None
    t0 = time.perf_counter()
    draft = drafter.propose(tokens, j)
    policy.observe_drafting(time.perf_counter() - t0, len(draft))
    return draft, None


def _settle_without_full(draft: Draft, slim: torch.Tensor, tiers: list[Tier], params: SamplingParams,
                         generator: torch.Generator | None) -> tuple[list[int], int | None]:
    """Tiers 1 and 2 of a round in order. slim: [k'+1, V]. Returns the settled tokens and the position
    where the full model takes over (None: the slim verifier replaced a draft or settled the bonus
    position, which ends the round)."""
    new: list[int] = []
    for i, tier in enumerate(tiers):
        if tier == Tier.FULL:
            return new, i
        if tier == Tier.ACCEPT:  # keep the draft, no check
            new.append(draft.tokens[i])
            continue
        has_draft = i < len(draft)  # tier 2: the slim verifier keeps the draft or regenerates the token
        q_row = draft.probs[i] if draft.probs is not None and has_draft else None
        token = settle(draft.tokens[i] if has_draft else None, q_row, slim[i], params, generator)
        new.append(token)
        if not has_draft or token != draft.tokens[i]:
            return new, None
    return new, None  # unreachable: the bonus position is SLIM or FULL


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
