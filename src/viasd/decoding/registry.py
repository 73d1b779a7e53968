"""The strategy table: every decoding strategy, its drafter, its loop, and whether it is lossless.

The API, the CLI, the benchmark and the report read this table; nothing else compares strategy
names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar
from dataclasses import dataclass
from enum import StrEnum

from viasd.decoding.acceptance import DeferralRule
from viasd.decoding.drafters import Drafter
from viasd.decoding.multitier import viasd_lossless_decode, viasd_tiered_decode
from viasd.decoding.strategies import autoregressive_decode, speculative_decode
from viasd.decoding.tiers import TierThresholds
from viasd.decoding.session import DecodeRequest
from viasd.errors import UsageError
from viasd.models.decoder import Decoder
from viasd.models.kvcache import LayerMask
from viasd.models.layers import ReducedHead


class DraftKind(StrEnum):
    AUTO = "auto"  # chosen from what the request gives (a drafter model, else the strategy's default)
    MODEL = "model"  # a separate model with the verifier's vocabulary
    PLD = "pld"  # n-gram prompt lookup, no model
    SELF = "self"  # a route of the verifier's own layers


class Mode(StrEnum):
    LOSSLESS = "lossless"
    TIERED = "tiered"


@dataclass(frozen=True, kw_only=True)
class LoopArgs:
    """What a loop needs beyond the request."""

    k: int
    mode: Mode = Mode.LOSSLESS
    full_block: int = 8
    slim: LayerMask | None = None
    thresholds: TierThresholds | None = None
    cascade: tuple[DeferralRule, float] | None = None  # (rule, alpha), used by the cascade loop
    # loops with a drafter (not cascades by default): draft lengths from measured pass costs (decoding/draft_length.py)
    adaptive: bool = False
    resume: bool = True  # viasd: full passes resume where the slim route's whole lower layers end
    slim_head: ReducedHead | None = None  # viasd: the slim verifier's reduced LM head (None: the full one)
    correct: bool = False  # tiered viasd, greedy: full passes correct the tokens settled without them (multitier._recheck)


Loop = Callable[[Decoder, Drafter | None, DecodeRequest, LoopArgs], list[int]]
T = TypeVar("T")


def _given(value: T | None, what: str) -> T:
    """`value`, which the strategy's loop needs (its drafter, route or thresholds, set by `generate`)."""
    if value is None:
        raise ValueError(f"this strategy's loop needs {what}")
    return value


def _viasd(decoder: Decoder, drafter: Drafter | None, req: DecodeRequest, args: LoopArgs) -> list[int]:
    if args.mode is Mode.LOSSLESS:
        return viasd_lossless_decode(decoder, _given(drafter, "a drafter"), _given(args.slim, "a slim route"), req, args.k,
                                     full_block=args.full_block, resume=args.resume, head=args.slim_head, adaptive=args.adaptive)
    return viasd_tiered_decode(decoder, _given(drafter, "a drafter"), _given(args.slim, "a slim route"), req, args.k,
                               _given(args.thresholds, "tier thresholds"), resume=args.resume, head=args.slim_head,
                               adaptive=args.adaptive, correct=args.correct)


@dataclass(frozen=True)
class Strategy:
    name: str
    help: str
    loop: Loop
    drafter: DraftKind | None  # a fixed drafter kind; AUTO: --draft chooses; None: no drafter
    default_draft: DraftKind | None = None  # AUTO without a drafter model
    lossless: bool = True  # for every mode (viasd: in lossless mode only, see `is_lossless`)
    multitier: bool = False  # a slim verifier between drafter and full verifier; lossless / tiered modes
    full_checks_every_draft: bool = True  # the full verifier judges each draft (SD-family loops)
    needs_draft_probs: bool = False  # its rule reads the drafter's distribution (n-gram lookup has none)

    def draft_kind(self, requested: DraftKind | str, has_model: bool) -> DraftKind | None:
        """The drafter this strategy uses, given --draft and whether a drafter model was given."""
        requested = DraftKind(requested)
        if self.drafter is None:
            return None
        if self.drafter is not DraftKind.AUTO:
            if requested not in (DraftKind.AUTO, self.drafter):
                raise UsageError(f"strategy {self.name!r} drafts with {self.drafter.value!r}, not {requested.value!r}")
            return self.drafter
        kind = requested if requested is not DraftKind.AUTO else DraftKind.MODEL if has_model else self.default_draft
        if kind is DraftKind.PLD and self.needs_draft_probs:
            raise UsageError(f"strategy {self.name!r} reads the drafter's probabilities, which n-gram lookup (pld) does not "
                             "have: draft with self (a route) or model (--drafter)")
        return kind

    def is_lossless(self, mode: Mode | str = Mode.LOSSLESS) -> bool:
        return self.lossless and (not self.multitier or Mode(mode) is Mode.LOSSLESS)

    def label(self, mode: Mode | str) -> str:
        return f"{self.name}/{Mode(mode).value}" if self.multitier else self.name


def _ar(decoder: Decoder, drafter: Drafter | None, req: DecodeRequest, args: LoopArgs) -> list[int]:
    # under a grammar, its forced tokens are drafted (`drafters.GrammarDrafter` with no drafter of its own)
    return autoregressive_decode(decoder, req) if drafter is None else speculative_decode(decoder, drafter, req, 1)


def _sd(decoder: Decoder, drafter: Drafter | None, req: DecodeRequest, args: LoopArgs) -> list[int]:
    return speculative_decode(decoder, _given(drafter, "a drafter"), req, args.k, adaptive=args.adaptive)


def _cascade(decoder: Decoder, drafter: Drafter | None, req: DecodeRequest, args: LoopArgs) -> list[int]:
    return speculative_decode(decoder, _given(drafter, "a drafter"), req, args.k, args.cascade, adaptive=args.adaptive)


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("ar", "autoregressive decoding (the baseline)", _ar, None),
    Strategy("sd", "speculative decoding with a separate drafter model (--drafter)", _sd, DraftKind.MODEL),
    Strategy("pld", "speculative decoding with prompt-lookup n-gram drafts (no drafter model)", _sd, DraftKind.PLD),
    Strategy("self-sd", "speculative decoding drafting with a route of the verifier's own layers", _sd, DraftKind.SELF),
    Strategy("cascade", "speculative cascades (Narasimhan et al. 2024): Chow / Diff / OPT deferral, then SD (lossy)",
             _cascade, DraftKind.AUTO, default_draft=DraftKind.SELF, lossless=False, needs_draft_probs=True),
    Strategy("viasd", "VIA-SD: drafter -> slim verifier (a route) -> full verifier; --mode lossless or tiered",
             _viasd, DraftKind.AUTO, default_draft=DraftKind.PLD, multitier=True, full_checks_every_draft=False),
)}
BASELINE = "ar"  # plain decoding: what every speed-up is measured against
DEFAULT_STRATEGY = "pld"


def strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise UsageError(f"unknown strategy {name!r}: choose from {', '.join(STRATEGIES)}") from None
