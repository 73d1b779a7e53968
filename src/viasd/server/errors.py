"""OpenAI-style error bodies (`{"error": {"message", "type", "param", "code"}}`) and the APIError
each failure becomes: engine errors, request validation, requests the server ended."""

from __future__ import annotations

from collections.abc import Callable

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from viasd.errors import UsageError, ViasdError
from viasd.server.engine import Job


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = status, message, type_, param, code, headers


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# the error body of another dialect's routes, by path prefix (routes_ollama.py, routes_infill.py register theirs)
DIALECT_ERRORS: dict[str, Callable[[APIError], dict]] = {}


def error_response(e: APIError, path: str = "") -> JSONResponse:
    shape = next((f for prefix, f in DIALECT_ERRORS.items() if path.startswith(prefix)), None)
    body = shape(e) if shape is not None else error_body(e.message, e.type, e.param, e.code)
    return JSONResponse(body, status_code=e.status, headers=e.headers)


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


def validation_error(e: ValidationError) -> APIError:
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
