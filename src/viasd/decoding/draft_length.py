"""Draft lengths from measured costs: how many drafts a round should verify (`--adapt-k`).

A verification pass of r rows does not cost r times a one-row pass, nor the same: with float weights
and oneDNN it is nearly flat in r, with native quantized weights each extra row costs about half a
one-row pass (docs/ARCHITECTURE.md, "Weights in the file's own format"). So the best draft length is a
property of the machine and the weights, not a constant. With a per-draft acceptance rate alpha,
j drafts commit (1 - alpha^(j+1)) / (1 - alpha) tokens on average (Leviathan et al. 2023, eq. 1)
and cost c(j) = T(j+1)/T(1) one-row passes plus the drafting; each round takes the j in 0..k that
commits the most tokens per unit of cost. alpha is learnt as the request decodes, from what the full
model accepted (decayed, so that a copied passage raises it quickly and ordinary text lowers it).
T(r) starts from a measurement on a short context (`pass_times`, once per model: the row counts
interleaved, so that a slow spell of a shared machine hits them alike rather than making some row
counts look dear for good) and follows the verification passes of requests decoded alone (their
attention grows with the context); what one request learns starts the next one's, so that a
long-running process (a server) does not keep one measurement's errors.

The choice changes only how fast a lossless strategy decodes, never what it outputs (greedy output
equals `ar`'s and sampled output follows the verifier's distribution at every draft length); a seeded
sampled output can differ between runs, as the measured costs do (a fixed `k` reproduces it).
"""

from __future__ import annotations

from viasd.decoding.drafters import NO_DRAFT, Draft, Drafter
from viasd.decoding.session import CallKind
from viasd.execution.passes import Passes
from viasd.execution.timing import PassTimer, pass_times
from viasd.models.decoder import Decoder

_PRIOR = (1.2, 0.8)  # (accepted, rejected) pseudo-counts: alpha starts at 0.6
_DECAY = 0.9  # weight of the past per round
_PROBE_EVERY = 8  # rounds without drafts before one draft is tried again (drafters that cost) ...
_PROBE_MAX = 128  # ... doubling after each probe the full model rejects, up to this
_FOLLOW = 0.3  # weight of a new pass time in T(r)


def expected_tokens(alpha: float, j: int) -> float:
    """Tokens a round with j drafts commits on average when each draft is accepted with probability
    alpha until the first rejection (plus the recovered or bonus token)."""
    return float(j + 1) if alpha >= 1.0 else (1.0 - alpha ** (j + 1)) / (1.0 - alpha)


