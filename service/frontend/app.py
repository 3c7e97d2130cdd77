"""The FastAPI app of a front end, given the engine it calls (``service/link/client.py``'s
``EngineClient``): the engine process's link, or the engine in this process, which
``service/launcher/local_app.py`` builds (this package never imports ``service/engine/``). Creating
the app loads nothing; the lifespan does."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute

from service.frontend.docs import install_docs
from service.frontend.error_responses import install_error_handlers
from service.frontend.hot_routes import HotRoutes, check_hot_routes
from service.frontend.inputs import json_limits
from service.frontend.middleware import RequestContextMiddleware
from service.frontend.oip import extensions as oip_extensions
from service.frontend.oip import repository as oip_repository
from service.frontend.oip import routes as oip
from service.frontend.oip.grpc_service import GrpcServer
from service.frontend.oip.schemas import HEADER_LENGTH, InferRequest
from service.frontend.routers import attention, demo, health, metrics, models, predict, shadow
from service.frontend.schemas import AttentionRequest, PredictRequest
from service.frontend.security import OPENAPI_SECURITY, SECURITY_SCHEMES, require_api_key
from service.frontend.state import FrontendState
from service.link.client import EngineClient
from service.observability import logs, tracing
from service.observability.metrics import Metrics
from service.settings import Settings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

__version__ = "0.1.0"

# The groups of /docs and /redoc, in this order: what most users call first.
TAGS = [
    {"name": "inference", "description": "Classify images and see the model's attention."},
    {"name": "models", "description": "The models served, their versions and settings."},
    {"name": "health", "description": "Liveness and readiness probes."},
    {"name": "metrics", "description": "Prometheus metrics."},
    {
        "name": "open inference protocol",
        "description": "KServe v2 / Triton: health, metadata, infer, statistics, configuration.",
    },
    {"name": "model repository", "description": "Triton's model repository extension."},
]

DESCRIPTION = """\
Classifies images with a Vision Transformer exported to ONNX, on onnxruntime, with dynamic batching.

Errors are JSON `{"error": {"code", "message", "field", "request_id"}}`; every response carries
`X-Request-ID` (yours, when you send one).
"""


def operation_id(route: APIRoute) -> str:
    """A stable operation id: the route's name, ``v2_`` before the Open Inference Protocol's,
    ``_version`` after the one-version form (``model_ready``, ``v2_model_ready_version``)."""
    name = route.name
    if "{version}" in route.path_format and not name.endswith("_version"):
        name += "_version"
    return f"v2_{name}" if route.path_format.startswith("/v2") else name


def _openapi(app: FastAPI, routers: list[APIRouter]) -> dict[str, Any]:
    """The generated document, plus the JSON request bodies the routes parse themselves and the
    bearer scheme on every route that needs the API key."""
    if app.openapi_schema:
        return app.openapi_schema
    document = get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=app.routes,
        tags=app.openapi_tags,
    )
    components = document.setdefault("components", {})
    components["securitySchemes"] = SECURITY_SCHEMES
    # the routes behind the require_api_key dependency (the inference routes declare it themselves)
    for router in routers:
        for route in router.routes:
            needs_key = [*router.dependencies, *getattr(route, "dependencies", [])]
            if isinstance(route, APIRoute) and any(
                d.dependency is require_api_key for d in needs_key
            ):
                for method in route.methods:
                    document["paths"][route.path_format][method.lower()].update(OPENAPI_SECURITY)
    schemas = components.setdefault("schemas", {})
    for model in (PredictRequest, AttentionRequest, InferRequest):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    order = [tag["name"] for tag in TAGS]
    document["paths"] = dict(  # the order of /docs' groups; sorted() keeps each group's own order
        sorted(
            document["paths"].items(),
            key=lambda path: min(
                order.index(tag) if tag in order else len(order)
                for operation in path[1].values()
                for tag in operation.get("tags", [None])
            ),
        )
    )
    app.openapi_schema = document
    return document


def create_app(
    settings: Settings,
    engine: EngineClient,
    tracer_provider: TracerProvider | None = None,
    worker: int | None = None,
    process_metrics: Metrics | None = None,
) -> FastAPI:
    """The app, calling ``engine``: a front end of ``python -m service`` gets its link to the engine
    process, a single process the engine in it (``service/launcher/local_app.py``, built with the
    same ``process_metrics``). Tracing follows the OTEL_* environment variables
    (service/observability/tracing.py), unless a ``tracer_provider`` is given (tests give one with an
    in-memory exporter)."""
    logs.configure(settings.server.log_level, settings.server.log_format)
    app_metrics = process_metrics or Metrics()
    state = FrontendState(settings, app_metrics, engine, worker)
    provider = tracer_provider or tracing.provider_from_environment(os.environ)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tracing.activate(provider)
        try:
            await state.start()
            grpc_server = GrpcServer(state, app.version) if settings.server.grpc_port else None
            try:
                if grpc_server is not None:
                    await grpc_server.start()
                yield
            finally:
                state.begin_shutdown()  # not ready over either protocol from here on
                stopping = [state.stop()]
                if grpc_server is not None:  # refuses new calls, lets those in flight finish
                    stopping.append(grpc_server.stop(settings.server.graceful_shutdown_s))
                await asyncio.gather(*stopping)
        finally:
            tracing.activate(None)
            if tracer_provider is None and provider is not None:
                provider.shutdown()  # exports what is left

    app = FastAPI(
        title="vitserve",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,  # service/frontend/docs.py serves the docs from local assets
        redoc_url=None,
        openapi_tags=TAGS,
        generate_unique_id_function=operation_id,
        # FastAPI's own telemetry off: the HTTP spans come from opentelemetry-instrumentation-fastapi
        # (tracing.py), which a global tracer provider would make it duplicate, and it looks for
        # one on every request
        telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
    )
    app.state.settings = settings
    app.state.metrics = app_metrics
    app.state.frontend = state
    install_error_handlers(app)
    routers = [
        oip_extensions.router,  # before oip.router: /v2/models/stats is not model "stats"
        predict.router,
        attention.router,
        models.router,
        shadow.router,
        health.router,
        metrics.router,
        oip.router,
        oip_repository.router,
        demo.router,
    ]
    routers.append(oip.not_in_protocol_route(routers))
    for router in routers:
        app.include_router(router)
    install_docs(app, settings.server)
    check_hot_routes(route for router in routers for route in router.routes)
    app.add_middleware(HotRoutes, handlers=app.exception_handlers)  # the innermost middleware
    app.add_middleware(
        RequestContextMiddleware,
        max_body_bytes=settings.limits.max_body_bytes,
        metrics=app_metrics,
        json_limits=json_limits(settings.limits),
        static_paths=frozenset(
            route.path for router in routers for route in router.routes if "{" not in route.path
        ),
    )
    if (
        settings.server.cors_origin_list
    ):  # outermost: preflights and early 413s get CORS headers too
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.server.cors_origin_list,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-ID", "Retry-After", HEADER_LENGTH],
        )
    if provider is not None:
        tracing.instrument(app, provider)
    app.openapi = lambda: _openapi(app, routers)  # type: ignore[method-assign]
    return app
