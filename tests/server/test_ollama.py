"""Ollama's API through the official `ollama` client (list, show, chat, generate; whole and streamed):
the text that of the same request through /v1 (the `openai` client) under every strategy, structured
output valid, tools as Ollama's calls, errors as Ollama's `{"error": "..."}` with a 4xx."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("fastapi")
from viasd.server import ServeSettings, create_app  # noqa: E402
from live_server import LiveServer  # noqa: E402

SERVED = "tiny-coder"
HI = [{"role": "user", "content": "hello world"}]
STRATEGIES = {"ar": {"strategy": "ar"}, "pld": {"strategy": "pld"}, "sd": {"strategy": "sd", "k": 3},
              "viasd": {"strategy": "viasd", "mode": "lossless", "draft": "pld", "k": 3, "adapt_k": False}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
# (its keys in the order the `ollama` client sends them: the template prints the tools as given)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "required": ["city"], "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}}}}


@pytest.fixture(scope="module")
def live(coder):
    model, drafter = coder
    app = create_app(model, drafter, settings=ServeSettings(defaults={"strategy": "pld", "max_new_tokens": 12}, served_name=SERVED))
    with LiveServer(app) as server:
        yield server


@pytest.fixture(scope="module")
def oll(live):
    return ollama.Client(host=live.url, timeout=120)


def test_list_show_and_version(live, oll):
    models = oll.list().models
    assert [m.model for m in models] == [SERVED] and models[0].details.family
    shown = oll.show(SERVED)
    assert {"completion", "tools", "insert"} <= set(shown.capabilities) and shown.template
    assert shown.modelinfo["general.architecture"]
    assert httpx.get(live.url + "/api/version").json()["version"]


def test_chat_is_the_chat_completion_under_every_strategy(live, oll):
    oc, texts = live.client(), set()
    for name, ext in STRATEGIES.items():
        options = {"num_predict": 10, "temperature": 0, "viasd": ext}
        r = oll.chat(model=SERVED, messages=HI, options=options)
        ref = oc.chat.completions.create(model=SERVED, messages=HI, max_tokens=10, temperature=0, extra_body={"viasd": ext})
        assert r.message.role == "assistant" and r.message.content == ref.choices[0].message.content, name
        assert r.done and r.done_reason == ref.choices[0].finish_reason
        assert (r.prompt_eval_count, r.eval_count) == (ref.usage.prompt_tokens, ref.usage.completion_tokens)
        assert r.eval_duration > 0 and r.total_duration >= r.eval_duration
        raw = httpx.post(live.url + "/api/chat", json={"model": SERVED, "messages": HI, "stream": False, "options": options}).json()
        assert raw["viasd"]["config"]["strategy"] == ext["strategy"] and raw["message"]["content"] == r.message.content
        texts.add(r.message.content)
        if name not in ("pld", "sd"):  # (streams are the same events under every strategy: two suffice)
            continue
        parts = list(oll.chat(model=SERVED, messages=HI, options=options, stream=True))
        assert "".join(p.message.content or "" for p in parts) == r.message.content
        assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
        assert parts[-1].eval_count == r.eval_count and parts[-1].done_reason == r.done_reason
    assert len(texts) == 1  # greedy: the same text whatever drafts it


def test_generate_raw_template_and_suffix_are_their_v1_requests(live, oll):
    oc = live.client()
    for ext in (STRATEGIES["ar"], STRATEGIES["viasd"]):
        options = {"num_predict": 10, "viasd": ext}
        raw = oll.generate(model=SERVED, prompt="def add(a, b):", raw=True, options=options)
        ref = oc.completions.create(model=SERVED, prompt="def add(a, b):", max_tokens=10, extra_body={"viasd": ext})
        assert raw.response == ref.choices[0].text and raw.done
        templated = oll.generate(model=SERVED, prompt="hello world", system="Be brief.", options=options)
        ref = oc.chat.completions.create(model=SERVED, max_tokens=10, extra_body={"viasd": ext}, messages=[
            {"role": "system", "content": "Be brief."}, *HI])
        assert templated.response == ref.choices[0].message.content
        fim = oll.generate(model=SERVED, prompt="def add(a, b):\n    return", suffix="\nprint(add(1, 2))\n", options=options)
        ref = oc.completions.create(model=SERVED, prompt="def add(a, b):\n    return", suffix="\nprint(add(1, 2))\n", max_tokens=10,
                                    extra_body={"viasd": ext})
        assert fim.response == ref.choices[0].text
    parts = list(oll.generate(model=SERVED, prompt="def add(a, b):", raw=True, options={"num_predict": 10}, stream=True))
    assert "".join(p.response for p in parts) == oll.generate(model=SERVED, prompt="def add(a, b):", raw=True,
                                                             options={"num_predict": 10}).response
    assert parts[-1].done and parts[-1].eval_count == 10 and parts[-1].done_reason == "length"
    assert oll.generate(model=SERVED, prompt="").done_reason == "load"  # (Ollama's way to load a model)


def test_options_stop_seed_and_samplers_are_the_declared_settings(live, oll):
    oc = live.client()
    options = {"num_predict": 10, "temperature": 0.9, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "seed": 7, "repeat_penalty": 1.2,
               "num_ctx": 2048, "num_thread": 2}  # (the last two are the runner's: accepted, nothing to set)
    r = oll.chat(model=SERVED, messages=HI, options=options)
    ref = oc.chat.completions.create(model=SERVED, messages=HI, max_tokens=10, temperature=0.9, top_p=0.9, seed=7,
                                     extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2})
    assert r.message.content == ref.choices[0].message.content
    config = httpx.post(live.url + "/api/chat", json={"model": SERVED, "messages": HI, "stream": False, "options": options}).json()[
        "viasd"]["config"]
    assert config["repetition_penalty"] == 1.2 and config["top_k"] == 20
    full = oll.generate(model=SERVED, prompt="def add(a, b):", raw=True, options={"num_predict": 12}).response
    stop = full.strip()[2:4]
    cut = oll.generate(model=SERVED, prompt="def add(a, b):", raw=True, options={"num_predict": 12, "stop": [stop]})
    assert cut.response == full[: full.index(stop)] and cut.done_reason == "stop"


def test_logprobs_are_the_chat_completions(live, oll):
    r = oll.chat(model=SERVED, messages=HI, options={"num_predict": 5}, logprobs=True, top_logprobs=2)
    ref = live.client().chat.completions.create(model=SERVED, messages=HI, max_tokens=5, logprobs=True, top_logprobs=2)
    want = ref.choices[0].logprobs.content
    assert [(x.token, x.logprob) for x in r.logprobs] == [(x.token, x.logprob) for x in want]
    assert [[t.token for t in x.top_logprobs] for x in r.logprobs] == [[t.token for t in x.top_logprobs] for x in want]


def test_format_json_and_schema_answers_validate(live, oll):
    r = oll.chat(model=SERVED, messages=HI, format="json", options={"num_predict": 30})
    ref = live.client().chat.completions.create(model=SERVED, messages=HI, max_tokens=30, response_format={"type": "json_object"})
    assert r.message.content == ref.choices[0].message.content and r.message.content.startswith("{")
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.message.content), dict)
    for stream in (False, True):
        out = oll.generate(model=SERVED, prompt="A reply:", format=SCHEMA, options={"num_predict": 60}, stream=stream)
        text = "".join(p.response for p in out) if stream else out.response
        jsonschema.validate(json.loads(text), SCHEMA)


def test_tools_answer_as_the_chat_completions_calls(live, oll):
    oc = live.client()
    messages = [{"role": "user", "content": "weather in Paris?"}]
    for opts in ({"num_predict": 30},):
        r = oll.chat(model=SERVED, messages=messages, tools=[WEATHER], options=opts)
        ref = oc.chat.completions.create(model=SERVED, messages=messages, tools=[WEATHER], max_tokens=30,
                                         **{k: v for k, v in opts.items() if k != "num_predict"}).choices[0].message
        want = [{"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in ref.tool_calls or []]
        assert [{"name": c.function.name, "arguments": dict(c.function.arguments)} for c in r.message.tool_calls or []] == want
        assert (r.message.content or "") == (ref.content or "")
        parts = list(oll.chat(model=SERVED, messages=messages, tools=[WEATHER], options=opts, stream=True))
        streamed = [c for p in parts for c in p.message.tool_calls or []]
        assert [{"name": c.function.name, "arguments": dict(c.function.arguments)} for c in streamed] == want
        assert "".join(p.message.content or "" for p in parts) == (r.message.content or "")
    # a conversation with a call and its result, as Ollama sends it back (no call ids; the tool's name)
    history = [*messages, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                                            "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "18 C", "tool_name": "get_weather"}]
    assert oll.chat(model=SERVED, messages=history, tools=[WEATHER], options={"num_predict": 8}).done


def ollama_error(r, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"] and "Traceback" not in r.text
    return body["error"]


@pytest.mark.parametrize("path, body, status, needle", [
    ("/api/chat", {"model": "nope", "messages": HI}, 404, "nope"),
    ("/api/chat", {"model": SERVED, "messages": HI, "options": {"temperature": "hot"}}, 400, "temperature"),
    ("/api/chat", {"model": SERVED, "messages": HI, "options": {"warp": 9}}, 400, "warp"),
    ("/api/chat", {"model": SERVED, "messages": HI, "options": {"viasd": {"strategy": "nope"}}}, 400, "strategy"),
    ("/api/chat", {"model": SERVED, "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, 400, "images"),
    ("/api/chat", {"model": SERVED, "messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ("/api/chat", {"model": SERVED, "messages": HI, "format": "yaml"}, 400, "format"),
    ("/api/chat", {"model": SERVED, "messages": HI, "think": True}, 400, "thinking"),
    ("/api/generate", {"model": SERVED, "prompt": "hi", "options": {"num_predict": 100000000}}, 400, "num_predict"),
    ("/api/generate", {"model": SERVED, "prompt": "hi", "context": [1, 2]}, 400, "context"),
    ("/api/generate", {"model": SERVED, "prompt": "hi", "options": {"top_p": 0}}, 400, "top_p"),
    ("/api/show", {"model": "nope"}, 404, "nope"),
    ("/api/show", {}, 400, "model"),
])
def test_bad_requests_get_ollamas_error(live, path, body, status, needle):
    assert needle in ollama_error(httpx.post(live.url + path, json=body, timeout=60), status)


def test_the_client_raises_ollamas_error_and_malformed_bodies_get_it_too(live, oll):
    with pytest.raises(ollama.ResponseError) as e:
        oll.chat(model="nope", messages=HI)
    assert e.value.status_code == 404 and "nope" in e.value.error
    ollama_error(httpx.post(live.url + "/api/chat", content=b"{", headers={"content-type": "application/json"}), 400)
    ollama_error(httpx.post(live.url + "/api/generate", json=[1]), 400)
    ollama_error(httpx.get(live.url + "/api/nothing"), 404)


def test_a_busy_or_keyed_server_answers_in_ollamas_shape(coder):
    app = create_app(coder[0], settings=ServeSettings(served_name=SERVED, api_key="k"))
    with LiveServer(app) as server:
        ollama_error(httpx.post(server.url + "/api/chat", json={"model": SERVED, "messages": HI}), 401)
        r = httpx.post(server.url + "/api/chat", json={"model": SERVED, "messages": HI, "stream": False,
                                                       "options": {"num_predict": 3}}, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["done"]
