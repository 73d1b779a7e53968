"""logprobs / top_logprobs on both endpoints, each token's source (`viasd.provenance`) and /v1/models'
`viasd` object, through the official `openai` client."""

from __future__ import annotations

import math
from collections import Counter

import httpx
import pytest

from viasd import generate

from helpers import HAIKU, MODEL, check_error

GREEDY = {"temperature": 0, "max_tokens": 16}


def chat(client, stream=False, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": HAIKU}], stream=stream,
                                          **GREEDY, **kw)


def test_chat_logprobs_are_the_full_model_s_for_every_strategy_streamed_or_not(client, smollm2):
    ref = generate([{"role": "user", "content": HAIKU}], smollm2, strategy="ar", max_new_tokens=16, logprobs=5, progress=False)
    for strategy in ("ar", "pld", "self-sd", "viasd"):
        r = chat(client, logprobs=True, top_logprobs=5, extra_body={"viasd": {"strategy": strategy}})
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens == len(ref.token_ids), strategy
        for entry, lp, t in zip(content, ref.logprobs, ref.token_ids):
            assert entry.logprob == pytest.approx(lp.logprob, abs=1e-4), strategy
            assert bytes(entry.bytes) == smollm2.vocabulary.pieces[t]
            assert len(entry.top_logprobs) == 5 and entry.top_logprobs[0].token == entry.token  # greedy: the top one
            assert [e.logprob for e in entry.top_logprobs] == pytest.approx([v for _, v in lp.top], abs=1e-4)
        assert sum(math.exp(e.logprob) for e in content[0].top_logprobs) <= 1 + 1e-5
        chunks = list(chat(client, stream=True, logprobs=True, top_logprobs=5, extra_body={"viasd": {"strategy": strategy}}))
        streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content], strategy
    plain = chat(client)
    assert plain.choices[0].logprobs is None
    r = chat(client, logprobs=True)  # no alternatives asked for
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)


def test_completions_logprobs_in_the_legacy_shape(client, smollm2):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(len(top) <= 3 and max(top.values()) == pytest.approx(v, abs=1e-6) for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", logprobs=3, stream=True, **GREEDY))
    streamed = [(t, v, o) for c in chunks if c.choices and c.choices[0].logprobs
                for t, v, o in zip(c.choices[0].logprobs.tokens, c.choices[0].logprobs.token_logprobs, c.choices[0].logprobs.text_offset)]
    assert streamed == list(zip(lp.tokens, lp.token_logprobs, lp.text_offset))


def test_provenance_tells_who_settled_each_token_and_adds_up(client):
    extension = {"viasd": {"strategy": "viasd", "adapt_k": False, "provenance": True}}
    chunks = list(client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5, 6, 7, 8,", stream=True, extra_body=extension,
                                            **GREEDY))
    tokens = [t for c in chunks for t in (c.model_extra.get("viasd") or {}).get("tokens", [])]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    stats = chunks[-1].model_extra["viasd"]["stats"]
    assert "".join(t["text"] for t in tokens) == text
    assert Counter(t["by"] for t in tokens) == +Counter(stats["sources"])
    assert len(tokens) == stats["new_tokens"] and Counter(t["by"] for t in tokens)["draft"] > 0
    whole = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5, 6, 7, 8,", extra_body=extension, **GREEDY)
    assert whole.model_extra["viasd"]["tokens"] == tokens
    # without it: plain OpenAI chunks
    plain = list(client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5, 6, 7, 8,", stream=True, **GREEDY))
    assert all("tokens" not in (c.model_extra.get("viasd") or {}) for c in plain)


def test_provenance_with_a_stop_string_carries_exactly_the_text_sent(client):
    extension = {"viasd": {"strategy": "pld", "provenance": True}}
    for stream in (True, False):
        r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5, 6, 7, 8,", stop=["11"], stream=stream,
                                      extra_body=extension, **GREEDY)
        chunks = list(r) if stream else [r]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        tokens = [t for c in chunks for t in (c.model_extra.get("viasd") or {}).get("tokens", [])]
        assert "11" not in text and text.endswith("10, ")
        assert "".join(t["text"] for t in tokens) == text


def test_bad_logprobs_values_name_the_field(live):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(live.url + "/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": 21})
    check_error(r, 422, None)
    assert r.json()["error"]["param"] == "top_logprobs"
    r = httpx.post(live.url + "/v1/chat/completions", json={**body, "top_logprobs": 2})
    check_error(r, 400, "invalid_value")
    assert r.json()["error"]["param"] == "top_logprobs" and "logprobs" in r.json()["error"]["message"]
    r = httpx.post(live.url + "/v1/chat/completions", json={**body, "logprobs": True, "viasd": {"strategy": "viasd", "mode": "tiered"}})
    check_error(r, 400, "invalid_value")
    assert r.json()["error"]["param"] == "logprobs" and "tiered" in r.json()["error"]["message"]
    r = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "logprobs": -1})
    check_error(r, 422, None)
    assert r.json()["error"]["param"] == "logprobs"
    r = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "viasd": {"provenance": "yes"}})
    check_error(r, 422, None)


def test_models_lists_what_a_request_may_choose(client, smollm2):
    (entry,) = client.models.list().data
    options = entry.model_extra["viasd"]
    assert entry.id == MODEL and options["default_strategy"] == "pld" and options["drafter"] is None
    assert "viasd" in options["strategies"] and options["modes"] == ["lossless", "tiered"]
    assert {r["name"] for r in options["routes"]} == {"slim", "draft"}
    for route in options["routes"]:
        assert 0 < route["fraction"] < 1 and all(0 <= i < smollm2.config.n_layers for i in route["attention"] + route["mlp"])
