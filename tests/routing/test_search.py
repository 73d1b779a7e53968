"""DIMR search: the full route costs nothing, a planted best mask is found, seeded runs repeat,
and an interrupted study resumes without losing completed trials."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import torch

from viasd.models.loading import load_model
from viasd.models.kvcache import LayerMask
from viasd.routing import Route
from viasd.routing.search import build_calibration, evaluate_route, kept_from_scores, kept_within_bytes, search_route

from support import save_tiny

PLANTED = [0, 2, 5, 7]  # the informative layers; the others are no-ops


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VIASD_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def planted_dir(tmp_path_factory):
    """8 layers; layers outside PLANTED have zero output projections, so they change nothing."""
    from safetensors.torch import load_file, save_file

    path = save_tiny(tmp_path_factory.mktemp("planted"), n_layers=8, seed=3)
    f = path / "model.safetensors"
    state = load_file(f)
    for i in set(range(8)) - set(PLANTED):
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            state[f"model.layers.{i}.{name}"].zero_()
    save_file(state, f, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def planted(planted_dir):
    return load_model(str(planted_dir), progress=False)


@pytest.fixture(scope="module")
def bpe_pair_models(tmp_path_factory):
    """A byte-level BPE verifier and its twin: the same weights, behind the same tokenizer with one
    token added (another vocabulary, whose extra token has a zero embedding)."""
    from safetensors.torch import load_file, save_file

    from support import bpe_tokenizer

    tok = bpe_tokenizer(300, ["the quick brown fox jumps over the lazy dog", "hello world, hello there"] * 20)
    v_dir = save_tiny(tmp_path_factory.mktemp("bv"), seed=3, tokenizer=tok)
    d_dir = save_tiny(tmp_path_factory.mktemp("bd"), seed=3, tokenizer=tok)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(d_dir)
    state = load_file(v_dir / "model.safetensors")
    for name, w in list(state.items()):
        if w.shape[0] == 300 and w.dim() == 2:  # embedding (and a separate head): one row more
            state[name] = torch.cat([w, torch.zeros(1, w.shape[1])])
    save_file(state, d_dir / "model.safetensors", metadata={"format": "pt"})
    import json

    cfg = json.loads((d_dir / "config.json").read_text())
    cfg["vocab_size"] = 301
    (d_dir / "config.json").write_text(json.dumps(cfg))
    return load_model(str(v_dir), progress=False), load_model(str(d_dir), progress=False)


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 61, (8,), generator=g).tolist() for _ in range(3)]


def test_full_route_costs_nothing(tiny):
    calib = build_calibration(tiny, seq_len=32, top_k=16, progress=False, prompts=prompts())
    full = evaluate_route(tiny, calib, None)
    assert full["kl"] == pytest.approx(0, abs=1e-6) and full["tv"] == pytest.approx(0, abs=1e-6)
    assert full["top1_agreement"] == 1.0
    partial = evaluate_route(tiny, calib, LayerMask.from_layers(4, [0, 1]))
    assert partial["kl"] > 0.01 and partial["tv"] > 0.01


def test_kept_from_scores():
    assert kept_from_scores({1: 0.9, 2: 0.1, 3: 0.5}, 4, [0, 4]) == [0, 1, 3, 4]
    assert kept_from_scores({1: 0.2, 2: 0.3}, 1, []) == [2]


def test_kept_within_bytes():
    sizes = [4, 3, 3, 2, 4]
    # pinned 0 and 4 (8 bytes), then by score while it fits: 1 (11), 3 (13); 2 no longer fits
    assert kept_within_bytes({1: 0.9, 2: 0.5, 3: 0.1}, [0, 4], sizes, 13) == [0, 1, 3, 4]
    assert kept_within_bytes({1: 0.9, 2: 0.5, 3: 0.1}, [0, 4], sizes, 8) == [0, 4]


def test_byte_budget_search_counts_the_head_and_fills_the_budget(planted):
    """--budget-unit bytes: the slim pass' weight bytes, head included, stay within the budget, and
    no layer left out would still fit; a budget that cannot hold the head and the pinned layers is
    refused; the route records what it and a full pass resumed after it read."""
    from viasd.errors import UsageError

    calib = build_calibration(planted, seq_len=32, top_k=16, progress=False, prompts=prompts())
    dec, n = planted.decoder, 8
    full = dec.weight_bytes()
    route = search_route(planted, 0.6, 8, seed=0, calib=calib, n_random=4, progress=False, prefix=2, head_vocab=20,
                         budget_unit="bytes")
    head = dec.reduced_head(route.vocab)
    used = dec.weight_bytes(route.mask, head=head)
    assert used <= 0.6 * full and route.metrics["weight_bytes_fraction"] == pytest.approx(used / full, abs=1e-4)
    assert route.kept_layers[:2] == [0, 1] and 7 in route.kept_layers
    layer = dec.weight_bytes(LayerMask.from_layers(n, [3]), head=False)  # every layer of the tiny model is alike
    assert used + layer > 0.6 * full  # full: another layer would not fit
    assert route.metrics["resumed_full_fraction"] == pytest.approx(dec.weight_bytes(None, from_layer=route.mask.prefix) / full, abs=1e-4)
    assert route.search["budget_unit"] == "bytes"
    with pytest.raises(UsageError, match="cannot hold the LM head"):
        search_route(planted, 0.05, 2, calib=calib, progress=False, budget_unit="bytes")
    with pytest.raises(UsageError, match="unknown --budget-unit 'flops'"):
        search_route(planted, 0.5, 2, calib=calib, progress=False, budget_unit="flops")


def test_search_finds_the_planted_mask_and_repeats_with_a_seed(planted):
    calib = build_calibration(planted, seq_len=32, top_k=16, progress=False, prompts=prompts())
    assert evaluate_route(planted, calib, LayerMask.from_layers(8, PLANTED))["kl"] == pytest.approx(0, abs=1e-6)
    a = search_route(planted, 0.5, 60, seed=1, pin_ends=False, calib=calib, n_random=15, progress=False)
    assert a.kept_layers == PLANTED and a.metrics["kl"] == pytest.approx(0, abs=1e-6)
    b = search_route(planted, 0.5, 60, seed=1, pin_ends=False, calib=calib, n_random=15, progress=False)
    assert b.kept_layers == a.kept_layers and b.metrics == a.metrics


def complete_trials(db) -> int:
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(db) as con:
            return con.execute("select count(*) from trials where state = 'COMPLETE'").fetchone()[0]
    except sqlite3.Error:
        return 0


def test_interrupted_search_resumes(planted_dir, tmp_path):
    out = tmp_path / "route.json"
    db = tmp_path / "route.optuna.sqlite"
    cmd = [sys.executable, "-m", "viasd", "search", "--model", str(planted_dir), "--budget", "0.5", "--trials", "150",
           "--seed", "2", "--calib-seqs", "2", "--calib-len", "24", "--no-pin-ends", "--out", str(out), "-q"]
    env = {**os.environ, "VIASD_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while complete_trials(db) < 10 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    interrupted_at = complete_trials(db)
    assert 10 <= interrupted_at < 150, "the run should have been killed mid-study"
    assert not out.exists()
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert complete_trials(db) == 150  # nothing lost, nothing run twice
    route = Route.load(out)
    assert route.search["trials"] == 150 and len(route.kept_layers) == 4


def test_frequent_vocab_ranks_counts_then_ids():
    from collections import Counter

    from viasd.routing.vocab import coverage, frequent_vocab

    counts = Counter({40: 5, 7: 9, 63: 1, 99: 4})  # 99: outside a 64-token vocabulary
    vocab = frequent_vocab(counts, 64, 5, always=[50])
    # rounded up to 16: 50 (always), 7, 40, 63 by count, then the lowest other ids
    assert vocab == tuple(sorted({50, 7, 40, 63} | set(range(13))))
    assert frequent_vocab(counts, 64, 100) == tuple(range(64))
    assert coverage(vocab, [7, 7, 50, 62]) == 0.75
    with pytest.raises(Exception, match="at least 1 token"):
        frequent_vocab(counts, 64, 0)


def test_prefix_search_keeps_lower_layers_whole_and_stores_a_vocabulary(planted, tmp_path):
    from viasd.errors import UsageError

    calib = build_calibration(planted, seq_len=32, top_k=16, progress=False, prompts=prompts())
    route = search_route(planted, 0.75, 12, seed=0, calib=calib, n_random=6, progress=False, prefix=4, head_vocab=20)
    assert route.kept_layers[:4] == [0, 1, 2, 3] and route.mask.prefix >= 4 and len(route.kept_layers) == 6
    assert len(route.vocab) == 32 and list(route.vocab) == sorted(set(route.vocab))
    assert planted.eos_token_ids <= set(route.vocab)
    assert route.metrics["vocab_size"] == 32 and 0 < route.metrics["vocab_top1_coverage_calibration"] <= 1
    again = Route.load(route.save(tmp_path / "r.json"))
    assert again.vocab == route.vocab and again == route
    with pytest.raises(UsageError, match="--prefix must be in 0 .. 6"):
        search_route(planted, 0.75, 2, calib=calib, progress=False, prefix=7)


def test_routes_vocab_adds_a_head_and_routes_show_draws_it(planted, planted_dir, tmp_path, capsys):
    from viasd.cli import main

    calib = build_calibration(planted, progress=False)  # the default calibration `routes vocab` reads
    route = search_route(planted, 0.75, 4, seed=0, calib=calib, n_random=4, progress=False, prefix=3)
    path = route.save(tmp_path / "r.json")
    assert main(["routes", "vocab", str(path), "--size", "20", "--model", str(planted_dir), "-q"]) == 0
    stored = Route.load(path)
    assert len(stored.vocab) == 32 and stored.mask == route.mask and stored.metrics["vocab_size"] == 32
    capsys.readouterr()
    assert main(["routes", "show", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "resumes full passes at layer" in shown and "reduced: 32 tokens" in shown
    other = tmp_path / "other.json"
    path.write_text(path.read_text().replace('"n_layers": 8', '"n_layers": 9'))
    assert main(["routes", "vocab", str(path), "--size", "20", "--model", str(planted_dir), "-o", str(other), "-q"]) == 2
    assert not other.exists()


def test_the_calibration_text_is_ar_s_greedy_continuation(tiny):
    from viasd.routing.search import greedy_continuation

    from support import run_ar

    prompt = [1, 5, 9, 3]
    assert greedy_continuation(tiny.decoder, prompt, 30) == run_ar(tiny, prompt, 30)


def test_drafter_misses_weigh_the_search_where_the_drafter_is_wrong(tiny, tiny_drafter, bpe_pair_models):
    """The verifier drafting for itself misses nothing; another model misses where its greedy token
    differs (as counted directly); the rescue costs are the costs over those positions only."""
    from viasd.routing.search import RESCUE_COSTS, drafter_misses

    calib = build_calibration(tiny, seq_len=32, top_k=16, progress=False, prompts=prompts())
    assert not any(bool(m.any()) for m in drafter_misses(tiny, tiny, calib))
    calib.misses = drafter_misses(tiny, tiny_drafter, calib)
    for seq, plen, wrong in zip(calib.sequences, calib.prompt_lens, calib.misses):
        logits = tiny_drafter.decoder.forward(seq[:-1], 0, tiny_drafter.decoder.new_cache(len(seq)))[plen - 1 :]
        assert torch.equal(wrong, logits.argmax(-1) != seq[plen:])
    route = LayerMask.from_layers(4, [0, 3])
    m = evaluate_route(tiny, calib, route)
    assert set(RESCUE_COSTS) <= set(m) and m["top1_agreement_where_drafter_wrong"] <= 1.0
    calib.misses = [torch.ones_like(w) for w in calib.misses]  # every position: the plain costs
    every = evaluate_route(tiny, calib, route)
    assert every["kl_where_drafter_wrong"] == pytest.approx(every["kl"]) and every["tv_where_drafter_wrong"] == pytest.approx(every["tv"])
    with pytest.raises(Exception, match="needs a drafter whose misses it weighs"):
        calib.misses = None
        search_route(tiny, 0.5, 2, calib=calib, cost="kl_where_drafter_wrong", progress=False)
    # across vocabularies: the twin predicts the verifier's token wherever one of its own tokens ends
    # where the next verifier token starts, and misses exactly the other positions
    v, twin = bpe_pair_models
    assert v.tokenizer.get_vocab() != twin.tokenizer.get_vocab()
    calib = build_calibration(v, seq_len=24, top_k=8, progress=False, prompts=[v.vocabulary.encode("the quick brown fox")])
    seq, plen = calib.sequences[0].tolist(), calib.prompt_lens[0]
    wrong = drafter_misses(v, twin, calib)[0]
    ends = [len(v.vocabulary.text_bytes(seq[: j + 1])) for j in range(len(seq))]
    twin_ids = twin.vocabulary.encode(v.vocabulary.text_bytes(seq).decode())
    boundaries = {len(twin.vocabulary.text_bytes(twin_ids[: m + 1])) for m in range(len(twin_ids))}
    assert wrong.tolist() == [ends[j] not in boundaries for j in range(plen - 1, len(seq) - 1)]
