"""VIA-SD's tier rules: how each position of a round is settled in tiered mode, as pure functions.

| tier | rule (per draft position, in order) | who settles it |
|---|---|---|
| `Tier.ACCEPT` (1) | slim p(draft) >= `accept`, drafter p(draft) >= `accept_draft`, TV(drafter, slim) <= `accept_tv` | nobody: draft kept |
| `Tier.SLIM` (2) | slim top prob >= `slim` and slim entropy <= `slim_entropy` | the slim verifier keeps or replaces the draft |
| `Tier.FULL` (3) | everything else | the full verifier |

Before any of these, a round whose drafts all have drafter probability >= `draft_confident` (a
drafter with a distribution: a model or a drafting route) is tier 1 whole, with no slim pass at all:
the paper decides tiers from the draft distribution, and such a round costs only its drafting.

The bonus position (after the last draft) has no draft, so it can only be `SLIM` (by the same slim
rule) or `FULL`. A draft the slim verifier cannot judge (outside its reduced head's vocabulary) is `FULL`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import torch

from viasd.errors import UsageError


class Tier(IntEnum):
    ACCEPT = 1
    SLIM = 2
    FULL = 3


@dataclass(frozen=True)
class TierThresholds:
    """Tiered mode's thresholds (see the module table). Thresholds above 1 switch a tier off:
    `accept=2, slim=2` is plain SD; `accept=2, slim=0` lets the slim verifier settle everything."""

    accept: float = 0.9
    accept_draft: float = 0.5
    accept_tv: float = 1.0
    slim: float = 0.6
    slim_entropy: float = float("inf")
    draft_confident: float = 2.0  # a round whose drafts all have drafter prob >= this skips the slim pass (> 1: off)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("accept", "accept_draft", "accept_tv", "slim", "slim_entropy", "draft_confident")}


def confident_round(draft: list[int], q: torch.Tensor | None, t: TierThresholds) -> bool:
    """Whether every draft of a round is tier 1 by the drafter's own probability alone.
    draft: k ids; q: [k, V] drafter probabilities (None: a deterministic drafter, never)."""
    if q is None or not draft or t.draft_confident > 1.0:
        return False
    return bool((q[torch.arange(len(draft)), torch.tensor(draft, dtype=torch.long)] >= t.draft_confident).all())



def thresholds_beside(route_file: Path, correct: bool = False) -> Path:
    """Where a slim route's calibrated thresholds lie: ROUTE.thresholds.json, chosen for speed under a
    quality constraint, or (`correct`) ROUTE.correct.thresholds.json, chosen for speed alone, since
    correction mode's output is the full model's whatever the thresholds."""
    return route_file.with_suffix(".correct.thresholds.json" if correct else ".thresholds.json")


def load_thresholds(path: Path | str) -> dict[str, float]:
    """The thresholds a JSON file sets (a bare object or `{"thresholds": {...}}`), checked by shape,
    type and range."""
    from viasd.validation import check_thresholds, read_json, require_dict

    data = require_dict(read_json(path, "thresholds"), path, "thresholds")
    data = require_dict(data.get("thresholds", data), path, "thresholds")
    known = TierThresholds().to_dict()
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise UsageError(f"{path}: unknown threshold(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return check_thresholds(data, path)


@dataclass(frozen=True)
class ConfidenceSignals:
    """Per-position confidence signals of a round, each [k]."""

    draft_prob: torch.Tensor  # q(x): the drafter's probability of its own token (1 for deterministic drafters)
    slim_prob: torch.Tensor  # the slim verifier's probability of the draft
    slim_top: torch.Tensor  # the slim verifier's top probability
    slim_margin: torch.Tensor  # its top-1 minus top-2 probability
    slim_entropy: torch.Tensor  # its entropy (nats)
    tv: torch.Tensor  # total variation between drafter and slim distributions


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] entropy in nats."""
    return -(probs * probs.clamp_min(1e-12).log()).sum(-1)


def confidence_signals(draft: torch.Tensor, q: torch.Tensor | None, slim: torch.Tensor) -> ConfidenceSignals:
    """draft: [k]; q: [k, V] drafter probabilities (None: deterministic drafter, q(x) = 1);
    slim: [k, V] slim-verifier probabilities at the draft positions."""
    k = draft.shape[0]
    idx = torch.arange(k)
    top2 = slim.topk(2, dim=-1).values if slim.shape[-1] > 1 else torch.cat([slim, torch.zeros_like(slim)], -1)
    q_full = q if q is not None else torch.nn.functional.one_hot(draft, slim.shape[-1]).float()
    return ConfidenceSignals(
        draft_prob=q_full[idx, draft], slim_prob=slim[idx, draft], slim_top=top2[:, 0],
        slim_margin=top2[:, 0] - top2[:, 1], slim_entropy=entropy(slim), tv=0.5 * (q_full - slim).abs().sum(-1),
    )


def assign_tiers(signals: ConfidenceSignals, t: TierThresholds) -> torch.Tensor:
    """[k] tier of each draft position (1 accept, 2 slim, 3 full)."""
    tier1 = (signals.slim_prob >= t.accept) & (signals.draft_prob >= t.accept_draft) & (signals.tv <= t.accept_tv)
    tier2 = (signals.slim_top >= t.slim) & (signals.slim_entropy <= t.slim_entropy)
    return torch.where(tier1, int(Tier.ACCEPT), torch.where(tier2, int(Tier.SLIM), int(Tier.FULL)))


def round_tiers(draft: list[int], q: torch.Tensor | None, slim: torch.Tensor, t: TierThresholds,
                judged: list[bool] | None = None) -> list[Tier]:
    """The tier of every position of a round: k drafts, then the bonus position.

    draft: k ids; q: [k, V] or None; slim: [k+1, V] slim-verifier probabilities; judged: [k] whether
    the slim verifier's head scores each draft (None: all; those it does not go to the full model).
    """
    k = len(draft)
    tiers = [Tier(x) for x in assign_tiers(confidence_signals(torch.tensor(draft, dtype=torch.long), q, slim[:k]), t).tolist()] if k else []
    if judged is not None:
        tiers = [tier if ok else Tier.FULL for tier, ok in zip(tiers, judged)]
    bonus = slim[k]
    bonus_slim = float(bonus.max()) >= t.slim and float(entropy(bonus)) <= t.slim_entropy
    return tiers + [Tier.SLIM if bonus_slim else Tier.FULL]
