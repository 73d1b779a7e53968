"""GET /health, /metrics and /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

router = APIRouter()


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
    return {"object": "list", "data": [{"id": state.served, "object": "model", "created": state.created, "owned_by": "viasd"}]}
