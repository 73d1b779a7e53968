"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) driven by the official `anthropic`
client: the same text as /v1/chat/completions under every strategy, the exact streamed event sequence, tool
use and tool results, stop sequences, structured output, x-api-key, and bad input answered in Anthropic's
error shape."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("fastapi")
from dialects import CHAT_TOOLS, FUNCTIONS, KEY, SCHEMA, SERVED, STRATEGIES, drained_stream, serve, tiny_pair  # noqa: E402

TOOLS = [{"name": f["name"], "input_schema": f["parameters"], **({"description": f["description"]} if "description" in f else {})}
         for f in FUNCTIONS]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory)


@pytest.fixture(scope="module")
def live(pair):
    with serve(*pair) as server:
        yield server


@pytest.fixture(scope="module")
def ac(live):
    return anthropic.Anthropic(base_url=live.url, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def oc(live):
    return live.client(KEY)


def post(live, body: dict, path: str = "/v1/messages", headers: dict | None = None):
    return httpx.post(live.url + path, json=body, headers={"x-api-key": KEY} if headers is None else headers, timeout=300)


def check_error(r, status: int, kind: str):
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}}."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind and body["error"]["message"]
    assert "Traceback" not in r.text


def create(ac, **kw):
    return ac.messages.create(model=SERVED, **{"messages": HI, "max_tokens": 20, **kw})


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_greedy_text_equals_chat_completions_whole_and_streamed(ac, oc, strategy):
    ext = {"viasd": STRATEGIES[strategy]}
    messages = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "yes"},
                {"role": "user", "content": "maybe"}]
    ref = oc.chat.completions.create(model=SERVED, messages=[{"role": "system", "content": "Be brief."}, *messages], max_tokens=20,
                                     extra_body=ext).choices[0].message.content
    r = create(ac, system="Be brief.", messages=messages, extra_body=ext)
    assert r.type == "message" and r.role == "assistant" and [b.type for b in r.content] == ["text"]
    assert r.content[0].text == ref and ref
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None and r.usage.output_tokens == 20
    assert r.model_extra["viasd"]["config"]["strategy"] == STRATEGIES[strategy]["strategy"]
    with ac.messages.stream(model=SERVED, system=[{"type": "text", "text": "Be brief."}], messages=messages, max_tokens=20,
                            extra_body=ext) as stream:
        assert "".join(stream.text_stream) == ref
        final = stream.get_final_message()
    assert final.content[0].text == ref and final.stop_reason == "max_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (r.usage.input_tokens, 20)


def test_a_system_message_inside_messages_is_the_system_prompt(ac):
    a = create(ac, system="Be brief.")
    b = create(ac, messages=[{"role": "system", "content": "Be brief."}, *HI])
    assert a.content[0].text == b.content[0].text and a.usage.input_tokens == b.usage.input_tokens


def test_the_stream_is_the_exact_event_sequence(live):
    body = {"model": SERVED, "messages": HI, "max_tokens": 12, "stream": True}
    with httpx.stream("POST", live.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [block.split("\n") for block in raw.strip().split("\n\n")]
    names = [e[0].removeprefix("event: ") for e in events]
    datas = [json.loads(e[1].removeprefix("data: ")) for e in events]
    assert [d["type"] for d in datas] == names
    deltas = names.count("content_block_delta")
    assert deltas > 2 and names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * deltas,
                                    "content_block_stop", "message_delta", "message_stop"]
    assert datas[0]["message"]["content"] == [] and datas[0]["message"]["usage"]["output_tokens"] == 0
    assert datas[1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in datas[3:3 + deltas])
    assert datas[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None} and datas[-2]["usage"]["output_tokens"] == 12


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences_end_the_text_and_are_named(ac, stream):
    full = create(ac, max_tokens=24).content[0].text
    word = next(w for w in full.split() if full.index(w) > 0)  # a word past the start of the answer
    kw = dict(max_tokens=24, stop_sequences=[word, "never there"])
    if stream:
        with ac.messages.stream(model=SERVED, messages=HI, **kw) as s:
            r = s.get_final_message()
    else:
        r = create(ac, **kw)
    assert r.content[0].text == full[: full.index(word)]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use_parses_into_the_declared_tool(ac, stream):
    kw = dict(tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}, max_tokens=60)
    if stream:
        with ac.messages.stream(model=SERVED, messages=HI, **kw) as s:
            kinds = [e.type for e in s]
            r = s.get_final_message()
        assert "input_json" in kinds and kinds[-1] == "message_stop"
    else:
        r = create(ac, **kw)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    use = r.content[0]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, FUNCTIONS[0]["parameters"])


def test_tool_choice_any_and_auto_and_none(ac):
    forced = create(ac, tools=TOOLS, tool_choice={"type": "any"}, max_tokens=60)
    assert forced.stop_reason == "tool_use" and forced.content[-1].name in ("get_weather", "get_time")
    auto = create(ac, tools=TOOLS, tool_choice={"type": "auto"}, max_tokens=24)
    assert all(b.type in ("text", "tool_use") for b in auto.content)
    none = create(ac, tools=TOOLS, tool_choice={"type": "none"}, max_tokens=10)
    assert [b.type for b in none.content] == ["text"] and none.content[0].text == create(ac, max_tokens=10).content[0].text


