"""Tool calls in OpenAI's shape (`tools`, `tool_choice`, `parallel_tool_calls` of a chat request).

The prompt goes through the model's own chat template with `tools=`; the answer is constrained by an
llguidance Lark grammar whose calls are `%json` objects of each function's name and its `parameters`
schema, and parsed back per template family (as llama.cpp's common/chat.cpp and vLLM's parsers do):

- "hermes" (Qwen2.5, Hermes 2 Pro: the template mentions `<tool_call>`):
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, several separated by a newline
  (under "auto", bare `{"name": "f", "arguments": {...}}` objects too: Qwen2.5-Coder answers those);
- "llama3" (Llama 3.1+ JSON tool calling: `<|python_tag|>` in the template): `{"name": "f", "parameters": {...}}`;
- "generic" (a template that knows no tools): the tools described in a system message, the Hermes form expected.

`tool_choice` "required" or a named function: the whole answer is the calls; "auto": text, or calls
after a lazily matched `<tool_call>` (llguidance's lazy lexeme, what its StructTag builds; the token
itself where the tokenizer has one); "none": no grammar (the tools stay out of the prompt).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from viasd.decoding.grammar import closed_objects, grammar_of
from viasd.errors import UsageError
from viasd.server.errors import APIError

HERMES, LLAMA3, GENERIC = "hermes", "llama3", "generic"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCE = "```json\n"  # Qwen2.5-Coder's own form of a call under "auto" (llama.cpp's Hermes parser reads it too)
# compact JSON with the separators the templates' `tojson` prints: no free whitespace to sample
_JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
_GENERIC_SYSTEM = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
                   "function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function "
                   "call, return a json object with function name and arguments within <tool_call></tool_call> XML "
                   'tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def family_of(tokenizer) -> str:
    """The tool-call form a chat template expects of its model."""
    template = getattr(tokenizer, "chat_template", None) or ""
    text = template if isinstance(template, str) else "\n".join(map(str, template.values()))
    if OPEN in text:
        return HERMES
    if "<|python_tag|>" in text or ('"parameters"' in text and "<|start_header_id|>" in text):
        return LLAMA3
    return GENERIC


@dataclass
class ToolPlan:
    """A request's tools, checked: the functions (OpenAI's dicts), the choice ("auto", "required" or a
    function's name), whether several calls may come, the template family."""

    functions: list[dict]
    choice: str
    parallel: bool
    family: str
    # ids of <tool_call>, </tool_call> where each is a token of its own (llguidance reads added tokens as
    # special ones, which the text "<tool_call>" never matches), and whether decoding drops them
    tags: tuple[int, int] | None = None
    dropped: bool = False
    tokenizer: Any = field(default=None, repr=False)  # a transformers tokenizer

    def answer_text(self, text: str, ids: list[int]) -> str:
        """An answer's text with its tool-call tags: where decoding drops them (special tokens), the
        answer decoded again around them."""
        if not self.dropped:
            return text
        assert self.tags is not None  # (dropped: the tags are special tokens)
        out: list[str] = []
        piece: list[int] = []
        for t in ids:
            if t in self.tags:
                out += [self.tokenizer.decode(piece, skip_special_tokens=True), OPEN if t == self.tags[0] else CLOSE]
                piece = []
            else:
                piece.append(t)
        return "".join(out) + self.tokenizer.decode(piece, skip_special_tokens=True)

    @property
    def args_key(self) -> str:
        return "parameters" if self.family == LLAMA3 else "arguments"

    def template_tools(self) -> list[dict]:
        return [{"type": "function", "function": f} for f in self.functions]


def plan_of(req, tokenizer) -> ToolPlan | None:
    """The tools a chat request declares, checked (a 400 naming the parameter); None when it calls none."""
    tools, choice = req.tools or [], req.tool_choice
    named = choice.function.name if choice is not None and not isinstance(choice, str) else None
    if not tools:
        if named is not None or choice == "required":
            raise APIError(400, "tool_choice asks for a tool call but the request declares no tools", param="tool_choice",
                           code="invalid_value")
        return None
    functions = [t.function.model_dump(exclude_none=True) for t in tools]
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        raise APIError(400, "two tools have the same function name", param="tools", code="invalid_value")
    for i, f in enumerate(functions):
        try:
            grammar_of({"type": "json_schema", "json_schema": {"name": f["name"], "schema": parameters(f)}})
        except UsageError as e:
            raise APIError(400, f"tools[{i}].function.parameters: {e}".replace("response_format: ", ""),
                           param=f"tools[{i}].function.parameters", code="invalid_value") from None
    if named is not None and named not in names:
        raise APIError(400, f"tool_choice names the function {named!r}, which tools does not declare", param="tool_choice",
                       code="invalid_value")
    if choice == "none":
        return None
    fmt = req.response_format
    if fmt is not None and fmt.type != "text" or req.viasd is not None and (req.viasd.regex or req.viasd.grammar):
        raise APIError(400, "response_format constrains the answer and tools would too: give tool_choice 'none' or no "
                            "response_format", param="response_format", code="invalid_value")
    family = family_of(tokenizer)
    tags = tag_tokens(tokenizer) if family != LLAMA3 else None
    dropped = tags is not None and not any(tokenizer.decode([i], skip_special_tokens=True) for i in tags)
    plan = ToolPlan(functions, named or choice or "auto", req.parallel_tool_calls is not False, family, tags, dropped, tokenizer)
    try:  # (the functions' schemas together: over the size limit, say)
        grammar_of({"type": "grammar", "grammar": grammar(plan)})
    except UsageError as e:
        raise APIError(400, f"tools: {e}".replace("response_format: ", ""), param="tools", code="invalid_value") from None
    return plan


def tag_tokens(tokenizer) -> tuple[int, int] | None:
    """The ids of <tool_call> and </tool_call> where each is one token of `tokenizer` (Qwen2.5's)."""
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (OPEN, CLOSE)]
    if any(len(i) != 1 or i[0] == tokenizer.unk_token_id for i in ids):
        return None
    return ids[0][0], ids[1][0]


