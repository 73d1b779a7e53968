"""Every lossless strategy yields exactly the autoregressive greedy tokens (float32), and the
sampling path follows the verifier's distribution."""

from __future__ import annotations

import json

from types import SimpleNamespace

import pytest
import torch

from viasd import generate
from viasd.decoding.acceptance import SamplingParams
from viasd.decoding.draft_length import DraftLength, expected_tokens
from viasd.execution.timing import pass_times
from viasd.decoding.drafters import Draft, LookupDrafter, ModelDrafter, NgramDrafter, SelfDrafter
from viasd.decoding.strategies import speculative_decode
from viasd.decoding.session import DecodeRequest, Session
from viasd.models.kvcache import LayerMask
from viasd.routing.resolve import default_draft_layers

from support import GREEDY, NO_EOS, exact_marginals, run_ar, run_sd


class RandomDrafter:
    """Proposes uniformly random tokens: almost never accepted."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.g = vocab, torch.Generator().manual_seed(seed)

    def begin(self, max_len: int, verifier) -> None:
        pass

    def propose(self, context, k) -> Draft:
        return Draft(torch.randint(0, self.vocab, (k,), generator=self.g).tolist(), None)


def tiny_drafters(tiny, tiny_drafter):
    n = tiny.config.n_layers
    return {
        "same-model (always accept)": ModelDrafter(tiny.decoder, GREEDY, None, None),
        "other-model": ModelDrafter(tiny_drafter.decoder, GREEDY, None, None),
        "random (never accept)": RandomDrafter(tiny.config.vocab_size),
        "pld": NgramDrafter(),
        "self route [0, 3]": SelfDrafter(tiny.decoder, LayerMask.from_layers(n, [0, 3]), GREEDY, None, None),
        "self attn-only route": SelfDrafter(tiny.decoder, LayerMask(attn=(True,) * n, mlp=(True, False, False, True)), GREEDY, None, None),
        "adaptive other-model": ModelDrafter(tiny_drafter.decoder, GREEDY, None, 0.5),
        "other-model without q": ModelDrafter(tiny_drafter.decoder, GREEDY, None, None, probs=False),
        "self route [0, 3] without q": SelfDrafter(tiny.decoder, LayerMask.from_layers(n, [0, 3]), GREEDY, None, None, probs=False),
    }


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [1, 3, 6])
def test_lossless_strategies_equal_ar_on_tiny_model(tiny, tiny_drafter, seed, k):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 61, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
    expected = run_ar(tiny, prompt, 40)
    for name, drafter in tiny_drafters(tiny, tiny_drafter).items():
        out, stats = run_sd(tiny, drafter, prompt, 40, k=k)
        assert out == expected, name
        assert stats.rounds >= 2 and stats.new_tokens == 40, name
        if name.startswith("same-model"):
            assert stats.accepted == stats.drafted > 0  # every draft accepted
        if name.startswith("random"):
            assert stats.accepted <= stats.drafted * 0.2


def test_stopping_at_eos_is_the_same_for_every_strategy(tiny, tiny_drafter):
    prompt = [3, 4, 5]
    free = run_ar(tiny, prompt, 30)
    eos = frozenset([free[7]])  # pretend the 8th generated token is EOS
    expected = run_ar(tiny, prompt, 30, eos)
    assert expected == free[: free.index(free[7]) + 1]
    for name, drafter in tiny_drafters(tiny, tiny_drafter).items():
        assert run_sd(tiny, drafter, prompt, 30, eos=eos)[0] == expected, name


def test_statistics_add_up(tiny):
    drafter = ModelDrafter(tiny.decoder, GREEDY, None, None)
    out, stats = run_sd(tiny, drafter, [1, 2, 3], 21, k=4)
    d = stats.to_dict()
    assert d["rejection_rate"] == 0.0
    # 21 tokens: the first from the prefill's last row (a round of its own), then 5 per round
    # (4 accepted + bonus) -> rounds of 1, 5, 5, 5, 5
    assert d["rounds"] == 5 and d["mean_accepted_length"] == pytest.approx(21 / 5)
    assert d["calls"]["full"] == 1 + 4  # prefill + one verification per drafting round
    assert d["calls"]["draft"] == 1 + 4 * 4  # the drafter's prompt pass, then 4 a drafting round
    assert d["acceptance_per_position"] == [1.0, 1.0, 1.0, 1.0]


# ------------------------------------------------------------------------------- sampling path


# ------------------------------------------------------------------ draft lengths from measured costs

def test_draft_length_follows_costs_and_acceptance():
    assert expected_tokens(0.5, 2) == 1.75 and expected_tokens(1.0, 3) == 4.0 and expected_tokens(0.0, 5) == 1.0
    flat = [0.01] * 5  # a pass of 5 rows costs what one row does (float weights, oneDNN)
    steep = [0.01 * (1 + 0.9 * j) for j in range(5)]  # each row ~0.9 of a pass (compute-bound kernels)
    assert DraftLength(4, flat, free_drafts=True).choose() == 4  # drafts are free to verify: draft the most
    policy = DraftLength(4, steep, free_drafts=True)
    assert policy.choose() == 0  # at the prior acceptance (0.6) no draft pays for its row
    for _ in range(20):
        policy.observe(4, 4)  # everything accepted (a copied passage)
    assert policy.alpha > 0.9 and policy.choose() == 4
    for _ in range(20):
        policy.observe(2, 0)
    assert policy.alpha < 0.4 and policy.choose() == 0
    # a drafter that costs is only scored on drafts it makes: one is tried after 8 rounds without
    costly = DraftLength(4, steep, free_drafts=False)
    assert [costly.choose() for _ in range(9)] == [0] * 8 + [1]
    costly.observe(1, 0)  # the probe was rejected: the next one comes after twice as many idle rounds
    assert [costly.choose() for _ in range(17)] == [0] * 16 + [1]
    dear = DraftLength(4, steep, free_drafts=False, draft_s=0.05)  # a drafting pass: 5 one-row passes
    for _ in range(20):
        dear.observe(1, 1)
    assert dear.choose() == 0  # never worth it, even with every draft accepted
    with pytest.raises(ValueError, match="pass times for 1..5 rows"):
        DraftLength(4, [0.01] * 3, free_drafts=True)


def test_draft_length_shrinks_as_a_batch_fills_the_cheap_rows():
    """Beside other requests a round with drafts pays a pass of its own (a shared pass groups calls
    of equal row buckets), so drafts pay there only where nearly all of them are accepted, and not
    beside many others at all; alone, cheap rows make long drafts pay and dear ones (this project's
    AVX2 machine) one."""
    cheap = [0.01 * (1 + 0.1 * j) for j in range(5)]
    steep = [0.01 * (1 + 0.55 * j) for j in range(5)]
    for times, alone in ((cheap, 4), (steep, 1)):
        policy = DraftLength(4, times, free_drafts=True)
        for _ in range(10):
            policy.observe(4, 3)  # alpha about 0.75
        assert policy.choose(others=0) == alone
        assert policy.choose(others=1) == 0 and policy.choose(others=7) == 0, times
    copying = DraftLength(4, cheap, free_drafts=True)
    for _ in range(20):
        copying.observe(4, 4)  # alpha about 1: a copied passage
    assert copying.choose(others=1) == 4 and copying.choose(others=7) == 0
    # no draft: one pass of 8 rows; j drafts: 7 rows, and j+1 rows in a pass of their own
    assert DraftLength(4, steep, True).batch_costs(7)[:2] == pytest.approx([1 + 0.55 * 7, 1 + 0.55 * 6 + 1.55])
    # times a neighbour inflated (learnt by a served request while seven others tokenized their
    # prompts): a pass of 7 rows still never costs more than 6 rows and a pass of one, so no draft
    # pays beside 6 others however well the drafter did
    inflated = DraftLength(4, [0.020, 0.037, 0.068, 0.071, 0.133], free_drafts=True)
    for _ in range(20):
        inflated.observe(4, 3)
    costs = inflated.batch_costs(6)
    assert costs[0] <= min(costs[1:]) and inflated.choose(others=6) == 0


def test_lossless_viasd_prices_a_round_with_drafts_at_its_slim_and_resumed_full_pass():
    """Lossless VIA-SD's rounds with drafts pay a slim pass and a resumed full pass of the same rows
    (`check_share + verify_share` of a full pass); a round without drafts one full pass of one row.
    So it drafts less than `sd` at the same acceptance, and nothing beside 7 other requests."""
    cheap = [0.01 * (1 + 0.1 * j) for j in range(5)]
    sd, viasd = DraftLength(4, cheap, True), DraftLength(4, cheap, True, check_share=0.8, verify_share=0.7)
    assert viasd.batch_costs(0) == pytest.approx([1.0] + [1.5 * (1 + 0.1 * j) for j in range(1, 5)])
    assert viasd.batch_costs(7)[:2] == pytest.approx([1 + 0.1 * 7, 1 + 0.1 * 6 + 1.5 * 1.1])
    for policy in (sd, viasd):
        for _ in range(10):
            policy.observe(4, 3)  # alpha about 0.75
    assert sd.choose(others=0) == 4 and viasd.choose(others=0) == 4  # 4.1 tokens / (1.5 * 1.4) > 1 a pass
    for policy in (sd, viasd):
        for _ in range(10):
            policy.observe(1, 0)  # alpha about 0.3
    assert sd.choose(others=0) > 0 and viasd.choose(others=0) == 0  # 1.3 / 1.1 > 1 > 1.3 / 1.65
    for _ in range(30):
        viasd.observe(4, 4)  # alpha about 1: a copied passage
    assert viasd.choose(others=0) == 4 and viasd.choose(others=7) == 0
    with pytest.raises(ValueError, match="pass shares"):
        DraftLength(4, cheap, True, check_share=1.5)
    with pytest.raises(ValueError, match="pass shares"):
        DraftLength(4, cheap, True, verify_share=0.0)


def test_beside_others_the_policy_neither_learns_their_passes_nor_probes_where_drafts_cannot_pay():
    """A pass beside other requests carries their rows and waits for their drafters: its time is not
    that of this request's rows (learnt as such, every draft length cost about the same and 8 served
    `sd` requests drafted as if alone). And a probe there makes every member wait for the drafter,
    so none is made where drafts could not pay even if all were accepted."""
    from viasd.execution import batching
    from viasd.execution.passes import Passes

    cheap = [0.01 * (1 + 0.1 * j) for j in range(5)]
    session = batching.BatchSession()
    session.members = 1  # another request is running
    policy = DraftLength(4, cheap, free_drafts=False, draft_s=0.002, passes=Passes(session))  # a drafted token: 0.2 of a pass

    def beside_others():
        policy.observe_pass(1, 0.5)
        policy.observe_drafting(0.3, 1)
        return [policy.choose(others=7) for _ in range(40)]

    assert session.member(beside_others) == [0] * 40  # 7 others: (7 + 2) / (1.8 + 0.2) < 8 / 1.7 at best
    assert policy.times == cheap and policy.draft_s == 0.002
    assert policy.choose(others=0) > 0  # alone, drafts pay
    policy.observe_pass(1, 0.02)
    assert policy.times[0] > cheap[0]  # alone, its passes are its own: learnt


def test_a_requests_learnt_pass_times_start_the_models_next_request(tiny):
    """Pass costs are measured once per model in a process; what a request alone learns of its
    verification passes starts the next request's policy (a server kept one measurement's curve,
    10-15% off a row count, and its `pld` drafted shorter rounds than `viasd generate`'s: 0.93x),
    and passes beside other requests, which carry their rows, are learnt by neither."""
    from viasd.decoding.draft_length import draft_policy
    from viasd.execution import batching
    from viasd.execution.passes import Passes

    k, measured = 4, [0.01 * (1 + 0.5 * j) for j in range(5)]
    tiny.decoder.pass_times = {(k + 1, False): list(measured)}
    try:
        first = draft_policy(tiny.decoder, NgramDrafter(), k)
        assert first.times == measured
        first.observe_pass(3, 0.05)  # 3 rows took 0.05 s, not 0.02
        learnt = 0.7 * measured[2] + 0.3 * 0.05
        assert first.times[2] == pytest.approx(learnt)
        second = draft_policy(tiny.decoder, NgramDrafter(), k)
        assert second.times == pytest.approx(measured[:2] + [learnt] + measured[3:])
        assert second.costs[2] > DraftLength(k, measured, free_drafts=True).costs[2]

        session = batching.BatchSession()
        session.members = 1  # another request is running
        second.passes = Passes(session)
        session.member(lambda: second.observe_pass(2, 0.5))
        assert draft_policy(tiny.decoder, NgramDrafter(), k).times[1] == measured[1]
        admitted = batching.BatchSession()
        admitted.admitted = 2  # the only member, but the server took in another request (starting, finishing)
        second.passes = Passes(admitted)
        admitted.member(lambda: second.observe_pass(2, 0.5))
        assert draft_policy(tiny.decoder, NgramDrafter(), k).times[1] == measured[1]
        apart = draft_policy(tiny.decoder, NgramDrafter(), k, shared=False)  # passes that are not whole ones
        apart.observe_pass(4, 0.001)
        assert apart.times[3] < measured[3] and draft_policy(tiny.decoder, NgramDrafter(), k).times[3] == measured[3]
    finally:
        tiny.decoder.pass_times.clear()


def test_drafting_passes_are_priced_as_measured_alone_and_a_rounds_other_time_once_a_round():
    """A round's drafting costs its passes, one a draft plus a few more (a drafter of another
    vocabulary drafts a token past what it keeps), at the price of a drafting pass measured alone;
    the rest of its time (tokenizer calls) is the round's, whatever its length, and is learnt only
    from steady rounds: not from a request's first (what is done once) nor from a probe after idle
    rounds (its first pass reads all that was committed meanwhile). Learnt per pass from every
    round, such rounds priced each drafting pass twice as dear and no draft length paid again."""
    cheap = [0.01 * (1 + 0.05 * j) for j in range(5)]
    policy = DraftLength(4, cheap, False, draft_s=0.001)  # a drafting pass: 0.1 of a verifier pass
    for _ in range(10):
        policy.observe(4, 2)  # alpha about 0.67
    assert policy.choose(others=0) > 0
    policy.observe_drafting(0.050, drafted=4, passes=6)  # the first round: 6 passes and 44 ms done once
    assert policy.draft_s == 0.001 and policy.round_s == 0 and policy.extra_passes == pytest.approx(1)
    for _ in range(4):
        assert policy.choose(others=0) > 0
        policy.observe_drafting(0.0065, drafted=4, passes=6)  # then 0.5 ms a round beside the passes
    assert policy.round_s == pytest.approx(0.0005 * 15 / 16) and policy.extra_passes == pytest.approx(2, abs=0.1)
    assert policy.choose(others=0) == 3  # (1 - 0.67^4) / 0.33 tokens for 1.15 + 5 * 0.1 + 0.05 passes
    # a round's own time counts once, not once a draft: 3 ms a round spread over more tokens makes
    # the longest round pay most
    for _ in range(10):
        policy.observe_drafting(0.006, drafted=1, passes=3)
        policy.choose(others=0)
    assert policy.round_s == pytest.approx(0.003, rel=0.02) and policy.choose(others=0) == 4
    # a probe after rounds without drafts reads what was committed meanwhile: not a steady round's cost
    for _ in range(20):
        policy.observe(2, 0)
    while policy.choose(others=0) == 0:
        pass
    policy.observe_drafting(0.030, drafted=1, passes=2)
    assert policy.round_s == pytest.approx(0.003, rel=0.02)


def test_drafting_costs_are_known_before_any_draft(tiny, tiny_drafter):
    from viasd.decoding.draft_length import drafting_seconds

    params = GREEDY
    times = pass_times(tiny.decoder, 3)
    assert drafting_seconds(NgramDrafter(), times) == 0.0
    half = SelfDrafter(tiny.decoder, LayerMask.from_layers(tiny.decoder.config.n_layers, [0, 1]), params, None, None)
    assert drafting_seconds(half, times) == pytest.approx(half.verifier_share * times[0])
    model = ModelDrafter(tiny_drafter.decoder, params, None, None)
    assert drafting_seconds(model, times) == pass_times(tiny_drafter.decoder, 3, last_only=True)[0] > 0
    assert drafting_seconds(model, times, k=4) == pass_times(tiny_drafter.decoder, 6, last_only=True)[0]  # graphs of up to k + 2 rows built


def test_a_drafter_models_passes_are_priced_over_the_head_it_drafts_with(tiny_drafter, monkeypatch):
    """A drafter over a reduced LM head is priced by last-row passes over that head (qwen2.5-coder-0.5b's
    over 32768 tokens took 0.80x the time of its whole head's), kept apart from the whole head's."""
    from viasd.decoding.draft_length import drafting_seconds

    dec = tiny_drafter.decoder
    head = dec.reduced_head(tuple(range(0, dec.config.vocab_size, 2)))
    heads = []
    forward = type(dec).forward

    def spying(self, tokens, start, cache, *args, **kwargs):
        heads.append(kwargs.get("head"))
        return forward(self, tokens, start, cache, *args, **kwargs)
    monkeypatch.setattr(type(dec), "forward", spying)
    dec.pass_times.clear()
    try:
        seconds = drafting_seconds(LookupDrafter(ModelDrafter(dec, GREEDY, None, None, head), 3), [1.0, 1.0])
        assert seconds > 0 and len(heads) == 12 and all(h is head for h in heads)  # 3 row counts x (3 reps + 1)
        assert pass_times(dec, 3, last_only=True, head=head)[0] == seconds and len(heads) == 12  # kept
        pass_times(dec, 3, last_only=True)  # the whole head's: measured apart
        assert len(heads) == 24 and heads[-1] is None
    finally:
        dec.pass_times.clear()
    with pytest.raises(ValueError, match="last-row"):
        pass_times(dec, 2, head=head)


def test_pass_times_are_measured_interleaved(tiny, monkeypatch):
    """Every row count is measured in every round (1, 2, 3, 1, 2, 3, ...), not one after another, after
    a context taken as the scratch cache holds it (no pass computes it: 0.9 s of qwen 1.5B's 2.2 s
    before a first token, for a cost that does not depend on what the keys hold)."""
    calls = []
    forward = type(tiny.decoder).forward

    def counting(self, tokens, start, cache, *args, **kwargs):
        calls.append(int(tokens.shape[0]))
        return forward(self, tokens, start, cache, *args, **kwargs)
    monkeypatch.setattr(type(tiny.decoder), "forward", counting)
    tiny.decoder.pass_times.clear()
    try:
        times = pass_times(tiny.decoder, 3, reps=2)
    finally:
        tiny.decoder.pass_times.clear()
    assert calls == [1, 2, 3] * 3 and len(times) == 3


def test_pass_times_are_kept_for_the_next_processes_of_a_boot(tiny_q8, tmp_path, monkeypatch):
    """A measurement is kept in the cache directory, and read back instead of measuring (a CLI call
    measured before each first token: 1.3 s of qwen 1.5B's 2.0 s to `pld`'s) for the same model
    shapes, formats, kernels and cores, on the same boot, for a day; never a stale one, another boot's,
    a damaged file's or one taken on fewer cores than the process may use; `keep=False` never reads."""
    from viasd.execution import timing
    from viasd import compute

    monkeypatch.setenv("VIASD_CACHE", str(tmp_path))
    monkeypatch.delenv("VIASD_NO_TIMING_CACHE")
    monkeypatch.setattr(timing, "_boot_id", lambda: "boot-1")
    budget = compute.budget()
    monkeypatch.setattr(budget, "threads", budget.fixed or budget.cores)  # the machine idle
    monkeypatch.setattr(budget, "update", lambda now=None: budget.threads)
    decoder = tiny_q8.decoder
    calls = []
    own = decoder.forward
    monkeypatch.setitem(decoder.__dict__, "forward",
                        lambda tokens, *a, **kw: (calls.append(int(tokens.shape[0])), own(tokens, *a, **kw))[1])

    def measure(rows=3, last_only=False, keep=True):
        decoder.pass_times.clear()  # a new process: nothing kept in memory
        calls.clear()
        return timing.pass_times(decoder, rows, last_only=last_only, keep=keep), len(calls)

    try:
        first, n = measure()
        assert n == 12 and (tmp_path / timing.STORE_NAME).exists()
        assert measure() == (first, 0)  # read back, no pass
        assert measure(rows=2)[1] == 8 and measure(last_only=True)[1] == 12  # another measurement each
        assert measure(keep=False)[1] == 12  # the benchmark's recorded costs: always measured
        monkeypatch.setattr(timing, "_boot_id", lambda: "boot-2")  # rebooted (or another machine)
        second, n = measure()
        assert n == 12 and measure() == (second, 0)
        store = tmp_path / timing.STORE_NAME
        data = json.loads(store.read_text())
        assert {e["boot"] for e in data.values()} == {"boot-2"}  # the old boot's entries dropped
        for entry in data.values():
            entry["at"] -= timing.STORE_MAX_AGE_S + 1
        store.write_text(json.dumps(data))
        assert measure()[1] == 12  # stale: measured again
        store.write_text('{"torn')
        assert measure()[1] == 12 and measure()[1] == 0  # a damaged file: measured, then kept again
        if (budget.fixed or budget.cores) > 1:
            monkeypatch.setattr(budget, "threads", 1)  # cores taken by other processes
            store.unlink()
            assert measure()[1] == 12 and not store.exists()  # measured, not kept
        monkeypatch.setenv("VIASD_NO_TIMING_CACHE", "1")
        monkeypatch.setattr(budget, "threads", budget.fixed or budget.cores)
        assert measure()[1] == 12 and measure()[1] == 12 and not store.exists()
    finally:
        decoder.pass_times.clear()


@pytest.mark.parametrize("steep", [False, True])
def test_adaptive_draft_lengths_keep_every_drafter_lossless(tiny, tiny_drafter, steep, monkeypatch):
    """Draft lengths chosen round by round (from the tiny model's measured pass costs, or from
    injected ones where each row costs 1.5 passes) never change the greedy output."""
    k, prompt = 4, [1, 5, 6, 7, 5, 6, 7, 5, 6, 7]
    expected = run_ar(tiny, prompt, 40)
    if steep:
        tiny.decoder.pass_times = {(k + 1, False): [0.01 * (1 + 1.5 * j) for j in range(k + 1)]}
        # the injected costs kept: followed, a slow spell in the measured one-row passes (a busy
        # machine: the suite on both cores) made a never-accepted drafter's single drafts pay
        monkeypatch.setattr(DraftLength, "observe_pass", lambda self, rows, seconds: None)
    try:
        for name, drafter in tiny_drafters(tiny, tiny_drafter).items():
            req = DecodeRequest(prompt=prompt, max_new_tokens=40, params=GREEDY, eos=NO_EOS)
            assert speculative_decode(tiny.decoder, drafter, req, k, adaptive=True) == expected, name
            s = req.stats
            assert s.new_tokens == 40 and s.accepted <= s.drafted, name
            if steep and name.startswith("random"):  # never accepted, each row dear: it stops drafting
                assert s.drafted <= 8, s.drafted
            if steep and name == "pld":  # free drafts: scored on what follows, verified when they pay
                assert s.accepted == s.drafted or s.drafted <= 8
    finally:
        tiny.decoder.pass_times.clear()
    costs = pass_times(tiny.decoder, 3)
    assert len(costs) == 3 and costs == sorted(costs) and costs[0] > 0


@pytest.mark.parametrize("kind", ["model", "model-head", "pld", "model-lookup"])
def test_sampled_tokens_follow_the_verifier_distribution(small_vocab_pair, kind):
    """N = 1500 sampled decodes of 4 tokens: the first from the prefill, the next three from one
    verification of k = 2 drafts (accepts, recoveries and bonuses); each position's empirical
    distribution is within TV 0.05 of the exact marginal (sampling noise alone: ~0.02 with 8 tokens).
    model-head: the drafter scores 4 of the 8 tokens only (a reduced head), so its proposal
    distribution is 0 on the others, which the verifier must still produce in their share.
    model-lookup: the model behind 2-token prompt lookup; the prompt holds (5, v) for every first
    token v but 5, so the round verifies looked-up tokens after those and the model's after 5."""
    verifier, drafter_model = small_vocab_pair
    params = SamplingParams(temperature=1.0, top_p=0.95)
    prompt = {"pld": [1, 2, 3, 1, 2], "model-lookup": [5, 0, 5, 1, 5, 2, 5, 3, 5, 4, 5, 6, 5, 7, 5]}.get(kind, [4, 0])
    marginals = exact_marginals(verifier, prompt, params, n=4)
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(4, marginals[0].shape[0])
    n = 1500
    drafted = accepted = looked_up = 0
    for _ in range(n):
        head = drafter_model.decoder.reduced_head([0, 2, 3, 5]) if kind == "model-head" else None
        drafter = ModelDrafter(drafter_model.decoder, params, g, None, head) if kind.startswith("model") else NgramDrafter()
        if kind == "model-lookup":
            drafter = LookupDrafter(drafter, 2)
        req = DecodeRequest(prompt=prompt, max_new_tokens=4, params=params, eos=NO_EOS, generator=g)
        out, stats = speculative_decode(verifier.decoder, drafter, req, k=2), req.stats
        for i, t in enumerate(out):
            counts[i, t] += 1
        drafted, accepted, looked_up = drafted + stats.drafted, accepted + stats.accepted, looked_up + stats.lookup_drafted
    assert 0 < accepted < drafted  # both the accept and the residual paths were exercised
    assert (0 < looked_up < drafted) if kind == "model-lookup" else looked_up == 0
    for i, p in enumerate(marginals):
        assert 0.5 * (counts[i] / n - p).abs().sum() < 0.05, i


# ------------------------------------------------------------------------------------ smollm2

PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Translate to English: Der schnelle braune Fuchs springt über den faulen Hund.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]


