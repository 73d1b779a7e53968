"""The lean runtime against transformers, and the KV-cache invariant against a cache-free reference."""

from __future__ import annotations

import random

import pytest
import torch

from viasd.models.loading import load_model
from viasd.models.kvcache import LayerMask

from support import reference_logits, save_tiny


def hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids[None]).logits[0]


def cached_logits(model, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Logits of `ids` fed through the cache in blocks of the given sizes."""
    cache = model.decoder.new_cache(len(ids))
    out, start = [], 0
    for n in chunks:
        out.append(model.decoder.forward(ids[start : start + n], start, cache))
        start += n
    assert start == len(ids)
    return torch.cat(out)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_logits_match_transformers_tiny(tmp_path, arch):
    path = save_tiny(tmp_path / arch, arch=arch)
    model = load_model(str(path), progress=False)
    assert model.config.qkv_bias == (arch == "qwen2")
    ids = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(3))
    ref = hf_logits(path, ids)
    for chunks in ([40], [17, 1, 1, 8, 13], [1] * 40):
        assert (cached_logits(model, ids, chunks) - ref).abs().max() < 1e-4


@pytest.mark.model
def test_logits_match_transformers_smollm2(smollm2_f32):
    smollm2 = smollm2_f32  # transformers dequantizes the GGUF to float32: compare like with like
    ids = torch.tensor(smollm2.encode("The capital of France is Paris, and the capital of Germany is"))
    ref = hf_logits(smollm2.path, ids)
    scale = ref.abs().max().item()  # ~40 for this prompt
    # Same GEMM kernels as transformers (MKL): within 1e-4 absolute (measured 8e-5).
    plain = load_model("smollm2-135m", progress=False, pack=False, weights="float32")
    assert (cached_logits(plain, ids, [len(ids) - 5, 1, 4]) - ref).abs().max() < 1e-4
    # Prepacked oneDNN products round differently: within 1e-5 of the logit scale (measured 1.4e-4
    # absolute at scale 39, i.e. 3.7e-6 relative; transformers' own cached and uncached paths differ by 4e-5).
    ours = cached_logits(smollm2, ids, [len(ids) - 5, 1, 4])
    assert (ours - ref).abs().max() < 1e-5 * scale
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_cache_matches_cache_free_reference_across_routes_and_rollbacks(tiny):
    """Random schedule of full passes, routed passes and rollbacks; each pass's logits equal the
    cache-free reference's, so routed passes never corrupt what the full model later reads."""
    rng = random.Random(0)
    n = tiny.config.n_layers
    routes = [None, LayerMask.from_layers(n, [0, 2]), LayerMask.from_layers(n, [1, 2, 3]),
              LayerMask(attn=(True, False, True, True), mlp=(True, True, False, True))]
    cache = tiny.decoder.new_cache(400)
    tokens = [rng.randrange(64) for _ in range(5)]
    tiny.decoder.forward(torch.tensor(tokens), 0, cache)
    checked = {"full": 0, "routed": 0, "rollback": 0}
    for step in range(120):
        route = rng.choice(routes)
        action = rng.random()
        if action < 0.15 and len(tokens) > 8:  # reject some tail: rollback is setting lengths
            keep = rng.randrange(len(tokens) - 6, len(tokens))
            del tokens[keep:]
            cache.rollback(keep)
            checked["rollback"] += 1
            continue
        start = cache.length(route)
        # a pass may also restart earlier than its valid length (recompute)
        if start > 0 and rng.random() < 0.2:
            start = rng.randrange(cache.n_full if route is not None else 0, start + 1)
        new = [rng.randrange(64) for _ in range(rng.randint(1, 5))]
        del tokens[start:]
        tokens.extend(new)
        n_full_before = cache.n_full
        logits = tiny.decoder.forward(torch.tensor(tokens[start:]), start, cache, route=route)
        base = n_full_before if route is not None else 0
        ref = reference_logits(tiny, tokens, base, route)[start - base :]
        # float32 rounding differs with block shapes (~1e-5 relative); stale K/V would differ by O(1)
        assert torch.allclose(logits, ref, atol=1e-4, rtol=1e-4), (step, route, start, (logits - ref).abs().max())
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))
        checked["full" if route is None else "routed"] += 1
    assert min(checked.values()) >= 10, checked


