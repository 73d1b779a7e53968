"""A request's body to a validated request and the decode settings it asks for (every refusal an
APIError with OpenAI's status and code)."""

from __future__ import annotations

import json
import re

from fastapi import Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from viasd.api import GenerateConfig
from viasd.errors import UsageError
from viasd.server.errors import APIError, validation_error
from viasd.server.schemas import OPENAI_FIELDS
from viasd.settings import check_bias_ids


async def read_body(request: Request, max_body: int) -> bytes:
    """The whole body, refused (413) as soon as it grows over `max_body` bytes."""
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body:
                raise APIError(413, f"request body over the {max_body}-byte limit", code="request_too_large")
    except ClientDisconnect:  # the client closed before sending its whole body: nobody to answer
        raise APIError(499, "the client closed the connection before sending the whole request body",
                       code="client_closed") from None
    return bytes(body)


async def read_json(request: Request, max_body: int):
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind != "application/json":  # (a cross-site form or text/plain POST needs no CORS preflight: refused unread)
        raise APIError(415, f"the request body must be sent as Content-Type: application/json, got {kind or 'none'!r}"[:200],
                       code="unsupported_media_type")
    body = await read_body(request, max_body)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})", code="invalid_encoding") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}"[:300], code="invalid_json") from None
    if "\\u" in text:  # escapes may spell lone surrogates ("\\ud800"): not text, and not encodable
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "request body contains a lone UTF-16 surrogate escape (not valid Unicode text)",
                           code="invalid_encoding") from None
    return data


def parse(cls, data, served: str):
    """`data` as a request of schema `cls` for the model `served`."""
    if not isinstance(data, dict):
        raise APIError(422, "request body must be a JSON object", code="invalid_type")
    try:
        req = cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    if req.model != served:
        raise APIError(404, f"the model {req.model!r} does not exist here; this server has {served!r}",
                       param="model", code="model_not_found")
    bad = req.unsupported()
    if bad:
        raise APIError(400, f"{bad} is not supported by this server" + (" (only n=1)" if bad == "n" else ""),
                       param=bad, code="unsupported_parameter")
    wrong = req.contradiction()
    if wrong is not None:
        raise APIError(400, wrong[2], param=wrong[0], code=wrong[1])
    return req


def response_format_of(req) -> tuple[dict | None, str]:
    """The `response_format` setting a request asks for (OpenAI's field, or the `viasd` object's
    regex / grammar), and the parameter that gave it."""
    given = req.response_format.as_setting() if req.response_format is not None else None
    ext = req.viasd
    extras = [(k, getattr(ext, k)) for k in ("regex", "grammar") if ext is not None and getattr(ext, k) is not None]
    if len(extras) > 1:
        raise APIError(400, "give at most one of viasd.regex and viasd.grammar", param="viasd.grammar", code="invalid_value")
    if not extras:
        return given, "response_format"
    kind, text = extras[0]
    if given is not None and given["type"] != "text":
        raise APIError(400, f"viasd.{kind} and response_format {given['type']!r} both constrain the output: give one",
                       param=f"viasd.{kind}", code="invalid_value")
    return {"type": kind, kind: text}, f"viasd.{kind}"


def config_for(req, max_tokens: int | None, defaults: dict, max_positions: int, vocab_size: int | None = None) -> dict:
    """The generate settings of one request: the server's defaults, then what the request sets
    (`vocab_size`: logit_bias' ids checked against it)."""
    s = dict(defaults)
    if req.viasd is not None:
        s.update(req.viasd.settings())
    for name in OPENAI_FIELDS:
        if getattr(req, name) is not None:
            s[name] = getattr(req, name)
    try:
        logprobs = req.logprobs_setting()
    except ValueError as e:
        raise APIError(400, str(e), param="top_logprobs", code="invalid_value") from None
    if logprobs is not None:
        s["logprobs"] = logprobs
    fmt, fmt_param = response_format_of(req)
    if fmt is not None:
        s["response_format"] = fmt
    if max_tokens is not None:
        if max_tokens > max_positions:
            raise APIError(400, f"max_tokens ({max_tokens}) exceeds the model's context of "
                                f"{max_positions} positions", param="max_tokens", code="context_length_exceeded")
        s["max_new_tokens"] = max_tokens
    known = set(GenerateConfig.setting_names())
    s = {k: v for k, v in s.items() if k in known}
    try:
        GenerateConfig.from_settings(**{**s, "chat": None}).validate()
        if vocab_size is not None:
            check_bias_ids(s.get("logit_bias"), vocab_size)
    except UsageError as e:
        # (a setting's message starts with its name: "top_p must ...", "logit_bias[5] ...")
        named = m.group() if (m := re.match(r"\w*", str(e))) else ""
        param = fmt_param if named == "response_format" else named if named in OPENAI_FIELDS + ("logprobs",) else "viasd"
        raise APIError(400, str(e), param=param, code="invalid_value") from None
    return s
