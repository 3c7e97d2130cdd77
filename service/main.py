"""The FastAPI app: ``uvicorn service.main:app``. Creating the app loads nothing; the lifespan does."""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from service.docs import install_docs
from service.errors import install_error_handlers
from service.inputs import json_limits
from service.metrics import Metrics
from service.middleware import RequestContextMiddleware
from service.oip import repository as oip_repository
from service.oip import routes as oip
from service.oip.schemas import InferRequest
from service.routers import attention, demo, health, metrics, models, predict
from service.schemas import AttentionRequest, PredictRequest
from service.settings import Settings
from service.state import ServiceState

__version__ = "0.1.0"

DESCRIPTION = """\
Classifies images with a Vision Transformer exported to ONNX, on onnxruntime, with dynamic batching.

Errors are JSON `{"error": {"code", "message", "field", "request_id"}}`; every response carries
`X-Request-ID` (yours, when you send one).
"""


def _configure_logging(level: str) -> None:
    logger = logging.getLogger("vitserve")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)-9s vitserve: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The generated document, plus the JSON request bodies the routes parse themselves."""
    if app.openapi_schema:
        return app.openapi_schema
    document = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for model in (PredictRequest, AttentionRequest, InferRequest):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    app.openapi_schema = document
    return document


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    _configure_logging(settings.log_level)
    app_metrics = Metrics()
    state = ServiceState(settings, app_metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(
        title="vitserve",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,  # service/docs.py serves the docs from local assets
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.metrics = app_metrics
    app.state.service = state
    install_error_handlers(app)
    routers = [
        predict.router,
        attention.router,
        models.router,
        health.router,
        metrics.router,
        oip.router,
        oip_repository.router,
        demo.router,
    ]
    routers.append(oip.not_in_protocol_route(routers))
    for router in routers:
        app.include_router(router)
    install_docs(app, settings)
    app.add_middleware(
        RequestContextMiddleware,
        max_body_bytes=settings.max_body_bytes,
        metrics=app_metrics,
        json_limits=json_limits(settings),
        static_paths=frozenset(
            route.path for router in routers for route in router.routes if "{" not in route.path
        ),
    )
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


app = create_app()