@pytest.mark.model
@pytest.mark.parametrize("prompt", PROMPTS)
def test_lossless_strategies_equal_ar_on_smollm2(smollm2, prompt):
    ids = smollm2.encode(prompt)
    expected = run_ar(smollm2, ids, 48, smollm2.eos_token_ids)
    n = smollm2.config.n_layers
    drafters = {
        "sd same-model (always accept)": ModelDrafter(smollm2.decoder, GREEDY, None, None),
        "sd random (never accept)": RandomDrafter(smollm2.config.vocab_size),
        "pld": NgramDrafter(),
        "self-sd default route": SelfDrafter(smollm2.decoder, LayerMask.from_layers(n, default_draft_layers(n)), GREEDY, None, None),
        "self-sd adaptive": SelfDrafter(smollm2.decoder, LayerMask.from_layers(n, default_draft_layers(n)), GREEDY, None, 0.6),
    }
    for name, drafter in drafters.items():
        out, stats = run_sd(smollm2, drafter, ids, 48, k=5, eos=smollm2.eos_token_ids)
        assert out == expected, name
        assert stats.rounds >= 2, name
        if "always" in name:
            assert stats.accepted == stats.drafted


def test_drafter_with_a_reduced_head_drafts_inside_it_and_stays_lossless(tiny, tiny_drafter):
    inside = list(range(0, tiny.config.vocab_size, 2))
    head = tiny_drafter.decoder.reduced_head(inside)
    drafter = ModelDrafter(tiny_drafter.decoder, GREEDY, None, None, head)
    prompt = [1, 2, 3, 4, 5]
    expected = run_ar(tiny, prompt, 24, NO_EOS)
    req = DecodeRequest(prompt=prompt, max_new_tokens=24, params=GREEDY, eos=NO_EOS)
    drafter.begin(64, SimpleNamespace(stats=req.stats, tokens=prompt, passes=req.passes))  # (what a drafter model reads of a verifier)
    assert set(drafter.propose(prompt, 6).tokens) <= set(inside)
    out, stats = run_sd(tiny, ModelDrafter(tiny_drafter.decoder, GREEDY, None, None, head), prompt, 24, k=3, eos=NO_EOS)
    assert out == expected and stats.drafted > 0


