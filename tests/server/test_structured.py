"""Structured output and tool calls through the server (`response_format`, `viasd.regex` / `viasd.grammar`,
`tools` / `tool_choice`): the official `openai` client against a live server on a tiny random model
with a byte-level BPE tokenizer and Qwen2.5's chat template (tools in `<tool_call>` tags)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("fastapi")
from viasd.models.loading import load_model  # noqa: E402
from viasd.server import ServeSettings, create_app  # noqa: E402
from viasd.server.tools import GENERIC, HERMES, LLAMA3, ToolPlan, ToolStream, chat_prompt, family_of, grammar, parameters, split  # noqa: E402
from live_server import LiveServer  # noqa: E402
from helpers import check_error  # noqa: E402
from support import bpe_tokenizer, save_tiny  # noqa: E402

SERVED = "tiny-qwen"
TEMPLATE = (Path(__file__).parent / "qwen_template.jinja").read_text()
CORPUS = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
          '{"ok": true, "n": 3}', "yes no maybe hello world"] * 10
# small closed schemas: a random model's answers under them end within a few dozen tokens
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    # (trained on the template's tool prompt too: its merges keep the prompt within the 512 positions)
    tok = bpe_tokenizer(600, CORPUS + [TEMPLATE, json.dumps(TOOLS)] * 10)
    tok.chat_template = TEMPLATE
    # (seed 5: greedy, its json_object answer to "hi" closes within 10 tokens)
    return load_model(str(save_tiny(tmp_path_factory.mktemp("tiny-qwen"), seed=5, tokenizer=tok)), progress=False)


@pytest.fixture(scope="module")
def live_qwen(tiny_qwen):
    app = create_app(tiny_qwen, settings=ServeSettings(defaults={"strategy": "pld", "max_new_tokens": 60}, served_name=SERVED))
    with LiveServer(app) as server:
        yield server


@pytest.fixture(scope="module")
def oc(live_qwen):
    return live_qwen.client()


def chat(oc, **kw):
    return oc.chat.completions.create(model=SERVED, **{"messages": HI, "max_tokens": 60, **kw})


def test_json_schema_strict_answers_validate_on_both_endpoints(oc):
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}}
    r = chat(oc, response_format=fmt)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    assert r.choices[0].finish_reason == "stop"
    c = oc.completions.create(model=SERVED, prompt="A reply:", max_tokens=60, extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(c.choices[0].text), SCHEMA)


def test_json_object_and_regex_answers(oc):
    assert isinstance(json.loads(chat(oc, response_format={"type": "json_object"}).choices[0].message.content), dict)
    r = chat(oc, extra_body={"viasd": {"regex": "(yes|no|maybe)!"}})
    assert re.fullmatch("(yes|no|maybe)!", r.choices[0].message.content)
    c = oc.completions.create(model=SERVED, prompt="Answer:", max_tokens=20, extra_body={"viasd": {"regex": "[0-9]{4}"}})
    assert re.fullmatch("[0-9]{4}", c.choices[0].text)
    g = chat(oc, extra_body={"viasd": {"grammar": 'start: "ok " NUM\nNUM: /[1-3]/'}})
    assert re.fullmatch("ok [1-3]", g.choices[0].message.content)


def test_a_constraint_cut_by_max_tokens_ends_with_length(oc):
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
    r = chat(oc, response_format=fmt, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_a_tool_call_complete_at_exactly_max_tokens_finishes_with_tool_calls(oc):
    kw = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
    whole = chat(oc, **kw)
    assert whole.choices[0].finish_reason == "tool_calls"
    calls = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    n = whole.usage.completion_tokens - 1  # all but its end token: where the grammar allows nothing but the end
    at_budget = chat(oc, max_tokens=n, **kw).choices[0]
    assert at_budget.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in at_budget.message.tool_calls] == calls
    assert streamed(oc, max_tokens=n, **kw) == (None, calls, "tool_calls")
    # a token earlier the grammar still allows the newline that ends a turn: the budget cut the answer
    assert chat(oc, max_tokens=n - 1, **kw).choices[0].finish_reason == "length"


def check_calls(calls, names=("get_weather", "get_time")):
    """Each call names a declared function and its arguments are valid under its schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"])