def parameters(function: dict) -> dict:
    """A function's arguments schema, its objects closed as a json_schema's are (no free keys to repeat)."""
    return closed_objects(function.get("parameters")) or {"type": "object", "properties": {}, "additionalProperties": False}


def grammar(plan: ToolPlan) -> str:
    """The Lark grammar (llguidance's) of the answers `plan` allows."""
    chosen = [f for f in plan.functions if plan.choice in ("auto", "required") or f["name"] == plan.choice]
    lines = ["%llguidance {}", "fn: " + " | ".join(f"fn_{i}" for i in range(len(chosen)))]
    for i, f in enumerate(chosen):
        schema = {"type": "object", "properties": {"name": {"const": f["name"]}, plan.args_key: parameters(f)},
                  "required": ["name", plan.args_key], "additionalProperties": False, "x-guidance": _JSON_STYLE}
        lines.append(f"fn_{i}: %json {json.dumps(schema)}")
    several = plan.parallel and plan.choice in ("auto", "required")
    sep = '"; "' if plan.family == LLAMA3 else r'"\n"'
    lines.append("bare: fn" + (f" ({sep} fn)*" if several else ""))
    # text that opens neither a JSON call nor a ```json fence (those are calls)
    lines.append(r"TEXT: /([^{`](.|\n)*)?|`([^`](.|\n)*)?|``([^`](.|\n)*)?|```([^j](.|\n)*)?|```j([^s](.|\n)*)?|"
                 r"```js([^o](.|\n)*)?|```jso([^n](.|\n)*)?|```json([^\n](.|\n)*)?/")
    lines.append(r'fenced: "```json\n" bare "\n```" "\n"?')
    if plan.family == LLAMA3:
        lines.append("start: " + ("TEXT | bare" if plan.choice == "auto" else "bare"))
        return "\n".join(lines)
    # the tags as text, or as the tokens they are (llguidance reads added tokens as special)
    open_, close = (f"<[{plan.tags[0]}]>", f"<[{plan.tags[1]}]>") if plan.tags else (f'"{OPEN}"', f'"{CLOSE}"')
    lines.append(rf'body: "\n" fn "\n" {close}')
    # (the newline after the last call: where models end their turn; a call after it is not forced)
    lines.append("more: " + (rf'("\n" {open_} body)* "\n"?' if several else r'"\n"?'))
    if plan.choice != "auto":
        lines.append(f"start: {open_} body more")
    elif plan.tags:  # text, text then tagged calls, or bare or fenced JSON calls (Qwen2.5-Coder answers those)
        lines.append(f"start: TEXT | TEXT {open_} body more | bare | fenced")
    else:  # the tag as text, matched lazily
        lines += ["start: TEXT | trig body more | bare | fenced", f"trig[lazy]: TEXT {open_}"]
    return "\n".join(lines)


