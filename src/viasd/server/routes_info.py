"""GET /health, /metrics and /v1/models; POST /tokenize and /detokenize (llama-server's shapes)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError

from viasd.decoding.registry import DEFAULT_STRATEGY, STRATEGIES, Mode
from viasd.routing.resolve import resolve_route
from viasd.server.errors import APIError, validation_error
from viasd.server.parsing import read_json
from viasd.server.schemas import Strict
from viasd.settings import DRAFT_KINDS, MODES

router = APIRouter()


class TokenizeRequest(Strict):
    content: str
    add_special: bool = False  # the tokenizer's own special tokens around the text (a BOS)
    with_pieces: bool = False  # each id with its text (its bytes as a list where they are not UTF-8)
    model: str | None = None


class DetokenizeRequest(Strict):
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=1 << 20)]
    model: str | None = None


async def _body(request: Request, cls):
    state = request.app.state
    try:
        req = cls.model_validate(await read_json(request, state.settings.max_body_bytes))
    except ValidationError as e:
        raise validation_error(e) from None
    if req.model is not None and req.model != state.served:
        raise APIError(404, f"the model {req.model!r} does not exist here; this server has {state.served!r}",
                       param="model", code="model_not_found")
    return req, state.model


@router.post("/tokenize")
async def tokenize(request: Request):
    req, model = await _body(request, TokenizeRequest)
    ids = list(model.tokenizer(req.content, add_special_tokens=req.add_special)["input_ids"])
    if not req.with_pieces:
        return {"tokens": ids}
    pieces = model.vocabulary.pieces

    def piece(i: int):
        try:
            return pieces[i].decode("utf-8")
        except UnicodeDecodeError:  # part of a character: its bytes, as llama-server gives them
            return list(pieces[i])

    return {"tokens": [{"id": i, "piece": piece(i)} for i in ids]}


@router.post("/detokenize")
async def detokenize(request: Request):
    req, model = await _body(request, DetokenizeRequest)
    bad = next((t for t in req.tokens if t >= model.config.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary (0..{model.config.vocab_size - 1})", param="tokens",
                       code="invalid_value")
    return {"content": model.tokenizer.decode(req.tokens, skip_special_tokens=False)}


@router.get("/health")
async def health(request: Request):
    if request.app.state.worker.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics")
async def metrics_route(request: Request):
    return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def models(request: Request):
    state = request.app.state
    entry = {"id": state.served, "object": "model", "created": state.created, "owned_by": "viasd", "viasd": served_options(state)}
    return {"object": "list", "data": [entry]}


def served_options(state) -> dict:
    """What a request to this server may choose (the `viasd` object of /v1/models): the strategies, the
    drafter loaded (a request drafts with it by `draft: "model"`), and the routes a request runs unless it
    names its own layers (`slim_layers`, `draft_layers`)."""
    d, model = state.defaults, state.model
    drafter = state.worker.drafter
    routes = []
    for role, layers, file in (("slim", d.get("slim_layers"), d.get("slim_route")), ("draft", d.get("draft_layers"), d.get("draft_route"))):
        mask = resolve_route(model, role, layers, file).mask
        routes.append({"name": role, "fraction": round(mask.fraction, 4),
                       "attention": [i for i, a in enumerate(mask.attn) if a], "mlp": [i for i, m in enumerate(mask.mlp) if m]})
    return {"strategies": list(STRATEGIES), "default_strategy": d.get("strategy", DEFAULT_STRATEGY), "modes": list(MODES),
            "default_mode": d.get("mode", Mode.LOSSLESS.value), "draft_kinds": list(DRAFT_KINDS),
            "drafter": drafter.name if drafter is not None else None, "layers": model.config.n_layers, "routes": routes}
