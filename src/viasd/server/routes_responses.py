"""POST /v1/responses: OpenAI's Responses API, stateless, translated to a chat completions request
(openai_responses.py) and decoded by the one chat path."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from viasd.server.openai_responses import ResponseEvents, ResponseShape, ResponsesRequest, chat_request
from viasd.server.parsing import parse, read_json
from viasd.server.routes_completions import answer_whole, start_chat
from viasd.server.streaming import answer_stream

router = APIRouter()


@router.post("/v1/responses")
async def responses(request: Request):
    state = request.app.state
    req = parse(ResponsesRequest, await read_json(request, state.settings.max_body_bytes), state.served)
    reply = start_chat(request, chat_request(req), "responses")
    shape = ResponseShape(req, state.served)
    if req.stream:
        return await answer_stream(reply, True, ResponseEvents(shape, reply).render)
    whole = await answer_whole(reply)
    return whole if isinstance(whole, Response) else shape.whole(whole)
