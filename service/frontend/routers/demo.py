"""GET /: a small demo page (vanilla HTML, CSS and JS in service/frontend/static; no build step, no CDN).

The page calls the public API from the browser: ``/models`` for the models, their names and labels,
``/models/{name}/predict`` (multipart) for the top classes and ``/models/{name}/attention`` (multipart
field ``format=png``) for the overlay, on the model the person picks. The page itself needs no API key; when the service has one, the page asks for it and
sends it as ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

STATIC = Path(__file__).resolve().parent.parent / "static"

# The page loads nothing from elsewhere: scripts, styles and images come from this origin (images also
# from blob: URLs the page makes from its own uploads and from /attention's PNG).
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob: data:; "
        "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}

router = APIRouter(tags=["demo"], include_in_schema=False)


def _file(name: str, media_type: str) -> FileResponse:
    return FileResponse(STATIC / name, media_type=media_type, headers=_HEADERS)


@router.get("/")
async def index() -> FileResponse:
    return _file("index.html", "text/html; charset=utf-8")


@router.get("/static/demo.js")
async def script() -> FileResponse:
    return _file("demo.js", "text/javascript; charset=utf-8")


@router.get("/static/demo.css")
async def stylesheet() -> FileResponse:
    return _file("demo.css", "text/css; charset=utf-8")
