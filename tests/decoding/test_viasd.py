"""VIA-SD: lossless mode equals `ar`; tiered mode equals a cache-free reference of the same rules;
the threshold limits reproduce `sd` and the routed model; tier counts add up; sampling is lossless.
Also the speculative-cascades baseline."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from viasd import generate
from viasd.decoding.acceptance import SamplingParams, cascade_defer, cascade_target, greedy_accept
from viasd.decoding.draft_length import DraftLength
from viasd.decoding.drafters import NO_DRAFT, ModelDrafter, NgramDrafter, SelfDrafter, ngram_lookup
from viasd.decoding.multitier import lossless_policy, resume_layer, viasd_lossless_decode, viasd_tiered_decode
from viasd.decoding.strategies import speculative_decode
from viasd.decoding.tiers import Tier, TierThresholds, assign_tiers, confidence_signals
from viasd.decoding.session import DecodeRequest
from viasd.models.loading import load_model
from viasd.models.kvcache import LayerMask
from viasd.routing.resolve import default_slim_layers

from support import GREEDY, exact_marginals, reference_logits, run_ar
SLIM = [0, 1, 3]  # tiny model (4 layers): slim route
DRAFT = [0, 3]  # tiny model: self-drafting route


def drafters(model, other):
    n = model.config.n_layers
    return {
        "pld": lambda: NgramDrafter(),
        "self": lambda: SelfDrafter(model.decoder, LayerMask.from_layers(n, DRAFT), GREEDY, None, None),
        "model": lambda: ModelDrafter(other.decoder, GREEDY, None, None),
        "same-model": lambda: ModelDrafter(model.decoder, GREEDY, None, None),
    }


def prompts(n=4):
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(n):
        base = torch.randint(0, 61, (5,), generator=g).tolist()
        out.append(base + base[:3] + torch.randint(0, 61, (3,), generator=g).tolist())  # repeats for pld
    return out


@pytest.mark.parametrize("k, full_block", [(2, 4), (4, 8), (6, 3)])
def test_lossless_equals_ar_on_tiny_model(tiny, tiny_drafter, k, full_block):
    slim = LayerMask.from_layers(tiny.config.n_layers, SLIM)
    for prompt in prompts():
        expected = run_ar(tiny, prompt, 40)
        for name, make in drafters(tiny, tiny_drafter).items():
            req = DecodeRequest(prompt=prompt, max_new_tokens=40, params=GREEDY)
            out = viasd_lossless_decode(tiny.decoder, make(), slim, req, k, full_block)
            assert out == expected, name
            s = req.stats.to_dict()
            assert s["calls"]["full"] >= 3 and s["calls"]["slim"] >= 2, name  # prefill + >= 2 verifications
            assert sum(s["tiers"].values()) == s["new_tokens"] == 40, name


def test_full_model_rejections_are_counted(tiny, tiny_drafter):
    """The full verifier's judged/kept counters: equal to drafted/accepted in SD; in lossless VIA-SD
    a slim verifier that is the full model itself proposes blocks the full model never rejects."""
    all_layers = LayerMask.from_layers(tiny.config.n_layers, range(tiny.config.n_layers))
    for prompt in prompts(2):
        req = DecodeRequest(prompt=prompt, max_new_tokens=24, params=GREEDY)
        speculative_decode(tiny.decoder, ModelDrafter(tiny_drafter.decoder, GREEDY, None, None), req, 4)
        s = req.stats.to_dict()
        assert (s["full_checked"], s["full_kept"]) == (s["drafted"], s["accepted"]) and s["full_rejection_rate"] > 0
        req = DecodeRequest(prompt=prompt, max_new_tokens=24, params=GREEDY)
        viasd_lossless_decode(tiny.decoder, ModelDrafter(tiny_drafter.decoder, GREEDY, None, None), all_layers, req, 4, 8)
        s = req.stats.to_dict()
        assert s["full_checked"] > 0 and s["full_kept"] == s["full_checked"] and s["full_rejection_rate"] == 0.0
        assert s["rejection_rate"] > 0  # the drafter's tokens are still rejected, by the slim stage


@pytest.mark.model
@pytest.mark.parametrize("prompt", ["Write a short story about a robot learning to paint.",
                                    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                                    "List three facts about the Moon."])
@pytest.mark.parametrize("draft", ["self", "pld"])
def test_lossless_equals_ar_on_smollm2(smollm2, prompt, draft):
    expected = generate(prompt, smollm2, strategy="ar", max_new_tokens=40)
    got = generate(prompt, smollm2, strategy="viasd", mode="lossless", draft=draft, max_new_tokens=40)
    assert got.token_ids == expected.token_ids
    s = got.stats.to_dict()
    assert s["calls"]["full"] >= 3  # prefill + >= 2 full verifications
    assert sum(s["tiers"].values()) == s["new_tokens"]


# --------------------------------------------------------------------------- tiered reference


def ref_draft(model, kind, tokens, n_full, k):
    """Drafts recomputed from scratch: pld lookup, or greedy along the drafting route."""
    if kind == "pld":
        return ngram_lookup(np.array(tokens), k, 3, 1), None
    route = LayerMask.from_layers(model.config.n_layers, DRAFT)
    seq, probs = list(tokens), []
    for _ in range(k):
        row = reference_logits(model, seq, min(n_full, len(seq) - 1), route)[-1]
        probs.append(torch.softmax(row, -1))
        seq.append(int(row.argmax()))
    return seq[len(tokens):], torch.stack(probs) if probs else None


def tiered_reference(model, kind, slim_layers, prompt, n_new, k, thr):
    slim_route = LayerMask.from_layers(model.config.n_layers, slim_layers)
    first = int(reference_logits(model, prompt, 0, None)[-1].argmax())  # every loop's first token: the prefill's
    tokens, out = list(prompt) + [first], [first]
    n_full = len(tokens) - 1
    while len(out) < n_new:
        budget = n_new - len(out)
        drafts, q = ref_draft(model, kind, tokens, n_full, min(k, budget - 1)) if budget > 1 else ([], None)
        kd = len(drafts)
        if kd:
            slim = torch.softmax(reference_logits(model, tokens + drafts, n_full, slim_route)[len(tokens) - 1 - n_full:], -1)
            tiers = assign_tiers(confidence_signals(torch.tensor(drafts, dtype=torch.long), q, slim[:kd]), thr).tolist()
            tiers.append(2 if slim[kd].max() >= thr.slim else 3)
        else:
            tiers = [3]  # no draft: the full model decides
        new, i = [], 0
        while tiers[i] != 3:
            if tiers[i] == 1:
                new.append(drafts[i])
                i += 1
                continue
            token = int(slim[i].argmax())
            new.append(token)
            if i == kd or token != drafts[i]:
                break
            i += 1
        if tiers[i] == 3:
            seq = tokens + new + drafts[i:]
            rows = reference_logits(model, seq, 0, None)[len(tokens + new) - 1:]
            n, x = greedy_accept(torch.tensor(drafts[i:], dtype=torch.long), rows)
            new += drafts[i:i + n] + [x]
            n_full = len(seq)
        new = new[:budget]
        tokens += new
        out += new
        n_full = min(n_full, len(tokens) - 1)
    return out


@pytest.mark.parametrize("kind", ["pld", "self"])
@pytest.mark.parametrize("thr", [TierThresholds(accept=0.5, accept_draft=0.0, slim=0.4),
                                 TierThresholds(accept=0.3, accept_draft=0.3, slim=0.7),
                                 TierThresholds(accept=0.8, accept_draft=0.0, accept_tv=0.5, slim=0.2)])
def test_tiered_equals_cache_free_reference(tiny, kind, thr):
    slim_route = LayerMask.from_layers(tiny.config.n_layers, SLIM)
    seen = set()
    for prompt in prompts(3):
        expected = tiered_reference(tiny, kind, SLIM, prompt, 30, 4, thr)
        make = drafters(tiny, None)[kind]
        req = DecodeRequest(prompt=prompt, max_new_tokens=30, params=GREEDY)
        out = viasd_tiered_decode(tiny.decoder, make(), slim_route, req, 4, thr)
        assert out == expected
        s = req.stats.to_dict()
        assert sum(s["tiers"].values()) == s["new_tokens"] == 30
        seen |= {t for t, n in s["tiers"].items() if n}
    assert len(seen) >= 2  # the thresholds mix tiers


@pytest.mark.parametrize("kind", ["pld", "self", "model"])
def test_tiered_with_every_token_to_full_is_sd(tiny, tiny_drafter, kind):
    slim_route = LayerMask.from_layers(tiny.config.n_layers, SLIM)
    never = TierThresholds(accept=2.0, slim=2.0)
    for prompt in prompts(3):
        make = drafters(tiny, tiny_drafter)[kind]
        expected = speculative_decode(tiny.decoder, make(), DecodeRequest(prompt=prompt, max_new_tokens=30, params=GREEDY), 4)
        req = DecodeRequest(prompt=prompt, max_new_tokens=30, params=GREEDY)
        assert viasd_tiered_decode(tiny.decoder, make(), slim_route, req, 4, never) == expected
        s = req.stats.to_dict()
        assert s["tiers"] == {"accept": 0, "slim": 0, "full": 30}
        assert s["calls"].get("slim", 0) == 0  # at SD's cost: no slim pass can change a round


def test_tiered_with_slim_settling_everything_is_the_routed_model(tiny):
    """A drafter that always drafts, and a slim verifier that settles every position: every token is
    the routed model's (the first is the prefill's), but the last when a round is left with one token
    of budget: no draft, so the full model decides it, with no slim pass."""
    n = tiny.config.n_layers
    slim_route = LayerMask.from_layers(n, SLIM)
    everything = TierThresholds(accept=2.0, slim=0.0)
    for prompt in prompts(3):
        cache = tiny.decoder.new_cache(64)
        first = int(tiny.decoder.forward(torch.tensor(prompt), 0, cache)[-1].argmax())
        seq, routed = list(prompt) + [first], [first]
        for _ in range(29):
            logits = tiny.decoder.forward(torch.tensor(seq[-1:]), len(seq) - 1, cache, route=slim_route)[0]
            routed.append(int(logits.argmax()))
            seq.append(routed[-1])
        req = DecodeRequest(prompt=prompt, max_new_tokens=30, params=GREEDY)
        out = viasd_tiered_decode(tiny.decoder, drafters(tiny, None)["self"](), slim_route, req, 4, everything)
        assert out == tiered_reference(tiny, "self", SLIM, prompt, 30, 4, everything)
        s = req.stats.to_dict()
        if s["tiers"]["full"] == 1:  # the first token only (the prefill's)
            assert out == routed and s["calls"]["full"] == 1
        else:  # and the last: its round had no draft
            assert out[:29] == routed[:29] and s["tiers"] == {"accept": 0, "slim": 28, "full": 2}


class _NoDrafts:
    """A drafter that never finds anything (as prompt lookup on text with no repeats)."""

    def begin(self, max_len, verifier):
        pass

    def propose(self, context, k):
        return NO_DRAFT


def test_tiered_round_without_a_draft_makes_no_slim_pass(tiny):
    """Rounds with no draft are the full model's: ar's tokens, with no slim pass, even with thresholds
    under which the slim verifier would settle every position."""
    slim_route = LayerMask.from_layers(tiny.config.n_layers, SLIM)
    for prompt in prompts(2):
        req = DecodeRequest(prompt=prompt, max_new_tokens=12, params=GREEDY)
        out = viasd_tiered_decode(tiny.decoder, _NoDrafts(), slim_route, req, 4, TierThresholds(accept=0.0, slim=0.0))
        assert out == run_ar(tiny, prompt, 12)
        s = req.stats.to_dict()
        assert s["calls"].get("slim", 0) == 0 and s["calls"]["full"] == 12 and s["tiers"]["full"] == 12


# ------------------------------------------------------------------------------ sampling


def test_lossless_sampling_follows_the_verifier_distribution(tmp_path):
    """N = 1500 sampled decodes of 5 tokens (the first from the prefill, then slim-verified blocks of 2
    checked by the full model); the first three tokens' marginals within TV 0.05 of exact."""
    from support import save_tiny
    from viasd.models.loading import load_model

    words = [f"w{i}" for i in range(6)] + ["<eos>", "<unk>"]
    model = load_model(str(save_tiny(tmp_path / "m", seed=5, words=words, scale=0.4)), progress=False)
    params = SamplingParams(temperature=1.0)
    prompt = [4, 0]
    marginals = exact_marginals(model, prompt, params, n=3)
    slim = LayerMask.from_layers(4, SLIM)
    g = torch.Generator().manual_seed(3)
    counts = torch.zeros(3, 8)
    n = 1500
    for _ in range(n):
        drafter = SelfDrafter(model.decoder, LayerMask.from_layers(4, DRAFT), params, g, None)
        req = DecodeRequest(prompt=prompt, max_new_tokens=5, params=params, generator=g)
        out = viasd_lossless_decode(model.decoder, drafter, slim, req, 2, 2)
        for i, t in enumerate(out[:3]):
            counts[i, t] += 1
    for i, p in enumerate(marginals):
        assert 0.5 * (counts[i] / n - p).abs().sum() < 0.05, i