def test_tool_results_go_back_through_the_template(ac, oc):
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                  {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "Oslo", "unit": "c"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": '{"temp": 3}'}]}]
    r = create(ac, messages=messages, tools=TOOLS, max_tokens=10, tool_choice={"type": "none"})
    call = {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}
    chat = [messages[0], {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": '{"temp": 3}'}]
    ref = oc.chat.completions.create(model=SERVED, messages=chat, tools=CHAT_TOOLS, tool_choice="none", max_tokens=10)
    assert r.content[0].text == ref.choices[0].message.content
    assert r.usage.input_tokens == ref.usage.prompt_tokens


def test_output_config_json_schema_answers_validate(ac):
    r = create(ac, max_tokens=60, extra_body={"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}})
    assert r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(r.content[0].text), SCHEMA)


def test_count_tokens_is_the_prompt_a_message_reads(ac):
    kw = dict(system="Be brief.", messages=HI, tools=TOOLS)
    counted = ac.messages.count_tokens(model=SERVED, **kw)
    assert counted.input_tokens == create(ac, tool_choice={"type": "auto"}, **kw).usage.input_tokens > 0
    assert ac.messages.count_tokens(model=SERVED, messages=HI).input_tokens == create(ac).usage.input_tokens


def test_keys_by_x_api_key_or_bearer(live, ac):
    assert post(live, {"model": SERVED, "messages": HI, "max_tokens": 2}, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    check_error(post(live, {"model": SERVED, "messages": HI, "max_tokens": 2}, headers={"x-api-key": "wrong"}), 401,
                "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=live.url, api_key="wrong", max_retries=0).messages.create(model=SERVED, messages=HI, max_tokens=2)


@pytest.mark.parametrize("body, status, kind", [
    ({"model": SERVED, "messages": HI}, 400, "invalid_request_error"),  # no max_tokens
    ({"model": SERVED, "messages": HI, "max_tokens": "ten"}, 400, "invalid_request_error"),
    ({"model": SERVED, "messages": [], "max_tokens": 5}, 400, "invalid_request_error"),
    ({"model": SERVED, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 5}, 400,
     "invalid_request_error"),
    ({"model": SERVED, "messages": [{"role": "assistant", "content": "hi"}], "max_tokens": 5}, 400, "invalid_request_error"),
    ({"model": SERVED, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}],
      "max_tokens": 5}, 400, "invalid_request_error"),
    ({"model": SERVED, "messages": HI, "max_tokens": 5, "tool_choice": {"type": "tool", "name": "get_time"}}, 400, "invalid_request_error"),
    ({"model": SERVED, "messages": HI, "max_tokens": 5, "tool_choice": {"type": "tool"}, "tools": TOOLS}, 400, "invalid_request_error"),
    ({"model": SERVED, "messages": HI, "max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400,
     "invalid_request_error"),
    ({"model": SERVED, "messages": HI, "max_tokens": 5, "temperature": 7}, 400, "invalid_request_error"),
    ({"model": SERVED, "messages": HI, "max_tokens": 5, "bogus": True}, 400, "invalid_request_error"),
    ({"model": SERVED, "messages": HI, "max_tokens": 10 ** 6}, 400, "invalid_request_error"),
    ({"model": "claude-9", "messages": HI, "max_tokens": 5}, 404, "not_found_error"),
], ids=["no-max-tokens", "wrong-type", "no-messages", "image", "last-assistant", "orphan-result", "tool-without-tools",
        "tool-without-name", "thinking", "temperature", "unknown-field", "over-context", "model"])
def test_bad_input_gets_anthropics_error_shape(live, body, status, kind):
    check_error(post(live, body), status, kind)


def test_other_failures_take_anthropics_shape_too(live):
    check_error(httpx.get(live.url + "/v1/messages", headers={"x-api-key": KEY}), 405, "invalid_request_error")
    check_error(httpx.post(live.url + "/v1/messages", content=b"{", headers={"x-api-key": KEY, "content-type": "application/json"}),
                400, "invalid_request_error")
    check_error(post(live, {"model": SERVED}, path="/v1/messages/count_tokens"), 400, "invalid_request_error")


def test_a_stream_the_drain_cuts_ends_with_an_error_event(pair):
    events = drained_stream(pair[0], "/v1/messages", {"model": SERVED, "messages": HI, "max_tokens": 40, "stream": True})
    assert [k for k, _ in events] == ["message_start", "content_block_start", "ping", "content_block_delta", "content_block_stop", "error"]
    assert events[-1][1] == {"type": "error", "error": {"type": "overloaded_error", "message": events[-1][1]["error"]["message"]}}
    assert "shutting down" in events[-1][1]["error"]["message"]
