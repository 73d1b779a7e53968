"""Samplers of the verifier's distribution (top_k, min_p, presence / frequency / repetition penalties,
logit_bias): every lossless strategy still equals `ar` token for token under greedy decoding, sampled
tokens follow the processed distribution, and bad values are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from viasd import generate
from viasd.decoding.acceptance import SamplingParams, logits_to_probs
from viasd.decoding.drafters import ModelDrafter, NgramDrafter, SelfDrafter
from viasd.decoding.multitier import viasd_lossless_decode, viasd_tiered_decode
from viasd.decoding.processors import LogitProcessors, ProcessorState
from viasd.decoding.strategies import autoregressive_decode, speculative_decode
from viasd.decoding.tiers import TierThresholds
from viasd.decoding.session import DecodeRequest
from viasd.errors import UsageError
from viasd.models.kvcache import LayerMask

from support import GREEDY, NO_EOS

SLIM, DRAFT = [0, 1, 3], [0, 3]  # tiny model (4 layers): slim route, self-drafting route
EOS_OFF = {61: -100.0, 62: -100.0, 63: -100.0}  # the tiny vocabulary's <eos>, <unk>, <pad> never chosen
PENALISED = LogitProcessors(logit_bias={3: 2.0, 9: -100.0, **EOS_OFF}, presence_penalty=0.7, frequency_penalty=0.4,
                            repetition_penalty=1.3)


def reference(logits: torch.Tensor, prompt: list[int], generated: list[int], p: LogitProcessors) -> torch.Tensor:
    """One position's processed logits [V], written out token by token (the definition the fast path must meet)."""
    x = logits.float().clone()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(generated):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(generated):
        x[t] -= p.frequency_penalty * generated.count(t)
        x[t] -= p.presence_penalty
    return x


def test_rows_of_one_pass_see_the_tokens_before_each():
    """The fast path on a pass of several rows (drafts ahead; with n = 6, 7 pending rows before the
    committed end, as tiered mode's full passes have) equals the per-position definition, and a
    retraction takes the counts back."""
    p = LogitProcessors(logit_bias={5: 3.0}, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.7)
    prompt, out, ahead = [1, 2, 3], [4, 4, 5, 2], [6, 4]
    state = ProcessorState(p, prompt)
    state.commit(out[:1])
    state.commit(out[1:])
    logits = torch.randn(7, 64, generator=torch.Generator().manual_seed(0)) * 3
    seq = out + ahead  # the generated tokens of committed + ahead
    for n in (1, 3, 5, 6, 7):  # rows of the last n positions
        rows = state.process(logits[:n], out, ahead)
        for i in range(n):
            expected = reference(logits[i], prompt, seq[: len(seq) - n + 1 + i], p)
            assert torch.allclose(rows[i], expected, atol=1e-6), (n, i)
    state.retract(out[-2:])
    fresh = ProcessorState(p, prompt)
    fresh.commit(out[:2])
    assert torch.equal(state.process(logits[:3], out[:2], [7, 7]), fresh.process(logits[:3], out[:2], [7, 7]))


def test_neutral_values_leave_the_default_path_alone(tiny):
    assert not LogitProcessors().active and not LogitProcessors(logit_bias={}).active
    req = DecodeRequest(prompt=[1, 2, 3], max_new_tokens=4, params=GREEDY, eos=NO_EOS, processors=LogitProcessors())
    plain = DecodeRequest(prompt=[1, 2, 3], max_new_tokens=4, params=GREEDY)
    assert autoregressive_decode(tiny.decoder, req) == autoregressive_decode(tiny.decoder, plain)


