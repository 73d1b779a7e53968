"""Prompt prefix caching (execution/prefix.py): what is kept and found, and that reuse changes no token."""

from __future__ import annotations

import httpx
import pytest
import torch

from viasd.api import generate
from viasd.execution.passes import Passes
from viasd.execution.prefix import MIN_REUSE, PrefixCache

from live_server import LiveServer, metric


def _kv(n: int, fill: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.full((2, 1, n, 4), fill)
    return k, k + 0.5


def test_lookup_finds_the_longest_shared_prefix_and_leaves_the_last_row_to_compute():
    cache = PrefixCache(1 << 20)
    cache.store([1, 2, 3, 4, 5, 6], *_kv(6, 1.0))
    cache.store([1, 2, 3, 9, 9, 9, 9, 9], *_kv(8, 2.0))
    n, k, v, hidden = cache.lookup([1, 2, 3, 4, 5, 7, 7])
    assert n == 5 and k[0, 0, 0, 0] == 1.0 and v[0, 0, 0, 0] == 1.5 and hidden is None
    assert cache.lookup([1, 2, 3, 4, 5, 6])[0] == 5  # the same prompt: all but its last position
    assert cache.lookup([1, 2, 3, 9, 9, 9, 8])[0] == 6 and cache.lookup([1, 2, 3, 9, 9, 9, 8])[1][0, 0, 0, 0] == 2.0
    assert cache.lookup([1, 2, 3, 7, 7]) is None  # 3 shared positions: fewer than MIN_REUSE
    assert cache.lookup([5, 1, 2, 3]) is None
    assert MIN_REUSE == 4 and cache.hits == 4 and cache.lookups == 6
    # a cache keeping residual streams for resumed passes (VIA-SD) only meets entries kept at its layer
    cache.store([1, 2, 3, 4, 5, 6, 7], *_kv(7, 4.0), hidden=torch.full((7, 3), 5.0), layer=2)
    n, k, v, hidden = cache.lookup([1, 2, 3, 4, 5, 6, 7, 8], layer=2)
    assert n == 7 and k[0, 0, 0, 0] == 4.0 and hidden.shape == (7, 3) and hidden[0, 0] == 5.0
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7, 8])[0] == 6 and cache.lookup([1, 2, 3, 4, 5, 6, 7, 8])[3] is None
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7, 8], layer=1) is None


def test_the_byte_budget_drops_the_least_recently_used_and_an_extension_replaces_its_prefix():
    one = 2 * 2 * 1 * 8 * 4 * 4  # k and v of 8 positions, float32
    cache = PrefixCache(2 * one)
    cache.store(list(range(8)), *_kv(8))
    cache.store(list(range(10, 18)), *_kv(8))
    assert cache.lookup(list(range(8)) + [99])[0] == 8  # touched: now the most recent
    cache.store(list(range(20, 28)), *_kv(8))  # over budget: the least recently used (10..17) goes
    assert cache.nbytes == 2 * one
    assert cache.lookup(list(range(10, 18)) + [99]) is None and cache.lookup(list(range(8)) + [99]) is not None
    cache.store(list(range(8)) + [8, 9, 10, 11], *_kv(12, 3.0))  # extends 0..7: replaces it
    assert cache.lookup(list(range(8)) + [99])[1][0, 0, 0, 0] == 3.0
    # 0..7 replaced (512 bytes freed), then 20..27 dropped for room: the extension alone is left
    assert cache.nbytes == one * 12 // 8 and cache.lookup(list(range(20, 28)) + [99]) is None
    tiny_budget = PrefixCache(10)
    tiny_budget.store(list(range(8)), *_kv(8))  # larger than the whole budget: not kept
    assert tiny_budget.nbytes == 0


@pytest.mark.parametrize("model_name", ["tiny", "tiny_q8"])
def test_reused_prefixes_change_no_token_and_skip_their_rows(model_name, request, tiny_drafter, monkeypatch):
    """Prompts sharing a prefix, decoded through the cache by every strategy: the tokens are those
    decoded without it, and the shared positions are not computed again."""
    model = request.getfixturevalue(model_name)
    rows = []
    real = model.decoder.forward

    def counting(tokens, start, *args, **kwargs):
        rows.append((start, len(tokens)))
        return real(tokens, start, *args, **kwargs)

    base = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12"
    prompts = [base + " w13", base + " w20 w21", base + " w13"]
    cases = [({"strategy": "ar"}, None), ({"strategy": "pld"}, None), ({"strategy": "sd", "k": 3}, tiny_drafter),
             ({"strategy": "viasd", "mode": "lossless", "slim_layers": (0, 1, 3)}, None)]
    for settings, drafter in cases:
        alone = [generate(p, model, drafter=drafter, max_new_tokens=12, chat=False, progress=False, **settings).token_ids
                 for p in prompts]
        kept = PrefixCache(16 << 20)
        monkeypatch.setitem(model.decoder.__dict__, "forward", counting)  # (undone without leaving an attribute)
        rows.clear()
        reused = [generate(p, model, drafter=drafter, max_new_tokens=12, chat=False, progress=False,
                           passes=Passes(prefix=[(model.decoder, kept)]), **settings).token_ids for p in prompts]
        del model.decoder.__dict__["forward"]
        assert reused == alone, settings
        n = len(model.encode(base, chat=False))
        assert kept.hits == 2 and kept.reused_positions >= 2 * n - 1, (settings, kept.hits, kept.reused_positions)
        assert rows[0][0] == 0  # the first prompt is computed from position 0 ...
        assert not any(start == 0 for start, _ in rows[1:]), settings  # ... the others from their shared prefix


def test_a_pass_that_wants_every_rows_logits_is_not_served_from_the_cache(tiny):
    kept = PrefixCache(1 << 20)
    ids = torch.arange(4, 20)
    passes = Passes(prefix=[(tiny.decoder, kept)])
    c1 = tiny.decoder.new_cache(64)
    passes.forward(tiny.decoder, ids, 0, c1, last_only=True)
    c2 = tiny.decoder.new_cache(64)
    full = passes.forward(tiny.decoder, ids, 0, c2)  # every row's logits: computed, not looked up
    assert kept.lookups == 1 and full.logits.shape[0] == ids.shape[0]
    tiny.decoder.forward(ids, 0, tiny.decoder.new_cache(64), last_only=True)  # the decoder alone: no cache
    assert kept.lookups == 1


def test_the_server_reuses_its_template_prefix_and_answers_as_without(tiny_q8):
    from viasd.server.app import ServeSettings, create_app

    def answers(prefix_mb: int):
        app = create_app(tiny_q8, settings=ServeSettings(served_name="tiny", prefix_cache=prefix_mb << 20))
        with LiveServer(app) as live:
            out = []
            for tail in ("w13", "w20 w21", "w13"):
                r = httpx.post(live.url + "/v1/completions", timeout=120,
                               json={"model": "tiny", "prompt": "w1 w2 w3 w4 w5 w6 w7 w8 " + tail, "max_tokens": 10})
                assert r.status_code == 200, r.text
                out.append(r.json()["choices"][0]["text"])
            m = live.metrics()
            return out, metric(m, "viasd_prefix_cache_reused_tokens"), metric(m, "viasd_prefix_cache_bytes")

    with_cache, reused, kept = answers(16)
    without, reused_off, kept_off = answers(0)
    assert with_cache == without
    assert reused >= 2 * 8 and kept > 0
    assert reused_off == 0 and kept_off == 0
