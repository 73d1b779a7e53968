"""Decode statistics: counters, derived rates, and merging the turns of a conversation."""

from __future__ import annotations

import pytest

from viasd.decoding.stats import DecodeStats


def test_stats_merge_adds_up():
    a, b = DecodeStats(prompt_tokens=5), DecodeStats(prompt_tokens=9)
    a.observe_call("full", 3, verifier_share=1.0), b.observe_call("slim", 2, verifier_share=0.5)
    a.observe_round(4, 2), b.observe_round(2, 2), b.observe_round(5, 0)
    a.observe_tokens(3), b.observe_tokens(6)
    a.observe_tiers([1, 3, 3]), b.observe_tiers([2] * 6)
    m = a.merge(b).to_dict()
    assert m["calls"] == {"full": 3, "slim": 2} and m["new_tokens"] == 9 and m["prompt_tokens"] == 14
    assert m["verifier_layer_passes_per_token"] == pytest.approx(4.0 / 9, abs=1e-4)
    assert (m["drafted"], m["accepted"], m["rounds"]) == (11, 4, 3)
    assert m["acceptance_per_position"] == pytest.approx([2 / 3, 2 / 3, 0.0, 0.0, 0.0], abs=1e-4)
    assert m["tiers"] == {"accept": 1, "slim": 6, "full": 2}


def test_cost_in_full_passes_by_bytes_read(tiny, tiny_drafter):
    """Issue 11's accounting: each call's weights read (kept sub-layers and the LM head; a drafter
    model's own weights), over the bytes of one full verifier pass."""
    from viasd import generate
    from viasd.models.kvcache import LayerMask

    dec, n = tiny.decoder, tiny.config.n_layers
    full = dec.weight_bytes()
    attn_only, mlp_only = LayerMask((True,) * n, (False,) * n), LayerMask((False,) * n, (True,) * n)
    head = dec.lm_head.out_features * dec.lm_head.in_features * 4  # float32
    assert dec.weight_bytes(attn_only) + dec.weight_bytes(mlp_only) == full + head
    assert dec.weight_bytes(LayerMask.from_layers(n, range(n))) == full
    ar = generate([5, 6, 7, 8], tiny, strategy="ar", max_new_tokens=12).stats.to_dict()
    assert ar["full_pass_bytes"] == full and ar["bytes_read"] == 12 * full  # the prefill and 11 one-token passes
    assert ar["full_pass_equivalents_per_token"] == 1.0
    sd = generate([5, 6, 7, 8], tiny, drafter=tiny_drafter, strategy="sd", max_new_tokens=12).stats.to_dict()
    drafter = tiny_drafter.decoder.weight_bytes()
    drafter_head = tiny_drafter.decoder.lm_head.out_features * tiny_drafter.decoder.lm_head.in_features * 4
    # the drafter's prompt pass fills its cache without a head; each drafting pass reads it all
    assert sd["bytes_read"] == sd["calls"]["full"] * full + sd["calls"]["draft"] * drafter - drafter_head
    assert sd["full_pass_equivalents_per_token"] == round(sd["bytes_read"] / full / 12, 4)


def test_host_time_per_drafted_token_counts_only_decode_rounds_that_drafted(monkeypatch):
    """`host_ms_per_drafted`: between consecutive verification rounds, the wall time not spent in
    passes, summed over the rounds that drafted, over their drafts; rounds before the first token
    and rounds without drafts are left out."""
    from viasd.decoding import stats as stats_module

    clock, passes = [0.0], [0.0]
    monkeypatch.setattr(stats_module.time, "perf_counter", lambda: clock[0])
    s = DecodeStats(pass_seconds=lambda: passes[0])
    s.observe_round(3, 1)  # before the first token: not counted
    s.observe_tokens(1)  # the first token: decode-only from here
    s.observe_round(0, 0)  # the first decode round marks the start
    clock[0], passes[0] = 0.050, 0.046  # a round with 2 drafts: 4 ms host
    s.observe_round(2, 2)
    clock[0], passes[0] = 0.080, 0.070  # no drafts: 6 ms host, not counted
    s.observe_round(0, 0)
    clock[0], passes[0] = 0.130, 0.119  # slim rounds between count their drafts too: 3 drafts, 1 ms host
    s.observe_round(2, 1, verification=False)
    s.observe_round(1, 1)
    d = s.to_dict()
    assert d["host_ms_per_drafted"] == pytest.approx(5.0 / 5, abs=1e-6)
    assert s.merge(DecodeStats()).to_dict()["host_ms_per_drafted"] == d["host_ms_per_drafted"]
    assert DecodeStats().to_dict()["host_ms_per_drafted"] is None