@pytest.mark.model
def test_drafter_model_drafts_over_the_verifiers_shipped_slim_vocabulary(smollm2):
    from viasd.routing.route import ModelFingerprint, shipped_route

    vocab = shipped_route(ModelFingerprint.of(smollm2), "slim").vocab
    ids = smollm2.encode(PROMPTS[2])
    ar = generate(ids, smollm2, strategy="ar", max_new_tokens=24).token_ids
    sd = generate(ids, smollm2, strategy="sd", drafter=smollm2, max_new_tokens=24)
    assert sd.config["drafter_head_vocab"] == len(vocab) and sd.token_ids == ar
    full = generate(ids, smollm2, strategy="sd", drafter=smollm2, max_new_tokens=24, reduced_head=False)
    assert full.config["drafter_head_vocab"] is None and full.token_ids == ar


@pytest.mark.model
def test_generate_api_record(smollm2):
    pieces: list[str] = []
    result = generate(PROMPTS[0], smollm2, strategy="pld", max_new_tokens=24, on_text=pieces.append)
    assert "".join(pieces) == result.text and result.text
    d = result.to_dict()
    assert d["token_ids"] == result.token_ids and len(d["token_ids"]) == d["stats"]["new_tokens"] <= 24
    for key in ("new_tokens", "wall_s", "tokens_per_s", "mean_accepted_length", "rejection_rate", "calls"):
        assert key in d["stats"]
    assert d["config"]["strategy"] == "pld" and d["config"]["model"] == "smollm2-135m"
    # sampling is seeded: the same seed gives the same text
    a = generate(PROMPTS[0], smollm2, strategy="self-sd", max_new_tokens=16, temperature=0.8, seed=3)
    b = generate(PROMPTS[0], smollm2, strategy="self-sd", max_new_tokens=16, temperature=0.8, seed=3)
    assert a.token_ids == b.token_ids