def test_forced_tool_calls_parse_into_declared_functions(oc, choice):
    r = chat(oc, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    message = r.choices[0].message
    check_calls(message.tool_calls, ["get_time"] if isinstance(choice, dict) else ("get_weather", "get_time"))
    assert len(message.tool_calls) == 1 and message.content is None
    assert r.choices[0].finish_reason == "tool_calls"


def test_auto_answers_text_or_valid_calls(oc):
    r = chat(oc, tools=TOOLS, tool_choice="auto", max_tokens=24)
    message = r.choices[0].message
    if message.tool_calls:
        check_calls(message.tool_calls)
        assert r.choices[0].finish_reason in ("tool_calls", "length")
    else:
        assert "<tool_call>" not in message.content and r.choices[0].finish_reason in ("stop", "length")


def streamed(oc, **kw):
    """A streamed answer reassembled: its content, its calls (name, arguments) and finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chat(oc, stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for frag in delta.tool_calls or []:
            if frag.index not in calls:  # the first fragment: id, type, name and empty arguments
                assert frag.id.startswith("call_") and frag.type == "function" and frag.function.arguments == ""
                calls[frag.index] = [frag.function.name, ""]
            else:
                calls[frag.index][1] += frag.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_streamed_answers_equal_whole_ones(oc, choice):
    kw = dict(tools=TOOLS, tool_choice=choice, parallel_tool_calls=True, max_tokens=24)
    whole = chat(oc, **kw).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert streamed(oc, **kw) == (whole.message.content, calls, whole.finish_reason)


def test_tool_results_are_accepted_back_through_the_template(oc, tiny_qwen):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}
    messages = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'}]
    r = chat(oc, messages=messages, tools=TOOLS, max_tokens=4)
    as_template = [messages[0], {"role": "assistant", "content": None, "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}}]}, messages[2]]
    ids = tiny_qwen.encode(as_template, True, tools=TOOLS)
    assert r.usage.prompt_tokens == len(ids)
    assert '<tool_response>\n{"temp": 3}\n</tool_response>' in tiny_qwen.tokenizer.decode(ids)
    assert '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}' in tiny_qwen.tokenizer.decode(ids)


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
BAD = {  # request fields -> (status, param)
    "invalid json schema": ({"response_format": BAD_SCHEMA}, 400, "response_format"),
    "unknown format type": ({"response_format": {"type": "xml"}}, 422, "response_format"),
    "invalid regex": ({"viasd": {"regex": "("}}, 400, "viasd.regex"),
    "invalid grammar": ({"viasd": {"grammar": "start: nowhere"}}, 400, "viasd.grammar"),
    "regex and json_object": ({"viasd": {"regex": "a"}, "response_format": {"type": "json_object"}}, 400, "viasd.regex"),
    "regex and grammar": ({"viasd": {"regex": "a", "grammar": 'start: "a"'}}, 400, "viasd.grammar"),
    "invalid parameters schema": ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
                                  400, "tools[0].function.parameters"),
    "tool_choice undeclared": ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "tool_choice"),
    "tool_choice required, no tools": ({"tool_choice": "required"}, 400, "tool_choice"),
    "named tool_choice, no tools": ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, 400, "tool_choice"),
    "tools and json_object": ({"tools": TOOLS, "response_format": {"type": "json_object"}}, 400, "response_format"),
    "two tools of one name": ({"tools": [WEATHER, WEATHER]}, 400, "tools"),
    "tool without function": ({"tools": [{"type": "function"}]}, 422, "tools.0.function"),
    "tool of another type": ({"tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, 422, "tools.0.type"),
    "bad function name": ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, 422, "tools.0.function.name"),
    "bad tool_choice": ({"tools": TOOLS, "tool_choice": "always"}, 422, "tool_choice"),
    "tool message without content": ({"messages": HI + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "x"}]},
        400, "messages"),
    "user message without content": ({"messages": [{"role": "user", "content": None}]}, 400, "messages"),
    "tool calls in a user message": ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, 400, "messages"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_structured_input_is_refused_naming_the_param(live_qwen, case):
    fields, status, param = BAD[case]
    r = httpx.post(live_qwen.url + "/v1/chat/completions", json={"model": SERVED, "messages": HI, "max_tokens": 4, **fields})
    check_error(r, status, None)
    assert r.json()["error"]["param"] == param, r.text
    if case in LIBRARY_SAYS:  # llguidance's own message
        assert LIBRARY_SAYS[case] in r.json()["error"]["message"]


LIBRARY_SAYS = {"invalid json schema": "no-such-type", "invalid regex": "unclosed group", "invalid parameters schema": "type"}

NO_ANSWER = {  # request fields -> (param, what the one-line message says)
    "false schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}},
                     "response_format", "the schema is false, which no JSON value satisfies"),
    "schema that only refers to itself": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
        "response_format", "invalid json schema: no text satisfies it"),
    "required property that only recurses": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}}, "response_format",
        "invalid json schema: no finite text satisfies it"),
    "regex matching nothing": ({"viasd": {"regex": r"[^\s\S]"}}, "viasd.regex", "invalid regex: no text satisfies it"),
    "regex too large to build": ({"viasd": {"regex": "a{1000000}"}}, "viasd.regex", "invalid regex: no finite text satisfies it"),
}


@pytest.mark.parametrize("case", list(NO_ANSWER))
def test_constraints_with_no_finite_answer_are_400s_naming_why(live_qwen, case):
    """Not a 200 with empty content, a 500 (`false`), or an error without its param once decoding began."""
    fields, param, says = NO_ANSWER[case]
    r = httpx.post(live_qwen.url + "/v1/chat/completions", json={"model": SERVED, "messages": HI, "max_tokens": 4, **fields})
    check_error(r, 400, "invalid_value")
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"] and "\n" not in error["message"], r.text


def test_a_true_schema_is_any_json_value(oc):
    r = chat(oc, response_format={"type": "json_schema", "json_schema": {"name": "any", "schema": True}}, max_tokens=8)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")


def test_tool_arguments_take_only_their_declared_keys():
    args = parameters(TIME["function"] | {"parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}}})
    assert args["additionalProperties"] is False


def test_families_grammars_and_parsers(tiny_qwen):
    """Llama 3's JSON calls and the generic form (a template without tools): the grammar holds what the
    parser reads back, and a stream's fragments add up to the whole answer's calls."""
    from viasd.api import constraint_for

    assert family_of(tiny_qwen.tokenizer) == HERMES
    llama = "<|start_header_id|>ipython<|end_header_id|>{{ '{\"name\": \"' + t.name + '\", \"parameters\": ' }}<|python_tag|>"
    assert family_of(SimpleNamespace(chat_template=llama)) == LLAMA3
    assert family_of(SimpleNamespace(chat_template={"default": "x", "tool_use": "<tool_call>"})) == HERMES
    functions = [t["function"] for t in TOOLS]
    cases = {LLAMA3: '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "f"}}; '
                     '{"name": "get_time", "parameters": {"utc": true}}',
             GENERIC: 'ok <tool_call>\n{"name": "get_time", "arguments": {"utc": false}}\n</tool_call>'}
    for family, text in cases.items():
        constraint = constraint_for(tiny_qwen, {"type": "grammar", "grammar": grammar(ToolPlan(functions, "auto", True, family))})
        matcher = constraint.matcher
        assert all(matcher.consume_token(t) for t in tiny_qwen.tokenizer.encode(text)) and matcher.is_accepting(), family
        whole = split(text, family, final=True)
        assert [c[0] for c in whole.calls] == (["get_weather", "get_time"] if family == LLAMA3 else ["get_time"])
        stream = ToolStream(family)
        deltas = [d for i in range(0, len(text), 3) for d in stream.feed(text[i:i + 3])] + stream.feed("", final=True)
        args = {}
        for d in deltas:
            for frag in d.get("tool_calls", []):
                args[frag["index"]] = args.get(frag["index"], "") + frag["function"]["arguments"]
        assert [args[i] for i in sorted(args)] == [c[1] for c in whole.calls]
        assert "".join(d.get("content", "") for d in deltas) == whole.content


def test_generic_template_gets_the_tools_in_a_system_message(tiny_qwen):
    template = tiny_qwen.tokenizer.chat_template  # swapped for one that knows no tools, then restored
    tiny_qwen.tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    try:
        assert family_of(tiny_qwen.tokenizer) == GENERIC
        plan = ToolPlan([t["function"] for t in TOOLS], "required", False, GENERIC)
        call = {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": {"utc": True}}}
        messages = HI + [{"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c", "content": "12:00"}]
        text = tiny_qwen.tokenizer.decode(chat_prompt(tiny_qwen, messages, plan))
        assert text.startswith("<system># Tools") and '"name": "get_weather"' in text
        assert text.endswith('<user>hi\n<assistant><tool_call>\n{"name": "get_time", "arguments": {"utc": true}}\n</tool_call>\n'
                             "<user><tool_response>\n12:00\n</tool_response>\n<assistant>")
    finally:
        tiny_qwen.tokenizer.chat_template = template


def test_tags_that_are_tokens_of_their_own():
    """Qwen2.5's <tool_call> is one added token, which llguidance reads as a special one: the grammar names
    it by id; where decoding drops it, the answer is decoded again around it. Bare JSON calls (Qwen2.5-Coder
    answers those under `auto`) are calls too."""
    import llguidance
    import llguidance.hf

    from viasd.decoding.grammar import grammar_of
    from viasd.server.tools import tag_tokens

    tok = bpe_tokenizer(300, CORPUS)
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    tags = tag_tokens(tok)
    assert tags is not None and tok.decode(list(tags), skip_special_tokens=True) == ""
    plan = ToolPlan([t["function"] for t in TOOLS], "auto", True, HERMES, tags, True, tok)
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=len(tok)),
                                   grammar_of({"type": "grammar", "grammar": grammar(plan)}), log_level=0)
    call = '\n{"name": "get_time", "arguments": {"utc": true}}\n'
    ids = tok.encode("ok ", add_special_tokens=False) + [tags[0]] + tok.encode(call, add_special_tokens=False) + [tags[1]]
    assert all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()
    text = plan.answer_text(tok.decode(ids, skip_special_tokens=True), ids)
    assert text == "ok <tool_call>" + call + "</tool_call>"
    assert split(text, HERMES, final=True).calls == [["get_time", '{"utc": true}', True]]
    bare = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
    assert split(bare, HERMES, final=True) == split(bare, GENERIC, final=True)
    assert split(bare, HERMES, final=True).calls == [["get_weather", '{"city": "Oslo", "unit": "c"}', True]]
    assert split(bare[:20], HERMES, final=False).content == ""  # (held: it may be a call)
    fenced = "```json\n" + bare + "\n```"  # Qwen2.5-Coder-1.5B's answer under auto
    ids = tok.encode(fenced, add_special_tokens=False)
    matcher.reset()
    assert all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()
    assert split(fenced, HERMES, final=True).calls == split(bare, HERMES, final=True).calls
    assert split(fenced, HERMES, final=True).content == "" and split("```js", HERMES, final=False).content == ""
    matcher.reset()  # a code fence of another language is text
    assert all(matcher.consume_token(t) for t in tok.encode("```py\nx = 1\n```", add_special_tokens=False))
    assert split("```py\nx = 1\n```", HERMES, final=True).content == "```py\nx = 1\n```"
