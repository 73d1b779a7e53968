"""Ollama's API: GET /api/tags, /api/version, POST /api/show, /api/chat, /api/generate (the `ollama`
client, Open WebUI). A chat or generate request is translated into the OpenAI request it amounts to
(`options` onto the declared settings, `format` onto response_format, `tools` as they are, `suffix` as
fill-in-the-middle) and decoded by the same path; answers are Ollama's records, whole or streamed as
NDJSON ending with the record that says `done` and counts the tokens and nanoseconds. Errors:
`{"error": "message"}` with a 4xx status (a line of that shape ends a stream that fails).

`options.viasd` takes the `viasd` extension object (strategy, mode, drafting ...), as /v1's requests do."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, UTC
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, create_model

from viasd.server import dialect
from viasd.server.errors import DIALECT_ERRORS, APIError
from viasd.server.responses import Reply, record
from viasd.server.routes_completions import completion_prompt, start, start_chat
from viasd.server.schemas import ChatCompletionRequest, CompletionRequest, Strict, ViasdExtension, field_of
from viasd.server.tools import ToolStream, split, whole_message
from viasd.settings import MAX_NEW_TOKENS, SETTINGS
from viasd.version import __version__

router = APIRouter()
DIALECT_ERRORS["/api/"] = lambda e: {"error": e.message}
OLLAMA_VERSION = "0.12.0"  # the Ollama API this one answers as (clients gate features on it)

# Ollama's options that are decode settings: option name -> setting name (settings.py)
SAMPLING = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "repeat_penalty": "repetition_penalty"}
# Ollama's options with nothing to set here (its runner's memory and threads, samplers it has dropped): accepted, ignored
IGNORED = ("numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mmap",
           "use_mlock", "embedding_only", "num_thread", "num_keep", "repeat_last_n", "tfs_z", "typical_p", "mirostat",
           "mirostat_tau", "mirostat_eta", "penalize_newline")
_OPTION_FIELDS: dict[str, Any] = {
    **{o: (field_of(SETTINGS[s]), None) for o, s in SAMPLING.items()},
    "num_predict": (Annotated[int, Field(ge=-2, le=MAX_NEW_TOKENS)] | None, None),  # -1, -2 (no limit, fill the context): the default
    "stop": (list[Annotated[str, Field(min_length=1, max_length=256)]] | None, None),
    "viasd": (ViasdExtension | None, None),
    **{o: (object, None) for o in IGNORED}}
if TYPE_CHECKING:  # (built from the settings below; mypy reads its fields as Any)
    class Options(Strict):
        def __getattr__(self, name: str) -> Any: ...
else:
    Options = create_model("Options", __base__=Strict, **_OPTION_FIELDS)


class Lenient(BaseModel):
    """Ollama's request bodies: typed strictly, fields it does not know ignored (as Ollama does)."""

    model_config = ConfigDict(strict=True, extra="ignore")


class CalledFunction(Lenient):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    arguments: dict = Field(default_factory=dict)


class Call(Lenient):
    function: CalledFunction