@pytest.mark.model
def test_streamed_text_reassembles_to_the_decoded_text_for_any_round_sizes(smollm2):
    import random

    from viasd.api import TextStream
    from viasd.decoding.stats import Source

    texts = ["Ünïcödé → 漢字, emoji 🙂🚀 and a combining e\u0301.", "def f(x):\n    return x  # 😀\n\n\tdone",
             "  two leading spaces<|im_end|>and a special token in the middle", "Привет мир. مرحبا\r\n"]
    rng = random.Random(0)
    for text in texts:
        ids = smollm2.tokenizer.encode(text, add_special_tokens=False)
        for _ in range(3):  # rounds of 1-5 tokens, as speculative strategies commit them
            pieces: list[str] = []
            stream = TextStream(smollm2, lambda tokens: pieces.extend(t.text for t in tokens))
            at = 0
            while at < len(ids):
                n = rng.randint(1, 5)
                stream(ids[at : at + n], [Source.FULL] * n, None)
                at += n
                # every emission ends on a whole character and is a prefix of the text decoded so far
                assert smollm2.decode(ids[:at]).startswith("".join(pieces)), text
            assert "".join(pieces) == smollm2.decode(ids) and stream.ids == ids
            assert len(pieces) == len(ids)  # one piece a token ("" where a token ends inside a character)
    assert TextStream(smollm2, print)._steps is not None  # smollm2's fast tokenizer streams incrementally