def prompt_messages(messages: list[dict], plan: ToolPlan | None, generic: bool) -> list[dict]:
    """The conversation as the template takes it: for a template that knows no tools (`generic`), the
    tools described in the system message, calls and their results written out in the Hermes form."""
    if not generic:
        return messages
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            m["content"] = (m.get("content") or "") + "".join(
                f'{OPEN}\n{json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})}\n{CLOSE}'
                for c in calls)
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append({**m, "content": m.get("content") or ""})
    if plan is not None:
        system = _GENERIC_SYSTEM.format(tools="\n".join(json.dumps(t) for t in plan.template_tools()))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


@dataclass
class Calls:
    """An answer split into its text and its tool calls ([name, arguments JSON text, closed])."""

    content: str
    calls: list[list]


def split(text: str, family: str, final: bool) -> Calls:
    """The text and calls of an answer so far; not `final`: only what later tokens cannot change (a
    partial tag or closing held back), so a stream's pieces always add up to the whole answer's."""
    if family == LLAMA3:
        return _split_bare(text, final, "parameters", "; ")
    if text.startswith("{"):  # bare JSON calls, without tags
        return _split_bare(text, final, "arguments", "\n")
    if text.startswith(FENCE + "{"):  # the same in a ```json fence
        inner = _split_bare(text[len(FENCE):], final, "arguments", "\n")
        return Calls("", inner.calls) if inner.calls or not final else Calls(text, [])
    if not final and (FENCE + "{").startswith(text):  # (held: it may open a fenced call)
        return Calls("", [])
    at = text.find(OPEN)
    if at < 0:
        return Calls(text if final else _hold(text, OPEN).rstrip(), [])
    calls, pos = [], at
    while text.startswith(OPEN, pos):
        head = f'{OPEN}\n{{"name": "'
        name_end = text.find('"', pos + len(head))
        key = '", "arguments": '
        if not text.startswith(head, pos) or name_end < 0 or not text.startswith(key, name_end):
            break  # the call's name is not there yet (or not in this form)
        start = name_end + len(key)
        end = text.find("}\n" + CLOSE, start)
        if end < 0:  # still open: its arguments so far (cut by max_tokens: the value, if it is whole)
            calls.append([text[pos + len(head):name_end], _value(text, start) if final else _hold(text[start:], "}\n" + CLOSE), False])
            break
        calls.append([text[pos + len(head):name_end], text[start:end], True])
        pos = end + len("}\n" + CLOSE) + 1  # (the newline between calls)
    if final and not calls:  # a tag but no call in the form asked for: text
        return Calls(text, [])
    return Calls(text[:at].rstrip(), calls)


