"""Automatic tiered thresholds: the constraint holds, the all-to-full candidate agrees exactly,
and the thresholds file drives `generate`."""

from __future__ import annotations

import json

import pytest

from viasd import generate
from viasd.api import GenerateConfig
from viasd.decoding.tiers import load_thresholds
from viasd.calibrate import ALL_TO_FULL, MIN_GAIN, OFF, calibrate, greedy_agreement, plot_curve, write_thresholds
from viasd.cli import main


def test_calibrate_chooses_fastest_feasible(tiny, tmp_path):
    base = GenerateConfig.from_settings(strategy="viasd", mode="tiered", k=3, max_new_tokens=16, draft="self", slim_layers=(0, 1, 3))
    prompts = [[1, 2, 3, 4, 1, 2], [7, 8, 9, 7, 8]]
    best, cands = calibrate(tiny, base, prompts, grid="small", min_agreement=0.9, progress=False)
    all_full = next(c for c in cands if c.thresholds == ALL_TO_FULL)
    assert all_full.agreement == 1.0  # plain SD: every token is the full model's greedy choice
    assert best.agreement >= 0.9
    fastest = max(c.tokens_per_s for c in cands if c.agreement >= 0.9)
    # the fastest feasible candidate, unless plain SD is within MIN_GAIN of it
    assert best.tokens_per_s == fastest if fastest >= (1 + MIN_GAIN) * all_full.tokens_per_s else best is all_full
    path = write_thresholds(tmp_path / "r.thresholds.json", best, cands, {"model": "tiny"})
    data = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON token {c}"))
    # strict JSON: an infinite threshold is written as "inf" and read back as inf
    assert load_thresholds(path) == best.thresholds.to_dict() and len(data["explored"]) == len(cands) == 32
    # a drafter with a distribution: tier 1 by its confidence alone is tried too, beside every other pair
    assert {c.thresholds.draft_confident for c in cands} == {0.9, OFF}
    png = plot_curve(tmp_path / "curve.png", best, cands, 0.9, "tiny")
    assert png.read_bytes()[:4] == b"\x89PNG"
    # the written file drives tiered decoding
    out = generate(prompts[0], tiny, strategy="viasd", mode="tiered", slim_layers=(0, 1, 3), draft="self",
                   thresholds=str(path), max_new_tokens=8)
    assert out.config["tier_thresholds"] == best.thresholds.to_dict()


def test_greedy_agreement_counts_full_model_choices(tiny):
    prompt = [1, 2, 3]
    ar = generate(prompt, tiny, strategy="ar", max_new_tokens=10).token_ids  # may stop early at EOS
    assert len(ar) >= 6 and greedy_agreement(tiny, prompt, ar) == len(ar)
    wrong = (ar[5] + 1) % 60
    assert greedy_agreement(tiny, prompt, ar[:5] + [wrong] + ar[6:]) <= len(ar) - 1


def test_calibrate_cli_rejects_bad_constraint(capsys):
    assert main(["calibrate", "--min-agreement", "1.5"]) == 2
    assert "--min-agreement must be in (0, 1]" in capsys.readouterr().err


def test_calibrate_without_draft_probabilities_leaves_draft_confident_off(tiny):
    base = GenerateConfig.from_settings(strategy="viasd", mode="tiered", k=3, max_new_tokens=8, draft="pld", slim_layers=(0, 1, 3))
    _, cands = calibrate(tiny, base, [[1, 2, 3, 1, 2, 3, 1]], grid="small", progress=False)
    assert len(cands) == 16 and {c.thresholds.draft_confident for c in cands} == {OFF}


def test_calibrate_correction_mode_chooses_fastest(tiny):
    base = GenerateConfig.from_settings(strategy="viasd", mode="tiered", k=3, max_new_tokens=12, draft="self",
                                        slim_layers=(0, 1, 3), correct=True)
    best, cands = calibrate(tiny, base, [[1, 2, 3, 4, 1, 2], [7, 8, 9, 7, 8]], grid="small", min_agreement=0.99, progress=False)
    assert all(c.agreement == 1.0 for c in cands)  # correction: every output is the full model's greedy one
    fastest = max(cands, key=lambda c: c.tokens_per_s)
    all_full = next(c for c in cands if c.thresholds == ALL_TO_FULL)
    assert best is (fastest if fastest.tokens_per_s >= (1 + MIN_GAIN) * all_full.tokens_per_s else all_full)


def test_correction_mode_reads_its_own_thresholds_beside_the_route(tiny, tmp_path):
    from viasd.routing.route import ModelFingerprint, Route

    route = Route.from_layers(ModelFingerprint.of(tiny), (0, 1, 3)).save(tmp_path / "r.slim.json")
    (tmp_path / "r.slim.thresholds.json").write_text(json.dumps({"accept": 0.5, "slim": 0.6}))
    ids, settings = [1, 2, 3, 4], dict(strategy="viasd", mode="tiered", slim_route=str(route), draft="self", max_new_tokens=4)
    assert generate(ids, tiny, **settings, correct=True).config["tier_thresholds"]["accept"] == 0.5  # the only file
    (tmp_path / "r.slim.correct.thresholds.json").write_text(json.dumps({"accept": 0.7, "slim": 0.8}))
    assert generate(ids, tiny, **settings, correct=True).config["tier_thresholds"]["accept"] == 0.7
    assert generate(ids, tiny, **settings).config["tier_thresholds"]["accept"] == 0.5  # without --correct: the other file
