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
  proposal. Output distribution exactly the full model's; greedy output equals `ar` (at any draft
  length, so greedy decoding chooses it from measured costs, as `sd` does).
- `viasd_tiered_decode`: per draft position a tier from confidence signals; tiers 1 and 2 are
  committed without a full-model check; the full model is called only at a tier-3 position, and then
  processes every pending position in one pass (which also fills its KV cache). A round with no
  draft (prompt lookup found nothing, or one token of budget is left) makes no slim pass: the full
  model decides its token; nor does any round when thresholds above 1 switch tiers 1 and 2 off.
  With `correct` (greedy), that pass also corrects the first token settled without it where the full
  model's choice differs (`_recheck`), and tokens go out only once checked: the output equals `ar`'s.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from viasd.decoding.acceptance import SamplingParams, accept, first_maxima, settle
from viasd.decoding.draft_length import DraftLength, draft_policy, propose
from viasd.execution.timing import PassTimer
from viasd.decoding.drafters import Draft, Drafter
from viasd.decoding.stats import Source, drafted_sources
from viasd.decoding.tiers import Tier, TierThresholds, confident_round, round_tiers
from viasd.decoding.session import DecodeRequest, Session, pass_bytes
from viasd.execution.passes import Passes
from viasd.models.decoder import Decoder
from viasd.models.kvcache import LayerMask
from viasd.models.layers import ReducedHead
from viasd.models.logits import PassOutput


def resume_layer(route: LayerMask, resume: bool = True) -> int | None:
    """Where full passes resume after slim passes along `route`: the first layer it does not keep whole
    (None: resuming off, or a route that keeps no whole layer at the bottom)."""
    m = route.prefix
    return m if resume and 0 < m < route.n_layers else None


def viasd_lossless_decode(decoder: Decoder, drafter: Drafter, route: LayerMask, req: DecodeRequest, k: int, full_block: int = 8,
                          resume: bool = True, head: ReducedHead | None = None, adaptive: bool = False) -> list[int]:
    """Lossless VIA-SD: blocks of up to `full_block` slim-verified tokens, each checked by one full pass
    (`resume`: which starts at the route's first incomplete layer, see `resume_layer`; `head`: the
    slim verifier's reduced LM head, drafts cut before the first token outside it; `adaptive`: each
    slim round drafts the number that commits the most tokens per measured second, its slim and
    resumed full pass priced at their shares of a full pass' bytes (`lossless_policy`), down to none:
    then one full pass of one row decides a token, as in `ar`, and beside other served requests
    that is what it does unless nearly every draft is kept)."""
    from_layer = resume_layer(route, resume)
    policy = lossless_policy(decoder, drafter, route, k, from_layer, head, req.passes) if adaptive else None
    v = Session.start(decoder, drafter, req, len(req.prompt) + req.max_new_tokens + k + full_block + 2, tiers=True,
                       resume_layer=from_layer)
    while not v.done:
        # 1. slim stage: speculative decoding drafter -> slim builds a block distributed as q'
        s = _slim_stage(v, drafter, route, k, full_block, head, policy)
        # 2. full stage: one pass verifies the block, with q' as the proposal distribution
        out = v.full(s.block)  # [len(block)+1, V]
        n, x = accept(s.block, s.block_q, out.logits, req.params, req.generator, known=out.argmax)
        req.stats.observe_round(0, 0)
        req.stats.observe_full_check(len(s.block), n)
        if s.rescue is not None and n >= s.rescue:  # the full model judged the slim verifier's replacement
            req.stats.observe_rescue(n > s.rescue)
        own = [t == Tier.ACCEPT and not f for t, f in zip(s.origin, s.forced)]  # the drafter's drafts
        if policy is not None:  # drafts both verifiers kept, of all the block's; a free drafter's unverified proposal too
            policy.observe(s.drafted - sum(s.forced), sum(own[:n]))
            if s.peek is not None:
                policy.observe(1, int(x == s.peek))
        # 3. commit; drafter tokens the full model rejected (or the budget cut) no longer count as accepted
        sources = [Source.GRAMMAR if f else _TIER_SOURCE[t] for t, f in zip(s.origin[:n], s.forced)]
        kept = v.commit(s.block[:n] + [x], s.origin[:n] + [Tier.FULL], sources=sources, logits=out.logits)
        req.stats.observe_grammar(sum(s.forced), sum(s.forced[: min(n, kept)]))
        req.stats.accepted -= s.origin.count(Tier.ACCEPT) - s.origin[: min(n, kept)].count(Tier.ACCEPT)
    return v.out


