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
counts look dear for good) and follows the request's own verification passes (their attention grows
with the context).

The choice changes only how fast a lossless strategy decodes, never what it outputs (greedy output
equals `ar`'s and sampled output follows the verifier's distribution at every draft length); a seeded
sampled output can differ between runs, as the measured costs do (a fixed `k` reproduces it).
"""

from __future__ import annotations

import statistics
import time

import torch

from viasd.decoding.drafters import NO_DRAFT, Draft, Drafter
from viasd.decoding.verifier import CallKind
from viasd.models import batching
from viasd.models.runtime import Decoder

_CONTEXT = 64  # positions already in the cache when the pass costs are measured
_PRIOR = (1.2, 0.8)  # (accepted, rejected) pseudo-counts: alpha starts at 0.6
_DECAY = 0.9  # weight of the past per round
_PROBE_EVERY = 8  # rounds without drafts before one draft is tried again (drafters that cost) ...
_PROBE_MAX = 128  # ... doubling after each probe the full model rejects, up to this
_FOLLOW = 0.3  # weight of a new pass time in T(r)


def pass_times(decoder: Decoder, rows: int, reps: int = 3) -> list[float]:
    """Seconds of a forward pass of 1..rows tokens after a `_CONTEXT`-position prompt (medians, on a
    scratch cache), measured once per decoder and row count and kept on it. Non-decreasing: a pass of
    more rows never counts as cheaper."""
    cached: dict[int, list[float]] = decoder.__dict__.setdefault("_pass_times", {})
    if rows in cached:
        return cached[rows]
    n = max(1, min(_CONTEXT, decoder.config.max_positions - rows - 1))
    ids = torch.arange(rows + n) % min(1000, decoder.config.vocab_size)  # any tokens: the cost is the same
    cache = decoder.new_cache(n + rows)
    decoder.forward(ids[:n], 0, cache)
    samples: list[list[float]] = [[] for _ in range(rows)]
    for i in range(reps + 1):  # row counts interleaved: drift hits all of them alike
        for r in range(1, rows + 1):
            t0 = time.perf_counter()
            decoder.forward(ids[n : n + r], n, cache)
            if i:  # the first round builds the graphs
                samples[r - 1].append(time.perf_counter() - t0)
            cache.rollback(n)
    times: list[float] = []
    for r in range(rows):
        times.append(max(statistics.median(samples[r]), times[-1] if times else 0.0))
    cached[rows] = times
    return times


def expected_tokens(alpha: float, j: int) -> float:
    """Tokens a round with j drafts commits on average when each draft is accepted with probability
    alpha until the first rejection (plus the recovered or bonus token)."""
    return float(j + 1) if alpha >= 1.0 else (1.0 - alpha ** (j + 1)) / (1.0 - alpha)


class DraftLength:
    """The draft length of each round: `choose()` before drafting, `observe()` after verifying.

    `times[j]`: seconds of a pass of j+1 rows (`pass_times`); `free_drafts`: the drafter costs nothing
    (prompt lookup), so it can always propose and be scored on the token that follows even when the
    round verifies no draft.
    """

    def __init__(self, k: int, times: list[float], free_drafts: bool, draft_s: float = 0.0):
        if len(times) < k + 1 or times[0] <= 0:
            raise ValueError(f"need positive pass times for 1..{k + 1} rows, got {times}")
        self.k, self.free_drafts = k, free_drafts
        self.times = list(times[: k + 1])  # [k+1] seconds of a pass of 1..k+1 rows
        self.accepted, self.rejected = _PRIOR
        self.draft_s = draft_s  # seconds per drafting pass (decayed mean; `drafting_seconds` first)
        self.extra_passes = 0.0  # drafting passes a round makes beyond one per draft (decayed mean)
        self._idle = 0  # rounds since the last verified draft
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
        buckets (`batching.padded_rows`) and reads every weight once per bucket (8 `pld` requests ran
        2-3 passes a step and served 0.75x `ar`'s tokens/s). Past the measured row counts, each row
        at the last measured row's cost."""
        costs = self.costs
        slope = costs[-1] - costs[-2] if len(costs) > 1 else costs[0]
        rows = lambda r: costs[r - 1] if r <= len(costs) else costs[-1] + (r - len(costs)) * slope  # noqa: E731
        if others == 0:
            return costs
        return [rows(others + 1)] + [rows(others) + costs[j] for j in range(1, self.k + 1)]

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def choose(self, others: int | None = None) -> int:
        """Drafts for the next round. Served beside `others` other requests (default: the other
        members of this thread's batch session, a row each), the round's passes carry their rows too
        (`batch_costs`): the draft length that commits the most tokens of all of them per unit of
        their time, so that speculation shrinks to none beside others unless nearly every draft is
        accepted (alone: this request's tokens per unit of its own passes' time). A drafter that costs is probed now and then after rounds
        without drafts (its acceptance is only learnt from verified drafts), but not where drafts
        could not pay even if every one were accepted: a probe beside others makes them all wait for
        its drafter's passes (`batching.lockstep`)."""
        if others is None:
            others = _others()
        a, costs, pass_cost = self.alpha, self.batch_costs(others), self.draft_s / self.times[0]
        drafting = lambda i: (i + self.extra_passes) * pass_cost if i else 0.0  # noqa: E731
        rate = lambda alpha, i: (others + expected_tokens(alpha, i)) / (costs[i] + drafting(i))  # noqa: E731
        rates = [rate(a, i) for i in range(self.k + 1)]
        j = max(range(self.k + 1), key=lambda i: (rates[i], -i))  # ties: fewer drafts
        self._probing = False
        if j == 0 and not self.free_drafts and self.k > 0 and self._idle >= self._probe_every:
            if max(rate(1.0, i) for i in range(1, self.k + 1)) > rates[0]:  # drafts could pay: score the drafter
                j, self._probing = 1, True
        self._idle = 0 if j > 0 else self._idle + 1
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
        if 1 <= rows <= len(self.times) and seconds > 0 and _others() == 0:
            self.times[rows - 1] = (1 - _FOLLOW) * self.times[rows - 1] + _FOLLOW * seconds

    def observe_drafting(self, seconds: float, drafted: int, passes: int | None = None) -> None:
        """Time spent drafting `drafted` tokens in `passes` passes of a drafter model or route (default:
        one a draft), alone (as `observe_pass`). Priced per pass, with the passes a round makes beyond
        one per draft apart: a drafter of another vocabulary drafts a token more than it keeps (the last
        converted one may still grow) and its first pass reads the text committed since its last draft,
        so a round of one draft cost 3-8 passes' time; counted per draft, a drafter probed with one
        draft after rounds without any looked too dear ever to draft more (qwen 1.5B with smollm2:
        0.4-0.9 of a verifier pass a draft against 0.11 a pass, and 33 tok/s against 38 at a fixed 4)."""
        passes = drafted if passes is None else passes
        if drafted > 0 and passes > 0 and _others() == 0:
            per_pass = seconds / passes
            self.draft_s = 0.5 * self.draft_s + 0.5 * per_pass if self.draft_s else per_pass
            self.extra_passes = 0.5 * self.extra_passes + 0.5 * max(0, passes - drafted)


