"""What answers around the routes: the bearer token and declared body size (ASGI middleware), the
exception handlers that turn every failure into an OpenAI-style error body, and the per-endpoint
request counter they share."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from viasd.server.errors import APIError, engine_error, error_response
from viasd.server.metrics import Metrics

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/models": "models",
             "/metrics": "metrics", "/health": "health"}


def endpoint_of(path: str) -> str:
    return ENDPOINTS.get(path, "other")


def public(path: str) -> bool:
    """Served without the API key: /health, and the chat page (/) with its files (/static/...), which
    hold nothing of the server's; the page asks for the key when the API answers 401."""
    return path in ("/", "/health") or path.startswith("/static/")


class AuthAndSize:
    """ASGI middleware: the bearer token (all routes but the public ones: /health, the chat page and its
    files; constant-time comparison) and the declared body size (413 before reading a byte of it)."""

    def __init__(self, app, api_key: str | None, max_body: int, metrics: Metrics):
        self.app, self.key, self.max_body, self.metrics = app, api_key.encode() if api_key else None, max_body, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            problem = self.problem(scope)
            if problem is not None:
                self.metrics.requests.labels(endpoint_of(scope["path"]), str(problem.status)).inc()
                await error_response(problem)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def problem(self, scope) -> APIError | None:
        """The error for a request without the token or with a declared body over the limit, else None."""
        headers = dict(scope.get("headers") or [])
        if self.key is not None and not public(scope["path"]):
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)):
                return APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is None:
            return None
        try:
            too_big = int(length) > self.max_body
        except ValueError:
            return APIError(400, "invalid Content-Length header", code="invalid_request")
        if too_big:
            return APIError(413, f"request body over the {self.max_body}-byte limit", code="request_too_large")
        return None


def count(request: Request, status: int) -> None:
    request.app.state.metrics.requests.labels(endpoint_of(request.url.path), str(status)).inc()


async def on_api_error(request: Request, e: APIError):
    count(request, e.status)
    return error_response(e)


async def on_http_error(request: Request, e: StarletteHTTPException):
    count(request, e.status_code)
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return error_response(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code))


async def on_internal_error(request: Request, e: Exception):
    count(request, 500)
    return error_response(engine_error(e))


def install(app: FastAPI, settings) -> None:
    """The middleware and exception handlers of `app` (`settings`: a ServeSettings)."""
    app.add_middleware(AuthAndSize, api_key=settings.api_key, max_body=settings.max_body_bytes, metrics=app.state.metrics)
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_internal_error)