def _split_bare(text: str, final: bool, args_key: str, sep: str) -> Calls:
    """JSON calls `{"name": ..., args_key: {...}}` separated by `sep` (Llama 3's form)."""
    head, key = '{"name": "', f'", "{args_key}": '
    if not text.startswith("{"):
        return Calls(text, [])
    calls, pos = [], 0
    while text.startswith(head, pos):
        name_end = text.find('"', pos + len(head))
        if name_end < 0 or not text.startswith(key, name_end):
            break
        start = name_end + len(key)
        end = _object_end(text, start)
        if end is None:  # still open: its arguments so far (the outer brace held back)
            calls.append([text[pos + len(head):name_end], _value(text, start) if final else _hold(text[start:], "}"), False])
            break
        calls.append([text[pos + len(head):name_end], text[start:end], True])
        pos = end + 1 + len(sep)
    return Calls("" if calls or not final else text, calls)


def _object_end(text: str, start: int) -> int | None:
    """The index just past the JSON value at `start` if it is complete and its object is closed."""
    try:
        _, end = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None
    return end if text.startswith("}", end) else None


def _value(text: str, start: int) -> str:
    """The JSON value at `start` if it is whole, else the rest of the text (an answer cut short)."""
    try:
        return text[start:json.JSONDecoder().raw_decode(text, start)[1]]
    except ValueError:
        return text[start:]


def _hold(text: str, tag: str) -> str:
    """`text` less its longest tail that could begin `tag`."""
    for n in range(min(len(tag), len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return text[:-n]
    return text


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_calls(parsed: Calls) -> list[dict]:
    """OpenAI's `message.tool_calls` of a whole answer."""
    return [{"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}
            for name, args, _ in parsed.calls]


class ToolStream:
    """A streamed answer's deltas: its text as far as it is surely text, then each call's fragments
    (first its id, type, name and empty arguments, then pieces of its arguments)."""

    def __init__(self, family: str):
        self.family, self.text, self.content_sent = family, "", 0
        self.sent: list[int] = []  # characters of each call's arguments sent

    def feed(self, piece: str, final: bool = False) -> list[dict]:
        self.text += piece
        parsed = split(self.text, self.family, final)
        deltas: list[dict] = []
        if len(parsed.content) > self.content_sent and not self.sent:
            deltas.append({"content": parsed.content[self.content_sent:]})
            self.content_sent = len(parsed.content)
        for i, (name, args, _) in enumerate(parsed.calls):
            if i == len(self.sent):
                deltas.append({"tool_calls": [{"index": i, "id": call_id(), "type": "function",
                                               "function": {"name": name, "arguments": ""}}]})
                self.sent.append(0)
            if len(args) > self.sent[i]:
                deltas.append({"tool_calls": [{"index": i, "function": {"arguments": args[self.sent[i]:]}}]})
                self.sent[i] = len(args)
        return deltas


def chat_prompt(model, messages: list[dict], plan: ToolPlan | None):
    """What the engine decodes for a chat request: its messages as they are, or (tools declared, or
    tool calls and results in the conversation) the token ids of the template given the tools."""
    from viasd.api import check_messages

    try:
        check_messages(messages)  # (a null content outside an assistant's tool calls, ...)
        if plan is None and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            return messages
        generic = (plan.family if plan is not None else family_of(model.tokenizer)) == GENERIC
        messages = prompt_messages(messages, plan, generic)
        tools = plan.template_tools() if plan is not None and not generic else None
        return model.encode(check_messages(messages), True, tools=tools)
    except UsageError as e:
        raise APIError(400, str(e), param="messages", code="invalid_value") from None
    except Exception as e:  # the template's own refusal (jinja raise_exception: roles out of order, ...)
        raise APIError(400, f"the model's chat template refused the conversation: {e}"[:500], param="messages",
                       code="invalid_value") from None


def finish_of(finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason of an answer that called tools (`called`): "tool_calls" where it ended by itself."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def whole_message(text: str, finish_reason: str | None, family: str) -> tuple[dict, str | None]:
    """A whole answer's `message` and `finish_reason` when tools may be called (`text`: `answer_text`'s)."""
    parsed = split(text, family, True)
    if not parsed.calls:
        return {"role": "assistant", "content": text}, finish_reason
    message = {"role": "assistant", "content": parsed.content or None, "tool_calls": tool_calls(parsed)}
    return message, finish_of(finish_reason, True)