# ------------------------------------------------------------------------------ signals, cascades


def test_confidence_signals_and_tiers_on_hand_built_distributions():
    slim = torch.tensor([[0.95, 0.05, 0.0], [0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])
    q = torch.tensor([[0.9, 0.1, 0.0], [0.2, 0.8, 0.0], [1.0, 0.0, 0.0]])
    draft = torch.tensor([0, 1, 0])
    s = confidence_signals(draft, q, slim)
    assert torch.allclose(s.slim_prob, torch.tensor([0.95, 0.3, 0.2]))
    assert torch.allclose(s.draft_prob, torch.tensor([0.9, 0.8, 1.0]))
    assert torch.allclose(s.slim_top, torch.tensor([0.95, 0.5, 0.6]))
    assert torch.allclose(s.tv, torch.tensor([0.05, 0.5, 0.8]))
    assert assign_tiers(s, TierThresholds(accept=0.9, accept_draft=0.5, slim=0.55)).tolist() == [1, 3, 2]
    assert assign_tiers(s, TierThresholds(accept=0.9, accept_draft=0.95, slim=0.55)).tolist() == [2, 3, 2]
    assert assign_tiers(s, TierThresholds(accept=2, slim=2)).tolist() == [3, 3, 3]


def test_cascade_deferral_rules():
    q = torch.tensor([[0.9, 0.1], [0.6, 0.4]])
    p = torch.tensor([[0.5, 0.5], [0.95, 0.05]])
    assert cascade_defer(q, p, "chow", 0.2).tolist() == [True, False]  # max q >= 0.8
    assert cascade_defer(q, p, "diff", 0.2).tolist() == [True, False]  # max q >= max p - 0.2
    assert cascade_defer(q, p, "opt", 1.0).tolist() == [True, True]  # 0.6 >= 0.95 - 0.35
    assert cascade_defer(q, p, "opt", 0.5).tolist() == [True, False]
    pi = cascade_target(q, p, torch.tensor([True, False]))
    assert torch.equal(pi, torch.tensor([[0.9, 0.1], [0.95, 0.05]]))


def test_cascade_that_never_defers_equals_ar_and_always_deferring_keeps_every_draft(tiny, tiny_drafter):
    for prompt in prompts(2):
        expected = run_ar(tiny, prompt, 24)
        never = generate(prompt, tiny, drafter=tiny_drafter, strategy="cascade", rule="chow", alpha=0.0, max_new_tokens=24)
        assert never.token_ids == expected
        always = generate(prompt, tiny, drafter=tiny_drafter, strategy="cascade", rule="chow", alpha=1.0, max_new_tokens=24)
        s = always.stats.to_dict()
        assert s["rejection_rate"] == 0.0 and s["accepted"] == s["drafted"] > 0


def test_viasd_api_settings_and_errors(tiny, tmp_path):
    out = generate([1, 2, 3], tiny, strategy="viasd", mode="tiered", slim_layers=tuple(SLIM), accept=2.0, slim=2.0, max_new_tokens=8)
    assert out.config["tier_thresholds"]["accept"] == 2.0 and out.stats.to_dict()["tiers"]["full"] == 8
    (tmp_path / "t.json").write_text('{"accept": 2.0, "slim": 0.0}')
    out = generate([1, 2, 3], tiny, strategy="viasd", mode="tiered", draft="self", slim_layers=tuple(SLIM),
                   thresholds=str(tmp_path / "t.json"), max_new_tokens=8, adapt_k=False)
    # the first token is the prefill's; every drafted round's tokens the slim verifier's (a last round
    # left with one token of budget has no draft: the full model's; with a fixed k every other round drafts)
    assert out.stats.to_dict()["tiers"] in ({"accept": 0, "slim": 7, "full": 1}, {"accept": 0, "slim": 6, "full": 2})
    (tmp_path / "bad.json").write_text('{"acept": 0.5}')
    from viasd.errors import UsageError

    with pytest.raises(UsageError, match="unknown threshold\\(s\\) acept"):
        generate([1, 2, 3], tiny, strategy="viasd", mode="tiered", thresholds=str(tmp_path / "bad.json"), max_new_tokens=4)
    with pytest.raises(UsageError, match="unknown mode 'fast'"):
        generate([1, 2, 3], tiny, strategy="viasd", mode="fast")
    for bad in (dict(strategy="viasd", mode="lossless"), dict(strategy="pld"),
                dict(strategy="viasd", mode="tiered", temperature=0.5)):
        with pytest.raises(UsageError, match="correct applies to strategy viasd in tiered mode with greedy decoding"):
            generate([1, 2, 3], tiny, correct=True, max_new_tokens=4, **bad)
    with pytest.raises(UsageError, match="correct must be True or False"):
        generate([1, 2, 3], tiny, strategy="viasd", mode="tiered", correct="yes", max_new_tokens=4)
    out = generate([1, 2, 3], tiny, strategy="viasd", mode="tiered", slim_layers=tuple(SLIM), accept=0.0, accept_draft=0.0,
                   slim=0.0, correct=True, max_new_tokens=12)
    assert out.config["correct"] is True and out.token_ids == generate([1, 2, 3], tiny, strategy="ar", max_new_tokens=12).token_ids
    with pytest.raises(UsageError, match="unknown setting\\(s\\): mdoe"):
        generate([1, 2, 3], tiny, strategy="viasd", mdoe="tiered")
    assert default_slim_layers(30) == tuple(i for i in range(30) if not (10 <= i < 20 and i % 2))


@pytest.mark.parametrize("kind", ["pld", "self"])
def test_resumed_full_passes_change_no_token_and_read_fewer_bytes(tiny, kind):
    """With the slim route keeping layers 0-1 whole, full passes start at layer 2 where slim passes
    stored the stream: the same tokens in both modes, fewer weight bytes in tiered mode, and lossless
    still equals `ar`."""
    slim = LayerMask.from_layers(tiny.config.n_layers, SLIM)
    thr = TierThresholds(accept=0.5, accept_draft=0.0, slim=0.4)
    for prompt in prompts(2):
        runs = {}
        for resume in (True, False):
            req_t, req_l = (DecodeRequest(prompt=prompt, max_new_tokens=30, params=GREEDY),
                            DecodeRequest(prompt=prompt, max_new_tokens=30, params=GREEDY))
            runs[resume] = (viasd_tiered_decode(tiny.decoder, drafters(tiny, None)[kind](), slim, req_t, 4, thr, resume), req_t.stats,
                            viasd_lossless_decode(tiny.decoder, drafters(tiny, None)[kind](), slim, req_l, 4, 8, resume), req_l.stats)
        assert runs[True][0] == runs[False][0] and runs[True][2] == runs[False][2] == run_ar(tiny, prompt, 30)
        on, off = runs[True][1], runs[False][1]
        # the same passes, but positions no slim pass processed go through the layers below 2 alone first
        assert on.calls - Counter({"lower": on.calls["lower"]}) == off.calls
        assert on.bytes_read < off.bytes_read
        assert "lower" not in runs[False][3].calls


def test_resume_setting_reaches_the_record(tiny, tiny_q8):
    on = generate([1, 5, 6, 7, 5, 6], tiny_q8, strategy="viasd", mode="tiered", slim_layers=SLIM, max_new_tokens=8)
    off = generate([1, 5, 6, 7, 5, 6], tiny_q8, strategy="viasd", mode="tiered", slim_layers=SLIM, max_new_tokens=8, resume=False)
    assert on.config["resume_layer"] == 2 and off.config["resume_layer"] is None and on.token_ids == off.token_ids
    not_whole = generate([1, 5, 6, 7], tiny_q8, strategy="viasd", slim_layers=[1, 2, 3], max_new_tokens=4)
    assert not_whole.config["resume_layer"] is None  # layer 0 is not kept: nothing to resume from
    # float weights never resume: a row computed alone by oneDNN may round otherwise than in its pass
    assert generate([1, 5, 6, 7, 5, 6], tiny, strategy="viasd", slim_layers=SLIM, max_new_tokens=8).config["resume_layer"] is None


def test_reduced_head_scores_its_vocabulary_only(tiny):
    """A slim verifier with a reduced head: its logits at the kept ids are the full head's, -inf
    elsewhere; a draft outside it goes to the full model (tiered) or is never slim-verified
    (lossless, which still equals `ar`); a head over every id changes nothing."""
    from viasd.decoding.tiers import Tier, round_tiers

    dec, n = tiny.decoder, tiny.config.n_layers
    slim = LayerMask.from_layers(n, SLIM)
    vocab = list(range(0, 64, 2))  # 32 even ids
    head = dec.reduced_head(vocab)
    cache_a, cache_b = dec.new_cache(32), dec.new_cache(32)
    full, reduced = dec.forward(torch.tensor([3, 9, 4]), 0, cache_a), dec.forward(torch.tensor([3, 9, 4]), 0, cache_b, head=head)
    assert torch.allclose(reduced[:, vocab], full[:, vocab], atol=1e-5) and torch.isinf(reduced[:, 1::2]).all()
    assert dec.weight_bytes(slim, head=head) < dec.weight_bytes(slim)
    thr = TierThresholds(accept=0.0, accept_draft=0.0, slim=0.0)  # every draft the slim verifier judges is tier 1
    probs = torch.softmax(reduced, -1)
    assert round_tiers([4, 5], None, probs, thr, head.contains([4, 5])) == [Tier.ACCEPT, Tier.FULL, Tier.SLIM]
    everything = dec.reduced_head(range(64))
    for prompt in prompts(3):
        req = DecodeRequest(prompt=prompt, max_new_tokens=24, params=GREEDY)
        out = viasd_tiered_decode(dec, NgramDrafter(), slim, req, 4, thr, head=head)
        # tiers 1 and 2 commit only tokens the head holds (judged drafts, the slim verifier's own)
        assert sum(t % 2 for t in out) <= req.stats.tiers[Tier.FULL] and sum(req.stats.tiers.values()) == 24
        plain, same = (DecodeRequest(prompt=prompt, max_new_tokens=24, params=GREEDY),
                       DecodeRequest(prompt=prompt, max_new_tokens=24, params=GREEDY))
        assert (viasd_tiered_decode(dec, NgramDrafter(), slim, plain, 4, thr)
                == viasd_tiered_decode(dec, NgramDrafter(), slim, same, 4, thr, head=everything))
        req = DecodeRequest(prompt=prompt, max_new_tokens=24, params=GREEDY)
        assert viasd_lossless_decode(dec, NgramDrafter(), slim, req, 4, 8, head=head) == run_ar(tiny, prompt, 24)


def test_drafter_confident_rounds_skip_the_slim_pass(tiny, tiny_drafter):
    """Tier 1 from the drafter's own probability: at draft_confident=0 every drafted round is
    committed without a slim pass (the drafter's greedy text then), and off (2) changes nothing."""
    slim = LayerMask.from_layers(tiny.config.n_layers, SLIM)
    for prompt in prompts(2):
        req = DecodeRequest(prompt=prompt, max_new_tokens=20, params=GREEDY)
        out = viasd_tiered_decode(tiny.decoder, ModelDrafter(tiny_drafter.decoder, GREEDY, None, None), slim, req, 4,
                                  TierThresholds(draft_confident=0.0))
        assert "slim" not in req.stats.calls and req.stats.tiers[Tier.ACCEPT] >= 15
        drafted = run_ar(tiny_drafter, prompt + out[:1], 19)  # after the prefill's token, the drafter's own greedy text
        assert out[1:-1] == drafted[: len(out) - 2]  # (the last token may be the full model's: one token of budget left)
        off, default = (DecodeRequest(prompt=prompt, max_new_tokens=20, params=GREEDY),
                        DecodeRequest(prompt=prompt, max_new_tokens=20, params=GREEDY))
        assert (viasd_tiered_decode(tiny.decoder, ModelDrafter(tiny_drafter.decoder, GREEDY, None, None), slim, off, 4,
                                    TierThresholds(draft_confident=2.0))
                == viasd_tiered_decode(tiny.decoder, ModelDrafter(tiny_drafter.decoder, GREEDY, None, None), slim, default, 4,
                                       TierThresholds()))


def test_full_passes_recheck_tokens_settled_without_them(tiny):
    """The tier-3 pass computes the full model's logits before every token settled without it; greedy,
    tiered mode counts where the full model would have chosen otherwise: never when the drafts are the
    full model's own greedy tokens, often with n-gram drafts all accepted unchecked."""
    slim = LayerMask.from_layers(tiny.config.n_layers, SLIM)
    everything_tier1 = TierThresholds(accept=0.0, accept_draft=0.0, slim=1.5)  # drafts tier 1; the bonus position tier 3
    rechecked = disagreed = 0
    for prompt in prompts(3):
        req = DecodeRequest(prompt=prompt, max_new_tokens=30, params=GREEDY)
        viasd_tiered_decode(tiny.decoder, drafters(tiny, None)["same-model"](), slim, req, 4, everything_tier1)
        assert req.stats.rechecked > 0 and req.stats.disagreed == 0
        req = DecodeRequest(prompt=prompt, max_new_tokens=30, params=GREEDY)
        viasd_tiered_decode(tiny.decoder, NgramDrafter(), slim, req, 4, everything_tier1)
        rechecked, disagreed = rechecked + req.stats.rechecked, disagreed + req.stats.disagreed
    assert 0 < disagreed <= rechecked


@pytest.mark.parametrize("kind", ["pld", "self", "model"])
@pytest.mark.parametrize("thr", [TierThresholds(accept=0.0, accept_draft=0.0, slim=1.5),  # drafts tier 1, bonus full
                                 TierThresholds(accept=2.0, slim=0.0),  # the slim verifier settles everything
                                 TierThresholds(accept=0.5, accept_draft=0.0, slim=0.4)])
def test_tiered_correction_equals_ar_and_streams_only_checked_tokens(tiny, tiny_drafter, kind, thr):
    """Correction mode: full passes replace the first token settled without them where the full
    model's greedy choice differs. The output equals ar's under thresholds that change it without
    correction, and the stream (tokens passed to on_tokens) is exactly the output: no token that a
    correction took back was ever emitted."""
    slim = LayerMask.from_layers(tiny.config.n_layers, SLIM)
    changed = corrected = 0
    for prompt in prompts(3):
        expected = run_ar(tiny, prompt, 30)
        plain = DecodeRequest(prompt=prompt, max_new_tokens=30, params=GREEDY)
        changed += viasd_tiered_decode(tiny.decoder, drafters(tiny, tiny_drafter)[kind](), slim, plain, 4, thr) != expected
        streamed: list[int] = []
        sources: list = []
        req = DecodeRequest(prompt=prompt, max_new_tokens=30, params=GREEDY,
                            on_tokens=lambda ids, by, _: (streamed.extend(ids), sources.extend(by)))
        out = viasd_tiered_decode(tiny.decoder, drafters(tiny, tiny_drafter)[kind](), slim, req, 4, thr, correct=True)
        assert out == expected and streamed == out
        s = req.stats
        assert s.new_tokens == 30 and sum(s.tiers.values()) == 30 and s.discarded >= s.corrected
        # who settled each streamed token: taken-back ones are not counted
        assert len(sources) == 30 and Counter(sources) == +s.sources
        # drafts a correction took back no longer count as accepted: the first token (the prefill's)
        # and each corrected one are no drafts
        assert s.accepted <= s.new_tokens - 1 - s.corrected
        corrected += s.corrected
    assert changed > 0 and corrected > 0  # the thresholds do change tokens, and correction mends them


def test_tiered_correction_checks_the_budget_s_last_tokens(tiny):
    """Tokens settled without the full model at the end of the budget get a full pass of their own
    (and, where it disagrees, decoding goes on from the corrected token): with every draft tier 1
    and n-gram drafts, the output still equals ar's, at every budget."""
    slim = LayerMask.from_layers(tiny.config.n_layers, SLIM)
    thr = TierThresholds(accept=0.0, accept_draft=0.0, slim=0.0)
    for n in (1, 2, 5, 13):
        for prompt in prompts(2):
            req = DecodeRequest(prompt=prompt, max_new_tokens=n, params=GREEDY)
            assert viasd_tiered_decode(tiny.decoder, NgramDrafter(), slim, req, 4, thr, correct=True) == run_ar(tiny, prompt, n)
            assert req.stats.accepted <= n - 1 - req.stats.corrected  # (taken-back drafts uncounted)
    with pytest.raises(ValueError, match="greedy"):
        viasd_tiered_decode(tiny.decoder, NgramDrafter(), slim,
                            DecodeRequest(prompt=prompts(1)[0], max_new_tokens=4, params=SamplingParams(0.7)), 4, thr, correct=True)


def test_tiered_correction_stops_at_the_end_token_ar_stops_at(tiny):
    """End tokens: settled without the full model, an end token ends the budget early; the final check
    keeps it when the full model agrees (the decode ends there, as ar's does) and takes it back when
    it does not (decoding goes on). Either way the output is ar's with the same end tokens."""
    slim = LayerMask.from_layers(tiny.config.n_layers, SLIM)
    thr = TierThresholds(accept=0.0, accept_draft=0.0, slim=0.0)
    ended = 0
    for prompt in prompts(4):
        free = run_ar(tiny, prompt, 30)
        for eos in ({free[6]}, {free[11], free[17]}):
            expected = run_ar(tiny, prompt, 30, frozenset(eos))
            streamed: list[int] = []
            req = DecodeRequest(prompt=prompt, max_new_tokens=30, params=GREEDY, eos=frozenset(eos),
                                on_tokens=lambda ids, *_: streamed.extend(ids))
            out = viasd_tiered_decode(tiny.decoder, NgramDrafter(), slim, req, 4, thr, correct=True)
            assert out == expected == streamed
            ended += len(out) < 30
    assert ended > 0


@pytest.mark.parametrize("kind", ["pld", "model"])
def test_adaptive_tiered_with_every_token_to_full_equals_ar(tiny, tiny_drafter, kind):
    """Tiered VIA-SD choosing each round's draft length from measured costs: with tiers 1-2 off it is
    adaptive SD, so greedy output equals `ar`, and it drafts fewer tokens than the fixed k (some
    rounds none, a poor drafter on a random model); greedy generate() turns it on for tiered mode."""
    slim = LayerMask.from_layers(tiny.config.n_layers, SLIM)
    off = TierThresholds(accept=2.0, slim=2.0)
    for prompt in prompts(2):
        make = drafters(tiny, tiny_drafter)[kind]
        fixed, adaptive = (DecodeRequest(prompt=prompt, max_new_tokens=30, params=GREEDY),
                           DecodeRequest(prompt=prompt, max_new_tokens=30, params=GREEDY))
        assert viasd_tiered_decode(tiny.decoder, make(), slim, fixed, 4, off) == run_ar(tiny, prompt, 30)
        assert viasd_tiered_decode(tiny.decoder, make(), slim, adaptive, 4, off, adaptive=True) == run_ar(tiny, prompt, 30)
        assert adaptive.stats.drafted < fixed.stats.drafted
    r = generate([1, 5, 6, 7, 5, 6], tiny, strategy="viasd", mode="tiered", slim_layers=SLIM, max_new_tokens=6)
    assert r.config["adaptive_k"] is True
    assert generate([1, 5, 6, 7, 5, 6], tiny, strategy="viasd", slim_layers=SLIM, max_new_tokens=6).config["adaptive_k"] is True
    assert generate([1, 5, 6, 7, 5, 6], tiny, strategy="viasd", slim_layers=SLIM, max_new_tokens=6,
                    temperature=0.8, seed=1).config["adaptive_k"] is False  # sampling: --k every round, so --seed reproduces


class _Oracle:
    """A free drafter (as prompt lookup is) that proposes `ar`'s own continuation."""

    free = True

    def __init__(self, prompt: list[int], continuation: list[int]):
        self.sequence = list(prompt) + list(continuation)

    def begin(self, max_len, verifier) -> None:
        pass

    def propose(self, context: list[int], k: int):
        from viasd.decoding.drafters import Draft

        return Draft(self.sequence[len(context) : len(context) + k], None)


def test_adaptive_tiered_scores_free_drafts_it_did_not_verify(tiny, monkeypatch):
    """Where each row costs nearly a pass, the prior acceptance chooses no draft; a free drafter is
    then still scored on the token it proposed, so a drafter that is always right earns its drafts
    back (as in `sd`). Tiered mode once never learnt: it drafted nothing for the whole request."""
    k, prompt = 4, [1, 5, 6, 7, 5, 6]
    expected = run_ar(tiny, prompt, 40)
    slim = LayerMask.from_layers(tiny.config.n_layers, SLIM)
    off = TierThresholds(accept=2.0, slim=2.0)
    # each row 0.7 of a pass: at the prior acceptance (0.6) no draft pays; at 0.8 one does (the costs
    # held there: measured passes of the tiny model would replace them)
    tiny.decoder.pass_times = {(k + 1, False): [1 + 0.7 * j for j in range(k + 1)]}
    monkeypatch.setattr(DraftLength, "observe_pass", lambda self, rows, seconds: None)
    try:
        for decode in (lambda req: speculative_decode(tiny.decoder, _Oracle(prompt, expected), req, k, adaptive=True),
                       lambda req: viasd_tiered_decode(tiny.decoder, _Oracle(prompt, expected), slim, req, k, off, adaptive=True)):
            req = DecodeRequest(prompt=prompt, max_new_tokens=40, params=GREEDY)
            assert decode(req) == expected
            assert req.stats.drafted >= 20 and req.stats.accepted == req.stats.drafted
    finally:
        tiny.decoder.pass_times.clear()


def test_adaptive_lossless_viasd_drafts_only_where_its_two_passes_pay_and_always_equals_ar(tiny, tiny_drafter):
    """Lossless VIA-SD choosing each slim round's draft length (greedy generate()'s default): a round
    with drafts pays a slim pass and a resumed full pass, each at its share of a full pass' bytes
    (together at least one full pass: both read the LM head, and the route keeps every layer below
    where the full pass resumes); a round without drafts is one full pass of one row, as in `ar`.
    Where each row costs a whole pass no draft length can pay even if every draft is kept: it decodes
    as `ar` does, with no slim pass at all. Where rows are cheap, an always-right free drafter (scored
    on its proposals while none is verified; the slim verifier here the whole model, so that it keeps
    them too) earns long drafts. Either way, and with every drafter, the output equals `ar`'s."""
    k, prompt, n = 4, [1, 5, 6, 7, 5, 6], tiny.config.n_layers
    expected = run_ar(tiny, prompt, 40)
    slim, whole = LayerMask.from_layers(n, SLIM), LayerMask.from_layers(n, range(n))
    policy = lossless_policy(tiny.decoder, NgramDrafter(), slim, k, resume_layer(slim), None)
    assert policy.check_share + policy.verify_share >= 1.0 and policy.check_share < 1.0
    try:
        for row_cost, drafts in ((1.0, False), (0.1, True)):
            tiny.decoder.pass_times = {(k + 1, False): [1 + row_cost * j for j in range(k + 1)]}
            req = DecodeRequest(prompt=prompt, max_new_tokens=40, params=GREEDY)
            assert viasd_lossless_decode(tiny.decoder, _Oracle(prompt, expected), whole, req, k, 8, adaptive=True) == expected
            s = req.stats.to_dict()
            if drafts:
                assert s["drafted"] >= 20 and s["accepted"] == s["drafted"], s
            else:
                assert s["drafted"] == 0 and s["calls"].get("slim", 0) == 0 and s["calls"]["full"] == 40, s
            for name, make in drafters(tiny, tiny_drafter).items():
                req = DecodeRequest(prompt=prompt, max_new_tokens=40, params=GREEDY)
                assert viasd_lossless_decode(tiny.decoder, make(), slim, req, k, 8, adaptive=True) == expected, name
    finally:
        tiny.decoder.pass_times.clear()


@pytest.mark.model
def test_correction_mode_equals_ar_on_native_weights_after_a_long_unchecked_run():
    """Issue 26's case: every draft tier 1 (accept 0, slim 0) leaves runs of 70+ unchecked tokens for
    one full pass; on the row-exact kernel that pass' logits must be `ar`'s (it differed from token 76)."""
    from viasd.models import rowexact

    if not rowexact.available():
        pytest.skip("no row-exact kernel on this CPU")
    model = load_model("smollm2-135m", pack="row-exact", progress=False)
    prompt = "List the planets of the solar system, one per line."
    ar = generate(prompt, model, strategy="ar", max_new_tokens=128, progress=False)
    out = generate(prompt, model, strategy="viasd", mode="tiered", correct=True, accept=0.0, slim=0.0, max_new_tokens=128,
                   progress=False)
    assert len(ar.token_ids) > 80
    assert out.token_ids == ar.token_ids


def test_lossless_viasd_counts_the_slim_verifiers_rescues(tiny, tiny_drafter):
    """Where the slim verifier rejects a draft, its replacement goes to the full model: a slim route of
    every layer is the full model, so it keeps every rescue; a route of half the layers fewer."""

    prompt = [1, 5, 6, 7, 5, 6]
    everything = generate(prompt, tiny, drafter=tiny_drafter, strategy="viasd", draft="model", slim_layers=(0, 1, 2, 3),
                          max_new_tokens=40, adapt_k=False, progress=False).stats
    assert everything.rescues > 0 and everything.rescues_kept == everything.rescues
    half = generate(prompt, tiny, drafter=tiny_drafter, strategy="viasd", draft="model", slim_layers=(0, 3),
                    max_new_tokens=40, adapt_k=False, progress=False).stats
    assert half.rescues > 0 and half.rescues_kept < half.rescues
    assert half.to_dict()["slim_rescue_agreement"] == round(half.rescues_kept / half.rescues, 4)
