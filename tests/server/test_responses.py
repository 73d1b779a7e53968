"""OpenAI's Responses API (/v1/responses) driven by the official `openai` client: the same text as
/v1/chat/completions under every strategy, streamed events that reassemble to the whole response, function
calls and their results, text.format json_schema, logprobs, and bad input answered in OpenAI's error shape."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("fastapi")
from dialects import FUNCTIONS, KEY, SCHEMA, SERVED, STRATEGIES, drained_stream, serve, tiny_pair  # noqa: E402
from helpers import check_error  # noqa: E402

TOOLS = [{"type": "function", **f} for f in FUNCTIONS]
HI = "hi"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory)


@pytest.fixture(scope="module")
def live(pair):
    with serve(*pair) as server:
        yield server


@pytest.fixture(scope="module")
def oc(live):
    return live.client(KEY)


def post(live, body: dict, key: str = KEY):
    return httpx.post(live.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300)


def chat_text(oc, messages, **kw) -> str:
    return oc.chat.completions.create(model=SERVED, messages=messages, **kw).choices[0].message.content


def raw_stream(oc, **kw) -> list:
    return list(oc.responses.create(model=SERVED, stream=True, **kw))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_greedy_text_equals_chat_completions_whole_and_streamed(oc, strategy):
    ext = {"viasd": STRATEGIES[strategy]}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}]
    ref = chat_text(oc, messages, max_tokens=20, extra_body=ext)
    r = oc.responses.create(model=SERVED, instructions="Be brief.", input="hello world", max_output_tokens=20, extra_body=ext)
    assert r.object == "response" and r.output_text == ref and ref
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # (20 tokens: cut)
    assert r.usage.output_tokens == 20 and r.usage.total_tokens == r.usage.input_tokens + 20
    assert r.model_extra["viasd"]["config"]["strategy"] == STRATEGIES[strategy]["strategy"]
    events = raw_stream(oc, instructions="Be brief.", input="hello world", max_output_tokens=20, extra_body=ext)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ref
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].content[0].text == ref


def test_stream_event_sequence(oc):
    events = raw_stream(oc, input=[{"role": "user", "content": HI}], max_output_tokens=12)
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 2  # really streamed
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-4].text == text and events[-2].item.content[0].text == text
    assert events[-1].response.usage.output_tokens == 12


def test_forced_function_call_whole_streamed_and_through_the_stream_helper(oc):
    kw = dict(model=SERVED, input=HI, tools=TOOLS, tool_choice={"type": "function", "name": "get_time"}, parallel_tool_calls=False,
              max_output_tokens=40)
    r = oc.responses.create(**kw)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_time" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), FUNCTIONS[1]["parameters"])
    with oc.responses.stream(**kw) as stream:  # the SDK's own accumulator of the events
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    assert [(o.type, o.name, o.arguments) for o in final.output] == [("function_call", "get_time", call.arguments)]


def test_function_call_output_goes_back_through_the_template(oc):
    items = [{"role": "user", "content": "Weather in Oslo?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 3}'}]
    r = oc.responses.create(model=SERVED, input=items, tools=TOOLS, tool_choice="none", max_output_tokens=10)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}
    messages = [items[0], {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'}]
    assert r.output_text == chat_text(oc, messages, tools=[{"type": "function", "function": f} for f in FUNCTIONS],
                                      tool_choice="none", max_tokens=10)


def test_text_format_json_schema_answers_validate(oc):
    fmt = {"format": {"type": "json_schema", "name": "reply", "schema": SCHEMA, "strict": True}}
    r = oc.responses.create(model=SERVED, input=HI, text=fmt, max_output_tokens=60)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"


def test_logprobs_through_include(oc):
    r = oc.responses.create(model=SERVED, input=HI, include=["message.output_text.logprobs"], top_logprobs=2, max_output_tokens=6)
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == 6 and "".join(lp.token for lp in logprobs) == r.output_text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)


@pytest.mark.parametrize("body, status, code", [
    ({"model": SERVED, "input": HI, "previous_response_id": "resp_123"}, 400, "previous_response_not_found"),
    ({"model": SERVED, "input": HI, "background": True}, 400, "unsupported_parameter"),
    ({"model": SERVED, "input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "invalid_value"),
    ({"model": SERVED, "input": HI, "reasoning": {"effort": "high"}}, 400, "unsupported_parameter"),
    ({"model": SERVED, "input": [{"type": "reasoning", "summary": []}]}, 422, None),
    ({"model": SERVED, "input": HI, "tools": [{"type": "web_search"}]}, 422, None),
    ({"model": SERVED, "input": HI, "temperature": "hot"}, 422, "invalid_type"),
    ({"model": SERVED, "input": HI, "max_output_tokens": 0}, 422, "invalid_value"),
    ({"model": SERVED, "input": HI, "bogus": 1}, 422, "unknown_parameter"),
    ({"model": "gpt-9", "input": HI}, 404, "model_not_found"),
    ({"model": SERVED}, 422, "missing_required_parameter"),
    ({"model": SERVED, "input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, 400, "invalid_value"),
    ({"model": SERVED, "input": HI, "tool_choice": "required"}, 400, "invalid_value"),
    ({"model": SERVED, "input": HI, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, 400, None),
], ids=["previous-id", "background", "item-reference", "reasoning", "unknown-item", "builtin-tool", "wrong-type", "zero-tokens",
        "unknown-field", "model", "no-input", "orphan-output", "required-without-tools", "bad-schema"])
def test_bad_input_gets_openais_error_shape(live, body, status, code):
    check_error(post(live, body), status, code)


def test_the_api_key_is_checked(live, oc):
    check_error(post(live, {"model": SERVED, "input": HI}, key="wrong"), 401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        live.client("wrong").responses.create(model=SERVED, input=HI)


def test_a_stream_the_drain_cuts_ends_with_response_failed(pair):
    events = drained_stream(pair[0], "/v1/responses", {"model": SERVED, "input": HI, "max_output_tokens": 40, "stream": True})
    kinds = [k for k, _ in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.failed"]
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "shutting_down" and failed["output"][0]["content"][0]["text"] == " "
