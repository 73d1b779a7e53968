"""The chat page: GET / (static/index.html) and its script, style and vendored libraries under /static/
(static/vendor: marked and DOMPurify, see its README). Served without the API key (middleware.public):
the page holds nothing of the server's, and asks for the key when the API answers 401. Its content
security policy lets it load and call nothing but this server."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent / "static"
# no inline script, no other origin; images only from here or data: (a model's Markdown cannot make the
# browser fetch anything elsewhere)
POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
          "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": POLICY, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}

router = APIRouter()


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def page():
    return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8", headers=HEADERS)


def install_page(app: FastAPI) -> None:
    """GET / and /static/... on `app`."""
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