class Message(Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list | None = None
    tool_calls: list[Call] | None = None
    tool_name: str | None = None


Format = Literal["", "json"] | dict | None


class _Request(Lenient):
    model: Annotated[str, Field(min_length=1, max_length=512)]
    format: Format = None
    options: Options | None = None
    stream: bool = True  # (Ollama streams unless told not to)
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    keep_alive: object = None


class ChatBody(_Request):
    messages: Annotated[list[Message], Field(max_length=10_000)] = Field(default_factory=list)
    tools: Annotated[list[dict], Field(max_length=128)] | None = None


class GenerateBody(_Request):
    prompt: Annotated[str, Field(max_length=1_000_000)] = ""
    suffix: Annotated[str, Field(max_length=1_000_000)] = ""
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list | None = None


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def checked_model(state, name: str) -> str:
    if name not in (state.served, state.served + ":latest"):
        raise APIError(404, f"model {name!r} not found: this server has {state.served!r}", code="model_not_found")
    return name


def common_fields(state, body: _Request, chat: bool) -> dict:
    """The OpenAI request fields of Ollama's `options`, `format` and logprobs."""
    out: dict = {"model": state.served, "stream": body.stream}
    if body.think not in (None, False):
        raise APIError(400, f"{state.served} does not support thinking", code="invalid_value")
    o = body.options
    if o is not None:
        out.update({s: getattr(o, name) for name, s in SAMPLING.items() if getattr(o, name) is not None})
        if o.num_predict is not None and o.num_predict > 0:
            out["max_tokens"] = o.num_predict
        elif o.num_predict == 0:
            raise APIError(400, "options.num_predict 0 asks for no tokens: give a positive number, or -1 for no limit",
                           code="invalid_value")
        if o.stop:
            out["stop"] = o.stop
        if o.viasd is not None:
            out["viasd"] = o.viasd.model_dump(exclude_none=True)
    if body.format == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": body.format}}
    if body.logprobs:
        out.update({"logprobs": True, "top_logprobs": body.top_logprobs or 0} if chat else {"logprobs": body.top_logprobs or 0})
    return out


def openai_messages(messages: list[Message]) -> list[dict]:
    """Ollama's messages as OpenAI's: calls get ids, and each tool result the id of the call it answers
    (the one of its `tool_name`, else the next unanswered one)."""
    out: list[dict] = []
    open_calls: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.images:
            raise APIError(400, "images are not supported: the model reads text only", param=f"messages[{i}].images",
                           code="invalid_value")
        entry: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.role == "assistant" and m.tool_calls:
            calls = [{"id": f"call_{i}_{k}", "type": "function",
                      "function": {"name": c.function.name, "arguments": json.dumps(c.function.arguments)}}
                     for k, c in enumerate(m.tool_calls)]
            entry["tool_calls"], open_calls = calls, list(calls)
        elif m.role == "tool":
            match = next((c for c in open_calls if c["function"]["name"] == m.tool_name), open_calls[0] if open_calls else None)
            if match is not None:
                open_calls.remove(match)
            entry["tool_call_id"] = match["id"] if match is not None else "none"
        elif m.role != "tool":
            open_calls = []
        out.append(entry)
    return out


def ollama_calls(message: dict) -> list[dict]:
    """An OpenAI message's tool calls as Ollama's (arguments an object)."""
    calls = []
    for c in message.get("tool_calls") or []:
        try:
            args = json.loads(c["function"]["arguments"])
        except ValueError:  # (cut by the token budget)
            args = {}
        calls.append({"function": {"name": c["function"]["name"], "arguments": args if isinstance(args, dict) else {}}})
    return calls


def final(reply: Reply, name: str, key: str) -> dict:
    """The record that ends an answer: done, why, and the token counts and durations (ns)."""
    t = dialect.timings(reply)
    ns = lambda s: int(s * 1e9)  # noqa: E731
    text = {"role": "assistant", "content": ""} if key == "message" else ""
    return {"model": name, "created_at": now(), key: text, "done": True, "done_reason": reply.job.finish_reason,
            "total_duration": ns(t["total_s"]), "load_duration": 0, "prompt_eval_count": t["prompt_n"],
            "prompt_eval_duration": ns(t["prompt_s"]), "eval_count": t["predicted_n"], "eval_duration": ns(t["predicted_s"]),
            "viasd": record(reply.job)}


def logprobs_of(reply: Reply, tokens) -> list | None:
    lp = reply.token_logprobs(tokens)
    return None if lp is None else lp["content"]


def loaded(name: str, key: str) -> dict:
    """Ollama's answer to a request with nothing to generate (no messages, an empty prompt): the model is loaded."""
    return {"model": name, "created_at": now(), key: {"role": "assistant", "content": ""} if key == "message" else "",
            "done": True, "done_reason": "load"}


async def answer(reply: Reply, name: str, key: str, stream: bool):
    """The whole answer as one record, or NDJSON records as the text comes (`key`: "message" or "response")."""
    plan = reply.tools
    if not stream:
        ended = await dialect.whole(reply)
        if ended is not None:
            return ended
        job = reply.job
        out = final(reply, name, key)
        if key == "message":
            message: dict[str, Any] = {"role": "assistant", "content": job.text}
            if plan is not None:
                message, _ = whole_message(plan.answer_text(job.text, job.decoded.token_ids), "stop", plan.family)
                message = {"role": "assistant", "content": message.get("content") or "",
                           **({"tool_calls": ollama_calls(message)} if message.get("tool_calls") else {})}
            out[key] = message
        else:
            out[key] = job.text
        if reply.logprobs is not None:
            out["logprobs"] = logprobs_of(reply, job.tokens)
        return out
    event = await dialect.first(reply)
    if isinstance(event, Response):
        return event
    return StreamingResponse(records(reply, event, name, key), media_type="application/x-ndjson")


async def records(reply: Reply, event: tuple, name: str, key: str):
    plan = reply.tools
    calls = ToolStream(plan.family) if plan is not None and not plan.dropped else None

    def record_of(text: str, tokens=None, **more) -> bytes:
        r: dict[str, Any] = {"model": name, "created_at": now(),
                             key: {"role": "assistant", "content": text, **more} if key == "message" else text, "done": False}
        if tokens and reply.logprobs is not None:
            r["logprobs"] = logprobs_of(reply, tokens)
        return (json.dumps(r, ensure_ascii=False) + "\n").encode()

    async for ev in dialect.events(reply, event):
        if ev[0] == "text":
            text = ev[1]
            if calls is not None:  # only what is surely text; the calls come whole at the end
                text = "".join(d.get("content", "") for d in calls.feed(text))
            if text or (ev[2] and reply.logprobs is not None):
                yield record_of(text, ev[2])
        elif ev[0] == "done":
            job = reply.job
            if plan is not None:
                whole = plan.answer_text(job.text, job.decoded.token_ids)
                parsed = split(whole, plan.family, True)
                rest = "".join(d.get("content", "") for d in calls.feed("", final=True)) if calls is not None else \
                    (whole if not parsed.calls else parsed.content)
                message, _ = whole_message(whole, "stop", plan.family)
                found = ollama_calls(message)
                if rest or found:
                    yield record_of(rest, **({"tool_calls": found} if found else {}))
            yield (json.dumps(final(reply, name, key), ensure_ascii=False) + "\n").encode()
        else:
            yield (json.dumps({"error": ev[1].message}, ensure_ascii=False) + "\n").encode()


@router.post("/api/chat")
async def chat(request: Request):
    state = request.app.state
    body = await dialect.body_of(request, ChatBody)
    name = checked_model(state, body.model)
    if not body.messages:
        return loaded(name, "message")
    fields = {**common_fields(state, body, chat=True), "messages": openai_messages(body.messages)}
    if body.tools:
        fields["tools"] = [{"type": t.get("type", "function"), "function": t.get("function")} for t in body.tools]
    req = dialect.translated(ChatCompletionRequest, fields, state.served)
    return await answer(start_chat(request, req, "ollama_chat"), name, "message", body.stream)


@router.post("/api/generate")
async def generate(request: Request):
    state = request.app.state
    body = await dialect.body_of(request, GenerateBody)
    name = checked_model(state, body.model)
    for field, given in (("images", body.images), ("context", body.context), ("template", body.template)):
        if given:
            raise APIError(400, f"{field} is not supported by this server", code="unsupported_parameter")
    if not body.prompt and not body.suffix:
        return loaded(name, "response")
    as_chat = not body.suffix and not body.raw and state.model.has_chat_template
    fields = common_fields(state, body, chat=as_chat)
    if body.suffix:  # fill in the middle: the prompt before the gap, the suffix after it
        req = dialect.translated(CompletionRequest, {**fields, "prompt": body.prompt, "suffix": body.suffix}, state.served)
        reply = start(request, "ollama_generate", req, completion_prompt(state, req), req.max_tokens, chat=False)
    elif not as_chat:  # the prompt as it is
        req = dialect.translated(CompletionRequest, {**fields, "prompt": body.prompt}, state.served)
        reply = start(request, "ollama_generate", req, completion_prompt(state, req), req.max_tokens, chat=False)
    else:  # the prompt as a user's message (after the system one) in the model's template
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + [{"role": "user", "content": body.prompt}]
        req = dialect.translated(ChatCompletionRequest, {**fields, "messages": messages}, state.served)
        reply = start_chat(request, req, "ollama_generate")
    reply.chat = True  # (logprobs in the chat shape, which Ollama's are)
    return await answer(reply, name, "response", body.stream)


def details(state) -> tuple[dict, int]:  # (Ollama's details, the weights' bytes)
    model, c = state.model, state.model.config
    try:
        n = model.decoder.weight_bytes()
    except Exception:  # (a decoder without the count)
        n = 0
    return {"parent_model": "", "format": "gguf" if model.source_sha256 else "safetensors", "family": c.family,
            "families": [c.family], "parameter_size": "", "quantization_level": model.weights.upper()}, n


@router.get("/api/tags")
async def tags(request: Request):
    state = request.app.state
    info, size = details(state)
    digest = hashlib.sha256(state.served.encode()).hexdigest()
    modified = datetime.fromtimestamp(state.created, UTC).isoformat().replace("+00:00", "Z")
    return {"models": [{"name": state.served, "model": state.served, "modified_at": modified, "size": size, "digest": digest,
                        "details": info}]}


class ShowBody(Lenient):
    model: Annotated[str, Field(min_length=1, max_length=512)] | None = None
    name: Annotated[str, Field(min_length=1, max_length=512)] | None = None  # (older clients' spelling)
    verbose: bool | None = None


@router.post("/api/show")
async def show(request: Request):
    state = request.app.state
    body = await dialect.body_of(request, ShowBody)
    if body.model is None and body.name is None:
        raise APIError(400, "missing model name", code="missing_required_parameter")
    checked_model(state, body.model or body.name)
    model, c = state.model, state.model.config
    info, _ = details(state)
    template = getattr(model.tokenizer, "chat_template", None)
    capabilities = ["completion"] + (["tools"] if model.has_chat_template else []) + \
        (["insert"] if state.fim is not None else [])
    modified = datetime.fromtimestamp(state.created, UTC).isoformat().replace("+00:00", "Z")
    return {"modelfile": f"FROM {state.served}\n", "parameters": "", "template": template if isinstance(template, str) else "",
            "details": info, "capabilities": capabilities, "modified_at": modified,
            "model_info": {"general.architecture": c.architecture, f"{c.family}.context_length": c.max_positions,
                           f"{c.family}.block_count": c.n_layers, f"{c.family}.embedding_length": c.hidden,
                           f"{c.family}.attention.head_count": c.n_heads, f"{c.family}.attention.head_count_kv": c.n_kv_heads,
                           "tokenizer.vocab_size": c.vocab_size}}


@router.get("/api/version")
async def version():
    return {"version": OLLAMA_VERSION, "viasd": __version__}
