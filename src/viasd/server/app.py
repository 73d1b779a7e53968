"""The OpenAI-compatible HTTP API over one loaded model (FastAPI).

Status codes: 400 malformed JSON / invalid UTF-8 / unsupported parameter / prompt + max_tokens beyond
the context / settings the engine rejects; 401 missing or wrong bearer token; 404 unknown model or
route; 405 wrong method; 413 body over the size limit; 422 wrong types or out-of-range values;
499 the client left (or sent half a body, or stopped reading a stream); 503 queue full or shutting
down (a stream the drain cut ends with that error object and `[DONE]`). Every error body is OpenAI's
`{"error": {"message", "type", "param", "code"}}`; no traceback ever reaches a response.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from viasd.api import GenerateConfig, drafts_with_model, generate
from viasd.errors import UsageError, ViasdError
from viasd.server.engine import Draining, Job, QueueFull, Worker
from viasd.server.metrics import Metrics
from viasd.server.schemas import ChatCompletionRequest, CompletionRequest

DEFAULT_MAX_BODY = 1 << 20  # 1 MiB


@dataclass
class ServeSettings:
    """What `viasd serve` configures beyond the model: request defaults and limits."""

    defaults: dict = field(default_factory=dict)  # GenerateConfig fields (flags of `viasd serve`)
    served_name: str | None = None  # the model id clients use (default: the model's name)
    max_queue: int = 64  # requests waiting behind the running ones; more get 503
    max_batch: int = 8  # requests decoded at once, their passes batched
    kv_budget: int | None = None  # bytes of KV cache the running requests may reserve (None: a quarter of free memory)
    prefix_cache: int = 128 << 20  # bytes of recent prompts' K/V kept for reuse (models/prefix.py); 0: off
    max_body_bytes: int = DEFAULT_MAX_BODY
    api_key: str | None = None


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = status, message, type_, param, code, headers


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


def ended_by_server(job: Job) -> APIError:
    """Why the server ended a request before its finish: a drain that timed out, or a reader that stalled."""
    if job.cancel_reason == "stalled":
        return APIError(499, f"the stream was not read for {job.stall_timeout:g} s (or over {job.max_unread} events "
                             "waited unread): generation stopped", "invalid_request_error", code="stream_stalled")
    if job.started is None:  # still queued when the drain ended it
        return APIError(503, "the server is shutting down: the request was cancelled before it started", "server_error",
                        code="shutting_down")
    return APIError(503, "the server is shutting down: generation stopped before its end", "server_error",
                    code="shutting_down")


def engine_error(e: Exception) -> APIError:
    if isinstance(e, UsageError):
        msg = str(e)
        code = "context_length_exceeded" if "exceeds the model's" in msg else "invalid_value"
        return APIError(400, msg, code=code)
    if isinstance(e, ViasdError):
        return APIError(500, str(e), "server_error", code="engine_error")
    return APIError(500, "internal error while generating (logged on the server)", "server_error", code="internal_error")


_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "nullable"}


def finite(x):
    """JSON has no inf / NaN: a threshold of inf (no limit) is sent as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def _validation_error(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    # a union reports one error per member: prefer a broken constraint over "not that type"
    err = next((x for x in errors if not x.get("type", "").endswith("_type")), errors[0])
    loc = ".".join(str(p) for p in err.get("loc", ())
                   if not (isinstance(p, str) and ("[" in p or "-" in p or p in _TAGS)))
    code = "invalid_type" if "type" in err.get("type", "") or err.get("type") in ("missing", "extra_forbidden") else "invalid_value"
    if err.get("type") == "extra_forbidden":
        return APIError(422, f"unrecognized request argument: {loc}", param=loc, code="unknown_parameter")
    if err.get("type") == "missing":
        return APIError(422, f"missing required argument: {loc}", param=loc, code="missing_required_parameter")
    return APIError(422, f"{loc}: {err.get('msg')}", param=loc or None, code=code)


ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/models": "models",
             "/metrics": "metrics", "/health": "health"}


def endpoint_of(path: str) -> str:
    return ENDPOINTS.get(path, "other")


class AuthAndSize:
    """ASGI middleware: the bearer token (all routes but /health; constant-time comparison) and the
    declared body size (413 before reading a byte of it)."""

    def __init__(self, app, api_key: str | None, max_body: int, metrics: Metrics):
        self.app, self.key, self.max_body, self.metrics = app, api_key.encode() if api_key else None, max_body, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            problem = None
            if self.key is not None and scope["path"] != "/health":
                auth = headers.get(b"authorization", b"")
                scheme, _, token = auth.partition(b" ")
                if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)):
                    problem = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            length = headers.get(b"content-length")
            if problem is None and length is not None:
                try:
                    too_big = int(length) > self.max_body
                except ValueError:
                    too_big, problem = False, APIError(400, "invalid Content-Length header", code="invalid_request")
                if too_big:
                    problem = APIError(413, f"request body over the {self.max_body}-byte limit", code="request_too_large")
            if problem is not None:
                self.metrics.requests.labels(endpoint_of(scope["path"]), str(problem.status)).inc()
                await error_response(problem)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def check_serving(model, drafter, defaults: dict) -> None:
    """One token decoded with the server's own settings before the app exists (and so before
    `/health` says ok): whatever the engine would refuse in every request (a route of another model,
    thresholds it rejects, a missing or unusable drafter) stops the server at start with one line
    (UsageError: `viasd serve` exits 2) instead of a 400 to each client."""
    settings = {**defaults, "max_new_tokens": 1, "chat": False}
    uses = drafter is not None and drafts_with_model(GenerateConfig.from_settings(**settings))
    generate([0], model, drafter=drafter if uses else None, progress=False, **settings)


