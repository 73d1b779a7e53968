"""Server-sent events of a streamed answer: the chunks as the text comes, then the last chunk (its
finish reason, the `viasd` record, the usage when asked) or the error that ended it, then `[DONE]`."""

from __future__ import annotations

import json

from fastapi.responses import Response, StreamingResponse

from viasd.api import TokenText
from viasd.server.errors import ended_by_server, engine_error, error_body
from viasd.server.responses import Reply, record
from viasd.server.tools import ToolStream, finish_of

_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def answer_stream(reply: Reply, include_usage: bool, render=None) -> Response:
    """Wait for the first event, so that errors before any text get a status code; then stream.
    `render`: the stream's bytes from its chunks (another dialect's events; default OpenAI's)."""
    first = await reply.job.next_event()
    ended = reply.ended_early(first)
    if ended is not None:
        return ended
    body = (render or events)(chunks(reply, first, include_usage))
    return StreamingResponse(body, media_type="text/event-stream", headers=_HEADERS)


async def events(chunks):
    async for data in chunks:
        yield sse(data)


async def chunks(reply: Reply, event: tuple, include_usage: bool):
    """The chat chunks of a streamed answer (dicts), then `[DONE]` (or nothing, when the client left)."""
    done = False
    plan = reply.tools
    calls = ToolStream(plan.family) if plan is not None else None  # text and tool-call fragments
    tokens: list[TokenText] = []  # tokens whose logprobs / sources no chunk has carried yet (a tool call's text may send none)
    extras = reply.logprobs is not None or reply.provenance
    try:
        if reply.chat:
            yield reply.chunk("", first_chunk=True)
        while True:
            kind = event[0]
            if kind == "text":
                tokens += event[2] if extras else []
            if kind == "text" and calls is not None:
                # (tags that decoding drops are not in the text: such an answer is sent at its end)
                for delta in calls.feed(event[1]) if not plan.dropped else []:
                    yield reply.delta_chunk(delta, tokens)
                    tokens = []
            elif kind == "text" and (event[1] or tokens):
                yield reply.chunk(event[1], tokens=tokens)
                tokens = []
            elif kind in ("done", "error", "cancelled"):
                done = True
                for delta in final_deltas(reply, calls) if calls is not None and kind == "done" else []:
                    yield reply.delta_chunk(delta, tokens)
                    tokens = []
                for data in last_events(reply, event, include_usage, bool(calls and calls.sent), tokens):
                    yield data
                return
            event = await reply.job.next_event()
    finally:
        if not done:  # the client went away (or the server stops): end the decode within a round
            reply.abandon()


def final_deltas(reply: Reply, calls: ToolStream) -> list[dict]:
    """The deltas the end of an answer that may call tools adds (all of it where decoding drops the tags)."""
    plan, job = reply.tools, reply.job
    if not plan.dropped:
        return calls.feed("", final=True)
    return calls.feed(plan.answer_text(job.text, job.decoded.token_ids), final=True)


def last_events(reply: Reply, event: tuple, include_usage: bool, called: bool = False, tokens=()) -> list:
    """What ends the stream for its last event (done, error or cancelled), the request accounted for
    (`called`: the answer held tool calls; `tokens`: those no chunk has carried yet)."""
    job = reply.job
    if event[0] == "done":
        reply.finish(200)
        last = reply.chunk(None, finish_of(job.finish_reason, called), tokens=list(tokens))
        last["viasd"] = {**last.get("viasd", {}), **record(job)}
        return [last, reply.usage_chunk(), "[DONE]"] if include_usage else [last, "[DONE]"]
    if event[0] == "error":
        e = engine_error(event[1])
        reply.finish(e.status)
        reply.count(e.status)  # headers already said 200
    elif job.cancel_reason not in ("shutdown", "stalled"):  # cancelled by the client: nobody to tell
        reply.finish(499)
        return []
    else:
        e = ended_by_server(job)  # the reader may still be there: say why the stream ends
        reply.finish(e.status)
        if e.status != 499:
            reply.count(e.status)  # headers already said 200
    return [error_body(e.message, e.type, e.param, e.code), "[DONE]"]
