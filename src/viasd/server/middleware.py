"""What answers around the routes: the Host and Origin a browser sends (BrowserGuard), the bearer token
(or x-api-key) and declared body size (AuthAndSize), the exception handlers that turn every failure into an
OpenAI-style error body, and the per-endpoint request counter they share."""

from __future__ import annotations

import hmac
import ipaddress
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from viasd.server.errors import APIError, engine_error, error_response
from viasd.server.metrics import Metrics

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/models": "models",
             "/metrics": "metrics", "/health": "health", "/api/chat": "ollama_chat", "/api/generate": "ollama_generate",
             "/infill": "infill", "/v1/responses": "responses", "/v1/messages": "messages",
             "/v1/messages/count_tokens": "count_tokens"}


def endpoint_of(path: str) -> str:
    return ENDPOINTS.get(path, "other")


def public(path: str) -> bool:
    """Served without the API key: /health, and the chat page (/) with its files (/static/...), which
    hold nothing of the server's; the page asks for the key when the API answers 401."""
    return path in ("/", "/health") or path.startswith("/static/")


def host_name(value: str) -> str:
    """The name of a Host header (or of an origin's netloc): lower case, without port, brackets or final dot."""
    value = value.strip().lower()
    if value.startswith("["):  # an IPv6 literal: [::1]:8000
        return value[1:].partition("]")[0]
    return value.rpartition(":")[0].rstrip(".") if value.count(":") == 1 else value.rstrip(".")


def local_name(name: str) -> bool:
    """An IP literal, or localhost: names no other site's page can have (a rebinding page's Host is its own
    domain name)."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def same_host(origin: str, host: str, scheme: str) -> bool:
    """An Origin naming the host (and port) the request was sent to: the server's own page."""
    try:
        o = urlsplit(origin)
        default = {"http": 80, "https": 443}.get(o.scheme)
        h = urlsplit(f"{scheme}://{host}")
        return bool(o.hostname) and o.hostname == h.hostname and (o.port or default) == (h.port or default)
    except ValueError:  # (a port out of range, a bracket unclosed)
        return False


class _Refusing:
    """ASGI middleware that answers a request its `problem` names with that error (counted by endpoint)
    and passes every other one on."""

    app: object
    metrics: Metrics

    def problem(self, scope) -> APIError | None:
        raise NotImplementedError

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            problem = self.problem(scope)
            if problem is not None:
                self.metrics.requests.labels(endpoint_of(scope["path"]), str(problem.status)).inc()
                await error_response(problem, scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BrowserGuard(_Refusing):
    """ASGI middleware against other web pages: a Host header that is no name of this server (DNS rebinding:
    a page whose domain now resolves to this machine) and an Origin header of another site, both 403.
    `hosts`: names accepted besides IP literals and localhost, None: any; `origins`: the other sites'
    origins accepted ("*": any)."""

    def __init__(self, app, hosts: frozenset[str] | None, origins: frozenset[str], metrics: Metrics):
        self.app, self.hosts, self.origins, self.metrics = app, hosts, origins, metrics

    def problem(self, scope) -> APIError | None:
        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host", b"").decode("latin-1")
        name = host_name(host)
        if self.hosts is not None and host and not (local_name(name) or name in self.hosts):
            return APIError(403, f"the Host {name!r} is not a name of this server: add it to viasd serve --allowed-hosts"[:300],
                            code="host_not_allowed")
        origin = headers.get(b"origin")
        if origin is None:
            return None
        origin = origin.decode("latin-1").strip().lower().rstrip("/")
        if "*" in self.origins or origin in self.origins or same_host(origin, host, scope.get("scheme", "http")):
            return None
        return APIError(403, f"requests from the web page of {origin!r} are not allowed: add its origin to viasd serve "
                             "--allowed-origins"[:300], code="origin_not_allowed")


class AuthAndSize(_Refusing):
    """ASGI middleware: the bearer token (all routes but the public ones: /health, the chat page and its
    files; constant-time comparison) and the declared body size (413 before reading a byte of it)."""

    def __init__(self, app, api_key: str | None, max_body: int, metrics: Metrics):
        self.app, self.key, self.max_body, self.metrics = app, api_key.encode() if api_key else None, max_body, metrics

    def problem(self, scope) -> APIError | None:
        """The error for a request without the token or with a declared body over the limit, else None."""
        headers = dict(scope.get("headers") or [])
        if self.key is not None and not public(scope["path"]):
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            bearer = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
            # (Anthropic's clients send the key as x-api-key)
            if not (bearer or hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self.key)):
                return APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
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
    return error_response(e, request.url.path)


async def on_http_error(request: Request, e: StarletteHTTPException):
    count(request, e.status_code)
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return error_response(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code), request.url.path)


async def on_internal_error(request: Request, e: Exception):
    count(request, 500)
    return error_response(engine_error(e), request.url.path)


def install(app: FastAPI, settings) -> None:
    """The middleware and exception handlers of `app` (`settings`: a ServeSettings); the last added runs first:
    Host and Origin, then CORS for the origins allowed (whose preflights carry no key), then key and size."""
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(AuthAndSize, api_key=settings.api_key, max_body=settings.max_body_bytes, metrics=app.state.metrics)
    origins = frozenset(settings.allowed_origins)
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=sorted(origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Api-Key", "Anthropic-Version"])
    hosts = None if settings.allowed_hosts is None or "*" in settings.allowed_hosts else frozenset(settings.allowed_hosts)
    app.add_middleware(BrowserGuard, hosts=hosts, origins=origins, metrics=app.state.metrics)
    # (Starlette types a handler as taking any Exception; it calls each with its own class's only)
    app.add_exception_handler(APIError, on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, on_internal_error)
