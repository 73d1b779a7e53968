"""`viasd serve`'s bad input (never a 500, never a traceback) and its API key."""

from __future__ import annotations

import http.client
import json

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from viasd.server import ServeSettings, create_app  # noqa: E402
from live_server import LiveServer  # noqa: E402
from helpers import MODEL, check_error  # noqa: E402


LONG_IDS = [1] * 8190


def _post(live, path, content, headers=None):
    return httpx.post(live.url + path, content=content, headers={"Content-Type": "application/json", **(headers or {})}, timeout=120)


def _body(**kw):
    return json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2, **kw}).encode()


BAD = {
    "malformed JSON": ("/v1/completions", b'{"model": "smollm2-135m", "prompt": ', 400, "invalid_json"),
    "invalid UTF-8": ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "\xff\xfe"}', 400, "invalid_encoding"),
    "lone surrogate escape": ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
                              400, "invalid_encoding"),
    "not an object": ("/v1/completions", b'["a"]', 422, "invalid_type"),
    "unknown model": ("/v1/completions", _body(model="gpt-4"), 404, "model_not_found"),
    "missing model": ("/v1/completions", b'{"prompt": "a"}', 422, "missing_required_parameter"),
    "missing prompt": ("/v1/completions", b'{"model": "smollm2-135m"}', 422, "missing_required_parameter"),
    "string for int": ("/v1/completions", _body(max_tokens="3"), 422, "invalid_type"),
    "bool for int": ("/v1/completions", _body(max_tokens=True), 422, "invalid_type"),
    "negative max_tokens": ("/v1/completions", _body(max_tokens=-1), 422, "invalid_value"),
    "absurd max_tokens": ("/v1/completions", _body(max_tokens=10**12), 422, "invalid_value"),
    "max_tokens beyond the context": ("/v1/completions", _body(max_tokens=9000), 400, "context_length_exceeded"),
    "prompt + max_tokens beyond the context": ("/v1/completions", _body(prompt=LONG_IDS, max_tokens=100), 400, "context_length_exceeded"),
    "token id out of range": ("/v1/completions", _body(prompt=[1, 10**9]), 400, "invalid_value"),
    "empty prompt": ("/v1/completions", _body(prompt="  "), 400, "invalid_value"),
    "temperature too high": ("/v1/completions", _body(temperature=7), 422, "invalid_value"),
    "NaN top_p": ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "a", "top_p": NaN}', 422, "invalid_value"),
    "negative seed": ("/v1/completions", _body(seed=-5), 422, "invalid_value"),
    "n=2": ("/v1/completions", _body(n=2), 400, "unsupported_parameter"),
    "logprobs over 20": ("/v1/completions", _body(logprobs=21), 422, "invalid_value"),
    "echo": ("/v1/completions", _body(echo=True), 400, "unsupported_parameter"),
    "unknown argument": ("/v1/completions", _body(frobnicate=1), 422, "unknown_parameter"),
    "too many stops": ("/v1/completions", _body(stop=list("abcde")), 422, "invalid_value"),
    "two prompts": ("/v1/completions", _body(prompt=["a", "b"]), 422, None),
    "bad strategy": ("/v1/completions", _body(viasd={"strategy": "magic"}), 422, None),
    "bad k": ("/v1/completions", _body(viasd={"k": 1000}), 422, "invalid_value"),
    "adapt_k not a boolean": ("/v1/completions", _body(viasd={"adapt_k": "yes"}), 422, None),
    "unknown viasd field": ("/v1/completions", _body(viasd={"slim_route": "/etc/passwd"}), 422, "unknown_parameter"),
    "model drafting without a drafter": ("/v1/completions", _body(viasd={"strategy": "sd"}), 400, "invalid_value"),
    "slim layer out of range": ("/v1/completions", _body(viasd={"strategy": "viasd", "slim_layers": [0, 99]}), 400, "invalid_value"),
    "inconsistent ngram bounds": ("/v1/completions", _body(viasd={"min_ngram": 5, "max_ngram": 2}), 400, "invalid_value"),
    "empty messages": ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": []}', 422, None),
    "bad role": ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [{"role": "wizard", "content": "x"}]}', 422, None),
    "message content a number": ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": 5}]}',
                                 422, None),
    "last message not the user's": ("/v1/chat/completions",
                                    b'{"model": "smollm2-135m", "messages": [{"role": "assistant", "content": "x"}]}',
                                    400, "invalid_value"),
    "malformed tools": ("/v1/chat/completions",
                        b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
                        422, "missing_required_parameter"),
    "tools on completions": ("/v1/completions", _body(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
                             "unsupported_parameter"),
    "legacy functions": ("/v1/chat/completions",
                         b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}',
                         400, "unsupported_parameter"),
    "negative top_k": ("/v1/completions", _body(top_k=-1), 422, "invalid_value"),
    "min_p above 1": ("/v1/completions", _body(min_p=1.5), 422, "invalid_value"),
    "repetition_penalty 0": ("/v1/completions", _body(repetition_penalty=0), 422, "invalid_value"),
    "presence_penalty as text": ("/v1/completions", _body(presence_penalty="1"), 422, "invalid_type"),
    "frequency_penalty beyond OpenAI's range": ("/v1/completions", _body(frequency_penalty=2.5), 422, "invalid_value"),
    "logit_bias a list": ("/v1/completions", _body(logit_bias=[1, 2]), 422, "invalid_type"),
    "logit_bias key no token id": ("/v1/completions", _body(logit_bias={"hello": 1}), 422, "invalid_value"),
    "logit_bias beyond 100": ("/v1/completions", _body(logit_bias={"5": 101}), 422, "invalid_value"),
    "logit_bias id outside the vocabulary": ("/v1/completions", _body(logit_bias={"99999999": 1}), 400, "invalid_value"),
    "unknown route": ("/v1/embeddings", _body(), 404, "not_found"),
    "body over the limit": ("/v1/completions", _body(prompt="x" * 70_000), 413, "request_too_large"),
}