@pytest.mark.parametrize("reduced", [False, True])
def test_a_drafter_without_q_drafts_what_one_with_q_drafts(tiny, tiny_drafter, reduced):
    """`probs=False` (greedy loops that read no q) skips the softmax: the same tokens, no q (with a
    reduced head, the argmax among the head's ids without the full-vocabulary row); a sampling
    drafter must keep q (it draws from it)."""
    context = [5, 9, 2, 7, 11]
    head = tiny_drafter.decoder.reduced_head(list(range(1, tiny.config.vocab_size, 3))) if reduced else None
    with_q, without = (ModelDrafter(tiny_drafter.decoder, GREEDY, None, None, head, probs=p) for p in (True, False))
    for d in (with_q, without):
        d.begin(64, Session.start(tiny.decoder, None, DecodeRequest(prompt=context, max_new_tokens=0, params=GREEDY), 64))
    a, b = with_q.propose(context, 5), without.propose(context, 5)
    assert a.tokens == b.tokens and len(a.tokens) == 5
    assert a.probs is not None and a.probs.shape[0] == 5 and b.probs is None
    if reduced:
        assert all(t % 3 == 1 for t in b.tokens)
    with pytest.raises(ValueError, match="keeps its probabilities"):
        ModelDrafter(tiny_drafter.decoder, SamplingParams(temperature=1.0), None, None, probs=False)
