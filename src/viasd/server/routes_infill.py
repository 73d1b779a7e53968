"""POST /infill as llama.cpp's server defines it (llama.vscode, llama.vim): the code before and after the
cursor (`input_prefix`, `input_suffix`), what was typed at it (`prompt`) and other files of the project
(`input_extra`: [{"filename", "text"}]) laid out in the model's FIM tokens as llama.cpp's
`format_infill` does (fim.repository), decoded by the same path as /v1/completions. The answer is
llama.cpp's /completion record (`content`, `stop`, `tokens_predicted`, `tokens_evaluated`, `timings`
...; `response_fields` picks some of it), or SSE `data: {...}` records as the text comes.
Errors: llama.cpp's `{"error": {"code", "message", "type"}}`.

Accepted and ignored: what tunes llama.cpp's own scheduling and samplers (`cache_prompt`: the prefix
cache is always on; `t_max_prompt_ms`, `t_max_predict_ms`, `n_indent`, `samplers`, `id_slot`).
`viasd` takes the extension object (strategy, mode, drafting ...), as /v1's requests do."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import Field, create_model

from viasd.server import dialect, fim
from viasd.server.errors import DIALECT_ERRORS, APIError
from viasd.server.responses import Reply, record, token_string
from viasd.server.routes_completions import start
from viasd.server.routes_ollama import Lenient
from viasd.server.schemas import CompletionRequest, Strict, ViasdExtension, field_of
from viasd.settings import MAX_NEW_TOKENS, SETTINGS

router = APIRouter()
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          503: "unavailable_error"}
DIALECT_ERRORS["/infill"] = lambda e: {"error": {"code": e.status, "message": e.message, "type": _TYPES.get(
    e.status, "server_error" if e.status >= 500 else "invalid_request_error")}}

# llama.cpp's sampling fields that are decode settings: field -> setting (settings.py)
SAMPLING = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "repeat_penalty": "repetition_penalty"}
IGNORED = ("cache_prompt", "t_max_prompt_ms", "t_max_predict_ms", "n_indent", "samplers", "id_slot", "repeat_last_n",
           "typical_p", "mirostat", "mirostat_tau", "mirostat_eta", "n_keep", "n_discard", "ignore_eos", "return_tokens")
TEXT = Annotated[str, Field(max_length=1_000_000)]


class ExtraFile(Strict):
    filename: Annotated[str, Field(max_length=4096)] = "tmp"
    text: TEXT = ""


_REQUEST_FIELDS: dict[str, Any] = {
    "input_prefix": (TEXT, ""), "input_suffix": (TEXT, ""), "prompt": (TEXT, ""),
    "input_extra": (Annotated[list[ExtraFile], Field(max_length=1024)], []),
    "n_predict": (Annotated[int, Field(ge=-1, le=MAX_NEW_TOKENS)] | None, None),  # -1: no limit (the server's default)
    "stop": (list[Annotated[str, Field(min_length=1, max_length=256)]] | None, None),
    "stream": (bool, False),
    "n_probs": (Annotated[int, Field(ge=0, le=20)], 0),  # each token's probability and this many alternatives'
    "response_fields": (list[str] | None, None),
    "model": (object, None),  # (llama-server serves one model: any name is it)
    "viasd": (ViasdExtension | None, None),
    **{f: (field_of(SETTINGS[s]), None) for f, s in SAMPLING.items()},
    **{f: (object, None) for f in IGNORED}}
if TYPE_CHECKING:  # (built from the settings below; mypy reads its fields as Any)
    class InfillRequest(Lenient):
        def __getattr__(self, name: str) -> Any: ...
else:
    InfillRequest = create_model("InfillRequest", __base__=Lenient, **_REQUEST_FIELDS)


def stop_type(reply: Reply) -> tuple[str, str]:
    """llama.cpp's stop_type ("limit", "word", "eos") and the stop string that ended the text."""
    job = reply.job
    if job.finish_reason == "length":
        return "limit", ""
    rest = job.result.text[len(job.text):] if job.result is not None else ""
    word = next((s for s in job.stops if rest.startswith(s)), "")
    return ("word", word) if word else ("eos", "")


