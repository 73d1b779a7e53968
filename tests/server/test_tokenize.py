"""POST /tokenize and /detokenize, in llama-server's shapes."""

from __future__ import annotations

import httpx

from helpers import MODEL


def test_tokenize_and_detokenize_round_trip(live, smollm2):
    text = "Hello world, naïve café"
    r = httpx.post(live.url + "/tokenize", json={"content": text})
    assert r.status_code == 200
    ids = r.json()["tokens"]
    assert ids == smollm2.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert httpx.post(live.url + "/detokenize", json={"tokens": ids, "model": MODEL}).json() == {"content": text}
    pieces = httpx.post(live.url + "/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert joined.decode("utf-8") == text


def test_tokenize_bad_input_names_the_field(live):
    r = httpx.post(live.url + "/tokenize", json={"text": "hi"})
    assert r.status_code == 422 and r.json()["error"]["param"] in ("content", "text")
    r = httpx.post(live.url + "/detokenize", json={"tokens": [1, 10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert "outside the vocabulary" in r.json()["error"]["message"]
    r = httpx.post(live.url + "/detokenize", json={"tokens": [-1]})
    assert r.status_code == 422 and r.json()["error"]["param"].startswith("tokens")
    r = httpx.post(live.url + "/tokenize", json={"content": "hi", "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
