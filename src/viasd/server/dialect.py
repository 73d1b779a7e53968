"""What the other client dialects (routes_ollama.py, routes_infill.py) share: their bodies parsed against
schemas whose decode settings come from settings.py, a queued decode waited for whole or read as a
stream's events (accounted for as the OpenAI routes account for theirs), the token counts and times."""

from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from viasd.server.errors import APIError, ended_by_server, engine_error, validation_error
from viasd.server.parsing import parse, read_json
from viasd.server.responses import Reply


async def body_of(request: Request, cls):
    """The request's JSON body as `cls` (a 400 for a malformed or ill-typed one: these dialects have no 422)."""
    data = await read_json(request, request.app.state.settings.max_body_bytes)
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_type")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise as_400(validation_error(e)) from None


def as_400(e: APIError) -> APIError:
    if e.status == 422:
        e.status = 400
    return e


def translated(cls, fields: dict, served: str):
    """The OpenAI request a dialect's request amounts to, checked as one (its refusals 400s)."""
    try:
        return parse(cls, fields, served)
    except APIError as e:
        raise as_400(e) from None


async def whole(reply: Reply) -> Response | None:
    """Wait for the decode's end: None once it is done (accounted for), else the answer to a request that
    ended early (raised when an error)."""
    try:
        event = await reply.job.next_event()
    except asyncio.CancelledError:  # the handler itself was cancelled: stop the decode, account for it
        reply.abandon()
        raise
    ended = reply.ended_early(event)
    if ended is not None:
        return ended
    reply.finish(200)
    return None


async def first(reply: Reply) -> tuple | Response:
    """A stream's first event, or the answer to a request that ended before any text (an error raised)."""
    event = await reply.job.next_event()
    ended = reply.ended_early(event)
    return ended if ended is not None else event


async def events(reply: Reply, event: tuple):
    """The stream's events from `event` on: ("text", piece, tokens) ..., then ("done",) or ("error", APIError)
    (the request accounted for); nothing more once the client is gone."""
    done = False
    try:
        while True:
            kind = event[0]
            if kind == "text":
                yield event
            elif kind == "done":
                done = True
                reply.finish(200)
                yield event
                return
            elif kind == "error":
                done = True
                e = engine_error(event[1])
                reply.finish(e.status)
                reply.count(e.status)  # (headers already said 200)
                yield ("error", e)
                return
            else:  # cancelled
                done = True
                job = reply.job
                if job.cancel_reason not in ("shutdown", "stalled"):  # by the client: nobody to tell
                    reply.finish(499)
                    return
                e = ended_by_server(job)
                reply.finish(e.status)
                if e.status != 499:
                    reply.count(e.status)
                yield ("error", e)
                return
            event = await reply.job.next_event()
    finally:
        if not done:  # the client went away (or the server stops): end the decode within a round
            reply.abandon()


def timings(reply: Reply) -> dict:
    """Counts and seconds of a finished decode: prompt tokens and its prefill (to the first token), new
    tokens and the time after it, and the whole request's time from its arrival."""
    job = reply.job
    st = job.result.stats if job.result is not None else None
    prompt_s = (st.first_token_s or 0.0) if st is not None else 0.0
    return {"prompt_n": st.prompt_tokens if st is not None else 0, "prompt_s": prompt_s,
            "predicted_n": st.new_tokens if st is not None else 0,
            "predicted_s": max(0.0, st.wall_s - prompt_s) if st is not None else 0.0,
            "total_s": time.perf_counter() - job.arrived}