def test_routed_pass_cannot_read_positions_it_did_not_write(tiny):
    route = LayerMask.from_layers(tiny.config.n_layers, [0, 1])
    cache = tiny.decoder.new_cache(32)
    tiny.decoder.forward(torch.tensor([1, 2, 3]), 0, cache)  # n_full = 3
    tiny.decoder.forward(torch.tensor([4, 5]), 3, cache, route=route)  # route valid to 5
    assert cache.n_full == 3 and cache.length(route) == 5
    other = LayerMask.from_layers(tiny.config.n_layers, [2, 3])
    with pytest.raises(ValueError, match="only 3 positions are valid"):
        tiny.decoder.forward(torch.tensor([6]), 5, cache, route=other)
    with pytest.raises(ValueError, match="only 3 positions are valid"):
        tiny.decoder.forward(torch.tensor([6]), 5, cache)  # the full model never read routed K/V
    with pytest.raises(ValueError, match="must start at or after n_full=3"):
        tiny.decoder.forward(torch.tensor([3, 4]), 2, cache, route=route)  # would overwrite full K/V
    tiny.decoder.forward(torch.tensor([4, 5, 6]), 3, cache)  # full pass from n_full overwrites
    assert cache.n_full == 6 and cache.length(route) == 6
    cache.rollback(4)
    assert cache.n_full == 4


def test_route_of_wrong_length_is_rejected(tiny):
    cache = tiny.decoder.new_cache(8)
    with pytest.raises(ValueError, match="route has 3 layers, model has 4"):
        tiny.decoder.forward(torch.tensor([1]), 0, cache, route=LayerMask.from_layers(3, [0]))


def test_cache_overflow_is_an_error(tiny):
    cache = tiny.decoder.new_cache(4)
    with pytest.raises(ValueError, match="overflow"):
        tiny.decoder.forward(torch.tensor([1, 2, 3, 4, 5]), 0, cache)


# ------------------------------------------------------------------ resumed full passes


def resumed_after_slim(model, route: LayerMask, prompt: list[int], block: list[int], lower_rows: int = 0):
    """Logits of `block` by a plain full pass, and by a full pass resumed at the route's prefix after
    one slim pass over all of the block but its last `lower_rows` tokens (those go through the layers
    below it alone first, as `Session.full` sends them)."""
    dec, n = model.decoder, len(prompt)
    plain, resumed = dec.new_cache(64), dec.new_cache(64)
    resumed.enable_resume(route.prefix)
    for cache in (plain, resumed):
        dec.forward(torch.tensor(prompt), 0, cache)
    expected = dec.forward(torch.tensor(block), n, plain)
    slim_rows = len(block) - lower_rows
    dec.forward(torch.tensor(block[:slim_rows]), n, resumed, route=route)
    assert resumed.n_exact == n + slim_rows and resumed.n_full == n
    if lower_rows:
        lower = LayerMask.lower(route.n_layers, route.prefix)
        assert resumed.length(lower) == n + slim_rows  # the layers below the prefix are the full model's there
        assert dec.forward(torch.tensor(block[slim_rows:]), n + slim_rows, resumed, route=lower, logits=False) is None
    got = dec.forward(torch.tensor(block), n, resumed, resume=True)
    assert resumed.n_full == resumed.n_exact == n + len(block)
    return expected, got


@pytest.mark.parametrize("lower_rows", [0, 2])
def test_resumed_full_pass_equals_the_full_pass_bit_for_bit(tiny, lower_rows):
    """A route keeping layers 0..m-1 whole computes the full model's stream entering layer m and its
    K/V below m; a full pass resumed there gives the full pass' logits exactly (the same operations on
    the same values), also for positions the layers below m processed alone."""
    n = tiny.config.n_layers
    route = LayerMask(attn=(True, True, False, True), mlp=(True, True, True, False))
    assert route.prefix == 2
    expected, got = resumed_after_slim(tiny, route, [3, 9, 4, 11, 7], [5, 8, 2, 40, 13], lower_rows)
    assert torch.equal(got, expected)
    assert LayerMask.from_layers(n, range(n)).prefix == n and LayerMask.from_layers(n, [1, 2]).prefix == 0


