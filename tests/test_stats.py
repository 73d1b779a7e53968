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
