"""Per-decode statistics and the result record every strategy returns."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from viasd.decoding.tiers import Tier


class Source(StrEnum):
    """Who settled a committed token (the server's per-token provenance, `DecodeStats.sources`)."""

    GRAMMAR = "grammar"  # a draft the grammar alone determined, kept by the verifier
    DRAFT = "draft"  # a drafter's token kept (tiered VIA-SD's tier 1: without a verifier's check)
    SLIM = "slim"  # the slim verifier's own token (VIA-SD)
    FULL = "full"  # the full model's token: every token of `ar`, SD's recovered or bonus token


def drafted_sources(n: int, forced: int) -> list[Source]:
    """The sources of the first n kept tokens of a draft whose first `forced` came from the grammar."""
    return [Source.GRAMMAR if i < forced else Source.DRAFT for i in range(n)]


@dataclass(frozen=True)
class TokenLogprob:
    """The full model's log-probability of a committed token, and the `top` most likely tokens at its
    position (id, log-probability), most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """logits [n, V] (row i: the position of tokens[i]) -> each token's log-probability under
    log_softmax(logits) and the `top` most likely tokens there (those the logits rule out left out)."""
    x = logits.float()
    lse = torch.logsumexp(x, -1, keepdim=True)  # [n, 1] (no V-sized log_softmax: two reads of each row)
    chosen = (x[torch.arange(len(tokens)), torch.tensor(tokens)] - lse[:, 0]).tolist()  # [n]
    if top <= 0:
        return [TokenLogprob(lp) for lp in chosen]
    values, ids = x.topk(top, -1)  # [n, top]
    values = values - lse
    return [TokenLogprob(lp, tuple((i, v) for i, v in zip(row_ids, row_v) if v > float("-inf")))
            for lp, row_ids, row_v in zip(chosen, ids.tolist(), values.tolist())]


@dataclass
class DecodeStats:
    """Counters filled by a decoding loop through `observe_*`; `to_dict` derives the rates.

    Keys of `calls` are `decoding.session.CallKind` values: "full" (verifier, every layer), "slim"
    (verifier along the slim route), "draft" (drafter: a separate model or a drafting route of the
    verifier). Model-free drafters (n-gram lookup) make no calls.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    wall_s: float = 0.0
    first_token_s: float | None = None
    calls: Counter = field(default_factory=Counter)
    # decoding passes by (model, kind, rows, weight bytes read): what the time cost model prices with
    # each model's measured pass times (`report.cost_model`)
    passes: Counter = field(default_factory=Counter)
    # verifier work, hardware-independent: one full-model call counts 1.0 whatever its block size
    # (decoding is weight-bandwidth bound), a routed call counts its share of sub-layers
    verifier_layer_passes: float = 0.0
    # every call's weights read, in bytes (the verifier's passes along their routes, LM head included,
    # and a drafter model's own weights), over the bytes of one full verifier pass: the cost per token
    # in full-pass equivalents where decoding is bound by weight bandwidth (0: not counted, e.g. T5)
    bytes_read: int = 0
    full_pass_bytes: int = 0
    rounds: int = 0  # verification rounds by the deciding verifier (each commits >= 1 token)
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)  # [k_max] drafts seen at position i of a block
    accepted_at: list[int] = field(default_factory=list)  # [k_max] drafts accepted at position i
    tiers: Counter = field(default_factory=Counter)  # committed tokens by `Tier`
    sources: Counter = field(default_factory=Counter)  # committed tokens by `Source`
    unchecked: int = 0  # committed tokens the full model never checked (tiered mode)
    # proposed tokens the full verifier judged and kept: drafts in SD, the slim-verified block in
    # lossless VIA-SD, tier-3 drafts in tiered VIA-SD (the paper's rejection rate is this one's)
    full_checked: int = 0
    full_kept: int = 0
    # tiered mode, greedy: tokens settled without the full model that a later full pass computed
    # logits before anyway, and how many of them the full model would have chosen otherwise
    rechecked: int = 0
    disagreed: int = 0
    # tiered correction mode: tokens replaced by the full model's choice, and tokens dropped with them
    # (the corrected one and everything settled after it)
    corrected: int = 0
    discarded: int = 0
    # cross-vocabulary drafting through text: bytes the drafter drafted, those its converted drafts
    # kept (the rest was lost to the verifier's re-tokenization), and drafts whose junction with the
    # committed text no verifier tokenization respected
    converted_bytes: int = 0
    converted_kept: int = 0
    junction_splits: int = 0
    # lossless VIA-SD: the slim verifier's replacements of drafts it rejected that the full model
    # judged, and those it kept (the slim verifier's agreement with the full model where the drafter
    # was wrong: what a slim tier can rescue)
    rescues: int = 0
    rescues_kept: int = 0
    # constrained decoding: tokens the grammar alone determined and drafted, those the full verifier
    # kept, rows masked, and the host seconds the masks took
    grammar_drafted: int = 0
    grammar_accepted: int = 0
    grammar_masks: int = 0
    grammar_s: float = 0.0
    lookup_drafted: int = 0  # drafts prompt lookup found in front of a drafter model (`LookupDrafter`)
    lookup_accepted: int = 0
    # decode-only seconds (after the first token) inside model passes (`pass_seconds`: the request's
    # `Passes.seconds`); the rest of the decode-only time is host time: sampling, acceptance, drafts'
    # conversion, streaming
    decode_pass_s: float = 0.0
    # host seconds of the decode-only rounds that drafted, and their drafts (a round runs from one
    # verification round's `observe_round` to the next: the drafting, acceptance, conversion and
    # commit between its passes)
    drafting_host_s: float = 0.0
    drafting_drafted: int = 0
    pass_seconds: Callable[[], float] | None = field(default=None, repr=False, compare=False)
    _t0: float = field(default_factory=time.perf_counter, repr=False)
    _pass_mark: float | None = field(default=None, repr=False)
    _round_mark: tuple[float, float, int] | None = field(default=None, repr=False)  # (wall, pass seconds, drafted) at the last round

    def observe_call(self, name: str, n: int = 1, verifier_share: float = 0.0, bytes_read: int = 0,
                     rows: int = 0, model: str = "verifier") -> None:
        """`rows` > 0: a decoding pass of that many rows of `model` ("verifier" or "drafter"), which
        the time cost model counts (`passes`; prefill passes give none)."""
        self.calls[name] += n
        self.verifier_layer_passes += n * verifier_share
        self.bytes_read += n * bytes_read
        if rows:
            self.passes[(model, str(name), rows, bytes_read)] += n

    def observe_round(self, n_drafted: int, n_accepted: int, verification: bool = True) -> None:
        """A block of n_drafted drafter tokens of which the first n_accepted were kept;
        `verification`: the round was decided by the verifier that counts rounds (the full model, or
        in tiered mode whichever settled it)."""
        self.rounds += verification
        self.drafted += n_drafted
        if verification and self._pass_mark is not None and self.pass_seconds is not None:  # decode-only: after the first token
            now, passed = time.perf_counter(), self.pass_seconds()
            if self._round_mark is not None and self.drafted > self._round_mark[2]:
                self.drafting_host_s += max(0.0, now - self._round_mark[0] - (passed - self._round_mark[1]))
                self.drafting_drafted += self.drafted - self._round_mark[2]
            self._round_mark = (now, passed, self.drafted)
        self.accepted += n_accepted
        while len(self.drafted_at) < n_drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(n_drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < n_accepted

    def observe_full_check(self, n_checked: int, n_kept: int) -> None:
        """The full verifier judged n_checked proposed tokens and kept the first n_kept."""
        self.full_checked += n_checked
        self.full_kept += n_kept

    def observe_recheck(self, n_rechecked: int, n_disagreed: int) -> None:
        self.rechecked += n_rechecked
        self.disagreed += n_disagreed

    def observe_conversion(self, drafted_bytes: int, kept_bytes: int, junction: bool = False) -> None:
        self.converted_bytes += drafted_bytes
        self.converted_kept += kept_bytes
        self.junction_splits += junction

    def observe_rescue(self, kept: bool) -> None:
        self.rescues += 1
        self.rescues_kept += kept

    def observe_grammar(self, n_forced: int, n_kept: int) -> None:
        """n_forced grammar-forced drafts were judged by the full verifier and n_kept of them kept."""
        self.grammar_drafted += n_forced
        self.grammar_accepted += n_kept

    def observe_lookup(self, n_found: int, n_kept: int) -> None:
        """n_found drafts found by prompt lookup (no drafting pass) were judged and n_kept of them kept."""
        self.lookup_drafted += n_found
        self.lookup_accepted += n_kept

    @contextmanager
    def grammar_clock(self, rows: int) -> Iterator[None]:
        """Time `rows` grammar masks (host time)."""
        t0 = time.perf_counter()
        yield
        self.grammar_s += time.perf_counter() - t0
        self.grammar_masks += rows

    def observe_tiers(self, tiers: Iterable[int]) -> None:
        self.tiers.update(tiers)

    def observe_tokens(self, n: int) -> None:
        if self.first_token_s is None and n > 0:
            self.first_token_s = time.perf_counter() - self._t0
            self._pass_mark = self.pass_seconds() if self.pass_seconds is not None else None
        self.new_tokens += n

    def merge(self, other: DecodeStats) -> DecodeStats:
        """The statistics of two decodes in sequence (e.g. the turns of a conversation): counters
        and times add up, the first token is this decode's."""
        pad = lambda xs, n: xs + [0] * (n - len(xs))  # noqa: E731
        n = max(len(self.drafted_at), len(other.drafted_at))
        return DecodeStats(
            prompt_tokens=self.prompt_tokens + other.prompt_tokens, new_tokens=self.new_tokens + other.new_tokens,
            wall_s=self.wall_s + other.wall_s, first_token_s=self.first_token_s, calls=self.calls + other.calls,
            passes=self.passes + other.passes,
            verifier_layer_passes=self.verifier_layer_passes + other.verifier_layer_passes,
            bytes_read=self.bytes_read + other.bytes_read, full_pass_bytes=self.full_pass_bytes or other.full_pass_bytes,
            rounds=self.rounds + other.rounds, drafted=self.drafted + other.drafted, accepted=self.accepted + other.accepted,
            drafted_at=[a + b for a, b in zip(pad(self.drafted_at, n), pad(other.drafted_at, n))],
            accepted_at=[a + b for a, b in zip(pad(self.accepted_at, n), pad(other.accepted_at, n))],
            tiers=self.tiers + other.tiers, sources=self.sources + other.sources, unchecked=self.unchecked + other.unchecked,
            full_checked=self.full_checked + other.full_checked, full_kept=self.full_kept + other.full_kept,
            rechecked=self.rechecked + other.rechecked, disagreed=self.disagreed + other.disagreed,
            corrected=self.corrected + other.corrected, discarded=self.discarded + other.discarded,
            converted_bytes=self.converted_bytes + other.converted_bytes,
            converted_kept=self.converted_kept + other.converted_kept,
            junction_splits=self.junction_splits + other.junction_splits,
            rescues=self.rescues + other.rescues, rescues_kept=self.rescues_kept + other.rescues_kept,
            grammar_drafted=self.grammar_drafted + other.grammar_drafted,
            grammar_accepted=self.grammar_accepted + other.grammar_accepted,
            grammar_masks=self.grammar_masks + other.grammar_masks, grammar_s=self.grammar_s + other.grammar_s,
            lookup_drafted=self.lookup_drafted + other.lookup_drafted,
            lookup_accepted=self.lookup_accepted + other.lookup_accepted,
            decode_pass_s=self.decode_pass_s + other.decode_pass_s,
            drafting_host_s=self.drafting_host_s + other.drafting_host_s,
            drafting_drafted=self.drafting_drafted + other.drafting_drafted,
        )

    def finish(self) -> None:
        self.wall_s = time.perf_counter() - self._t0
        if self._pass_mark is not None and self.pass_seconds is not None:
            self.decode_pass_s = self.pass_seconds() - self._pass_mark

    @property
    def decode_tokens_per_s(self) -> float:
        if self.first_token_s is None or self.new_tokens < 2 or self.wall_s <= self.first_token_s:
            return 0.0
        return round((self.new_tokens - 1) / (self.wall_s - self.first_token_s), 3)

    def to_dict(self) -> dict:
        full = self.calls.get("full", 0)
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "wall_s": round(self.wall_s, 4),
            "first_token_s": None if self.first_token_s is None else round(self.first_token_s, 4),
            "tokens_per_s": round(self.new_tokens / self.wall_s, 3) if self.wall_s > 0 else 0.0,
            # decode-only: the tokens after the first over the time after it (the prompt's prefill and
            # first token excluded), as llama.cpp's tg figures count
            "decode_tokens_per_s": self.decode_tokens_per_s,
            # of the decode-only time: seconds in model passes, and the rest (host time)
            "decode_pass_s": round(self.decode_pass_s, 4),
            "decode_host_s": round(max(0.0, self.wall_s - self.first_token_s - self.decode_pass_s), 4)
            if self.first_token_s is not None else None,
            # of that, per drafted token: the host time of the rounds that drafted over their drafts
            "host_ms_per_drafted": round(1e3 * self.drafting_host_s / self.drafting_drafted, 4) if self.drafting_drafted else None,
            # tokens committed per verification round (accepted drafts + the recovered/bonus token),
            # as vLLM and Spec-Bench count it
            "mean_accepted_length": round(self.new_tokens / self.rounds, 4) if self.rounds else 0.0,
            "rejection_rate": round((self.drafted - self.accepted) / self.drafted, 4) if self.drafted else 0.0,
            # of the proposed tokens the full verifier judged, the share it rejected
            "full_rejection_rate": round((self.full_checked - self.full_kept) / self.full_checked, 4) if self.full_checked else 0.0,
            "calls": dict(self.calls),
            "passes": [[*key, n] for key, n in sorted(self.passes.items())],  # [model, kind, rows, bytes, count]
            "tokens_per_full_call": round(self.new_tokens / full, 4) if full else 0.0,
            "verifier_layer_passes_per_token": round(self.verifier_layer_passes / self.new_tokens, 4) if self.new_tokens else 0.0,
            "bytes_read": self.bytes_read,
            "full_pass_bytes": self.full_pass_bytes,
            "full_pass_equivalents_per_token": (round(self.bytes_read / self.full_pass_bytes / self.new_tokens, 4)
                                                if self.full_pass_bytes and self.new_tokens else 0.0),
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "full_checked": self.full_checked,
            "full_kept": self.full_kept,
            "tiers": {tier.name.lower(): self.tiers.get(tier, 0) for tier in Tier},
            # committed tokens by who settled them (grammar, draft, slim, full): the server's provenance
            "sources": {source.value: self.sources.get(source, 0) for source in Source},
            "settled_without_full": round(self.unchecked / self.new_tokens, 4) if self.new_tokens else 0.0,
            "rechecked": self.rechecked,
            # of those, the share where the full model's greedy choice differs (tiered mode's error rate
            # where it can be seen; the full model never sees tokens settled after its last pass)
            "recheck_disagreement": round(self.disagreed / self.rechecked, 4) if self.rechecked else 0.0,
            "corrected": self.corrected,
            "discarded": self.discarded,
            # cross-vocabulary drafting through text: the share of drafted bytes lost to re-tokenization
            "retokenization_loss": round(1 - self.converted_kept / self.converted_bytes, 4) if self.converted_bytes else 0.0,
            "junction_splits": self.junction_splits,
            "slim_rescues": self.rescues,
            "slim_rescue_agreement": round(self.rescues_kept / self.rescues, 4) if self.rescues else None,
            # constrained decoding: tokens the grammar drafted, those kept, and the masks' host time
            "grammar_drafted": self.grammar_drafted,
            "grammar_accepted": self.grammar_accepted,
            "grammar_mask_us": round(1e6 * self.grammar_s / self.grammar_masks, 1) if self.grammar_masks else None,
            # sd behind prompt lookup: drafts lookup found (free: no drafting pass), and those kept
            "lookup_drafted": self.lookup_drafted,
            "lookup_accepted": self.lookup_accepted,
            "acceptance_per_position": [round(a / d, 4) if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)],
        }


@dataclass
class DecodeResult:
    """What every strategy returns: the CLI and the benchmark store and print any of them alike (what
    they need to know about a strategy itself they read from `decoding.registry`)."""

    text: str
    token_ids: list[int]  # new tokens only
    stats: DecodeStats
    config: dict = field(default_factory=dict)  # the request's settings, echoed for records
    sources: list[Source] = field(default_factory=list)  # [len(token_ids)] who settled each token
    logprobs: list[TokenLogprob] | None = None  # [len(token_ids)] with the `logprobs` setting
    # "length": max_new_tokens cut the answer (a constrained one: where its grammar allowed more than the
    # end); "stop": an end token, a complete grammar, or the caller ended it
    finish_reason: str = "stop"

    def to_dict(self) -> dict:
        out = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
               "stats": self.stats.to_dict(), "config": self.config}
        if self.logprobs is not None:
            out["logprobs"] = [{"logprob": lp.logprob, "top": [list(t) for t in lp.top]} for lp in self.logprobs]
        return out
