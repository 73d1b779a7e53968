"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, translated to a chat
completions request (anthropic_messages.py) and decoded by the one chat path; errors in Anthropic's shape."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from viasd.server.anthropic_messages import (CountTokensRequest, MessageEvents, MessageShape, MessagesRequest, anthropic_error_body,
                                             chat_request)
from viasd.server.errors import DIALECT_ERRORS, APIError
from viasd.server.parsing import parse, read_json
from viasd.server.routes_completions import answer_whole, chat_input, start
from viasd.server.streaming import answer_stream

router = APIRouter()
DIALECT_ERRORS["/v1/messages"] = anthropic_error_body


async def request_of(request: Request, cls):
    """The body as a request of `cls` (Anthropic answers ill-typed bodies with a 400, not a 422)."""
    state = request.app.state
    try:
        return parse(cls, await read_json(request, state.settings.max_body_bytes), state.served)
    except APIError as e:
        if e.status == 422:
            e.status = 400
        raise


def prompt_tokens(model, prompt) -> int:
    """The tokens of a chat prompt (the template's token ids, or the messages it will render)."""
    return len(prompt) if prompt and isinstance(prompt[0], int) else len(model.encode(prompt, True))


@router.post("/v1/messages")
async def messages(request: Request):
    state = request.app.state
    req = await request_of(request, MessagesRequest)
    chat = chat_request(req)
    prompt, plan = chat_input(state, chat)
    shape = MessageShape(state.served, req.stops())
    reply = start(request, "messages", chat, prompt, chat.limit(), chat=True, plan=plan)
    if req.stream:
        return await answer_stream(reply, False, MessageEvents(shape, reply, prompt_tokens(state.model, prompt)).render)
    whole = await answer_whole(reply)
    return whole if isinstance(whole, Response) else shape.whole(whole, reply.job)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    state = request.app.state
    chat = chat_request(await request_of(request, CountTokensRequest))
    prompt, _ = chat_input(state, chat)
    return {"input_tokens": prompt_tokens(state.model, prompt)}
