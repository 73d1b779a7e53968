"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): the request schema, its
translation into a chat completions request (one decode path: strategies, tools, structured output, stop
strings, batching and the prefix cache as chat's), and the chat answer translated back into a Message,
whole or as the event sequence the `anthropic` SDK parses."""

from __future__ import annotations

import json
import uuid
from contextlib import aclosing
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, ValidationError, create_model

from viasd.server.errors import APIError, validation_error
from viasd.server.responses import record
from viasd.server.schemas import ChatCompletionRequest, FunctionName, MaxTokens, Strict, ViasdExtension, field_of
from viasd.settings import SETTINGS

Text = Annotated[str, Field(max_length=1_000_000)]
Id = Annotated[str, Field(min_length=1, max_length=256)]
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


class TextBlock(Strict):
    type: Literal["text"]
    text: Text
    cache_control: dict | None = None
    citations: list | None = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: Id
    name: FunctionName
    input: dict
    cache_control: dict | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: Id
    content: Text | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class InputMessage(Strict):
    role: Literal["user", "assistant", "system"]  # (system: as current clients send it inside messages)
    content: Text | Annotated[list[Block], Field(max_length=10_000)]


class ToolDef(Strict):
    name: FunctionName
    description: Annotated[str, Field(max_length=100_000)] | None = None
    input_schema: dict
    type: Literal["custom"] | None = None
    cache_control: dict | None = None
    strict: bool | None = None


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict | bool = Field(alias="schema")


class OutputConfig(Strict):
    format: OutputFormat | None = None
    effort: str | None = None


# Anthropic's sampling fields, declared by settings.py (their bounds the server's)
_Sampling = create_model("_AnthropicSampling", __base__=Strict,  # type: ignore[call-overload]
                         **{n: (field_of(SETTINGS[n]), None) for n in ("temperature", "top_p", "top_k")})


class CountTokensRequest(_Sampling):  # type: ignore[valid-type, misc]  # (a model made from settings.py)
    model: Annotated[str, Field(min_length=1, max_length=512)]
    messages: Annotated[list[InputMessage], Field(min_length=1, max_length=10_000)]
    system: Text | list[TextBlock] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    viasd: ViasdExtension | None = None
    metadata: dict | None = None
    service_tier: str | None = None

    def unsupported(self) -> str | None:
        return "thinking" if self.thinking is not None and self.thinking.type != "disabled" else None

    def contradiction(self) -> tuple[str, str, str] | None:
        return None

    def stops(self) -> list[str]:
        return []


class MessagesRequest(CountTokensRequest):
    max_tokens: get_args(MaxTokens)[0]  # type: ignore[valid-type]  # (required and not null, as Anthropic's)
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=16)] | None = None
    stream: bool = False

    def stops(self) -> list[str]:
        return list(self.stop_sequences or [])


def anthropic_error_body(e: APIError) -> dict:
    """Anthropic's error body (`{"type": "error", "error": {"type", "message"}}`), its type by status."""
    kinds = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large",
             429: "rate_limit_error", 503: "overloaded_error"}
    return {"type": "error", "error": {"type": kinds.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error"),
                                       "message": e.message}}


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content or [] if isinstance(b, TextBlock))


