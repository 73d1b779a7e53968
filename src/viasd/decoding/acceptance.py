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

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution decoding samples from: softmax(logits / T), restricted to the top-p nucleus.

    logits: [..., V] -> probs [..., V] (float32, rows sum to 1). Greedy: one-hot at the argmax.
    """
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy_accept(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy verification: keep drafts while they equal the verifier's argmax.

    draft: [k] token ids; target_logits: [k+1, V], row i scores the position of draft[i]
    (row k is the bonus position). Returns (n_accepted, next_token).
    """
    k = draft.shape[0]
    target = target_logits.argmax(-1)  # [k+1]
    mismatch = (draft != target[:k]).nonzero()
    n = int(mismatch[0]) if mismatch.numel() else k
    return n, int(target[n])


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
    residual = (p[n] - q_n).clamp_min(0.0)  # p'(x) = norm(max(0, p(x) - q(x)))
    total = residual.sum()
    if total <= 0:  # p == q up to rounding: the rejection had probability ~0; fall back to p
        residual, total = p[n], p[n].sum()
    return n, sample(residual / total, generator)


# ------------------------------------------------------------------------ VIA-SD tier assignment


@dataclass(frozen=True)
class TierThresholds:
    """Tiered mode's rules (VIA-SD), per draft position, in order:

    tier 1 (accept): slim prob of the draft >= `accept`, drafter prob of its token >= `accept_draft`
        and TV(drafter, slim) <= `accept_tv`: kept with no further check;
    tier 2 (slim): slim top prob >= `slim` and slim entropy <= `slim_entropy`: the slim verifier
        settles the token (keeps the draft if it is the slim's choice, else replaces it);
    tier 3 (full): everything else goes to the full verifier.
    Thresholds above 1 switch a tier off: `accept=2, slim=2` is plain SD; `accept=2, slim=0` lets
    the slim verifier settle everything.
    """

    accept: float = 0.9
    accept_draft: float = 0.5
    accept_tv: float = 1.0
    slim: float = 0.6
    slim_entropy: float = float("inf")

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("accept", "accept_draft", "accept_tv", "slim", "slim_entropy")}


def confidence_signals(draft: torch.Tensor, q: torch.Tensor | None, slim: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-position confidence signals.

    draft: [k]; q: [k, V] drafter probabilities (None: deterministic drafter, q(x) = 1);
    slim: [k, V] slim-verifier probabilities at the draft positions. Returns [k] tensors.
    """
    k = draft.shape[0]
    idx = torch.arange(k)
    top2 = slim.topk(2, dim=-1).values if slim.shape[-1] > 1 else torch.cat([slim, torch.zeros_like(slim)], -1)
    q_full = q if q is not None else torch.nn.functional.one_hot(draft, slim.shape[-1]).float()
    return {
        "draft_prob": q_full[idx, draft],
        "slim_prob": slim[idx, draft],
        "slim_top": top2[:, 0],
        "slim_margin": top2[:, 0] - top2[:, 1],
        "slim_entropy": -(slim * slim.clamp_min(1e-12).log()).sum(-1),
        "tv": 0.5 * (q_full - slim).abs().sum(-1),
    }


def assign_tiers(signals: dict[str, torch.Tensor], t: TierThresholds) -> torch.Tensor:
    """[k] tier of each draft position (1 accept, 2 slim, 3 full) from `confidence_signals`."""
    tier1 = (signals["slim_prob"] >= t.accept) & (signals["draft_prob"] >= t.accept_draft) & (signals["tv"] <= t.accept_tv)
    tier2 = (signals["slim_top"] >= t.slim) & (signals["slim_entropy"] <= t.slim_entropy)
    return torch.where(tier1, 1, torch.where(tier2, 2, 3))


# ------------------------------------------------------------------ speculative cascades (baseline)

DEFERRAL_RULES = ("chow", "diff", "opt")


def cascade_defer(q: torch.Tensor, p: torch.Tensor, rule: str, alpha: float) -> torch.Tensor:
    """Speculative cascades (Narasimhan et al. 2024): defer to the small model at each position?

    q: [k, V] drafter distribution, p: [k, V] full model's. Returns [k] bool.
    Chow: max q >= 1 - alpha;  Diff: max q >= max p - alpha;  OPT: max q >= max p - alpha * TV(p, q).
    """
    q_max, p_max = q.max(-1).values, p.max(-1).values
    if rule == "chow":
        return q_max >= 1 - alpha
    if rule == "diff":
        return q_max >= p_max - alpha
    if rule == "opt":
        return q_max >= p_max - alpha * 0.5 * (p - q).abs().sum(-1)
    raise ValueError(f"unknown deferral rule {rule!r}: {', '.join(DEFERRAL_RULES)}")


def cascade_target(q: torch.Tensor, p: torch.Tensor, defer: torch.Tensor) -> torch.Tensor:
    """pi = q where deferred to the small model, else p. q, p: [k, V]; defer: [k] -> [k, V]."""
    return torch.where(defer[:, None], q, p)
