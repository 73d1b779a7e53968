"""Acceptance rules as pure tensor functions, named as in the papers.

Notation (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023): p is the *target* (verifier) distribution, q the *draft* distribution, x a draft
token. (Careful: transformers' `_speculative_sampling` uses the opposite letters.)

Glossary (as vLLM's RejectionSampler defines it)
- accepted tokens: the leading draft tokens the rule keeps;
- recovered token: the token sampled from the residual distribution at the first rejection;
- bonus token: the token sampled from p after the last draft token when every draft was accepted.
Each verification round commits `n_accepted` draft tokens plus exactly one recovered-or-bonus token.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import torch


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] -> [...] int64: the index of each row's first maximum, as `torch.argmax(x, -1)`.
    A float32 CPU tensor goes through numpy, several times faster (torch wakes its OpenMP team for
    a row of a large vocabulary)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and not x.requires_grad:
        return torch.from_numpy(np.asarray(np.argmax(x.numpy(), -1)))
    return x.argmax(-1)


def first_maxima(x: torch.Tensor, known: list[int] | None = None) -> list[int]:
    """x [V] or [n, V] -> the index of each row's first maximum, as Python ints ([V]: one). `known`:
    them, as a pass' LM head found them writing x (`PassOutput.argmax`): then x is not scanned (a cold
    152k-float row took ~0.17 ms to scan on the AMX Xeon, a verifier pass 34 ms)."""
    if known is not None:
        return known
    found = argmax(x)
    return [int(found)] if x.dim() == 1 else found.tolist()


SCAN = 64  # `first_among` reads up to this many ids one by one


def first_among(x: torch.Tensor, ids: Sequence[int], known: list[int] | None = None) -> int:
    """x [V], ids (any order, each in 0..V-1) -> the first maximum of x over `ids` alone, as x's
    argmax with every other entry -inf: x's own (`known`, [1], as its pass found it) where `ids` holds it, else the
    lowest id of x[ids]'s maxima (NaN the largest, as torch.argmax has it; the rest of x is never
    scanned). Up to `SCAN` ids of a float32 row are read as Python floats: right after a pass, with
    the caches cold, that took 70 us where numpy's indexing took 230 (the AMX Xeon, a 1.5B pass)."""
    if not len(ids):
        raise ValueError("first_among needs at least one id")
    if known is not None and known[0] in ids:
        return known[0]
    if len(ids) <= SCAN and x.dtype == torch.float32 and x.dim() == 1 and x.stride(0) == 1:
        n = x.shape[0]
        row = (ctypes.c_float * n).from_address(x.data_ptr())  # (x's own floats, read in place)
        best, top, nan = -1, 0.0, -1
        for i in ids:
            if not 0 <= i < n:
                raise IndexError(f"id {i} is out of range for logits of {n}")
            v = row[i]
            if v != v:
                nan = i if nan < 0 or i < nan else nan
            elif best < 0 or v > top or v == top and i < best:
                best, top = i, v
        return nan if nan >= 0 else best
    ids_np = np.asarray(ids, dtype=np.int64)
    # [n] (one torch call, not three: each costs 50-80 us right after a pass, the caches cold)
    values = x.numpy()[ids_np] if x.dtype == torch.float32 else x[torch.from_numpy(ids_np)].float().numpy()
    top = values.max()
    return int(ids_np[np.isnan(values) if np.isnan(top) else values == top].min())


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = every token
    min_p: float = 0.0  # 0 = off

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] logits -> the distribution decoding samples from (`logits_to_probs`)."""
        return logits_to_probs(logits, self)

    def confidence(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] logits -> a model's distribution as its confidence: the raw softmax when greedy (a
        one-hot would say nothing), else the sampling distribution."""
        return torch.softmax(logits.float(), -1) if self.greedy else self.probs(logits)

    def draw(self, probs: torch.Tensor, generator: torch.Generator | None) -> int:
        """One token from probs [V]: the argmax when greedy, else a sample."""
        return int(argmax(probs)) if self.greedy else sample(probs, generator)

    def next_token(self, logits: torch.Tensor, generator: torch.Generator | None, known: list[int] | None = None) -> int:
        """The token plain decoding picks from logits [V] (`known`: its argmax, [1], where the pass found it)."""
        return first_maxima(logits, known)[0] if self.greedy else sample(self.probs(logits), generator)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution decoding samples from: softmax(logits / T) restricted to the top_k tokens, then
    to the top-p nucleus, then to the tokens of at least min_p times the top probability (vLLM's order).

    logits: [..., V] -> probs [..., V] (float32, rows sum to 1). Greedy: one-hot at the argmax (none of
    the three changes it).
    """
    if params.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).to(torch.float32)
    scaled = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:  # ties with the k-th logit stay, as in vLLM
        kth = scaled.topk(params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.min_p > 0:  # (after temperature: the bar is relative to the sampled distribution's top)
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy_accept(draft: list[int] | torch.Tensor, target_logits: torch.Tensor,
                  known: list[int] | None = None) -> tuple[int, int]:
    """Greedy verification: keep drafts while they equal the verifier's argmax.

    draft: [k] token ids; target_logits: [k+1, V], row i scores the position of draft[i]
    (row k is the bonus position); known: [k+1] its rows' argmax where the pass found them.
    Returns (n_accepted, next_token).
    """
    # (compared as Python ints: a handful of small tensor ops cost more than the comparison, every round)
    target = first_maxima(target_logits, known)  # [k+1]
    draft = draft.tolist() if isinstance(draft, torch.Tensor) else draft
    n = next((i for i, (d, t) in enumerate(zip(draft, target)) if d != t), len(draft))
    return n, target[n]


def speculative_sampling(
    draft: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Leviathan et al. Algorithm 1: lossless rejection sampling of a draft block.

    draft: [k] token ids; q: [k, V] draft probabilities (None: a deterministic drafter, i.e. q is
    one-hot at each draft token, as for n-gram lookup); p: [k+1, V] target probabilities.
    Returns (n_accepted, next_token); next_token ~ p exactly, marginally, at every position.
    """
    k = draft.shape[0]
    idx = torch.arange(k)
    p_x = p[idx, draft]  # [k] p(x) of each draft token
    q_x = q[idx, draft] if q is not None else torch.ones(k)  # [k] q(x)
    r = torch.rand(k, generator=generator)  # [k]
    # q(x) <= p(x): always accept; q(x) > p(x): accept with probability p(x)/q(x)
    rejected = (r * q_x > p_x).nonzero()
    if not rejected.numel():
        return k, sample(p[k], generator)  # bonus token
    n = int(rejected[0])
    q_n = q[n] if q is not None else torch.nn.functional.one_hot(draft[n], p.shape[-1]).float()
    return n, _residual_sample(p[n], q_n, generator)


def _residual_sample(p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None) -> int:
    """The recovered token: a sample of p'(x) = norm(max(0, p(x) - q(x))). p, q: [V]."""
    residual = (p - q).clamp_min(0.0)
    total = residual.sum()
    if total <= 0:  # p == q up to rounding: the rejection had probability ~0; fall back to p
        residual, total = p, p.sum()
    return sample(residual / total, generator)


def accept(
    draft: list[int] | torch.Tensor,
    q: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    target_probs: torch.Tensor | None = None,
    known: list[int] | None = None,
) -> tuple[int, int]:
    """The one acceptance entry point of every loop: keep a prefix of `draft`, plus one recovered or
    bonus token. Greedy: `greedy_accept`; sampling: `speculative_sampling` (lossless).

    draft: [k] ids; q: [k, V] the drafts' proposal distribution (None: deterministic; unused when
    greedy); target_logits: [k+1, V]; target_probs: [k+1, V] a target other than the verifier's own
    distribution (speculative cascades' pi), replacing the one derived from target_logits; known:
    [k+1] target_logits' rows' argmax where the pass found them (`PassOutput.argmax`).
    Returns (n_accepted, next_token).
    """
    if params.greedy:
        if target_probs is not None:
            return greedy_accept(draft, target_probs)
        return greedy_accept(draft, target_logits, known)
    draft = torch.as_tensor(draft, dtype=torch.long)
    p = params.probs(target_logits) if target_probs is None else target_probs
    return speculative_sampling(draft, q, p, generator)


def settle(draft_token: int | None, q_row: torch.Tensor | None, p: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> int:
    """One position settled against target probabilities p [V] (VIA-SD's tier 2, the slim verifier's
    p): greedy takes p's argmax; sampling keeps the draft with probability min(1, p(x)/q(x)), else
    samples the residual, and samples p where there is no draft. Lossless for that position."""
    if params.greedy:
        return int(argmax(p))
    if draft_token is None:
        return sample(p, generator)
    q_x = float(q_row[draft_token]) if q_row is not None else 1.0
    if float(torch.rand(1, generator=generator)) * q_x <= float(p[draft_token]):
        return draft_token
    q_n = q_row if q_row is not None else torch.nn.functional.one_hot(torch.tensor(draft_token), p.shape[-1]).float()
    return _residual_sample(p, q_n, generator)


# ------------------------------------------------------------------ speculative cascades (baseline)

class DeferralRule(StrEnum):
    CHOW = "chow"
    DIFF = "diff"
    OPT = "opt"


DEFERRAL_RULES = tuple(DeferralRule)


def cascade_defer(q: torch.Tensor, p: torch.Tensor, rule: DeferralRule | str, alpha: float) -> torch.Tensor:
    """Speculative cascades (Narasimhan et al. 2024): defer to the small model at each position?

    q: [k, V] drafter distribution, p: [k, V] full model's. Returns [k] bool.
    Chow: max q >= 1 - alpha;  Diff: max q >= max p - alpha;  OPT: max q >= max p - alpha * TV(p, q).
    """
    q_max, p_max = q.max(-1).values, p.max(-1).values
    match DeferralRule(rule):
        case DeferralRule.CHOW:
            return q_max >= 1 - alpha
        case DeferralRule.DIFF:
            return q_max >= p_max - alpha
        case DeferralRule.OPT:
            return q_max >= p_max - alpha * 0.5 * (p - q).abs().sum(-1)


def cascade_target(q: torch.Tensor, p: torch.Tensor, defer: torch.Tensor) -> torch.Tensor:
    """pi = q where deferred to the small model, else p. q, p: [k, V]; defer: [k] -> [k, V]."""
    return torch.where(defer[:, None], q, p)


def cascade_target_probs(q: torch.Tensor | None, target_logits: torch.Tensor, params: SamplingParams,
                         rule: DeferralRule | str, alpha: float) -> torch.Tensor:
    """The cascade's target for a verification block: pi at the k draft positions, p at the bonus one.

    q: [k, V] drafter probabilities; target_logits: [k+1, V] -> pi [k+1, V]. The rule compares the
    models' own confidences (greedy: raw softmax; sampling: the processed p).
    """
    if q is None:
        raise ValueError("speculative cascades need a drafter with probabilities (a model or a self route)")
    k = q.shape[0]
    p = params.confidence(target_logits)  # [k+1, V]
    return torch.cat([cascade_target(q, p[:k], cascade_defer(q, p[:k], rule, alpha)), p[k:]])
