"""POST /v1/completions and /v1/chat/completions: a request checked, queued for the worker, and
answered whole or as a stream."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from viasd.server import dialect, fim
from viasd.server.engine import Draining, Job, QueueFull
from viasd.server.errors import APIError
from viasd.server.parsing import config_for, parse, read_json
from viasd.server.responses import Reply
from viasd.server.schemas import ChatCompletionRequest, CompletionRequest
from viasd.server.streaming import answer_stream
from viasd.server.tools import ToolPlan, chat_prompt, grammar, plan_of

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request):
    state = request.app.state
    req = parse(CompletionRequest, await read_json(request, state.settings.max_body_bytes), state.served)
    return await run(request, "completions", req, completion_prompt(state, req), req.max_tokens, chat=False)


def completion_prompt(state, req: CompletionRequest):
    """What a completion request decodes: its prompt, or with a `suffix` the model's FIM layout around the gap."""
    prompt, vocab_size = req.prompt, state.model.config.vocab_size
    if req.suffix is not None:
        if not isinstance(prompt, str):
            raise APIError(400, "suffix needs the prompt as text (the code before the gap), not token ids", param="prompt",
                           code="invalid_value")
        return fim.plain(state.model, fim.require_fim(state, "suffix"), prompt, req.suffix)
    if isinstance(prompt, list):
        bad = [t for t in prompt if t >= vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} out of range: the vocabulary has {vocab_size} ids",
                           param="prompt", code="invalid_value")
    elif not prompt.strip():
        raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
    return prompt


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state = request.app.state
    req = parse(ChatCompletionRequest, await read_json(request, state.settings.max_body_bytes), state.served)
    return await answer(start_chat(request, req, "chat"), req)


def chat_input(state, req: ChatCompletionRequest) -> tuple[object, ToolPlan | None]:
    """What a chat request decodes (its prompt) and the tools its answer may call, checked."""
    if not state.model.has_chat_template:
        raise APIError(400, f"{state.served} has no chat template: use /v1/completions", code="no_chat_template")
    messages = [m.as_engine() for m in req.messages]
    if messages[-1]["role"] not in ("user", "tool"):
        raise APIError(400, "the last message must be a user message (or a tool's result) for the model to answer",
                       param="messages", code="invalid_value")
    plan = plan_of(req, state.model.tokenizer)
    return chat_prompt(state.model, messages, plan), plan


def start_chat(request: Request, req: ChatCompletionRequest, endpoint: str) -> Reply:
    """A chat request's decode queued (the other dialects translate theirs into one: routes_responses.py, routes_messages.py)."""
    prompt, plan = chat_input(request.app.state, req)
    return start(request, endpoint, req, prompt, req.limit(), chat=True, plan=plan)


async def run(request: Request, endpoint: str, req, prompt, max_tokens: int | None, chat: bool, plan: ToolPlan | None = None):
    """Queue the decode of `prompt`, then answer: the whole text, or a stream of it."""
    return await answer(start(request, endpoint, req, prompt, max_tokens, chat, plan), req)


async def answer(reply: Reply, req):
    if req.stream:
        return await answer_stream(reply, bool(req.stream_options and req.stream_options.include_usage))
    return await answer_whole(reply)


def start(request: Request, endpoint: str, req, prompt, max_tokens: int | None, chat: bool, plan: ToolPlan | None = None) -> Reply:
    """The decode of `prompt` queued for the worker, and the Reply that will answer it."""
    state = request.app.state
    settings = config_for(req, max_tokens, state.defaults, state.model.config.max_positions, state.model.config.vocab_size)
    settings["chat"] = chat
    if plan is not None:  # the answer: text or calls of the declared functions, as tool_choice allows
        settings["response_format"] = {"type": "grammar", "grammar": grammar(plan)}
    job = Job(prompt, settings, req.stops(), asyncio.get_running_loop(), stream=bool(req.stream))
    submit(state.worker, job)
    watcher = asyncio.create_task(watch_disconnect(request, job))
    return Reply(job, endpoint, chat, state.served, state.metrics, watcher, plan, state.model, bool(req.viasd and req.viasd.provenance))


def submit(worker, job: Job) -> None:
    try:
        worker.submit(job)
    except QueueFull:
        raise APIError(503, f"the server is busy: {worker.max_queue} requests already wait; retry later",
                       "server_error", code="queue_full", headers={"Retry-After": "1"}) from None
    except Draining:
        raise APIError(503, "the server is shutting down", "server_error", code="shutting_down") from None


async def watch_disconnect(request: Request, job: Job) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.stop("client")
            return


async def answer_whole(reply: Reply):
    ended = await dialect.whole(reply)
    return ended if ended is not None else reply.body()