@pytest.mark.model
def test_resumed_full_pass_on_smollm2(smollm2, smollm2_f32):
    """The same on a real model: native logits equal bit for bit (row-exact products); float32 ones
    within rounding where the last row's layers below m ran alone (oneDNN's one-row products round
    differently from its block products), with the same argmax."""
    ids = smollm2.encode("List three facts about the Moon.")
    route = LayerMask.from_layers(30, list(range(15)) + [27, 28, 29])
    for model in (smollm2, smollm2_f32):
        for lower_rows in (0, 1):
            expected, got = resumed_after_slim(model, route, ids[:-4], ids[-4:] + [1, 2, 3], lower_rows)
            if model.weights == "native" or lower_rows == 0:
                assert torch.equal(got, expected), (model.weights, lower_rows)
            assert torch.allclose(got, expected, atol=1e-4, rtol=1e-5) and torch.equal(got.argmax(-1), expected.argmax(-1))


def test_resume_is_refused_where_states_are_missing_or_stale(tiny):
    n = tiny.config.n_layers
    dec = tiny.decoder
    slim = LayerMask(attn=(True, True, False, True), mlp=(True, True, True, False))  # prefix 2
    other = LayerMask.from_layers(n, [0, 3])  # writes layer 0's K/V from a routed stream
    cache = dec.new_cache(32)
    with pytest.raises(ValueError, match="cannot resume"):
        dec.forward(torch.tensor([1, 2]), 0, cache, resume=True)  # resuming never enabled
    with pytest.raises(ValueError, match="resume layer must be in 1 .. 3"):
        cache.enable_resume(4)
    cache.enable_resume(2)
    dec.forward(torch.tensor([1, 2, 3]), 0, cache)
    with pytest.raises(ValueError, match="empty cache only"):
        cache.enable_resume(2)
    dec.forward(torch.tensor([4, 5]), 3, cache, route=slim)
    assert cache.resumable(3, 5) and not cache.resumable(3, 6)
    dec.forward(torch.tensor([4, 6]), 3, cache, route=other)  # position 4 now holds another token's K/V below 2
    assert cache.n_exact == 3
    with pytest.raises(ValueError, match="cannot resume at layer 2: stored states reach 3"):
        dec.forward(torch.tensor([4, 5]), 3, cache, resume=True)
    dec.forward(torch.tensor([4, 5]), 3, cache, route=slim)
    cache.rollback_route(slim, 4)  # its rejected draft's state goes with it
    assert cache.n_exact == 4 and not cache.resumable(3, 5)


def test_cache_with_resume_matches_cache_free_reference(tiny):
    """The random schedule of full, routed and resumed passes and rollbacks: each pass' logits equal
    the cache-free reference's, and every resumed pass equals a plain full pass on a twin cache."""
    rng = random.Random(1)
    n = tiny.config.n_layers
    routes = [None, LayerMask(attn=(True, True, False, True), mlp=(True, True, True, False)),
              LayerMask.from_layers(n, [0, 1, 2]), LayerMask.from_layers(n, [0, 3]), LayerMask.lower(n, 2)]
    dec = tiny.decoder
    cache = dec.new_cache(400)
    cache.enable_resume(2)
    tokens = [rng.randrange(64) for _ in range(5)]
    dec.forward(torch.tensor(tokens), 0, cache)
    resumed = 0
    for step in range(300):
        if rng.random() < 0.15 and len(tokens) > 8:
            keep = rng.randrange(len(tokens) - 6, len(tokens))
            if rng.random() < 0.5:  # one route's rejected drafts only
                cache.rollback_route(rng.choice(routes[1:]), rng.randrange(keep, len(tokens) + 1))
            del tokens[keep:]
            cache.rollback(keep)
            continue
        route = rng.choice(routes)
        start = cache.length(route)
        if route is None and start < len(tokens) and cache.resumable(start, len(tokens)) and rng.random() < 0.7:
            logits = dec.forward(torch.tensor(tokens[start:]), start, cache, resume=True)
            ref = reference_logits(tiny, tokens, 0, None)[start:]
            assert torch.allclose(logits, ref, atol=1e-4, rtol=1e-4), (step, (logits - ref).abs().max())
            resumed += 1
            continue
        new = [rng.randrange(64) for _ in range(rng.randint(1, 5))]
        del tokens[start:]
        tokens.extend(new)
        base = cache.n_full if route is not None else 0
        logits = dec.forward(torch.tensor(tokens[start:]), start, cache, route=route)
        ref = reference_logits(tiny, tokens, base, route)[start - base :]
        assert torch.allclose(logits, ref, atol=1e-4, rtol=1e-4), (step, route, start, (logits - ref).abs().max())
    assert resumed >= 10, resumed
