"""The interactive API docs, /docs (Swagger UI) and /redoc, from assets on this server.

FastAPI's own pages load Swagger UI and ReDoc from a public CDN, unpinned and without integrity checks:
broken on an offline host, and an API key typed into "Authorize" would be readable by a third-party
script. The assets here come from the pinned ``fastapi-offline`` package (Swagger UI 5.32.6 and
ReDoc's standalone bundle, as files in its wheel), are served from ``/docs/assets/``, and the pages
carry a Content-Security-Policy that lets them load nothing from anywhere else. ``VITSERVE_DOCS=false``
turns the pages off.
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse

from service.settings import ServerSettings

ASSETS_URL = "/docs/assets"
_ASSETS_DIR = Path(fastapi_offline.__file__).parent / "static"
# The only files served: a fixed table, nothing from the request becomes a path.
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "redoc.standalone.js": "text/javascript",
    "favicon.png": "image/png",
}
# Inline scripts and styles are the pages' own (FastAPI's templates); ReDoc runs a worker from a blob.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; connect-src 'self'; "
    "frame-ancestors 'none'"
)


def install_docs(app: FastAPI, server: ServerSettings) -> None:
    """Add /docs, /redoc and their assets to ``app`` (created with ``docs_url=None`` and
    ``redoc_url=None``), unless ``server.docs`` is off."""
    if not server.docs:
        return
    openapi_url = app.openapi_url or "/openapi.json"
    favicon = f"{ASSETS_URL}/favicon.png"
    # The pages depend on nothing in the request: rendered once, here.
    swagger_ui = get_swagger_ui_html(
        openapi_url=openapi_url,
        title=f"{app.title} - Swagger UI",
        swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js",
        swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
        swagger_favicon_url=favicon,
        swagger_ui_parameters={"validatorUrl": None},  # no call to the public validator service
    )
    redoc = get_redoc_html(
        openapi_url=openapi_url,
        title=f"{app.title} - ReDoc",
        redoc_js_url=f"{ASSETS_URL}/redoc.standalone.js",
        redoc_favicon_url=favicon,
        with_google_fonts=False,
    )
    _add_page(app, "/docs", bytes(swagger_ui.body))
    _add_page(app, "/redoc", bytes(redoc.body))
    for name, media_type in ASSETS.items():
        _add_asset(app, name, media_type)


def _add_page(app: FastAPI, path: str, html: bytes) -> None:
    @app.get(path, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(html, headers={"Content-Security-Policy": CONTENT_SECURITY_POLICY})


def _add_asset(app: FastAPI, name: str, media_type: str) -> None:
    path = _ASSETS_DIR / name

    @app.get(f"{ASSETS_URL}/{name}", include_in_schema=False)
    async def asset() -> FileResponse:
        return FileResponse(
            path, media_type=media_type, headers={"Cache-Control": "public, max-age=86400"}
        )