def chat_messages(req: CountTokensRequest) -> list[dict]:
    """The conversation as chat messages: the system prompt first, tool_use blocks as an assistant's tool calls,
    tool_result blocks as tool messages (before the user's text that comes with them)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": _text(req.system)}] if req.system else []
    for i, m in enumerate(req.messages):
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if m.role != "user" and any(isinstance(b, ToolResultBlock) for b in blocks):
            raise APIError(400, f"messages.{i}: tool_result blocks belong in a user message", param=f"messages.{i}",
                           code="invalid_value")
        if m.role == "system" and any(isinstance(b, ToolUseBlock) for b in blocks):
            raise APIError(400, f"messages.{i}: tool_use blocks belong in an assistant message", param=f"messages.{i}",
                           code="invalid_value")
        results = [b for b in blocks if isinstance(b, ToolResultBlock)]
        for r in results:
            text = _text(r.content)
            out.append({"role": "tool", "tool_call_id": r.tool_use_id, "content": f"Error: {text}" if r.is_error else text})
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                 for b in blocks if isinstance(b, ToolUseBlock)]
        text = _text(blocks)
        if m.role == "user" and results and not text:
            continue
        out.append({"role": m.role, "content": text if text or not calls else None, **({"tool_calls": calls} if calls else {})})
    return out


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completions request that decodes what `req` asks."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req),
                  **{n: getattr(req, n) for n in ("temperature", "top_p", "top_k") if getattr(req, n) is not None}}
    if isinstance(req, MessagesRequest):
        body.update(max_completion_tokens=req.max_tokens, stream=req.stream, stop=req.stop_sequences)
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.input_schema}}
                         for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool" and choice.name is None:
            raise APIError(400, "tool_choice.name: a tool_choice of type 'tool' names the tool", param="tool_choice.name",
                           code="invalid_value")
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}} if choice.type == "tool" else \
            {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use is not None:
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
    if req.viasd is not None:
        body["viasd"] = req.viasd.model_dump(exclude_none=True)
    if len(body.get("stop") or []) > 4:  # (chat takes 4 stop strings; the engine any number)
        stops, body["stop"] = body["stop"], None
    else:
        stops = None
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise validation_error(e) from None
    if stops is not None:
        chat.stop = stops
    wrong = chat.contradiction()
    if wrong is not None:
        message = wrong[2].replace("'tool_call_id'", "'tool_use_id'").replace("'tool_calls'", "tool_use blocks")
        raise APIError(400, message.replace("messages with role 'tool'", "tool_result blocks"), param="messages", code=wrong[1])
    return chat


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def tool_use_id(chat_id: str) -> str:
    return "toolu_" + chat_id.removeprefix("call_")


def tool_input(arguments: str) -> dict:
    """A call's arguments as the object Anthropic's `input` is ({} where decoding was cut before they closed)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_of(job, finish: str, stops: list[str]) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a chat finish reason (a stop string found where the text ends)."""
    if finish == "stop" and stops:
        full, text = job.result.text if job.result is not None else "", job.text
        rest = full[len(text):] if full.startswith(text) else ""
        hit = next((s for s in stops if rest.startswith(s)), None)
        if hit is not None:
            return "stop_sequence", hit
    return STOP_REASONS.get(finish, "end_turn"), None


class MessageShape:
    """The Message of one request: its id, model and the stop strings it was asked to stop at."""

    def __init__(self, served: str, stops: list[str]):
        self.served, self.stops, self.id = served, stops, new_id("msg_")

    def body(self, content: list, stop_reason: str | None, stop_sequence: str | None, input_tokens: int, output_tokens: int,
             extension: dict | None = None) -> dict:
        out = {"id": self.id, "type": "message", "role": "assistant", "model": self.served, "content": content,
               "stop_reason": stop_reason, "stop_sequence": stop_sequence,
               "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}
        if extension is not None:
            out["viasd"] = extension
        return out

    def whole(self, chat: dict, job) -> dict:
        """The Message of a whole chat completion (`Reply.body`)."""
        choice = chat["choices"][0]
        message, calls = choice["message"], choice["message"].get("tool_calls") or []
        content = [{"type": "text", "text": message.get("content") or ""}] if message.get("content") or not calls else []
        content += [{"type": "tool_use", "id": tool_use_id(c["id"]), "name": c["function"]["name"],
                     "input": tool_input(c["function"]["arguments"])} for c in calls]
        reason, seq = stop_of(job, choice["finish_reason"], self.stops)
        u = chat["usage"]
        return self.body(content, reason, seq, u["prompt_tokens"], u["completion_tokens"], chat.get("viasd"))


def sse(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()


class MessageEvents:
    """A streamed chat answer's chunks (`streaming.chunks`) as Anthropic's events: message_start, then per content
    block content_block_start, its deltas (text_delta / input_json_delta) and content_block_stop (a ping after the
    first start), then message_delta (stop_reason, usage) and message_stop."""

    def __init__(self, shape: MessageShape, reply, input_tokens: int):
        self.shape, self.reply, self.input_tokens = shape, reply, input_tokens
        self.blocks = 0  # content blocks started
        self.open: str | None = None  # the open block's type
        self.pinged = False

    def start(self, block: dict) -> list[bytes]:
        out = self.stop()
        out.append(sse("content_block_start", {"index": self.blocks, "content_block": block}))
        self.blocks += 1
        self.open = block["type"]
        if not self.pinged:
            self.pinged = True
            out.append(sse("ping", {}))
        return out

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", {"index": self.blocks - 1})]

    def delta(self, delta: dict) -> bytes:
        return sse("content_block_delta", {"index": self.blocks - 1, "delta": delta})

    async def render(self, chunks):
        async with aclosing(chunks):
            yield sse("message_start", {"message": self.shape.body([], None, None, self.input_tokens, 0)})
            finish = None
            async for data in chunks:
                if data == "[DONE]":
                    break
                if "error" in data:  # the decode failed (or the server stopped it)
                    for b in self.stop():
                        yield b
                    yield sse("error", {"error": {"type": "overloaded_error" if data["error"]["type"] == "server_error"
                                                  else "invalid_request_error", "message": data["error"]["message"]}})
                    return
                if not data["choices"]:
                    continue
                choice = data["choices"][0]
                delta = choice["delta"]
                if delta.get("content"):
                    for b in self.start({"type": "text", "text": ""}) if self.open != "text" else []:
                        yield b
                    yield self.delta({"type": "text_delta", "text": delta["content"]})
                for frag in delta.get("tool_calls") or []:
                    fn = frag.get("function") or {}
                    if frag.get("id"):
                        for b in self.start({"type": "tool_use", "id": tool_use_id(frag["id"]), "name": fn.get("name", ""), "input": {}}):
                            yield b
                    if fn.get("arguments"):
                        yield self.delta({"type": "input_json_delta", "partial_json": fn["arguments"]})
                finish = choice["finish_reason"] or finish
            else:
                return  # the client left: nobody to tell
            if not self.blocks:  # an empty answer: one empty text block, as a whole message has
                for b in self.start({"type": "text", "text": ""}):
                    yield b
            for b in self.stop():
                yield b
            job = self.reply.job
            reason, seq = stop_of(job, finish or "stop", self.shape.stops)
            yield sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                        "usage": {"output_tokens": job.result.stats.new_tokens}, "viasd": record(job)})
            yield sse("message_stop", {})