def lossless_policy(decoder: Decoder, drafter: Drafter, route: LayerMask, k: int, from_layer: int | None,
                    head: ReducedHead | None, passes: Passes | None = None) -> DraftLength | None:
    """Lossless VIA-SD's draft lengths (`DraftLength`): a round with drafts pays a slim pass along
    `route` and a full pass from `from_layer`, each at its share of a full pass' weight bytes (the
    route's share of sub-layers where a model does not say). Pass times stay as measured at the start:
    the loop's full passes are resumed ones, which would teach T(r) a fraction of a full pass."""
    full = pass_bytes(decoder, None)
    check = pass_bytes(decoder, route, 0, head) / full if full else route.fraction
    verify = pass_bytes(decoder, None, from_layer or 0) / full if full else 1.0
    return draft_policy(decoder, drafter, k, check_share=min(1.0, check), verify_share=min(1.0, max(verify, 1e-3)),
                        passes=passes)


# who settled a token of each tier that is not a kept grammar-forced draft
_TIER_SOURCE = {Tier.ACCEPT: Source.DRAFT, Tier.SLIM: Source.SLIM, Tier.FULL: Source.FULL}


class _SlimBlock(NamedTuple):
    block: list[int]  # the slim-verified tokens
    origin: list[Tier]  # each one's: ACCEPT, a drafter token; SLIM, the slim verifier's recovered/bonus token
    block_q: torch.Tensor | None  # [len(block), V] q' at each position (sampling only)
    rescue: int | None  # where the slim verifier replaced a rejected draft (None: it did not)
    drafted: int  # drafts proposed in the block's rounds
    forced: list[bool]  # [len(block)] which tokens are grammar-forced drafts
    peek: int | None  # a free drafter's proposal the policy cut when the block is empty (scored on the full model's token)


def _slim_stage(v: Session, drafter: Drafter, route: LayerMask, k: int, full_block: int,
                head: ReducedHead | None = None, policy: DraftLength | None = None) -> _SlimBlock:
    """Draft and slim-verify rounds until the block is full, an end token appears, or the slim
    verifier rejects a draft (`policy`: each round drafts as many as it chooses, at most k).

    Stopping at the first slim rejection matters: a block continued past it grows from the slim
    verifier's own token, which the full model rejects more often than a draft both agreed on, and
    each further round costs a drafting run and a slim pass (filling the block regardless cost three
    times the verifier work per token). An empty draft ends the stage too: a
    slim pass would only add one token, at most of a full pass' cost.
    """
    params = v.req.params
    block: list[int] = []
    origin: list[Tier] = []
    block_q: list[torch.Tensor] = []
    forced: list[bool] = []
    drafted, peek = 0, None
    q = lambda: torch.cat(block_q) if block_q else None  # noqa: E731
    while len(block) < min(full_block, v.budget - 1):
        k_eff = min(k, v.budget - 2 - len(block))
        draft, proposed = propose(drafter, v.tokens + block, k_eff, policy)
        if head is not None:  # the slim verifier judges no draft outside its head's vocabulary
            draft = draft.cut(next((i for i, ok in enumerate(head.contains(draft.tokens)) if not ok), len(draft)))
        if not draft.tokens:
            peek = proposed if not block else None
            break
        drafted += len(draft)
        slim = v.slim(route, block + draft.tokens, n_rows=len(draft) + 1, head=head)  # [k'+1, V]
        n, x = accept(draft.tokens, draft.probs, slim.logits, params, v.req.generator, known=slim.argmax)
        v.stats.observe_round(len(draft), n, verification=False)
        v.keep_slim(route, len(block) + n)  # slim K/V now covers the block and the accepted drafts
        block += draft.tokens[:n] + [x]
        origin += [Tier.ACCEPT] * n + [Tier.SLIM]
        forced += [i < draft.forced for i in range(n)] + [False]
        if not params.greedy:
            block_q.append(params.probs(slim.logits[: n + 1]))
        if n < len(draft):
            return _SlimBlock(block, origin, q(), len(block) - 1, drafted, forced, None)
        if any(t in v.req.eos for t in block[-n - 1 :]):
            break
    return _SlimBlock(block, origin, q(), None, drafted, forced, peek)


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
    if correct and not req.params.greedy:
        raise ValueError("correction needs greedy decoding: it replaces a token by the full model's greedy choice")
    return _TieredLoop(decoder, drafter, route, req, k, thresholds, resume, head, adaptive, correct).run()