def timings(reply: Reply) -> dict:
    t = dialect.timings(reply)
    pm, dm = 1e3 * t["prompt_s"], 1e3 * t["predicted_s"]
    return {"prompt_n": t["prompt_n"], "prompt_ms": pm, "prompt_per_token_ms": pm / t["prompt_n"] if t["prompt_n"] else 0.0,
            "prompt_per_second": 1e3 * t["prompt_n"] / pm if pm else 0.0, "predicted_n": t["predicted_n"], "predicted_ms": dm,
            "predicted_per_token_ms": dm / t["predicted_n"] if t["predicted_n"] else 0.0,
            "predicted_per_second": 1e3 * t["predicted_n"] / dm if dm else 0.0}


def probabilities(reply: Reply, tokens) -> list[dict]:
    """llama.cpp's completion_probabilities of `tokens` (with n_probs)."""
    piece = reply._piece
    entry = lambda i, lp: {"id": i, "token": token_string(piece(i)), "logprob": lp, "bytes": list(piece(i))}  # noqa: E731
    return [{**entry(t.id, t.logprob.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.logprob.top]} for t in tokens]


def result(reply: Reply, req, content: str, tokens) -> dict:
    """The record of a finished infill (the whole answer, or a stream's last record)."""
    job = reply.job
    t = timings(reply)
    kind, word = stop_type(reply)
    out = {"index": 0, "content": content, "tokens": [], "id_slot": 0, "stop": True, "model": reply.served,
           "tokens_predicted": t["predicted_n"], "tokens_evaluated": t["prompt_n"],
           "generation_settings": {"n_predict": job.settings.get("max_new_tokens"), **{
               f: job.decoded.config.get(s) for f, s in SAMPLING.items() if s in job.decoded.config}},
           "has_new_line": "\n" in job.text, "truncated": False, "stop_type": kind, "stopping_word": word,
           "tokens_cached": t["prompt_n"] + t["predicted_n"], "timings": t, "viasd": record(job)}
    if req.n_probs:
        out["completion_probabilities"] = probabilities(reply, tokens)
    if req.response_fields:  # llama.cpp's: the fields named, a nested one by its path ("timings/prompt_n")
        picked = {}
        for path in req.response_fields:
            value, found = out, True
            for key in path.split("/"):
                if isinstance(value, dict) and key in value:
                    value = value[key]
                else:
                    found = False
                    break
            if found:
                picked[path] = value
        out = picked
    return out


def sse(data: dict) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


@router.post("/infill")
async def infill(request: Request):
    state = request.app.state
    req = await dialect.body_of(request, InfillRequest)
    tokens = fim.require_fim(state, "input_prefix")
    fields = {"model": state.served, "prompt": req.input_prefix, "stream": req.stream,
              **{s: getattr(req, f) for f, s in SAMPLING.items() if getattr(req, f) is not None}}
    if req.n_predict is not None and req.n_predict > 0:
        fields["max_tokens"] = req.n_predict
    if req.n_predict == 0:
        raise APIError(400, "n_predict 0 asks for no tokens: give a positive number, or -1 for no limit",
                               param="n_predict", code="invalid_value")
    if req.stop:
        fields["stop"] = req.stop
    if req.n_probs:
        fields["logprobs"] = req.n_probs
    if req.viasd is not None:
        fields["viasd"] = req.viasd.model_dump(exclude_none=True)
    creq = dialect.translated(CompletionRequest, fields, state.served)
    n_predict = creq.max_tokens or state.defaults.get("max_new_tokens", 0)
    prompt = fim.repository(state.model, tokens, req.input_prefix, req.input_suffix, req.prompt,
                            [(f.filename, f.text) for f in req.input_extra], n_predict)
    reply = start(request, "infill", creq, prompt, creq.max_tokens, chat=False)
    if not req.stream:
        ended = await dialect.whole(reply)
        return ended if ended is not None else result(reply, req, reply.job.text, reply.job.tokens)
    event = await dialect.first(reply)
    if isinstance(event, Response):
        return event
    return StreamingResponse(events(reply, req, event, len(prompt)), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def events(reply: Reply, req, event: tuple, prompt_n: int):
    count = 0
    async for ev in dialect.events(reply, event):
        if ev[0] == "text":
            count += len(ev[2])
            if ev[1] or (ev[2] and req.n_probs):
                chunk = {"index": 0, "content": ev[1], "tokens": [], "stop": False, "id_slot": 0, "tokens_predicted": count,
                         "tokens_evaluated": prompt_n}
                if req.n_probs:
                    chunk["completion_probabilities"] = probabilities(reply, ev[2])
                yield sse(chunk)
        elif ev[0] == "done":
            yield sse(result(reply, req, "", []))
        else:
            yield sse(DIALECT_ERRORS["/infill"](ev[1]))