def test_penalised_lossless_strategies_equal_penalised_ar(tiny, tiny_drafter):
    """Greedy, with penalties and biases: sd, pld, self-sd, lossless VIA-SD and corrected tiered VIA-SD
    (its full passes take tokens back: their counts too) equal ar token for token; and the output differs
    from the unpenalised one, so the penalties did bind."""
    n_layers, corrected = tiny.config.n_layers, 0
    slim = LayerMask.from_layers(n_layers, SLIM)
    for prompt in ([5, 6, 7, 8, 5, 6, 7], [11, 3, 11, 3, 20]):
        req = lambda: DecodeRequest(prompt=prompt, max_new_tokens=24, params=GREEDY, eos=NO_EOS, processors=PENALISED)  # noqa: E731
        expected = autoregressive_decode(tiny.decoder, req())
        assert expected != autoregressive_decode(tiny.decoder, DecodeRequest(prompt=prompt, max_new_tokens=24, params=GREEDY, eos=NO_EOS))
        assert 9 not in expected
        self_drafter = lambda: SelfDrafter(tiny.decoder, LayerMask.from_layers(n_layers, DRAFT), GREEDY, None, None)  # noqa: E731
        runs = {
            "sd": lambda r: speculative_decode(tiny.decoder, ModelDrafter(tiny_drafter.decoder, GREEDY, None, None), r, 3),
            "sd same-model": lambda r: speculative_decode(tiny.decoder, ModelDrafter(tiny.decoder, GREEDY, None, None), r, 4),
            "pld": lambda r: speculative_decode(tiny.decoder, NgramDrafter(), r, 4),
            "self-sd": lambda r: speculative_decode(tiny.decoder, self_drafter(), r, 3),
            "viasd lossless": lambda r: viasd_lossless_decode(tiny.decoder, self_drafter(), slim, r, 3, 2),
            "viasd tiered, corrected": lambda r: viasd_tiered_decode(tiny.decoder, self_drafter(), slim, r, 4,
                                                                   TierThresholds(accept=2.0, slim=0.0), correct=True),
        }
        for name, run in runs.items():
            r = req()
            assert run(r) == expected, name
            corrected += r.stats.corrected if name.startswith("viasd tiered") else 0
    assert corrected > 0  # the slim verifier settled tokens the full model took back


def test_every_strategy_through_generate_equals_ar_with_samplers(tiny, tiny_drafter):
    """The settings' path (generate's keywords): the greedy output is ar's for every lossless strategy;
    top_k, top_p and min_p leave greedy decoding alone."""
    settings = dict(logit_bias={**EOS_OFF, "3": 2}, presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3,
                    max_new_tokens=24, progress=False)
    prompt = [5, 6, 7, 8, 5, 6, 7]
    expected = generate(prompt, tiny, strategy="ar", **settings)
    assert expected.config["repetition_penalty"] == 1.3
    for name, kw in {"sd": dict(strategy="sd", k=3), "pld": dict(strategy="pld"),
                     "self-sd": dict(strategy="self-sd", draft_layers=(0, 2)),
                     "viasd lossless": dict(strategy="viasd", slim_layers=(0, 1, 3)),
                     "viasd tiered, corrected": dict(strategy="viasd", mode="tiered", correct=True, slim_layers=(0, 1, 3)),
                     "ar, truncated sampler": dict(strategy="ar", top_k=2, top_p=0.5, min_p=0.3)}.items():
        r = generate(prompt, tiny, drafter=tiny_drafter if name == "sd" else None, **kw, **settings)
        assert r.token_ids == expected.token_ids, name


def test_logit_bias_removes_and_forces_tokens(tiny):
    prompt = [5, 6, 7, 8]
    free = generate(prompt, tiny, strategy="ar", max_new_tokens=8, progress=False).token_ids
    banned = generate(prompt, tiny, strategy="pld", max_new_tokens=8, logit_bias={free[0]: -100}, progress=False).token_ids
    assert banned[0] != free[0] and free[0] not in banned
    for temperature in (0.0, 1.0):
        forced = generate(prompt, tiny, strategy="pld", max_new_tokens=6, logit_bias={"17": 100}, temperature=temperature,
                          progress=False).token_ids
        assert forced == [17] * 6, temperature


