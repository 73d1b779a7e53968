"""The OpenAI-compatible HTTP API over one loaded model (FastAPI).

Status codes: 400 malformed JSON / invalid UTF-8 / unsupported parameter / prompt + max_tokens beyond
the context / settings the engine rejects / fields OpenAI refuses together; 401 missing or wrong bearer
token; 403 a Host that is no name of this server, or another site's Origin; 404 unknown model or route;
405 wrong method; 413 body over the size limit; 415 a JSON route's body not sent as application/json;
422 wrong types or out-of-range values;
499 the client left (or sent half a body, or stopped reading a stream); 503 queue full or shutting
down (a stream the drain cut ends with that error object and `[DONE]`). Every error body is OpenAI's
`{"error": {"message", "type", "param", "code"}}`; no traceback ever reaches a response.

Here: the settings and the app's assembly. The routes: routes_completions.py (the request parsed in
parsing.py, answered by responses.py whole or by streaming.py as events), routes_info.py (health,
metrics, models), routes_page.py (the chat page at /, its files in static/); token and size checks and
exception handlers: middleware.py; error bodies: errors.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import FastAPI

from viasd.api import GenerateConfig, drafts_with_model, generate
from viasd.server.engine import Worker
from viasd.server.fim import fim_tokens
from viasd.server.errors import APIError, ended_by_server, engine_error, error_body, error_response  # noqa: F401 (re-exported)
from viasd.server.metrics import Metrics
from viasd.server.middleware import ENDPOINTS, AuthAndSize, endpoint_of, install  # noqa: F401 (re-exported)
from viasd.server.responses import finite  # noqa: F401 (re-exported)
from viasd.server.routes_completions import router as completions_router
from viasd.server.routes_info import router as info_router
from viasd.server import routes_messages, routes_responses
from viasd.server import routes_infill, routes_ollama
from viasd.server.routes_page import install_page

DEFAULT_MAX_BODY = 1 << 20  # 1 MiB


@dataclass
class ServeSettings:
    """What `viasd serve` configures beyond the model: request defaults and limits."""

    defaults: dict = field(default_factory=dict)  # GenerateConfig fields (flags of `viasd serve`)
    served_name: str | None = None  # the model id clients use (default: the model's name)
    max_queue: int = 64  # requests waiting behind the running ones; more get 503
    max_batch: int = 8  # requests decoded at once, their passes batched
    kv_budget: int | None = None  # bytes of KV cache the running requests may reserve (None: a quarter of free memory)
    prefix_cache: int = 128 << 20  # bytes of recent prompts' K/V kept for reuse (execution/prefix.py); 0: off
    max_body_bytes: int = DEFAULT_MAX_BODY
    api_key: str | None = None
    # Host names answered besides IP literals and localhost (against DNS rebinding); None or "*": any
    allowed_hosts: tuple[str, ...] | None = ()
    allowed_origins: tuple[str, ...] = ()  # other sites whose pages may call the API (CORS); "*": any


def check_serving(model, drafter, defaults: dict) -> None:
    """One token decoded with the server's own settings before the app exists (and so before
    `/health` says ok): whatever the engine would refuse in every request (a route of another model,
    thresholds it rejects, a missing or unusable drafter) stops the server at start with one line
    (UsageError: `viasd serve` exits 2) instead of a 400 to each client."""
    settings = {**defaults, "max_new_tokens": 1, "chat": False}
    uses = drafter is not None and drafts_with_model(GenerateConfig.from_settings(**settings))
    generate([0], model, drafter=drafter if uses else None, progress=False, **settings)


def create_app(model, drafter=None, settings: ServeSettings | None = None, worker: Worker | None = None) -> FastAPI:
    """The app for one loaded model (and optional drafter). `worker` may be given (tests wrap it).

    app.state: worker, metrics, model, settings, defaults (the request defaults, `chat` left out),
    served (the model id clients use), created (when the app was made, for /v1/models) and fim (the
    model's fill-in-the-middle tokens, or None)."""
    settings = settings or ServeSettings()
    metrics = Metrics()
    worker = worker or Worker(model, drafter, settings.max_queue, max_batch=settings.max_batch, kv_budget=settings.kv_budget,
                              prefix_cache=settings.prefix_cache)
    worker.on_depth = metrics.depth
    metrics.watch(worker)
    defaults = dict(settings.defaults)
    defaults.pop("chat", None)
    GenerateConfig.from_settings(**defaults).validate()
    check_serving(model, drafter, defaults)

    app = FastAPI(title="viasd", docs_url=None, redoc_url=None, openapi_url=None)
    state = app.state
    state.worker, state.metrics, state.model, state.settings, state.defaults = worker, metrics, model, settings, defaults
    state.served, state.created = settings.served_name or model.name, int(time.time())
    state.fim = fim_tokens(model.tokenizer)  # the model's fill-in-the-middle tokens, or None
    install(app, settings)  # the token and size checks, the exception handlers
    app.include_router(info_router)
    app.include_router(completions_router)
    app.include_router(routes_responses.router)  # OpenAI's /v1/responses
    app.include_router(routes_messages.router)  # Anthropic's /v1/messages
    app.include_router(routes_ollama.router)  # Ollama's /api/...
    app.include_router(routes_infill.router)  # llama.cpp's /infill
    install_page(app)  # GET / (the chat page) and /static/...
    return app


def build_app(model_name: str, drafter_name: str | None, settings, weights: str = "native", device: str = "cpu",
              progress: bool = False, drafter_weights: str | None = None):
    """Load the model (and drafter: `loading.load_drafter`) by name, then the app over them (`viasd
    serve`, each Ray Serve replica)."""
    from viasd.models.loading import load_drafter, load_model

    model = load_model(model_name, weights=weights, device=device, progress=progress)
    drafter = load_drafter(drafter_name, weights, drafter_weights, device, progress) if drafter_name else None
    return create_app(model, drafter, settings)
