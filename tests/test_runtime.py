"""The lean runtime against transformers, and the KV-cache invariant against a cache-free reference."""

from __future__ import annotations

import random

import pytest
import torch

from viasd.models.loading import load_model
from viasd.models.runtime import LayerMask

from conftest import reference_logits, save_tiny


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