@pytest.mark.model
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_a_clear_openai_style_error(live, case):
    path, content, status, code = BAD[case]
    check_error(_post(live, path, content), status, code)


SAMPLERS = ("top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
SAMPLER_CASES = [c for c in BAD if any(f'"{f}"'.encode() in BAD[c][1] for f in SAMPLERS)]


@pytest.mark.model
@pytest.mark.parametrize("case", SAMPLER_CASES)
def test_a_bad_sampler_value_names_its_field(live, case):
    path, content, status, code = BAD[case]
    field = next(k for k in json.loads(content) if k in SAMPLERS)
    error = _post(live, path, content).json()["error"]
    assert error["param"].split(".")[0] == field and field in error["message"], error


@pytest.mark.model
def test_bad_input_edge_transports(live):
    check_error(httpx.get(live.url + "/v1/completions"), 405, "method_not_allowed")
    # a chunked body (no Content-Length) over the limit is cut while reading
    chunks = (b"x" * 8192 for _ in range(10))
    check_error(httpx.post(live.url + "/v1/completions", content=chunks, headers={"Content-Type": "application/json"}), 413,
                "request_too_large")
    # streaming requests get their errors as a status code too, before any event is sent
    check_error(_post(live, "/v1/completions", _body(stream=True, prompt=LONG_IDS, max_tokens=100)), 400, "context_length_exceeded")
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}  # and the server is fine


@pytest.mark.model
def test_the_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError, match="does not exist here"):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2)
    assert e.value.code == "unsupported_parameter"
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-3)


@pytest.fixture(scope="module")
def tiny_live_with_key(tiny):
    with LiveServer(create_app(tiny, settings=ServeSettings(served_name="tiny", api_key="s3cret-key"))) as server:
        yield server


def test_api_key_guards_every_route_but_health_and_the_page(tiny_live_with_key):
    live = tiny_live_with_key
    assert httpx.get(live.url + "/health").status_code == 200
    for path in ("/", "/static/app.js", "/static/vendor/purify.min.js"):  # the chat page asks for the key itself
        assert httpx.get(live.url + path).status_code == 200, path
    check_error(httpx.get(live.url + "/static/nothing.js"), 404, "not_found")
    for path in ("/static", "/static/../v1/models", "/static/%2e%2e/v1/models", "/static/..%2fmetrics"):  # no way around the key
        conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)  # (sends the path as it is)
        conn.request("GET", path)
        assert conn.getresponse().status in (401, 404), path
        conn.close()
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("GET", "/nowhere")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-key"}, {"Authorization": "Basic s3cret-key"}):
            r = httpx.request(method, live.url + path, headers=headers, content=b"{}")
            check_error(r, 401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        live.client("wrong").models.list()
    good = live.client("s3cret-key")
    assert [m.id for m in good.models.list().data] == ["tiny"]
    r = good.completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=4)
    assert r.usage.completion_tokens >= 1
    assert httpx.get(live.url + "/metrics", headers={"Authorization": "Bearer s3cret-key"}).status_code == 200


@pytest.mark.model
def test_without_a_key_any_or_no_token_is_accepted(live):
    assert httpx.get(live.url + "/v1/models").status_code == 200
    assert httpx.get(live.url + "/v1/models", headers={"Authorization": "Bearer anything"}).status_code == 200