class DraftLength:
    """The draft length of each round: `choose()` before drafting, `observe()` after verifying.

    `times[j]`: seconds of a pass of j+1 rows (`pass_times`); `free_drafts`: the drafter costs nothing
    (prompt lookup), so it can always propose and be scored on the token that follows even when the
    round verifies no draft; `draft_s`: seconds of one drafting pass, measured alone
    (`drafting_seconds`). A round with j drafts costs the verification pass of j+1 rows, j + `extra_passes`
    drafting passes at `draft_s`, and `round_s` of other drafting time (both learnt from the rounds:
    a drafter of another vocabulary drafts a token past what it keeps and converts its text with two
    tokenizers each round).

    Lossless VIA-SD verifies drafts in two passes (`multitier.viasd_lossless_decode`): a slim pass of
    j+1 rows along the route, then a full pass that resumes where the route's whole lower layers end.
    `check_share` and `verify_share` price them at their shares of a full pass' weight bytes
    (`pass_bytes`); a round without drafts is one full pass of one row, as in `sd`.
    """

    def __init__(self, k: int, times: list[float], free_drafts: bool, draft_s: float = 0.0,
                 check_share: float = 0.0, verify_share: float = 1.0, learnt: list[float] | None = None,
                 passes: Passes | None = None):
        if len(times) < k + 1 or times[0] <= 0:
            raise ValueError(f"need positive pass times for 1..{k + 1} rows, got {times}")
        if not (0.0 <= check_share <= 1.0 and 0.0 < verify_share <= 1.0):
            raise ValueError(f"pass shares must lie in [0, 1] (verify: (0, 1]), got check {check_share}, verify {verify_share}")
        self.k, self.free_drafts = k, free_drafts
        self.check_share, self.verify_share = check_share, verify_share
        self.times = list(times[: k + 1])  # [k+1] seconds of a pass of 1..k+1 rows
        self._learnt = learnt  # where what `observe_pass` learns is kept for the model's next requests
        self.passes = passes or Passes()  # the request's: whether its passes are its own, beside how many others
        self.accepted, self.rejected = _PRIOR
        self.draft_s = draft_s  # seconds per drafting pass (`drafting_seconds`: measured alone, once)
        self.extra_passes = 0.0  # drafting passes a round makes beyond one per draft (decayed mean)
        self.round_s = 0.0  # a drafting round's time beyond its passes at draft_s (decayed mean)
        self._idle = 0  # rounds since the last verified draft
        self._drafting = 0  # rounds with drafts so far
        self._steady = False  # this round follows one with drafts (its drafter has little to catch up on)
        self._probe_every = _PROBE_EVERY
        self._probing = False

    @property
    def costs(self) -> list[float]:
        """[k+1]: a pass of j+1 rows in one-row passes (never decreasing in j)."""
        out = [t / self.times[0] for t in self.times]
        for j in range(1, len(out)):
            out[j] = max(out[j], out[j - 1])
        return out

    def batch_costs(self, others: int) -> list[float]:
        """[k+1]: the passes of a round beside `others` other requests (a row each), in one-row passes:
        with no draft, one pass of their rows and this one's; with j drafts, that pass without this
        request's row plus a pass of its own j+1 rows, since a shared pass groups calls of equal row
        buckets (`batching.padded_rows`) and reads every weight once per bucket. Past the measured row
        counts, each row at the last measured row's cost. A pass of r rows never counts as more than
        one of r - 1 rows and a one-row pass (it could be run as those two), so that times a
        neighbour's work inflated cannot price a step's shared pass above a split one and make
        requests draft beside each other. A round with drafts of lossless
        VIA-SD pays its slim and its resumed full pass instead of one full pass (`check_share +
        verify_share` of it)."""
        costs = self.costs
        own = [costs[0]] + [(self.check_share + self.verify_share) * c for c in costs[1:]]  # [k+1]
        if others == 0:
            return own
        slope = costs[-1] - costs[-2] if len(costs) > 1 else costs[0]
        table = [costs[0]]  # [n] a pass of 1..n rows (n: as many as the round's step may carry)
        for r in range(2, max(others + 1, len(costs)) + 1):
            measured = costs[r - 1] if r <= len(costs) else costs[-1] + (r - len(costs)) * slope
            table.append(min(measured, table[-1] + costs[0]))
        rows = lambda r: table[r - 1]  # noqa: E731
        return [rows(others + 1)] + [rows(others) + own[j] for j in range(1, self.k + 1)]

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def choose(self, others: int | None = None) -> int:
        """Drafts for the next round. Served beside `others` other requests (default: the other
        members of the request's batch session, a row each), the round's passes carry their rows too
        (`batch_costs`): the draft length that commits the most tokens of all of them per unit of
        their time, so that speculation shrinks to none beside others unless nearly every draft is
        accepted (alone: this request's tokens per unit of its own passes' time). A drafter that costs is probed now and then after rounds
        without drafts (its acceptance is only learnt from verified drafts), but not where drafts
        could not pay even if every one were accepted: a probe beside others makes them all wait for
        its drafter's passes (`batching.lockstep`)."""
        if others is None:
            others = self.passes.others()
        a, costs, pass_cost, round_cost = self.alpha, self.batch_costs(others), self.draft_s / self.times[0], self.round_s / self.times[0]
        drafting = lambda i: (i + self.extra_passes) * pass_cost + round_cost if i else 0.0  # noqa: E731
        rate = lambda alpha, i: (others + expected_tokens(alpha, i)) / (costs[i] + drafting(i))  # noqa: E731
        rates = [rate(a, i) for i in range(self.k + 1)]
        j = rates.index(max(rates))  # (ties: the fewest drafts)
        self._probing, self._steady = False, self._idle == 0 and self._drafting > 0
        if j == 0 and not self.free_drafts and self.k > 0 and self._idle >= self._probe_every:
            if max(rate(1.0, i) for i in range(1, self.k + 1)) > rates[0]:  # drafts could pay: score the drafter
                j, self._probing = 1, True
        self._idle = 0 if j > 0 else self._idle + 1
        self._drafting += j > 0
        return j

    def observe(self, drafted: int, accepted: int) -> None:
        """A verified round: `accepted` of `drafted` drafts kept (a rejection ends the prefix)."""
        if drafted <= 0:
            return
        self.accepted = _DECAY * self.accepted + accepted
        self.rejected = _DECAY * self.rejected + (1 if accepted < drafted else 0)
        if self._probing:  # a rejected probe waits twice as long for the next one
            self._probe_every = _PROBE_EVERY if accepted else min(2 * self._probe_every, _PROBE_MAX)

    def observe_pass(self, rows: int, seconds: float) -> None:
        """A verification pass of `rows` rows took `seconds`. Learnt only from a request's passes of its
        own: beside others, a pass carries their rows too and waits for their drafters (`batching`),
        and its time is not that of `rows` rows (learnt as such, it made every draft length cost
        about the same, so that 8 served `sd` requests drafted as if alone)."""
        if 1 <= rows <= len(self.times) and seconds > 0 and self.passes.alone():
            self.times[rows - 1] = (1 - _FOLLOW) * self.times[rows - 1] + _FOLLOW * seconds
            if self._learnt is not None and rows <= len(self._learnt):
                self._learnt[rows - 1] = self.times[rows - 1]

    def observe_drafting(self, seconds: float, drafted: int, passes: int | None = None) -> None:
        """Time spent drafting `drafted` tokens in `passes` passes of a drafter model or route (default:
        one a draft), alone (as `observe_pass`), graph builds left out (`PassTimer`). The passes are
        priced at `draft_s`, measured alone once; the rest of the time is the round's own (`round_s`:
        tokenizer calls, sampling). The passes a round makes beyond one per draft are learnt apart:
        a drafter of another vocabulary drafts a token more than it keeps (the last converted one may
        still grow). The round's own time is learnt only from rounds that follow one with drafts: a
        request's first drafting round pays what is done once, and a probe after rounds without drafts
        first reads every token committed meanwhile, which steady drafting never does; priced into
        every pass, such rounds would make a drafter look twice as dear and stop drafting for good."""
        passes = drafted if passes is None else passes
        if drafted > 0 and passes > 0 and self.passes.alone():
            self.extra_passes = 0.5 * self.extra_passes + 0.5 * max(0, passes - drafted)
            if self._steady:
                self.round_s = 0.5 * self.round_s + 0.5 * max(0.0, seconds - passes * self.draft_s)


