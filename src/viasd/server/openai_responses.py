"""OpenAI's Responses API (POST /v1/responses), stateless: the request schema, its translation into a chat
completions request (one decode path: strategies, tools, structured output, logprobs, batching and the
prefix cache as chat's), and the chat answer translated back into a Response, whole or as its events."""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError

from viasd.server.errors import APIError, validation_error
from viasd.server.responses import record, usage
from viasd.server.schemas import (JSONObjectFormat, ChatCompletionRequest, FunctionName, Logprobs, MaxTokens, Strict,
                                  TextFormat, ViasdExtension, OPENAI_FIELDS, _Sampling)

LOGPROBS = "message.output_text.logprobs"  # the `include` entry that asks for the text's logprobs
Text = Annotated[str, Field(max_length=1_000_000)]
Id = Annotated[str, Field(min_length=1, max_length=256)]


class ContentPart(Strict):
    type: Literal["input_text", "output_text"]  # (an assistant's earlier answer: output_text)
    text: Text
    annotations: list | None = None
    logprobs: list | None = None


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | Annotated[list[ContentPart], Field(min_length=1)]
    id: Id | None = None
    status: str | None = None


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: Id
    name: FunctionName
    arguments: Text
    id: Id | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: Id
    output: Text | list[ContentPart]
    id: Id | None = None
    status: str | None = None


class ItemReference(Strict):  # (a stored item: refused, nothing is stored here)
    type: Literal["item_reference"]
    id: Id


def _item_kind(v) -> str | None:
    return v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None)


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ItemReference, Tag("item_reference")],
                      Discriminator(_item_kind)]


class FunctionTool(Strict):
    type: Literal["function"]
    name: FunctionName
    description: Annotated[str, Field(max_length=100_000)] | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(Strict):
    type: Literal["function"]
    name: FunctionName


class JSONSchemaText(Strict):
    type: Literal["json_schema"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    schema_: dict | bool = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: Annotated[TextFormat | JSONObjectFormat | JSONSchemaText, Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Sampling):  # (its sampling fields: settings.py's, as chat's)
    model: Annotated[str, Field(min_length=1, max_length=512)]
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=10_000)]
    instructions: Text | None = None
    max_output_tokens: MaxTokens = None
    stream: bool = False
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    top_logprobs: Logprobs = None
    include: list[str] | None = None
    viasd: ViasdExtension | None = None
    # state this server does not keep: refused unless empty (`unsupported`)
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: object = None
    prompt: object = None
    reasoning: object = None
    # bookkeeping, accepted and ignored (nothing is stored: `store` true or not)
    store: bool | None = None
    metadata: dict | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    max_tool_calls: int | None = None
    stream_options: dict | None = None

    def unsupported(self) -> str | None:
        for name in ("conversation", "prompt", "reasoning"):
            if getattr(self, name) is not None:
                return name
        return None

    def contradiction(self) -> tuple[str, str, str] | None:
        if self.previous_response_id is not None:
            return ("previous_response_id", "previous_response_not_found",
                    f"previous response {self.previous_response_id!r} not found: this server stores no responses (store: false); "
                    "send the conversation in `input`")
        if self.background:
            return "background", "unsupported_parameter", "background mode needs stored responses, which this server does not keep"
        if not isinstance(self.input, str) and any(isinstance(i, ItemReference) for i in self.input):
            return "input", "invalid_value", "item references need stored items, which this server does not keep: send the items"
        return None

    def stops(self) -> list[str]:
        return []


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completions request that decodes what `req` asks."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    for item in [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input:
        if isinstance(item, MessageItem):
            text = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            messages.append({"role": item.role, "content": text})
        elif isinstance(item, FunctionCallItem):  # calls in a row: one assistant turn (after its text, if any)
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": out})
    body = {"model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens, "stream": req.stream,
            **{n: getattr(req, n) for n in OPENAI_FIELDS if getattr(req, n) is not None}}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else {
            "type": "function", "function": {"name": req.tool_choice.name}}
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, JSONSchemaText):
        body["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)}
    elif fmt is not None:
        body["response_format"] = fmt.as_setting()
    if LOGPROBS in (req.include or []) or req.top_logprobs is not None:
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs
    if req.viasd is not None:
        body["viasd"] = req.viasd.model_dump(exclude_none=True)
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise validation_error(e) from None
    wrong = chat.contradiction()
    if wrong is not None:
        raise APIError(400, wrong[2].replace("'tool_call_id'", "'call_id'").replace("'tool_calls'", "function_call items"),
                       param="input", code=wrong[1])
    return chat


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def message_item(item_id: str, text: str, logprobs: list | None, status: str = "completed") -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part] if status == "completed" else []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments, "status": status}


def response_usage(u: dict) -> dict:
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0}, "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": u["total_tokens"]}