def drafting_seconds(drafter: Drafter, verifier_times: list[float]) -> float:
    """Seconds a drafting pass costs before any drafting is measured (a request that starts beside
    others never measures it alone): a drafter model's one-row pass (measured once per model, as the
    verifier's), a drafting route's share of the verifier's one-row pass, nothing for a free drafter."""
    if getattr(drafter, "free", False):
        return 0.0
    if (share := getattr(drafter, "verifier_share", 0.0)) > 0:
        return share * verifier_times[0]
    decoder = getattr(drafter, "decoder", None)
    return pass_times(decoder, 1)[0] if isinstance(decoder, Decoder) and not decoder.is_encoder_decoder else 0.0


def _others() -> int:
    """Other requests in this thread's batch session (0 outside one)."""
    session = batching.current()
    return max(0, session.members - 1) if session is not None else 0


def propose(drafter: Drafter, tokens: list[int], k: int, policy: DraftLength | None) -> tuple[Draft, int | None]:
    """Up to k drafts of `drafter` after `tokens`; with a policy, as many as it chooses. A free
    drafter proposes k and is cut; the first token cut off comes back too (`peek`), so that the policy
    scores the drafter on it even in rounds that verify no draft (else an acceptance estimate that
    chose no draft could never learn otherwise)."""
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
    stats = getattr(drafter, "stats", None)
    calls = stats.calls[CallKind.DRAFT] if stats is not None else None
    t0 = time.perf_counter()
    draft = drafter.propose(tokens, j)
    passes = stats.calls[CallKind.DRAFT] - calls if calls is not None else None
    policy.observe_drafting(time.perf_counter() - t0, len(draft), passes)
    return draft, None