def drafting_seconds(drafter: Drafter, verifier_times: list[float], k: int = 1, passes: Passes | None = None) -> float:
    """Seconds of one drafting pass, before any drafting is measured (a request that starts beside
    others never measures it alone): a drafter model's one-row pass over the LM head it drafts with
    (measured once per model and head, as the verifier's; its last-row passes of up to k + 2 rows, a
    round's first pass reading what was committed since, built then too, so that no round pays for a
    graph), a drafting route's share of the verifier's one-row pass, nothing for a free drafter."""
    if getattr(drafter, "free", False):
        return 0.0
    if (share := getattr(drafter, "verifier_share", 0.0)) > 0:
        return share * verifier_times[0]
    decoder = getattr(drafter, "decoder", None)
    if not isinstance(decoder, Decoder) or decoder.is_encoder_decoder:
        return 0.0
    return pass_times(decoder, k + 2, last_only=True, passes=passes, head=getattr(drafter, "head", None))[0]


def draft_policy(decoder: Decoder, drafter: Drafter, k: int, check_share: float = 0.0,
                 verify_share: float = 1.0, shared: bool = True, passes: Passes | None = None) -> DraftLength | None:
    """The draft-length policy of a loop that verifies with `decoder` and drafts with `drafter`, its
    costs measured now (before the first token: measuring belongs to the time to it, not to
    decoding); None where there is nothing to choose (k = 0, an encoder-decoder). `check_share`,
    `verify_share`: lossless VIA-SD's two passes a round (`DraftLength`). `shared`: what the policy
    learns of its verification passes is kept for the model's next requests (False where those passes
    are not whole ones: a full pass resumed at a layer costs a fraction of one)."""
    if k <= 0 or decoder.is_encoder_decoder:
        return None
    times = pass_times(decoder, k + 1, passes=passes)
    # what a request learns of its passes' times starts the next request's: a long-running process (a
    # server) measures the pass costs once, and one measurement (3 passes of each row count) can be
    # off by 10-15% a row count for good (a server's priced 3-5 rows of smollm2 at 1.27-1.45x one row
    # where three fresh processes measured 1.14-1.35x, and its `pld` drafted shorter rounds)
    return DraftLength(k, times, getattr(drafter, "free", False), drafting_seconds(drafter, times, k, passes), check_share,
                       verify_share, learnt=times if shared else None, passes=passes)


def propose(drafter: Drafter, tokens: list[int], k: int, policy: DraftLength | None) -> tuple[Draft, int | None]:
    """Up to k drafts of `drafter` after `tokens`; with a policy, as many as it chooses. A free
    drafter proposes k and is cut; the first token cut off comes back too (`peek`), so that the policy
    scores the drafter on it even in rounds that verify no draft (else an acceptance estimate that
    chose no draft could never learn otherwise). A grammar's forced tokens (`drafters.GrammarDrafter`)
    come first in every draft, beyond k and whatever the policy chooses: they cost no drafting. A
    drafter model behind prompt lookup (`drafters.LookupDrafter`) proposes the k tokens lookup finds,
    where it finds any, without the model or the policy (`Draft.looked_up`); beside other requests
    only the policy's choice is drafted (extra rows in a shared pass make the others wait too)."""
    if k <= 0:
        return NO_DRAFT, None
    lookup = getattr(drafter, "lookup", None)
    if lookup is not None and (policy is None or not policy.passes.others()) and (found := lookup(tokens, k)).tokens:
        return found, None
    if policy is None:
        return drafter.propose(tokens, k), None
    if policy.free_drafts:
        proposal = drafter.propose(tokens, k)
        j = min(proposal.forced + policy.choose(), len(proposal))
        return proposal.cut(j), proposal.tokens[j] if j < len(proposal) else None
    j = min(policy.choose(), k)
    if j == 0 and not getattr(drafter, "forces", False):
        return NO_DRAFT, None
    stats = getattr(drafter, "stats", None)
    calls = stats.calls[CallKind.DRAFT] if stats is not None else None
    with PassTimer(getattr(drafter, "decoder", None)) as timer:
        draft = drafter.propose(tokens, j)
    passes = stats.calls[CallKind.DRAFT] - calls if stats is not None and calls is not None else None
    if j:
        policy.observe_drafting(timer.seconds, len(draft) - draft.forced, passes)
    return draft, None