@pytest.mark.parametrize("bad, message", [
    (dict(top_k=-1), "top_k must be >= 0"), (dict(min_p=1.5), "min_p must be <= 1.0"),
    (dict(presence_penalty=2.5), "presence_penalty must be <= 2.0"), (dict(frequency_penalty=-3), "frequency_penalty must be >= -2.0"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0.0"), (dict(logit_bias={5: 101}), r"logit_bias\[5\] must be <= 100.0"),
    (dict(logit_bias={"x": 1}), "logit_bias keys must be token ids"), (dict(logit_bias=[1, 2]), "logit_bias must map token ids"),
    (dict(logit_bias={64: 1}), r"logit_bias names token id 64, outside the vocabulary: ids must be in \[0, 64\)"),
])
def test_bad_sampler_values_are_refused_naming_the_setting(tiny, bad, message):
    with pytest.raises(UsageError, match=message):
        generate([1, 2, 3], tiny, max_new_tokens=2, progress=False, **bad)


# ------------------------------------------------------------------------------ sampling


def processed_marginals(model, prompt: list[int], params: SamplingParams, p: LogitProcessors, n: int) -> list[torch.Tensor]:
    """P(i-th new token) for i = 1..n under the processed verifier distribution, by enumerating every
    continuation (each position processed by `reference`)."""
    marginals: list = [0] * n

    def walk(generated: list[int], weight: float, depth: int) -> None:
        ids = prompt + generated
        logits = model.decoder.forward(torch.tensor(ids), 0, model.decoder.new_cache(len(ids)), last_only=True)[0]
        probs = logits_to_probs(reference(logits, prompt, generated, p), params)
        marginals[depth] = marginals[depth] + weight * probs
        if depth + 1 < n:
            for t in torch.nonzero(probs > 0).flatten().tolist():
                walk(generated + [t], weight * float(probs[t]), depth + 1)

    walk([], 1.0, 0)
    return marginals


# two runs, each with several samplers: every one of them moves the exact marginals by more than 0.12
# (checked below by enumeration), far beyond the bound; one run per sampler would cost 2.5 times as much
SAMPLERS = {  # name -> (sampling params, processors)
    "top_k, min_p, logit_bias": (SamplingParams(1.0, top_k=3, min_p=0.3), LogitProcessors(logit_bias={0: 1.0, 3: -100.0, 5: 2.0})),
    # (a repetition penalty below 1 favours repeats, and so counts of 2 that the frequency penalty reads)
    "presence, frequency, repetition": (SamplingParams(1.0), LogitProcessors(presence_penalty=2.0, frequency_penalty=-1.0,
                                                                              repetition_penalty=0.5)),
}
NEUTRAL = {"top_k": 0, "min_p": 0.0, "logit_bias": None, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def without(params: SamplingParams, procs: LogitProcessors, name: str) -> tuple[SamplingParams, LogitProcessors]:
    """The same samplers less `name` (set to its neutral value)."""
    if hasattr(params, name):
        return dataclasses.replace(params, **{name: NEUTRAL[name]}), procs
    return params, dataclasses.replace(procs, **{name: NEUTRAL[name]})


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_sampled_speculative_decoding_follows_the_processed_distribution(small_vocab_pair, name):
    """N = 1000 sampled sd decodes of 3 tokens (the first from the prefill, two from a verification of
    k = 2 drafts of a drafter that knows nothing of the samplers); each position's empirical distribution
    within TV 0.06 of the exact marginal of the processed distribution (noise alone: ~0.025 with 8
    tokens, 0.05 seen at worst), which each sampler left out moves by more than 0.12 at some position."""
    verifier, drafter_model = small_vocab_pair
    params, procs = SAMPLERS[name]
    prompt = [4, 0, 4]
    marginals = processed_marginals(verifier, prompt, params, procs, 3)
    for sampler in (n for n in NEUTRAL if getattr(params if hasattr(params, n) else procs, n) != NEUTRAL[n]):
        other = processed_marginals(verifier, prompt, *without(params, procs, sampler), 3)
        assert max(0.5 * float((a - b).abs().sum()) for a, b in zip(marginals, other)) > 0.12, sampler
    g = torch.Generator().manual_seed(7)
    n = 1000
    counts = torch.zeros(3, marginals[0].shape[0])
    drafted = accepted = 0
    for _ in range(n):
        drafter = ModelDrafter(drafter_model.decoder, SamplingParams(1.0), g, None)
        req = DecodeRequest(prompt=prompt, max_new_tokens=3, params=params, eos=NO_EOS, generator=g,
                            processors=procs if procs.active else None)
        for i, t in enumerate(speculative_decode(verifier.decoder, drafter, req, k=2)):
            counts[i, t] += 1
        drafted, accepted = drafted + req.stats.drafted, accepted + req.stats.accepted
    assert 0 < accepted < drafted  # both the accept and the residual paths were exercised
    for i, p in enumerate(marginals):
        assert 0.5 * (counts[i] / n - p).abs().sum() < 0.06, i