class ResponseShape:
    """The Response object of one request: its id, what it echoes of the request, its output as it grows."""

    def __init__(self, req: ResponsesRequest, served: str):
        self.req, self.served, self.id, self.created = req, served, new_id("resp_"), int(time.time())

    def body(self, output: list, status: str = "completed", usage: dict | None = None, record: dict | None = None,
             error: dict | None = None) -> dict:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        choice = req.tool_choice if req.tool_choice is None or isinstance(req.tool_choice, str) else req.tool_choice.model_dump()
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": error,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.served,
               "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
               "store": False, "background": False, "temperature": req.temperature, "top_p": req.top_p,
               "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}},
               "tool_choice": choice or "auto", "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
               "top_logprobs": req.top_logprobs, "truncation": req.truncation or "disabled", "metadata": req.metadata or {},
               "usage": response_usage(usage) if usage is not None else None}
        if record is not None:
            out["viasd"] = record
        return out

    def whole(self, chat: dict) -> dict:
        """The Response of a whole chat completion (`Reply.body`)."""
        choice = chat["choices"][0]
        message, calls = choice["message"], choice["message"].get("tool_calls") or []
        output = []
        if message.get("content") or not calls:
            output.append(message_item(new_id("msg_"), message.get("content") or "", (choice.get("logprobs") or {}).get("content")))
        output += [call_item(new_id("fc_"), c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        return self.body(output, status, chat["usage"], chat.get("viasd"))


class ResponseEvents:
    """A streamed chat answer's chunks (`streaming.chunks`) as the Responses API's server-sent events."""

    def __init__(self, shape: ResponseShape, reply):
        self.shape, self.reply, self.seq = shape, reply, 0
        self.logprobs: list[dict] = []
        self.output: list[dict] = []  # the items so far (the last one open while `self.open`)
        self.open: str | None = None  # "message" or "call": the kind of the open item
        self.text, self.logprobs = "", []  # the open message's text and logprobs

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    def _index(self) -> int:
        return len(self.output) - 1

    def open_message(self) -> list[bytes]:
        item = message_item(new_id("msg_"), "", None, "in_progress")
        self.output.append(item)
        self.open, self.text, self.logprobs = "message", "", []
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self.event("response.output_item.added", output_index=self._index(), item=item),
                self.event("response.content_part.added", item_id=item["id"], output_index=self._index(), content_index=0, part=part)]

    def text_delta(self, text: str, logprobs: list) -> list[bytes]:
        out = self.open_message() if self.open != "message" else []
        self.text += text
        self.logprobs += logprobs
        return out + [self.event("response.output_text.delta", item_id=self.output[-1]["id"], output_index=self._index(),
                                 content_index=0, delta=text, logprobs=logprobs)]

    def close(self) -> list[bytes]:
        """The events that end the open item, if any."""
        if self.open is None:
            return []
        item, i = self.output[-1], self._index()
        kind, self.open = self.open, None
        if kind == "message":
            done = message_item(item["id"], self.text, self.logprobs)
            self.output[-1] = done
            return [self.event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0, text=self.text,
                               logprobs=self.logprobs),
                    self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                               part=done["content"][0]),
                    self.event("response.output_item.done", output_index=i, item=done)]
        done = {**item, "status": "completed"}
        self.output[-1] = done
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i, name=item["name"],
                           arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=i, item=done)]

    def call_fragment(self, frag: dict) -> list[bytes]:
        fn = frag.get("function") or {}
        out = []
        if frag.get("id"):  # a new call: its item opens
            out = self.close()
            self.output.append(call_item(new_id("fc_"), frag["id"], fn.get("name", ""), "", "in_progress"))
            self.open = "call"
            out.append(self.event("response.output_item.added", output_index=self._index(), item=self.output[-1]))
        if fn.get("arguments"):
            self.output[-1]["arguments"] += fn["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=self.output[-1]["id"],
                                  output_index=self._index(), delta=fn["arguments"]))
        return out

    async def render(self, chunks):
        async with aclosing(chunks):
            yield self.event("response.created", response=self.shape.body([], "in_progress"))
            yield self.event("response.in_progress", response=self.shape.body([], "in_progress"))
            finish = None
            async for data in chunks:
                if data == "[DONE]":
                    break
                if "error" in data:  # the decode failed (or the server stopped it): the response failed
                    for b in self.close():
                        yield b
                    err = data["error"]
                    yield self.event("response.failed", response=self.shape.body(
                        self.output, "failed", error={"code": err.get("code") or "server_error", "message": err["message"]}))
                    return
                if not data["choices"]:
                    continue
                choice = data["choices"][0]
                delta, lp = choice["delta"], (choice.get("logprobs") or {}).get("content") or []
                if delta.get("content") or (lp and not delta.get("tool_calls")):
                    for b in self.text_delta(delta.get("content") or "", lp):
                        yield b
                for frag in delta.get("tool_calls") or []:
                    for b in self.call_fragment(frag):
                        yield b
                finish = choice["finish_reason"] or finish
            else:
                return  # the client left: nobody to tell
            if not self.output:  # an empty answer: one empty message, as a whole response has
                for b in self.open_message():
                    yield b
            for b in self.close():
                yield b
            status = "incomplete" if finish == "length" else "completed"
            yield self.event(f"response.{status}", response=self.shape.body(self.output, status, usage(self.reply.job),
                                                                            record(self.reply.job)))