def create_app(model, drafter=None, settings: ServeSettings | None = None, worker: Worker | None = None) -> FastAPI:
    """The app for one loaded model (and optional drafter). `worker` may be given (tests wrap it)."""
    settings = settings or ServeSettings()
    metrics = Metrics()
    worker = worker or Worker(model, drafter, settings.max_queue, max_batch=settings.max_batch, kv_budget=settings.kv_budget,
                              prefix_cache=settings.prefix_cache)
    worker.on_depth = metrics.depth
    metrics.watch(worker)
    served = settings.served_name or model.name
    defaults = dict(settings.defaults)
    defaults.pop("chat", None)
    base = GenerateConfig.from_settings(**defaults)
    base.validate()
    check_serving(model, drafter, defaults)
    created = int(time.time())

    app = FastAPI(title="viasd", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker, app.state.metrics, app.state.model = worker, metrics, model
    app.add_middleware(AuthAndSize, api_key=settings.api_key, max_body=settings.max_body_bytes, metrics=metrics)

    def count(request: Request, status: int) -> None:
        metrics.requests.labels(endpoint_of(request.url.path), str(status)).inc()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        count(request, e.status)
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        count(request, e.status_code)
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error_response(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        count(request, 500)
        return error_response(engine_error(e))

    @app.get("/health")
    async def health():
        if worker.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served, "object": "model", "created": created, "owned_by": "viasd"}]}

    async def read_json(request: Request) -> dict:
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > settings.max_body_bytes:
                    raise APIError(413, f"request body over the {settings.max_body_bytes}-byte limit", code="request_too_large")
        except ClientDisconnect:  # the client closed before sending its whole body: nobody to answer
            raise APIError(499, "the client closed the connection before sending the whole request body",
                           code="client_closed") from None
        try:
            text = bytes(body).decode("utf-8")
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

    def parse(cls, data):
        if not isinstance(data, dict):
            raise APIError(422, "request body must be a JSON object", code="invalid_type")
        try:
            req = cls.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e) from None
        if req.model != served:
            raise APIError(404, f"the model {req.model!r} does not exist here; this server has {served!r}",
                           param="model", code="model_not_found")
        bad = req.unsupported()
        if bad:
            raise APIError(400, f"{bad} is not supported by this server" + (" (only n=1)" if bad == "n" else ""),
                           param=bad, code="unsupported_parameter")
        return req

    def config_for(req, max_tokens: int | None) -> dict:
        s = dict(defaults)
        if req.viasd is not None:
            s.update(req.viasd.settings())
        for name in ("temperature", "top_p", "seed"):
            if getattr(req, name) is not None:
                s[name] = getattr(req, name)
        if max_tokens is not None:
            if max_tokens > model.config.max_positions:
                raise APIError(400, f"max_tokens ({max_tokens}) exceeds the model's context of "
                                    f"{model.config.max_positions} positions", param="max_tokens", code="context_length_exceeded")
            s["max_new_tokens"] = max_tokens
        known = set(GenerateConfig.setting_names())
        s = {k: v for k, v in s.items() if k in known}
        try:
            GenerateConfig.from_settings(**{**s, "chat": None}).validate()
        except UsageError as e:
            raise APIError(400, str(e), param="viasd", code="invalid_value") from None
        return s

    def usage(job: Job) -> dict:
        st = job.result.stats
        return {"prompt_tokens": st.prompt_tokens, "completion_tokens": st.new_tokens,
                "total_tokens": st.prompt_tokens + st.new_tokens}

    def record(job: Job) -> dict:
        c = job.result.config
        keep = ("strategy", "draft", "drafter", "mode", "k", "adapt_k", "adaptive_k", "slim_fraction", "tier_thresholds",
                "resume", "resume_layer", "reduced_head", "slim_head_vocab", "drafter_head_vocab", "correct", "temperature", "top_p", "seed")
        return finite({"config": {k: c[k] for k in keep if k in c}, "stats": job.result.stats.to_dict()})

    async def watch_disconnect(request: Request, job: Job) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                job.stop("client")
                return

    async def run(request: Request, endpoint: str, req, prompt, max_tokens: int | None, chat: bool):
        settings_ = config_for(req, max_tokens)
        settings_["chat"] = chat
        job = Job(prompt, settings_, req.stops(), asyncio.get_running_loop(), stream=bool(req.stream))
        try:
            worker.submit(job)
        except QueueFull:
            raise APIError(503, f"the server is busy: {worker.max_queue} requests already wait; retry later",
                           "server_error", code="queue_full", headers={"Retry-After": "1"}) from None
        except Draining:
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down") from None
        watcher = asyncio.create_task(watch_disconnect(request, job))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        now = int(time.time())

        def finish(status: int) -> None:
            """Account for the request once; error statuses are counted where they are answered."""
            if job.finished:
                return
            job.finished = True
            watcher.cancel()
            if status in (200, 499):
                metrics.requests.labels(endpoint, str(status)).inc()
            metrics.observe_decode(endpoint, job)
            if status == 200:
                metrics.latency.labels(endpoint).observe(time.perf_counter() - job.arrived)

        if not req.stream:
            try:
                while True:
                    kind, *rest = await job.next_event()
                    if kind == "error":
                        e = engine_error(rest[0])
                        finish(e.status)
                        raise e
                    if kind == "cancelled":
                        if job.cancel_reason == "shutdown":
                            finish(503)
                            raise ended_by_server(job)
                        finish(499)
                        return Response(status_code=499)
                    break
            except asyncio.CancelledError:  # the handler itself was cancelled: stop the decode, account for it
                job.stop("client")
                asyncio.get_running_loop().create_task(_drain_cancelled(job, finish))
                raise
            finish(200)
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": job.text}, "logprobs": None,
                          "finish_reason": job.finish_reason}
            else:
                choice = {"index": 0, "text": job.text, "logprobs": None, "finish_reason": job.finish_reason}
            return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": now,
                    "model": served, "choices": [choice], "usage": usage(job), "viasd": record(job)}

        # streaming: wait for the first event so that errors before any text get a status code
        first = await job.next_event()
        if first[0] == "error":
            e = engine_error(first[1])
            finish(e.status)
            raise e
        if first[0] == "cancelled" and job.cancel_reason == "shutdown":
            finish(503)
            raise ended_by_server(job)
        if first[0] == "cancelled":
            finish(499)
            return Response(status_code=499)
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(text: str | None, finish_reason: str | None = None, first_chunk: bool = False) -> dict:
            if chat:
                delta = {} if text is None else ({"role": "assistant", "content": text} if first_chunk else {"content": text})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            return {"id": rid, "object": obj, "created": now, "model": served, "choices": [choice]}

        def sse(data: dict | str) -> bytes:
            return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()

        async def stream():
            event, done = first, False
            try:
                if chat:
                    yield sse(chunk("", first_chunk=True))
                while True:
                    kind = event[0]
                    if kind == "text":
                        yield sse(chunk(event[1]))
                    elif kind == "done":
                        finish(200)
                        done = True
                        last = chunk(None, job.finish_reason)
                        last["viasd"] = record(job)
                        yield sse(last)
                        if include_usage:
                            yield sse({"id": rid, "object": obj, "created": now, "model": served, "choices": [],
                                       "usage": usage(job)})
                        yield sse("[DONE]")
                        return
                    elif kind == "error":
                        e = engine_error(event[1])
                        finish(e.status)
                        metrics.requests.labels(endpoint, str(e.status)).inc()  # headers already said 200
                        done = True
                        yield sse(error_body(e.message, e.type, e.param, e.code))
                        yield sse("[DONE]")
                        return
                    elif kind == "cancelled":
                        done = True
                        if job.cancel_reason not in ("shutdown", "stalled"):
                            finish(499)
                            return
                        e = ended_by_server(job)  # the reader may still be there: say why the stream ends
                        finish(e.status)
                        if e.status != 499:
                            metrics.requests.labels(endpoint, str(e.status)).inc()  # headers already said 200
                        yield sse(error_body(e.message, e.type, e.param, e.code))
                        yield sse("[DONE]")
                        return
                    event = await job.next_event()
            finally:
                if not done:  # the client went away (or the server stops): end the decode within a round
                    job.stop("client")
                    if not job.finished:
                        asyncio.get_running_loop().create_task(_drain_cancelled(job, finish))

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _drain_cancelled(job: Job, finish) -> None:
        """Account for a stream the client left: wait for the worker's last event."""
        while True:
            kind, *_ = await job.next_event()
            if kind in ("done", "cancelled", "error"):
                finish(499)
                return

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await read_json(request))
        prompt = req.prompt
        if isinstance(prompt, list):
            bad = [t for t in prompt if t >= model.config.vocab_size]
            if bad:
                raise APIError(400, f"token id {bad[0]} out of range: the vocabulary has {model.config.vocab_size} ids",
                               param="prompt", code="invalid_value")
        elif not prompt.strip():
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        return await run(request, "completions", req, prompt, req.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatCompletionRequest, await read_json(request))
        if not model.has_chat_template:
            raise APIError(400, f"{served} has no chat template: use /v1/completions", code="no_chat_template")
        messages = [m.as_engine() for m in req.messages]
        if messages[-1]["role"] != "user":
            raise APIError(400, "the last message must be a user message for the model to answer",
                           param="messages", code="invalid_value")
        return await run(request, "chat", req, messages, req.limit(), chat=True)

    return app