class _TieredLoop:
    """`viasd_tiered_decode`'s state and its steps: a round's drafts, tiers 1-2, the full pass."""

    def __init__(self, decoder: Decoder, drafter: Drafter, route: LayerMask, req: DecodeRequest, k: int,
                 thresholds: TierThresholds, resume: bool, head: ReducedHead | None, adaptive: bool, correct: bool):
        self.drafter, self.route, self.req, self.k, self.thresholds = drafter, route, req, k, thresholds
        self.head, self.correct, self.params, self.stats = head, correct, req.params, req.stats
        # thresholds above 1 switch tiers 1 and 2 off: then every position is the full model's, and a slim
        # pass could change nothing (with both off this is plain SD, at SD's cost)
        self.slim_tiers = thresholds.accept <= 1.0 or thresholds.slim <= 1.0
        from_layer = resume_layer(route, resume and self.slim_tiers)
        # (its resumed full passes cost a fraction of a full pass: not learnt for the model's other loops)
        self.policy = draft_policy(decoder, drafter, k, shared=from_layer is None, passes=req.passes) if adaptive else None
        self.v = Session.start(decoder, drafter, req, len(req.prompt) + req.max_new_tokens + k + 2, tiers=True,
                                resume_layer=from_layer)
        self.v.hold = correct
        self.drafted = [False] * len(self.v.out)  # [len(v.out)] whether each new token is a kept draft (correction takes some back)

    def run(self) -> list[int]:
        v = self.v
        while not v.done or (self.correct and v.cache.n_full < len(v.tokens) - 1):
            if v.done:  # correction: the budget is spent, and tokens the full model has not checked remain
                if self._check_the_rest():
                    break
                continue
            self._round()
        return v.out

    def _check_the_rest(self) -> bool:
        """One full pass over the tokens no full pass has checked; True when they all stand (the
        decode ends), else decoding goes on from the corrected token."""
        v = self.v
        unchecked = v.tokens[v.cache.n_full + 1 :]
        rows = v.full([], n_rows=len(unchecked) + 1)[:-1]  # [u, V]: the logits before each of them
        new, origin, corrected = _recheck(v, rows, unchecked, [], [], self.correct, self.drafted)
        if not corrected:  # all checked: they go out, and the decode ends (at its budget or end token)
            v.release()
            return True
        self.drafted += [False] * v.commit(new, origin)
        return False

    def _round(self) -> None:
        v, stats = self.v, self.stats
        # 1. draft, and score the drafts and the bonus position with one slim pass
        draft, peek = propose(self.drafter, v.tokens, min(self.k, v.budget - 1), self.policy)
        if confident_round(draft.tokens, draft.probs, self.thresholds):  # tier 1 by the drafter alone: no slim pass
            stats.observe_round(len(draft), len(draft))
            kept = v.commit(list(draft.tokens), [Tier.ACCEPT] * len(draft), checked=False,
                            sources=drafted_sources(len(draft), draft.forced))
            stats.unchecked += kept
            self.drafted += [True] * kept
            return
        if draft.tokens and self.slim_tiers:
            slim = self.params.confidence(v.slim(self.route, draft.tokens, head=self.head).logits)  # [k'+1, V]
            tiers = round_tiers(draft.tokens, draft.probs, slim, self.thresholds,
                                self.head.contains(draft.tokens) if self.head is not None else None)  # k'+1
            # 2. tiers 1 and 2, in order, up to the first tier-3 position
            new, i = _settle_without_full(draft, slim, tiers, self.params, self.req.generator)
        else:  # no draft (or no tier but the full one): the full model decides, with no slim pass
            new, i, tiers = [], 0, []
        origin = tiers[: len(new)]
        if i is not None:
            new, origin = self._full_decides(draft, new, origin, i)
        kept_drafts = _common_prefix(new, draft.tokens)
        stats.observe_round(len(draft), kept_drafts)  # settled by the slim or the full verifier
        stats.observe_grammar(draft.forced, min(kept_drafts, draft.forced))
        if self.policy is not None:  # the drafter's own drafts (a grammar's forced ones are not its)
            self.policy.observe(len(draft) - draft.forced, max(0, kept_drafts - draft.forced))
            if peek is not None and kept_drafts == len(draft) and len(new) > len(draft):
                self.policy.observe(1, int(new[len(draft)] == peek))  # the proposed token after the verified drafts
        # (past the kept drafts no token is tier 1: a round ends at its first token that is not its draft)
        sources = drafted_sources(kept_drafts, draft.forced) + [_TIER_SOURCE[t] for t in origin[kept_drafts:]]
        kept = v.commit(new, origin, checked=i is not None, sources=sources)
        stats.unchecked += sum(t != Tier.FULL for t in origin[:kept])
        self.drafted += [j < kept_drafts for j in range(kept)]

    def _full_decides(self, draft: Draft, new: list[int], origin: list[Tier], i: int) -> tuple[list[int], list[Tier]]:
        """3. The full model processes every pending position and the remaining drafts (from i) in one
        pass, and decides the remaining drafts (lossless from here). The pass also computes its logits
        before each token settled without it (pending ones and this round's tiers 1-2): greedy, it
        counts where it would have chosen otherwise, and with `correct` corrects the first."""
        v = self.v
        unchecked = v.tokens[min(v.cache.n_full, len(v.tokens) - 1) + 1 :] + new
        n_rows = len(unchecked) + len(draft) - i + 1
        with PassTimer(v.decoder) as timer:
            rows = v.full(new + draft.tokens[i:], n_rows=n_rows)  # [u + k'-i+1, V]
        if self.policy is not None:  # the costs it chooses by follow the measured passes, as in `sd`
            self.policy.observe_pass(n_rows, timer.seconds)
        if self.params.greedy and unchecked:
            new, origin, corrected = _recheck(v, rows[: len(unchecked)], unchecked, new, origin, self.correct, self.drafted)
            if corrected:
                return new, origin
        rows = rows[len(unchecked) :]  # [k'-i+1, V]
        n, x = accept(draft.tokens[i:], None if draft.probs is None else draft.probs[i:], rows.logits, self.params,
                      self.req.generator, known=rows.argmax)
        self.stats.observe_full_check(len(draft) - i, n)
        return new + draft.tokens[i : i + n] + [x], origin + [Tier.FULL] * (n + 1)


def _recheck(v: Session, rows: PassOutput, unchecked: list[int], new: list[int], origin: list[Tier],
             correct: bool, drafted: list[bool]) -> tuple[list[int], list[Tier], bool]:
    """Greedy, after a full pass: rows [u, V] are the full model's logits before each of `unchecked`
    (the committed tokens it had not processed, then the round's `new` ones); count where its choice
    differs (`observe_recheck`). With `correct`, at the first such token that choice replaces it and
    everything after it is dropped: committed ones are taken back (`Session.retract`, never
    streamed; the drafts among them, `drafted`'s flags of the new tokens, no longer count as
    accepted), the round's are cut. Returns the round's tokens and tiers to commit (unchanged when
    nothing is corrected; otherwise ending with the corrected token, tier 3) and whether it corrected one."""
    choice = first_maxima(rows.logits, rows.argmax)
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
